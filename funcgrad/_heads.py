"""``funcgrad.compose_heads`` and ``funcgrad.stacked_heads``: many cheap heads on one slow f."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, Literal, TypeVar, overload

import torch

from . import _coords, _engine, _tree
from ._config import CheckMode, resolve_check
from ._errors import FuncgradWarning, describe, first_line
from ._function import (
    FlatFunction,
    build_vjp,
    is_torch_func_limit,
    normalize_argnums,
    values_readable,
)
from ._plan import STRATEGIES, Plan, make_plan
from ._pullback import check_chunk_size

Tensors = tuple[torch.Tensor, ...]
R = TypeVar("R")


class StackedHeads:
    """k heads ``y -> head_fn(params_j, y)`` that share one function; see :func:`stacked_heads`."""

    def __init__(self, head_fn: Callable[[Any, Any], torch.Tensor], params: Any) -> None:
        call = "stacked_heads(head_fn, params)"
        if not callable(head_fn):
            raise TypeError(f"{call}: `head_fn` must be callable, got {describe(head_fn)}.")
        leaves, self.params_def = _tree.flatten(params)
        if not leaves:
            raise ValueError(f"{call}: `params` contains no tensor; give leaves with a leading k.")
        sizes = set()
        for index, leaf in enumerate(leaves):
            path = _tree.leaf_path(self.params_def, index)
            if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0:
                raise ValueError(
                    f"{call}: `params` leaf {path} must be a tensor with a leading dimension k "
                    f"(one slice per head), got {describe(leaf)}."
                )
            sizes.add(leaf.shape[0])
        if len(sizes) != 1:
            raise ValueError(
                f"{call}: every `params` leaf must have the same leading size k (one per head), "
                f"got sizes {sorted(sizes)}."
            )
        self.head_fn, self.params = head_fn, tuple(leaves)
        self.k = sizes.pop()

    def __len__(self) -> int:
        return self.k

    def __repr__(self) -> str:
        return f"stacked_heads({getattr(self.head_fn, '__name__', self.head_fn)!r}, k={self.k})"


def stacked_heads(head_fn: Callable[[Any, Any], torch.Tensor], params: Any) -> StackedHeads:
    """k heads that are one function with k sets of parameters, for :func:`compose_heads`.

    Head j is ``y -> head_fn(params_j, y)``, where ``params_j`` takes slice j of every leaf of
    ``params``. :func:`compose_heads` evaluates all k head values and cotangents in one
    ``vmap`` instead of k Python calls.

    Args:
        head_fn: ``(p, y) -> real scalar`` for one head's parameters ``p``.
        params: a pytree whose tensor leaves all have a leading dimension k.

    Returns:
        A heads collection of length k.

    Example:
        >>> import torch, funcgrad
        >>> w = torch.randn(512, 64)
        >>> probes = funcgrad.stacked_heads(lambda w_j, y: torch.nn.functional.softplus(w_j @ y), w)
        >>> len(probes)
        512
    """
    return StackedHeads(head_fn, params)


def _normalize_heads(heads: object, call: str) -> tuple[list[Any] | None, Any]:
    """(keys or None, heads): a list of callables, or a StackedHeads."""
    if isinstance(heads, StackedHeads):
        return None, heads
    if isinstance(heads, Mapping):
        keys, fns = list(heads.keys()), list(heads.values())
    elif isinstance(heads, Sequence) and not isinstance(heads, (str, bytes)):
        keys, fns = None, list(heads)
    elif callable(heads):
        raise TypeError(
            f"{call}: `heads` must be a sequence or mapping of callables, got a single callable "
            f"{describe(heads)}. Wrap it in a list: heads=[head]."
        )
    else:
        raise TypeError(
            f"{call}: `heads` must be a sequence or a mapping of callables y -> scalar, or "
            f"funcgrad.stacked_heads(...), got {describe(heads)}."
        )
    if not fns:
        raise ValueError(f"{call}: `heads` is empty; give at least one head y -> scalar.")
    for index, fn in enumerate(fns):
        if not callable(fn):
            name = f"key {keys[index]!r}" if keys is not None else f"index {index}"
            raise TypeError(
                f"{call}: head at {name} must be callable y -> scalar, got {describe(fn)}."
            )
    return keys, fns


def _scalar(value: Any, where: str, call: str) -> torch.Tensor:
    """The head's output as a 0-dim real floating tensor, or a clear error."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{call}: {where} must return a real scalar tensor, got {describe(value)}.")
    if value.is_complex() or not value.is_floating_point():
        raise TypeError(
            f"{call}: {where} must return a real floating-point scalar, got dtype {value.dtype}. "
            + (
                "Take .real or .abs() of a complex value."
                if value.is_complex()
                else "Use .float()."
            )
        )
    if value.numel() != 1:
        raise ValueError(
            f"{call}: {where} must return a scalar, got shape {tuple(value.shape)}. "
            "Reduce it (.sum() or .mean()), or make one head per entry."
        )
    return value.reshape(())


def _head_cotangents(
    heads: Any, keys: list[Any] | None, flat: FlatFunction, out: Tensors, call: str
) -> tuple[torch.Tensor, Tensors]:
    """Each head's value and its gradient w.r.t. y: values (k,), cotangent leaves (k, ...).

    Head by head (they are cheap), or in one vmap for stacked heads: never the Jacobian of
    the stacked head values, which would cost O(k^2) head work.
    """
    out_def = flat.out_def
    if isinstance(heads, StackedHeads):

        def stacked_head(p: Tensors, y: Tensors) -> torch.Tensor:
            value = heads.head_fn(_tree.unflatten(heads.params_def, p), _tree.unflatten(out_def, y))
            return _scalar(value, "stacked head_fn", call)

        grads, values = torch.func.vmap(
            torch.func.grad_and_value(stacked_head, argnums=1), in_dims=(0, None)
        )(heads.params, out)
        return values, grads

    results = []
    for index, head in enumerate(heads):
        where = f"head {index}" if keys is None else f"head {keys[index]!r}"

        def one(y: Tensors, head: Callable[..., Any] = head, where: str = where) -> torch.Tensor:
            return _scalar(head(_tree.unflatten(out_def, y)), where, call)

        results.append(torch.func.grad_and_value(one)(out))
    values = torch.stack([value for _, value in results])
    grads = tuple(torch.stack([g[j] for g, _ in results]) for j in range(len(out)))
    return values, grads


def _chunks(total: int, chunk_size: int | None) -> list[tuple[int, int]]:
    step = total if chunk_size is None else chunk_size
    return [(start, min(start + step, total)) for start in range(0, total, step)]


def _forward_mode(
    flat: FlatFunction,
    chunk_size: int | None,
    check: CheckMode,
    head_cotangents: Callable[[Tensors], tuple[torch.Tensor, Tensors]],
) -> tuple[torch.Tensor, Tensors, Tensors, Tensors]:
    """jacfwd: JVPs along the n real unit directions of the inputs, chunk by chunk, each chunk
    reduced at once to its columns of ``V @ J``, so J is never held whole.

    Returns (values, f's output, aux tensors, grads); ``head_cotangents`` maps f's output to
    the head values and cotangents (called once, on the first chunk's output).
    """
    primals = flat.leaves

    def one(*tangent: torch.Tensor) -> Tensors:
        result: tuple[Any, ...] = torch.func.jvp(flat, primals, tangent, has_aux=flat.has_aux)
        out, tangent_out = result[0], result[1]
        aux = result[2] if flat.has_aux else ()
        return (*out, *tangent_out, *aux)

    columns: list[torch.Tensor] = []
    for start, stop in _chunks(_coords.real_size(primals), chunk_size):
        # Every output is batched (f's own as broadcast views): row 0 is f's output.
        stacked = _engine.batched(
            one,
            _coords.unit_rows(primals, start, stop),
            chunk_size=chunk_size,
            check=check,
            what="f's JVP",
        )
        n_out = flat.out_def.num_leaves  # known once f has run
        if not columns:
            out = tuple(s[0] for s in stacked[:n_out])
            aux = tuple(s[0] for s in stacked[2 * n_out :])
            values, cotangents = head_cotangents(out)
            coords = _coords.to_coords(cotangents, cotangents[0].shape[0])
        tangents = stacked[n_out : 2 * n_out]
        columns.append(coords @ _coords.to_coords(tangents, stop - start).T)
    grads = _coords.from_coords(torch.cat(columns, dim=1), primals)
    return values, out, aux, grads


def _jacobian_went_non_finite(grads: Tensors, out: Tensors) -> bool:
    """Whether V @ J produced inf/NaN, in eager mode only (it is a data-dependent check).

    A Jacobian row or column holds 0 * inf = NaN where autograd, pulling back the head's own
    cotangent, would give inf: such results are recomputed by pulling back the cotangents
    themselves, so that NaN/inf come out exactly as in autograd.
    """
    if not values_readable(out):
        return False
    # One reduction per leaf: NaN and inf survive a sum (an overflow to inf only costs a
    # needless, still correct, recomputation).
    return not all(bool(torch.isfinite(g.sum())) for g in grads)


def _try_forward(flat: FlatFunction, run: Callable[[], Any]) -> Any:
    """``run()`` (forward mode), or None where forward mode cannot differentiate f: then the
    caller uses reverse mode, which covers strictly more of PyTorch."""
    try:
        return run()
    except (RuntimeError, NotImplementedError) as error:
        if not is_torch_func_limit(error):  # that one is reported by build_vjp's fallback
            warnings.warn(
                f"{flat.call}: forward mode cannot differentiate f ({first_line(error)}); "
                "used reverse mode (jacrev) instead.",
                FuncgradWarning,
                stacklevel=4,
            )
        return None


def _validate(f: object, strategy: object, chunk_size: object, argnums: object, call: str) -> None:
    if not callable(f):
        raise TypeError(f"{call}: `f` must be callable, got {describe(f)}.")
    if strategy not in STRATEGIES:
        raise ValueError(
            f"{call}: unknown `strategy` {strategy!r}; "
            f"expected one of {', '.join(map(repr, STRATEGIES))}."
        )
    check_chunk_size(chunk_size, call)
    if not isinstance(argnums, (int, tuple)) or isinstance(argnums, bool):
        raise TypeError(f"{call}: `argnums` must be an int or a tuple of ints, got {argnums!r}.")


class ComposedHeads(Generic[R]):
    """The function returned by :func:`compose_heads`; call it with f's arguments."""

    def __init__(self, f, heads, argnums, has_aux, strategy, chunk_size, check) -> None:
        self.call = "compose_heads(f, heads)"
        _validate(f, strategy, chunk_size, argnums, self.call)
        self.keys, self.heads = _normalize_heads(heads, self.call)
        self.f, self.argnums, self.has_aux = f, argnums, has_aux
        self.strategy, self.chunk_size = strategy, chunk_size
        self.check = resolve_check(check, self.call) if check is not None else None
        functools.update_wrapper(self, f, updated=())

    @property
    def k(self) -> int:
        return len(self.heads)

    def _flat(self, args: Sequence[Any]) -> FlatFunction:
        argnums = normalize_argnums(self.argnums, len(args), self.call)
        return FlatFunction(self.f, args, argnums, self.has_aux, self.call)

    def plan(self, *args: Any) -> Plan:
        """The plan for these arguments. Runs f's forward once, without gradients, for y's shape."""
        flat = self._flat(args)
        with torch.no_grad():
            result = flat(*flat.leaves)
        out = result[0] if self.has_aux else result
        return make_plan(
            self.strategy, self.k, _coords.real_size(out), _coords.real_size(flat.leaves)
        )

    def __call__(self, *args: Any) -> R:
        check = resolve_check(self.check, self.call)
        flat = self._flat(args)

        def heads_of(out: Tensors) -> tuple[torch.Tensor, Tensors]:
            return _head_cotangents(self.heads, self.keys, flat, out, self.call)

        def forward(known: tuple[torch.Tensor, Tensors] | None = None) -> Any:
            cotangents = (lambda out: known) if known is not None else heads_of
            return _try_forward(
                flat, lambda: _forward_mode(flat, self.chunk_size, check, cotangents)
            )

        strategy = self.strategy
        if strategy == "jacfwd":
            result = forward()
            if result is not None:
                values, out, aux, grads = result
                if not _jacobian_went_non_finite(grads, out):
                    return self._package(flat, values, grads, aux)
            # Reverse mode instead: the cotangents themselves if J went non-finite.
            strategy = "jacrev" if result is None else "vjp"
        out, vjp_fn, aux, can_vmap = build_vjp(flat)
        values, cotangents = heads_of(out)
        plan = make_plan(strategy, self.k, _coords.real_size(out), _coords.real_size(flat.leaves))
        if plan.strategy == "jacfwd":
            result = forward((values, cotangents)) if can_vmap else None
            if result is not None and not _jacobian_went_non_finite(result[3], out):
                return self._package(flat, values, result[3], aux)
            plan = Plan("jacrev" if result is None else "vjp", plan.k, plan.m, plan.n)
        pull = functools.partial(
            _reverse_grads,
            vjp_fn=vjp_fn,
            flat=flat,
            out=out,
            cotangents=cotangents,
            chunk_size=self.chunk_size,
            check=check,
            can_vmap=can_vmap,
        )
        grads = pull(plan)
        if plan.strategy == "jacrev" and _jacobian_went_non_finite(grads, out):
            grads = pull(Plan("vjp", plan.k, plan.m, plan.n))
        return self._package(flat, values, grads, aux)

    def _package(
        self, flat: FlatFunction, values: torch.Tensor, grads: Tensors, aux: Tensors
    ) -> Any:
        trees = flat.split_inputs(grads)
        grad_tree = trees[0] if isinstance(self.argnums, int) else tuple(trees)
        if self.keys is not None:
            values_out: Any = {key: values[i] for i, key in enumerate(self.keys)}
            grad_out: Any = {key: _tree_index(grad_tree, i) for i, key in enumerate(self.keys)}
        else:
            values_out, grad_out = values, grad_tree
        if self.has_aux:
            return values_out, grad_out, flat.rebuild_aux(aux)
        return values_out, grad_out


def _tree_index(tree: Any, i: int) -> Any:
    leaves, treedef = _tree.flatten(tree)
    return _tree.unflatten(treedef, [leaf[i] for leaf in leaves])


def _reverse_grads(
    plan: Plan,
    vjp_fn: Callable[[Tensors], Tensors],
    flat: FlatFunction,
    out: Tensors,
    cotangents: Tensors,
    chunk_size: int | None,
    check: CheckMode,
    can_vmap: bool,
) -> Tensors:
    """vjp/loop: pull back the k cotangents. jacrev: pull back the m unit directions of y,
    chunk by chunk, each chunk of J's rows reduced at once into ``V @ J``."""
    pull = functools.partial(
        _engine.batched,
        lambda *cotangent: vjp_fn(cotangent),
        chunk_size=chunk_size,
        check=check,
        what="f's pullback",
        can_vmap=can_vmap and plan.strategy != "loop",
    )
    if plan.strategy in ("vjp", "loop"):
        return pull(cotangents)
    coords = _coords.to_coords(cotangents, plan.k)
    grads: Tensors = ()
    for start, stop in _chunks(plan.m, chunk_size):
        part = _coords.combine(coords[:, start:stop], pull(_coords.unit_rows(out, start, stop)))
        grads = part if not grads else tuple(g + p for g, p in zip(grads, part))
    return grads


@overload
def compose_heads(
    f: Callable[..., Any],
    heads: Sequence[Callable[[Any], torch.Tensor]]
    | Mapping[Any, Callable[[Any], torch.Tensor]]
    | StackedHeads,
    *,
    argnums: int | tuple[int, ...] = 0,
    has_aux: Literal[False] = False,
    strategy: str = "auto",
    chunk_size: int | None = None,
    check: CheckMode | None = None,
) -> ComposedHeads[tuple[Any, Any]]: ...
@overload
def compose_heads(
    f: Callable[..., Any],
    heads: Sequence[Callable[[Any], torch.Tensor]]
    | Mapping[Any, Callable[[Any], torch.Tensor]]
    | StackedHeads,
    *,
    argnums: int | tuple[int, ...] = 0,
    has_aux: Literal[True],
    strategy: str = "auto",
    chunk_size: int | None = None,
    check: CheckMode | None = None,
) -> ComposedHeads[tuple[Any, Any, Any]]: ...
def compose_heads(
    f: Callable[..., Any],
    heads: Any,
    *,
    argnums: int | tuple[int, ...] = 0,
    has_aux: bool = False,
    strategy: str = "auto",
    chunk_size: int | None = None,
    check: CheckMode | None = None,
) -> Any:
    """Values and gradients of many cheap heads on one slow f, with f run once.

    ``compose_heads(f, heads)(*args)`` returns ``(values, grads)`` with the same values as::

        values = torch.stack([h(f(*args)) for h in heads])
        grads = [torch.func.grad(lambda *a: h(f(*a)), argnums)(*args) for h in heads]  # stacked

    but f's forward runs once and its backward as few times as the shapes allow. By the
    chain rule each head only contributes a cotangent ``v_i = grad h_i(y)``, and
    ``grads_i = J_f(x)^T v_i``; the strategy decides how these k products are formed.

    Args:
        f: ``f(*args) -> y``, a pytree of floating/complex tensors (``(y, aux)`` with
            ``has_aux=True``).
        heads: a sequence of callables ``y -> real scalar``, a mapping ``name -> callable``,
            or :func:`stacked_heads`.
        argnums: which positional arguments to differentiate (int or tuple, as torch.func).
        has_aux: f returns ``(y, aux)``; aux is returned as a third output.
        strategy: how to pull the k cotangents back (m = real numel of y, n = of the inputs):

            - ``"vjp"``: one vmapped backward over the k cotangents: k directions.
            - ``"jacrev"``: pull back the m unit directions of y (the rows of J), then
              ``V @ J``: m directions plus a (k, m) @ (m, n) product.
            - ``"jacfwd"``: n JVPs (the columns of J), then ``V @ J``: f's forward runs
              once more batched with n tangents.
            - ``"loop"``: one unbatched backward per head: k passes, lowest memory, no vmap.
            - ``"auto"``: the cheapest by ``k`` vs ``m`` vs ``2 n`` (forward mode must be
              clearly cheaper); shapes only, so the same under vmap, grad and compile.
        chunk_size: at most this many directions per vmapped call (None: all at once,
            1: a loop), as torch.func's. Bounds memory at the price of more passes.
        check: compare batched results with unbatched ones on a sample (see
            :func:`funcgrad.set_check`); None uses the global setting.

    Returns:
        A function of f's arguments returning ``(values, grads)`` or ``(values, grads, aux)``.
        For a sequence of k heads ``values`` has shape ``(k,)`` and every grad leaf a leading
        k; for a mapping both are dicts keyed by the head names. ``grads`` has the structure
        of the differentiated argument (a tuple of them when ``argnums`` is a tuple).

    Example:
        >>> import torch, funcgrad
        >>> def slow_fun(x):
        ...     return torch.real(torch.trace(torch.matrix_exp(1j * x * torch.ones(30, 30))))
        >>> heads = [lambda y: y**2, lambda y: torch.sqrt(y)]
        >>> fn = funcgrad.compose_heads(slow_fun, heads)
        >>> x = torch.tensor(1.0)
        >>> values, grads = fn(x)
        >>> grads.shape, fn.plan(x).strategy, fn.plan(x).directions
        (torch.Size([2]), 'jacrev', 1)

    Notes:
        Cost: one forward of f, the k heads and their gradients (head by head, or one vmap
        for stacked heads), then ``Plan.directions`` passes through f, batched with vmap.
        The returned function composes with ``torch.func.vmap`` (per-sample gradients),
        ``torch.func.grad`` (second order) and ``torch.compile``.
    """
    return ComposedHeads(f, heads, argnums, has_aux, strategy, chunk_size, check)
