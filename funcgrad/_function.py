"""f as torch.func sees it: a function of a flat tuple of tensors returning a flat tuple.

Inputs and outputs are flattened with optree at this boundary (see ``_tree``), and every
check on them is made here so that the user gets one clear message, not autograd's.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import _tree
from ._errors import FuncgradWarning, describe, first_line

Tensors = tuple[torch.Tensor, ...]

# Messages of torch.func failures on graphs that plain autograd can still differentiate.
_TORCH_FUNC_LIMITS = (
    "In order to use an autograd.Function with functorch transforms",
    "Cannot access data pointer of Tensor that doesn't have storage",
    "Cannot access storage of TensorWrapper",
)
# f updates a captured tensor in place (BatchNorm's running statistics in training mode):
# torch.func refuses it at the first in-place op, before anything is mutated.
_MUTATES_CAPTURED = "would mutate a captured Tensor"

# Messages of forward-mode AD that cannot differentiate an op that reverse mode can.
_FORWARD_MODE_LIMITS = (
    "forward AD",
    "forward mode AD",
    "jvp function for custom autograd.Function",
    "jvp is not implemented",
    "the derivative for",
    _MUTATES_CAPTURED,
    *_TORCH_FUNC_LIMITS,
)


def is_forward_mode_limit(error: BaseException) -> bool:
    """Whether forward mode (not the user's code) failed, so that reverse mode may succeed."""
    return isinstance(error, (RuntimeError, NotImplementedError)) and any(
        limit in str(error) for limit in _FORWARD_MODE_LIMITS
    )


def is_torch_func_limit(error: BaseException) -> bool:
    """Whether torch.func (not vmap alone) failed on f, so that only eager autograd can help."""
    message = str(error)
    return (
        "In order to use an autograd.Function with functorch transforms" in message
        or _MUTATES_CAPTURED in message
    )


def normalize_argnums(argnums: object, nargs: int, call: str) -> tuple[int, ...]:
    """``argnums`` as a tuple of non-negative ints, checked against the number of arguments."""
    items = argnums if isinstance(argnums, tuple) else (argnums,)
    if not items or not all(isinstance(a, int) and not isinstance(a, bool) for a in items):
        raise TypeError(
            f"{call}: `argnums` must be an int or a non-empty tuple of ints, got {argnums!r}."
        )
    result = []
    for a in items:
        if not -nargs <= a < nargs:
            raise ValueError(
                f"{call}: `argnums` entry {a} is out of range: f was called with {nargs} "
                f"positional argument(s), so argnums must lie in [{-nargs}, {nargs - 1}]."
            )
        result.append(a % nargs)
    if len(set(result)) != len(result):
        raise ValueError(
            f"{call}: `argnums` {argnums!r} names the same argument twice; list each once."
        )
    return tuple(result)


def check_primal_leaves(
    leaves: Sequence[Any], treedef: Any, what: str, call: str, hint: str
) -> None:
    if not leaves:
        raise ValueError(f"{call}: {what} contains no tensor to differentiate.")
    for index, leaf in enumerate(leaves):
        if not _tree.is_differentiable(leaf):
            path = _tree.leaf_path(treedef, index)
            raise TypeError(
                f"{call}: {what}, leaf {path}, must be a floating-point or complex tensor to be "
                f"differentiated, got {describe(leaf)}. Convert it with .float() or .double(), "
                f"or {hint}."
            )


def outside_transforms(leaves: Sequence[torch.Tensor]) -> bool:
    """Whether no leaf is a functorch wrapper, i.e. we are not inside vmap/grad/jvp."""
    return not any(torch._C._functorch.is_functorch_wrapped_tensor(t) for t in leaves)


def values_readable(leaves: Sequence[torch.Tensor]) -> bool:
    """Whether data-dependent Python (``bool(t)``, ``.item()``) may look at these tensors:
    eager mode, outside torch.func transforms and outside a compiled region."""
    # is_compiling first: dynamo cannot trace is_functorch_wrapped_tensor.
    return not torch.compiler.is_compiling() and outside_transforms(leaves)


class FlatFunction:
    """``f(*args)`` as a function of the flat leaves of the arguments in ``argnums``."""

    def __init__(
        self,
        f: Callable[..., Any],
        args: Sequence[Any],
        argnums: tuple[int, ...],
        has_aux: bool,
        call: str,
        hint: str = "pass it through a non-differentiated argument (see `argnums`)",
    ) -> None:
        self.f, self.args, self.argnums, self.has_aux, self.call = (
            f,
            list(args),
            argnums,
            has_aux,
            call,
        )
        self.in_defs: list[Any] = []
        self.counts: list[int] = []
        flat_leaves: list[torch.Tensor] = []
        for a in argnums:
            leaves, treedef = _tree.flatten(args[a])
            check_primal_leaves(leaves, treedef, f"argument {a}", call, hint)
            self.in_defs.append(treedef)
            self.counts.append(len(leaves))
            flat_leaves.extend(leaves)
        self.leaves: Tensors = tuple(flat_leaves)
        self.out_def: Any = None
        self._aux_def: Any = None
        self._aux_static: list[Any] = []

    def split_inputs(self, leaves: Sequence[Any]) -> list[Any]:
        """Flat input leaves (or gradients of them) back into one tree per argnum."""
        trees, start = [], 0
        for treedef, count in zip(self.in_defs, self.counts):
            trees.append(_tree.unflatten(treedef, leaves[start : start + count]))
            start += count
        return trees

    def __call__(self, *leaves: torch.Tensor) -> Any:
        args = list(self.args)
        for a, tree in zip(self.argnums, self.split_inputs(leaves)):
            args[a] = tree
        result = self.f(*args)
        if self.has_aux:
            if not (isinstance(result, tuple) and len(result) == 2):
                raise TypeError(
                    f"{self.call}: with has_aux=True, f must return a pair (output, aux), got "
                    f"{describe(result)}. Return `out, aux` or pass has_aux=False."
                )
            result, aux = result
        out_leaves, self.out_def = _tree.flatten(result)
        if not out_leaves:
            raise TypeError(f"{self.call}: f returned no tensor (got {describe(result)}).")
        for index, leaf in enumerate(out_leaves):
            if not _tree.is_differentiable(leaf):
                path = _tree.leaf_path(self.out_def, index)
                raise TypeError(
                    f"{self.call}: f's output, leaf {path}, must be a floating-point or complex "
                    f"tensor, got {describe(leaf)}. Return only differentiable tensors from f "
                    "and put anything else in aux (has_aux=True)."
                )
        if not self.has_aux:
            return tuple(out_leaves)
        # torch.func carries only tensors as aux; the rest is kept here, it has no level.
        aux_leaves, self._aux_def = _tree.flatten(aux)
        self._aux_static = [None if isinstance(x, torch.Tensor) else x for x in aux_leaves]
        return tuple(out_leaves), tuple(x for x in aux_leaves if isinstance(x, torch.Tensor))

    def rebuild_aux(self, tensors: Sequence[torch.Tensor]) -> Any:
        it = iter(tensors)
        return _tree.unflatten(
            self._aux_def, [next(it) if x is None else x for x in self._aux_static]
        )

    def outputs(self, out_leaves: Sequence[torch.Tensor]) -> Any:
        return _tree.unflatten(self.out_def, out_leaves)


def autograd_grad(
    outputs: Any, inputs: Tensors, cotangents: Any, retain_graph: bool, create_graph: bool = False
) -> Tensors:
    """``torch.autograd.grad`` with zeros, not None, for inputs the outputs do not reach."""
    grads = torch.autograd.grad(
        outputs,
        inputs,
        cotangents,
        retain_graph=retain_graph,
        create_graph=create_graph,
        allow_unused=True,
    )
    return tuple(torch.zeros_like(x) if g is None else g for g, x in zip(grads, inputs))


def _eager_vjp(flat: FlatFunction) -> tuple[Tensors, Callable[[Tensors], Tensors], Tensors]:
    """The same contract as ``torch.func.vjp``, on plain autograd (one retained graph).

    ``vjp_fn`` can still be vmapped (``torch.func.vmap`` over ``torch.autograd.grad``, as
    TorchJD batches), so the directions are batched where the graph allows it."""
    inputs = tuple(leaf.detach().requires_grad_() for leaf in flat.leaves)
    with torch.enable_grad():
        result = flat(*inputs)
    out, aux = result if flat.has_aux else (result, ())

    def vjp_fn(cotangents: Tensors) -> Tensors:
        return autograd_grad(out, inputs, cotangents, retain_graph=True)

    return tuple(o.detach() for o in out), vjp_fn, tuple(a.detach() for a in aux)


def build_vjp(flat: FlatFunction) -> tuple[Tensors, Callable[[Tensors], Tensors], Tensors, bool]:
    """``torch.func.vjp`` of ``flat``; where torch.func cannot differentiate f but autograd
    can, the same on eager autograd with one warning. Returns (out, vjp_fn, aux, can_vmap)."""
    try:
        result = torch.func.vjp(flat, *flat.leaves, has_aux=flat.has_aux)
    except (RuntimeError, NotImplementedError) as error:
        mutates = _MUTATES_CAPTURED in str(error)
        limit = mutates or any(limit in str(error) for limit in _TORCH_FUNC_LIMITS)
        if not limit or not outside_transforms(flat.leaves):
            raise
        out, vjp_fn, aux = _eager_vjp(flat)
        if mutates:
            why = (
                "f updates a captured tensor in place, such as BatchNorm's running statistics "
                "in training mode; torch.func refuses that before anything is mutated. funcgrad "
                "ran f once on eager autograd instead (statistics updated once, gradients as "
                "autograd's, still batched with vmap where it can). To stay in torch.func: "
                "use eval mode, torch.func.replace_all_batch_norm_modules_(model), or pass "
                "the buffers to f explicitly"
            )
            warnings.warn(f"{flat.call}: {why}.", FuncgradWarning, stacklevel=4)
            return out, vjp_fn, aux, True
        warnings.warn(
            f"{flat.call}: torch.func cannot differentiate f ({first_line(error)}); "
            "fell back to eager torch.autograd.grad, one backward pass per direction. "
            "The answer is the same as autograd's; it is not batched and not composable with "
            "torch.func transforms.",
            FuncgradWarning,
            stacklevel=4,
        )
        return out, vjp_fn, aux, False
    if flat.has_aux:
        out, vjp_fn, aux = result  # type: ignore[misc]  # torch.func types the pair only
        return out, vjp_fn, aux, True
    out, vjp_fn = result  # type: ignore[misc]
    return out, vjp_fn, (), True
