"""The cheap side: each head's value and cotangent on y, and backward's per-task gradients.
Eager calls that build no graph of their results take plain autograd on a detached y, one
``autograd.grad`` per head, against per-head autograd in float64."""

from __future__ import annotations

import pytest
import torch
from helpers import autograd_reference

import funcgrad


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


@pytest.mark.parametrize("level", ["features", "params"])
def test_backward_collects_the_losses_gradients_as_autograd(level):
    """The per-task cotangents and each task's own gradients against a loop of
    torch.autograd.grad; one loss has an infinite derivative on its path (sqrt at 0)."""
    torch.manual_seed(0)
    encoder = torch.nn.Linear(3, 4).double()
    heads = [torch.nn.Linear(4, 1).double() for _ in range(3)]
    x = torch.randn(5, 3, dtype=torch.float64)

    def losses_of(features):
        return [
            heads[0](features).pow(2).mean(),
            heads[1](features).tanh().sum(),
            torch.sqrt(torch.relu(heads[2](features))).sum(),  # relu makes zeros: sqrt at 0
        ]

    features = encoder(x)
    losses = losses_of(features)
    params = [*encoder.parameters(), *(p for h in heads for p in h.parameters())]
    want = [torch.zeros_like(p) for p in params]
    for loss in losses:
        for w, g in zip(
            want, torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
        ):
            if g is not None:
                w += g
    funcgrad.backward(losses, through=features, level=level)
    for p, w in zip(params, want):
        torch.testing.assert_close(p.grad, w, equal_nan=True)
