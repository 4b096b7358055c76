"""Adversarial cases for the three entry points (issue 9), each against per-head autograd.

Classes: multi-output ops in the bridge's graph, dependent ``through`` tensors, heads of
wildly different scales, non-finite and extreme values, random ops under forward mode, half
precision, strict check in forward mode, and the everyday calls (module containers as heads,
generator inputs, ``through=x``, zero cotangents).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from helpers import assert_rows_close, autograd_reference
from torch import nn

import funcgrad


def per_head_autograd(zs, inputs):
    """torch.autograd.grad head by head; unused inputs as zeros."""
    out = []
    for z in zs:
        g = torch.autograd.grad(z, inputs, retain_graph=True, allow_unused=True)
        out.append(tuple(torch.zeros_like(x) if gi is None else gi for gi, x in zip(g, inputs)))
    return tuple(torch.stack([row[j] for row in out]) for j in range(len(inputs)))


def assert_grads_match(zs, inputs, through, **kwargs):
    inputs = tuple(inputs) if isinstance(inputs, (list, tuple)) else (inputs,)
    expected = per_head_autograd(zs, inputs)
    got = funcgrad.grads(zs, inputs, through=through, **kwargs)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, equal_nan=True)


# -- 1. multi-output ops: gradient edges, not nodes ---------------------------------------

MULTI_OUTPUT = {
    "unbind": lambda t: t.unbind(),
    "chunk": lambda t: t.chunk(2),
    "split": lambda t: t.split([1, 1]),
    "var_mean": lambda t: torch.var_mean(t.reshape(1, -1) * t.reshape(-1, 1), dim=0),
    "aminmax": lambda t: torch.aminmax(t.reshape(1, -1) * t.reshape(-1, 1), dim=0),
}


@pytest.mark.parametrize("op", MULTI_OUTPUT)
def test_bridge_counts_paths_through_sibling_outputs(op):
    x = torch.randn(2, requires_grad=True)
    first, second = MULTI_OUTPUT[op](torch.sin(x) * 3)
    zs = [(first * second).sum(), (first**2).sum() + second.sum()]
    with pytest.raises(ValueError, match=r"through"):
        funcgrad.grads(zs, x, through=first)


@pytest.mark.parametrize("op", MULTI_OUTPUT)
def test_bridge_through_all_sibling_outputs_is_exact(op):
    x = torch.randn(2, requires_grad=True)
    parts = MULTI_OUTPUT[op](torch.sin(x) * 3)
    zs = [(parts[0] * parts[1]).sum(), (parts[0] ** 2).sum() - parts[1].sum()]
    assert_grads_match(zs, x, through=list(parts))


@pytest.mark.parametrize("op", MULTI_OUTPUT)
def test_bridge_refuses_heads_that_miss_through_via_a_sibling(op):
    x = torch.randn(2, requires_grad=True)
    first, second = MULTI_OUTPUT[op](torch.sin(x) * 3)
    with pytest.raises(ValueError, match=r"outputs\[0\] does not depend on `through`"):
        funcgrad.grads([(second * 2).sum()], x, through=first)


def test_bridge_multi_output_values_index():
    """max(dim) returns values and indices from one node: only the values' edge is through."""
    x = torch.randn(3, 4, requires_grad=True)
    values, _ = (x.exp()).max(dim=1)
    zs = [(values**2).sum(), values.sin().sum(), values[0] * values[-1]]
    assert_grads_match(zs, x, through=values)


# -- 2. dependent and repeated through ----------------------------------------------------


def test_bridge_refuses_dependent_through_before_any_backward():
    x = torch.randn(3, requires_grad=True)
    y1 = torch.sin(x)
    y2 = 2 * y1
    with pytest.raises(ValueError, match=r"through\[1\] is computed from through\[0\]"):
        funcgrad.grads([(y2**2).sum() + y1.sum()], x, through=[y1, y2])
    with pytest.raises(ValueError, match=r"through\[1\] is computed from through\[0\]"):
        funcgrad.grads([(y2**2).sum()], x, through=[y1, y2.exp()])


def test_bridge_refuses_repeated_through():
    x = torch.randn(3, requires_grad=True)
    y = torch.sin(x)
    with pytest.raises(ValueError, match=r"through\[1\].*same tensor as through\[0\]"):
        funcgrad.grads([y.sum()], x, through=[y, y])


def test_bridge_independent_through_is_exact():
    x = torch.randn(3, requires_grad=True)
    y1, y2 = torch.sin(x), torch.cos(x) * x
    zs = [(y1 * y2).sum(), y1.sum(), (y2**3).sum()]
    assert_grads_match(zs, x, through=[y1, y2])


def test_bridge_through_x_itself():
    x = torch.randn(4, requires_grad=True)
    zs = [(x**2).sum(), x.sin().sum()]
    assert_grads_match(zs, x, through=x)


def test_bridge_generator_inputs():
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 5))
    y = model(torch.randn(6, 3))
    zs = [(y[:, i] ** 2).mean() for i in range(5)]
    expected = per_head_autograd(zs, tuple(model.parameters()))
    got = funcgrad.grads(zs, model.parameters(), through=y)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)


# -- 3. heads of wildly different scales ----------------------------------------------------

SCALES = [1e-8, 1e-4, 1.0, 1e4, 1e8]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("k", [3, 6, 12])
def test_scaled_heads_grads_and_pb_many(dtype, k):
    m = 6
    x = torch.randn(5, dtype=dtype, requires_grad=True)
    w = torch.randn(m, 5, dtype=dtype)
    scales = torch.tensor([SCALES[i % len(SCALES)] for i in range(k)], dtype=dtype)
    cot = torch.randn(k, m, dtype=dtype) * scales[:, None]
    y = torch.tanh(w @ x)
    zs = [(c * y).sum() for c in cot]
    expected = per_head_autograd(zs, (x,))[0]
    (got,) = funcgrad.grads(zs, x, through=y)
    rtol = 1e-4 if dtype == torch.float32 else 1e-9
    assert_rows_close(got, expected, rtol)
    _, pb = funcgrad.pullback(lambda t: torch.tanh(w @ t), x.detach())
    assert_rows_close(pb.many(cot)[0], expected, rtol)
    assert_rows_close([pb(c)[0] for c in cot], expected, rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_compose_heads_scaled(dtype):
    x = torch.randn(4, dtype=dtype)
    w = torch.randn(8, 4, dtype=dtype)
    heads = [lambda y, s=s: s * (y**2).sum() + y[0] for s in SCALES]
    for strategy in ["auto", "vjp", "jacrev", "jacfwd", "loop"]:
        _, got = funcgrad.compose_heads(lambda t: torch.sin(w @ t), heads, strategy=strategy)(x)
        _, reference = autograd_reference(lambda t: torch.sin(w @ t), heads, (x,))
        rtol = 1e-4 if dtype == torch.float32 else 1e-9
        for g, e in zip(got, reference):
            torch.testing.assert_close(g, e, rtol=rtol, atol=rtol * e.abs().max())


# -- 4. non-finite and extreme values --------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_bridge_sqrt_at_zero_is_inf_like_autograd(k):
    x = torch.tensor([0.0, 1.0, 4.0], requires_grad=True)
    y = 3 * x
    zs = [(torch.sqrt(y) * (i + 1)).sum() for i in range(k)]
    assert_grads_match(zs, x, through=y)


@pytest.mark.parametrize("strategy", ["auto", "vjp", "jacrev", "jacfwd", "loop"])
def test_compose_heads_sqrt_at_zero(strategy):
    x = torch.tensor([0.0, 1.0, 4.0])
    heads = [lambda y, i=i: (torch.sqrt(y) * (i + 1)).sum() for i in range(4)]
    _, got = funcgrad.compose_heads(lambda t: 3 * t, heads, strategy=strategy)(x)
    _, reference = autograd_reference(lambda t: 3 * t, heads, (x,))
    torch.testing.assert_close(got, torch.stack(reference), equal_nan=True)


@pytest.mark.parametrize("magnitude", [1e20, 1e-25, 1e30, 1e-38])
def test_pullback_float32_extreme_cotangents(magnitude):
    w = torch.randn(4, 3, dtype=torch.float32)
    x = torch.randn(3, dtype=torch.float32)
    _, pb = funcgrad.pullback(lambda t: w @ t, x)
    v = torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=torch.float32) * magnitude
    (got,) = pb(v)
    expected = w.double().T @ v.double()
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=0)
    (many,) = pb.many(torch.stack([v, v * 1e-3]))
    torch.testing.assert_close(many[0].double(), expected, rtol=1e-5, atol=0)


def test_pullback_inf_cotangent_matches_autograd():
    x = torch.tensor([0.0, 1.0, 2.0])
    _, pb = funcgrad.pullback(torch.sin, x)
    v = torch.tensor([float("inf"), 1.0, 0.0])
    (got,) = pb(v)
    (many,) = pb.many(torch.stack([v, torch.ones(3)]))
    xr = x.clone().requires_grad_()
    (expected,) = torch.autograd.grad(torch.sin(xr), xr, v)
    torch.testing.assert_close(got, expected, equal_nan=True)
    torch.testing.assert_close(many[0], expected, equal_nan=True)


# -- 5. random ops under forward mode --------------------------------------------------------


WIDE = torch.randn(32, 8)


def dropout_f(t):  # m = 32 > 2 n = 16: forward mode would win for k > 16 heads
    return torch.nn.functional.dropout(torch.sin(WIDE @ t), p=0.5, training=True)


DROPOUT_HEADS = [lambda y, i=i: (y * (i + 1)).sum() + (y**2)[i] for i in range(3)]


@pytest.mark.parametrize("check", [False, True])
@pytest.mark.parametrize("chunk_size", [None, 1, 3])
@pytest.mark.parametrize("strategy", ["jacfwd", "auto", "vjp", "jacrev", "loop"])
def test_dropout_grads_belong_to_the_returned_values(strategy, chunk_size, check):
    if strategy == "jacfwd" and chunk_size is not None:
        chunk_size = 8  # forward mode takes every column in one pass
    x = torch.randn(8)
    heads = DROPOUT_HEADS * 6  # k = 18 > 2 n
    torch.manual_seed(1)
    if strategy == "auto":  # f draws: linearised on eager autograd, forward mode no candidate
        assert funcgrad.compose_heads(dropout_f, heads).plan(x).strategy == "vjp"
    fn = funcgrad.compose_heads(
        dropout_f, heads, strategy=strategy, chunk_size=chunk_size, check=check
    )
    if strategy == "jacfwd":  # its batched JVP would draw its own masks: reverse mode
        with pytest.warns(funcgrad.FuncgradWarning, match="f draws random numbers"):
            values, got = fn(x)
    else:
        values, got = fn(x)
    after = torch.rand(1)
    torch.manual_seed(1)
    xr = x.clone().requires_grad_()
    y = dropout_f(xr)
    expected_after = torch.rand(1)
    expected = per_head_autograd([h(y) for h in heads], (xr,))[0]
    torch.testing.assert_close(values, torch.stack([h(y) for h in heads]).detach())
    torch.testing.assert_close(got, expected)
    # f's random ops drew exactly what one eager forward draws.
    torch.testing.assert_close(after, expected_after)


# -- 6. half precision ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_pullback_and_grads(dtype):
    w = torch.randn(5, 4).to(dtype)
    x = torch.randn(4).to(dtype)
    cot = torch.randn(3, 5).to(dtype)
    _, pb = funcgrad.pullback(lambda t: torch.tanh(w @ t), x)
    (many,) = pb.many(cot)
    (one,) = pb(cot[0])
    assert many.dtype == one.dtype == dtype
    xr = x.clone().requires_grad_()
    y = torch.tanh(w @ xr)
    expected = per_head_autograd([(c * y).sum() for c in cot], (xr,))[0]
    tol = dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(many.float(), expected.float(), **tol)
    torch.testing.assert_close(one.float(), expected[0].float(), **tol)
    (got,) = funcgrad.grads([(c * y).sum() for c in cot], xr, through=y)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), expected.float(), **tol)


# -- 7. strict check and head errors are not swallowed in forward mode --------------------


def test_strict_check_is_not_swallowed_by_the_forward_mode_fallback(monkeypatch):
    from funcgrad import _engine

    def wrong(*args, **kwargs):
        raise funcgrad.BatchingMismatchError("vmap computed f's JVP wrongly (planted)")

    monkeypatch.setattr(_engine, "forward_columns", wrong)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(funcgrad.BatchingMismatchError, match="planted"):
            funcgrad.compose_heads(torch.sin, DROPOUT_HEADS, strategy="jacfwd", check="strict")(
                torch.randn(4)
            )


def test_head_runtime_error_under_jacfwd_propagates_without_fallback():
    calls = []

    def f(t):
        calls.append(1)
        return torch.sin(t)

    def bad_head(y):
        raise RuntimeError("my head is broken")

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeError, match="my head is broken"):
            funcgrad.compose_heads(f, [bad_head, bad_head], strategy="jacfwd")(torch.randn(3))


# -- everyday calls ------------------------------------------------------------------------


def test_module_list_and_module_dict_heads():
    encoder = nn.Linear(4, 6)
    heads = nn.ModuleList([nn.Linear(6, 1), nn.Linear(6, 1)])
    x = torch.randn(4)

    def f(t):
        return torch.tanh(encoder(t))

    def as_fns(modules):
        return [lambda y, h=h: h(y).sum() for h in modules]

    values, got = funcgrad.compose_heads(f, heads)(x)
    ref_values, reference = autograd_reference(f, as_fns(heads), (x,))
    torch.testing.assert_close(got, torch.stack(reference))
    torch.testing.assert_close(values.reshape(-1), torch.stack(ref_values).reshape(-1))

    named = nn.ModuleDict({"b": nn.Linear(6, 1), "a": nn.Linear(6, 1)})
    values, got = funcgrad.compose_heads(f, named)(x)
    assert set(got) == {"a", "b"}
    _, reference = autograd_reference(f, as_fns(named.values()), (x,))
    for key, e in zip(named.keys(), reference):
        torch.testing.assert_close(got[key], e)


def test_pb_many_with_zero_cotangents_gives_zero_length():
    x = torch.randn(3, 2)
    _, pb = funcgrad.pullback(lambda t: t.sin().sum(0), x)
    (got,) = pb.many(torch.empty(0, 2))
    assert got.shape == (0, 3, 2)


def test_pullback_integer_primal_error_does_not_suggest_argnums():
    with pytest.raises(TypeError) as info:
        funcgrad.pullback(lambda t: t * 2, torch.arange(3))
    assert "argnums" not in str(info.value)
    assert "pullback" in str(info.value)


def test_bridge_repeated_inputs_like_autograd():
    x = torch.randn(3, requires_grad=True)
    y = x.sin()
    zs = [y.sum(), (y * y).sum()]
    got = funcgrad.grads(zs, [x, x], through=y, retain_graph=True)
    expected = per_head_autograd(zs, (x, x))
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)


def test_bridge_create_graph_gives_second_derivatives():
    x = torch.randn(3, requires_grad=True)
    y = x.sin()
    zs = [(y**3).sum(), y.sum()]
    (g,) = funcgrad.grads(zs, x, through=y, create_graph=True)
    (got,) = torch.autograd.grad(g.sum(), x, retain_graph=True)
    firsts = [torch.autograd.grad(z, x, create_graph=True)[0] for z in zs]
    (expected,) = torch.autograd.grad(sum(t.sum() for t in firsts), x)
    torch.testing.assert_close(got, expected)


# -- 8. inside transforms: the documented 0 * inf limit -------------------------------------

SQRT_HEADS = [lambda y, i=i: (torch.sqrt(y) * (i + 1)).sum() for i in range(4)]
AT_ZERO = torch.tensor([[0.0, 1.0, 4.0], [1.0, 2.0, 3.0]])


def _under_vmap(strategy):
    fn = funcgrad.compose_heads(lambda t: 3 * t, SQRT_HEADS, strategy=strategy)
    return torch.func.vmap(lambda x: fn(x)[1])(AT_ZERO)


def test_inside_vmap_vjp_keeps_autograds_inf():
    expected = torch.stack(
        [torch.stack(autograd_reference(lambda t: 3 * t, SQRT_HEADS, (x,))[1]) for x in AT_ZERO]
    )
    got = _under_vmap("vjp")
    torch.testing.assert_close(got, expected)
    assert torch.isinf(got[0, :, 0]).all() and torch.isfinite(got[0, :, 1:]).all()


@pytest.mark.parametrize("strategy", ["jacrev", "jacfwd"])
def test_inside_vmap_products_can_turn_inf_into_nan_as_documented(strategy):
    """If this starts to fail because the NaN is gone, update docs/reliability.md."""
    got = _under_vmap(strategy)
    assert torch.isnan(got[0, :, 1:]).all()
    assert torch.isfinite(got[1]).all()  # finite inputs are unaffected
    page = (Path(__file__).parents[1] / "docs" / "reliability.md").read_text()
    assert "**Inside `vmap`, `grad` or `torch.compile`**" in page
    assert 'Pass `strategy="vjp"` there if' in page


def test_jacfwd_with_chunks_smaller_than_n_is_an_error_before_f_runs():
    calls = []

    def f(t):
        calls.append(1)
        return torch.sin(t)

    fn = funcgrad.compose_heads(f, DROPOUT_HEADS, strategy="jacfwd", chunk_size=2)
    with pytest.raises(ValueError, match=r"strategy='jacfwd'.*chunk_size=2.*once per chunk"):
        fn(torch.randn(3))
    assert not calls


# -- a transform around the call, seen only through a tensor f captures ----------------------

_X0 = torch.randn(3)
_A0 = torch.randn(3)
_TWO_HEADS = [lambda y: y.sum(), lambda y: (y**2).sum()]


def _captured_f(a):
    return lambda x: torch.sin(x * a)


def _per_head_torch_func(a):
    """torch.func's answer: each head's gradient w.r.t. x of head(f(x)), f capturing ``a``."""
    f = _captured_f(a)
    return torch.stack([torch.func.grad(lambda x, h=h: h(f(x)))(_X0) for h in _TWO_HEADS])


def _pulled(a, many):
    _, pb = funcgrad.pullback(_captured_f(a), _X0)
    v = torch.stack([torch.ones(3), 2 * torch.ones(3)])
    return pb.many(v)[0] if many else pb(v[1])[0]


_CAPTURED_ENTRIES = {
    "compose_heads": (
        lambda a: funcgrad.compose_heads(_captured_f(a), _TWO_HEADS)(_X0)[1],
        _per_head_torch_func,
    ),
    "combine_heads features": (
        lambda a: funcgrad.combine_heads(_captured_f(a), _TWO_HEADS, level="features")(_X0)[1],
        lambda a: _per_head_torch_func(a).sum(0),
    ),
    "combine_heads params": (
        lambda a: funcgrad.combine_heads(_captured_f(a), _TWO_HEADS, level="params")(_X0)[1],
        lambda a: _per_head_torch_func(a).sum(0),
    ),
    "pb(v)": (
        lambda a: _pulled(a, many=False),
        lambda a: torch.func.vjp(_captured_f(a), _X0)[1](2 * torch.ones(3))[0],
    ),
    "pb.many(V)": (
        lambda a: _pulled(a, many=True),
        lambda a: torch.stack(
            [torch.func.vjp(_captured_f(a), _X0)[1](s * torch.ones(3))[0] for s in (1.0, 2.0)]
        ),
    ),
}
_TRANSFORMS = {
    "grad": lambda g: torch.func.grad(lambda a: g(a).sum())(_A0),
    "jacrev": lambda g: torch.func.jacrev(g)(_A0),
    "vmap": lambda g: torch.func.vmap(g)(torch.stack([_A0, 2 * _A0])),
}


@pytest.mark.parametrize("transform", _TRANSFORMS)
@pytest.mark.parametrize("entry", _CAPTURED_ENTRIES)
def test_a_transform_seen_only_through_a_captured_tensor(entry, transform):
    """f captures a tensor the transform maps over (x itself is plain): the call is inside
    the transform all the same, so its results keep their dependence on the captured tensor
    (torch.func.grad/jacrev through them), as torch.func's own answer does (found by review:
    the gradient through compose_heads/combine_heads/pullback came back wrong, or torch's
    requires_grad_ error reached the user)."""
    run, reference = _CAPTURED_ENTRIES[entry]
    apply = _TRANSFORMS[transform]
    torch.testing.assert_close(apply(run), apply(reference))


# -- funcgrad inside what funcgrad differentiates, and forward mode under no_grad ------------

_W3 = torch.randn(3, 3)


def _inner_g(z):
    return torch.tanh(_W3 @ z) * z


def _nested_head(y):
    """A head that itself calls funcgrad: the squared norm of a pullback of its input."""
    _, pb = funcgrad.pullback(_inner_g, y)
    return pb(torch.ones(3))[0].pow(2).sum()


def _nested_head_reference(y):
    _, vjp_fn = torch.func.vjp(_inner_g, y)
    return vjp_fn(torch.ones(3))[0].pow(2).sum()


@pytest.mark.parametrize("entry", ["auto", "vjp", "jacrev", "jacfwd", "loop", "features", "params"])
def test_a_head_that_calls_funcgrad_is_differentiated(entry):
    """Heads run on plain autograd count as inside a transform for a funcgrad call in them,
    so its result keeps its graph (found by review: those heads' gradients were zero)."""
    f = lambda x: torch.sin(x) * 2  # noqa: E731
    x = torch.randn(3)
    heads = [_nested_head, lambda y: y.sum()]
    references = [_nested_head_reference, lambda y: y.sum()]
    rows = torch.stack([torch.func.grad(lambda x, h=h: h(f(x)))(x) for h in references])
    if entry in ("features", "params"):
        got = funcgrad.combine_heads(f, heads, level=entry)(x)[1]
        torch.testing.assert_close(got, rows.sum(0))
    else:
        torch.testing.assert_close(funcgrad.compose_heads(f, heads, strategy=entry)(x)[1], rows)


@pytest.mark.parametrize("transform", ["jvp", "jacfwd"])
@pytest.mark.parametrize("entry", ["pullback out", "pb(out)", "compose_heads"])
def test_forward_mode_around_a_call_under_no_grad(entry, transform):
    """Forward mode needs no grad mode: under no_grad a jvp/jacfwd level around the call
    still differentiates through its results (found by review: they were detached)."""
    x = torch.randn(3)

    def run(x):
        if entry == "compose_heads":
            return funcgrad.compose_heads(_inner_g, _TWO_HEADS)(x)[1]
        out, pb = funcgrad.pullback(_inner_g, x)
        return out if entry == "pullback out" else pb(out)[0]

    def reference(x):
        if entry == "compose_heads":
            return torch.stack(
                [torch.func.grad(lambda x, h=h: h(_inner_g(x)))(x) for h in _TWO_HEADS]
            )
        out, vjp_fn = torch.func.vjp(_inner_g, x)
        return out if entry == "pullback out" else vjp_fn(out)[0]

    def apply(g):
        if transform == "jvp":
            return torch.func.jvp(g, (x,), (torch.ones(3),))[1]
        return torch.func.jacfwd(g)(x)

    with torch.no_grad():
        torch.testing.assert_close(apply(run), apply(reference))


def test_jacfwd_of_an_f_that_calls_funcgrad():
    """strategy='jacfwd' runs f's JVPs; a funcgrad call inside f keeps its tangent there
    (found by review: a wrong answer, no warning, even with check='strict')."""

    def f(x):
        out, pb = funcgrad.pullback(_inner_g, x)
        return pb(out)[0]

    def f_reference(x):
        out, vjp_fn = torch.func.vjp(_inner_g, x)
        return vjp_fn(out)[0]

    x = torch.randn(3)
    rows = torch.stack([torch.func.grad(lambda x, h=h: h(f_reference(x)))(x) for h in _TWO_HEADS])
    got = funcgrad.compose_heads(f, _TWO_HEADS, strategy="jacfwd")(x)[1]
    torch.testing.assert_close(got, rows)


@pytest.mark.parametrize("level", ["features", "params"])
def test_combine_heads_values_keep_their_graph_where_the_call_keeps_one(level):
    """Inside torch.func.grad (and with create_graph=True) combine_heads' values carry their
    graph, as compose_heads' do (found by review: d values / d w was zero)."""
    a = torch.randn(3)

    def values_sum(a):
        return funcgrad.combine_heads(_captured_f(a), _TWO_HEADS, level=level)(_X0)[0].sum()

    def reference(a):
        y = _captured_f(a)(_X0)
        return sum(h(y) for h in _TWO_HEADS)

    torch.testing.assert_close(torch.func.grad(values_sum)(a), torch.func.grad(reference)(a))
    x = _X0.clone().requires_grad_()
    values = funcgrad.combine_heads(torch.sin, _TWO_HEADS, level=level, create_graph=True)(x)[0]
    assert values.requires_grad
