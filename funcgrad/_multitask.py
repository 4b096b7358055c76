"""``funcgrad.backward``: one weighted update from k task losses, written into ``.grad``."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from . import _distributed, _weighting
from ._bridge import Edge, _as_tuple, _check_outputs, _edge, _walk, pull_through, through_edges
from ._config import resolve_check
from ._errors import describe
from ._function import autograd_grad
from ._pullback import check_chunk_size

_CALL = "funcgrad.backward(losses, through=...)"
Tensors = tuple[torch.Tensor, ...]


def _losses(losses: Any) -> tuple[list[Any] | None, Tensors, list[str]]:
    """(keys or None, the losses, a name for each in messages)."""
    if isinstance(losses, Mapping):
        keys: list[Any] | None = list(losses.keys())
        values: Any = list(losses.values())
        names = [f"losses[{key!r}]" for key in losses]
    else:
        keys, values = None, losses
        names = []
    tensors = _as_tuple(values, "losses", _CALL)
    return keys, tensors, names or [f"losses[{i}]" for i in range(len(tensors))]


def _named_inputs(inputs: Any) -> list[tuple[str, torch.Tensor]]:
    """``inputs`` as (name, leaf) pairs: tensors, or a mapping / ``named_parameters()`` pairs,
    so that messages can name a parameter."""
    if isinstance(inputs, Mapping):
        pairs = [(f"inputs[{key!r}]", value) for key, value in inputs.items()]
    elif isinstance(inputs, Iterable) and not isinstance(inputs, torch.Tensor):
        items = list(inputs)
        if items and all(isinstance(item, tuple) and len(item) == 2 for item in items):
            pairs = [(f"inputs[{name!r}]", value) for name, value in items]
        else:
            tensors = _as_tuple(items, "inputs", _CALL)
            pairs = [(f"inputs[{i}]", x) for i, x in enumerate(tensors)]
    else:
        pairs = [("inputs[0]", x) for x in _as_tuple(inputs, "inputs", _CALL)]
    if not pairs:
        raise ValueError(f"{_CALL}: `inputs` is empty; give the shared parameters, or None.")
    for name, x in pairs:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{_CALL}: {name} must be a tensor, got {describe(x)}.")
        if not (x.requires_grad and x.is_leaf):
            raise ValueError(
                f"{_CALL}: {name} must be a leaf tensor that requires grad (a parameter), "
                f"got {describe(x)} with requires_grad={x.requires_grad}, is_leaf={x.is_leaf}."
            )
    return pairs


def _leaf_name(edge: Edge, leaf: torch.Tensor, names: dict[Edge, str]) -> str:
    return names.get(edge, f"a leaf tensor of shape {tuple(leaf.shape)}")


def _split_leaves(
    losses: Tensors, names: list[str], mids: Tensors, inputs: Any
) -> tuple[dict[Edge, torch.Tensor], list[dict[Edge, torch.Tensor]]]:
    """(shared leaves, each loss's task-specific leaves), from one walk of the graph
    (before any backward): shared ones are those ``through`` depends on (or ``inputs``);
    a loss's own are those it reaches without passing through ``through``."""
    stops = through_edges(mids, _CALL)
    below: dict[Edge, torch.Tensor] = {}
    _walk(list(stops), {}, {}, below)
    leaf_names: dict[Edge, str] = {}
    if inputs is None:
        shared = below
    else:
        shared = {}
        for name, x in _named_inputs(inputs):
            edge = _edge(x)
            leaf_names.setdefault(edge, name)
            if edge in below:  # as torch.autograd.backward: an unused input is left alone
                shared.setdefault(edge, x)
    if not shared:
        raise ValueError(
            f"{_CALL}: `through` depends on no "
            + ("leaf that requires grad" if inputs is None else "tensor of `inputs`")
            + ", so there is nothing shared to update. Pass the features computed by the "
            "shared model, or use sum(losses).backward()."
        )
    per_task = []
    for name, loss in zip(names, losses):
        own: dict[Edge, torch.Tensor] = {}
        _, reached = _walk([_edge(loss)], {}, stops, own)
        if not reached:
            raise ValueError(
                f"{_CALL}: {name} does not depend on `through`; every loss must be computed "
                "from the shared features. Drop it, or add its features to `through`."
            )
        for edge, leaf in own.items():
            if edge in below:
                raise ValueError(
                    f"{_CALL}: {name} reaches {_leaf_name(edge, leaf, leaf_names)} other than "
                    "through `through`, so that leaf is both shared and task-specific and its "
                    "weighted gradient would miss a path. Add the intermediate that the loss "
                    "uses to `through` (or detach it)."
                )
        per_task.append(own)
    return shared, per_task


def _accumulate(leaf: torch.Tensor, grad: torch.Tensor) -> None:
    """``leaf.grad += grad``, as autograd accumulates (``grad`` is a fresh tensor, kept as
    the first ``.grad`` without a copy)."""
    grad = grad.detach()
    if leaf.grad is None:
        leaf.grad = grad
    else:
        leaf.grad.add_(grad)


def backward(
    losses: Sequence[torch.Tensor] | Mapping[Any, torch.Tensor],
    *,
    through: Sequence[torch.Tensor] | torch.Tensor,
    weighting: Any = None,
    level: str = "params",
    inputs: Any = None,
    retain_graph: bool = False,
    chunk_size: int | None = None,
    process_group: Any = None,
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
        losses: k real scalar tensors, a sequence or a mapping ``name -> loss``, each
            computed from ``through``.
        through: the shared features (one tensor or several independent ones).
        weighting: a callable Gramian (k x k) -> weights (k,), such as TorchJD's
            ``UPGradWeighting()``; at ``level="params"`` also a TorchJD ``Aggregator``
            (``UPGrad()``, ``NashMTL(...)``, ``GradDrop()``). None: all ones.
        level: ``"params"``: G is the Gramian of the per-task gradients of the shared
            parameters (exact Jacobian descent). ``"features"``: G is the Gramian ``V V^T``
            of the per-task gradients with respect to ``through`` (MGDA-UB's bound).
        inputs: the shared leaves to update (tensors, a mapping or ``named_parameters()``
            pairs, which name them in messages). None: every leaf ``through`` depends on.
        retain_graph: keep the graph of the shared part after the last backward.
        chunk_size: at level ``"params"``, at most this many directions per batched
            backward through the shared part (1: a loop).
        process_group: data-parallel training: a ``torch.distributed`` ProcessGroup, or the
            ``DistributedDataParallel`` module that wraps the shared encoder (its reducer
            then averages the shared gradients). Every rank ends with the ``.grad`` of one
            process on the concatenated batch (losses are means over equal local shards,
            the global loss their average, as in DDP); task-specific leaves are averaged
            too. None: nothing is communicated. See the README, "Scaling out".

    Returns:
        The weights, shape (k,), detached (a dict for a mapping of losses); None for a
        TorchJD aggregator that returns a vector without weights (GradDrop, ConFIG, ...).

    Example:
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
        Cost: one backward of each loss to ``through`` (cheap, head by head), then through
        the shared part: ONE backward at ``level="features"`` or with ``weighting=None``
        (along ``w @ V``), and at ``level="params"`` one batched backward along the
        independent directions of the k cotangents (at most ``min(k, numel(through))``),
        after which the update needs no further pass. Everything is checked before the
        shared part runs (the graph is walked once), and ``.grad`` is only written once
        the weights are known to be finite. At level ``"params"`` the graph of the shared
        part is retained during the call, whatever ``retain_graph``.
    """
    check_chunk_size(chunk_size, _CALL)
    rule = _weighting.resolve(weighting, level, _CALL)
    keys, outs, names = _losses(losses)
    _check_outputs(outs, _CALL, names)
    mids = _as_tuple(through, "through", _CALL)
    shared, per_task = _split_leaves(outs, names, mids, inputs)

    # Losses -> through (cheap), with each loss's own leaves on the way. V is written in
    # place, row by row: it is the one k x m buffer that the features level holds.
    k = len(outs)
    cotangents = tuple(mid.new_empty((k, *mid.shape)) for mid in mids)
    own_grads = []
    for i, (loss, own) in enumerate(zip(outs, per_task)):
        grads = autograd_grad(loss, mids + tuple(own.values()), None, retain_graph=True)
        for row, grad in zip(cotangents, grads):
            row[i] = grad
        own_grads.append(grads[len(mids) :])
    leaves = tuple(shared.values())

    group = None if process_group is None else _distributed.Group(process_group, _CALL)
    if group is not None:
        if group.ddp and rule.kind == "vector" and level == "params":
            raise ValueError(
                f"{_CALL}: {type(rule.fn).__name__} returns an update without weights, but a "
                "DDP-wrapped encoder needs weights (its reducer averages the backward of "
                "w @ V). Use a weighted aggregator, or pass the process group itself and a "
                "plain encoder."
            )
        # Fixed length (the all-gather needs equal sizes); variable parts as int hashes,
        # which do not depend on PYTHONHASHSEED.
        group.agree(
            [
                k,
                _LEVEL_CODES[level],
                len(mids),
                len(leaves),
                hash(tuple(tuple(leaf.shape) for leaf in leaves)),
                hash(tuple(tuple(tuple(x.shape) for x in own.values()) for own in per_task)),
            ],
            [
                "number of losses",
                "level",
                "number of `through` tensors",
                "number of shared leaves",
                "hash of the shared leaves' shapes",
                "hash of the task-specific leaves' shapes",
            ],
            mids[0].device,
        )
        own_grads = _average_own(group, own_grads)

    if rule.kind == "sum" or level == "features":
        # w from V V^T, then ONE backward of w @ V through the shared part.
        weights: torch.Tensor | None = _weighting.weights_on_features(
            rule, cotangents, "with respect to `through`", _CALL, group
        )
        assert weights is not None
        direction = _weighting.weighted(weights, cotangents, tuple(mid.detach() for mid in mids))
        _write_own(per_task, own_grads)
        if group is None or group.ddp:  # DDP's reducer averages the shared gradients
            torch.autograd.backward(mids, direction, inputs=list(leaves), retain_graph=retain_graph)
        else:
            local = autograd_grad(mids, leaves, direction, retain_graph=retain_graph)
            for leaf, grad in zip(leaves, group.average(local)):
                _accumulate(leaf, grad)
    else:
        check = resolve_check(None, _CALL)
        task_grads = pull_through(mids, leaves, cotangents, chunk_size, check)
        if group is not None:  # the global per-task gradients: one k x P all-reduce
            task_grads = group.average(task_grads)
        weights, update = _weighting.combine(
            rule, task_grads, "with respect to the shared parameters", _CALL, group
        )
        _write_own(per_task, own_grads)
        if group is not None and group.ddp:
            # DDP expects one backward per forward: the backward of w @ V_r, which its
            # reducer averages into w @ (global per-task gradients).
            assert weights is not None
            like = tuple(mid.detach() for mid in mids)
            direction = _weighting.weighted(weights, cotangents, like)
            torch.autograd.backward(mids, direction, inputs=list(leaves), retain_graph=retain_graph)
        else:
            for leaf, u in zip(leaves, update):
                _accumulate(leaf, u)
    if weights is None or keys is None:
        return weights
    return {key: weights[i] for i, key in enumerate(keys)}


_LEVEL_CODES = {"params": 0, "features": 1}


def _average_own(group: _distributed.Group, own_grads: list[Tensors]) -> list[Tensors]:
    """Every task-specific gradient averaged over the ranks, in one flat buffer."""
    flat = group.average([g for grads in own_grads for g in grads])
    result, start = [], 0
    for grads in own_grads:
        result.append(flat[start : start + len(grads)])
        start += len(grads)
    return result


def _write_own(per_task: list[dict[Edge, torch.Tensor]], own_grads: list[Tensors]) -> None:
    for own, grads in zip(per_task, own_grads):
        for leaf, grad in zip(own.values(), grads):
            _accumulate(leaf, grad)
