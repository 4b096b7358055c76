"""Host reads (each a stall of the stream on a GPU), counted on the CPU by
funcgrad.HostReadCounter: the counter itself, then every entry point's steady state; and a
dry run of shapes on the ``meta`` device, where no value can be read."""

from __future__ import annotations

import functools

import pytest
import torch

import funcgrad


def _count(fn) -> funcgrad.HostReadCounter:
    with funcgrad.HostReadCounter() as counter:
        fn()
    return counter


def test_the_counter_counts_each_way_of_reading_a_value():
    x = torch.tensor([1.0, -2.0])
    assert _count(lambda: bool(x[0])).count == 1
    assert _count(lambda: x[0].item()).count == 1
    assert _count(lambda: float(x.sum())).count == 1
    assert _count(lambda: torch.equal(x, x)).count == 1
    assert _count(lambda: torch.allclose(x, x)).count == 1

    def branch():
        if x.any():
            return 1
        return 0

    assert _count(branch).count == 1
    # Outputs whose shape depends on the values read a count from the device.
    assert _count(lambda: x[x > 0]).count == 1
    assert _count(lambda: torch.nonzero(x)).count == 1


def test_the_counter_counts_nothing_for_pure_tensor_ops():
    x = torch.randn(3, 4, requires_grad=True)

    def pure():
        y = torch.where(torch.isfinite(x), x, 0.0).tanh() @ torch.randn(4, 2)
        (g,) = torch.autograd.grad(y.sum(), x)
        torch._assert_async(torch.isfinite(g).all())  # the device-side check: no read
        torch.func.vmap(torch.func.grad(lambda v: v.sin().sum()))(x.detach())
        return x[torch.tensor([0, 2])], g.max(), y.sort()

    counter = _count(pure)
    assert counter.count == 0, [str(read) for read in counter.reads]


def test_a_counter_counts_one_block_at_a_time():
    counter = funcgrad.HostReadCounter()
    with counter, pytest.raises(RuntimeError, match="already counting a block"), counter:
        pass
    with counter:  # (usable again once its block is over)
        bool(torch.tensor(1.0))
    assert counter.count == 1


def test_the_counter_names_the_line_that_reads():
    x = torch.tensor(1.0)
    counter = _count(lambda: x.item())
    (read,) = counter.reads
    assert read.op == "aten._local_scalar_dense"
    assert read.where.startswith(__file__) and "lambda" in read.where
    counter.reset()
    assert counter.count == 0 and repr(counter) == "HostReadCounter(count=0)"


# Host reads of one steady-state call (the second with the same signature), per entry
# point, on the overhead case's tiny problems (funcgrad/bench/_overhead.py, float32, CPU).
# The test fails on a NEW read. The target is at most 1 read per call on every entry point
# (beyond what f, the heads and the weighting read themselves; the weighting here reads
# nothing). Where the remaining reads come from (the first frame outside torch):
#   compose_heads, scalar y (jacrev/jacfwd plans): all_finite on V @ J (the non-finite
#     recompute)
#   pb(v) alone, pb.many(V) alone (a Pullback's later calls): by_linearity's one read of
#     what the call learns at once (the held cotangents turned into directions, the new
#     cotangents' residual outside the kept span, whether they and their product are
#     finite); a Pullback's first call reads nothing (its cotangents go through f as they
#     are)
#   combine_heads, backward: _weighting.checked_weights (G and the weights, one read)
TARGET = 1
ALLOWED_READS = {
    "compose_heads": 0,
    "compose_heads, scalar y": 1,
    "stacked_heads": 0,
    "pullback + pb(v)": 0,
    "pullback + pb.many(V)": 0,
    "pb(v), a Pullback reused": 1,
    "combine_heads features": 1,
    "combine_heads params": 1,
    "grads": 0,
    "backward features": 1,
    "backward params": 1,
    # The calls of one Pullback alone, with a new cotangent each time.
    "pb(v) alone": 1,
    "pb.many(V) alone": 1,
    "pb(v) in the span": 1,
    "pb.many(V), k > m": 1,
    # compose_heads with each fixed strategy, on the scalar-y problem.
    "compose_heads, scalar y, vjp": 0,
    "compose_heads, scalar y, jacrev": 1,
    "compose_heads, scalar y, jacfwd": 1,
    "compose_heads, scalar y, loop": 0,
}


def _calls() -> dict[str, tuple[object, object]]:
    """name -> (warm-up call, counted call), the same signature."""
    from funcgrad.bench._overhead import entry_points

    calls: dict[str, tuple[object, object]] = {
        name: (point.funcgrad, point.funcgrad) for name, point in entry_points("cpu").items()
    }
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(8, 16, generator=gen)
    x = torch.randn(16, generator=gen)

    def f(x):
        return torch.tanh(w @ x)

    _, pb = funcgrad.pullback(f, x)
    v = torch.randn(4, 8, generator=gen)
    calls["pb(v) alone"] = (lambda: pb(v[0]), lambda: pb(v[1]))
    _, pb_many = funcgrad.pullback(f, x)
    calls["pb.many(V) alone"] = (lambda: pb_many.many(v[:2]), lambda: pb_many.many(v[2:]))
    _, pb_span = funcgrad.pullback(f, x)
    calls["pb(v) in the span"] = (lambda: pb_span(v[0]), lambda: pb_span(-2 * v[0]))
    _, pb_wide = funcgrad.pullback(f, x)
    wide = torch.randn(12, 8, generator=gen)
    calls["pb.many(V), k > m"] = (lambda: None, lambda: pb_wide.many(wide))

    def f_scalar(x):
        return torch.tanh(w @ x).pow(2).sum()

    heads = [lambda y, i=i: torch.sin(y * (i + 1)) for i in range(8)]
    for strategy in ("vjp", "jacrev", "jacfwd", "loop"):
        call = functools.partial(funcgrad.compose_heads(f_scalar, heads, strategy=strategy), x)
        calls[f"compose_heads, scalar y, {strategy}"] = (call, call)
    return calls


def test_host_reads_per_entry_point_do_not_grow():
    counts, where = {}, {}
    for name, (warm, counted) in _calls().items():
        warm()
        with funcgrad.HostReadCounter() as counter:
            counted()
        counts[name] = counter.count
        where[name] = [str(read) for read in counter.reads]
    assert set(counts) == set(ALLOWED_READS)
    grown = {
        name: (count, ALLOWED_READS[name], where[name])
        for name, count in counts.items()
        if count > ALLOWED_READS[name]
    }
    assert not grown, f"new host reads (count, allowed, where): {grown}"
    assert TARGET == 1  # the target; see the comment above ALLOWED_READS


# -- a dry run of shapes on the meta device: no value read, results of the right shapes ------


def _encoder_and_losses():
    with torch.device("meta"):
        encoder = torch.nn.Linear(4, 8)
        heads = torch.nn.ModuleList([torch.nn.Linear(8, 1) for _ in range(3)])
        x = torch.randn(5, 4)
    features = encoder(x)
    return encoder, heads, features, [head(features).sum() for head in heads]


@pytest.mark.parametrize("level", ["features", "params"])
@pytest.mark.parametrize("weighting", [None, "ones"])
def test_backward_on_meta(level, weighting):
    encoder, heads, features, losses = _encoder_and_losses()
    rule = None if weighting is None else (lambda g: torch.ones_like(g[0]))
    weights = funcgrad.backward(losses, through=features, level=level, weighting=rule)
    assert weights.shape == (3,)
    assert encoder.weight.grad.is_meta and encoder.weight.grad.shape == (8, 4)
    assert heads[0].weight.grad.shape == (1, 8)


@pytest.mark.parametrize("strategy", ["auto", "vjp", "jacrev", "jacfwd", "loop"])
def test_compose_and_combine_heads_on_meta(strategy):
    x = torch.randn(5, 4, device="meta")
    heads = [lambda y: y.sum(), lambda y: y[0, 0], lambda y: (y**2).mean()]
    values, grads = funcgrad.compose_heads(torch.tanh, heads, strategy=strategy)(x)
    assert values.is_meta and values.shape == (3,) and grads.shape == (3, 5, 4)
    fn = funcgrad.combine_heads(torch.tanh, heads, lambda g: torch.ones_like(g[0]))
    assert fn(x)[1].shape == (5, 4)


def test_grads_and_pullback_on_meta():
    x = torch.randn(6, device="meta", requires_grad=True)
    y = torch.sin(x)[:3]
    (got,) = funcgrad.grads([y.sum(), y[0], y[1] * y[2], (y**2).sum()], x, through=y)
    assert got.is_meta and got.shape == (4, 6)
    _, pb = funcgrad.pullback(torch.sin, torch.randn(3, device="meta"))
    assert pb.many(torch.randn(2, 3, device="meta"))[0].shape == (2, 3)
