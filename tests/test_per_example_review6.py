"""Fixes from the sixth adversarial review of the per-example code: each against the
per-example autograd loop (`tests.helpers.per_example_jacobian`) in float64, or a clear
refusal with .grad untouched."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import funcgrad
from tests.helpers import per_example_jacobian


@pytest.fixture(autouse=True)
def _float64():
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


def _clipped(jac, max_norm):
    """per_example_clip's update from the loop's (B, P) rows."""
    return (max_norm / (jac.norm(dim=1) + 1e-6)).clamp(max=1.0) @ jac


def _flat_grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


# -- S1: a NaN output gradient at padding positions ------------------------------------------


class _PaddedMean(nn.Module):
    """Token embeddings normalised per token: the zero padding rows give NaN there, masked
    out after, so the loss never reads them, but their output gradient is NaN."""

    def __init__(self, padding_idx: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4, padding_idx=padding_idx)
        self.lin = nn.Linear(4, 1)
        self.pad = self.emb.padding_idx

    def forward(self, index: torch.Tensor) -> torch.Tensor:
        h = self.emb(index)
        h = h / h.norm(dim=-1, keepdim=True)  # NaN at padding positions (0 / 0)
        h = torch.where((index != self.pad).unsqueeze(-1), h, 0.0)
        return self.lin(h).squeeze(-1).sum(1)


@pytest.mark.parametrize("padding_idx", [0, -1])
def test_a_nan_output_gradient_at_padding_positions_leaves_the_padding_row_zero(padding_idx):
    """The padding positions were masked by d * (index != padding_idx): NaN * 0 = NaN, and
    the update wrote it into the padding row; torch's backward gives 0 there."""
    torch.manual_seed(0)
    model = _PaddedMean(padding_idx)
    pad = model.pad
    index = torch.tensor([[3, 5, pad, pad], [7, pad, pad, pad], [2, 2, 8, 1]])
    jac = per_example_jacobian(model, lambda m: m(index))
    assert torch.isfinite(jac).all()
    with funcgrad.per_example(model) as pe:
        torch.testing.assert_close(pe.gramian(model(index)), jac @ jac.T)
        funcgrad.per_example_clip(model(index), 1.0)
        torch.testing.assert_close(_flat_grads(model), _clipped(jac, 1.0))
        model.zero_grad(set_to_none=True)
        pe.backward(model(index))
        torch.testing.assert_close(_flat_grads(model), jac.sum(0))
