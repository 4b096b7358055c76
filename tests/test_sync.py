"""The Sync policies on 2 gloo ranks: every rank applies and returns the same weights (also
for weightings that draw random numbers), the ranks agree before any backward (loss keys,
one rank's failed check), and an error leaves every .grad unchanged. Against one process on
the whole batch, in float64. Every collective has a 30 s timeout (a broken test fails, never
hangs)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torchjd.aggregation import Random

import funcgrad
from funcgrad.bench._ddp import gloo_group

WORLD = 2


def _model():
    torch.manual_seed(0)
    encoder = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 6))
    heads = torch.nn.ModuleList(torch.nn.Linear(6, 1) for _ in range(3))
    return encoder.double(), heads.double()


def _data():
    generator = torch.Generator().manual_seed(1)
    return torch.randn(8, 5, generator=generator), torch.randn(8, 3, generator=generator)


def _losses(encoder, heads, x, y):
    features = encoder(x)
    losses = [
        torch.nn.functional.mse_loss(head(features), y[:, i : i + 1])
        for i, head in enumerate(heads)
    ]
    return features, losses


def _setting(rank, wrap):
    encoder, heads = _model()
    ddp = torch.nn.parallel.DistributedDataParallel(encoder) if wrap == "ddp" else None
    return encoder, heads, (ddp or encoder), (ddp or dist.group.WORLD)


def _run(rank, store, body):
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    with gloo_group(30, init_method=f"file://{store}", rank=rank, world_size=WORLD):
        body(rank)


def _gathered(tensor):
    parts = [torch.empty_like(tensor) for _ in range(WORLD)]
    dist.all_gather(parts, tensor.contiguous())
    return parts


def _random_weights(rank):
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
        features, losses = _losses(run, heads, x[shard], y[shard])
        weights = funcgrad.backward(
            losses, through=features, weighting=weighting, level=level, process_group=group
        )
        message = f"{level} {wrap} {name}"
        for other in _gathered(weights):
            torch.testing.assert_close(other, weights, msg=message)
        # One process on the whole batch, with the weights every rank applied.
        features, losses = _losses(*reference, x, y)
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
    x, y = _data()
    shard = slice(rank * 4, rank * 4 + 4)
    for wrap in ("plain", "ddp"):
        # Loss dicts whose keys come in another order on rank 1: an error on every rank.
        encoder, heads, run, group = _setting(rank, wrap)
        features, losses = _losses(run, heads, x[shard], y[shard])
        named = {"a": losses[0], "b": losses[1]}
        if rank == 1:
            named = {"b": losses[1], "a": losses[0]}
        with pytest.raises(ValueError, match=r"ranks of `process_group` disagree \(loss keys"):
            funcgrad.backward(named, through=features, process_group=group)
        assert all(p.grad is None for p in [*encoder.parameters(), *heads.parameters()])

        # One rank fails a local check: its own error there, a clear one on the other rank.
        encoder, heads, run, group = _setting(rank, wrap)
        features, losses = _losses(run, heads, x[shard], y[shard])
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

        # A weighting that fails (NaN weights) on every rank: nothing written anywhere.
        for level in ("params", "features"):
            encoder, heads, run, group = _setting(rank, wrap)
            features, losses = _losses(run, heads, x[shard], y[shard])
            with pytest.raises(ValueError, match="non-finite weights"):
                funcgrad.backward(
                    losses,
                    through=features,
                    weighting=lambda g: torch.full((3,), float("nan")),
                    level=level,
                    process_group=group,
                )
            assert all(p.grad is None for p in [*encoder.parameters(), *heads.parameters()])


@pytest.mark.parametrize("body", [_random_weights, _disagreements])
def test_two_gloo_ranks(body, tmp_path):
    mp.spawn(_run, args=(str(tmp_path / "store"), body), nprocs=WORLD, join=True)
