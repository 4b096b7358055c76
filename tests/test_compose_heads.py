"""compose_heads against torch.autograd.grad per head, over a grid of functions and options."""

from __future__ import annotations

import contextlib
import math
import warnings

import optree
import pytest
import torch
from helpers import (
    EMPTY_CASES,
    HEAD,
    CountingF,
    Pair,
    _module_case,
    _requires_grad,
    assert_tree_close,
    autograd_reference,
    tree_index,
)
from torch import nn

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
    signatures = fn._composition._records
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
    assert last[2][0][1:] == (torch.float32, torch.device("cpu"), False)
    assert new[2][0][1:] == (torch.float32, torch.device("cpu"), True)


@pytest.mark.parametrize("strategy", ["auto", "vjp", "jacrev", "jacfwd", "loop"])
def test_random_draws_are_those_of_one_eager_forward(strategy):
    """nn.TransformerEncoder in training mode (dropout on non-contiguous tensors, which
    torch.func draws otherwise than eager): values, gradients and the generator's state
    equal one eager forward under the same seed, on the first call and later ones. jacfwd
    warns once that it uses reverse mode, on the first call; the later ones run reverse
    mode at once, quietly."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.2, batch_first=True)
    encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).double()
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    heads = [lambda y, i=i: (y[..., i] ** 2).sum() for i in range(5)]
    fn = funcgrad.compose_heads(encoder, heads, strategy=strategy)
    combined = funcgrad.combine_heads(encoder, heads, lambda g: g.diagonal(), level="features")
    for call in range(2):
        torch.manual_seed(1)
        xr = x.clone().requires_grad_()
        y = encoder(xr)
        want_state = torch.get_rng_state()
        want_values = torch.stack([h(y) for h in heads])
        want = torch.stack([torch.autograd.grad(h(y), xr, retain_graph=True)[0] for h in heads])
        torch.manual_seed(1)
        context = (
            pytest.warns(funcgrad.FuncgradWarning, match="draws random numbers")
            if strategy == "jacfwd" and call == 0
            else contextlib.nullcontext()
        )
        with context, warnings.catch_warnings():
            if not (strategy == "jacfwd" and call == 0):
                warnings.simplefilter("error", funcgrad.FuncgradWarning)
            values, grads = fn(x)
        assert torch.equal(torch.get_rng_state(), want_state)
        torch.testing.assert_close(values, want_values)
        torch.testing.assert_close(grads, want)
        torch.manual_seed(1)
        values, grad, weights = combined(x)
        torch.testing.assert_close(values, want_values)
        torch.testing.assert_close(grad, torch.einsum("k,k...->...", weights, want))


@pytest.mark.parametrize("strategy", ["vjp", "jacrev", "jacfwd", "loop"])
def test_nan_and_inf_propagate_as_in_autograd(strategy):
    def f(x):
        return torch.stack([torch.log(x[0]), x[1] * x[2], torch.sqrt(x[2])])

    heads = [lambda y: y[0] + y[1], lambda y: y[1] * 2, lambda y: y.sum()]
    for x in [torch.tensor([-1.0, 2.0, 3.0]), torch.tensor([1.0, float("inf"), 0.0])]:
        values, grads = funcgrad.compose_heads(f, heads, strategy=strategy)(x)
        ref_values, ref_grads = autograd_reference(f, heads, (x,))
        torch.testing.assert_close(values, torch.stack(ref_values), equal_nan=True)
        torch.testing.assert_close(grads, torch.stack(ref_grads), equal_nan=True)


def test_public_objects_print_what_they_are():
    fn = funcgrad.compose_heads(torch.sin, {"a": lambda y: y.sum()}, chunk_size=2)
    assert repr(fn) == "compose_heads(sin, ['a'], strategy='auto', chunk_size=2)"
    _, pb = funcgrad.pullback(torch.sin, torch.zeros(2))
    assert repr(pb).startswith("Pullback(of pullback at y of shape (2,): 0 direction(s)")
    pb.release()
    assert repr(pb) == "Pullback(released)"


# -- empty tensors ---------------------------------------------------------------------------


def _head(y):
    leaves = optree.tree_leaves(y)
    return sum((leaf**2).sum() for leaf in leaves)


@pytest.mark.parametrize("case", EMPTY_CASES)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_empty_tensors_give_zeros_of_the_right_shapes(case, strategy):
    f, make = EMPTY_CASES[case]
    x = make()
    heads = [_head, lambda y: 2 * _head(y)]
    values, grads = funcgrad.compose_heads(f, heads, strategy=strategy)(x)
    leaves = optree.tree_leaves(x)
    for g, leaf in zip(optree.tree_leaves(grads), leaves):
        assert g.shape == (2, *leaf.shape)
    for i, head in enumerate(heads):
        xs = optree.tree_map(lambda t: t.clone().requires_grad_(), x)
        z = head(f(xs))
        torch.testing.assert_close(values[i], z.detach())
        expected = torch.autograd.grad(z, optree.tree_leaves(xs), allow_unused=True)
        for g, e, leaf in zip(optree.tree_leaves(grads), expected, leaves):
            torch.testing.assert_close(g[i], torch.zeros_like(leaf) if e is None else e)


# -- a head that raises is named ---------------------------------------------------------------


def _broken(y):
    return y[10]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_raising_head_in_a_list_is_named_by_index(strategy):
    with pytest.raises(IndexError, match="out of bounds") as info:
        funcgrad.compose_heads(torch.sin, [lambda y: y.sum(), _broken], strategy=strategy)(
            torch.randn(3)
        )
    assert any("raised by head 1" in note for note in info.value.__notes__)


def test_raising_head_in_a_dict_is_named_by_key():
    heads = {"ok": lambda y: y.sum(), "bad": _broken}
    with pytest.raises(IndexError) as info:
        funcgrad.compose_heads(torch.sin, heads)(torch.randn(3))
    assert any("raised by head 'bad'" in note for note in info.value.__notes__)


def test_raising_stacked_head_fn_is_named():
    heads = funcgrad.stacked_heads(lambda p, y: (p * y).sum() + y[10], torch.randn(4, 3))
    with pytest.raises(IndexError) as info:
        funcgrad.compose_heads(torch.sin, heads)(torch.randn(3))
    assert any("stacked head_fn" in note for note in info.value.__notes__)


def test_a_stacked_head_fn_raising_on_one_call_leaves_the_next_calls_right():
    """The head's name is added once to the exception that propagates (not swallowed),
    every call that raises; a KeyboardInterrupt passes unnamed; calls that do not raise,
    between and after, give the loop's answer."""
    fail: list[BaseException] = []

    def head(p, y):
        if fail:
            raise fail[0]
        return (p * y).sum()

    params = torch.randn(4, 3)
    fn = funcgrad.compose_heads(torch.sin, funcgrad.stacked_heads(head, params))
    x = torch.randn(3)
    expected = torch.stack([torch.cos(x) * p for p in params])
    for error in (ValueError("no"), ValueError("again"), KeyboardInterrupt()):
        torch.testing.assert_close(fn(x)[1], expected)
        fail[:] = [error]
        with pytest.raises(type(error)) as info:
            fn(x)
        notes = getattr(info.value, "__notes__", [])
        named = [note for note in notes if "stacked head_fn" in note]
        assert len(named) == (0 if isinstance(error, KeyboardInterrupt) else 1)
        fail.clear()
    torch.testing.assert_close(fn(x)[1], expected)


def test_raising_module_dict_head_is_named_by_key():
    heads = nn.ModuleDict({"fine": nn.Linear(3, 1), "wrong": nn.Linear(5, 1)})
    with pytest.raises(RuntimeError) as info:
        funcgrad.compose_heads(torch.sin, heads)(torch.randn(3))
    assert any("raised by head 'wrong'" in note for note in info.value.__notes__)


# -- the cheap side: each head's value and cotangent on y, as per-head autograd ---------------


def _assert_matches_reference(f, heads, x, **options):
    values, grads = funcgrad.compose_heads(f, heads, **options)(x)
    ref_values, ref_grads = autograd_reference(f, heads, (x,))
    torch.testing.assert_close(values, torch.stack(ref_values), equal_nan=True)
    torch.testing.assert_close(grads, torch.stack(ref_grads), equal_nan=True)


@pytest.mark.parametrize("strategy", ["vjp", "jacrev", "loop", "auto"])
def test_heads_of_a_matrix_output(strategy):
    torch.manual_seed(0)
    w = torch.randn(5, 3, dtype=torch.float64)
    f = lambda x: torch.tanh(w @ x)  # noqa: E731
    heads = [
        lambda y: (y**2).sum(),
        lambda y: y[0, 1],
        lambda y: torch.logsumexp(y.flatten(), 0),
    ]
    _assert_matches_reference(f, heads, torch.randn(3, 4, dtype=torch.float64), strategy=strategy)


def test_heads_independent_of_y_get_zeros():
    heads = [lambda y: y.sum(), lambda y: torch.tensor(2.0)]
    values, grads = funcgrad.compose_heads(torch.sin, heads)(torch.zeros(3))
    torch.testing.assert_close(values, torch.tensor([0.0, 2.0]))
    torch.testing.assert_close(grads, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))
    _, grads = funcgrad.compose_heads(torch.sin, heads[1:])(torch.zeros(3))
    torch.testing.assert_close(grads, torch.zeros(1, 3))


def test_heads_of_a_tuple_output_touching_some_leaves():
    f = lambda x: (torch.sin(x), torch.cos(x).sum())  # noqa: E731
    heads = [lambda y: y[0].sum(), lambda y: y[1] ** 2, lambda y: y[0][0] * y[1]]
    _assert_matches_reference(f, heads, torch.randn(4, dtype=torch.float64))


def test_heads_of_a_complex_output():
    f = lambda x: torch.exp(1j * x)  # noqa: E731
    heads = [lambda y: y.real.sum(), lambda y: (y.abs() ** 2).sum(), lambda y: (y * y).imag[0]]
    _assert_matches_reference(f, heads, torch.randn(3, dtype=torch.float64))


def test_non_finite_head_gradients_as_autograd():
    heads = [lambda y, i=i: (torch.sqrt(y) * (i + 1)).sum() for i in range(3)]
    _assert_matches_reference(lambda t: 3 * t, heads, torch.tensor([0.0, 1.0, 4.0]))


def test_one_head_and_a_mapping():
    _assert_matches_reference(torch.sin, [lambda y: y.sum()], torch.randn(3, dtype=torch.float64))
    fn = funcgrad.compose_heads(torch.sin, {"b": lambda y: y.sum(), "a": lambda y: y[0]})
    values, grads = fn(torch.zeros(2))
    assert list(values) == ["b", "a"]
    torch.testing.assert_close(grads["a"], torch.tensor([1.0, 0.0]))


def test_a_bad_head_is_named():
    heads = [lambda y: y.sum(), lambda y: y]
    with pytest.raises(ValueError, match=r"head 1 must return a scalar, got shape \(3,\)"):
        funcgrad.compose_heads(torch.sin, heads)(torch.zeros(3))


def test_create_graph_keeps_the_cotangents_dependence_on_x():
    """With create_graph=True the cotangents stay functions of x (torch.func.grad), so the
    second derivative includes the heads' curvature."""
    x = torch.tensor([0.3, -0.7], dtype=torch.float64, requires_grad=True)
    heads = [lambda y: (y**3).sum()]
    _, grads = funcgrad.compose_heads(torch.sin, heads, create_graph=True)(x)
    (got,) = torch.autograd.grad(grads.sum(), x)
    (g,) = torch.autograd.grad((torch.sin(x) ** 3).sum(), x, create_graph=True)
    torch.testing.assert_close(got, torch.autograd.grad(g.sum(), x)[0])


# -- no graph of the results unless create_graph=True --------------------------------------


@pytest.mark.parametrize("strategy", ["vjp", "jacrev", "jacfwd", "loop", "auto"])
def test_compose_heads_builds_no_graph_of_its_results(strategy):
    model, heads, x = _module_case()  # parameters require grad: torch.func would build one
    values, grads = funcgrad.compose_heads(model, heads, strategy=strategy)(x)
    assert not _requires_grad((values, grads))
    values, grads = funcgrad.compose_heads(model, heads, strategy=strategy, create_graph=True)(x)
    assert grads.requires_grad  # through the parameters


@pytest.mark.parametrize("strategy", ["vjp", "jacrev", "jacfwd", "loop"])
def test_create_graph_gives_second_order_as_autograd(strategy):
    """d/dx sum_i grads_i against autograd's double backward, head by head, in float64."""
    torch.manual_seed(0)
    w = torch.randn(3, 4, dtype=torch.float64)
    f = lambda x: torch.sin(w @ x)  # noqa: E731
    heads = [lambda y: (y**2).sum(), lambda y: y.prod()]
    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    _, grads = funcgrad.compose_heads(f, heads, strategy=strategy, create_graph=True)(x)
    (got,) = torch.autograd.grad(grads.sum(), x)
    expected = torch.zeros_like(x)
    for head in heads:
        (g,) = torch.autograd.grad(head(f(x)), x, create_graph=True)
        expected += torch.autograd.grad(g.sum(), x)[0]
    torch.testing.assert_close(got, expected)


def test_inside_torch_func_grad_the_graph_is_built():
    torch.manual_seed(0)
    w = torch.randn(3, 4, dtype=torch.float64)
    f = lambda x: torch.sin(w @ x)  # noqa: E731
    heads = [lambda y: (y**2).sum(), lambda y: y.prod()]
    fn = funcgrad.compose_heads(f, heads, strategy="vjp")
    x = torch.randn(4, dtype=torch.float64)
    got = torch.func.grad(lambda x: fn(x)[1].sum())(x)
    expected = sum(
        torch.func.grad(lambda x, h=h: torch.func.grad(lambda x: h(f(x)))(x).sum())(x)
        for h in heads
    )
    torch.testing.assert_close(got, expected)


# -- stacked heads, and heads on an nn.Module's parameters -------------------------------------


def test_stacked_probes_plan_m_directions_and_match_a_loop():
    torch.manual_seed(1)
    w1 = torch.randn(64, 128) / 10
    f = lambda x: torch.tanh(w1 @ x)  # noqa: E731
    probes = {"w": torch.randn(512, 64), "b": torch.randn(512)}

    def probe(p, y):
        return torch.nn.functional.softplus(p["w"] @ y + p["b"])

    composed = funcgrad.compose_heads(f, funcgrad.stacked_heads(probe, probes))
    x = torch.randn(128)
    assert composed.plan(x).directions == 64
    values, grads = composed(x)
    heads = [
        lambda y, j=j: probe({"w": probes["w"][j], "b": probes["b"][j]}, y) for j in range(512)
    ]
    ref_values, ref_grads = autograd_reference(f, heads[:20], (x,))
    torch.testing.assert_close(values[:20], torch.stack(ref_values))
    torch.testing.assert_close(grads[:20], torch.stack(ref_grads))


@pytest.mark.parametrize("tree", ["bare", "dict"])
def test_stacked_heads_build_their_vmapped_gradient_once(tree):
    """The heads' vmapped grad_and_value is built on the first call for y's tree and reused
    (a tiny call's fixed cost); answers as per-head autograd, float64, for a bare y and a
    tree y."""
    w = torch.randn(5, 3, dtype=torch.float64)
    f = (lambda x: torch.tanh(w @ x)) if tree == "bare" else (lambda x: {"a": w @ x, "b": x})
    params = {"w": torch.randn(4, 5, dtype=torch.float64), "b": torch.randn(4, dtype=torch.float64)}

    def probe(p, y):
        y = y if tree == "bare" else y["a"].sin() * y["b"].sum()
        return torch.nn.functional.softplus(p["w"] @ y + p["b"])

    heads = funcgrad.stacked_heads(probe, params)
    composed = funcgrad.compose_heads(f, heads, strategy="vjp")
    x = torch.randn(3, dtype=torch.float64)
    one = [lambda y, j=j: probe({"w": params["w"][j], "b": params["b"][j]}, y) for j in range(4)]
    ref_values, ref_grads = autograd_reference(f, one, (x,))
    for _ in range(3):
        values, grads = composed(x)
        torch.testing.assert_close(values, torch.stack(ref_values))
        torch.testing.assert_close(grads, torch.stack(ref_grads))
    assert len(heads._cotangent_fns) == 1


class Encoder(torch.nn.Module):
    def __init__(self, d_in=12, d_hidden=16, d_out=8):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(d_in, d_hidden), torch.nn.GELU(), torch.nn.Linear(d_hidden, d_out)
        )

    def forward(self, x):
        return self.net(x)


def test_multi_task_gradients_on_module_parameters():
    encoder = Encoder()
    batch = torch.randn(10, 12)
    tasks = []
    for t in range(4):
        w = torch.randn(3 if t % 2 else 1, 8)
        if t % 2:  # linear + cross-entropy
            target = torch.randint(0, 3, (10,))
            tasks.append(lambda z, w=w, y=target: torch.nn.functional.cross_entropy(z @ w.T, y))
        else:  # linear + MSE
            target = torch.randn(10, 1)
            tasks.append(lambda z, w=w, y=target: torch.nn.functional.mse_loss(z @ w.T, y))

    def f(params, x):
        return torch.func.functional_call(encoder, params, (x,))

    params = {name: p.detach() for name, p in encoder.named_parameters()}
    losses, grads = funcgrad.compose_heads(f, tasks)(params, batch)
    assert set(grads) == set(params) and grads["net.0.weight"].shape == (4, 16, 12)
    for t, task in enumerate(tasks):
        loss = task(encoder(batch))
        reference = torch.autograd.grad(loss, list(encoder.parameters()))
        torch.testing.assert_close(losses[t], loss.detach())
        for (name, _), expected in zip(encoder.named_parameters(), reference):
            torch.testing.assert_close(grads[name][t], expected)


# -- under torch.compile ------------------------------------------------------------------


@pytest.mark.slow  # inductor compiles five graphs
@pytest.mark.parametrize("strategy", ["auto", "vjp", "jacrev", "jacfwd", "loop"])
def test_torch_compile_fullgraph_matches_eager(strategy):
    torch._dynamo.reset()
    w = torch.randn(4, 3)
    f = lambda x: {"y": torch.tanh(w @ x), "s": x.sum()}  # noqa: E731
    heads = [lambda y: y["y"].sum() * y["s"], lambda y: (y["y"] ** 2).sum(), lambda y: y["y"][0]]
    composed = funcgrad.compose_heads(f, heads, strategy=strategy)
    compiled = torch.compile(composed, fullgraph=True)
    x = torch.randn(3)
    values, grads = compiled(x)
    eager_values, eager_grads = composed(x)
    torch.testing.assert_close(values, eager_values)
    torch.testing.assert_close(grads, eager_grads)


@pytest.mark.slow  # inductor compiles
def test_compiled_steady_state_on_a_module_matches_eager():
    """The README's recipe: compile the whole compose_heads call of an nn.Module with list
    heads (fullgraph=True); it equals eager, builds no graph of its results, and later calls
    on the same shapes reuse the compiled graph."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8))
    w = torch.randn(6, 8)
    heads = [lambda y, i=i: (y @ w[i]).tanh().mean() for i in range(6)]
    fn = funcgrad.compose_heads(mlp, heads, strategy="vjp")
    compiled = torch.compile(fn, fullgraph=True)
    for x in (torch.randn(4, 8), torch.randn(4, 8)):
        values, grads = compiled(x)
        eager_values, eager_grads = fn(x)
        torch.testing.assert_close(values, eager_values)
        torch.testing.assert_close(grads, eager_grads)
        assert not grads.requires_grad


# -- bad input: a clear error naming the argument and the head, before f runs ----------------


@pytest.mark.parametrize(
    ("heads", "error", "match"),
    [
        (
            [HEAD, "not a function"],
            TypeError,
            r"compose_heads\(f, heads\): head at index 1 must be callable",
        ),
        (
            {"a": HEAD, "b": 3},
            TypeError,
            r"head at key 'b' must be callable y -> scalar, got int 3",
        ),
        ([], ValueError, r"compose_heads\(f, heads\): `heads` is empty"),
        ({}, ValueError, r"`heads` is empty"),
        (HEAD, TypeError, r"got a single callable .* Wrap it in a list: heads=\[head\]"),
        (42, TypeError, r"`heads` must be a sequence or a mapping of callables"),
    ],
)
def test_bad_heads(heads, error, match):
    with pytest.raises(error, match=match):
        funcgrad.compose_heads(torch.tanh, heads)


def test_unknown_strategy():
    with pytest.raises(
        ValueError, match=r"unknown `strategy` 'fast'; expected one of 'auto', 'vjp'"
    ):
        funcgrad.compose_heads(torch.tanh, [HEAD], strategy="fast")


@pytest.mark.parametrize(
    ("argnums", "error", "match"),
    [
        (2, ValueError, r"`argnums` entry 2 is out of range: f was called with 2 positional"),
        ((0, -2), ValueError, r"`argnums` \(0, -2\) names the same argument twice"),
        ((), TypeError, r"`argnums` must be an int or a non-empty tuple of ints"),
        ("0", TypeError, r"`argnums` must be an int or a tuple of ints, got '0'"),
    ],
)
def test_bad_argnums_before_f_runs(argnums, error, match):
    f = CountingF()
    with pytest.raises(error, match=match):
        funcgrad.compose_heads(lambda x, y: f(x * y), [HEAD], argnums=argnums)(
            torch.randn(2), torch.randn(2)
        )
    assert f.calls == 0


def test_has_aux_without_a_pair():
    with pytest.raises(TypeError, match=r"with has_aux=True, f must return a pair \(output, aux\)"):
        funcgrad.compose_heads(torch.tanh, [HEAD], has_aux=True)(torch.randn(3))


@pytest.mark.parametrize("strategy", ["auto", "vjp", "jacrev", "jacfwd", "loop"])
@pytest.mark.parametrize(
    ("bad_head", "error", "match"),
    [
        (lambda y: y, ValueError, r"head 1 must return a scalar, got shape \(3,\)\. Reduce it"),
        (
            lambda y: (y > 0).sum(),
            TypeError,
            r"head 1 must return a real floating-point scalar, got dtype torch.int64",
        ),
        (
            lambda y: (1j * y).sum(),
            TypeError,
            r"head 1 must return a real .*complex128\. Take \.real",
        ),
        (lambda y: 1.0, TypeError, r"head 1 must return a real scalar tensor, got float 1.0"),
    ],
)
def test_bad_head_outputs_name_the_head(strategy, bad_head, error, match):
    with pytest.raises(error, match=r"compose_heads\(f, heads\): " + match):
        funcgrad.compose_heads(torch.tanh, [HEAD, bad_head], strategy=strategy)(torch.randn(3))


def test_bad_head_in_a_mapping_and_in_stacked_heads():
    with pytest.raises(ValueError, match=r"head 'bad' must return a scalar"):
        funcgrad.compose_heads(torch.tanh, {"ok": HEAD, "bad": lambda y: y})(torch.randn(3))
    stacked = funcgrad.stacked_heads(lambda w, y: w * y, torch.randn(4, 3))
    with pytest.raises(ValueError, match=r"stacked head_fn must return a scalar, got shape \(3,\)"):
        funcgrad.compose_heads(torch.tanh, stacked)(torch.randn(3))


def test_bad_stacked_params():
    with pytest.raises(ValueError, match=r"same leading size k .* got sizes \[3, 4\]"):
        funcgrad.stacked_heads(lambda p, y: y.sum(), {"a": torch.ones(3, 2), "b": torch.ones(4)})
    with pytest.raises(ValueError, match=r"`params` leaf \['s'\] must be a tensor with a leading"):
        funcgrad.stacked_heads(lambda p, y: y.sum(), {"s": torch.tensor(1.0)})
    with pytest.raises(TypeError, match=r"`head_fn` must be callable"):
        funcgrad.stacked_heads("f", torch.ones(3))


# -- on eager autograd, and torch.func's pullback in grad mode ----------------------------------


def test_no_head_reaching_y_gives_zeros_on_eager_autograd():
    heads = [lambda y: torch.ones(()), lambda y: torch.zeros(())]
    fn = funcgrad.compose_heads(torch.sin, heads)
    x = torch.randn(3)
    assert fn.plan(x).engine == "autograd"  # (auto's first call on new shapes)
    values, grads = fn(x)
    torch.testing.assert_close(values, torch.tensor([1.0, 0.0]))
    torch.testing.assert_close(grads, torch.zeros(2, 3))


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


def test_forward_mode_from_several_threads_answers_each_call_exactly():
    """Review finding: torch's forward-mode levels are global to the process, and two
    threads in jacfwd at once corrupted each other's tangents (a wrong answer about one run
    in five) or fell back with a warning naming the wrong cause. One at a time now."""
    import threading

    heads = [lambda y: y.sum(), lambda y: (y**2).sum()]

    def f(q):
        return torch.tanh(q * 2.0).cumsum(-1)

    fn = funcgrad.compose_heads(f, heads, strategy="jacfwd")
    errors, failures = [], []

    def work(seed):
        try:
            for j in range(15):
                z = torch.randn(3 + (seed + j) % 3, dtype=torch.float64)
                want = torch.stack([torch.func.grad(lambda u, h=h: h(f(u)))(z) for h in heads])
                with warnings.catch_warnings():
                    warnings.simplefilter("error", funcgrad.FuncgradWarning)  # no fallback
                    grads = fn(z)[1]
                errors.append(float((grads - want).abs().max()))
        except Exception as error:  # reported below, with the errors
            failures.append(repr(error))

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures
    assert len(errors) == 60 and max(errors) < 1e-10


def _hooked(weight, hook):
    def f(q):
        h = weight @ q
        if h.requires_grad:
            h.register_hook(hook)
        return torch.sin(h)

    return f


def _per_head_autograd(f, heads, x):
    rows = []
    for head in heads:
        leaf = x.clone().requires_grad_()
        rows.append(torch.autograd.grad(head(f(leaf)), leaf)[0])
    return torch.stack(rows)


@pytest.mark.parametrize("strategy", ["auto", "vjp", "loop"])
def test_a_nonlinear_hook_in_f_gives_autograds_answer_on_every_call(strategy):
    """Review finding: a tensor hook registered in f (a clamp) is not linear in its gradient,
    so y's unit directions combined (jacrev) and forward mode (no backward hook runs) gave
    other answers than autograd's, and auto switched between them from call to call. f's
    hook is seen on the first call; from then on only the heads' cotangents go through f."""
    torch.manual_seed(0)
    weight = torch.randn(40, 2, dtype=torch.float64)  # n = 2, m = 40, k = 30: forward mode's
    f = _hooked(weight, lambda g: g.clamp(-0.05, 0.05))
    heads = [lambda y, i=i: y[i] * y[i + 5] for i in range(30)]
    fn = funcgrad.compose_heads(f, heads, strategy=strategy)
    x = torch.randn(2, dtype=torch.float64)
    want = _per_head_autograd(f, heads, x)
    for _ in range(5):
        torch.testing.assert_close(fn(x)[1], want)
        assert fn.plan(x).strategy in ("vjp", "loop")


def test_jacrev_is_refused_for_an_f_that_registers_a_hook():
    f = _hooked(torch.randn(5, 4, dtype=torch.float64), lambda g: 3 * g)
    fn = funcgrad.compose_heads(f, [lambda y: y.sum(), lambda y: y[0]], strategy="jacrev")
    with pytest.raises(ValueError, match=r"registers a tensor hook.*strategy='jacrev'.*'vjp'"):
        fn(torch.randn(4, dtype=torch.float64))


def test_a_head_that_changes_y_in_place_is_told_so():
    fn = funcgrad.compose_heads(torch.sin, [lambda y: y.mul_(2).sum(), lambda y: y.sum()])
    with pytest.raises(RuntimeError) as raised:
        fn(torch.randn(3, dtype=torch.float64))
    notes = "\n".join(getattr(raised.value, "__notes__", []))
    assert "head 0 changes y (f's output) in place" in notes and "y * 2" in notes


def test_retain_grad_in_f_falls_back_to_eager_autograd_with_one_warning():
    """Review finding: torch.func refuses Tensor.retain_grad() inside f, which eager autograd
    (and funcgrad.pullback) run as they are: compose_heads let torch's error through."""
    weight, x = torch.randn(5, 4, dtype=torch.float64), torch.randn(4, dtype=torch.float64)

    def f(q):
        h = weight @ q
        if h.requires_grad:
            h.retain_grad()
        return torch.tanh(h)

    heads = [lambda y: y.sum(), lambda y: y[0]]
    with pytest.warns(funcgrad.FuncgradWarning, match=r"retain_grad\(\).*fell back to eager"):
        grads = funcgrad.compose_heads(f, heads, strategy="vjp")(x)[1]
    torch.testing.assert_close(grads, _per_head_autograd(f, heads, x))
