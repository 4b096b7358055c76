"""``funcgrad.grads``: the imperative bridge, for code that already built its autograd graph."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import _coords, _engine, _graph, _linearize
from ._config import CheckMode, resolve_check
from ._plan import decide_once
from ._types import ChunkSize, Tensors
from ._validate import as_tensors, check_chunk_size, check_scalar_outputs

_CALL = "funcgrad.grads(outputs, inputs, through=...)"


def grads(
    outputs: Sequence[torch.Tensor] | torch.Tensor,
    inputs: Sequence[torch.Tensor] | torch.Tensor,
    *,
    through: Sequence[torch.Tensor] | torch.Tensor,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    allow_unused: bool = False,
    chunk_size: ChunkSize = None,
    check: CheckMode | None = None,
) -> Tensors:
    """Gradients of many outputs already in an autograd graph, with f's backward run once.

    Same values as ``torch.stack([torch.autograd.grad(z, inputs, retain_graph=True)[j] for z
    in outputs])`` for each input j, when every output depends on the inputs only through
    ``through`` (the seed's ``y = slow_fun(x)``). The cheap part, outputs -> ``through``, is
    differentiated output by output; the slow part, ``through`` -> inputs, along
    ``min(k, numel(through))`` directions in one batched backward: one pass for a scalar
    ``through``, whatever k.

    Args:
        outputs: k scalar tensors (z_i = g_i(y)), or one.
        inputs: the tensor(s) to differentiate with respect to (x).
        through: the intermediate tensor(s) every output is computed from (y).
        retain_graph: as in ``torch.autograd.grad`` (None: ``create_graph``). Without it,
            the graph counts as freed after the call, where ``torch.autograd.grad`` would
            free it: a later ``grads``, ``backward`` or ``.backward()`` through it raises
            torch's error, before any ``.grad`` is written (the docs page "Reliability",
            Freed and spent graphs, says which pass frees what).
        create_graph: build the graph of the gradients, for higher order.
        allow_unused: give zeros for inputs that ``through`` does not depend on, instead of
            an error.
        chunk_size: at most this many directions per batched backward (1: a loop).
        check: compare the batched backward with unbatched ones (see
            `funcgrad.set_check`); None uses the global setting.

    Returns:
        A tuple with one tensor per input, of shape ``(k, *input.shape)``.

    Examples:
        >>> import torch, funcgrad
        >>> x = torch.tensor(1.0, requires_grad=True)
        >>> y = torch.real(torch.trace(torch.matrix_exp(1j * x * torch.ones(30, 30))))
        >>> z1, z2 = y**2, torch.sqrt(y)
        >>> (dz_dx,) = funcgrad.grads([z1, z2], x, through=y)
        >>> dz_dx.shape
        torch.Size([2])

    Notes:
        Cost: one backward of each output to ``through`` (cheap), then the backward from
        ``through`` to the inputs along the k cotangents, or, where k > numel(through),
        along ``through``'s unit directions combined by a product: batched in one
        ``torch.func.vmap`` over ``torch.autograd.grad`` (a loop with ``create_graph``).
        No rank is detected (it reads values; `funcgrad.pullback` does, across
        calls); a non-finite product is pulled back as the cotangents themselves, so
        NaN/inf come out as in autograd. Where a module's full backward hook lies below
        ``through``, or an input has a tensor hook, the k cotangents themselves go through,
        so that the hooks see each output's gradient (see the docs page "Reliability",
        Hooks); ``through``'s own hooks run once per output, as in torch.
        Validation walks the graph's gradient edges once beforehand, so a wrong
        ``through`` (missed paths, dependent or repeated entries) is an error before any
        slow backward runs, and tells which nodes the call frees (see ``retain_graph``).
    """
    check_chunk_size(chunk_size, _CALL)
    mode = resolve_check(check, _CALL)
    outs = as_tensors(outputs, "outputs", _CALL, rows=True)
    ins = as_tensors(inputs, "inputs", _CALL)
    mids = as_tensors(through, "through", _CALL)
    check_scalar_outputs(outs, _CALL)
    graph = _graph.check_paths(outs, ins, mids, allow_unused, _CALL)
    spender = _graph.spent(graph)
    if spender is not None:
        raise RuntimeError(_graph.SECOND_BACKWARD.format(call=spender))

    retain = create_graph if retain_graph is None else retain_graph
    # (Without retain_graph, parts of the graph may be freed: a later backward raises up front.)
    with _graph.spent_if_raising(graph, _CALL, freed=not retain):
        # Outputs -> through (cheap): one cotangent on `through` per output, each backward
        # freeing that output's own part of the graph unless a later one runs through it.
        cotangents, _, _, _ = _linearize.losses_backward(
            outs, mids, [()] * len(outs), graph.alone, retain=retain, create_graph=create_graph
        )

        # Through -> inputs (slow): min(k, numel(through)) directions.
        lin = _linearize.of_graph(
            mids,
            ins,
            create_graph=create_graph,
            retain_graph=retain,
            by_backward=graph.checkpoint,
            compiled=graph.compiled,
        )
        # Hooks that can be seen below `through` (a module's backward hook, a tensor hook on
        # an input) must see the outputs' gradients, not unit directions.
        hooked = graph.hooked or any(x._backward_hooks for x in ins)
        k, n, m = len(outs), _coords.real_size(ins), _coords.real_size(lin.out)
        plan = decide_once(k, n, m, chunk_size, _CALL, hooked=hooked, sparse=graph.sparse)
        # Where the cotangents themselves go through, that one batched pull is the last: it
        # frees the part below `through`, as torch.autograd.grad would.
        last = hooked or (not retain and plan.strategy == "vjp")
        with _graph.hooks_fired(mids):  # (they ran in the backward of each output)
            result = _engine.once(plan, lin, cotangents, mode, last)
    if not retain:  # as torch.autograd.grad: see Args (no other process refuses with this one)
        # (Nothing to pull, empty inputs: no pass ran below `through`, so nothing there is
        # freed by torch, and the graph is marked as spent.)
        pulled = not _engine.nothing_to_pull(len(outs), lin.out, lin.x_like)
        _graph.spend(
            graph,
            _CALL,
            shared_freed=last and pulled,
            heads_freed=graph.freed_by_losses,
            torch_answers=True,
        )
    return result
