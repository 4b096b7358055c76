"""Sync policies (``funcgrad._sync``), one by one: the no-op defaults of ``Sync``, what each
policy answers to the questions ``backward`` asks (check_inputs, configure, by_backward,
task_gradients, write), ``.grad`` written as autograd's AccumulateGrad writes it, and the
ranks' agreement, on one gloo rank in this process (a second rank's answers faked where
needed). ``backward`` on two real ranks: test_distributed.py and test_fsdp.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from funcgrad import _graph, _sync, _weighting
from funcgrad.bench.ranks import gloo_group

CALL = "funcgrad.backward(losses, through=...)"
WEIGHTED = _weighting.resolve(lambda g: torch.ones(g.shape[0]), "params", CALL)


@pytest.fixture
def one_rank():
    """torch.distributed initialised with one gloo rank, for the test's body only."""
    with gloo_group(60, store=dist.HashStore(), rank=0, world_size=1):
        yield dist.group.WORLD


# -- Sync: no distribution, every answer a no-op ----------------------------------------------


def test_without_ranks_every_collective_is_the_identity():
    sync = _sync.Sync(CALL)
    a, b = torch.randn(2, 3), torch.randn(4, dtype=torch.float32)
    assert sync.size == 1 and not sync.reduces_backward
    assert sync.features_gramian(a) is a
    assert sync.sum_over_shards(a) is a
    assert sync.from_first_rank(a) is a
    averaged = sync.average([a, b])
    assert isinstance(averaged, tuple) and averaged[0] is a and averaged[1] is b
    with sync.collecting(), sync.reducing_backward():
        pass
    assert sync.bytes == 0


def test_without_ranks_agree_raises_the_local_error_and_nothing_else():
    sync = _sync.Sync(CALL)
    sync.agree({"k": 3}, None)
    sync.agree(None, None)
    error = ValueError("losses[0] must be a scalar")
    with pytest.raises(ValueError) as info:
        sync.agree({"k": 3}, error)
    assert info.value is error


@pytest.mark.parametrize("one_pull", [False, True])
def test_without_ranks_backward_computes_and_writes_every_update_itself(one_pull):
    sync = _sync.Sync(CALL)
    x = torch.randn(3, requires_grad=True)
    assert sync.by_backward(one_pull) is False
    assert sync.check_inputs([x], x * 2) is None
    assert sync.configure([x], "params", WEIGHTED, checkpoint=True) is None
    pulled = (torch.randn(2, 3),)
    calls = []
    got = sync.task_gradients(
        (x.sum(),), (torch.ones(2),), False, lambda: calls.append(1) or pulled
    )
    assert calls == [1] and got[0] is pulled[0]


def test_write_accumulates_as_autograd_does():
    leaves = [torch.zeros(2, 3, requires_grad=True), torch.zeros(3, requires_grad=True)]
    reference = [torch.zeros_like(leaf, requires_grad=True) for leaf in leaves]
    sync = _sync.Sync(CALL)
    for _ in range(2):
        update = (torch.randn(2, 3), torch.randn(3))
        sync.write(leaves, update)
        torch.autograd.backward([r * 1.0 for r in reference], list(update))
    for leaf, r in zip(leaves, reference):
        torch.testing.assert_close(leaf.grad, r.grad)


def test_accumulate_keeps_what_it_owns_and_copies_what_is_shared():
    """As AccumulateGrad: a fresh gradient is kept without a copy, and so is a contiguous
    view of all its storage (a copy-on-write clone that takes its memory once the gradient
    is dropped); one given to two leaves (autograd hands one tensor to both leaves of a sum)
    or held elsewhere is copied by the side that writes; a part of a larger storage (a row
    of the k stacked per-task gradients, which would keep all k alive) is copied; a later
    one is added."""
    fresh, stacked = torch.randn(4), torch.randn(3, 4)
    address, values = fresh.data_ptr(), fresh.clone()
    a, b, c = (torch.zeros(4, requires_grad=True) for _ in range(3))
    _sync.accumulate(a, fresh)
    _sync.accumulate(b, fresh)
    assert a.grad is not fresh and b.grad is not fresh
    b.grad.mul_(2)  # (b's copy now: a and fresh keep their values)
    torch.testing.assert_close(b.grad, 2 * values)
    fresh.add_(1)  # (fresh's copy: a keeps the values)
    torch.testing.assert_close(a.grad, values)
    del fresh  # a alone holds the first memory now: a write takes it, no copy
    a.grad.add_(0)
    assert a.grad.data_ptr() == address
    _sync.accumulate(c, stacked[1])
    assert c.grad.untyped_storage().nbytes() == 4 * c.grad.element_size()
    torch.testing.assert_close(c.grad, stacked[1])
    want, held = a.grad + stacked[0], a.grad
    _sync.accumulate(a, stacked[0])
    assert a.grad is held
    torch.testing.assert_close(a.grad, want)
    whole, turned = torch.randn(2, 2).view(4), torch.randn(2, 2).t()  # views of all of it
    address = whole.data_ptr()
    e, f = torch.zeros(4, requires_grad=True), torch.zeros(2, 2, requires_grad=True)
    _sync.accumulate(e, whole)  # (tensordot's result: a reshaped product)
    del whole
    assert e.grad.data_ptr() == address
    address = turned.data_ptr()
    _sync.accumulate(f, turned)  # (not contiguous: copied to the leaf's layout)
    assert f.grad.is_contiguous() and f.grad.data_ptr() != address
    torch.testing.assert_close(f.grad, turned)
    sparse = torch.randn(4).to_sparse()
    d = torch.zeros(4, requires_grad=True)
    _sync.accumulate(d, sparse)
    assert d.grad.is_sparse
    torch.testing.assert_close(d.grad.to_dense(), sparse.to_dense())


# -- the policy for each `process_group` ------------------------------------------------------


def test_process_group_needs_an_initialised_torch_distributed():
    assert type(_sync.policy(None, CALL)) is _sync.Sync
    with pytest.raises(RuntimeError, match=r"`process_group` was given but torch.distributed"):
        _sync.policy(object(), CALL)


def test_each_process_group_gets_its_policy(one_rank):
    group = _sync.policy(one_rank, CALL)
    assert type(group) is _sync.GroupSync and (group.size, group.rank, group.source) == (1, 0, 0)
    ddp = nn.parallel.DistributedDataParallel(nn.Linear(3, 2))
    assert type(_sync.policy(ddp, CALL)) is _sync.DDPSync
    with pytest.raises(TypeError, match=r"pass ddp.process_group"):
        _sync.policy(ddp, CALL, allow_modules=False)
    with pytest.raises(TypeError, match=r"must be a torch.distributed ProcessGroup .* got Linear"):
        _sync.policy(nn.Linear(3, 2), CALL)


# -- GroupSync: one all-reduce per dtype, the first rank's weights -----------------------------


def test_a_group_averages_in_one_flat_buffer_per_dtype_and_counts_its_bytes(one_rank):
    sync = _sync.policy(one_rank, CALL)
    tensors = [
        torch.randn(2, 3),
        torch.randn(4, dtype=torch.float32),
        torch.randn(5),
        torch.randn((), dtype=torch.float32),
    ]
    averaged = sync.average(tensors)
    assert [(t.dtype, t.shape) for t in averaged] == [(t.dtype, t.shape) for t in tensors]
    for got, want in zip(averaged, tensors):
        torch.testing.assert_close(got, want)  # the mean over one rank
    assert sync.bytes == (6 + 5) * 8 + (4 + 1) * 4  # one buffer per dtype
    g = torch.randn(3, 3)
    torch.testing.assert_close(sync.features_gramian(g.clone()), g)  # sum / R^2, R = 1
    torch.testing.assert_close(sync.from_first_rank(g.clone()), g)
    assert sync.bytes == (6 + 5) * 8 + (4 + 1) * 4 + 2 * 9 * 8
    assert not sync.by_backward(True) and not sync.by_backward(False)
    pulled = (torch.randn(2, 3), torch.randn(2, dtype=torch.float32))
    got = sync.task_gradients((), (torch.ones(2),), False, lambda: pulled)
    for g_, p in zip(got, pulled):
        torch.testing.assert_close(g_, p)


def _second_rank(monkeypatch, answer):
    """A second rank, whose all-gathered answer is ``answer``."""

    def all_gather_object(gathered, mine, group=None):
        gathered[0], gathered[1] = mine, answer

    monkeypatch.setattr(_sync.dist, "all_gather_object", all_gather_object)


def test_the_ranks_agree_or_every_rank_raises_before_anything_is_sent(one_rank, monkeypatch):
    sync = _sync.policy(one_rank, CALL)
    sync.size = 2
    facts = {"k": 3, "keys": None}
    _second_rank(monkeypatch, ("GroupSync", dict(facts), None))
    sync.agree(facts, None)
    _second_rank(monkeypatch, ("GroupSync", {"k": 2, "keys": None}, None))
    with pytest.raises(ValueError, match=r"disagree \(k: 2 on rank 1 vs 3 on rank 0\)"):
        sync.agree(facts, None)
    _second_rank(monkeypatch, ("DDPSync", dict(facts), None))
    with pytest.raises(ValueError, match=r"disagree \(wrap: DDPSync on rank 1 vs GroupSync"):
        sync.agree(facts, None)
    _second_rank(monkeypatch, ("GroupSync", None, "ValueError: losses[0] must be a scalar"))
    with pytest.raises(RuntimeError, match=r"rank 1 of `process_group` failed its checks"):
        sync.agree(facts, None)
    error = TypeError("mine")
    with pytest.raises(TypeError) as info:
        sync.agree(None, error)
    assert info.value is error
    assert sync.bytes == 0


def test_the_first_ranks_weights_come_with_every_ranks_outcome(one_rank, monkeypatch):
    """The weights and a flag per rank in ONE all-reduce: a weighting that raised on any rank
    is an error on every rank (before, a rank whose weighting raised left the others waiting
    in the broadcast of the weights until the group's timeout); the weights arrive bit for bit
    (a -0.0 stays -0.0) and in G's dtype on every rank (a float64 weight that overflows
    float32 is inf on every rank, not on the ranks whose weighting returned float32 only)."""
    sync = _sync.policy(one_rank, CALL)
    g, w = torch.randn(3, 3, dtype=torch.float32), torch.rand(3, dtype=torch.float32)
    got, flags = sync.first_rank_of(lambda: w, 3, g)
    assert got is w and flags is not None and flags.tolist() == [0]  # the first rank's own
    sync.check_ranks(flags)
    assert sync.bytes == (3 + 1) * 8
    with pytest.raises(ZeroDivisionError):  # its own error, after telling the others
        sync.first_rank_of(lambda: 1 / 0, 3, g)
    assert sync.bytes == 2 * (3 + 1) * 8
    got, _ = sync.first_rank_of(lambda: torch.tensor([1e39, 0.0, 0.0], dtype=torch.float64), 3, g)
    assert got.dtype == torch.float32 and got.isinf().tolist() == [True, False, False]
    sync.size, sync.rank = 2, 1  # as rank 1 of two, whose rank 0 ...
    reduce = dist.all_reduce

    def rank_0_adds(payload, **kwargs):
        payload[:3] += torch.tensor(sent, dtype=torch.float64)  # ... sends these
        payload[3] += failed  # ... raised, or not
        return reduce(payload, **kwargs)

    monkeypatch.setattr(_sync.dist, "all_reduce", rank_0_adds)
    failed, sent = 0, [-0.0, 0.5, 0.25]
    got, flags = sync.first_rank_of(lambda: w.double(), 3, g)
    sync.check_ranks(flags)
    assert got.dtype == torch.float32 and got.tolist() == sent
    assert got[0].signbit()  # rank 0's -0.0 (+0.0 from the other ranks turned it to +0.0)
    failed = 1
    got, flags = sync.first_rank_of(lambda: w, 3, g)
    with pytest.raises(RuntimeError, match=r"the weighting raised on group rank\(s\) \[0\] of"):
        sync.check_ranks(flags)
    assert w.tolist() != sent  # (the weighting's own tensor is not written)


@pytest.mark.parametrize("level", ["features", "params"])
def test_the_ranks_flags_cost_no_host_read_of_their_own(one_rank, level):
    """A step with a group reads the host 3 times, as before the flags (they are read with the
    finite check of G and the weights, in its one read)."""
    import funcgrad

    encoder = nn.Linear(5, 6)
    heads = nn.ModuleList(nn.Linear(6, 1) for _ in range(3))
    features = encoder(torch.randn(8, 5))
    losses = [head(features).pow(2).mean() for head in heads]
    with funcgrad.HostReadCounter() as counter:
        funcgrad.backward(
            losses, through=features, weighting=lambda g: torch.softmax(g.diagonal(), 0),
            level=level, process_group=one_rank,
        )  # fmt: skip
    assert counter.count == 3, [str(read) for read in counter.reads]


# -- DDPSync: DDP's reducer averages where it wraps exactly the shared leaves -------------------


def test_ddp_reduces_by_its_backward_only_where_it_wraps_exactly_the_shared_leaves(one_rank):
    encoder = nn.Linear(3, 4)
    sync = _sync.policy(nn.parallel.DistributedDataParallel(encoder), CALL)
    shared = list(encoder.parameters())
    sync.configure(shared, "params", WEIGHTED, checkpoint=False)
    assert sync.by_backward(False) and sync.by_backward(True)
    sync.configure(shared[:1], "params", WEIGHTED, checkpoint=False)  # funcgrad averages
    assert not sync.by_backward(False) and not sync.by_backward(True)
    with pytest.raises(ValueError, match=r"reentrant checkpoint inside"):
        sync.configure(shared, "features", WEIGHTED, checkpoint=True)
    with pytest.raises(ValueError, match=r"returns an update that is not w @ P"):
        sync.configure(shared, "params", _weighting.Rule("vector", object()), checkpoint=False)
    static = nn.Linear(3, 4)
    sync = _sync.policy(nn.parallel.DistributedDataParallel(static, static_graph=True), CALL)
    sync.configure(list(static.parameters()), "features", WEIGHTED, checkpoint=False)
    with pytest.raises(ValueError, match=r"static_graph=True\) is not supported"):
        sync.configure(list(static.parameters()), "params", WEIGHTED, checkpoint=False)


# -- FSDPSync: FSDP's own backward, each rank's shards ----------------------------------------


def test_fsdp_answers_from_its_module(one_rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    encoder = nn.Sequential(nn.Linear(3, 4), nn.Tanh())
    with pytest.raises(ValueError, match=r"got no sharded parameter"):
        _sync.FSDPSync(encoder, CALL)
    fully_shard(encoder, mesh=init_device_mesh("cpu", (1,)))
    sync = _sync.policy(encoder, CALL)
    assert type(sync) is _sync.FSDPSync
    assert sync.by_backward(True) and not sync.by_backward(False)
    with pytest.raises(TypeError, match=r"use funcgrad.backward with"):
        _sync.policy(encoder, CALL, allow_modules=False)

    features = encoder(torch.randn(5, 3))
    sync.check_inputs(None, features)
    with pytest.raises(ValueError, match=r"`inputs` must be None"):
        sync.check_inputs(list(encoder.parameters()), features)
    leaves: dict = {}
    _graph.walk([_graph.edge(features)], {}, {}, leaves)
    shared = list(leaves.values())
    gramian = _weighting.resolve(None, "features", CALL)
    sync.configure(shared, "features", gramian, checkpoint=False)
    with pytest.raises(ValueError, match=r"not parameters of this FSDP module"):
        sync.configure([*shared, torch.randn(2, requires_grad=True)], "features", gramian, False)
    with pytest.raises(ValueError, match=r"reads the whole Jacobian"):
        sync.configure(shared, "params", _weighting.Rule("jacobian", object()), False)
    features.sum().backward()  # ends FSDP's iteration


# -- The group's lifetime -----------------------------------------------------------------------


@pytest.mark.parametrize("wrap", ["ProcessGroup", "DDP", "FSDP"])
def test_backward_keeps_no_reference_to_the_group(wrap):
    """After ``backward`` at both levels, ``destroy_process_group`` frees the group: funcgrad
    holds none (a group held past it keeps gloo's threads alive into the interpreter's
    teardown, which can abort the process)."""
    import gc
    import weakref

    from helpers import task_losses
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    from torchjd.aggregation import UPGradWeighting

    import funcgrad

    def train():
        torch.manual_seed(0)
        encoder = nn.Sequential(nn.Linear(5, 7), nn.Tanh())
        heads = nn.ModuleList(nn.Linear(7, 1) for _ in range(3))
        x, y = torch.randn(4, 5), torch.randn(4, 3)
        if wrap == "ProcessGroup":
            run, group = encoder, dist.group.WORLD
        elif wrap == "DDP":
            run = group = nn.parallel.DistributedDataParallel(encoder)
        else:
            run = group = fully_shard(encoder, mesh=init_device_mesh("cpu", (1,)))
        for level in ("params", "features", "params"):
            features, losses = task_losses(run, heads, x, y)
            funcgrad.backward(
                losses, through=features, weighting=UPGradWeighting(), level=level,
                process_group=group,
            )  # fmt: skip

    with gloo_group(60, store=dist.HashStore(), rank=0, world_size=1):
        world = weakref.ref(dist.group.WORLD)
        train()
        _clear_sharding_prop_cache()  # torch's own: it holds every DeviceMesh FSDP2 used
    gc.collect()
    assert world() is None, [type(r) for r in gc.get_referrers(world())]
