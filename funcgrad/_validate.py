"""Argument validation, in one place: every check on a user's argument is made here, before
anything slow runs, with a message that names the call, the argument and the fix.

Also :func:`values_readable`, the one guard for data-dependent checks (``bool(t)``,
``.item()``): they run in eager mode only, never inside torch.func transforms or compiled code.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeGuard

import torch

from . import _tree
from ._errors import describe
from ._types import LEVELS, STRATEGIES, Tensors


def outside_transforms(leaves: Sequence[torch.Tensor]) -> bool:
    """Whether we are not inside vmap/grad/jvp: no torch.func transform is active (f may
    capture a transformed tensor while the leaves are plain), no leaf is a functorch
    wrapper, and funcgrad is not running an f on eager autograd to differentiate it (see
    :func:`differentiating`)."""
    return (
        not _differentiating.get()
        and torch._C._functorch.maybe_current_level() is None
        and not any(torch._C._functorch.is_functorch_wrapped_tensor(t) for t in leaves)
    )


_differentiating: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "funcgrad_differentiating", default=False
)


def differentiating() -> contextlib.AbstractContextManager[None]:
    """While funcgrad runs f or the heads on autograd to differentiate them: a funcgrad call
    inside counts as inside a transform (its results keep their graph, it reads no values).
    Nothing in compiled code, where dynamo cannot trace the context variable."""
    if torch.compiler.is_compiling():
        return contextlib.nullcontext()
    return _DifferentiatingBlock()


class _DifferentiatingBlock:
    """The context of :func:`differentiating`."""

    __slots__ = ("_token",)

    def __enter__(self) -> None:
        self._token = _differentiating.set(True)

    def __exit__(self, *exc: object) -> None:
        _differentiating.reset(self._token)


def values_readable(leaves: Sequence[torch.Tensor]) -> bool:
    """Whether data-dependent Python (``bool(t)``, ``.item()``) may look at these tensors:
    eager mode, outside torch.func transforms and outside a compiled region, on a device
    that holds values (not ``meta``: a dry run of shapes)."""
    # is_compiling first: dynamo cannot trace is_functorch_wrapped_tensor.
    return (
        not torch.compiler.is_compiling()
        and outside_transforms(leaves)
        and not any(t.is_meta for t in leaves)
    )


def check_not_inference_mode(call: str) -> None:
    """The heads' gradients are taken on autograd, which records nothing in inference mode
    (their gradients would come out zero, or autograd would raise)."""
    if not torch.compiler.is_compiling() and torch.is_inference_mode_enabled():
        raise RuntimeError(
            f"{call}: cannot run inside torch.inference_mode(), where autograd records "
            "nothing to differentiate. Call it outside that block (torch.no_grad() is fine: "
            "funcgrad differentiates f and the heads whatever the grad mode)."
        )


def check_flag(value: object, name: str, call: str) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{call}: `{name}` must be True or False, got {describe(value)}.")


def check_callable(f: object, name: str, call: str) -> None:
    if not callable(f):
        raise TypeError(f"{call}: `{name}` must be callable, got {describe(f)}.")


def is_count(value: object) -> TypeGuard[int]:
    """Whether ``value`` is a positive int (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_chunk_size(chunk_size: object, call: str) -> None:
    if chunk_size != "auto" and chunk_size is not None and not is_count(chunk_size):
        raise ValueError(
            f"{call}: `chunk_size` must be None (all at once), a positive int (1 means a "
            f"loop) or 'auto' (the most that fit the memory budget), got {chunk_size!r}."
        )


def check_strategy(strategy: object, call: str) -> None:
    if strategy not in STRATEGIES:
        raise ValueError(
            f"{call}: unknown `strategy` {strategy!r}; "
            f"expected one of {', '.join(map(repr, STRATEGIES))}."
        )


def check_level(level: object, call: str) -> None:
    if level not in LEVELS:
        raise ValueError(
            f"{call}: unknown `level` {level!r}; expected 'params' (exact Jacobian descent on "
            "the shared parameters) or 'features' (the Gramian of the task gradients with "
            "respect to `through`, one backward through the shared part)."
        )


def check_argnums_type(argnums: object, call: str) -> None:
    if not isinstance(argnums, (int, tuple)) or isinstance(argnums, bool):
        raise TypeError(f"{call}: `argnums` must be an int or a tuple of ints, got {argnums!r}.")


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


def as_tensors(value: Any, name: str, call: str, *, rows: bool = False) -> Tensors:
    """A tensor or a non-empty sequence (or generator) of tensors that require grad; with
    ``rows``, a 1-D tensor is its entries (``torch.stack(losses)`` is k losses)."""
    if isinstance(value, torch.Tensor) and rows and value.dim() == 1:
        items: Any = tuple(value.unbind())
    elif isinstance(value, torch.Tensor):
        items = (value,)
    elif isinstance(value, Iterable) and not isinstance(value, (str, bytes, Mapping)):
        items = tuple(value)  # a generator, such as model.parameters()
    else:
        items = ()
    if not items:
        raise TypeError(
            f"{call}: `{name}` must be a tensor or a non-empty sequence of tensors, "
            f"got {describe(value)}."
        )
    for index, item in enumerate(items):
        if not isinstance(item, torch.Tensor):
            raise TypeError(f"{call}: `{name}`[{index}] must be a tensor, got {describe(item)}.")
        if not item.requires_grad:
            if not outside_transforms(items):  # (forward mode tracks no autograd graph)
                raise untracked(f"`{name}`[{index}]", call)
            raise ValueError(
                f"{call}: `{name}`[{index}] does not require grad, so it is in no graph. "
                + (
                    "Create it with requires_grad=True."
                    if name == "inputs"
                    else "Compute it from the inputs with gradients enabled."
                )
            )
    return tuple(items)


# What a reverse-mode pass cannot reach inside a torch.func transform: the part of the message
# of :func:`untracked` that ``_linearize.TORCH_LIMITS`` knows (f then runs on eager autograd).
UNTRACKED = "is not tracked by the torch.func transform"


def untracked(what: str, call: str) -> RuntimeError:
    """The error of a funcgrad call that runs a backward (``grads``, ``backward``, the
    per-example Gramian) inside a torch.func transform, on a tensor that transform does not
    track: one captured from outside it (a module's parameter: ``torch.autograd.grad``
    refuses it there too, "appears to not have been used in the graph"), or any tensor under
    forward mode (``jvp``, ``jacfwd``), which records no graph. Where funcgrad itself runs f
    under ``torch.func`` (``compose_heads``, ``combine_heads``, ``pullback``), it runs f on
    eager autograd instead, where the answer is autograd's."""
    return RuntimeError(
        f"{call}: {what} {UNTRACKED} this call runs inside (vmap, grad, vjp, jacrev, jvp, "
        "jacfwd, or an f that funcgrad differentiates with torch.func): a tensor captured from "
        "outside the transform (a module's parameter), or any tensor under forward mode (jvp, "
        "jacfwd), which records no graph to pull back through. torch.autograd.grad refuses it "
        "there too. Differentiate it with a nested transform instead (funcgrad.compose_heads "
        "or torch.func.grad with the tensor passed as a differentiated argument), or call "
        "this outside the transform."
    )


def check_scalar_outputs(outputs: Tensors, call: str, names: Sequence[str] | None = None) -> None:
    """Every output a real floating scalar (a loss, a head's value)."""
    for i, z in enumerate(outputs):
        if z.numel() == 1 and z.is_floating_point():  # (the usual case: no name to build)
            continue
        name = f"outputs[{i}]" if names is None else names[i]
        if z.numel() != 1:
            raise ValueError(
                f"{call}: {name} must be a scalar, got shape {tuple(z.shape)}. Reduce it "
                "(.sum() or .mean()) or pass one entry per scalar."
            )
        if z.is_complex() or not z.is_floating_point():
            raise TypeError(f"{call}: {name} must be a real floating scalar, got {z.dtype}.")


def named_inputs(inputs: Any, call: str) -> list[tuple[str, torch.Tensor]]:
    """``inputs`` as (name, leaf) pairs: tensors, or a mapping / ``named_parameters()`` pairs,
    so that messages can name a parameter."""
    pairs: list[tuple[str, torch.Tensor]]
    if isinstance(inputs, torch.nn.Module):
        pairs = [(f"inputs[{name!r}]", p) for name, p in inputs.named_parameters()]
    elif isinstance(inputs, Mapping):
        pairs = [(f"inputs[{key!r}]", value) for key, value in inputs.items()]
    elif isinstance(inputs, Iterable) and not isinstance(inputs, torch.Tensor):
        items = list(inputs)
        if items and all(isinstance(item, tuple) and len(item) == 2 for item in items):
            pairs = [(f"inputs[{name!r}]", value) for name, value in items]
        else:
            tensors = as_tensors(items, "inputs", call)
            pairs = [(f"inputs[{i}]", x) for i, x in enumerate(tensors)]
    else:
        pairs = [("inputs[0]", x) for x in as_tensors(inputs, "inputs", call)]
    if not pairs:
        raise ValueError(f"{call}: `inputs` is empty; give the shared parameters, or None.")
    for name, x in pairs:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{call}: {name} must be a tensor, got {describe(x)}.")
        if not (x.requires_grad and x.is_leaf):
            raise ValueError(
                f"{call}: {name} must be a leaf tensor that requires grad (a parameter), "
                f"got {describe(x)} with requires_grad={x.requires_grad}, is_leaf={x.is_leaf}."
            )
    return pairs


def tolerances(dtype: torch.dtype) -> tuple[float, float]:
    if dtype in (torch.float64, torch.complex128):
        return 1e-9, 1e-12
    if dtype in (torch.float16, torch.bfloat16):
        return 2e-2, 1e-3
    return 1e-4, 1e-6


def mismatch(batched: Tensors, reference: Tensors, index: int) -> str | None:
    """Where the batched result's row ``index`` differs from an unbatched call's result,
    if anywhere (within the dtype's tolerance, relative to the reference's scale)."""
    for j, (b, r) in enumerate(zip(batched, reference)):
        rtol, atol = tolerances(r.dtype)
        scale = r.abs().nan_to_num(0.0, 0.0, 0.0).max().item() if r.numel() else 0.0
        if not torch.allclose(b[index], r, rtol=rtol, atol=atol * max(scale, 1.0), equal_nan=True):
            diff = (b[index] - r).abs().max().item()
            return f"output {j} of direction {index} differs by up to {diff:.3g}"
    return None
