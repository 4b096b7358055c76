"""Mixed precision: autocast, and the GradScaler recipe that keeps the weights of the
unscaled losses (scaled losses scale V by s and the Gramian by s^2)."""

from __future__ import annotations

import pytest
import torch
from torchjd.aggregation import UPGradWeighting

import funcgrad


def _model():
    torch.manual_seed(0)
    encoder = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8))
    heads = torch.nn.ModuleList(torch.nn.Linear(8, 1) for _ in range(3))
    return encoder.float(), heads.float()


def _losses(encoder, heads, x, y):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        features = encoder(x)
        losses = [
            torch.nn.functional.mse_loss(head(features).float(), y[:, i : i + 1])
            for i, head in enumerate(heads)
        ]
    return features, losses


@pytest.mark.parametrize("level", ["params", "features"])
def test_grad_scaler_recipe_gives_the_unscaled_update(level):
    x, y = torch.randn(12, 5, dtype=torch.float32), torch.randn(12, 3, dtype=torch.float32)
    weighting = UPGradWeighting()

    encoder, heads = _model()
    features, losses = _losses(encoder, heads, x, y)
    want = funcgrad.backward(losses, through=features, weighting=weighting, level=level)
    want_grads = [p.grad.clone() for p in [*encoder.parameters(), *heads.parameters()]]

    # The recipe (README, "Mixed precision"): scale the losses, unscale the Gramian.
    encoder, heads = _model()
    params = [*encoder.parameters(), *heads.parameters()]
    optimizer = torch.optim.SGD(params, lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    features, losses = _losses(encoder, heads, x, y)
    scale = scaler.get_scale()
    weights = funcgrad.backward(
        [scaler.scale(loss) for loss in losses],
        through=features,
        weighting=lambda gramian: weighting(gramian / scale**2),
        level=level,
    )
    scaler.unscale_(optimizer)
    torch.testing.assert_close(weights, want, rtol=1e-4, atol=1e-6)
    for p, expected in zip(params, want_grads):
        torch.testing.assert_close(p.grad, expected, rtol=1e-3, atol=1e-5)

    # Without the unscaling, the weighting sees a Gramian 2^20 times larger.
    encoder, heads = _model()
    features, losses = _losses(encoder, heads, x, y)
    seen = []
    funcgrad.backward(
        [scaler.scale(loss) for loss in losses],
        through=features,
        weighting=lambda gramian: seen.append(gramian) or weighting(gramian),
        level=level,
    )
    assert seen[0].abs().max() > 1e5
