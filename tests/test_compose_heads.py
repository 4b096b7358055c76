"""compose_heads against torch.autograd.grad per head, over a grid of functions and options."""

from __future__ import annotations

import contextlib
import math

import optree
import pytest
import torch
from helpers import Pair, assert_tree_close, autograd_reference, tree_index

import funcgrad

STRATEGIES = ["auto", "vjp", "jacrev", "jacfwd", "loop"]


def _case_tensor():
    w = torch.randn(4, 3)
    return (lambda x: torch.tanh(w @ x)), (torch.randn(3),), 0


def _case_tuple_in_dict_out():
    # dict output with unsorted keys: optree sorts them, torch would not.
    def f(ab):
        a, b = ab
        return {"z": torch.sin(b @ a), "a": (a * a).sum()}

    return f, ((torch.randn(2), torch.randn(3, 2)),), 0


def _case_dict_with_none_namedtuple_out():
    def f(d):
        return Pair(p=d["w"] * d["a"].sum(), q=torch.exp(d["w"][:2] - d["a"]))

    return f, ({"w": torch.randn(3), "b": None, "a": torch.randn(2)},), 0


def _case_argnums_tuple():
    def f(x, scale, z):
        return torch.cat([x * scale, torch.cos(z) * x[:1]])

    return f, (torch.randn(2), 3.0, torch.randn(2)), (0, 2)


def _case_complex_output():
    w = torch.randn(3, 2)

    def f(x):
        return torch.exp(1j * (w @ x))  # complex y; heads take real parts

    return f, (torch.randn(2),), 0


def _seed_fun(x):
    return torch.real(torch.trace(torch.matrix_exp(1j * x * torch.ones(6, 6))))


CASES = {
    "tensor": _case_tensor,
    "tuple-in-dict-out": _case_tuple_in_dict_out,
    "dict-none-namedtuple": _case_dict_with_none_namedtuple_out,
    "argnums-tuple": _case_argnums_tuple,
    "complex-y": _case_complex_output,
    "seed": lambda: (_seed_fun, (torch.tensor(0.3),), 0),
}


def _total(y):
    """A real scalar from any of the cases' outputs."""
    import optree

    return sum((leaf.real if leaf.is_complex() else leaf).sum() for leaf in optree.tree_leaves(y))


def _square(y):
    import optree

    return sum((leaf.abs() ** 2).sum() for leaf in optree.tree_leaves(y))


def _wiggle(y):
    import optree

    leaves = optree.tree_leaves(y)
    return (
        torch.sin(_total(y))
        + (leaves[-1].real if leaves[-1].is_complex() else leaves[-1]).flatten()[0] ** 3
    )


HEAD_SETS = {
    "one": [_total],
    "three": [_total, _square, _wiggle],
    "mapping": {"wiggle": _wiggle, "square": _square},
}


def _with_aux(f):
    def g(*args):
        y = f(*args)
        return y, {"total": _total(y).detach(), "note": "aux is returned untouched"}

    return g


@pytest.mark.parametrize("has_aux", [False, True], ids=["plain", "aux"])
@pytest.mark.parametrize("chunk_size", [None, 1, 2], ids=["all", "chunk1", "chunk2"])
@pytest.mark.parametrize("heads_name", list(HEAD_SETS))
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_matches_autograd_per_head(strategy, case, heads_name, chunk_size, has_aux):
    f, args, argnums = CASES[case]()
    heads = HEAD_SETS[heads_name]
    fn = f if not has_aux else _with_aux(f)
    composed = funcgrad.compose_heads(
        fn, heads, argnums=argnums, has_aux=has_aux, strategy=strategy, chunk_size=chunk_size
    )
    nums = argnums if isinstance(argnums, tuple) else (argnums,)
    n = sum(leaf.numel() for a in nums for leaf in optree.tree_leaves(args[a]))
    if strategy == "jacfwd" and chunk_size is not None and chunk_size < n:
        with pytest.raises(ValueError, match="once per chunk"):  # f would run per chunk
            composed(*args)
        return
    result = composed(*args)
    values, grads = result[:2]
    head_list = list(heads.values()) if isinstance(heads, dict) else heads
    ref_values, ref_grads = autograd_reference(f, head_list, args, argnums)
    if isinstance(heads, dict):
        assert list(values) == list(heads) and list(grads) == list(heads)
        for i, key in enumerate(heads):
            torch.testing.assert_close(values[key], ref_values[i])
            assert_tree_close(grads[key], ref_grads[i])
    else:
        assert values.shape == (len(heads),)
        torch.testing.assert_close(values, torch.stack(ref_values))
        for i in range(len(heads)):
            assert_tree_close(tree_index(grads, i), ref_grads[i])
    if has_aux:
        aux = result[2]
        assert aux["note"] == "aux is returned untouched"
        torch.testing.assert_close(aux["total"], _total(f(*args)))


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("n", [7, 40])
def test_seed_closed_form(strategy, n):
    """y = (N-1) + cos(N x) and dy/dx = -N sin(N x) for the seed's slow_fun."""

    def slow_fun(x):
        return torch.real(torch.trace(torch.matrix_exp(1j * x * torch.ones(n, n))))

    x = torch.tensor(0.7)
    y = (n - 1) + math.cos(n * 0.7)
    dy = -n * math.sin(n * 0.7)
    heads = [lambda y: y**2, lambda y: torch.sqrt(y), lambda y: torch.log(y)]
    values, grads = funcgrad.compose_heads(slow_fun, heads, strategy=strategy)(x)
    expected_values = torch.tensor([y**2, math.sqrt(y), math.log(y)])
    expected_grads = torch.tensor([2 * y * dy, 0.5 / math.sqrt(y) * dy, dy / y])
    torch.testing.assert_close(values, expected_values, rtol=1e-10, atol=0)
    torch.testing.assert_close(grads, expected_grads, rtol=1e-9, atol=0)


@pytest.mark.parametrize(
    ("k", "m", "n", "expected"),
    [
        (8, 1, 1, "jacrev"),  # the seed
        (8, 131072, 2_100_000, "vjp"),  # multi-task learning on a shared encoder
        (512, 64, 2048, "jacrev"),  # linear probes on a 64-d feature
        (64, 500, 3, "jacfwd"),  # few inputs, wide output
        (1, 1, 1, "vjp"),
        (4, 4, 4, "vjp"),  # ties go to vjp, which needs no product
    ],
)
def test_auto_plans_from_shapes(k, m, n, expected):
    from funcgrad._plan import make_plan

    plan = make_plan("auto", k, m, n)
    assert plan.strategy == expected
    assert plan.directions == {"vjp": k, "jacrev": m, "jacfwd": n}[expected]


def test_plan_reports_shapes_and_counts_backward_passes():
    from funcgrad._counting import BackwardCounter, counted

    counter = BackwardCounter()

    def slow_fun(x):
        x = counted(x, counter)
        return torch.real(torch.trace(torch.matrix_exp(1j * x * torch.ones(5, 5))))

    heads = [lambda y, p=p: y**p for p in range(1, 9)]
    composed = funcgrad.compose_heads(slow_fun, heads)
    plan = composed.plan(torch.tensor(1.0))
    assert (plan.strategy, plan.k, plan.m, plan.n, plan.directions) == ("jacrev", 8, 1, 1, 1)
    counter.reset()
    composed(torch.tensor(1.0))
    assert counter.backward == 1
    counter.reset()
    funcgrad.compose_heads(slow_fun, heads, strategy="loop")(torch.tensor(1.0))
    assert counter.backward == 8


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_vmap_over_inputs_matches_loop(strategy):
    w = torch.randn(3, 4)
    f = lambda x: torch.tanh(w @ x)  # noqa: E731
    heads = [lambda y: y.sum(), lambda y: (y**2).sum(), lambda y: y[0] * y[1]]
    composed = funcgrad.compose_heads(f, heads, strategy=strategy)
    xs = torch.randn(5, 4)
    values, grads = torch.func.vmap(composed)(xs)
    assert values.shape == (5, 3) and grads.shape == (5, 3, 4)
    for i in range(5):
        v, g = composed(xs[i])
        torch.testing.assert_close(values[i], v)
        torch.testing.assert_close(grads[i], g)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_second_order_matches_double_backward(strategy):
    w = torch.randn(3, 3)
    f = lambda x: torch.sin(w @ x) * x  # noqa: E731
    heads = [lambda y: (y**3).sum(), lambda y: torch.exp(y).prod()]
    weights = torch.randn(2, 3)

    def scalar(x):
        _, grads = funcgrad.compose_heads(f, heads, strategy=strategy)(x)
        return (grads * weights).sum()

    x = torch.randn(3)
    got = torch.func.grad(scalar)(x)

    xr = x.clone().requires_grad_()
    total = 0
    for i, head in enumerate(heads):
        (g,) = torch.autograd.grad(head(f(xr)), xr, create_graph=True)
        total = total + (g * weights[i]).sum()
    (expected,) = torch.autograd.grad(total, xr)
    torch.testing.assert_close(got, expected)


def test_one_record_per_call_signature_bounded_and_holding_no_tensor():
    """What calls learn (y's size, timings, the chunk fit, generator use) is one record per
    call signature, in an LRU of 64; it keeps no argument alive."""
    import gc
    import weakref

    fn = funcgrad.compose_heads(torch.tanh, [lambda y: y.sum(), lambda y: y[0]])
    for n in range(1, 71):
        fn(torch.randn(n))
    signatures = fn._composition._signatures
    assert len(signatures) == 64
    x = torch.randn(3, requires_grad=True)
    _, grads = fn(x)
    alive = weakref.ref(x)
    del x, grads
    gc.collect()
    assert alive() is None
    # requires_grad is part of the signature, as dtype and shape are
    before = len(signatures)
    fn(torch.randn(3, dtype=torch.float32))
    fn(torch.randn(3, dtype=torch.float32, requires_grad=True))
    assert len(signatures) == before  # the LRU is full: both new, both kept, two dropped
    last, new = list(signatures._records)[-2:]
    assert last[1][0][1:] == (torch.float32, torch.device("cpu"), False)
    assert new[1][0][1:] == (torch.float32, torch.device("cpu"), True)


@pytest.mark.parametrize("strategy", ["auto", "vjp", "jacrev", "jacfwd", "loop"])
def test_random_draws_are_those_of_one_eager_forward(strategy):
    """nn.TransformerEncoder in training mode (dropout on non-contiguous tensors, which
    torch.func draws otherwise than eager): values, gradients and the generator's state
    equal one eager forward under the same seed, on the first call and later ones."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.2, batch_first=True)
    encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).double()
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    heads = [lambda y, i=i: (y[..., i] ** 2).sum() for i in range(5)]
    fn = funcgrad.compose_heads(encoder, heads, strategy=strategy)
    combined = funcgrad.combine_heads(encoder, heads, lambda g: g.diagonal(), level="features")
    for _ in range(2):
        torch.manual_seed(1)
        xr = x.clone().requires_grad_()
        y = encoder(xr)
        want_state = torch.get_rng_state()
        want_values = torch.stack([h(y) for h in heads])
        want = torch.stack([torch.autograd.grad(h(y), xr, retain_graph=True)[0] for h in heads])
        torch.manual_seed(1)
        context = (
            pytest.warns(funcgrad.FuncgradWarning, match="draws random numbers")
            if strategy == "jacfwd"
            else contextlib.nullcontext()
        )
        with context:
            values, grads = fn(x)
        assert torch.equal(torch.get_rng_state(), want_state)
        torch.testing.assert_close(values, want_values)
        torch.testing.assert_close(grads, want)
        torch.manual_seed(1)
        values, grad, weights = combined(x)
        torch.testing.assert_close(values, want_values)
        torch.testing.assert_close(grad, torch.einsum("k,k...->...", weights, want))


# -- the engine: torch.func or eager autograd, weighed by auto (issue 29, item 1) ----------


@pytest.mark.parametrize(("margin", "engine"), [(1e9, "autograd"), (0.0, "torch.func")])
def test_auto_times_torch_func_then_eager_autograd_and_keeps_the_faster(
    monkeypatch, margin, engine
):
    # The margin replaces the clock: with 1e9 eager autograd always wins, with 0 never.
    from funcgrad import _heads

    monkeypatch.setattr(_heads, "ENGINE_MARGIN", margin)
    counter, runs = funcgrad.PassCounter(), []
    w = torch.randn(6, 4, dtype=torch.float64)

    def f(x):
        runs.append(1)
        return torch.tanh(w @ counter(x))

    heads = {"a": lambda y: y.sin().sum(), "b": lambda y: (y**2).sum(), "c": lambda y: y[0]}
    fn = funcgrad.compose_heads(f, heads)
    x = torch.randn(4, dtype=torch.float64)
    want_values, want_grads = autograd_reference(f, list(heads.values()), (x,))
    engines = []
    for call in range(5):
        plan = fn.plan(x)
        assert plan.engine_trial == (call == 1)
        engines.append(plan.engine)
        counter.reset()
        runs.clear()
        values, grads = fn(x)
        assert counter.backward == plan.passes and len(runs) == 1  # f runs once a call
        for i, key in enumerate(heads):
            torch.testing.assert_close(values[key], want_values[i])
            torch.testing.assert_close(grads[key], want_grads[i])
            assert not grads[key].requires_grad
    # where eager autograd was faster, the third call re-times torch.func (warm)
    assert engines == ["torch.func", "autograd", "torch.func", engine, engine]
    if engine == "autograd":
        assert "eager autograd" in plan.measured and "on eager autograd" in repr(plan)


def test_eager_autograd_runs_the_passes_it_plans(monkeypatch):
    # On eager autograd each head is pulled through the heads and f at once, vmapped over
    # the heads (the first calls time one more unbatched direction).
    from funcgrad import _heads

    monkeypatch.setattr(_heads, "ENGINE_MARGIN", 1e9)
    counter = funcgrad.PassCounter()
    w = torch.randn(5, 3, dtype=torch.float64)
    heads = [lambda y: y.sum(), lambda y: (y**2).mean(), lambda y: y.max()]
    fn = funcgrad.compose_heads(lambda x: w @ counter(x), heads)
    x = torch.randn(3, dtype=torch.float64)
    for _ in range(3):
        plan = fn.plan(x)
        counter.reset()
        values, grads = fn(x)
        assert counter.backward == plan.passes
    want_values, want_grads = autograd_reference(lambda x: w @ x, heads, (x,))
    torch.testing.assert_close(values, torch.stack(want_values))
    torch.testing.assert_close(grads, torch.stack(want_grads))
    assert fn.plan(x).engine == "autograd"


def test_no_head_reaching_y_gives_zeros_on_eager_autograd(monkeypatch):
    from funcgrad import _heads

    monkeypatch.setattr(_heads, "ENGINE_MARGIN", 1e9)
    heads = [lambda y: torch.ones(()), lambda y: torch.zeros(())]
    fn = funcgrad.compose_heads(torch.sin, heads)
    x = torch.randn(3)
    for _ in range(3):
        values, grads = fn(x)
    assert fn.plan(x).engine == "autograd"
    torch.testing.assert_close(values, torch.tensor([1.0, 0.0]))
    torch.testing.assert_close(grads, torch.zeros(2, 3))


def test_a_graph_of_the_results_stays_on_torch_func(monkeypatch):
    from funcgrad import _heads

    monkeypatch.setattr(_heads, "ENGINE_MARGIN", 1e9)
    fn = funcgrad.compose_heads(torch.sin, [lambda y: y.sum(), lambda y: y[0]], create_graph=True)
    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    for _ in range(3):
        plan = fn.plan(x)
        assert plan.engine == "torch.func" and not plan.engine_trial
        _, grads = fn(x)
    # second order: d/dx of sum(grad of head 0) = sum(-sin(x))
    (second,) = torch.autograd.grad(grads[0].sum(), x)
    torch.testing.assert_close(second, -torch.sin(x))


@pytest.mark.parametrize("calls", [1, 3])
def test_lstm_parameters_equal_the_per_head_loop(calls):
    # The CPU LSTM decides from the global grad mode whether to keep its backward's
    # workspace: torch.func's pullback failed on it without a graph of the results.
    torch.manual_seed(0)
    lstm = torch.nn.LSTM(4, 6, batch_first=True).double()
    x = torch.randn(2, 5, 4, dtype=torch.float64)
    params = dict(lstm.named_parameters())

    def f(p):
        return torch.func.functional_call(lstm, p, (x,))[0]

    heads = [lambda y, i=i: (y[..., i] ** 2).sum() for i in range(3)]
    fn = funcgrad.compose_heads(f, heads)
    for _ in range(calls):
        values, grads = fn(params)
    want_values, want_grads = autograd_reference(f, heads, (params,))
    torch.testing.assert_close(values, torch.stack(want_values))
    for i in range(3):
        assert_tree_close(tree_index(grads, i), want_grads[i])


@pytest.mark.parametrize("create_graph", [False, True])
def test_combine_heads_one_pullback_runs_on_eager_autograd_without_a_result_graph(create_graph):
    # One pullback of the summed heads: the eager forward and backward are the floor.
    w = torch.randn(5, 3, dtype=torch.float64)
    heads = [lambda y: y.sin().sum(), lambda y: (y**2).sum()]
    fn = funcgrad.combine_heads(lambda x: w @ x, heads, create_graph=create_graph)
    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    plan = fn.plan(x)
    assert plan.strategy == "weighted"
    assert plan.engine == ("torch.func" if create_graph else "autograd")
    _, grad, _ = fn(x)
    want = torch.autograd.grad(sum(h(w @ x) for h in heads), x)[0]
    torch.testing.assert_close(grad, want)
    assert grad.requires_grad == create_graph
