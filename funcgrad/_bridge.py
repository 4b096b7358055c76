"""``funcgrad.grads``: the imperative bridge, for code that already built its autograd graph."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from . import _coords
from ._errors import describe
from ._function import autograd_grad

_CALL = "funcgrad.grads(outputs, inputs, through=...)"


def _as_tuple(value: Any, name: str) -> tuple[torch.Tensor, ...]:
    items = (value,) if isinstance(value, torch.Tensor) else value
    if not isinstance(items, Sequence) or isinstance(items, str) or not items:
        raise TypeError(
            f"{_CALL}: `{name}` must be a tensor or a non-empty sequence of tensors, "
            f"got {describe(value)}."
        )
    for index, item in enumerate(items):
        if not isinstance(item, torch.Tensor):
            raise TypeError(f"{_CALL}: `{name}`[{index}] must be a tensor, got {describe(item)}.")
        if not item.requires_grad:
            raise ValueError(
                f"{_CALL}: `{name}`[{index}] does not require grad, so it is in no graph. "
                + (
                    "Create it with requires_grad=True."
                    if name == "inputs"
                    else "Compute it from the inputs with gradients enabled."
                )
            )
    return tuple(items)


def _node(t: torch.Tensor) -> Any:
    """The autograd node through which gradients reach ``t`` (AccumulateGrad for a leaf)."""
    if t.grad_fn is not None:
        return t.grad_fn
    with torch.enable_grad():
        view = t.view_as(t).grad_fn
    assert view is not None  # t requires grad (checked by _as_tuple)
    return view.next_functions[0][0]


def _reached(start: Any, targets: dict[Any, int], stop: set[Any]) -> set[int]:
    """Indices of the target nodes reachable from ``start`` without passing a ``stop`` node."""
    found, seen, todo = set(), {start}, [start]
    while todo:
        node = todo.pop()
        if node in targets:
            found.add(targets[node])
        if node in stop:
            continue
        for parent, _ in node.next_functions:
            if parent is not None and parent not in seen:
                seen.add(parent)
                todo.append(parent)
    return found


def _check_graph(outputs, inputs, through, allow_unused: bool) -> None:
    """Before any backward runs: every output reaches ``through`` and reaches the inputs only
    through it, and ``through`` reaches every input."""
    input_nodes = {_node(x): i for i, x in enumerate(inputs)}
    through_nodes = {_node(y): j for j, y in enumerate(through)}
    for i, z in enumerate(outputs):
        if not _reached(_node(z), through_nodes, set()):
            raise ValueError(
                f"{_CALL}: outputs[{i}] does not depend on `through`; every output must be "
                "computed from it (z = g(y)). Drop that output or compute it from `through`."
            )
        bypass = _reached(_node(z), input_nodes, set(through_nodes))
        if bypass:
            raise ValueError(
                f"{_CALL}: outputs[{i}] depends on inputs[{min(bypass)}] other than through "
                "`through`, so pulling back through `through` alone would miss that path. "
                "Add the intermediate it uses to `through`, or use torch.autograd.grad."
            )
    if not allow_unused:
        reached = set().union(*(_reached(node, input_nodes, set()) for node in through_nodes))
        for i in range(len(inputs)):
            if i not in reached:
                raise ValueError(
                    f"{_CALL}: `through` does not depend on inputs[{i}]; pass allow_unused=True "
                    "to get zeros for it (torch.autograd.grad would give None)."
                )


def _check_outputs(outputs: tuple[torch.Tensor, ...]) -> None:
    for i, z in enumerate(outputs):
        if z.numel() != 1:
            raise ValueError(
                f"{_CALL}: outputs[{i}] must be a scalar, got shape {tuple(z.shape)}. Reduce it "
                "(.sum() or .mean()) or pass one output per entry."
            )
        if z.is_complex() or not z.is_floating_point():
            raise TypeError(f"{_CALL}: outputs[{i}] must be a real floating scalar, got {z.dtype}.")


def _pull_rows(mids, ins, rows, retain: bool, create_graph: bool) -> tuple[torch.Tensor, ...]:
    """Pull back each row (leading dim of ``rows``) from ``through`` to the inputs, one
    backward each; the last one frees the graph unless ``retain``."""
    r = rows[0].shape[0]
    images = [
        autograd_grad(
            mids,
            ins,
            tuple(row[i] for row in rows),
            retain_graph=retain or i < r - 1,
            create_graph=create_graph,
        )
        for i in range(r)
    ]
    return tuple(torch.stack([image[j] for image in images]) for j in range(len(ins)))


def grads(
    outputs: Sequence[torch.Tensor] | torch.Tensor,
    inputs: Sequence[torch.Tensor] | torch.Tensor,
    *,
    through: Sequence[torch.Tensor] | torch.Tensor,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    allow_unused: bool = False,
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
        retain_graph: keep the graph for later backward calls; defaults to ``create_graph``,
            as in ``torch.autograd.grad``.
        create_graph: build the graph of the gradients, for higher order.
        allow_unused: give zeros for inputs that ``through`` does not depend on, instead of
            an error.

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
        Cost: one backward of each output to ``through`` (cheap), then one backward from
        ``through`` to the inputs per independent direction, unbatched (``autograd.grad``'s
        batched mode is slow for common ops). Validation walks the graph once beforehand,
        so a wrong ``through`` is an error before any slow backward runs.
    """
    outs = _as_tuple(outputs, "outputs")
    ins = _as_tuple(inputs, "inputs")
    mids = _as_tuple(through, "through")
    _check_outputs(outs)
    _check_graph(outs, ins, mids, allow_unused)
    retain = create_graph if retain_graph is None else retain_graph
    k = len(outs)

    # Outputs -> through (cheap): one cotangent on `through` per output.
    per_output = [
        autograd_grad(z, mids, None, retain_graph=True, create_graph=create_graph) for z in outs
    ]
    cotangents = tuple(torch.stack([c[j] for c in per_output]) for j in range(len(mids)))

    # Through -> inputs (slow): only the independent directions, the last one frees the graph.
    coords = _coords.to_coords(cotangents, k)
    m = coords.shape[1]
    directions = _coords.new_directions(coords.detach(), None, m)
    if create_graph and directions is not None and directions.shape[0] < m:
        # A partial basis gives the right values but projects the derivative of the
        # cotangents onto it: for higher order, pull back the cotangents themselves.
        return _pull_rows(mids, ins, cotangents, retain, create_graph)
    if directions is None:
        return tuple(torch.zeros((k, *x.shape), dtype=x.dtype, device=x.device) for x in ins)
    units = _coords.from_coords(directions, tuple(mid.detach() for mid in mids))
    rows = _pull_rows(mids, ins, units, retain, create_graph)
    return _coords.combine(coords @ directions.T, rows)
