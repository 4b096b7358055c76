"""``funcgrad.grads``: gradients of many outputs of an existing autograd graph through one
intermediate, against ``torch.autograd.grad`` output by output in float64."""

from __future__ import annotations

import pytest
import torch

import funcgrad


def _reference(outputs_of, x):
    rows = []
    for i in range(len(outputs_of(x))):
        xr = x.detach().requires_grad_()
        (g,) = torch.autograd.grad(outputs_of(xr)[i], xr)
        rows.append(g)
    return torch.stack(rows)


@pytest.mark.parametrize("k", [1, 3, 7], ids=lambda k: f"k={k}")
def test_fewer_or_more_outputs_than_through_has_coordinates(k):
    """k <= m pulls the k cotangents; k > m pulls y's m unit directions and combines."""
    torch.manual_seed(0)
    w = torch.randn(4, 6, dtype=torch.float64)

    def outputs_of(x):
        y = torch.tanh(w @ x)[:3]  # m = 3
        return [(y ** (i + 1)).sum() * (i - 1.5) for i in range(k)]

    x = torch.randn(6, dtype=torch.float64, requires_grad=True)
    y = torch.tanh(w @ x)[:3]
    outputs = [(y ** (i + 1)).sum() * (i - 1.5) for i in range(k)]
    (got,) = funcgrad.grads(outputs, x, through=y)
    torch.testing.assert_close(got, _reference(outputs_of, x))


def test_non_finite_cotangents_come_out_as_autograd_with_more_outputs_than_coordinates():
    x = torch.tensor([0.0, 1.0], dtype=torch.float64, requires_grad=True)
    y = 3 * x  # m = 2, k = 3: y's unit directions would give 0 * inf = NaN
    outputs = [torch.sqrt(y).sum(), (y**2).sum(), y[1] * 2]
    (got,) = funcgrad.grads(outputs, x, through=y)
    expected = _reference(lambda x: [torch.sqrt(3 * x).sum(), (9 * x**2).sum(), 6 * x[1]], x)
    torch.testing.assert_close(got, expected, equal_nan=True)
    assert torch.isinf(got[0, 0]) and torch.isfinite(got[1:]).all()
