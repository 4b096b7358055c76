"""``funcgrad.combine_heads``: one weighted gradient from many heads on one slow f, against
per-head autograd and TorchJD's weightings, in float64."""

from __future__ import annotations

import pytest
import torch
from helpers import _module_case, _requires_grad, assert_tree_close, autograd_reference
from torchjd import aggregation as tjd

import funcgrad


def _encoder_and_heads(k=4):
    torch.manual_seed(0)
    w1, w2 = torch.randn(6, 5), torch.randn(3, 6)
    x = torch.randn(5)

    def f(params):
        return torch.tanh(params["w2"] @ torch.tanh(params["w1"] @ x))

    targets = torch.randn(k, 3)
    heads = [lambda y, t=targets[i], s=i + 1: s * (y - t).pow(2).sum() for i in range(k)]
    return f, heads, {"w1": w1, "w2": w2}


def _combined_reference(f, heads, params, weighting, level):
    _, per_head = autograd_reference(f, heads, (params,))
    rows = torch.stack([torch.cat([g["w1"].flatten(), g["w2"].flatten()]) for g in per_head])
    if level == "features":
        y = f({k: v.detach() for k, v in params.items()}).detach().requires_grad_()
        v = torch.stack([torch.autograd.grad(h(y), y)[0] for h in heads])
        weights = weighting(v @ v.T)
    else:
        weights = weighting(rows @ rows.T)
    combined = weights @ rows
    return {"w1": combined[:30].reshape(6, 5), "w2": combined[30:].reshape(3, 6)}, weights


@pytest.mark.parametrize("strategy", ["auto", "vjp", "jacrev", "jacfwd", "loop"])
@pytest.mark.parametrize("level", ["params", "features"])
@pytest.mark.parametrize("make", [tjd.UPGradWeighting, tjd.MGDAWeighting, tjd.DualProjWeighting])
def test_combine_heads_against_per_head_autograd(make, level, strategy):
    f, heads, params = _encoder_and_heads()
    want, want_weights = _combined_reference(f, heads, params, make(), level)
    values, grad, weights = funcgrad.combine_heads(
        f, heads, make(), level=level, strategy=strategy
    )(params)
    assert_tree_close(grad, want, rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(weights, want_weights, rtol=1e-7, atol=1e-9)
    assert values.shape == (4,)


def test_combine_heads_jacobian_aggregator_mapping_heads_and_aux():
    f, heads, params = _encoder_and_heads()

    def f_aux(p):
        return f(p), {"norm": p["w1"].norm()}

    named = dict(zip("abcd", heads))
    values, grad, weights, aux = funcgrad.combine_heads(f_aux, named, tjd.UPGrad(), has_aux=True)(
        params
    )
    want, want_weights = _combined_reference(f, heads, params, tjd.UPGradWeighting(), "params")
    assert_tree_close(grad, want, rtol=1e-7, atol=1e-9)
    assert list(values) == list(weights) == list("abcd")
    torch.testing.assert_close(torch.stack(list(weights.values())), want_weights)
    assert set(aux) == {"norm"}
    _, grad_nash, weights_nash = funcgrad.combine_heads(f, heads, tjd.GradDrop())(params)
    assert weights_nash is None and grad_nash["w1"].shape == (6, 5)


def test_combine_heads_without_weighting_is_the_gradient_of_the_sum():
    f, heads, params = _encoder_and_heads()
    fn = funcgrad.combine_heads(f, heads)
    _, grad, weights = fn(params)
    want = torch.func.grad(lambda p: sum(h(f(p)) for h in heads))(params)
    assert_tree_close(grad, want)
    torch.testing.assert_close(weights, torch.ones(4))
    assert fn.plan(params).directions == 1
    features_plan = funcgrad.combine_heads(f, heads, tjd.MGDAWeighting(), level="features")
    assert features_plan.plan(params).strategy == "weighted"
    params_plan = funcgrad.combine_heads(f, heads, tjd.MGDAWeighting()).plan(params)
    assert params_plan.directions == min(params_plan.k, params_plan.m)


@pytest.mark.slow  # inductor compiles
@pytest.mark.parametrize("level", ["params", "features"])
def test_combine_heads_compiles_with_a_torch_native_weighting(level):
    f, heads, params = _encoder_and_heads()

    def weighting(gramian):
        return torch.softmax(-torch.diagonal(gramian), 0)

    fn = funcgrad.combine_heads(f, heads, weighting, level=level, strategy="vjp")
    eager = fn(params)
    compiled = torch.compile(fn, fullgraph=True)(params)
    assert_tree_close(compiled[1], eager[1], rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(compiled[2], eager[2])


def test_combine_heads_composes_with_vmap():
    """Per-sample combined gradients: vmap over a batch of inputs, against a loop."""
    torch.manual_seed(0)
    w = torch.randn(3, 4)
    heads = [lambda y: y.sum(), lambda y: y.pow(2).sum()]
    fn = funcgrad.combine_heads(
        lambda w, x: torch.tanh(w @ x), heads, lambda g: torch.softmax(-torch.diagonal(g), 0)
    )
    xs = torch.randn(5, 4)
    batched = torch.func.vmap(lambda x: fn(w, x)[1], in_dims=0)(xs)
    looped = torch.stack([fn(w, x)[1] for x in xs])
    torch.testing.assert_close(batched, looped)


@pytest.mark.parametrize("level", ["params", "features"])
def test_combine_heads_builds_no_graph_of_its_results(level):
    model, heads, x = _module_case()
    weighting = lambda g: torch.ones(g.shape[0], dtype=g.dtype)  # noqa: E731
    values, grad, weights = funcgrad.combine_heads(model, heads, weighting, level=level)(x)
    assert not _requires_grad((values, grad, weights))
    fn = funcgrad.combine_heads(model, heads, weighting, level=level, create_graph=True)
    assert fn(x)[1].requires_grad


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


def test_a_numpy_weighting_inside_vmap_says_why_it_cannot_run():
    """Review finding: TorchJD's UPGradWeighting (quadprog) under torch.func.vmap raised
    torch's "Cannot access data pointer" with no word on the weighting or the transform."""
    weight = torch.randn(5, 4, dtype=torch.float64)
    fn = funcgrad.combine_heads(
        lambda q: torch.tanh(weight @ q), [lambda y: y.sum(), lambda y: y[0]], tjd.UPGradWeighting()
    )
    with pytest.raises(RuntimeError) as raised:
        torch.func.vmap(fn)(torch.randn(3, 4, dtype=torch.float64))
    notes = "\n".join(getattr(raised.value, "__notes__", []))
    assert "UPGradWeighting" in notes and "inside a torch.func transform" in notes
    assert "outside the transform" in notes
