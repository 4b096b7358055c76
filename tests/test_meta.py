"""A dry run of shapes on the ``meta`` device: every entry point reads no value (no
``.item()``, no ``bool(t)``), so it runs and gives results of the right shapes."""

from __future__ import annotations

import pytest
import torch

import funcgrad


def _encoder_and_losses():
    with torch.device("meta"):
        encoder = torch.nn.Linear(4, 8)
        heads = torch.nn.ModuleList([torch.nn.Linear(8, 1) for _ in range(3)])
        x = torch.randn(5, 4)
    features = encoder(x)
    return encoder, heads, features, [head(features).sum() for head in heads]


@pytest.mark.parametrize("level", ["features", "params"])
@pytest.mark.parametrize("weighting", [None, "ones"])
def test_backward_on_meta(level, weighting):
    encoder, heads, features, losses = _encoder_and_losses()
    rule = None if weighting is None else (lambda g: torch.ones_like(g[0]))
    weights = funcgrad.backward(losses, through=features, level=level, weighting=rule)
    assert weights.shape == (3,)
    assert encoder.weight.grad.is_meta and encoder.weight.grad.shape == (8, 4)
    assert heads[0].weight.grad.shape == (1, 8)


@pytest.mark.parametrize("strategy", ["auto", "vjp", "jacrev", "jacfwd", "loop"])
def test_compose_and_combine_heads_on_meta(strategy):
    x = torch.randn(5, 4, device="meta")
    heads = [lambda y: y.sum(), lambda y: y[0, 0], lambda y: (y**2).mean()]
    values, grads = funcgrad.compose_heads(torch.tanh, heads, strategy=strategy)(x)
    assert values.is_meta and values.shape == (3,) and grads.shape == (3, 5, 4)
    fn = funcgrad.combine_heads(torch.tanh, heads, lambda g: torch.ones_like(g[0]))
    assert fn(x)[1].shape == (5, 4)


def test_grads_and_pullback_on_meta():
    x = torch.randn(6, device="meta", requires_grad=True)
    y = torch.sin(x)[:3]
    (got,) = funcgrad.grads([y.sum(), y[0], y[1] * y[2], (y**2).sum()], x, through=y)
    assert got.is_meta and got.shape == (4, 6)
    _, pb = funcgrad.pullback(torch.sin, torch.randn(3, device="meta"))
    assert pb.many(torch.randn(2, 3, device="meta"))[0].shape == (2, 3)
