"""Mixed precision: autocast, and the GradScaler recipe that keeps the weights of the
unscaled losses (scaled losses scale V by s and the Gramian by s^2)."""

from __future__ import annotations

import pytest
import torch
from torchjd.aggregation import UPGrad, UPGradWeighting
from torchjd.autojac import jac_to_grad, mtl_backward

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


def _step(level, weighting, inside):
    """One step on the same bf16 forward; funcgrad.backward called inside the autocast region
    or after it."""
    encoder, heads = _model()
    x = torch.randn(12, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float32)
    y = torch.randn(12, 3, generator=torch.Generator().manual_seed(2), dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        features, losses = _losses(encoder, heads, x, y)
        if inside:
            weights = funcgrad.backward(losses, through=features, weighting=weighting, level=level)
    if not inside:
        weights = funcgrad.backward(losses, through=features, weighting=weighting, level=level)
    return weights, [p.grad for p in [*encoder.parameters(), *heads.parameters()]]


@pytest.mark.parametrize("level", ["params", "features"])
def test_weighting_inside_autocast_sees_a_float32_gramian(level):
    """Autocast is for the forward: the Gramian, the weighting and w @ P run in float32 also
    when backward is called inside the region (bf16 products there made UPGrad's solver
    fail, and gave a plain weighting a bf16 Gramian)."""
    seen = []

    def weighting(gramian):
        seen.append(gramian)
        return UPGradWeighting()(gramian)

    weights, grads = _step(level, weighting, inside=True)
    assert [g.dtype for g in seen] == [torch.float32]
    want_weights, want = _step(level, UPGradWeighting(), inside=False)
    assert weights.dtype == torch.float32
    torch.testing.assert_close(weights, want_weights)
    for got, expected in zip(grads, want):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, expected)
    weights, grads = _step(level, UPGradWeighting(), inside=True)
    torch.testing.assert_close(weights, want_weights)
    for got, expected in zip(grads, want):
        torch.testing.assert_close(got, expected)


def test_upgrad_aggregator_inside_autocast_equals_torchjd():
    """The params level inside autocast against TorchJD's mtl_backward + jac_to_grad on the
    same bf16 forward (TorchJD called after the region, in float32)."""
    encoder, heads = _model()
    x = torch.randn(12, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float32)
    y = torch.randn(12, 3, generator=torch.Generator().manual_seed(2), dtype=torch.float32)
    features, losses = _losses(encoder, heads, x, y)
    mtl_backward(losses, features)
    want_weights = jac_to_grad(list(encoder.parameters()), UPGrad())
    want = [p.grad for p in [*encoder.parameters(), *heads.parameters()]]

    encoder, heads = _model()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        features, losses = _losses(encoder, heads, x, y)
        weights = funcgrad.backward(losses, through=features, weighting=UPGrad())
    torch.testing.assert_close(weights, want_weights)
    for p, expected in zip([*encoder.parameters(), *heads.parameters()], want):
        torch.testing.assert_close(p.grad, expected)


@pytest.mark.parametrize("level", ["params", "features"])
def test_combine_heads_inside_autocast_weighs_in_float32(level):
    """f runs under the caller's autocast (a bf16 matmul, then float32), the weighting and
    the weighted products do not: against per-head autograd on the same autocast forward,
    with the Gramian, w @ V and w @ P formed in float32 by hand."""
    torch.manual_seed(0)
    a = torch.randn(5, 64, dtype=torch.float32)
    x = torch.randn(8, 5, dtype=torch.float32)
    targets = torch.randn(3, 8, 64, dtype=torch.float32)

    def f(x):
        return torch.tanh((x @ a).float())

    heads = [lambda y, t=t: (y - t).pow(2).mean() for t in targets]
    seen = []

    def weighting(gramian):
        seen.append(gramian.dtype)
        return UPGradWeighting()(gramian)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, grad, weights = funcgrad.combine_heads(f, heads, weighting, level=level)(x)
        leaf = x.clone().requires_grad_()
        y = f(leaf)
        v = torch.stack([torch.autograd.grad(h(y), y, retain_graph=True)[0] for h in heads])
        p = torch.stack([torch.autograd.grad(h(y), leaf, retain_graph=True)[0] for h in heads])
    assert seen == [torch.float32]
    rows = (v if level == "features" else p).flatten(1)
    want_weights = UPGradWeighting()(rows @ rows.T)
    if level == "features":  # one pull of w @ V (a bf16 backward rounds it, not each v_i)
        (want,) = torch.autograd.grad(y, leaf, torch.tensordot(want_weights, v, dims=1))
    else:
        want = torch.tensordot(want_weights, p, dims=1)
    torch.testing.assert_close(weights, want_weights)
    torch.testing.assert_close(grad, want)


@pytest.mark.parametrize("level", ["params", "features"])
@pytest.mark.parametrize("weighting", [None, UPGradWeighting()], ids=["none", "UPGrad"])
def test_backward_inside_autocast_equals_backward_after_it(level, weighting):
    """Float32 features from a bf16 layer, more losses than features (k=4 > m=2, so the
    params level combines pulled rows): backward runs no forward, so inside the region it
    must give what it gives after it (its products downcast to bf16 made .grad bf16, an
    error at the params level, and w @ V less accurate at the features level)."""

    def step(inside):
        torch.manual_seed(0)
        encoder = torch.nn.Linear(5, 2).float()
        x = torch.randn(3, 5, dtype=torch.float32)
        scales = torch.randn(4, 3, 2, dtype=torch.float32)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            features = encoder(x).float()
            losses = [(features * s).sum().pow(2) for s in scales]
            if inside:
                funcgrad.backward(losses, through=features, weighting=weighting, level=level)
        if not inside:
            funcgrad.backward(losses, through=features, weighting=weighting, level=level)
        return [p.grad for p in encoder.parameters()]

    for got, want in zip(step(inside=True), step(inside=False)):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want)
