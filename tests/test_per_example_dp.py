"""Per-example weightings, norms and DP-SGD clipping: the messages of a weighting's output,
`funcgrad.per_example_norms` and the clipped update against a per-example loop of
torch.autograd.grad in float64."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import funcgrad

B = 6


def test_a_weighting_of_the_wrong_shape_is_told_one_per_example():
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    x = torch.randn(B, 3)
    wrong = r"shape \(6,\) \(one per example\) from the \(6, 6\)"
    with funcgrad.per_example(model) as pe, pytest.raises(ValueError, match=wrong):
        pe.backward(model(x).squeeze(1), weighting=lambda g: g.diagonal()[:3])
    assert all(p.grad is None for p in model.parameters())
