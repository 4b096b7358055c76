"""``funcgrad.backward``: one weighted update from k task losses, written into ``.grad``.

It reads top to bottom as its stages: validate (and, with ranks, agree) -> collect (V and
the task-specific gradients) -> weigh (Gramian and weights) -> apply (everything that will
be written is computed, then ``.grad`` is written in one place). :func:`weigh_features` and
:func:`weigh_params` are shared with ``combine_heads``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ParamSpec, TypeVar

import torch

from . import _coords, _engine, _graph, _linearize, _sync, _weighting
from ._config import CheckMode, resolve_check
from ._plan import decide_once
from ._types import ChunkSize, InputsLike, Level, ProcessGroupLike, Tensors, Weighting
from ._validate import (
    as_tensors,
    check_chunk_size,
    check_scalar_outputs,
    named_inputs,
    outside_transforms,
)

_CALL = "funcgrad.backward(losses, through=...)"
_P = ParamSpec("_P")
_R = TypeVar("_R")


# -- weigh: shared with combine_heads ------------------------------------------------------


def weigh_features(
    rule: _weighting.Rule,
    cotangents: Tensors,
    sync: _sync.Sync,
    what: str,
    call: str,
    keep_graph: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, Tensors]:
    """(weights, c, R) for the one-pullback path, whose update is the pull of ``c @ R``.
    The weights are all ones without a weighting, else ``weighting(V V^T)`` of the global
    V (or, for a weighting that reads the Jacobian, of V itself: one process only), the
    first rank's on every rank; then ``c @ R = weights @ V``. A TorchJD aggregator maps V
    to the direction itself, its hooks included (LibMTL's ``rep_grad`` recipe): then R is
    that one row and c = [1]."""
    k = cotangents[0].shape[0]
    rows = _coords.to_coords(cotangents, k)
    if rule.kind == "sum":
        ones = torch.ones(k, dtype=rows.dtype, device=rows.device)
        return ones, ones, cotangents
    if rule.needs_jacobian:  # resolve() refused this with a process group
        weights, vector = _weighting.aggregate(rule, rows, call, keep_graph=keep_graph)
        assert weights is not None  # "vector" rules are refused at this level
        if vector is None:  # a weighting of V
            return weights, weights, cotangents
        like = tuple(v[0] for v in cotangents)
        one = torch.ones(1, dtype=rows.dtype, device=rows.device)
        return weights, one, _coords.from_coords(vector.to(rows.dtype)[None], like)
    g = sync.features_gramian(_weighting.gramian([rows], keep_graph))
    weights = _weighting.checked_weights(rule, g, [rows], what, call, sync, keep_graph)
    return weights, weights, cotangents


def weigh_params(
    rule: _weighting.Rule,
    task_grads: Tensors,
    sync: _sync.Sync,
    what: str,
    call: str,
    weighed: Sequence[bool] | None = None,
    keep_graph: bool = False,
) -> tuple[torch.Tensor | None, Tensors]:
    """(weights, update) from the global per-task gradient leaves (k, ...), as TorchJD's
    ``jac_to_grad`` computes them: ``weights @ P`` for a weighting; for an aggregator, its
    output on the Jacobian (its hooks included); the first rank's on every rank, for
    weightings that draw random numbers. Only the leaves marked in ``weighed`` (default:
    all) shape the weights and are the aggregator's Jacobian; the other leaves get
    ``weights @`` their per-task gradients."""
    k = task_grads[0].shape[0]
    if weighed is None or rule.kind == "vector":  # one without weights: every leaf's Jacobian
        weighed = [True] * len(task_grads)
    shaping = [g for g, w in zip(task_grads, weighed) if w]
    if not rule.needs_jacobian:  # leaf by leaf, as TorchJD's jac_to_grad does
        blocks = [_coords.to_coords([g], k) for g in shaping]
        g = sync.sum_over_shards(_weighting.gramian(blocks, keep_graph))
        weights = _weighting.checked_weights(rule, g, blocks, what, call, sync, keep_graph)
        return weights, _weighting.weighted_sum(weights, task_grads)
    rows = _coords.to_coords(shaping, k)
    found, vector = _weighting.aggregate(rule, rows, call, sync, keep_graph)
    if vector is None:  # a Jacobian weighting: weights only
        assert found is not None  # a Jacobian rule gives weights or an update
        return found, _weighting.weighted_sum(found, task_grads)
    if found is None and not all(weighed):
        raise ValueError(
            f"{call}: the aggregator {type(rule.fn).__name__} reported no weights, so the "
            "shared leaves that are not parameters get no update from it. Pass inputs= "
            "with every shared leaf to update."
        )
    # The aggregator's output (with its hooks' effect) is the update of the leaves it saw,
    # as jac_to_grad writes it.
    like = tuple(g[0] for g in shaping)
    written = iter(u[0] for u in _coords.from_coords(vector.to(rows.dtype)[None], like))
    unseen = [g for g, w in zip(task_grads, weighed) if not w]
    others = iter(_weighting.weighted_sum(found, unseen) if found is not None else ())
    return found, tuple(next(written) if w else next(others) for w in weighed)


# -- validate ------------------------------------------------------------------------------


@dataclasses.dataclass
class _Task:
    """What one call of ``backward`` works on, once validated."""

    rule: _weighting.Rule
    level: Level
    keys: list[Any] | None
    losses: Tensors
    through: Tensors
    shared: Tensors  # the shared leaves
    weighed: list[bool]  # which of them shape the weights (params level)
    own: list[Tensors]  # each loss's task-specific leaves
    graph: _graph.Graph  # what the backward of the losses frees (without retain_graph)

    def facts(self) -> dict[str, Any]:
        """What must match across ranks."""
        return {
            "number of losses": len(self.losses),
            "loss keys": None if self.keys is None else [repr(key) for key in self.keys],
            "level": self.level,
            "weighting": None if self.rule.fn is None else type(self.rule.fn).__name__,
            "number of `through` tensors": len(self.through),
            "shared leaves' shapes": [tuple(x.shape) for x in self.shared],
            "task-specific leaves' shapes": [[tuple(x.shape) for x in own] for own in self.own],
        }


def _validate(
    losses: Any,
    through: Any,
    weighting: Any,
    level: Any,
    inputs: Any,
    chunk_size: Any,
    sync: _sync.Sync,
) -> _Task:
    check_chunk_size(chunk_size, _CALL)
    rule = _weighting.resolve(weighting, level, _CALL, distributed=sync.size > 1)
    if isinstance(losses, Mapping):
        keys: list[Any] | None = list(losses.keys())
        names = [f"losses[{key!r}]" for key in losses]
        values: Any = list(losses.values())
    else:
        keys, values, names = None, losses, []
    if isinstance(values, torch.Tensor) and values.dim() > 1:
        raise ValueError(
            f"{_CALL}: `losses` must be k scalar losses (a sequence, a mapping, or a 1-D "
            f"tensor such as torch.stack(losses)), got a tensor of shape {tuple(values.shape)}. "
            "Reduce each task's loss to a scalar (.mean() or .sum())."
        )
    outs = as_tensors(values, "losses", _CALL, rows=True)
    names = names or [f"losses[{i}]" for i in range(len(outs))]
    check_scalar_outputs(outs, _CALL, names)
    mids = as_tensors(through, "through", _CALL)
    if not outside_transforms((*outs, *mids)):  # (as torch's .backward() refuses there)
        raise RuntimeError(
            f"{_CALL} was called inside a torch.func transform (vmap, grad, jacrev, ...), or "
            "inside an f that funcgrad is differentiating (a pullback's, a compose_heads' "
            "f or head): it writes .grad, as .backward() does, which torch refuses inside a "
            "transform. There, use funcgrad.combine_heads (the weighted update as a value), or "
            "funcgrad.grads with create_graph=True (as torch.autograd.grad, it builds no graph "
            "of its results without it)."
        )
    named = None if inputs is None else named_inputs(inputs, _CALL)
    shared, leaf_names, per_task, graph = _graph.split_leaves(outs, names, mids, named, _CALL)
    own = [tuple(leaves.values()) for leaves in per_task]
    leaves = tuple(shared.values())
    # Every .grad that will be written is checked before anything runs or is written.
    shared_names = [leaf_names.get(e, f"shared leaf {i}") for i, e in enumerate(shared)]
    _sync.check_presets(
        [*zip(shared_names, leaves)]
        + [(f"a task-specific leaf of {n}", x) for n, mine in zip(names, own) for x in mine],
        _CALL,
    )
    # By default only parameters shape the weights, as jac_to_grad(model.parameters(), ...)
    # (an input that requires grad, such as wav2vec2's, still gets w @ its gradients);
    # with `inputs`, every leaf given does; leaves of neither kind: all of them.
    weighed = [named is not None or isinstance(x, torch.nn.Parameter) for x in leaves]
    return _Task(
        rule,
        level,
        keys,
        outs,
        mids,
        leaves,
        weighed if any(weighed) else [True] * len(leaves),
        own,
        graph,
    )


# -- collect -------------------------------------------------------------------------------


def _collect(task: _Task, sync: _sync.Sync, retain: bool) -> tuple[Tensors, Tensors, Tensors, bool]:
    """(V: the k cotangents on ``through``, or without a weighting their sum, one row: all
    it needs; the task-specific leaves and their gradients, summed over the losses and
    averaged over the ranks; whether the whole graph above ``through`` was freed): the
    cheap backward of the losses (see :func:`funcgrad._linearize.losses_backward`)."""
    with sync.collecting():
        cotangents, leaves, grads, all_freed = _linearize.losses_backward(
            task.losses, task.through, task.own, task.graph.alone, retain=retain,
            summed=task.rule.kind == "sum",
        )  # fmt: skip
    return cotangents, leaves, sync.average(grads), all_freed


# -- apply ---------------------------------------------------------------------------------


class SecondBackwardError(RuntimeError):
    """A backward through a graph that an earlier call spent, raised before any `.grad` is
    written.

    `funcgrad.backward` and `funcgrad.grads` without `retain_graph=True` leave their graph
    counted as freed, as torch's own backward would free it. A later `funcgrad.backward`
    through it raises this (torch's message): before any pass where funcgrad kept part of
    the graph alive or other ranks must refuse with this one, else at the first node torch
    freed.
    It is a `RuntimeError`, as torch's error is. Pass `retain_graph=True` to the first call,
    or run the forward again.
    """


def _outside_autocast(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """``backward`` with autocast off on ``through``'s devices. It runs none of the user's
    forward (autograd's backward ignores autocast, and a checkpoint's recomputation restores
    its forward's autocast), so a caller's autocast would only downcast funcgrad's own
    products: the Gramian, ``w @ V``, the per-task gradients ``C @ J``."""

    @functools.wraps(fn)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        through = kwargs.get("through")
        mids = through if isinstance(through, (list, tuple)) else [through]
        devices = {t.device for t in mids if isinstance(t, torch.Tensor)}
        if not any(_weighting.autocast_on(device) for device in devices):  # (the usual case)
            return fn(*args, **kwargs)
        with contextlib.ExitStack() as stack:
            for device in devices:
                stack.enter_context(_weighting.no_autocast(device))
            return fn(*args, **kwargs)

    return wrapper


@_outside_autocast
def backward(
    losses: Sequence[torch.Tensor] | Mapping[Any, torch.Tensor],
    *,
    through: Sequence[torch.Tensor] | torch.Tensor | None = None,
    weighting: Weighting | None = None,
    level: Level = "params",
    inputs: InputsLike | None = None,
    retain_graph: bool = False,
    chunk_size: ChunkSize = None,
    check: CheckMode | None = None,
    process_group: ProcessGroupLike | None = None,
    batch_dim: int | None = None,
) -> Any:
    """One weighted update from k task losses, accumulated into ``.grad``, as
    ``torch.autograd.backward`` does for one loss.

    With ``P`` the k per-task gradients of the shared leaves (the rows of ``V J``: V the
    cotangents of the losses on ``through``, J the shared model's Jacobian) and ``w =
    weighting(G)``, the shared leaves get ``.grad += w @ P`` and every task-specific leaf its
    own loss's gradient (summed over the losses that reach it), TorchJD's ``mtl_backward``
    convention. ``weighting=None`` gives all ones: the same ``.grad`` as
    ``sum(losses).backward()``.

    Args:
        losses: k real scalar tensors, a sequence or a mapping ``name -> loss``, or a 1-D
            tensor of k losses (``torch.stack(losses)``), each computed from ``through``.
        through: the shared features (one tensor or several independent ones).
        weighting: a callable Gramian (k x k) -> weights (k,), such as TorchJD's
            ``UPGradWeighting()``; at ``level="params"`` also a TorchJD ``Aggregator``
            (``UPGrad()``, ``NashMTL(...)``, ``GradDrop()``). None: all ones.
        level: ``"params"``: G is the Gramian of the per-task gradients of the shared
            parameters (exact Jacobian descent). ``"features"``: G is the Gramian ``V V^T``
            of the per-task gradients with respect to ``through`` (MGDA-UB's bound).
        inputs: the shared leaves to update: tensors, a Module (its parameters), a mapping
            or ``named_parameters()`` pairs (which name them in messages); all of them shape
            the weights. None: every leaf ``through`` depends on is updated, and its
            ``nn.Parameter`` leaves shape the weights at level ``"params"`` (as TorchJD's
            ``jac_to_grad(model.parameters(), ...)``): another leaf that requires grad, such
            as an input, gets ``w @`` its per-task gradients without changing ``w``.
        retain_graph: keep the graph after the call, as ``torch.autograd.backward`` does.
            Without it the last pass through the shared part frees its saved tensors, and
            the graph counts as freed from the losses down (see Notes).
        chunk_size: at level ``"params"``, at most this many directions per batched
            backward through the shared part (1: a loop).
        check: compare the batched backward through the shared part with unbatched ones
            (see `funcgrad.set_check`); None uses the global setting.
        process_group: data-parallel training: a ``torch.distributed`` ProcessGroup, the
            ``DistributedDataParallel`` module that wraps the shared encoder (its reducer
            then averages the shared gradients), or the shared encoder sharded by FSDP2's
            ``fully_shard`` (its reduce-scatter averages them; at level ``"params"`` one
            FSDP backward per task, each rank reading its shard). Every rank ends with the
            ``.grad`` of one process on the concatenated batch (losses are means over equal
            local shards, the global loss their average, as in DDP); task-specific leaves
            are averaged too. None: nothing is communicated. See the docs page "Scaling out".
        batch_dim: 0 for per-example losses: ``losses`` is then a 1-D tensor (one loss per
            example) from a forward under `funcgrad.per_example`, and there is no
            ``through`` (see there); ``check`` then says whether per-example independence
            is verified on every call (True, "strict") or on the first of each signature.

    Returns:
        The weights, shape (k,), detached (a dict for a mapping of losses); None for a
        TorchJD aggregator that returns a vector without weights (GradDrop, ConFIG, ...).

    Examples:
        >>> import torch, funcgrad
        >>> encoder, heads = torch.nn.Linear(4, 8), torch.nn.ModuleList(
        ...     torch.nn.Linear(8, 1) for _ in range(3))
        >>> features = encoder(torch.randn(16, 4))
        >>> losses = [head(features).pow(2).mean() for head in heads]
        >>> weights = funcgrad.backward(losses, through=features, level="features",
        ...                             weighting=lambda gramian: torch.ones(3) / 3)
        >>> weights, encoder.weight.grad.shape, heads[0].weight.grad.shape
        (tensor([0.3333, 0.3333, 0.3333]), torch.Size([8, 4]), torch.Size([1, 8]))

    Notes:
        Cost: one backward of each loss to ``through`` (cheap, head by head; with
        ``weighting=None`` one backward of their sum, as ``sum(losses).backward()``), then
        through the shared part: ONE backward at ``level="features"`` or with ``weighting=None``
        (along ``w @ V``), and at ``level="params"`` one batched backward along the k
        cotangents (with ``retain_graph=True``, ``through``'s unit directions where k >
        ``numel(through)``), after which the update needs no further pass. It runs in
        stages: validate (the graph is walked once) and, with a process group, agree across
        ranks; collect (V and the task-specific gradients); weigh (the Gramian and the
        weights); apply. Nothing is written before the apply stage, so an error anywhere
        before it leaves every ``.grad`` unchanged.

        Without ``retain_graph``, the last pass through the shared part frees its saved
        tensors, as ``sum(losses).backward()`` does (no pass is added), and the graph counts
        as freed from the losses down: a second call through it, or your own
        ``.backward()``, raises torch's error before any ``.grad`` is written. The weighting
        runs after passes that freed part of the graph, so a retry after its error needs a
        new forward (or ``retain_graph=True``). In full: the docs page "Reliability", Freed
        and spent graphs.
    """
    if batch_dim is not None or through is None:  # per-example losses: _per_example.py
        from ._per_example import backward_from_losses

        return backward_from_losses(
            losses, through=through, batch_dim=batch_dim, weighting=weighting, level=level,
            inputs=inputs, retain_graph=retain_graph, chunk_size=chunk_size, check=check,
            process_group=process_group,
        )  # fmt: skip
    # Validate, then agree: every rank's checks travel in one collective, before any backward.
    sync = _sync.policy(process_group, _CALL)
    mode = resolve_check(check, _CALL)
    task: _Task | None = None
    error: Exception | None = None
    try:
        sync.check_inputs(inputs, through)
        task = _validate(losses, through, weighting, level, inputs, chunk_size, sync)
        spender = _graph.spent(task.graph)
        if spender is not None:
            raise SecondBackwardError(_graph.SECOND_BACKWARD.format(call=spender))
        _sync.check_fsdp_leaves(task.shared, task.own, sync)
        sync.configure(task.shared, task.level, task.rule, task.graph.checkpoint)
    except (TypeError, ValueError, SecondBackwardError) as caught:
        error = caught
    # (what must match across ranks: built only where there are other ranks)
    facts = (
        None
        if task is None or sync.size == 1
        else {**task.facts(), "wrap's reducer": sync.reduces_backward}
    )
    sync.agree(facts, error)
    assert task is not None

    # Collect: V on `through`, and each loss's own gradients.
    # Without retain_graph, each loss's backward frees its own part of the graph (where no
    # later loss runs through it) and the last pull the shared part: if anything below
    # raises, the graph counts as spent (a retry raises up front).
    with (
        _graph.spent_if_raising(
            task.graph, _CALL, freed=not retain_graph, error=SecondBackwardError
        ),
        contextlib.ExitStack() as stack,
    ):
        cotangents, own, own_grads, all_freed = _collect(task, sync, retain_graph)
        # `through`'s tensor hooks ran in that backward: not again from `through` down.
        stack.enter_context(_graph.hooks_fired(task.through))
        lin = _linearize.of_graph(
            task.through,
            task.shared,
            retain_graph=retain_graph,
            by_backward=task.graph.checkpoint,
            compiled=task.graph.compiled,
        )

        # Weigh, and compute what the shared leaves get (nothing is written yet).
        update: Tensors | None = None
        if task.rule.kind == "sum" or level == "features":
            what = "with respect to `through`"
            weights: torch.Tensor | None
            weights, coefficients, rows = weigh_features(task.rule, cotangents, sync, what, _CALL)
            if not sync.by_backward(one_pull=True):  # ONE pull of w @ V through the shared part
                update = sync.average(_engine.weighted(lin, coefficients, rows))
        else:
            # The last pull through the shared part frees its graph (unless retain_graph), as
            # sum(losses).backward() would; under a DDP wrap, the backward of w @ V follows it.
            last = not sync.by_backward(one_pull=False)
            # vmap cannot batch a sparse embedding's gradient, and a batched pass that frees the
            # graph would fail there after freeing the nodes above it: a loop from the start.
            k, m = len(task.losses), _coords.real_size(lin.out)
            n = _coords.real_size(task.shared)
            plan = decide_once(k, n, m, chunk_size, _CALL, last=last, sparse=task.graph.sparse)

            def pull() -> Tensors:  # the k cotangents through the shared part, on this rank
                return _engine.once(plan, lin, cotangents, mode, last)

            task_grads = sync.task_gradients(task.through, cotangents, retain_graph, pull)
            # Sparse gradients (nn.Embedding(sparse=True)) are densified for the Gramian and
            # w @ P, and the update written back sparse, as .grad would be.
            # (Each keeps its leaf's sparse dims, the stacked task dim aside: an embedding's
            # (rows, dim) gradient has one, so that the update adds to torch's own sparse
            # .grad, and torch's to it.)
            sparse = [max(g.sparse_dim() - 1, 1) if g.is_sparse else 0 for g in task_grads]
            task_grads = tuple(g.to_dense() if s else g for g, s in zip(task_grads, sparse))
            what = "with respect to the shared parameters"
            weights, update = weigh_params(task.rule, task_grads, sync, what, _CALL, task.weighed)
            update = tuple(u.to_sparse(s) if s else u for u, s in zip(update, sparse))
            if sync.by_backward(one_pull=False):  # DDP: one backward per forward, of w @ V_r,
                update = None  # which its reducer averages into w @ (global per-task gradients)

        # Apply: the one place that writes .grad. As in torch's backward, each leaf's
        # post-accumulate-grad hooks fire once, on its final .grad, the heads' first.
        for leaf, grad in zip(own, own_grads, strict=True):
            _sync.accumulate(leaf, grad)
        shared_ids = {id(x) for x in task.shared}  # (a tied leaf: once, after both writes)
        _sync.post_accumulate([x for x in own if id(x) not in shared_ids])
        if update is None:  # (torch's backward fires the shared leaves' hooks)
            assert weights is not None and lin.accumulate is not None
            with sync.reducing_backward():
                lin.accumulate(_engine.weighted_direction(weights, cotangents, lin.out))
        else:
            sync.write(task.shared, update)
    if not retain_graph:  # a later backward through the graph raises before it writes
        # (where a pass freed its part itself, torch refuses there: no hook needed)
        pulled = not _engine.nothing_to_pull(len(task.losses), lin.out, lin.x_like)
        heads_freed = task.graph.heads if all_freed else task.graph.freed_by_losses
        _graph.spend(
            task.graph,
            _CALL,
            shared_freed=pulled,
            heads_freed=heads_freed,
            torch_answers=sync.size == 1,  # (else every rank must refuse before a collective)
        )
    if task.rule.kind == "sum":  # (one summed row was weighed: all ones, one per loss)
        assert weights is not None
        weights = weights.new_ones(len(task.losses))
    if weights is None or task.keys is None:
        return weights
    return {key: weights[i] for i, key in enumerate(task.keys)}
