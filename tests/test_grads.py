"""``funcgrad.grads``: gradients of many outputs of an existing autograd graph through one
intermediate, against ``torch.autograd.grad`` output by output in float64."""

from __future__ import annotations

import gc
import math
import weakref

import pytest
import torch
from helpers import Unbatchable

import funcgrad
from funcgrad import _graph
from funcgrad._counting import BackwardCounter, counted


def _reference(outputs_of, x):
    rows = []
    for i in range(len(outputs_of(x))):
        xr = x.detach().requires_grad_()
        (g,) = torch.autograd.grad(outputs_of(xr)[i], xr)
        rows.append(g)
    return torch.stack(rows)


@pytest.mark.parametrize("k", [1, 3, 7], ids=lambda k: f"k={k}")
def test_fewer_or_more_outputs_than_through_has_coordinates(k):
    """k <= m pulls the k cotangents; k > m pulls y's m unit directions and combines."""
    torch.manual_seed(0)
    w = torch.randn(4, 6, dtype=torch.float64)

    def outputs_of(x):
        y = torch.tanh(w @ x)[:3]  # m = 3
        return [(y ** (i + 1)).sum() * (i - 1.5) for i in range(k)]

    x = torch.randn(6, dtype=torch.float64, requires_grad=True)
    y = torch.tanh(w @ x)[:3]
    outputs = [(y ** (i + 1)).sum() * (i - 1.5) for i in range(k)]
    (got,) = funcgrad.grads(outputs, x, through=y)
    torch.testing.assert_close(got, _reference(outputs_of, x))


def test_non_finite_cotangents_come_out_as_autograd_with_more_outputs_than_coordinates():
    x = torch.tensor([0.0, 1.0], dtype=torch.float64, requires_grad=True)
    y = 3 * x  # m = 2, k = 3: y's unit directions would give 0 * inf = NaN
    outputs = [torch.sqrt(y).sum(), (y**2).sum(), y[1] * 2]
    (got,) = funcgrad.grads(outputs, x, through=y)
    expected = _reference(lambda x: [torch.sqrt(3 * x).sum(), (9 * x**2).sum(), 6 * x[1]], x)
    torch.testing.assert_close(got, expected, equal_nan=True)
    assert torch.isinf(got[0, 0]) and torch.isfinite(got[1:]).all()


def test_empty_tensors_in_grads():
    x = torch.randn(3, requires_grad=True)
    e = torch.randn(0, requires_grad=True)
    y = x[:0] * 2
    (g,) = funcgrad.grads([y.sum(), 3 * y.sum()], x, through=y)
    assert g.shape == (2, 3) and not g.any()
    mixed = (x[:0] * 2, x.sin() * (e.sum() + 1))
    zs = [mixed[0].sum() + mixed[1].sum(), (mixed[1] ** 2).sum()]
    gx, ge = funcgrad.grads(zs, [x, e], through=mixed, retain_graph=True)
    assert ge.shape == (2, 0)
    for i, z in enumerate(zs):
        torch.testing.assert_close(gx[i], torch.autograd.grad(z, x, retain_graph=True)[0])


def _seed_graph(n, counter):
    # The seed's code, unchanged up to the line that asks for the gradients.
    def slow_fun(x):
        A = counted(x, counter) * torch.ones((n, n))
        B = torch.matrix_exp(1j * A)
        return torch.real(torch.trace(B))

    x = torch.tensor(1.0, requires_grad=True)
    y = slow_fun(x)
    z1 = y**2
    z2 = torch.sqrt(y)
    return x, y, [z1, z2, torch.log(y), torch.sin(y) * y]


def test_grads_on_the_seed_matches_closed_form_with_one_pass():
    counter = BackwardCounter()
    x, y, outputs = _seed_graph(40, counter)
    (dz_dx,) = funcgrad.grads(outputs, x, through=y, retain_graph=True)
    assert counter.backward == 1
    yv, dy = 39 + math.cos(40.0), -40 * math.sin(40.0)
    expected = [
        2 * yv * dy,
        0.5 / math.sqrt(yv) * dy,
        dy / yv,
        (math.cos(yv) * yv + math.sin(yv)) * dy,
    ]
    torch.testing.assert_close(dz_dx, torch.tensor(expected), rtol=1e-9, atol=0)
    reference = [torch.autograd.grad(z, x, retain_graph=True)[0] for z in outputs]
    torch.testing.assert_close(dz_dx, torch.stack(reference))


def test_grads_with_several_inputs_and_through_tensors():
    a, b = torch.randn(3, requires_grad=True), torch.randn(2, 3, requires_grad=True)
    h1 = torch.tanh(b @ a)  # (2,)
    h2 = torch.sin(a).sum() * b  # (2, 3)
    outputs = [(h1 * h2.sum(1)).sum(), h2.pow(2).mean(), h1[0] * 3, (h1.sum() + h2.sum()) ** 2]
    ga, gb = funcgrad.grads(outputs, [a, b], through=[h1, h2], retain_graph=True)
    assert ga.shape == (4, 3) and gb.shape == (4, 2, 3)
    for i, z in enumerate(outputs):
        ra, rb = torch.autograd.grad(z, [a, b], retain_graph=True)
        torch.testing.assert_close(ga[i], ra)
        torch.testing.assert_close(gb[i], rb)


def test_grads_create_graph_gives_second_order():
    x = torch.randn(3, requires_grad=True)
    y = torch.tanh(x) * x.sum()
    outputs = [(y**2).sum(), y.prod()]
    (g,) = funcgrad.grads(outputs, x, through=y, create_graph=True)
    (second,) = torch.autograd.grad(g.sum(), x, retain_graph=True)
    total = sum(torch.autograd.grad(z, x, create_graph=True)[0].sum() for z in outputs)
    (expected,) = torch.autograd.grad(total, x)
    torch.testing.assert_close(second, expected)


def _head_graph():
    torch.manual_seed(0)
    x = torch.randn(3, requires_grad=True)
    w = torch.randn(3, requires_grad=True)  # a head's parameter, not differentiated
    y = torch.exp(x)
    return x, w, y, [(w * y).sum(), (y**2).sum() + w.sum()]


def _raises(fn):
    try:
        fn()
    except RuntimeError as error:
        assert "backward through the graph a second time" in str(error)
        return True
    return False


@pytest.mark.parametrize("create_graph", [False, True])
@pytest.mark.parametrize("retain_graph", [None, False, True])
def test_grads_frees_the_graph_as_torch_autograd_grad_does(retain_graph, create_graph):
    """retain_graph as in torch.autograd.grad (default: create_graph): without it, a second
    call or the user's own backward through the graph raises torch's error, before any
    .grad is written; with it, both run again."""
    kwargs = {"retain_graph": retain_graph, "create_graph": create_graph}
    x, w, y, zs = _head_graph()
    (want,) = torch.autograd.grad(zs, x, **kwargs)
    torch_raises = _raises(lambda: torch.autograd.grad(zs, x))
    assert torch_raises == (not (create_graph if retain_graph is None else retain_graph))
    (only_w,) = torch.autograd.grad(zs[1], w)  # runs no freed node: torch answers

    x, w, y, zs = _head_graph()
    (g,) = funcgrad.grads(zs, x, through=y, **kwargs)
    torch.testing.assert_close(g.sum(0), want)
    assert _raises(lambda: funcgrad.grads(zs, x, through=y, retain_graph=True)) == torch_raises
    assert _raises(lambda: sum(zs).backward()) == torch_raises
    if torch_raises:
        assert x.grad is None and w.grad is None  # torch itself writes w.grad before raising
    else:
        torch.testing.assert_close(x.grad, want)
    torch.testing.assert_close(torch.autograd.grad(zs[1], w)[0], only_w)


@pytest.mark.parametrize("k", [2, 6])
def test_grads_frees_the_part_below_through_with_its_last_pass(k):
    """Without retain_graph, where the k cotangents themselves are pulled (k <= numel(y) = 4),
    the batched pull frees the saved tensors below `through`, as torch.autograd.grad does;
    where y's unit directions are (k > 4), that part is kept until the user drops it (the
    cotangents may have to be pulled again). Either way the graph counts as freed."""
    x = torch.randn(3, requires_grad=True)
    w = torch.randn(4, 3)
    y = torch.tanh(w @ x)  # TanhBackward0 saves its result
    zs = [(y * (i + 1)).pow(2).sum() for i in range(k)]
    funcgrad.grads(zs, x, through=y)
    freed = _raises(lambda: y.grad_fn._saved_result)
    assert freed == (k <= 4)
    assert _raises(lambda: funcgrad.grads(zs, x, through=y))


def test_grads_in_inference_mode_as_torch():
    """A graph built outside inference mode, differentiated inside it, as torch allows."""
    x, _, y, zs = _head_graph()
    with torch.inference_mode():
        want = [torch.autograd.grad(z, x, retain_graph=True)[0] for z in zs]
        (g,) = funcgrad.grads(zs, x, through=y)
    torch.testing.assert_close(g, torch.stack(want))


def test_grads_allow_unused_and_errors():
    x, unused = torch.randn(3, requires_grad=True), torch.randn(2, requires_grad=True)
    y = torch.sin(x)
    with pytest.raises(
        ValueError, match=r"`through` does not depend on inputs\[1\]; pass allow_unused=True"
    ):
        funcgrad.grads([y.sum()], [x, unused], through=y)
    gx, gu = funcgrad.grads([y.sum(), y[0]], [x, unused], through=y, allow_unused=True)
    torch.testing.assert_close(gu, torch.zeros(2, 2))
    torch.testing.assert_close(gx[1], torch.tensor([math.cos(x[0].item()), 0.0, 0.0]))
    other = torch.cos(x).sum()
    with pytest.raises(ValueError, match=r"outputs\[1\] does not depend on `through`"):
        funcgrad.grads([y.sum(), other], x, through=y)
    with pytest.raises(ValueError, match=r"outputs\[0\] depends on inputs\[0\] other than through"):
        funcgrad.grads([y.sum() + x.sum()], x, through=y)
    with pytest.raises(ValueError, match=r"outputs\[0\] must be a scalar, got shape \(3,\)"):
        funcgrad.grads([y], x, through=y)
    with pytest.raises(ValueError, match=r"`inputs`\[0\] does not require grad"):
        funcgrad.grads([y.sum()], torch.randn(3), through=y)
    with pytest.raises(TypeError, match=r"`outputs` must be a tensor or a non-empty sequence"):
        funcgrad.grads([], x, through=y)


def _zero_column_graph(k, **kwargs):
    """(W, y, outputs) where y[.., 0] = 0 and the first output is sqrt(y).sum(): its
    cotangent on y is inf at 0, and autograd's own backward of it gives 0 * inf = NaN."""
    torch.manual_seed(0)
    w = torch.randn(3, 4, dtype=torch.float64)
    w[:, 0] = 0
    w.requires_grad_()
    x = torch.randn(3, dtype=torch.float64)
    y = (x @ w).pow(2)  # m = 4, y[0] = 0
    outputs = [y.sqrt().sum()] + [(y * (i + 1)).sin().sum() for i in range(k - 1)]
    return w, y, outputs


@pytest.mark.parametrize("k", [2, 6], ids=lambda k: f"k={k}")
@pytest.mark.parametrize("check", [True, "strict"])
def test_check_compares_non_finite_gradients_as_autograd_gives_them(k, check):
    """check=True with a head whose backward gives NaN on one output (as per-output autograd
    gives it): the comparison of the batched rows with unbatched ones must treat NaN as
    equal to NaN, not fail on its own tolerance (`atol` NaN from a NaN scale)."""
    w, y, outputs = _zero_column_graph(k)
    want = torch.stack([torch.autograd.grad(z, w, retain_graph=True)[0] for z in outputs])
    assert want.isnan().any()
    w, y, outputs = _zero_column_graph(k)
    (got,) = funcgrad.grads(outputs, w, through=y, check=check)
    torch.testing.assert_close(got, want, equal_nan=True)


@pytest.mark.parametrize("k", [2, 6], ids=lambda k: f"k={k}")
@pytest.mark.parametrize("options", [{}, {"chunk_size": 1}, {"chunk_size": 2}])
def test_non_finite_gradients_come_out_as_autograd_and_the_graph_is_spent(k, options):
    """NaN where autograd gives NaN (0 * inf in the shared part's backward), at k <= m (the
    cotangents pulled, the last pull freeing the part below `through`) and k > m (a product
    first, then the cotangents); either way a later backward raises before any .grad."""
    w, y, outputs = _zero_column_graph(k)
    want = torch.stack([torch.autograd.grad(z, w, retain_graph=True)[0] for z in outputs])
    w, y, outputs = _zero_column_graph(k)
    (got,) = funcgrad.grads(outputs, w, through=y, **options)
    torch.testing.assert_close(got, want, equal_nan=True)
    assert _raises(lambda: sum(outputs).backward())
    assert w.grad is None


class _Box:
    def __init__(self, tensor):
        self.tensor = tensor


@pytest.mark.parametrize("k", [2, 6], ids=lambda k: f"k={k}")
def test_a_spent_grads_graph_goes_when_dropped(k):
    """Each output's backward frees its own part of the graph (the outputs share no node),
    and the last pull the part below `through` where k <= m; what is kept (k > m: the part
    below) goes when the user drops the outputs and `through` (no reference cycle)."""
    saved = []

    def pack(tensor):
        box = _Box(tensor.detach())
        saved.append(weakref.ref(box))  # the graph holds the only reference
        return box

    w = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda box: box.tensor):
        y = torch.tanh(torch.randn(2, 3, dtype=torch.float64) @ w).sum(0)  # m = 4
        outputs = [(y * (i + 1)).sin().sum() for i in range(k)]
    funcgrad.grads(outputs, w, through=y)
    below = 2  # mm's input and tanh's result
    assert sum(ref() is not None for ref in saved) == (0 if k <= 4 else below)
    del y, outputs
    gc.collect()
    assert saved and all(ref() is None for ref in saved)


def test_grads_runs_no_saved_tensor_unpack_hook_of_a_kept_graph():
    """k > numel(through) without retain_graph keeps the part below `through` (it is not
    freed: see Args): telling whether torch freed it must not unpack its saved tensors, which
    runs the user's unpack hooks outside any backward (a non-reentrant checkpoint then
    recomputes its forward: an extra forward, whose activations stay alive with the graph,
    and BatchNorm's running statistics updated once more)."""
    torch.manual_seed(0)
    w = torch.randn(3, dtype=torch.float64, requires_grad=True)
    forwards = []

    def block(t):  # (every node's first saved slot is filled: whichever is probed)
        forwards.append(1)
        return torch.tanh(w).sin() * t

    def run(**kwargs):
        y = torch.utils.checkpoint.checkpoint(
            block, torch.randn(2, 3, dtype=torch.float64), use_reentrant=False
        )  # m = 6
        outputs = [(y * (i + 1)).pow(2).sum() for i in range(8)]  # k = 8 > m
        forwards.clear()
        funcgrad.grads(outputs, w, through=y, **kwargs)
        return len(forwards), outputs

    kept, _ = run(retain_graph=True)
    assert kept == 1  # the one batched pull's recomputation
    spent, outputs = run()
    assert spent == kept, (
        f"{spent - kept} forward(s) of the checkpointed block run outside backward"
    )
    assert _raises(lambda: sum(outputs).backward())


def test_a_grads_call_that_failed_after_freeing_leaves_the_graph_refusing():
    """k <= m: the batched last pull fails in vmap after freeing tanh's node above the
    unbatchable one: the clear error of the Args. The user's backward through that graph
    must then raise before any .grad moves (w, a head's parameter, included)."""
    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, dtype=torch.float64, requires_grad=True)
    y = torch.tanh(Unbatchable.apply(x.repeat(2)[:4]))  # m = 4
    outputs = [(w * y).sum(), (y**2).sum()]  # k = 2
    with pytest.raises(RuntimeError, match=r"cannot run.*Nothing was written"):
        funcgrad.grads(outputs, x, through=y)
    assert _raises(lambda: sum(outputs).backward())
    assert x.grad is None and w.grad is None, "w.grad was written before the error"


def test_grads_unpacks_no_saved_tensor_more_than_with_retain_graph():
    """k > numel(through) without retain_graph keeps the part below `through`: the call
    must unpack its saved tensors no more often than with retain_graph=True (an offloading
    hook would copy back, or give its tensor away, outside any backward)."""
    unpacked = []

    def unpack(tensor):
        unpacked.append(1)
        return tensor

    def run(**kwargs):
        w = torch.randn(3, dtype=torch.float64, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
            y = torch.tanh(w).repeat(2)  # m = 6; TanhBackward0 saves its result
        outputs = [(y * (i + 1)).pow(2).sum() for i in range(8)]  # k = 8
        unpacked.clear()
        funcgrad.grads(outputs, w, through=y, **kwargs)
        return len(unpacked)

    assert run() == run(retain_graph=True)


@pytest.mark.parametrize("retain_graph", [False, True])
def test_outputs_sharing_nodes_above_through_keep_them_for_the_later_ones(retain_graph):
    """Outputs that share a node above `through` (one sin of y for all): each output's
    backward keeps what a later one runs through, the last frees it. Every answer is
    autograd's; without retain_graph a later backward of any output raises torch's error
    before it writes anything, and with it the graph answers again."""
    torch.manual_seed(0)
    w = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    b = torch.zeros((), dtype=torch.float64, requires_grad=True)
    y = torch.tanh(torch.randn(2, 3, dtype=torch.float64) @ w).sum(0)
    shared = (y * 2).sin()
    outputs = [(shared * (i + 1)).cos().sum() + b * i for i in range(3)]
    want = torch.stack([torch.autograd.grad(z, w, retain_graph=True)[0] for z in outputs])
    (got,) = funcgrad.grads(outputs, w, through=y, retain_graph=retain_graph)
    torch.testing.assert_close(got, want)
    if retain_graph:
        (again,) = funcgrad.grads(outputs, w, through=y)
        torch.testing.assert_close(again, want)
        return
    for z in outputs:
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            z.backward()
        assert w.grad is None and b.grad is None


class _Subclass(torch.Tensor):
    """A tensor subclass with its own __torch_function__ (as a user's or a library's)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return super().__torch_function__(func, types, args, kwargs or {})


def test_grads_and_backward_on_a_leaf_of_a_torch_function_subclass():
    """A leaf whose class overrides __torch_function__: torch finds its gradient edge through
    a view that the subclass would see (a new node each time): funcgrad's walk finds the
    leaf's own node, and the answers are autograd's."""
    x = torch.randn(3, dtype=torch.float64).as_subclass(_Subclass).requires_grad_()
    y = torch.tanh(x) * 2
    outputs = [y.pow(2).sum(), y.sin().sum()]
    (got,) = funcgrad.grads(outputs, x, through=y, retain_graph=True)
    for row, z in zip(got, outputs):
        (expected,) = torch.autograd.grad(z, x, retain_graph=True)
        torch.testing.assert_close(
            row.as_subclass(torch.Tensor), expected.as_subclass(torch.Tensor)
        )
    funcgrad.backward(outputs, through=y)
    torch.testing.assert_close(
        x.grad.as_subclass(torch.Tensor), got.sum(0).as_subclass(torch.Tensor)
    )


def test_where_torch_freed_the_whole_graph_nothing_is_marked_and_a_later_call_says_so():
    """Without retain_graph, where the outputs' own backwards and the last pull freed every
    node the call frees (disjoint heads, k <= m), torch's own freed graph answers a later
    backward, as after torch.autograd.grad: no node is marked (reading and writing a mark on
    every node costs ~1 us a node a call). A later funcgrad call then gives its own message
    for torch's error, and writes nothing; where funcgrad kept a part alive (k > m), the
    nodes are marked and a later call is refused before any pass."""
    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    ours = "reached saved tensors of this graph that an earlier backward without retain_graph"
    for again, message in (
        (lambda outputs, y: funcgrad.grads(outputs, x, through=y), ours),
        (lambda outputs, y: funcgrad.backward(outputs, through=y, weighting=lambda g: g[0]), ours),
        (lambda outputs, y: outputs[0].backward(), "Specify retain_graph=True"),  # (torch's)
    ):
        y = torch.tanh(x * 2)
        outputs = [(y * (i + 1)).sin().sum() for i in range(3)]
        graph = _graph.check_paths(tuple(outputs), (x,), (y,), False, "c")
        funcgrad.grads(outputs, x, through=y)
        assert graph.freed and not [n for n in graph.freed if _graph._SPENT in n.metadata]
        with pytest.raises(RuntimeError, match="backward through the graph a second time") as c:
            again(outputs, y)
        assert message in str(c.value)
        assert x.grad is None

    counter = funcgrad.PassCounter()
    y = torch.tanh(counter(x) * 2)[:2]  # m = 2 < k = 3: y's unit directions, the part kept
    outputs = [(y * (i + 1)).sin().sum() for i in range(3)]
    graph = _graph.check_paths(tuple(outputs), (x,), (y,), False, "c")
    funcgrad.grads(outputs, x, through=y)
    assert _graph.spent(graph) == "funcgrad.grads(outputs, inputs, through=...)"
    counter.reset()
    with pytest.raises(RuntimeError, match=r"funcgrad\.grads.* already ran the backward"):
        funcgrad.grads(outputs, x, through=y)
    assert counter.backward == 0


def test_empty_inputs_leave_nothing_freed_below_through_so_the_graph_is_marked():
    """With empty inputs nothing is pulled below `through` (no pass frees it there), so the
    call marks the graph: a second call through it is refused, as torch's would be."""
    x = torch.zeros(0, requires_grad=True)
    y = torch.cat([x.exp(), torch.ones(3)])
    (got,) = funcgrad.grads([(y**2).sum(), y.pow(3).sum()], x, through=y)
    assert got.shape == (2, 0)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        funcgrad.grads([(y**2).sum(), y.pow(3).sum()], x, through=y)


# -- hooks: as in one torch.autograd.grad per output (issue 42, item 2) -----------------------


def _hooked_graph(where, hook):
    """(outputs, params, y, calls): three outputs of y = tanh(lin2(tanh(lin1(x)))), with
    ``hook`` at ``where``; ``calls`` counts its calls."""
    torch.manual_seed(0)
    lin1, lin2 = torch.nn.Linear(3, 4), torch.nn.Linear(4, 5)
    calls = []

    def counted_hook(g):
        calls.append(1)
        return hook(g)

    if where == "parameter":
        lin1.weight.register_hook(counted_hook)
    a = lin1(torch.randn(6, 3))
    if where == "below":
        a.register_hook(counted_hook)
    y = torch.tanh(lin2(torch.tanh(a)))
    if where == "through":
        y.register_hook(counted_hook)
    elif where == "retain_grad":
        y.retain_grad()
    outputs = [(y * (i + 1)).sin().sum() for i in range(3)]
    return outputs, [*lin1.parameters(), *lin2.parameters()], y, calls


@pytest.mark.parametrize("chunk_size", [None, 1])
@pytest.mark.parametrize("hook", ["double", "observe", "clip"])
@pytest.mark.parametrize("where", ["through", "below", "parameter", "retain_grad"])
def test_hooks_fire_as_in_one_autograd_grad_per_output(where, hook, chunk_size):
    """A tensor hook on `through` ran in each output's backward to `through` and again in
    the pass from `through` down: twice torch's gradient for ``2 * g``. Now every hook gives
    the values of ``torch.autograd.grad`` output by output, and a retained ``through.grad``
    is theirs. Calls: once per output on `through` and above; below `through`, once per
    batched pass (one, under vmap, with each output's gradient a row: a row-wise hook such
    as a clip gives torch's values), once per output with ``chunk_size=1``."""
    fn = {
        "double": lambda g: 2 * g,
        "observe": lambda g: None,
        "clip": lambda g: g.clamp(-0.1, 0.1),
    }[hook]
    outputs, params, y, calls = _hooked_graph(where, fn)
    expected = [
        torch.stack(rows)
        for rows in zip(*[torch.autograd.grad(z, params, retain_graph=True) for z in outputs])
    ]
    expected_calls = len(calls)
    expected_retained = y.grad.clone() if where == "retain_grad" else None

    outputs, params, y, calls = _hooked_graph(where, fn)
    got = funcgrad.grads(outputs, params, through=y, chunk_size=chunk_size)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-11)
    batched = where in ("below", "parameter") and chunk_size is None
    assert len(calls) == (1 if batched and expected_calls else expected_calls)
    if where == "retain_grad":
        torch.testing.assert_close(y.grad, expected_retained, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("where", ["module", "parameter"])
def test_hooks_below_through_see_the_outputs_gradients_where_k_exceeds_through(where):
    """With more outputs than `through` has coordinates, `grads` pulls `through`'s unit
    directions and combines them: a hook below `through` would see those, and a nonlinear one
    (a clamp) gave a wrong answer. A module's full backward hook and a hook on an input can
    be seen in the graph: the k outputs' gradients themselves are then pulled."""
    clamp = {
        "module": lambda m, gi, go: tuple(g.clamp(-0.1, 0.1) for g in gi),
        "parameter": lambda g: g.clamp(-0.1, 0.1),
    }[where]

    def graph():
        torch.manual_seed(0)
        lin1, lin2 = torch.nn.Linear(3, 4), torch.nn.Linear(4, 4)
        if where == "module":
            lin2.register_full_backward_hook(clamp)
        else:
            lin1.weight.register_hook(clamp)
        y = torch.tanh(lin2(torch.tanh(lin1(torch.randn(6, 3))))).sum(0)[:2]  # m = 2 < k = 3
        outputs = [(y * (i + 1)).sin().sum() * 10 for i in range(3)]
        return outputs, [*lin1.parameters(), *lin2.parameters()], y

    outputs, params, y = graph()
    expected = [
        torch.stack(rows)
        for rows in zip(*[torch.autograd.grad(z, params, retain_graph=True) for z in outputs])
    ]
    outputs, params, y = graph()
    got = funcgrad.grads(outputs, params, through=y)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("k", [2, 8], ids=["k<m", "k>m"])
def test_grads_of_a_sparse_embedding_gradient(k):
    """Review finding: where k > numel(through), grads combined through's unit directions
    with a tensordot that sparse gradients do not support (a RuntimeError from torch); a
    sparse gradient now loops over the cotangents, as backward does."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 3, sparse=True).double()
    y = emb(torch.tensor([1, 4, 4]))
    outs = [(y * (i + 1)).sin().sum() for i in range(k)]
    want = torch.stack(
        [torch.autograd.grad(o, emb.weight, retain_graph=True)[0].to_dense() for o in outs]
    )
    (got,) = funcgrad.grads(outs, [emb.weight], through=y, retain_graph=True)
    got = got.to_dense() if got.is_sparse else got
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
