"""``funcgrad.combine_heads``: one weighted gradient from many heads on one slow f."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from . import _distributed, _weighting
from ._config import CheckMode, resolve_check
from ._function import build_vjp
from ._heads import ComposedHeads, StackedHeads
from ._plan import Plan

_CALL = "combine_heads(f, heads)"


class CombinedHeads(ComposedHeads[Any]):
    """The function returned by :func:`combine_heads`; call it with f's arguments."""

    def __init__(
        self, f, heads, weighting, level, argnums, has_aux, strategy, chunk_size, check, group
    ) -> None:
        super().__init__(f, heads, argnums, has_aux, strategy, chunk_size, check, call=_CALL)
        self.rule = _weighting.resolve(weighting, level, _CALL)
        self.level = level
        if isinstance(group, torch.nn.parallel.DistributedDataParallel):
            raise TypeError(
                f"{_CALL}: `process_group` must be a ProcessGroup here (f is a function, "
                "not a DDP module); pass ddp.process_group."
            )
        self.process_group = group

    @property
    def _one_pullback(self) -> bool:
        return self.rule.kind == "sum" or self.level == "features"

    def plan(self, *args: Any) -> Plan:
        """The plan for these arguments, from shapes only (see :meth:`ComposedHeads.plan`):
        ``"weighted"`` (one pullback) at level ``"features"`` or without a weighting, else
        the per-head plan of :func:`compose_heads`."""
        plan = super().plan(*args)
        return dataclasses.replace(plan, strategy="weighted") if self._one_pullback else plan

    def __call__(self, *args: Any) -> Any:
        check = resolve_check(self.check, self.call)
        flat = self._flat(args)
        weights: torch.Tensor | None
        group = None
        if self.process_group is not None:
            group = _distributed.Group(self.process_group, _CALL)
            group.agree(
                [
                    self.k,
                    int(self.level == "features"),
                    len(flat.leaves),
                    hash(tuple(tuple(x.shape) for x in flat.leaves)),
                ],
                [
                    "number of heads",
                    "level",
                    "number of differentiated leaves",
                    "hash of their shapes",
                ],
                flat.leaves[0].device,
            )
        if self._one_pullback:
            out, vjp_fn, aux, _ = build_vjp(flat)
            values, cotangents = self._heads_of(flat, out)
            weights = _weighting.weights_on_features(
                self.rule, cotangents, "with respect to f's output", _CALL, group
            )
            grads = tuple(vjp_fn(_weighting.weighted(weights, cotangents, out)))
            if group is not None:
                grads = group.average(grads)
        else:
            values, per_head, aux = self._per_head(flat, check)
            if group is not None:  # the global per-head gradients: one k x n all-reduce
                per_head = group.average(per_head)
            weights, grads = _weighting.combine(
                self.rule, per_head, "with respect to the differentiated arguments", _CALL, group
            )
        if group is not None:  # the global head values: the average of the ranks'
            (values,) = group.average([values.detach()])
        trees = flat.split_inputs(grads)
        grad = trees[0] if isinstance(self.argnums, int) else tuple(trees)
        values_out: Any = values
        weights_out: Any = weights
        if self.keys is not None:
            values_out = {key: values[i] for i, key in enumerate(self.keys)}
            if weights is not None:
                weights_out = {key: weights[i] for i, key in enumerate(self.keys)}
        if self.has_aux:
            return values_out, grad, weights_out, flat.rebuild_aux(aux)
        return values_out, grad, weights_out


def combine_heads(
    f: Callable[..., Any],
    heads: Sequence[Callable[[Any], torch.Tensor]]
    | Mapping[Any, Callable[[Any], torch.Tensor]]
    | StackedHeads,
    weighting: Any = None,
    *,
    level: str = "params",
    argnums: int | tuple[int, ...] = 0,
    has_aux: bool = False,
    strategy: str = "auto",
    chunk_size: int | None = None,
    check: CheckMode | None = None,
    process_group: Any = None,
) -> CombinedHeads:
    """The heads' values and ONE weighted gradient, ``sum_i w_i grads_i``, with f run once.

    ``combine_heads(f, heads, weighting)(*args)`` returns ``(values, grad, weights)``. With
    ``values, grads = compose_heads(f, heads)(*args)`` (the per-head gradients, rows ``P``):

    - ``level="params"``: ``weights = weighting(P P^T)``, the Gramian of the per-head
      gradients of the differentiated arguments (Jacobian descent), and ``grad = weights @ P``.
    - ``level="features"``: ``weights = weighting(V V^T)``, the Gramian of the head
      cotangents on f's output y, and ``grad = (weights @ V) J``: still ``weights @ P``.

    Args:
        f: ``f(*args) -> y``, as for :func:`compose_heads`.
        heads: a sequence or mapping of callables ``y -> real scalar``, or
            :func:`stacked_heads`.
        weighting: a callable Gramian (k x k) -> weights (k,), such as TorchJD's
            ``UPGradWeighting()``; at ``level="params"`` also a TorchJD ``Aggregator``.
            None: all ones (``grad`` is the gradient of the sum of the heads).
        level: ``"params"`` or ``"features"``, see above.
        argnums, has_aux, chunk_size, check: as for :func:`compose_heads`.
        strategy: how the per-head gradients are formed at level ``"params"``, as for
            :func:`compose_heads`; level ``"features"`` always takes one pullback.
        process_group: a ``torch.distributed`` ProcessGroup for data-parallel use (eager
            mode): each rank calls the function on its equal shard, and every rank gets the
            values (averaged), ``grad`` and weights of one call on the whole batch (heads
            are means over the shard, as in DDP). None: nothing is communicated.

    Returns:
        A function of f's arguments returning ``(values, grad, weights)`` (and aux with
        ``has_aux=True``): ``grad`` has the structure of the differentiated argument(s),
        ``values`` and ``weights`` shape (k,) (dicts for a mapping of heads). ``weights``
        is detached, and None for a TorchJD aggregator that returns only a vector.

    Example:
        >>> import torch, funcgrad
        >>> heads = [lambda y: y.sum(), lambda y: -y[0]]
        >>> fn = funcgrad.combine_heads(torch.sin, heads, lambda gramian: torch.ones(2),
        ...                             level="features")
        >>> values, grad, weights = fn(torch.zeros(3))
        >>> grad, weights, fn.plan(torch.zeros(3)).directions
        (tensor([0., 1., 1.]), tensor([1., 1.]), 1)

    Notes:
        Cost: one forward of f and the k heads, then at level ``"features"`` (or without a
        weighting) ONE pullback of f, whatever k; at level ``"params"`` the per-head plan of
        :func:`compose_heads` (the cheapest of k VJPs, m Jacobian rows or n JVPs; the
        Gramian ``P P^T = V (J J^T) V^T`` and the update then need no further pass). Under
        ``torch.compile`` a torch-native weighting compiles; TorchJD weightings that call a
        solver outside torch (UPGrad, DualProj via quadprog; CAGrad, NashMTL via cvxpy) call
        numpy and cannot run inside ``torch.compile(fullgraph=True)``.
    """
    return CombinedHeads(
        f, heads, weighting, level, argnums, has_aux, strategy, chunk_size, check, process_group
    )
