"""Every TorchJD 0.18 aggregator and weighting, used as it is, at both levels: exact against
TorchJD (params level: mtl_backward + jac_to_grad; features level: the same weighting on
the task gradients with respect to `through`, written out by hand), or a clear error that
says which level or form works. Hooks on TorchJD objects run as under jac_to_grad."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torchjd import aggregation as tjd
from torchjd.autojac import backward as torchjd_backward
from torchjd.autojac import jac_to_grad, mtl_backward

import funcgrad

K = 3
# Every concrete aggregator and weighting of torchjd.aggregation, built with arguments where
# it needs them (bases such as WeightedAggregator are built around a weighting).
OBJECTS = {
    "AlignedMTL": tjd.AlignedMTL,
    "AlignedMTLWeighting": tjd.AlignedMTLWeighting,
    "CAGrad": lambda: tjd.CAGrad(c=0.5),
    "CAGradWeighting": lambda: tjd.CAGradWeighting(c=0.5),
    "CRMOGMWeighting": lambda: tjd.CRMOGMWeighting(tjd.UPGradWeighting()),
    "CRMOGMWeighting(Mean)": lambda: tjd.CRMOGMWeighting(tjd.MeanWeighting()),
    "ConFIG": tjd.ConFIG,
    "Constant": lambda: tjd.Constant(torch.tensor([0.5, 1.0, 2.0])),
    "ConstantWeighting": lambda: tjd.ConstantWeighting(torch.tensor([0.5, 1.0, 2.0])),
    "DualProj": tjd.DualProj,
    "DualProjWeighting": tjd.DualProjWeighting,
    "ExcessMTL": tjd.ExcessMTL,
    "ExcessMTLWeighting": tjd.ExcessMTLWeighting,
    "FairGrad": lambda: tjd.FairGrad(alpha=1.0),
    "FairGradWeighting": lambda: tjd.FairGradWeighting(alpha=1.0),
    "GradDrop": tjd.GradDrop,
    "GradVac": tjd.GradVac,
    "GradVacWeighting": tjd.GradVacWeighting,
    "GramianWeightedAggregator": lambda: tjd.GramianWeightedAggregator(tjd.MGDAWeighting()),
    "IMTLG": tjd.IMTLG,
    "IMTLGWeighting": tjd.IMTLGWeighting,
    "Krum": lambda: tjd.Krum(n_byzantine=0),
    "KrumWeighting": lambda: tjd.KrumWeighting(n_byzantine=0),
    "MGDA": tjd.MGDA,
    "MGDAWeighting": tjd.MGDAWeighting,
    "Mean": tjd.Mean,
    "MeanWeighting": tjd.MeanWeighting,
    "MoDoWeighting": tjd.MoDoWeighting,
    "NashMTL": lambda: tjd.NashMTL(n_tasks=K),
    "PCD": tjd.PCD,
    "PCDWeighting": tjd.PCDWeighting,
    "PCGrad": tjd.PCGrad,
    "PCGradWeighting": tjd.PCGradWeighting,
    "Random": tjd.Random,
    "RandomWeighting": tjd.RandomWeighting,
    "SDMGradWeighting": tjd.SDMGradWeighting,
    "Sum": tjd.Sum,
    "SumWeighting": tjd.SumWeighting,
    "TrimmedMean": lambda: tjd.TrimmedMean(trim_number=1),
    "UPGrad": tjd.UPGrad,
    "UPGradWeighting": tjd.UPGradWeighting,
    "WeightedAggregator": lambda: tjd.WeightedAggregator(tjd.MeanWeighting()),
}
# Aggregators that map the Jacobian to an update without weights: params level only.
WITHOUT_WEIGHTS = {"ConFIG", "GradDrop", "TrimmedMean"}
# These read A = J_1 J_2^T from two independent mini-batches (TorchJD's jac_to_grad fails
# inside them with a size mismatch): funcgrad refuses them before any pass, with the recipe.
CROSS_BATCH = {"MoDoWeighting", "SDMGradWeighting"}
# The solvers behind these are iterative (cvxpy, quadprog): agreement to their tolerance.
LOOSE = {"CAGrad", "CAGradWeighting", "NashMTL", "FairGrad", "FairGradWeighting"}


def test_every_public_class_is_covered():
    concrete = {
        name
        for name in tjd.__all__
        if isinstance(getattr(tjd, name), type) and name not in ("Aggregator", "Weighting")
    }
    assert concrete <= set(OBJECTS), sorted(concrete - set(OBJECTS))


def _model():
    torch.manual_seed(0)
    encoder = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 6))
    heads = torch.nn.ModuleList(torch.nn.Linear(6, 1) for _ in range(K))
    x, y = torch.randn(10, 5), torch.randn(10, K)

    def losses():
        features = encoder(x)
        return features, [
            (head(features) - y[:, i : i + 1]).pow(2).mean() * (i + 1)
            for i, head in enumerate(heads)
        ]

    return encoder, heads, losses


def _grads(*modules):
    return [p.grad.clone() for m in modules for p in m.parameters()]


def _as_aggregator(obj):
    """A TorchJD weighting as jac_to_grad takes it: inside its aggregator."""
    bases = {cls.__name__ for cls in type(obj).__mro__}
    if "Aggregator" in bases:
        return obj
    if "_GramianWeighting" in bases or "_GramianWeighting" in {
        cls.__name__ for cls in type(getattr(obj, "weighting", None)).__mro__
    }:
        return tjd.GramianWeightedAggregator(obj)
    return tjd.WeightedAggregator(obj)


@pytest.mark.parametrize("name", list(OBJECTS))
def test_params_level_equals_jac_to_grad(name):
    encoder, heads, losses = _model()
    features, task_losses = losses()
    mtl_backward(task_losses, features)
    torch.manual_seed(1)  # the same draws for the random ones
    if name in CROSS_BATCH:
        with pytest.raises(RuntimeError, match="size mismatch"):
            jac_to_grad(list(encoder.parameters()), _as_aggregator(OBJECTS[name]()))
        encoder, heads, losses = _model()
        features, task_losses = losses()
        subclass = type("Mine", (OBJECTS[name],), {})  # a user's subclass is refused too
        for weighting in (OBJECTS[name](), _as_aggregator(OBJECTS[name]()), subclass()):
            with pytest.raises(ValueError, match="two independent mini-batches") as error:
                funcgrad.backward(task_losses, through=features, weighting=weighting)
            inner = getattr(weighting, "weighting", weighting)
            assert f"w your {type(inner).__name__} instance" in str(error.value)
            assert all(p.grad is None for p in encoder.parameters())
        return
    jac_to_grad(list(encoder.parameters()), _as_aggregator(OBJECTS[name]()))
    want = _grads(encoder, heads)

    encoder, heads, losses = _model()
    features, task_losses = losses()
    torch.manual_seed(1)
    # GradDrop draws one number per Jacobian column: the columns in jac_to_grad's order.
    weights = funcgrad.backward(
        task_losses, through=features, weighting=OBJECTS[name](), inputs=encoder.parameters()
    )
    tolerance = 1e-5 if name in LOOSE else 1e-7
    for got, expected in zip(_grads(encoder, heads), want):
        torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)
    assert (weights is None) == (name in WITHOUT_WEIGHTS)


@pytest.mark.parametrize("name", list(OBJECTS))
def test_features_level_is_the_weighting_on_the_feature_gradients(name):
    encoder, heads, losses = _model()
    features, task_losses = losses()
    if name in CROSS_BATCH:
        with pytest.raises(ValueError, match="weighting=lambda gramian: weights"):
            funcgrad.backward(
                task_losses, through=features, weighting=OBJECTS[name](), level="features"
            )
        assert all(p.grad is None for p in encoder.parameters())
        return
    if name in WITHOUT_WEIGHTS:
        with pytest.raises(ValueError, match=r"Aggregator without weights.*level='params'"):
            funcgrad.backward(
                task_losses, through=features, weighting=OBJECTS[name](), level="features"
            )
        assert all(p.grad is None for p in encoder.parameters())
        return
    # By hand: V (the task gradients on the features), the weighting on V V^T or on V as
    # TorchJD's aggregator would read them, then one backward of sum_i w_i L_i.
    rows = torch.stack(
        [
            torch.autograd.grad(loss, features, retain_graph=True)[0].flatten()
            for loss in task_losses
        ]
    )
    obj = OBJECTS[name]()
    captured = []
    aggregator = _as_aggregator(obj)
    aggregator.weighting.register_forward_hook(lambda _m, _i, out: captured.append(out))
    torch.manual_seed(1)
    aggregator(rows)
    w = captured[-1].detach()
    own = [list(h.parameters()) for h in heads]
    shared = torch.autograd.grad(
        sum(wi * loss for wi, loss in zip(w, task_losses)),
        list(encoder.parameters()),
        retain_graph=True,
    )
    want = list(shared) + [
        g for loss, params in zip(task_losses, own) for g in torch.autograd.grad(loss, params)
    ]

    encoder, heads, losses = _model()
    features, task_losses = losses()
    torch.manual_seed(1)
    weights = funcgrad.backward(
        task_losses, through=features, weighting=OBJECTS[name](), level="features"
    )
    tolerance = 1e-5 if name in LOOSE else 1e-7
    torch.testing.assert_close(weights, w, rtol=tolerance, atol=tolerance)
    for got, expected in zip(_grads(encoder, heads), want):
        torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("level", ["params", "features"])
def test_hooks_on_an_aggregator_and_its_weighting_run(level):
    calls = []
    aggregator = tjd.UPGrad()
    aggregator.register_forward_hook(lambda _m, _i, out: calls.append("aggregator"))
    aggregator.weighting.register_forward_hook(
        lambda _m, _i, out: calls.append("weighting") or out * 2  # a hook that changes weights
    )
    _encoder, _heads, losses = _model()
    features, task_losses = losses()
    weights = funcgrad.backward(task_losses, through=features, weighting=aggregator, level=level)
    assert calls == ["weighting", "aggregator"]
    features, task_losses = losses()
    plain = funcgrad.backward(task_losses, through=features, weighting=tjd.UPGrad(), level=level)
    torch.testing.assert_close(weights, 2 * plain)


def test_a_weighting_class_instead_of_an_instance_is_a_clear_error():
    _, _, losses = _model()
    features, task_losses = losses()
    with pytest.raises(TypeError, match=r"got the class UPGradWeighting. Pass UPGradWeighting\(\)"):
        funcgrad.backward(task_losses, through=features, weighting=tjd.UPGradWeighting)


@pytest.mark.parametrize("name", sorted(CROSS_BATCH))
def test_cross_batch_weighting_by_the_recipe_in_its_error(name):
    """The recipe the error gives (weights from A = J_1 J_2^T of two batches, then a
    constant weighting) equals TorchJD's own example: losses.backward(weights)."""

    def two_batches():
        torch.manual_seed(0)
        encoder = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh())
        head = torch.nn.Linear(4, K)
        batches = [(torch.randn(6, 5), torch.randn(6, K)) for _ in range(3)]
        return encoder, head, batches

    def task_losses(encoder, head, x, y):
        features = encoder(x)
        return features, ((head(features) - y) ** 2).mean(dim=0)

    def weights_from_two_batches(encoder, head, batches):
        params = list(encoder.parameters())
        jacobians = []
        for x, y in batches[:2]:
            _, losses = task_losses(encoder, head, x, y)
            rows = [torch.autograd.grad(loss, params, retain_graph=True) for loss in losses]
            jacobians.append(torch.stack([torch.cat([g.flatten() for g in r]) for r in rows]))
        return OBJECTS[name]()(jacobians[0] @ jacobians[1].T)

    encoder, head, batches = two_batches()
    weights = weights_from_two_batches(encoder, head, batches)
    _, losses = task_losses(encoder, head, *batches[2])
    losses.backward(weights)
    want = [p.grad.clone() for p in encoder.parameters()]

    encoder, head, batches = two_batches()
    weights = weights_from_two_batches(encoder, head, batches)
    features, losses = task_losses(encoder, head, *batches[2])
    funcgrad.backward(list(losses), through=features, weighting=lambda gramian: weights)
    for p, expected in zip(encoder.parameters(), want):
        torch.testing.assert_close(p.grad, expected)


def _rescaled_output():
    aggregator = tjd.UPGrad()
    aggregator.register_forward_hook(lambda _m, _i, out: out * 0.5)
    return aggregator


def _normalised_rows():
    aggregator = tjd.UPGrad()
    aggregator.register_forward_pre_hook(
        lambda _m, args: (args[0] / args[0].norm(dim=1, keepdim=True),)
    )
    return aggregator


def _doubled_mean():
    aggregator = tjd.Mean()
    aggregator.register_forward_pre_hook(lambda _m, args: (args[0] * 2,))
    return aggregator


# Hooks on the aggregator itself change its input or its output, not only its weights: the
# update is its output, which w @ P is not.
HOOKED = {
    "output rescaled": _rescaled_output,
    "rows normalised": _normalised_rows,
    "Mean, Jacobian doubled": _doubled_mean,
}


@pytest.mark.parametrize("name", list(HOOKED))
def test_hooks_on_an_aggregator_change_the_update_as_under_jac_to_grad(name):
    encoder, heads, losses = _model()
    features, task_losses = losses()
    mtl_backward(task_losses, features)
    want_weights = jac_to_grad(list(encoder.parameters()), HOOKED[name]())
    want = _grads(encoder, heads)

    encoder, heads, losses = _model()
    features, task_losses = losses()
    weights = funcgrad.backward(task_losses, through=features, weighting=HOOKED[name]())
    torch.testing.assert_close(weights, want_weights)
    for got, expected in zip(_grads(encoder, heads), want):
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("name", list(HOOKED))
def test_combine_heads_runs_an_aggregators_hooks_as_jac_to_grad(name):
    torch.manual_seed(0)
    a, x = torch.randn(5, 6), torch.randn(4, 5)
    targets = torch.randn(K, 4, 6)

    def f(x):
        return torch.tanh(x @ a)

    head_fns = [lambda y, t=t, i=i: (y - t).pow(2).mean() * (i + 1) for i, t in enumerate(targets)]
    leaf = x.clone().requires_grad_()
    features = f(leaf)
    torchjd_backward([h(features) for h in head_fns])  # leaf.jac: the (K, 4, 5) Jacobian
    want_weights = jac_to_grad([leaf], HOOKED[name]())

    _, grad, weights = funcgrad.combine_heads(f, head_fns, HOOKED[name]())(x)
    torch.testing.assert_close(weights, want_weights)
    torch.testing.assert_close(grad, leaf.grad)


@pytest.mark.parametrize("level", ["params", "features"])
def test_combine_heads_sees_a_hook_registered_after_it_was_built(level):
    """jac_to_grad looks for hooks at each call; so does the function combine_heads returns
    (it chose UPGrad's Gramian shortcut once, at construction, and dropped later hooks)."""
    torch.manual_seed(0)
    x = torch.randn(4, 5)
    encoder = torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.Tanh())
    head_fns = [lambda y, i=i: y[:, i].sin().sum() * (i + 1) for i in range(K)]
    aggregator = tjd.UPGrad()
    fn = funcgrad.combine_heads(encoder, head_fns, aggregator, level=level)
    _, plain, _ = fn(x)
    handle = aggregator.register_forward_hook(lambda _m, _i, out: out * 0.5)
    _, halved, _ = fn(x)
    torch.testing.assert_close(halved, plain * 0.5)
    handle.remove()
    torch.testing.assert_close(fn(x)[1], plain)


@pytest.mark.parametrize("name", list(HOOKED))
def test_features_level_pulls_the_hooked_aggregators_output(name):
    """At level='features' an aggregator maps V (the task gradients on `through`) to the
    direction pulled through the encoder, hooks included (LibMTL's rep_grad recipe): by
    hand, the aggregator on V, then one backward of `through` along its output."""
    encoder, _heads, losses = _model()
    features, task_losses = losses()
    rows = torch.stack(
        [
            torch.autograd.grad(loss, features, retain_graph=True)[0].flatten()
            for loss in task_losses
        ]
    )
    captured = []
    aggregator = HOOKED[name]()
    aggregator.weighting.register_forward_hook(lambda _m, _i, out: captured.append(out))
    direction = aggregator(rows).reshape(features.shape)
    want = torch.autograd.grad(features, list(encoder.parameters()), direction)

    encoder, _heads, losses = _model()
    features, task_losses = losses()
    weights = funcgrad.backward(
        task_losses, through=features, weighting=HOOKED[name](), level="features"
    )
    torch.testing.assert_close(weights, captured[-1])
    for p, expected in zip(encoder.parameters(), want):
        torch.testing.assert_close(p.grad, expected)

    # combine_heads at the features level: the same pull of the aggregator's output on V.
    x = torch.randn(4, 5)
    head_fns = [lambda y, i=i: y[:, i].sin().sum() * (i + 1) for i in range(K)]
    leaf = x.clone().requires_grad_()
    y = encoder(leaf)
    v = torch.stack([torch.autograd.grad(h(y), y, retain_graph=True)[0] for h in head_fns])
    (want_grad,) = torch.autograd.grad(y, leaf, HOOKED[name]()(v.flatten(1)).reshape(y.shape))
    _, grad, _ = funcgrad.combine_heads(encoder, head_fns, HOOKED[name](), level="features")(x)
    torch.testing.assert_close(grad, want_grad)


_DDP_SCRIPT = """
import sys, torch, funcgrad
from torchjd import aggregation as tjd
from funcgrad.bench.ranks import gloo_group

def main():  # the DDP module dies with it, before the group: none outlives the group
    torch.manual_seed(0)
    encoder = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(5, 6))
    heads = [torch.nn.Linear(6, 1) for _ in range(3)]
    hooked = tjd.Mean()
    hooked.register_forward_pre_hook(lambda _m, args: (args[0] * 2,))
    for level in ("params", "features"):
        features = encoder(torch.randn(4, 5))
        losses = [head(features).pow(2).mean() for head in heads]
        try:
            funcgrad.backward(
                losses, through=features, weighting=hooked, level=level, process_group=encoder
            )
        except ValueError as error:
            assert "forward hooks of its own" in str(error), error
            assert all(p.grad is None for p in encoder.parameters())
            print("refused", level)


with gloo_group(30, init_method="file://" + sys.argv[1], rank=0, world_size=1):
    main()
"""


@pytest.mark.slow  # a gloo process group, in a process of its own
def test_a_ddp_encoder_refuses_an_aggregator_whose_hooks_change_its_update(tmp_path):
    """DDP's reducer averages the backward of w @ V, which cannot carry what a hook on the
    aggregator itself does to its input or output: a clear error before any pass."""
    script = tmp_path / "ddp.py"
    script.write_text(_DDP_SCRIPT)
    run = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "store")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split("\n")[:2] == ["refused params", "refused features"], run.stderr


def test_an_aggregator_that_reports_no_weights_cannot_update_leaves_it_did_not_see():
    """An input that requires grad is not a parameter: it does not shape the weights and is
    not in the aggregator's Jacobian, so it gets w @ its gradients; without weights (here a
    weighted aggregator whose forward skips its weighting) that is a clear error."""

    class Halved(tjd.WeightedAggregator):
        def forward(self, matrix):
            return matrix.mean(dim=0) / 2

    encoder, heads, _ = _model()
    x = torch.randn(10, 5, requires_grad=True)
    features = encoder(x)
    task_losses = [head(features).pow(2).mean() for head in heads]
    with pytest.raises(ValueError, match=r"Halved reported no weights.*Pass inputs="):
        funcgrad.backward(task_losses, through=features, weighting=Halved(tjd.MeanWeighting()))
    assert x.grad is None and all(p.grad is None for p in encoder.parameters())
    # With every leaf in `inputs`, the aggregator sees them all, as jac_to_grad would (on a
    # new forward: the pull before the error freed the graph, as a backward does).
    features = encoder(x)
    task_losses = [head(features).pow(2).mean() for head in heads]
    leaves = [x, *encoder.parameters()]
    per_task = [torch.autograd.grad(loss, leaves, retain_graph=True) for loss in task_losses]
    funcgrad.backward(
        task_losses, through=features, weighting=Halved(tjd.MeanWeighting()), inputs=leaves
    )
    for leaf, grads in zip(leaves, zip(*per_task)):
        torch.testing.assert_close(leaf.grad, torch.stack(grads).mean(0) / 2)


@pytest.mark.parametrize("level", ["params", "features"])
@pytest.mark.parametrize("name", ["ExcessMTLWeighting", "CRMOGMWeighting"])
def test_the_returned_weights_do_not_alias_the_weightings_state(name, level):
    """These two return their state tensor as the weights. On main `backward` returned that
    tensor itself, so a caller's in-place change of the weights (a scaling for a log) changed
    the weighting's next weights, with no error."""
    runs = []
    for mutate in (False, True):
        weighting = OBJECTS[name]()
        *_, losses = _model()
        seen = []
        for _ in range(3):
            features, task_losses = losses()
            weights = funcgrad.backward(
                task_losses, through=features, weighting=weighting, level=level
            )
            seen.append(weights.clone())
            if mutate:
                weights.mul_(100.0)
        runs.append(seen)
    for kept, mutated in zip(*runs):
        torch.testing.assert_close(mutated, kept, rtol=0, atol=0)


@pytest.mark.parametrize("level", ["params", "features"])
@pytest.mark.parametrize("name", ["ExcessMTLWeighting", "CRMOGMWeighting"])
def test_the_weights_kept_in_the_graph_do_not_alias_the_weightings_state(name, level):
    """With ``create_graph=True`` the weights keep their graph and were, until session 12's
    review, the weighting's state tensor itself."""
    encoder, heads, _ = _model()
    x = torch.randn(10, 5)
    runs = []
    for mutate in (False, True):
        fn = funcgrad.combine_heads(
            encoder,
            [lambda y, h=h: h(y).pow(2).mean() for h in heads],
            OBJECTS[name](),
            level=level,
            create_graph=True,
        )
        seen = []
        for _ in range(3):
            _, _, weights = fn(x)
            seen.append(weights.detach().clone())
            if mutate:
                with torch.no_grad():
                    weights.mul_(100.0)
        runs.append(seen)
    for kept, mutated in zip(*runs):
        torch.testing.assert_close(mutated, kept, rtol=0, atol=0)
