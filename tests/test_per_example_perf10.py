"""Session 10's per-example changes, exact in float64 against a per-example autograd loop
and counted (never timed): the mixed rule's estimate of the materialised rule is the Gram
that `_gram` forms (its upper triangle in row blocks), not the whole ``B²·d·p``."""

from __future__ import annotations

import pytest
import torch
from helpers import per_example_jacobian
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import funcgrad


@pytest.mark.parametrize(
    ("batch", "width", "length"),
    [(128, 48, 40), (300, 48, 40), (20, 48, 40), (128, 96, 40)],
)
def test_the_materialised_estimate_counts_the_gram_it_forms(batch, width, length):
    """The plan's materialised flops are ``B·T·d·p`` for the per-example gradients (bmm)
    plus the multiply-adds of the Gram products that the call runs (``aten.mm``, counted
    by torch's FlopCounterMode: 2 flops a multiply-add): the upper triangle in row blocks
    at B = 128 and 300, the whole product at B = 20, and per block of output features
    where the (B, p, d) gradients are not formed whole (d = p = 96). On main the estimate
    counted ``B²·d·p`` (1.6x the products at B = 128). G equals the loop's ``J Jᵀ``."""
    torch.manual_seed(batch + width)
    model = nn.Sequential(nn.Linear(width, width, bias=False), nn.Tanh()).double()
    x = torch.randn(batch, length, width, dtype=torch.float64)

    def losses_of(m: nn.Module) -> torch.Tensor:
        return m(x).pow(2).sum((1, 2))

    rows = per_example_jacobian(model, losses_of)
    with funcgrad.per_example(model) as pe:
        losses = losses_of(model)
        with FlopCounterMode(display=False) as counter:
            gram = funcgrad.per_example_gramian(losses)
    torch.testing.assert_close(gram, rows @ rows.T, rtol=1e-12, atol=1e-12)
    (layer,) = pe.plan.layers
    assert "materialised" in layer.rule, pe.plan
    products = counter.get_flop_counts()["Global"].get(torch.ops.aten.mm, 0)
    assert products > 0
    assert layer.materialised_flops == batch * length * width * width + products // 2
