"""Task weightings: from k per-task gradients to weights and one update, for ``backward``
and ``combine_heads``. Pure math: no collectives (the Sync policy makes those, between
these steps).

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
from collections.abc import Sequence
from typing import Any

import torch

from ._errors import describe
from ._types import Tensors
from ._validate import check_level, values_readable


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
    check_level(level, call)
    if weighting is None:
        return Rule("sum")
    if isinstance(weighting, type):
        raise TypeError(
            f"{call}: `weighting` must be an instance, got the class {weighting.__name__}. "
            f"Pass {weighting.__name__}() (with its arguments, if it takes any)."
        )
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


def gramian(blocks: Sequence[torch.Tensor]) -> torch.Tensor:
    """``sum_b b @ b.T`` over column blocks (k, m_b) of the task gradients (detached), block
    by block, so that the k x n Jacobian is never concatenated."""
    work = [b.detach().to(work_dtype(b.dtype)) for b in blocks]
    return sum((b @ b.T for b in work[1:]), work[0] @ work[0].T)


def check_gramian(g: torch.Tensor, blocks: Sequence[torch.Tensor], what: str, call: str) -> None:
    """A NaN/inf Gramian makes every weighting's answer meaningless: a clear error, naming
    the tasks whose gradients are not finite (where values can be read)."""
    if values_readable([g]) and not bool(torch.isfinite(g).all()):
        finite = torch.stack([torch.isfinite(b).all(dim=1) for b in blocks]).all(dim=0)
        bad = (~finite).nonzero().flatten().tolist()
        tasks = f"task(s) {bad} have" if bad else "the products of the task gradients"
        raise ValueError(
            f"{call}: the Gramian of the task gradients {what} is not finite: {tasks} NaN or "
            "inf entries (or the products overflow), so no weighting can be computed from it. "
            "Check those losses, or scale them down."
        )


def checked_shape(weights: Any, k: int, source: str, call: str) -> torch.Tensor:
    """The weights returned by a weighting: a real tensor of shape (k,), detached."""
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
    return weights.detach()


def check_finite(weights: torch.Tensor, source: str, call: str) -> torch.Tensor:
    if values_readable([weights]) and not bool(torch.isfinite(weights).all()):
        raise ValueError(
            f"{call}: `weighting` returned non-finite weights {weights.tolist()} from {source}; "
            "the update would be NaN. Check the weighting (a solver that failed to converge?)."
        )
    return weights


def weights_from_gramian(rule: Rule, g: torch.Tensor, call: str) -> torch.Tensor:
    """``rule.fn(G)``, checked for shape (finiteness is checked once the ranks share them)."""
    assert rule.fn is not None
    with torch.no_grad():
        weights = rule.fn(g)
    return checked_shape(weights, g.shape[0], f"the {tuple(g.shape)} Gramian", call)


def aggregate(
    rule: Rule, rows: torch.Tensor, call: str
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(weights or None, update) from a TorchJD aggregator run on the k x n Jacobian, its
    hooks included; a weighted one's weights are read as its weighting returns them, as
    TorchJD's ``jac_to_grad`` reads them."""
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
    if not captured:
        return None, vector
    return checked_shape(captured[-1], k, f"the ({k}, {n}) Jacobian", call), vector


def check_update(vector: torch.Tensor, rule: Rule, call: str) -> torch.Tensor:
    if values_readable([vector]) and not bool(torch.isfinite(vector).all()):
        raise ValueError(
            f"{call}: the aggregator {type(rule.fn).__name__} returned a non-finite update."
        )
    return vector


def weighted_sum(weights: torch.Tensor, grads: Sequence[torch.Tensor]) -> Tensors:
    """``sum_i w_i grads_i`` leaf by leaf, for per-task gradient leaves (k, ...)."""
    return tuple(torch.tensordot(weights.to(g.dtype), g, dims=1) for g in grads)
