"""Weightings (``funcgrad._weighting``): what a weighting sees (the Gramian of the task
gradients at either level), how it is called (in the caller's grad mode, its result
detached), and the errors on what it returns, before any ``.grad`` is written; then the
module's own steps called directly: which rule each kind of weighting gets (as TorchJD's
``jac_to_grad`` runs it), the Gramian of column blocks, the aggregation of a Jacobian and the
weighted sum, against TorchJD and plain products."""

from __future__ import annotations

import pytest
import torch
from helpers import _counted_graph, _grads, _raises, _setup
from torchjd import aggregation as tjd

import funcgrad
from funcgrad import _weighting


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
    _, model, features, losses = _counted_graph()  # (the pull before the error freed the graph)
    with pytest.raises(ValueError, match="non-finite weights"):
        funcgrad.backward(losses, through=features, weighting=lambda g: g[0] / 0 - g[0] / 0)
    assert not _grads(model)


def test_finite_check_of_the_gramian_and_weights_is_exact():
    """G and the weights are checked finite by one sum, which finite entries can overflow:
    then the exact checks run and find nothing to refuse; one inf or NaN anywhere is refused."""
    rule = _weighting.resolve(lambda g: torch.full((2,), 3e38), "params", "call")
    big = torch.full((2, 2), 3e38)  # (finite, but its sum overflows float32)
    weights = _weighting.checked_weights(rule, big, [big], "here", "call")
    assert torch.equal(weights, torch.full((2,), 3e38))
    for bad in (float("inf"), float("nan")):
        g = big.clone()
        g[1, 0] = bad
        with pytest.raises(ValueError, match="Gramian of the task gradients here is not finite"):
            _weighting.checked_weights(rule, g, [g], "here", "call")
        nan_rule = _weighting.resolve(lambda g, bad=bad: torch.tensor([1.0, bad]), "params", "c")
        with pytest.raises(ValueError, match="non-finite weights"):
            _weighting.checked_weights(nan_rule, big / 1e38, [big], "here", "c")


def test_gramian_concatenated_or_by_blocks_agree():
    gen = torch.Generator().manual_seed(0)
    blocks = [torch.randn(3, n, generator=gen, dtype=torch.float64) for n in (5, 1, 7)]
    expected = torch.cat(blocks, dim=1) @ torch.cat(blocks, dim=1).T
    torch.testing.assert_close(_weighting.gramian(blocks), expected)
    big = [torch.randn(3, _weighting.CONCAT_ENTRIES // 3 + 1, generator=gen, dtype=torch.float32)]
    big.append(blocks[0].float())
    torch.testing.assert_close(
        _weighting.gramian(big),
        sum(b.double() @ b.double().T for b in big).float(),
        rtol=1e-5,
        atol=0,
    )


class _NaNMean(tjd.Mean):
    def forward(self, matrix):
        return super().forward(matrix) * float("nan")


class _NaNMeanWeighting(tjd.MeanWeighting):
    def forward(self, matrix):
        return super().forward(matrix) * float("nan")


@pytest.mark.parametrize("level", ["params", "features"])
@pytest.mark.parametrize(
    ("weighting", "match"),
    [
        (_NaNMean(), "the aggregator _NaNMean returned a non-finite update"),
        (_NaNMeanWeighting(), r"non-finite weights from the \(3, \d+\) Jacobian: expected 3 "),
    ],
)
def test_a_non_finite_aggregate_of_the_jacobian_is_an_error_before_any_write(
    level, weighting, match
):
    """An aggregator's update, or a Jacobian weighting's weights, that are not finite: a clear
    error (at both levels), and no .grad written."""
    _, model, features, losses = _counted_graph()
    with pytest.raises(ValueError, match=match):
        funcgrad.backward(losses, through=features, weighting=weighting, level=level)
    assert not _grads(model)


def test_non_finite_weights_error_names_the_first_indices_and_a_count():
    """m NaN weights: the message names the first five indices with their values and the count
    (expected vs got, and the fix), not the whole list."""
    m = 40
    bad = [2, 3, 5, 7, 11, 13, 17, 19]

    def weighting(gramian):
        w = torch.ones(gramian.shape[0], dtype=gramian.dtype)
        w[bad[::2]] = float("nan")
        w[bad[1::2]] = float("inf")
        return w

    model = torch.nn.Linear(3, 4)
    features = model(torch.randn(5, 3))
    losses = [(features * i).sum() for i in range(m)]
    with pytest.raises(ValueError) as info:
        funcgrad.backward(losses, through=features, weighting=weighting)
    message = str(info.value)
    assert message.startswith("funcgrad.backward(")
    assert f"expected {m} finite weights, got NaN or inf at {len(bad)} of them: " in message
    assert "[2] = nan, [3] = inf, [5] = nan, [7] = inf, [11] = nan, ... (3 more);" in message
    assert "[13]" not in message and "1.0" not in message
    assert "a solver that failed to converge?" in message
    assert model.weight.grad is None


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


# -- the module's own steps, called directly ------------------------------------------------

CALL = "funcgrad.backward(losses, through=...)"


def _hooked_upgrad():
    aggregator = tjd.UPGrad()
    aggregator.register_forward_hook(lambda module, inputs, output: output)
    return aggregator


RULES = {
    "none": (lambda: None, "sum"),
    "callable": (lambda: lambda g: g.diagonal(), "gramian"),
    "Gramian weighting": (tjd.UPGradWeighting, "gramian"),
    "Gramian-weighted aggregator": (tjd.UPGrad, "gramian"),
    "hooked aggregator": (_hooked_upgrad, "matrix"),
    "weighted aggregator": (tjd.Mean, "matrix"),
    "Jacobian weighting": (tjd.MeanWeighting, "jacobian"),
    "aggregator without weights": (tjd.GradDrop, "vector"),
}


@pytest.mark.parametrize("name", list(RULES))
def test_each_kind_of_weighting_is_run_as_jac_to_grad_runs_it(name):
    make, kind = RULES[name]
    weighting = make()
    rule = _weighting.resolve(weighting, "params", CALL)
    assert rule.kind == kind
    assert rule.needs_jacobian == (kind in ("jacobian", "matrix", "vector"))
    assert rule.update_is_weighted == (kind not in ("vector",) and name != "hooked aggregator")
    if name == "Gramian-weighted aggregator":  # jac_to_grad's shortcut: its Gramian weighting
        assert rule.fn is weighting.gramian_weighting


def test_resolve_refuses_what_is_no_weighting_before_any_pass():
    with pytest.raises(TypeError, match=r"got the class UPGrad\. Pass UPGrad\(\)"):
        _weighting.resolve(tjd.UPGrad, "params", CALL)
    with pytest.raises(TypeError, match=r"`weighting` must be None, a callable"):
        _weighting.resolve(3, "params", CALL)
    with pytest.raises(ValueError, match=r"GradDrop is a TorchJD Aggregator without weights"):
        _weighting.resolve(tjd.GradDrop(), "features", CALL)
    with pytest.raises(ValueError, match=r"reads the Jacobian, and at level='features'"):
        _weighting.resolve(tjd.MeanWeighting(), "features", CALL, distributed=True)
    with pytest.raises(ValueError, match=r"unknown `level`"):
        _weighting.resolve(None, "both", CALL)


def test_the_gramian_of_column_blocks_is_that_of_the_whole_jacobian():
    blocks = [torch.randn(3, 4), torch.randn(3, 1), torch.randn(3, 6)]
    whole = torch.cat(blocks, dim=1)
    torch.testing.assert_close(_weighting.gramian(blocks), whole @ whole.T)
    half = _weighting.gramian([b.to(torch.bfloat16) for b in blocks])
    assert half.dtype == torch.float32  # a half-precision Gramian overflows
    want = whole.to(torch.bfloat16).float()
    torch.testing.assert_close(half, want @ want.T)


def test_weights_from_the_gramian_are_computed_with_grad_and_come_back_detached():
    seen = {}

    def descended(g):
        seen["grad mode"], seen["input has a graph"] = torch.is_grad_enabled(), g.requires_grad
        w = torch.ones(g.shape[0], requires_grad=True)
        (step,) = torch.autograd.grad(w @ g @ w, w, create_graph=True)
        return w - 0.1 * step

    g = torch.randn(3, 3, requires_grad=True)
    g2 = (g @ g.T).detach().requires_grad_()
    with torch.no_grad():
        weights = _weighting.weights_from_gramian(_weighting.Rule("gramian", descended), g2, CALL)
    assert seen == {"grad mode": True, "input has a graph": False}
    assert not weights.requires_grad
    torch.testing.assert_close(weights, 1 - 0.1 * (g2 + g2.T).detach() @ torch.ones(3))


def test_aggregate_equals_the_aggregator_called_on_the_jacobian():
    rows = torch.randn(3, 7)
    hooked = _hooked_upgrad()
    weights, update = _weighting.aggregate(_weighting.resolve(hooked, "params", CALL), rows, CALL)
    torch.testing.assert_close(update, tjd.UPGrad()(rows))
    torch.testing.assert_close(weights @ rows, update)
    weights, update = _weighting.aggregate(
        _weighting.resolve(tjd.MeanWeighting(), "params", CALL), rows, CALL
    )
    assert update is None
    torch.testing.assert_close(weights, torch.full((3,), 1 / 3))
    weights, update = _weighting.aggregate(
        _weighting.Rule("vector", lambda j: j.sum(0)), rows, CALL
    )
    assert weights is None
    torch.testing.assert_close(update, rows.sum(0))


def test_weighted_sum_leaf_by_leaf_and_the_checks_of_weights():
    weights = torch.tensor([0.5, -1.0, 2.0])
    grads = (torch.randn(3, 2, 4), torch.randn(3, 5, dtype=torch.float32))
    got = _weighting.weighted_sum(weights, grads)
    for g, leaf in zip(got, grads):
        assert g.dtype == leaf.dtype
        torch.testing.assert_close(g, sum(w * row for w, row in zip(weights.tolist(), leaf)))
    assert not _weighting.checked_shape(weights.requires_grad_(), 3, "G", CALL).requires_grad
    with pytest.raises(ValueError, match=r"must return weights of shape \(3,\)"):
        _weighting.checked_shape(torch.ones(2), 3, "G", CALL)
    with pytest.raises(TypeError, match=r"must return real floating-point weights"):
        _weighting.checked_shape(torch.ones(3, dtype=torch.long), 3, "G", CALL)
    with pytest.raises(ValueError, match=r"non-finite weights from G: expected 3 finite .* at 1 "):
        _weighting.check_finite(torch.tensor([1.0, float("nan"), 1.0]), "G", CALL)


def _aten_ops(fn):
    """The top-level aten ops one call of ``fn`` dispatches (counted, not timed)."""
    with torch.autograd.profiler.profile() as prof:
        fn()
    return [e.name for e in prof.function_events if e.cpu_parent is None]


def test_gramian_and_weighted_sum_make_no_no_op_ops():
    # Task gradients that need no grad, in their work dtype: nothing to detach or convert
    # (each such op costs a dispatch per block, per call, and changes nothing).
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(3, *s, generator=gen, dtype=torch.float64) for s in [(4, 2), (5,)]]
    blocks = [g.reshape(3, -1) for g in grads]
    weights = torch.randn(3, generator=gen, dtype=torch.float64)
    ops = _aten_ops(lambda: _weighting.gramian(blocks))
    assert "aten::detach" not in ops and "aten::to" not in ops, ops
    ops = _aten_ops(lambda: _weighting.weighted_sum(weights, grads))
    assert "aten::to" not in ops and "aten::numpy_T" not in ops, ops
    rows = torch.cat(blocks, dim=1)
    torch.testing.assert_close(_weighting.gramian(blocks), rows @ rows.T)
    update = _weighting.weighted_sum(weights.float(), grads)  # (w converted to each dtype)
    for g, u in zip(grads, update):
        torch.testing.assert_close(u, torch.tensordot(weights, g, dims=1))
        assert u.dtype == g.dtype
