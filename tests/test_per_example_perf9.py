"""Session 9's cost change of the per-example rules, exact in float64 against a per-example
autograd loop and counted (never timed): the materialised rule's Gram forms the upper
triangle of G alone (row blocks against the examples from their first on), and G is
mirrored from it."""

from __future__ import annotations

import pytest
import torch
from helpers import per_example_jacobian
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import funcgrad
from funcgrad._per_example._layer import _GRAM_BLOCKED_FROM

# T ≫ d, p: the materialised rule (B·T·d·p + B²·d·p) is the cheaper; d·p = 2,304, so that the
# Gram products of B >= 128 are large enough to be formed in blocks
WIDTH, LENGTH = 48, 40


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH, bias=False), nn.Tanh()).double()


def _losses(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).sum((1, 2))


@pytest.mark.parametrize("batch", [20, 32, 77, 128, 300])
def test_the_materialised_gram_forms_the_upper_triangle_alone(batch):
    """G from the materialised Linear rule equals the loop's ``J Jᵀ`` (both triangles: the
    lower one mirrored), and its Gram products (``aten.mm``; the per-example gradients are
    formed by ``bmm``) cost (1 + step/B)/2 of the full ``2·B²·d·p`` with step = max(32,
    B/8), where there are two blocks or more and the product is large: on main they cost
    all of it (1.6x the bound at B = 128, 1.7x at 300); a small product stays whole (B = 77
    here)."""
    torch.manual_seed(batch)
    model = _model()
    x = torch.randn(batch, LENGTH, WIDTH, dtype=torch.float64)
    rows = per_example_jacobian(model, lambda m: _losses(m, x))
    with funcgrad.per_example(model) as pe:
        losses = _losses(model, x)
        with FlopCounterMode(display=False) as counter:
            gram = funcgrad.per_example_gramian(losses)
    assert "materialised" in str(pe.plan), pe.plan
    torch.testing.assert_close(gram, rows @ rows.T, rtol=1e-12, atol=1e-12)
    assert torch.equal(gram, gram.T)
    products = counter.get_flop_counts()["Global"].get(torch.ops.aten.mm, 0)
    full = 2 * batch * batch * WIDTH * WIDTH
    step = max(32, batch // 8)
    if batch < 2 * step or batch * batch * WIDTH**2 < _GRAM_BLOCKED_FROM:
        assert products == full
    else:
        blocks = range(0, batch, step)
        assert products == sum(2 * min(step, batch - s) * (batch - s) * WIDTH**2 for s in blocks)
        assert products <= (1 + step / batch) / 2 * full + 2 * step * step * WIDTH**2


def test_a_weighting_reads_both_triangles():
    """The weighting gets the whole symmetric G (the update is exact with a weighting that
    reads the off-diagonal entries), on a materialised layer beside a ghost one (T = 1)."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Flatten(), nn.Linear(60, 2)).double()
    x = torch.randn(70, 10, 6, dtype=torch.float64)

    def losses_of(m: nn.Module) -> torch.Tensor:
        return m(x).pow(2).sum(1)

    def weighting(gram: torch.Tensor) -> torch.Tensor:
        return gram.tril(-1).sum(0) / gram.diagonal().sum()

    rows = per_example_jacobian(model, losses_of)
    expected = weighting(rows @ rows.T) @ rows
    with funcgrad.per_example(model):
        funcgrad.backward(losses_of(model), batch_dim=0, weighting=weighting)
    found = torch.cat([p.grad.flatten() for p in model.parameters()])
    torch.testing.assert_close(found, expected, rtol=1e-10, atol=1e-12)
