"""``funcgrad.combine_heads``: one weighted gradient from many heads on one slow f."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from . import _engine, _sync, _tree, _weighting
from ._config import CheckMode
from ._function import result_graph
from ._heads import Composition, StackedHeads
from ._multitask import weigh_features, weigh_params
from ._plan import Plan
from ._projector import projector_advice
from ._types import ChunkSize, Level, ProcessGroupLike, Strategy, Weighting
from ._validate import check_flag, check_not_inference_mode, outside_transforms

_CALL = "combine_heads(f, heads)"


class CombinedHeads:
    """The function returned by `combine_heads`: call it with f's arguments.

    ``fn(*args)`` returns ``(values, grad, weights)`` (and aux with ``has_aux=True``);
    ``fn.plan(*args)`` returns the `funcgrad.Plan` that the call runs.

    Examples:
        >>> import torch, funcgrad
        >>> fn = funcgrad.combine_heads(torch.sin, [lambda y: y.sum(), lambda y: -y[0]])
        >>> fn
        combine_heads(sin, 2 heads, strategy='auto', weighting=None, level='params')
        >>> fn.plan(torch.zeros(3)).strategy  # no weighting: one pullback of the summed heads
        'weighted'
    """

    def __init__(
        self,
        composition: Composition,
        weighting: Any,
        level: Level,
        process_group: Any,
        create_graph: bool = False,
    ) -> None:
        self._composition = composition
        self._create_graph = create_graph
        self._weighting = weighting
        self.level = level
        distributed = process_group is not None
        _weighting.resolve(weighting, level, _CALL, distributed=distributed)  # a clear error now
        if isinstance(process_group, torch.nn.Module):  # DDP or FSDP: a clear error, at once
            _sync.policy(process_group, _CALL, allow_modules=False)
        self.process_group = process_group

    @property
    def k(self) -> int:
        """The number of heads."""
        return self._composition.k

    @property
    def rule(self) -> _weighting.Rule:
        """How the weighting is run, decided at each call as ``jac_to_grad`` decides it: a
        hook registered on a TorchJD aggregator after ``combine_heads`` runs too."""
        distributed = self.process_group is not None
        return _weighting.resolve(self._weighting, self.level, _CALL, distributed=distributed)

    def _one_pullback(self, rule: _weighting.Rule) -> bool:
        return rule.kind == "sum" or self.level == "features"

    def plan(self, *args: Any) -> Plan:
        """The plan that ``fn(*args)`` runs, from shapes only: ``"weighted"`` (one pullback of
        ``w @ V``) at level ``"features"`` or without a weighting, else the per-head plan of
        `compose_heads` (see `ComposedHeads.plan` for what it costs)."""
        c = self._composition
        flat = c.flat(args)
        with result_graph(self._create_graph, flat.leaves):
            plan = c.plan(flat, weighted=self._one_pullback(self.rule))
        # The device where the work happens: any input off the CPU (a CPU scalar or index
        # beside a model on an accelerator does not make the work the CPU's).
        tensors = [t for t in _tree.flatten(list(args))[0] if isinstance(t, torch.Tensor)]
        device = next((t.device for t in tensors if t.device.type != "cpu"), None)
        advice = projector_advice(self._weighting, c.k, device)  # by m and device
        return dataclasses.replace(plan, advice=advice)

    def __call__(self, *args: Any) -> Any:
        check_not_inference_mode(_CALL)
        leaves = [leaf for leaf in _tree.flatten(list(args))[0] if isinstance(leaf, torch.Tensor)]
        with result_graph(self._create_graph, leaves):
            return self._call(*args)

    def _call(self, *args: Any) -> Any:
        c = self._composition
        sync = _sync.policy(self.process_group, _CALL, allow_modules=False)
        flat = c.flat(args)
        sharded = _sync.first_sharded(flat.leaves)
        error = None
        if sharded is not None:
            error = TypeError(
                f"{_CALL}: differentiated leaf {sharded} is a DTensor (an FSDP-sharded "
                "parameter); combine_heads differentiates f with torch.func, which does not "
                "see the sharding. Pass plain (replicated) tensors, or use funcgrad.backward "
                "with process_group=<the FSDP encoder>."
            )
        sync.agree(
            {
                "number of heads": c.k,
                "head keys": None if c.keys is None else [repr(key) for key in c.keys],
                "level": self.level,
                "differentiated leaves' shapes": [tuple(x.shape) for x in flat.leaves],
            },
            error,
        )
        check = c.resolved_check()
        rule = self.rule
        # The results' graph, where the call keeps one (create_graph, inside a transform):
        # also the weights', so that a gradient through `grad` reaches them (their
        # dependence on the per-head gradients, and on what else the weighting reads).
        kept = self._create_graph or (  # (as result_graph: dynamo cannot trace the check)
            not torch.compiler.is_compiling() and not outside_transforms(flat.leaves)
        )
        if self._one_pullback(rule):
            lin = c.one_pullback(flat)
            values, cotangents = c.cotangents_of(flat)(lin.out)
            what = "with respect to f's output"
            # f ran under the caller's autocast, if any; w @ V is formed and pulled outside
            # it, as autograd's backward of that forward would run.
            with _weighting.no_autocast(cotangents[0].device):
                weights: torch.Tensor | None
                weights, coefficients, rows = weigh_features(
                    rule, cotangents, sync, what, _CALL, kept
                )
                grads = sync.average(_engine.weighted(lin, coefficients, rows))
            aux = lin.aux
        else:
            values, per_head, aux = c.per_head(flat, check)
            what = "with respect to the differentiated arguments"
            # The global per-head gradients: one k x n all-reduce.
            per_head = sync.average(per_head)
            weights, grads = weigh_params(rule, per_head, sync, what, _CALL, keep_graph=kept)
        # The global head values, on their graph where the call keeps one, as compose_heads'.
        (values,) = sync.average([values if kept else values.detach()])
        result = (c.keyed(values), c.grad_tree(flat, grads), c.keyed(weights))
        return (*result, flat.rebuild_aux(aux)) if c.has_aux else result

    def __repr__(self) -> str:
        weighting = "None" if self._weighting is None else type(self._weighting).__name__
        text = self._composition.describe("combine_heads")
        return text[:-1] + f", weighting={weighting}, level={self.level!r})"


def combine_heads(
    f: Callable[..., Any],
    heads: Sequence[Callable[[Any], torch.Tensor]]
    | Mapping[Any, Callable[[Any], torch.Tensor]]
    | torch.nn.ModuleList
    | torch.nn.ModuleDict
    | StackedHeads,
    weighting: Weighting | None = None,
    *,
    level: Level = "params",
    argnums: int | tuple[int, ...] = 0,
    has_aux: bool = False,
    strategy: Strategy = "auto",
    chunk_size: ChunkSize = None,
    check: CheckMode | None = None,
    process_group: ProcessGroupLike | None = None,
    create_graph: bool = False,
) -> CombinedHeads:
    """The heads' values and ONE weighted gradient, ``sum_i w_i grads_i``, with f run once.

    ``combine_heads(f, heads, weighting)(*args)`` returns ``(values, grad, weights)``. With
    ``values, grads = compose_heads(f, heads)(*args)`` (the per-head gradients, rows ``P``):

    - ``level="params"``: ``weights = weighting(P P^T)``, the Gramian of the per-head
      gradients of the differentiated arguments (Jacobian descent), and ``grad = weights @ P``.
    - ``level="features"``: ``weights = weighting(V V^T)``, the Gramian of the head
      cotangents on f's output y, and ``grad = (weights @ V) J``: still ``weights @ P``.

    Args:
        f: ``f(*args) -> y``, as for `compose_heads`.
        heads: a sequence or mapping of callables ``y -> real scalar``, or
            `stacked_heads`.
        weighting: a callable Gramian (k x k) -> weights (k,), such as TorchJD's
            ``UPGradWeighting()``; at ``level="params"`` also a TorchJD ``Aggregator``.
            None: all ones (``grad`` is the gradient of the sum of the heads).
        level: ``"params"`` or ``"features"``, see above.
        argnums: as for `compose_heads`.
        has_aux: as for `compose_heads`.
        chunk_size: as for `compose_heads`.
        check: as for `compose_heads`.
        strategy: how the per-head gradients are formed at level ``"params"``, as for
            `compose_heads`; level ``"features"`` always takes one pullback.
        process_group: a ``torch.distributed`` ProcessGroup for data-parallel use (eager
            mode): each rank calls the function on its equal shard, and every rank gets the
            values (averaged), ``grad`` and weights of one call on the whole batch (heads
            are means over the shard, as in DDP). None: nothing is communicated.
        create_graph: build the graph of ``grad``, ``weights`` (and aux), as for
            `compose_heads`, the weights' dependence on the Gramian included; by default
            none is built.

    Returns:
        A function of f's arguments returning ``(values, grad, weights)`` (and aux with
        ``has_aux=True``): ``grad`` has the structure of the differentiated argument(s),
        ``values`` and ``weights`` shape (k,) (dicts for a mapping of heads). ``weights``
        is None for a TorchJD aggregator that returns only a vector; it is detached unless
        the call keeps a graph (``create_graph=True``, or inside a torch.func transform):
        there the weighting is given the Gramian with its graph, and ``grad`` and
        ``weights`` keep the weights' dependence on it (a meta-gradient through ``grad``
        reaches the weighting). State a weighting keeps across calls must then be
        detached (``self.ema = G.diagonal().detach()``): a call whose weights reach an
        earlier call's freed graph raises, naming the fix.

    Examples:
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
        `compose_heads` (the cheapest of k VJPs, m Jacobian rows or n JVPs; the
        Gramian ``P P^T = V (J J^T) V^T`` and the update then need no further pass). Under
        ``torch.compile`` a torch-native weighting compiles; TorchJD weightings that call a
        solver outside torch (UPGrad, DualProj via quadprog; CAGrad, NashMTL via cvxpy) call
        numpy and cannot run inside ``torch.compile(fullgraph=True)``.
    """
    check_flag(create_graph, "create_graph", _CALL)
    composition = Composition(f, heads, argnums, has_aux, strategy, chunk_size, check, _CALL)
    return CombinedHeads(composition, weighting, level, process_group, create_graph)
