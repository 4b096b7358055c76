"""Walking an autograd graph by gradient edges, before any backward runs.

``funcgrad.grads`` and ``funcgrad.backward`` check here that the outputs reach the inputs
only through ``through``, and ``backward`` finds the shared and the task-specific leaves.
An op with several outputs (unbind, split, max(dim)) has one node for all of them; the
edge's output index tells them apart, so the walk reasons in edges, not nodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ._types import Tensors

Edge = tuple[Any, int]


def edge(t: torch.Tensor) -> Edge:
    """The gradient edge into ``t``: (node, output index). (torch finds a leaf's node through
    a view, which inference mode would leave without a graph: the view is made outside it.)"""
    with torch.inference_mode(False):
        e = torch.autograd.graph.get_gradient_edge(t)
    return e.node, e.output_nr


def _parents(e: Edge) -> list[Edge]:
    return [(node, nr) for node, nr in e[0].next_functions if node is not None]


def walk(
    starts: list[Edge],
    targets: dict[Edge, int],
    stop: dict[Edge, int],
    leaves: dict[Edge, torch.Tensor] | None = None,
) -> tuple[set[int], set[int]]:
    """(indices of the target edges, indices of the stop edges) reached from ``starts``; the
    walk does not go past a stop edge, so it stays in the cheap part of the graph. The leaf
    tensors it reaches (their AccumulateGrad nodes) are added to ``leaves`` if given.

    Conservative where it must be: gradient entering a node by any output is taken to reach
    all of its inputs (true of every op but a few with unused inputs), so a dependency is
    never missed; a stop edge is checked before a target edge."""
    found: set[int] = set()
    stopped: set[int] = set()
    seen, todo = set(starts), list(starts)
    while todo:
        e = todo.pop()
        if e in stop:
            stopped.add(stop[e])
            continue
        if e in targets:
            found.add(targets[e])
        if leaves is not None and hasattr(e[0], "variable"):  # AccumulateGrad: a leaf
            leaves.setdefault(e, e[0].variable)
        for parent in _parents(e):
            if parent not in seen:
                seen.add(parent)
                todo.append(parent)
    return found, stopped


# The backward node of torch.utils.checkpoint(use_reentrant=True), transformers' default
# gradient checkpointing. It recomputes its forward in backward and calls .backward() there:
# the leaves it uses (the parameters inside) are not edges of the graph, so torch.autograd.grad
# never reaches them (it would return None, or zeros with allow_unused) and only .backward()
# accumulates their gradients.
REENTRANT_CHECKPOINT = "CheckpointFunctionBackward"


def has_reentrant_checkpoint(outputs: Sequence[torch.Tensor]) -> bool:
    """Whether the graph below ``outputs`` holds a reentrant checkpoint."""
    starts = [edge(t) for t in outputs if t.grad_fn is not None]
    seen, todo = set(starts), list(starts)
    while todo:
        e = todo.pop()
        if type(e[0]).__name__ == REENTRANT_CHECKPOINT:
            return True
        for parent in _parents(e):
            if parent not in seen:
                seen.add(parent)
                todo.append(parent)
    return False


def through_edges(through: Tensors, call: str) -> dict[Edge, int]:
    """The gradient edges of ``through``, checked to be distinct and independent: pulling
    back through a tensor and one computed from it would count that path twice."""
    edges: dict[Edge, int] = {}
    for j, y in enumerate(through):
        e = edge(y)
        if e in edges:
            raise ValueError(
                f"{call}: through[{j}] is the same tensor as through[{edges[e]}]; "
                "list each intermediate once."
            )
        edges[e] = j
    for j, e in enumerate(edges):
        others = {o: i for o, i in edges.items() if o != e}
        _, above = walk(_parents(e), {}, others)
        if above:
            raise ValueError(
                f"{call}: through[{j}] is computed from through[{min(above)}], so pulling "
                "back through both would count that path twice. Pass only the independent "
                f"intermediates (drop through[{min(above)}] or through[{j}])."
            )
    return edges


def check_paths(
    outputs: Tensors, inputs: Tensors, through: Tensors, allow_unused: bool, call: str
) -> None:
    """``through`` lists independent tensors, every output reaches ``through`` and reaches
    the inputs only through it, and ``through`` reaches every input (unless allow_unused)."""
    input_edges: dict[Edge, int] = {}
    for i, x in enumerate(inputs):
        input_edges.setdefault(edge(x), i)  # a repeated input is answered like its first
    stops = through_edges(through, call)
    for i, z in enumerate(outputs):
        bypass, reached_through = walk([edge(z)], input_edges, stops)
        if not reached_through:
            raise ValueError(
                f"{call}: outputs[{i}] does not depend on `through`; every output must be "
                "computed from it (z = g(y)). Drop that output or compute it from `through`."
            )
        if bypass:
            raise ValueError(
                f"{call}: outputs[{i}] depends on inputs[{min(bypass)}] other than through "
                "`through`, so pulling back through `through` alone would miss that path. "
                "Add the intermediate it uses to `through`, or use torch.autograd.grad."
            )
    if not allow_unused and not has_reentrant_checkpoint(through):
        reached, _ = walk(list(stops), input_edges, {})
        for i, x in enumerate(inputs):
            if input_edges[edge(x)] not in reached:
                raise ValueError(
                    f"{call}: `through` does not depend on inputs[{i}]; pass allow_unused=True "
                    "to get zeros for it (torch.autograd.grad would give None)."
                )


def split_leaves(
    losses: Tensors,
    names: list[str],
    through: Tensors,
    inputs: list[tuple[str, torch.Tensor]] | None,
    call: str,
) -> tuple[dict[Edge, torch.Tensor], dict[Edge, str], list[dict[Edge, torch.Tensor]]]:
    """(shared leaves, their names, each loss's task-specific leaves), from one walk of the
    graph: shared ones are those ``through`` depends on (or those of ``inputs``); a loss's
    own are those it reaches without passing through ``through``."""
    stops = through_edges(through, call)
    below: dict[Edge, torch.Tensor] = {}
    walk(list(stops), {}, {}, below)
    leaf_names: dict[Edge, str] = {}
    hidden = has_reentrant_checkpoint(through)
    if hidden and inputs is None:
        raise ValueError(
            f"{call}: the graph below `through` holds a reentrant checkpoint "
            "(torch.utils.checkpoint with use_reentrant=True, transformers' default gradient "
            "checkpointing): the parameters inside it are reached only by .backward(), not by "
            "walking the graph. Pass inputs=model.parameters() (the shared parameters), or "
            "checkpoint with use_reentrant=False."
        )
    if inputs is None:
        shared = below
    else:
        shared = {}
        for name, x in inputs:
            e = edge(x)
            leaf_names.setdefault(e, name)
            # As torch.autograd.backward: an unused input is left alone (unless a reentrant
            # checkpoint hides which inputs are used).
            if e in below or hidden:
                shared.setdefault(e, x)
    if not shared:
        raise ValueError(
            f"{call}: `through` depends on no "
            + ("leaf that requires grad" if inputs is None else "tensor of `inputs`")
            + ", so there is nothing shared to update. Pass the features computed by the "
            "shared model, or use sum(losses).backward()."
        )
    per_task = []
    for name, loss in zip(names, losses):
        own: dict[Edge, torch.Tensor] = {}
        _, reached = walk([edge(loss)], {}, stops, own)
        if not reached:
            raise ValueError(
                f"{call}: {name} does not depend on `through`; every loss must be computed "
                "from the shared features. Drop it, or add its features to `through`."
            )
        for e, leaf in own.items():
            if e in below:
                where = leaf_names.get(e, f"a leaf tensor of shape {tuple(leaf.shape)}")
                raise ValueError(
                    f"{call}: {name} reaches {where} other than through `through`, so that "
                    "leaf is both shared and task-specific and its weighted gradient would "
                    "miss a path. Add the intermediate that the loss uses to `through` (or "
                    "detach it)."
                )
        per_task.append(own)
    return shared, leaf_names, per_task


def freed_nodes(outputs: Tensors, inputs: Tensors) -> list[Any]:
    """The nodes that a backward from ``outputs`` to ``inputs`` frees (without
    ``retain_graph``): those it runs (below ``outputs``, reaching an input's gradient edge,
    as the engine prunes) that save tensors."""
    starts = [edge(t) for t in outputs]
    into: dict[Any, list[Any]] = {}  # node -> the nodes that pass gradients into it
    seen, todo = set(starts), list(starts)
    while todo:
        e = todo.pop()
        for parent in _parents(e):
            into.setdefault(parent[0], []).append(e[0])
            if parent not in seen:
                seen.add(parent)
                todo.append(parent)
    targets = {edge(x)[0] for x in inputs}
    found, todo_nodes = set(targets), list(targets)
    while todo_nodes:
        for node in into.get(todo_nodes.pop(), ()):
            if node not in found:
                found.add(node)
                todo_nodes.append(node)
    below = {e[0] for e in starts} | into.keys()
    return [node for node in found if node in below and _saves_tensors(node)]


# Per node type: whether it saves tensors for backward (those a backward frees, and torch
# refuses to run twice); an add saves none, a matmul or tanh does.
_SAVES: dict[type, bool] = {}


def _saves_tensors(node: Any) -> bool:
    kind = type(node)
    if kind not in _SAVES:
        _SAVES[kind] = not hasattr(node, "variable") and any(  # (AccumulateGrad: a leaf)
            name.startswith("_raw_saved") or name == "saved_tensors" for name in dir(node)
        )
    return _SAVES[kind]


_SPENT = "funcgrad: spent"


def spent(nodes: Sequence[Any]) -> bool:
    """Whether a call with ``retain_graph=False`` marked any of ``nodes`` (see :func:`spend`)."""
    return any(_SPENT in node.metadata for node in nodes)


def spend(nodes: Sequence[Any], call: str, *, refuse_backward: bool) -> None:
    """Mark ``nodes`` (see :func:`freed_nodes`) as spent by a backward with
    ``retain_graph=False``, so that a later call through them raises before any pass (on
    every rank: see :func:`spent`). ``refuse_backward``: funcgrad kept the graph alive
    (its batched pulls retain it), so any later backward through them, the user's own
    included, raises as torch's would on the freed graph."""

    def refuse(_: Any) -> None:
        raise RuntimeError(SECOND_BACKWARD.format(call=call))

    for node in nodes:
        if _SPENT not in node.metadata:
            node.metadata[_SPENT] = True
            if refuse_backward:
                node.register_prehook(refuse)


SECOND_BACKWARD = (
    "Trying to backward through the graph a second time: {call} already ran the backward "
    "of this graph with retain_graph=False, which frees it (at level='params' funcgrad "
    "keeps its tensors for its batched pulls, but treats it as freed, as torch would). Pass "
    "retain_graph=True to the first call, or run the forward again."
)
