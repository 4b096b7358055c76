"""The mathematics as properties, with hypothesis over random shapes, trees and heads.

``FUNCGRAD_HYPOTHESIS_PROFILE=thorough pytest tests/test_properties.py`` runs 1000 examples
per property (the default profile runs 25).
"""

from __future__ import annotations

import optree
import pytest
import torch
from helpers import (
    assert_rows_close,
    assert_tree_close,
    autograd_reference,
    autograd_vjp,
    tree_index,
)
from hypothesis import given
from hypothesis import strategies as st

import funcgrad

ACTIVATIONS = [torch.sin, torch.tanh, torch.square, lambda t: torch.exp(-(t**2))]
TREE_KINDS = ["tensor", "tuple", "dict", "dict-with-none"]


@st.composite
def problems(draw):
    """A random MLP f on a random pytree input, with random real heads."""
    seed = draw(st.integers(0, 2**31 - 1))
    sizes = draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))
    hidden, m = draw(st.integers(1, 6)), draw(st.integers(1, 5))
    kind = draw(st.sampled_from(TREE_KINDS))
    k = draw(st.integers(1, 6))
    acts = draw(st.lists(st.integers(0, len(ACTIVATIONS) - 1), min_size=k, max_size=k))
    gen = torch.Generator().manual_seed(seed)
    leaves = [torch.randn(s, generator=gen) for s in sizes]
    if kind == "tensor":
        leaves = leaves[:1]
        primal = leaves[0]
    elif kind == "tuple":
        primal = tuple(leaves)
    else:
        primal = {f"k{len(leaves) - i}": leaf for i, leaf in enumerate(leaves)}  # unsorted keys
        if kind == "dict-with-none":
            primal["none"] = None
    n = sum(leaf.numel() for leaf in leaves)
    w1, w2 = torch.randn(hidden, n, generator=gen), torch.randn(m, hidden, generator=gen)

    def f(p):
        x = torch.cat(optree.tree_leaves(p))
        h = torch.tanh(w1 @ x)
        return {"y": w2 @ h, "extra": h[:1] * x[0]}

    coefficients = torch.randn(k, m, generator=gen)
    heads = [
        (
            lambda y, c=coefficients[j], a=ACTIVATIONS[acts[j]]: (
                (c * a(y["y"])).sum() + y["extra"].sum()
            )
        )
        for j in range(k)
    ]
    return f, primal, heads


@given(
    problems(),
    st.sampled_from(["auto", "vjp", "jacrev", "jacfwd", "loop"]),
    st.sampled_from([None, 1, 2]),
)
def test_every_strategy_equals_per_head_autograd(problem, strategy, chunk_size):
    f, primal, heads = problem
    fn = funcgrad.compose_heads(f, heads, strategy=strategy, chunk_size=chunk_size)
    n = sum(leaf.numel() for leaf in optree.tree_leaves(primal))
    if strategy == "jacfwd" and chunk_size is not None and chunk_size < n:
        with pytest.raises(ValueError, match="once per chunk"):
            fn(primal)
        return
    values, grads = fn(primal)
    ref_values, ref_grads = autograd_reference(f, heads, (primal,))
    torch.testing.assert_close(values, torch.stack(ref_values))
    for i, expected in enumerate(ref_grads):
        assert_tree_close(tree_index(grads, i), expected)


def _inner(a, b):
    return sum((u * v).sum() for u, v in zip(optree.tree_leaves(a), optree.tree_leaves(b)))


@given(problems(), st.booleans())
def test_adjoint_identity_against_jvp(problem, reuse):
    f, primal, _ = problem
    out, pb = funcgrad.pullback(f, primal, reuse=reuse)
    leaves, treedef = optree.tree_flatten(primal)
    tangent = [torch.randn_like(leaf) for leaf in leaves]
    flat_f = lambda *ls: optree.tree_leaves(f(optree.tree_unflatten(treedef, ls)))  # noqa: E731
    _, jv = torch.func.jvp(flat_f, tuple(leaves), tuple(tangent))
    for _ in range(3):
        u = optree.tree_map(torch.randn_like, out)
        (jtu,) = pb(u)
        torch.testing.assert_close(
            _inner(u, jv), _inner(jtu, optree.tree_unflatten(treedef, tangent))
        )


# Subnormal coefficients are left out: a row scaled by 2e-311 keeps only a few significant
# bits, so its direction is no longer within roundoff of span(u, v) and it is pulled back as
# a new direction (still exact, one pass more than the count asserted below).
@given(
    problems(),
    st.floats(-3, 3, allow_subnormal=False),
    st.floats(-3, 3, allow_subnormal=False),
)
def test_pullback_is_linear_and_matches_autograd(problem, alpha, beta):
    f, primal, _ = problem
    out, pb = funcgrad.pullback(f, primal, reuse=True)
    u, v = optree.tree_map(torch.randn_like, out), optree.tree_map(torch.randn_like, out)
    combo = optree.tree_map(lambda a, b: alpha * a + beta * b, u, v)
    pu, pv, pcombo = pb(u)[0], pb(v)[0], pb(combo)[0]
    assert_tree_close(
        pcombo, optree.tree_map(lambda a, b: alpha * a + beta * b, pu, pv), rtol=1e-8, atol=1e-10
    )
    assert_tree_close(pcombo, autograd_vjp(f, primal, combo), rtol=1e-8, atol=1e-10)
    assert pb.stats.vjps <= 2


@given(
    st.integers(0, 2**31 - 1),
    st.integers(1, 5),
    st.integers(1, 6),
    st.lists(st.integers(-8, 8), min_size=1, max_size=10),
    st.sampled_from([torch.float32, torch.float64]),
)
def test_rows_of_any_scale_are_pulled_back_exactly(seed, n, m, exponents, dtype):
    """pb.many and grads with cotangent rows scaled by 1e-8..1e8, some repeated (low rank)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(m, n, generator=gen, dtype=dtype)
    x = torch.randn(n, generator=gen, dtype=dtype)
    base = torch.randn(max(1, len(exponents) // 2), m, generator=gen, dtype=dtype)
    scales = torch.tensor([10.0**e for e in exponents], dtype=dtype)
    cot = base[torch.arange(len(exponents)) % len(base)] * scales[:, None]

    xr = x.clone().requires_grad_()
    y = torch.tanh(w @ xr)
    expected = torch.stack([torch.autograd.grad(y, xr, c, retain_graph=True)[0] for c in cot])
    rtol = 1e-4 if dtype == torch.float32 else 1e-9
    _, pb = funcgrad.pullback(lambda t: torch.tanh(w @ t), x)
    assert_rows_close(pb.many(cot)[0], expected, rtol)
    zs = [(c * y).sum() for c in cot]
    assert_rows_close(funcgrad.grads(zs, xr, through=y)[0], expected, rtol)


MULTI_OUTPUT_OPS = [
    lambda t: t.unbind(0),
    lambda t: t.chunk(2, dim=0),
    lambda t: t.split(1, dim=0),
    lambda t: torch.var_mean(t, dim=0),
    lambda t: torch.aminmax(t, dim=0),
]


@given(
    st.integers(0, 2**31 - 1),
    st.lists(st.integers(0, len(MULTI_OUTPUT_OPS) - 1), min_size=1, max_size=3),
    st.integers(1, 5),
    st.booleans(),
)
def test_bridge_on_random_multi_output_graphs(seed, ops, k, miss_one):
    """Graphs built from ops with several outputs (one node, several gradient edges): through
    = all outputs of the last op gives autograd's answer; leaving one out is an error."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, generator=gen, requires_grad=True)
    h = torch.sin(x) * 3
    for op in ops[:-1]:  # earlier multi-output ops, recombined into one tensor
        h = torch.stack([p.reshape(-1)[:3] for p in MULTI_OUTPUT_OPS[op](h)][:2]) + h[:2, :3]
    parts = list(MULTI_OUTPUT_OPS[ops[-1]](h))
    coefficients = torch.randn(k, len(parts), generator=gen)
    zs = [sum(c * (p**2).sum() + p.sum() for c, p in zip(row, parts)) for row in coefficients]
    if miss_one and len(parts) > 1:
        try:
            funcgrad.grads(zs, x, through=parts[1:])
        except ValueError as error:
            assert "other than through" in str(error)
        else:
            raise AssertionError("a path around `through` went unnoticed")
        return
    expected = torch.stack([torch.autograd.grad(z, x, retain_graph=True)[0] for z in zs])
    (got,) = funcgrad.grads(zs, x, through=parts)
    torch.testing.assert_close(got, expected)
