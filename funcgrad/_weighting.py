"""Task weightings: from k per-task gradients to one update, for ``backward`` and
``combine_heads``.

A weighting is any callable Gramian (k x k) -> weights (k,), TorchJD's ``*Weighting``
objects included. TorchJD's ``Aggregator`` objects (Jacobian -> vector) are recognised by
their class, without importing TorchJD: a Gramian-weighted one (UPGrad, MGDA, ...) is run
through its Gramian weighting, which needs only the Gramian; a weighted one (NashMTL,
Mean, ...) through its matrix weighting; any other (GradDrop, ConFIG, TrimmedMean) as it
is, on the Jacobian, and then has no weights to report.

With G the Gramian of the rows of a Jacobian P (k x n) and w = weighting(G), the update is
``w @ P``. When P = V J (V the head cotangents on y, J f's Jacobian), ``w @ P = (w @ V) J``:
one pullback of f, once w is known.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import _coords
from ._errors import describe
from ._function import values_readable

LEVELS = ("params", "features")


def _torchjd_kind(obj: object) -> str | None:
    """Which TorchJD aggregator base ``obj`` derives from (by class name: TorchJD is not
    imported), or None."""
    names = {cls.__name__ for cls in type(obj).__mro__ if cls.__module__.startswith("torchjd")}
    for kind in ("GramianWeightedAggregator", "WeightedAggregator", "Aggregator"):
        if kind in names:
            return kind
    return None


@dataclasses.dataclass(frozen=True)
class Rule:
    """How weights (or the update) come out of the task gradients.

    ``kind``: ``"sum"`` (no weighting: all ones, no Gramian), ``"gramian"`` (``fn(G)`` gives
    the weights), ``"matrix"`` (``fn(P)`` gives the update, P the k x n Jacobian, and
    ``fn.weighting`` the weights, as TorchJD's ``jac_to_grad`` reads them) or ``"vector"``
    (``fn(P)`` gives the update, and there are no weights).
    """

    kind: str
    fn: Any = None

    @property
    def needs_jacobian(self) -> bool:
        return self.kind in ("matrix", "vector")


def resolve(weighting: Any, level: object, call: str) -> Rule:
    """The rule for ``weighting`` at ``level``, or a clear error (before any pass)."""
    if level not in LEVELS:
        raise ValueError(
            f"{call}: unknown `level` {level!r}; expected 'params' (exact Jacobian descent on "
            "the shared parameters) or 'features' (the Gramian of the task gradients with "
            "respect to `through`, one backward through the shared part)."
        )
    if weighting is None:
        return Rule("sum")
    kind = _torchjd_kind(weighting)
    if kind == "GramianWeightedAggregator":  # UPGrad, MGDA, ...: only the Gramian is needed
        return Rule("gramian", weighting.gramian_weighting)
    if kind is not None:
        if level == "features":
            raise ValueError(
                f"{call}: `weighting` {type(weighting).__name__} is a TorchJD Aggregator that "
                "needs the Jacobian with respect to the parameters, which level='features' "
                "never forms. Pass level='params', or a Gramian weighting (such as "
                "UPGradWeighting()) at level='features'."
            )
        return Rule("matrix" if kind == "WeightedAggregator" else "vector", weighting)
    if not callable(weighting):
        raise TypeError(
            f"{call}: `weighting` must be None, a callable Gramian (k x k) -> weights (k,), "
            f"or a TorchJD Aggregator, got {describe(weighting)}."
        )
    return Rule("gramian", weighting)


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    # A half-precision Gramian overflows easily, and TorchJD's solvers want float32 or more.
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def gramian(
    blocks: Sequence[torch.Tensor],
    what: str,
    call: str,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """``sum_b b @ b.T`` over column blocks (k, m_b) of the task gradients (detached),
    checked finite where values can be read: a NaN/inf task gradient would make every
    weighting's answer meaningless. Block by block, so the k x n Jacobian is never
    concatenated. ``reduce`` (data-parallel) turns the local Gramian into the global one
    before the check, so that every rank raises alike."""
    work = [b.detach().to(work_dtype(b.dtype)) for b in blocks]
    g = sum((b @ b.T for b in work[1:]), work[0] @ work[0].T)
    if reduce is not None:
        g = reduce(g)
    if values_readable([g]) and not bool(torch.isfinite(g).all()):
        finite = torch.stack([torch.isfinite(b).all(dim=1) for b in work]).all(dim=0)
        bad = (~finite).nonzero().flatten().tolist()
        tasks = f"task(s) {bad} have" if bad else "the products of the task gradients"
        raise ValueError(
            f"{call}: the Gramian of the task gradients {what} is not finite: {tasks} NaN or "
            "inf entries (or the products overflow), so no weighting can be computed from it. "
            "Check those losses, or scale them down."
        )
    return g


def _validated(weights: Any, k: int, source: str, call: str) -> torch.Tensor:
    if not isinstance(weights, torch.Tensor):
        raise TypeError(
            f"{call}: `weighting` must return a tensor of k = {k} weights from {source}, got "
            f"{describe(weights)}."
        )
    if tuple(weights.shape) != (k,):
        raise ValueError(
            f"{call}: `weighting` must return weights of shape ({k},) (one per task) from "
            f"{source}, got shape {tuple(weights.shape)}. A weighting maps the Gramian to "
            "weights; a function returning an update vector is an aggregator (TorchJD's "
            "Aggregator, at level='params')."
        )
    if weights.is_complex() or not weights.is_floating_point():
        raise TypeError(
            f"{call}: `weighting` must return real floating-point weights, got {weights.dtype}."
        )
    if values_readable([weights]) and not bool(torch.isfinite(weights).all()):
        raise ValueError(
            f"{call}: `weighting` returned non-finite weights {weights.tolist()} from {source}; "
            "the update would be NaN. Check the weighting (a solver that failed to converge?)."
        )
    return weights.detach()


def weights_from_gramian(rule: Rule, g: torch.Tensor, call: str, group: Any = None) -> torch.Tensor:
    assert rule.fn is not None
    with torch.no_grad():
        weights = rule.fn(g)
        if group is not None and isinstance(weights, torch.Tensor) and weights.shape == g.shape[:1]:
            weights = group.from_first_rank(weights.to(g.dtype))  # rank 0's, for random ones
        return _validated(weights, g.shape[0], f"the {tuple(g.shape)} Gramian", call)


def update_from_jacobian(
    rule: Rule, rows: torch.Tensor, call: str
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(weights or None, update) from a TorchJD aggregator run on the k x n Jacobian, its
    hooks included; a weighted one's weights are read as its weighting returns them."""
    k, n = rows.shape
    captured: list[Any] = []
    hook = None
    if rule.kind == "matrix":
        hook = rule.fn.weighting.register_forward_hook(lambda _m, _i, out: captured.append(out))
    try:
        with torch.no_grad():
            vector = rule.fn(rows.detach().to(work_dtype(rows.dtype)))
    finally:
        if hook is not None:
            hook.remove()
    name = type(rule.fn).__name__
    if not isinstance(vector, torch.Tensor) or tuple(vector.shape) != (n,):
        raise ValueError(
            f"{call}: the aggregator {name} must map the ({k}, {n}) Jacobian to a vector of "
            f"shape ({n},), got {describe(vector)}."
        )
    if values_readable([vector]) and not bool(torch.isfinite(vector).all()):
        raise ValueError(f"{call}: the aggregator {name} returned a non-finite update.")
    weights = _validated(captured[-1], k, f"the ({k}, {n}) Jacobian", call) if captured else None
    return weights, vector


def weights_on_features(
    rule: Rule, cotangents: Sequence[torch.Tensor], what: str, call: str, group: Any = None
) -> torch.Tensor:
    """The weights of the one-pullback path: all ones without a weighting, else
    ``weighting(V V^T)``. With a group, the Gramian is the global one: each rank's
    features are disjoint coordinates, entering the global loss with a factor 1/R, so
    ``G = (1/R^2) sum_r V_r V_r^T``."""
    k = cotangents[0].shape[0]
    rows = _coords.to_coords(cotangents, k)
    if rule.kind == "sum":
        return torch.ones(k, dtype=rows.dtype, device=rows.device)
    reduce = None if group is None else (lambda g: group.sum(g) / group.size**2)
    return weights_from_gramian(rule, gramian([rows], what, call, reduce), call, group)


def weighted(
    weights: torch.Tensor, cotangents: Sequence[torch.Tensor], like: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, ...]:
    """``sum_i w_i v_i`` over k cotangent leaves (k, ...): the one direction to pull back
    through f, shaped like ``like``."""
    rows = _coords.to_coords(cotangents, cotangents[0].shape[0])
    return tuple(d[0] for d in _coords.from_coords((weights.to(rows.dtype) @ rows)[None], like))


def combine(
    rule: Rule, grads: Sequence[torch.Tensor], what: str, call: str, group: Any = None
) -> tuple[torch.Tensor | None, tuple[torch.Tensor, ...]]:
    """(weights, update): per-task gradient leaves (k, ...) to one update of the leaves'
    shapes, ``sum_i w_i grads_i`` (the aggregator's vector for a ``"vector"`` rule). Not for
    the ``"sum"`` rule, which needs no per-task gradients (one pass of the summed
    cotangent)."""
    k = grads[0].shape[0]
    if not rule.needs_jacobian:  # leaf by leaf, as TorchJD's jac_to_grad does
        blocks = [_coords.to_coords([g], k) for g in grads]
        weights = weights_from_gramian(rule, gramian(blocks, what, call), call, group)
        return weights, tuple(torch.tensordot(weights.to(g.dtype), g, dims=1) for g in grads)
    rows = _coords.to_coords(grads, k)
    found, vector = update_from_jacobian(rule, rows, call)
    if group is not None:  # GradDrop, Random draw random numbers: rank 0's update for all
        vector = group.from_first_rank(vector)
    update = _coords.from_coords(vector.to(rows.dtype)[None], tuple(g[0] for g in grads))
    return found, tuple(u[0] for u in update)
