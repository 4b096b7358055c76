"""Data-parallel funcgrad.backward and combine_heads (the Sync policies): 2 gloo ranks on CPU,
each rank's .grad against one process on the whole batch, in float64; every rank applies
and returns the same weights; the ranks agree before any backward, and an error leaves every
.grad unchanged. Every collective has a 30 s timeout (a failing test
ends, never hangs); every rank ends with the same barrier before destroying its group (see
funcgrad.bench.ranks.gloo_group)."""

from __future__ import annotations

import copy
import functools
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import rank_group, task_losses
from torchjd.aggregation import MeanWeighting, MGDAWeighting, Random, UPGrad, UPGradWeighting

import funcgrad
from funcgrad.bench.ranks import WORLD, spawn_ranks

pytestmark = pytest.mark.slow  # spawns gloo ranks and torchrun

CONFIGS = [
    (level, name, wrap)
    for level in ("params", "features")
    for name in ("UPGrad", "MGDA", "none")
    for wrap in ("plain", "ddp")
]
WEIGHTINGS = {"UPGrad": UPGradWeighting, "MGDA": MGDAWeighting, "none": lambda: None}


def _model():
    torch.manual_seed(0)
    encoder = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 6))
    heads = torch.nn.ModuleList(torch.nn.Linear(6, 1) for _ in range(3))
    return encoder.double(), heads.double()


def _data():
    generator = torch.Generator().manual_seed(1)
    return torch.randn(8, 5, generator=generator), torch.randn(8, 3, generator=generator)


def _step(encoder, heads, x, y, weighting, level, process_group=None):
    features, losses = task_losses(encoder, heads, x, y)
    return funcgrad.backward(
        losses, through=features, weighting=weighting, level=level, process_group=process_group
    )


def _group(rank, store):
    torch.set_default_dtype(torch.float64)
    return rank_group(rank, store)


def _agreement_worker(rank, store):
    with _group(rank, store):
        x, y = _data()
        shard = slice(rank * 4, rank * 4 + 4)
        for level, name, wrap in CONFIGS:
            encoder, heads = _model()
            ref_encoder, ref_heads = copy.deepcopy(encoder), copy.deepcopy(heads)
            shared = torch.nn.parallel.DistributedDataParallel(encoder) if wrap == "ddp" else None
            group = shared if shared is not None else dist.group.WORLD
            run = shared if shared is not None else encoder
            params = [*encoder.parameters(), *heads.parameters()]
            ref_params = [*ref_encoder.parameters(), *ref_heads.parameters()]
            optimizer = torch.optim.SGD(params, lr=0.1)
            ref_optimizer = torch.optim.SGD(ref_params, lr=0.1)
            for step in range(2):  # two steps in a row: DDP's reducer must be left clean
                optimizer.zero_grad()
                ref_optimizer.zero_grad()
                weights = _step(run, heads, x[shard], y[shard], WEIGHTINGS[name](), level, group)
                want = _step(ref_encoder, ref_heads, x, y, WEIGHTINGS[name](), level)
                torch.testing.assert_close(weights, want, msg=f"{level} {name} {wrap} {step}")
                for p, q in zip(params, ref_params):
                    torch.testing.assert_close(
                        p.grad, q.grad, rtol=1e-7, atol=1e-9, msg=f"{level} {name} {wrap} {step}"
                    )
                optimizer.step()
                ref_optimizer.step()
        # combine_heads: each rank on its shard against one call on the whole batch.
        module = _model()[0]
        params = {k: v.detach() for k, v in module.named_parameters()}
        head_fns = [
            lambda z, i=i: torch.nn.functional.mse_loss(z.sum(1, keepdim=True), z[:, i : i + 1])
            for i in range(3)
        ]

        def f(p, inputs):
            return torch.func.functional_call(module, p, (inputs,))

        for level in ("params", "features"):
            fn = funcgrad.combine_heads(
                f, head_fns, UPGradWeighting(), level=level, process_group=dist.group.WORLD
            )
            values, grad, weights = fn(params, x[shard])
            want = funcgrad.combine_heads(f, head_fns, UPGradWeighting(), level=level)(params, x)
            torch.testing.assert_close(values, want[0])
            torch.testing.assert_close(weights, want[2])
            for name in grad:
                torch.testing.assert_close(grad[name], want[1][name], rtol=1e-7, atol=1e-9)
        # A Jacobian aggregator at the params level, plain encoder.
        encoder, heads = _model()
        ref_encoder, ref_heads = copy.deepcopy(encoder), copy.deepcopy(heads)
        _step(encoder, heads, x[shard], y[shard], UPGrad(), "params", dist.group.WORLD)
        _step(ref_encoder, ref_heads, x, y, UPGrad(), "params")
        for p, q in zip(encoder.parameters(), ref_encoder.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-7, atol=1e-9)


def _mismatch(rank):
    """Another number of losses on one rank: the same clear error on both."""
    x, _ = _data()
    encoder, heads = _model()
    features = encoder(x[rank * 4 : rank * 4 + 4])
    losses = [head(features).mean() for head in heads][: 3 - rank]  # k = 3 vs 2
    with pytest.raises(ValueError, match=r"ranks of `process_group` disagree \(number of"):
        funcgrad.backward(
            losses,
            through=features,
            weighting=UPGradWeighting(),
            process_group=dist.group.WORLD,
        )
    assert all(p.grad is None for p in encoder.parameters())


def _setting(rank, wrap):
    encoder, heads = _model()
    ddp = torch.nn.parallel.DistributedDataParallel(encoder) if wrap == "ddp" else None
    return encoder, heads, (ddp or encoder), (ddp or dist.group.WORLD)


def _gathered(tensor):
    parts = [torch.empty_like(tensor) for _ in range(WORLD)]
    dist.all_gather(parts, tensor.contiguous())
    return parts


def _random_weights(rank):
    """Every rank applies and returns the first rank's weights, also for weightings that
    draw random numbers (each rank draws others here)."""
    torch.manual_seed(100 + rank)  # every rank draws other numbers
    x, y = _data()
    shard = slice(rank * 4, rank * 4 + 4)
    cases = [
        (level, wrap, name)
        for level in ("params", "features")
        for wrap in ("plain", "ddp")
        for name in ("gramian", "aggregator")
        if not (name == "aggregator" and level == "features")
    ]
    for level, wrap, name in cases:
        encoder, heads, run, group = _setting(rank, wrap)
        reference = copy.deepcopy((encoder, heads))
        weighting = Random() if name == "aggregator" else (lambda g: torch.rand(g.shape[0]))
        features, losses = task_losses(run, heads, x[shard], y[shard])
        weights = funcgrad.backward(
            losses, through=features, weighting=weighting, level=level, process_group=group
        )
        message = f"{level} {wrap} {name}"
        for other in _gathered(weights):
            torch.testing.assert_close(other, weights, msg=message)
        # One process on the whole batch, with the weights every rank applied.
        features, losses = task_losses(*reference, x, y)
        funcgrad.backward(losses, through=features, weighting=lambda g, w=weights: w, level=level)
        params = [*encoder.parameters(), *heads.parameters()]
        ref_params = [*reference[0].parameters(), *reference[1].parameters()]
        for p, q in zip(params, ref_params):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-7, atol=1e-9, msg=message)
    # combine_heads with a ProcessGroup: the weights returned are the ones applied.
    module = _model()[0]
    params = {k: v.detach() for k, v in module.named_parameters()}
    head_fns = [lambda z, i=i: z[:, i].pow(2).mean() for i in range(3)]

    def f(p, inputs):
        return torch.func.functional_call(module, p, (inputs,))

    for level in ("params", "features"):
        fn = funcgrad.combine_heads(
            f, head_fns, lambda g: torch.rand(3), level=level, process_group=dist.group.WORLD
        )
        _, grad, weights = fn(params, x[shard])
        for other in _gathered(weights):
            torch.testing.assert_close(other, weights)
        want = funcgrad.combine_heads(f, head_fns, lambda g, w=weights: w, level=level)(params, x)
        for key in grad:
            torch.testing.assert_close(grad[key], want[1][key], rtol=1e-7, atol=1e-9)


def _disagreements(rank):
    """Loss keys in another order, one rank failing its checks, a weighting failing
    everywhere: a clear error on every rank, and no .grad written anywhere."""
    x, y = _data()
    shard = slice(rank * 4, rank * 4 + 4)
    for wrap in ("plain", "ddp"):
        # Loss dicts whose keys come in another order on rank 1: an error on every rank.
        encoder, heads, run, group = _setting(rank, wrap)
        features, losses = task_losses(run, heads, x[shard], y[shard])
        named = {"a": losses[0], "b": losses[1]}
        if rank == 1:
            named = {"b": losses[1], "a": losses[0]}
        with pytest.raises(ValueError, match=r"ranks of `process_group` disagree \(loss keys"):
            funcgrad.backward(named, through=features, process_group=group)
        assert all(p.grad is None for p in [*encoder.parameters(), *heads.parameters()])

        # One rank fails a local check: its own error there, a clear one on the other rank.
        encoder, heads, run, group = _setting(rank, wrap)
        features, losses = task_losses(run, heads, x[shard], y[shard])
        if rank == 1:
            losses[2] = x[shard].sum() * torch.ones((), requires_grad=True)
        expected = (
            (ValueError, r"losses\[2\] does not depend on `through`")
            if rank == 1
            else (RuntimeError, r"rank 1 of `process_group` failed its checks")
        )
        with pytest.raises(expected[0], match=expected[1]):
            funcgrad.backward(losses, through=features, level="features", process_group=group)
        assert all(p.grad is None for p in [*encoder.parameters(), *heads.parameters()])

        # Rank 0 alone runs a second call through the graph it spent (retain_graph=False):
        # torch's error there, a clear one on rank 1 (which ran a new forward), no hang.
        # (Not under DDP, whose forward itself must run as often on every rank.)
        for level in ("params", "features") if wrap == "plain" else ():
            encoder, heads, run, group = _setting(rank, wrap)
            features, losses = task_losses(run, heads, x[shard], y[shard])
            funcgrad.backward(losses, through=features, level=level, process_group=group)
            before = [p.grad.clone() for p in encoder.parameters()]
            if rank == 1:
                features, losses = task_losses(run, heads, x[shard], y[shard])
            expected = (
                (RuntimeError, "backward through the graph a second time")
                if rank == 0
                else (RuntimeError, r"rank 0 of `process_group` failed its checks")
            )
            with pytest.raises(expected[0], match=expected[1]):
                funcgrad.backward(losses, through=features, level=level, process_group=group)
            for p, b in zip(encoder.parameters(), before):
                assert torch.equal(p.grad, b)
        # Under DDP every rank repeats the call: torch's error on each, before any collective.
        for level in ("params", "features") if wrap == "ddp" else ():
            encoder, heads, run, group = _setting(rank, wrap)
            features, losses = task_losses(run, heads, x[shard], y[shard])
            funcgrad.backward(losses, through=features, level=level, process_group=group)
            before = [p.grad.clone() for p in encoder.parameters()]
            with pytest.raises(RuntimeError, match="backward through the graph a second time"):
                funcgrad.backward(losses, through=features, level=level, process_group=group)
            for p, b in zip(encoder.parameters(), before):
                assert torch.equal(p.grad, b)

        # A weighting that fails (NaN weights) on every rank: nothing written anywhere.
        for level in ("params", "features"):
            encoder, heads, run, group = _setting(rank, wrap)
            features, losses = task_losses(run, heads, x[shard], y[shard])
            with pytest.raises(ValueError, match="non-finite weights"):
                funcgrad.backward(
                    losses,
                    through=features,
                    weighting=lambda g: torch.full((3,), float("nan")),
                    level=level,
                    process_group=group,
                )
            assert all(p.grad is None for p in [*encoder.parameters(), *heads.parameters()])


def _wrapped(config):
    """(encoder, side branch, heads, how a batch becomes the features, the DDP module) for a
    way people wrap DDP: all of the encoder, part of it, a side branch beside it, the heads
    inside it, or with static_graph."""
    encoder, heads = _model()
    side = torch.nn.Linear(5, 6).double()
    if config == "part":
        ddp = torch.nn.parallel.DistributedDataParallel(encoder[0])
        return encoder, side, heads, lambda x: (encoder[2](encoder[1](ddp(x))),), ddp
    if config == "heads inside":
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.ModuleList([encoder, heads]))
        return encoder, side, heads, lambda x: (ddp.module[0](x),), ddp
    static = config == "static graph"
    ddp = torch.nn.parallel.DistributedDataParallel(encoder, static_graph=static)
    if config == "side branch":
        return encoder, side, heads, lambda x: (ddp(x), side(x)), ddp
    return encoder, side, heads, lambda x: (ddp(x),), ddp


def _ddp_configurations(rank):
    """Each way of wrapping DDP is exact on every rank (against one process on the whole
    batch, two SGD steps), or a clear error on every rank."""
    x, y = _data()
    shard = slice(rank * 4, rank * 4 + 4)
    for config in ("part", "side branch", "heads inside", "static graph"):
        for level in ("params", "features"):
            encoder, side, heads, features_of, ddp = _wrapped(config)
            reference = copy.deepcopy((encoder, side, heads))
            params = [*encoder.parameters(), *side.parameters(), *heads.parameters()]
            ref_params = [p for module in reference for p in module.parameters()]
            optimizer = torch.optim.SGD(params, lr=0.1)
            ref_optimizer = torch.optim.SGD(ref_params, lr=0.1)
            for step in range(2):
                optimizer.zero_grad()
                ref_optimizer.zero_grad()
                features = features_of(x[shard])
                losses = [
                    torch.nn.functional.mse_loss(head(sum(features)), y[shard][:, i : i + 1])
                    for i, head in enumerate(heads)
                ]
                step_funcgrad = functools.partial(
                    funcgrad.backward,
                    losses,
                    through=features,
                    weighting=UPGradWeighting(),
                    level=level,
                    process_group=ddp,
                )
                if config == "static graph" and level == "params":
                    with pytest.raises(ValueError, match=r"static_graph=True\) is not supported"):
                        step_funcgrad()
                    assert all(p.grad is None for p in params)
                    break
                step_funcgrad()
                ref_features = (reference[0](x),) + (
                    (reference[1](x),) if config == "side branch" else ()
                )
                ref_losses = [
                    torch.nn.functional.mse_loss(head(sum(ref_features)), y[:, i : i + 1])
                    for i, head in enumerate(reference[2])
                ]
                funcgrad.backward(
                    ref_losses, through=ref_features, weighting=UPGradWeighting(), level=level
                )
                for p, q in zip(params, ref_params):
                    want = torch.zeros_like(q) if q.grad is None else q.grad
                    got = torch.zeros_like(p) if p.grad is None else p.grad
                    torch.testing.assert_close(
                        got, want, rtol=1e-7, atol=1e-9, msg=f"{config} {level} {step}"
                    )
                optimizer.step()
                ref_optimizer.step()


def _sync_worker(rank, store):
    with _group(rank, store):
        _mismatch(rank)
        _random_weights(rank)
        _disagreements(rank)
        _ddp_configurations(rank)


def _raising_on(rank, failing, weighting):
    """``weighting``, raising on rank ``failing`` (a solver failing there, state that differs)."""

    def pre_hook(module, inputs):
        if rank == failing:
            raise RuntimeError("the solver failed on this rank")

    if isinstance(weighting, torch.nn.Module):  # a TorchJD object: the hook runs in its call
        weighting.register_forward_pre_hook(pre_hook)
        return weighting
    return lambda g: pre_hook(None, (g,)) or weighting(g)


def _one_rank_failing_worker(rank, store):
    """A weighting (or aggregator) that raises on ONE rank, after the ranks agreed: its error
    there, a clear error on the other rank (which waited for its weights in a collective
    until the group's timeout before), no .grad written anywhere; then the next step runs
    on the same group and equals one process on the whole batch."""
    with _group(rank, store):
        x, y = _data()
        shard = slice(rank * 4, rank * 4 + 4)
        cases = [
            (wrap, level, name, failing)
            for wrap in ("plain", "ddp")
            for level in ("params", "features")
            for name in ("gramian", "aggregator", "jacobian")
            for failing in (0, 1)
            if name == "gramian" or (wrap, level) == ("plain", "params")
        ]
        for wrap, level, name, failing in cases:
            message = f"{wrap} {level} {name}, failing on rank {failing}"
            make = {"gramian": UPGradWeighting, "aggregator": UPGrad, "jacobian": MeanWeighting}
            weighting = make[name]() if name != "gramian" else lambda g: UPGradWeighting()(g)
            encoder, heads, run, group = _setting(rank, wrap)
            params = [*encoder.parameters(), *heads.parameters()]
            features, losses = task_losses(run, heads, x[shard], y[shard])
            raising = _raising_on(rank, failing, weighting)
            expected = (
                (RuntimeError, "the solver failed on this rank")
                if rank == failing
                else (RuntimeError, rf"weighting raised on group rank\(s\) \[{failing}\]")
            )
            with pytest.raises(expected[0], match=expected[1]):
                funcgrad.backward(
                    losses, through=features, weighting=raising, level=level, process_group=group
                )
            assert all(p.grad is None for p in params), message
            # The next step, on the same group: as one process on the whole batch.
            reference = copy.deepcopy((encoder, heads))
            features, losses = task_losses(run, heads, x[shard], y[shard])
            weighting = make[name]()
            funcgrad.backward(
                losses, through=features, weighting=weighting, level=level, process_group=group
            )
            features, losses = task_losses(*reference, x, y)
            funcgrad.backward(losses, through=features, weighting=make[name](), level=level)
            ref_params = [*reference[0].parameters(), *reference[1].parameters()]
            for p, q in zip(params, ref_params):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-7, atol=1e-9, msg=message)


@pytest.mark.parametrize("worker", [_agreement_worker, _sync_worker, _one_rank_failing_worker])
def test_two_gloo_ranks(worker, tmp_path):
    spawn_ranks(worker, str(tmp_path / "store"))


def test_process_group_needs_an_initialised_group():
    encoder, heads = _model()
    features = encoder(torch.randn(4, 5))
    with pytest.raises(RuntimeError, match=r"torch\.distributed is not initialised"):
        funcgrad.backward([h(features).mean() for h in heads], through=features, process_group=1)


def test_the_example_runs_under_torchrun():
    example = Path(__file__).parent.parent / "examples" / "ddp_multitask.py"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(example),
        ],
        capture_output=True,
        text=True,
        timeout=600,  # a loaded 2-core machine; its collectives time out after 60 s
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stdout.count("largest .grad difference") == 6
