"""``funcgrad.grads``: the imperative bridge, for code that already built its autograd graph."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from . import _coords, _engine
from ._config import CheckMode, resolve_check
from ._errors import describe
from ._function import autograd_grad
from ._pullback import check_chunk_size

_CALL = "funcgrad.grads(outputs, inputs, through=...)"


def _as_tuple(value: Any, name: str, call: str = _CALL) -> tuple[torch.Tensor, ...]:
    if isinstance(value, torch.Tensor):
        items: Any = (value,)
    elif isinstance(value, Iterable) and not isinstance(value, (str, bytes, Mapping)):
        items = tuple(value)  # a list, or a generator such as model.parameters()
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
            raise ValueError(
                f"{call}: `{name}`[{index}] does not require grad, so it is in no graph. "
                + (
                    "Create it with requires_grad=True."
                    if name == "inputs"
                    else "Compute it from the inputs with gradients enabled."
                )
            )
    return tuple(items)


Edge = tuple[Any, int]


def _edge(t: torch.Tensor) -> Edge:
    """The gradient edge into ``t``: (node, output index). An op with several outputs
    (unbind, split, max(dim)) has one node for all of them; the index tells them apart."""
    edge = torch.autograd.graph.get_gradient_edge(t)
    return edge.node, edge.output_nr


def _parents(edge: Edge) -> list[Edge]:
    return [(node, nr) for node, nr in edge[0].next_functions if node is not None]


def _walk(
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
        edge = todo.pop()
        if edge in stop:
            stopped.add(stop[edge])
            continue
        if edge in targets:
            found.add(targets[edge])
        if leaves is not None and hasattr(edge[0], "variable"):  # AccumulateGrad: a leaf
            leaves.setdefault(edge, edge[0].variable)
        for parent in _parents(edge):
            if parent not in seen:
                seen.add(parent)
                todo.append(parent)
    return found, stopped


def through_edges(through: tuple[torch.Tensor, ...], call: str) -> dict[Edge, int]:
    """The gradient edges of ``through``, checked to be distinct and independent: pulling
    back through a tensor and one computed from it would count that path twice."""
    edges: dict[Edge, int] = {}
    for j, y in enumerate(through):
        edge = _edge(y)
        if edge in edges:
            raise ValueError(
                f"{call}: through[{j}] is the same tensor as through[{edges[edge]}]; "
                "list each intermediate once."
            )
        edges[edge] = j
    for j, edge in enumerate(edges):
        others = {e: i for e, i in edges.items() if e != edge}
        _, above = _walk(_parents(edge), {}, others)
        if above:
            raise ValueError(
                f"{call}: through[{j}] is computed from through[{min(above)}], so pulling "
                "back through both would count that path twice. Pass only the independent "
                f"intermediates (drop through[{min(above)}] or through[{j}])."
            )
    return edges


def _check_graph(outputs, inputs, through, allow_unused: bool) -> None:
    """Before any backward runs: ``through`` lists independent tensors, every output reaches
    ``through`` and reaches the inputs only through it, and ``through`` reaches every input."""
    input_edges: dict[Edge, int] = {}
    for i, x in enumerate(inputs):
        input_edges.setdefault(_edge(x), i)  # a repeated input is answered like its first
    stops = through_edges(through, _CALL)
    for i, z in enumerate(outputs):
        bypass, reached_through = _walk([_edge(z)], input_edges, stops)
        if not reached_through:
            raise ValueError(
                f"{_CALL}: outputs[{i}] does not depend on `through`; every output must be "
                "computed from it (z = g(y)). Drop that output or compute it from `through`."
            )
        if bypass:
            raise ValueError(
                f"{_CALL}: outputs[{i}] depends on inputs[{min(bypass)}] other than through "
                "`through`, so pulling back through `through` alone would miss that path. "
                "Add the intermediate it uses to `through`, or use torch.autograd.grad."
            )
    if not allow_unused:
        reached, _ = _walk(list(stops), input_edges, {})
        for i, x in enumerate(inputs):
            if input_edges[_edge(x)] not in reached:
                raise ValueError(
                    f"{_CALL}: `through` does not depend on inputs[{i}]; pass allow_unused=True "
                    "to get zeros for it (torch.autograd.grad would give None)."
                )


def _check_outputs(
    outputs: tuple[torch.Tensor, ...], call: str = _CALL, names: Sequence[str] | None = None
) -> None:
    for i, z in enumerate(outputs):
        name = f"outputs[{i}]" if names is None else names[i]
        if z.numel() != 1:
            raise ValueError(
                f"{call}: {name} must be a scalar, got shape {tuple(z.shape)}. Reduce it "
                "(.sum() or .mean()) or pass one entry per scalar."
            )
        if z.is_complex() or not z.is_floating_point():
            raise TypeError(f"{call}: {name} must be a real floating scalar, got {z.dtype}.")


def grads(
    outputs: Sequence[torch.Tensor] | torch.Tensor,
    inputs: Sequence[torch.Tensor] | torch.Tensor,
    *,
    through: Sequence[torch.Tensor] | torch.Tensor,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    allow_unused: bool = False,
    chunk_size: int | None = None,
    check: CheckMode | None = None,
) -> tuple[torch.Tensor, ...]:
    """Gradients of many outputs already in an autograd graph, with f's backward run once.

    Same values as ``torch.stack([torch.autograd.grad(z, inputs, retain_graph=True)[j] for z
    in outputs])`` for each input j, when every output depends on the inputs only through
    ``through`` (the seed's ``y = slow_fun(x)``). The cheap part, outputs -> ``through``, is
    differentiated output by output; the slow part, ``through`` -> inputs, only along the
    independent directions of those cotangents: one pass for a scalar ``through``, at most
    ``min(k, numel(through))`` in general.

    Args:
        outputs: k scalar tensors (z_i = g_i(y)), or one.
        inputs: the tensor(s) to differentiate with respect to (x).
        through: the intermediate tensor(s) every output is computed from (y).
        retain_graph: accepted as in ``torch.autograd.grad``. The graph is always kept
            during the call (batching, ``check`` and the non-finite recompute may need it
            more than once), so a later backward through it works either way; its memory
            goes when you drop the outputs and ``through``.
        create_graph: build the graph of the gradients, for higher order.
        allow_unused: give zeros for inputs that ``through`` does not depend on, instead of
            an error.
        chunk_size: at most this many directions per batched backward (1: a loop).
        check: compare the batched backward with unbatched ones (see
            :func:`funcgrad.set_check`); None uses the global setting.

    Returns:
        A tuple with one tensor per input, of shape ``(k, *input.shape)``.

    Example:
        >>> import torch, funcgrad
        >>> x = torch.tensor(1.0, requires_grad=True)
        >>> y = torch.real(torch.trace(torch.matrix_exp(1j * x * torch.ones(30, 30))))
        >>> z1, z2 = y**2, torch.sqrt(y)
        >>> (dz_dx,) = funcgrad.grads([z1, z2], x, through=y)
        >>> dz_dx.shape
        torch.Size([2])

    Notes:
        Cost: one backward of each output to ``through`` (cheap), then the backward from
        ``through`` to the inputs along the independent directions only, batched in one
        ``torch.func.vmap`` over ``torch.autograd.grad`` (a loop with ``create_graph``).
        Rank detection is invariant to each output's scale; non-finite cotangents or
        images are pulled back as they are, so NaN/inf come out as in autograd.
        Validation walks the graph's gradient edges once beforehand, so a wrong
        ``through`` (missed paths, dependent or repeated entries) is an error before any
        slow backward runs. The graph is retained during the call; with
        ``retain_graph=False`` its memory goes when you drop the outputs.
    """
    check_chunk_size(chunk_size, _CALL)
    mode = resolve_check(check, _CALL)
    outs = _as_tuple(outputs, "outputs")
    ins = _as_tuple(inputs, "inputs")
    mids = _as_tuple(through, "through")
    _check_outputs(outs)
    _check_graph(outs, ins, mids, allow_unused)
    del retain_graph  # see Args: kept during the call either way

    # Outputs -> through (cheap): one cotangent on `through` per output.
    per_output = [
        autograd_grad(z, mids, None, retain_graph=True, create_graph=create_graph) for z in outs
    ]
    cotangents = tuple(torch.stack([c[j] for c in per_output]) for j in range(len(mids)))

    return pull_through(mids, ins, cotangents, chunk_size, mode, create_graph)


def pull_through(
    mids: tuple[torch.Tensor, ...],
    ins: tuple[torch.Tensor, ...],
    cotangents: tuple[torch.Tensor, ...],
    chunk_size: int | None,
    check: bool | str,
    create_graph: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Through -> inputs (slow) for k cotangents on ``mids``: only their independent
    directions, batched with vmap over torch.autograd.grad where the graph allows (a loop
    for create_graph). The graph is retained."""

    def backward(*cotangent: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return autograd_grad(mids, ins, cotangent, retain_graph=True, create_graph=create_graph)

    def pull(directions: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        return _engine.batched(
            backward,
            directions,
            chunk_size=chunk_size,
            check=check,
            what="the backward from `through` to the inputs",
            can_vmap=not create_graph,
        )

    like = tuple(mid.detach() for mid in mids)
    basis = _engine.Basis(_coords.real_size(like))
    result, _ = _engine.by_linearity(pull, cotangents, like, ins, basis, keep=False)
    return result
