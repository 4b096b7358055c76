"""Weightings (``funcgrad._weighting``): what a weighting sees (the Gramian of the task
gradients at either level), how it is called (in the caller's grad mode, its result
detached), and the errors on what it returns, before any ``.grad`` is written."""

from __future__ import annotations

import pytest
import torch
from helpers import _counted_graph, _grads, _raises, _setup
from torchjd import aggregation as tjd

import funcgrad


def test_returned_weights_equal_weighting_of_the_gramian():
    """The weighting sees the Gramian of the per-task gradients of the shared parameters
    (params) or of `through` (features), and the weights it returns come back."""
    seen = {}

    def weighting(gramian):
        seen["g"] = gramian.clone()
        return torch.softmax(-torch.diagonal(gramian), 0)

    model, x, targets = _setup(3)
    features = model.features(x)
    losses = model.losses(features, targets)
    per_task = [
        torch.cat(
            [g.flatten() for g in torch.autograd.grad(loss, model.shared(), retain_graph=True)]
        )
        for loss in losses
    ]
    on_features = [torch.autograd.grad(loss, features, retain_graph=True)[0] for loss in losses]
    rows = torch.stack(per_task)
    weights = funcgrad.backward(losses, through=features, weighting=weighting)
    torch.testing.assert_close(seen["g"], rows @ rows.T)
    torch.testing.assert_close(weights, weighting(rows @ rows.T))
    _, rows_f = None, torch.stack([v.flatten() for v in on_features])

    model, x, targets = _setup(3)
    features = model.features(x)
    weights = funcgrad.backward(
        model.losses(features, targets), through=features, weighting=weighting, level="features"
    )
    torch.testing.assert_close(seen["g"], rows_f @ rows_f.T)
    torch.testing.assert_close(weights, weighting(rows_f @ rows_f.T))


# -- errors on what a weighting returns: before any .grad is written ------------------------


@pytest.mark.parametrize("level", ["params", "features"])
def test_errors_on_weighting_output(level):
    _raises(
        r"`weighting` must return a tensor of k = 3 weights",
        weighting=lambda g: [1, 1, 1],
        level=level,
        error=TypeError,
    )
    _raises(r"must return weights of shape \(3,\) .* got shape \(3, 3\)", weighting=lambda g: g)
    _raises(
        "must return real floating-point weights",
        weighting=lambda g: torch.ones(3, dtype=torch.int64),
        error=TypeError,
    )
    _raises("non-finite weights", weighting=lambda g: torch.full((3,), float("nan")))


def test_params_level_weighting_errors_come_before_any_write():
    _, model, features, losses = _counted_graph()
    with pytest.raises(ValueError, match=r"must return weights of shape \(3,\)"):
        funcgrad.backward(losses, through=features, weighting=lambda g: torch.ones(2))
    assert not _grads(model)
    with pytest.raises(ValueError, match="non-finite weights"):
        funcgrad.backward(losses, through=features, weighting=lambda g: g[0] / 0 - g[0] / 0)
    assert not _grads(model)


def test_non_finite_gramian_is_an_error_before_the_shared_part():
    _raises(
        r"Gramian of the task gradients with respect to `through` is not finite: task\(s\) \[1\]",
        losses=lambda ls, m, f: [ls[0], ls[1] * float("inf"), ls[2]],
        weighting=tjd.UPGradWeighting(),
        level="features",
    )


# -- how a weighting is called ----------------------------------------------------------------


def _descended(gramian):
    """A weighting that differentiates inside itself: a few gradient steps on w^T G w from
    the mean, then a projection onto the simplex's sum."""
    w = torch.full((gramian.shape[0],), 1.0 / gramian.shape[0], dtype=gramian.dtype)
    for _ in range(3):
        w = w.detach().requires_grad_()
        (step,) = torch.autograd.grad(w @ gramian @ w, w)
        w = w - 0.1 * step / step.norm()
    return w / w.sum()


@pytest.mark.parametrize("level", ["params", "features"])
def test_a_weighting_may_differentiate_inside_itself(level):
    """It is called in the caller's grad mode (under torch.no_grad its autograd.grad
    raised), and its result is detached: against the same weighting on the Gramian by hand."""
    model, x, targets = _setup()
    features = model.features(x)
    losses = model.losses(features, targets)
    (z,) = features
    wrt = model.shared() if level == "params" else [z]
    rows = torch.stack(
        [
            torch.cat([g.flatten() for g in torch.autograd.grad(loss, wrt, retain_graph=True)])
            for loss in losses
        ]
    )
    want_weights = _descended(rows @ rows.T).detach()
    want = torch.autograd.grad(
        sum(w * loss for w, loss in zip(want_weights, losses)),
        model.shared(),
        retain_graph=True,
    )

    weights = funcgrad.backward(losses, through=features, weighting=_descended, level=level)
    assert not weights.requires_grad
    torch.testing.assert_close(weights, want_weights)
    for p, expected in zip(model.shared(), want):
        torch.testing.assert_close(p.grad, expected)

    fn = funcgrad.combine_heads(
        lambda x, a: torch.tanh(x @ a),
        [lambda y: y.sum(), lambda y: y.pow(2).mean()],
        _descended,
        level=level,
    )
    _, _, weights = fn(x, torch.randn(5, 4))
    assert weights.shape == (2,) and not weights.requires_grad
