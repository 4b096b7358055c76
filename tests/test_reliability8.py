"""Reliability hunt (session 8): silently wrong answers found on main, each against its
independent reference in float64 (a per-example loop of torch.autograd.grad, per-head
autograd with create_graph)."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn

import funcgrad
from funcgrad._per_example import _run

B = 6


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 4)).double()


def _x() -> torch.Tensor:
    return torch.randn(B, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


PERM = torch.tensor([1, 0, 3, 2, 5, 4])
SAME = torch.arange(B)
UP = 100.0 * torch.arange(B, dtype=torch.float64)[:, None]

# (a loss on the model's (B, 4) output that treats the examples independently, one with
# the same kinds of graph nodes that mixes them): the independence check's signature held
# the nodes' kinds only, so the second, after the first was checked, went unchecked
PAIRS: dict[
    str, tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]
] = {
    "flip": (lambda o: o + o.flip(1), lambda o: o + o.flip(0)),
    "roll": (lambda o: o + o.roll(1, 1), lambda o: o + o.roll(1, 0)),
    "mean": (lambda o: o - o.mean(1, keepdim=True), lambda o: o - o.mean(0, keepdim=True)),
    "sum": (lambda o: o * o.sum(1, keepdim=True), lambda o: o * o.sum(0, keepdim=True)),
    "softmax": (lambda o: o.softmax(1), lambda o: o.softmax(0)),
    "transpose": (
        lambda o: o.reshape(B, 2, 2).transpose(1, 2).sum(2).repeat(1, 2),
        lambda o: o.reshape(B // 2, 2, 4).transpose(0, 1).sum(0).repeat(2, 1),
    ),
    "slice": (lambda o: o + o[:, :1], lambda o: o + o[:1, :]),
    "index_select": (lambda o: o.index_select(0, SAME), lambda o: o.index_select(0, PERM)),
    "index": (lambda o: o[SAME] * o, lambda o: o[PERM] * o),
    "gather": (
        lambda o: o.gather(0, SAME[:, None].expand(B, 4)) * o,
        lambda o: o.gather(0, PERM[:, None].expand(B, 4)) * o,
    ),
    "sort": (  # sorted along the examples: the identity order on the checked call
        lambda o: (o + UP).sort(0).values,
        lambda o: (o + UP.flip(0)).sort(0).values,
    ),
    "number": (lambda o: o + 0.0 * o.mean(0), lambda o: o + 0.5 * o.mean(0)),
    "small number": (lambda o: o + 1e-12 * o.mean(0), lambda o: o + 0.5 * o.mean(0)),
    # a scale kept as a 0-dim tensor, as the FIRST operand (a ramped loss weight)
    "tensor first": (lambda o: o + _t(0.0) * o.mean(0), lambda o: o + _t(0.5) * o.mean(0)),
    "torch.mul first": (
        lambda o: o + torch.mul(_t(0.0), o.mean(0)),
        lambda o: o + torch.mul(_t(0.5), o.mean(0)),
    ),
    "div first": (lambda o: o + _t(0.0) / o.mean(0), lambda o: o + _t(0.5) / o.mean(0)),
    # lerp's tensor weight: 0 keeps o alone; and its number weight: 1 takes o alone
    "lerp tensor": (
        lambda o: torch.lerp(o, o.mean(0, keepdim=True).expand_as(o), _t(0.0)),
        lambda o: torch.lerp(o, o.mean(0, keepdim=True).expand_as(o), _t(0.5)),
    ),
    "lerp tensor one": (
        lambda o: torch.lerp(o.mean(0, keepdim=True).expand_as(o), o, _t(1.0)),
        lambda o: torch.lerp(o.mean(0, keepdim=True).expand_as(o), o, _t(0.75)),
    ),
    "lerp number one": (
        lambda o: torch.lerp(o.mean(0, keepdim=True).expand_as(o), o, 1.0),
        lambda o: torch.lerp(o.mean(0, keepdim=True).expand_as(o), o, 0.75),
    ),
}


def _t(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float64)


def _gram_loop(model: nn.Module, loss: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The Gramian of the per-loss gradients, by a loop of torch.autograd.grad."""
    params = list(model.parameters())
    losses = loss(model(_x())).pow(2).sum(1)
    rows = [
        torch.cat([g.flatten() for g in torch.autograd.grad(losses[b], params, retain_graph=True)])
        for b in range(B)
    ]
    J = torch.stack(rows)
    return J @ J.T


@pytest.mark.parametrize("name", sorted(PAIRS))
@pytest.mark.parametrize("call", ["gramian", "backward"])
def test_per_example_checks_a_mixing_term_with_the_same_kinds_of_ops(name, call):
    plain, mixing = PAIRS[name]
    model = _model()
    with funcgrad.per_example(model) as pe:
        for _ in range(2):
            gram = pe.gramian(plain(model(_x())).pow(2).sum(1))
        assert torch.allclose(gram, _gram_loop(model, plain), rtol=1e-10, atol=1e-12)
        # the mixing loss's true per-loss Gramian is not what the rules would give
        losses = mixing(model(_x())).pow(2).sum(1)
        with pytest.raises(ValueError, match="do not treat the examples independently"):
            if call == "gramian":
                pe.gramian(losses)
            else:
                pe.backward(losses, weighting=lambda g: torch.ones(B, dtype=g.dtype))
    assert all(p.grad is None for p in model.parameters())


def _count_checks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    count = [0]
    probe = _run._probe

    def counted(*args, **kwargs):
        count[0] += 1
        return probe(*args, **kwargs)

    monkeypatch.setattr(_run, "_probe", counted)
    return count


def test_per_example_targets_and_scales_do_not_check_every_call(monkeypatch):
    # What changes with every batch and cannot move one example's row to another (the
    # class labels a loss picks, a scale within a power of two) is not in the signature:
    # the check runs on the first call alone.
    count = _count_checks(monkeypatch)
    model = _model()
    gen = torch.Generator().manual_seed(3)
    with funcgrad.per_example(model) as pe:
        for step in range(6):
            y = torch.randint(0, 4, (B,), generator=gen)
            out = model(_x())
            ce = nn.functional.cross_entropy(out, y, reduction="none")
            picked = out.log_softmax(1).gather(1, y[:, None])[:, 0]
            chosen = out[torch.arange(B), y]
            pe.gramian(ce * (1.0 + 0.01 * step) + picked + chosen)
    assert count[0] == 1


def test_per_example_signatures_held_are_bounded(monkeypatch):
    # A scale that crosses a power of two on every call is a new signature each time
    # (checked again, right): the set of checked signatures does not grow without bound.
    from funcgrad._per_example import _independence

    monkeypatch.setattr(_independence, "_SIGNATURES", 4)
    count = _count_checks(monkeypatch)
    model = _model()
    with funcgrad.per_example(model) as pe:
        for step in range(10):
            pe.gramian((2.0**step * model(_x())).pow(2).sum(1))
            assert len(pe._independent) <= 4
    assert count[0] == 10


# -- combine_heads(create_graph=True): the weights' dependence on theta ---------------------

N, M = 3, 4


def _f(theta: torch.Tensor) -> torch.Tensor:
    A = torch.arange(1.0, 1.0 + M * N, dtype=theta.dtype).reshape(M, N) / 7
    return torch.tanh(A @ theta) + theta.sum() ** 2 / 5


HEADS = [
    lambda y: y.pow(2).sum(),
    lambda y: (y[0] - 2 * y[1]).sin(),
    lambda y: y.exp().sum() / 3,
]


def _inverse_norms(G: torch.Tensor) -> torch.Tensor:  # a weighting of G with a graph
    return G.diagonal().rsqrt()


def _solve(G: torch.Tensor) -> torch.Tensor:  # a closed form that mixes G's entries
    eye = torch.eye(G.shape[0], dtype=G.dtype)
    return torch.linalg.solve(G + eye, torch.ones(G.shape[0], dtype=G.dtype))


def _theta() -> torch.Tensor:
    gen = torch.Generator().manual_seed(5)
    return torch.randn(N, generator=gen, dtype=torch.float64).requires_grad_()


def _by_hand(
    theta: torch.Tensor, weighting: Callable[[torch.Tensor], torch.Tensor], level: str = "params"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``w(J J^T) @ J`` (level "params") or ``w(V V^T) @ J`` (level "features", V the heads'
    gradients on y), with J from per-head autograd, create_graph=True throughout."""
    y = _f(theta)
    J = torch.stack([torch.autograd.grad(h(y), theta, create_graph=True)[0] for h in HEADS])
    if level == "params":
        rows = J
    else:
        rows = torch.stack([torch.autograd.grad(h(y), y, create_graph=True)[0] for h in HEADS])
    weights = weighting(rows @ rows.T)
    return weights @ J, weights


@pytest.mark.parametrize("weighting", [_inverse_norms, _solve], ids=["inverse_norms", "solve"])
@pytest.mark.parametrize("level", ["params", "features"])
def test_combine_heads_create_graph_differentiates_the_weights(weighting, level):
    theta = _theta()
    fn = funcgrad.combine_heads(_f, HEADS, weighting, level=level, create_graph=True)
    _, grad, weights = fn(theta)
    want, want_weights = _by_hand(theta, weighting, level)
    assert torch.allclose(grad, want, rtol=1e-10, atol=1e-12)
    assert torch.allclose(weights, want_weights, rtol=1e-10, atol=1e-12)
    assert weights.requires_grad  # the returned weights keep their graph
    probe = torch.tensor([0.3, -1.1, 0.7], dtype=torch.float64)
    got = torch.autograd.grad(grad @ probe + weights.sum(), theta, create_graph=True)[0]
    ref = torch.autograd.grad(want @ probe + want_weights.sum(), theta, create_graph=True)[0]
    assert torch.allclose(got, ref, rtol=1e-9, atol=1e-11)
    # second order: the meta-gradient's own gradient
    got2 = torch.autograd.grad(got.pow(2).sum(), theta)[0]
    ref2 = torch.autograd.grad(ref.pow(2).sum(), theta)[0]
    assert torch.allclose(got2, ref2, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("level", ["params", "features"])
def test_combine_heads_create_graph_matches_finite_differences(level):
    fn = funcgrad.combine_heads(_f, HEADS, _solve, level=level, create_graph=True)
    assert torch.autograd.gradcheck(lambda t: fn(t)[1], (_theta(),))
    assert torch.autograd.gradgradcheck(lambda t: fn(t)[1], (_theta(),))


def test_combine_heads_create_graph_reaches_a_weighting_s_own_leaves():
    # weights from a learnable vector, not from G: "not used in the graph" before
    logits = torch.tensor([0.2, -0.4, 1.0], dtype=torch.float64, requires_grad=True)
    theta = _theta()
    fn = funcgrad.combine_heads(_f, HEADS, lambda G: torch.softmax(logits, 0), create_graph=True)
    _, grad, _ = fn(theta)
    got = torch.autograd.grad(grad.pow(2).sum(), [logits, theta])
    want, _ = _by_hand(theta, lambda G: torch.softmax(logits, 0))
    ref = torch.autograd.grad(want.pow(2).sum(), [logits, theta])
    for a, b in zip(got, ref):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("level", ["params", "features"])
def test_combine_heads_without_create_graph_builds_no_graph(level):
    seen = []

    def weighting(G: torch.Tensor) -> torch.Tensor:
        seen.append(G.requires_grad)
        return _solve(G)

    theta = _theta()
    _, grad, weights = funcgrad.combine_heads(_f, HEADS, weighting, level=level)(theta)
    assert seen == [False] and not grad.requires_grad and not weights.requires_grad
    want, _ = _by_hand(theta, _solve, level)
    assert torch.allclose(grad, want.detach(), rtol=1e-10, atol=1e-12)


def test_combine_heads_inside_torch_func_grad_differentiates_the_weights():
    # inside a transform the call keeps its results' graph: the weights' too
    theta = _theta()
    probe = torch.tensor([0.3, -1.1, 0.7], dtype=torch.float64)
    fn = funcgrad.combine_heads(_f, HEADS, _solve)
    got = torch.func.grad(lambda t: fn(t)[1] @ probe)(theta.detach())
    want, _ = _by_hand(theta, _solve)
    ref = torch.autograd.grad(want @ probe, theta)[0]
    assert torch.allclose(got, ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    "name",
    [
        "UPGradWeighting",
        "MGDAWeighting",
        "AlignedMTLWeighting",
        "DualProjWeighting",
        "MGDA",
        "UPGrad",
    ],
)
def test_combine_heads_create_graph_with_torchjd_objects(name):
    # TorchJD's weightings under create_graph, against the same object by hand: MGDA's and
    # AlignedMTL's weights carry a graph; UPGrad's and DualProj's are computed under no_grad
    # (TorchJD's _NonDifferentiable), constants to the meta-gradient in both
    aggregation = pytest.importorskip("torchjd.aggregation")
    weighting = getattr(aggregation, name)()
    by_hand = weighting if name.endswith("Weighting") else weighting.gramian_weighting
    theta = _theta()
    _, grad, weights = funcgrad.combine_heads(_f, HEADS, weighting, create_graph=True)(theta)
    want, want_weights = _by_hand(theta, by_hand)
    assert torch.allclose(grad, want, rtol=1e-8, atol=1e-10)
    assert weights.requires_grad == want_weights.requires_grad
    got = torch.autograd.grad(grad.pow(2).sum(), theta)[0]
    ref = torch.autograd.grad(want.pow(2).sum(), theta)[0]
    assert torch.allclose(got, ref, rtol=1e-8, atol=1e-10)


def test_combine_heads_create_graph_a_numpy_weighting_gets_a_note():
    def numpy_weighting(G: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(1 / G.numpy().diagonal() ** 0.5)

    fn = funcgrad.combine_heads(_f, HEADS, numpy_weighting, create_graph=True)
    with pytest.raises(RuntimeError) as info:
        fn(_theta())
    assert any("take its .detach() itself" in note for note in info.value.__notes__)

    def detaching(G: torch.Tensor) -> torch.Tensor:  # the fix the note names
        return numpy_weighting(G.detach())

    theta = _theta()
    _, grad, weights = funcgrad.combine_heads(_f, HEADS, detaching, create_graph=True)(theta)
    want, _ = _by_hand(theta, detaching)
    assert not weights.requires_grad
    got = torch.autograd.grad(grad.sum(), theta)[0]
    assert torch.allclose(got, torch.autograd.grad(want.sum(), theta)[0], rtol=1e-10)


# -- a TorchJD aggregator shared by threads ----------------------------------------------------


def test_combine_heads_aggregator_shared_by_two_threads_reports_each_its_own_weights():
    # An aggregator with hooks runs on the Jacobian, and funcgrad reads its weights by a
    # forward hook on its weighting, registered for the call. Two threads sharing the
    # aggregator: each call's hook also caught the other thread's weights, so the thread
    # whose weighting ran first returned the other's weights (forced here by events).
    aggregation = pytest.importorskip("torchjd.aggregation")
    import threading

    aggregator = aggregation.UPGrad()
    barrier = threading.Barrier(2, timeout=20)
    first_done, second_done = threading.Event(), threading.Event()
    local = threading.local()

    def pre_hook(module, args):
        barrier.wait()  # both calls have registered their hooks
        if local.order == 1:
            assert first_done.wait(20)

    def post_hook(module, args, out):
        if local.order == 0:
            first_done.set()  # the other thread's weighting runs now, this call's hook live
            assert second_done.wait(20)
        else:
            second_done.set()

    aggregator.register_forward_pre_hook(pre_hook)
    aggregator.register_forward_hook(post_hook)
    fn = funcgrad.combine_heads(_f, HEADS, aggregator)
    thetas = [_theta().detach(), 2 * _theta().detach() + 0.5]
    results: list = [None, None]
    errors: list = []

    def run(order: int) -> None:
        local.order = order
        try:
            results[order] = fn(thetas[order])
        except Exception as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    for order in range(2):
        theta = thetas[order].clone().requires_grad_()
        want, want_weights = _by_hand(theta, aggregator.gramian_weighting)
        _, grad, weights = results[order]
        assert torch.allclose(grad, want.detach(), rtol=1e-8, atol=1e-10)
        assert torch.allclose(weights, want_weights.detach(), rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("variant", ["transformer", pytest.param("gpt2", marks=pytest.mark.slow)])
def test_per_example_bench_models_are_checked_once_over_new_batches(monkeypatch, variant):
    # the signature with the ops' arguments stays the same from batch to batch on the
    # bench's models (padding masks, targets and token ids change): one check, not four
    if variant == "gpt2":
        pytest.importorskip("transformers")
    from funcgrad.bench import _per_example as bench

    count = _count_checks(monkeypatch)
    criterion = nn.CrossEntropyLoss(reduction="none")
    torch.manual_seed(0)
    model, _ = bench._model(variant, 8, True)
    with funcgrad.per_example(model) as pe:
        for step in range(4):
            torch.manual_seed(step + 10)
            _, (x, y) = bench._model(variant, 8, True)
            if variant == "gpt2":
                losses = criterion(model(x).logits[:, :-1].transpose(1, 2), x[:, 1:]).sum(1)
            else:
                losses = criterion(model(x), y)
            pe.backward(losses, weighting=lambda g: g.diagonal().rsqrt())
    assert count[0] == 1


def test_per_example_after_a_refused_mixing_call_the_plain_loss_is_exact(monkeypatch):
    # a refusal leaves nothing marked as checked: the plain loss again, then the mixing one
    # again (refused again), then the plain one, exact against the loop throughout
    count = _count_checks(monkeypatch)
    plain, mixing = PAIRS["index_select"]
    model = _model()
    with funcgrad.per_example(model) as pe:
        for _ in range(2):
            gram = pe.gramian(plain(model(_x())).pow(2).sum(1))
            assert torch.allclose(gram, _gram_loop(model, plain), rtol=1e-10, atol=1e-12)
            with pytest.raises(ValueError, match="do not treat the examples independently"):
                pe.gramian(mixing(model(_x())).pow(2).sum(1))
        gram = pe.gramian(plain(model(_x())).pow(2).sum(1))
        assert torch.allclose(gram, _gram_loop(model, plain), rtol=1e-10, atol=1e-12)
    assert count[0] == 3  # the plain signature once, the mixing one on each of its calls


# -- review26: what the signature reads, and what it costs ------------------------------------


def test_per_example_float_arguments_in_a_schedule_check_once(monkeypatch):
    # clamp bounds, a leaky_relu slope, a pow exponent, a huber delta, a label smoothing
    # moving within one power of two cannot move a row: one check over the schedule (each
    # float was held exactly: every step was checked)
    count = _count_checks(monkeypatch)
    model = _model()
    gen = torch.Generator().manual_seed(3)
    f = nn.functional
    with funcgrad.per_example(model) as pe:
        for step in range(6):
            s = 1.0 + 0.1 * step  # in [1, 2): one power of two
            y = torch.randint(0, 4, (B,), generator=gen)
            out = model(_x())
            losses = (
                out.clamp(-2 * s, 2 * s).pow(2).sum(1)
                + f.leaky_relu(out, 0.125 * s).sum(1)
                + out.abs().pow(2 * s).sum(1)
                + f.huber_loss(out, torch.zeros_like(out), reduction="none", delta=s).sum(1)
                + f.cross_entropy(out, y, reduction="none", label_smoothing=0.0625 * s)
            )
            pe.gramian(losses)
    assert count[0] == 1


def test_per_example_a_float_schedule_crossing_zero_is_checked_again(monkeypatch):
    # the bucket keeps 0 apart: a term switched on by an alpha is checked (and refused)
    model = _model()
    with funcgrad.per_example(model) as pe:
        o = model(_x())
        pe.gramian(torch.sub(o, o.mean(0), alpha=0.0).pow(2).sum(1))
        o = model(_x())
        with pytest.raises(ValueError, match="do not treat the examples independently"):
            pe.gramian(torch.sub(o, o.mean(0), alpha=0.5).pow(2).sum(1))


def test_per_example_indices_along_a_dim_of_the_batch_s_size_are_not_held(monkeypatch):
    # o.log_softmax(1)[arange(B), y] with C == B: y indexes the classes, not the examples;
    # it was hashed as it indexes a dim of size B, so every new batch was checked
    count = _count_checks(monkeypatch)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, B)).double()
    gen = torch.Generator().manual_seed(4)
    with funcgrad.per_example(model) as pe:
        for _ in range(5):
            y = torch.randint(0, B, (B,), generator=gen)
            out = model(_x())
            picked = out.log_softmax(1)[torch.arange(B), y]
            taken = out.gather(1, y[:, None])[:, 0]
            pe.gramian(picked + taken)
    assert count[0] == 1


def test_per_example_gpt2_sequence_classification_padded_t_equal_b_checks_once(monkeypatch):
    # GPT-2's pooled logits[arange(B), last non-pad position] with T == B: the positions
    # index the sequence dim, which has the batch's size: checked on every new batch
    transformers = pytest.importorskip("transformers")
    from transformers.utils import logging

    logging.set_verbosity_error()
    count = _count_checks(monkeypatch)
    n = 4
    config = transformers.GPT2Config(
        vocab_size=50, n_positions=16, n_embd=8, n_layer=1, n_head=2, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, num_labels=3, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2ForSequenceClassification(config).double()
    params = [p for p in model.parameters() if p.requires_grad]
    with funcgrad.per_example(model) as pe:
        for step in range(4):
            gen = torch.Generator().manual_seed(step)
            ids = torch.randint(1, 50, (n, n), generator=gen)
            lengths = torch.randint(1, n + 1, (n,), generator=gen)
            mask = (torch.arange(n)[None] < lengths[:, None]).long()
            ids = ids * mask
            y = torch.randint(0, 3, (n,), generator=gen)

            def losses(ids=ids, mask=mask, y=y) -> torch.Tensor:
                logits = model(input_ids=ids, attention_mask=mask).logits
                return nn.functional.cross_entropy(logits, y, reduction="none")

            gram = pe.gramian(losses())
            if step == 3:
                held = losses()
                rows = []
                for b in range(n):
                    grads = torch.autograd.grad(
                        held[b], params, retain_graph=True, allow_unused=True
                    )
                    rows.append(
                        torch.cat(
                            [
                                (g if g is not None else torch.zeros_like(p)).flatten()
                                for g, p in zip(grads, params)
                            ]
                        )
                    )
                J = torch.stack(rows)
                assert torch.allclose(gram, J @ J.T, rtol=1e-8, atol=1e-10)
    assert count[0] == 1


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 5)
        self.b = nn.Linear(5, 4)
        self.register_buffer("scale", torch.tensor(0.5))
        self.register_buffer("mask", torch.ones(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # a 0-dim constant and a full constant operand of a mul, an activation times an
        # activation, a division by a number: each saved under the checkpoint's hooks
        h = torch.tanh(self.a(x))
        return self.b(self.scale * (h * self.mask) * h / 3.0)


class _Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = _Block()
        self.head = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return self.head(checkpoint(self.block, x, use_reentrant=False))


def test_per_example_checkpointed_segment_runs_once_per_call(monkeypatch):
    # reading a mul's saved operand ran the checkpoint's unpack hook, which recomputes the
    # segment: two forwards of the segment per call instead of one. Now a saved tensor is
    # read only where it is a constant operand and no hook would run to read it.
    torch.manual_seed(0)
    model = _Checkpointed().double()
    forwards = [0]
    model.block.a.register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    count = _count_checks(monkeypatch)
    params = list(model.parameters())
    with funcgrad.per_example(model) as pe:
        for step in range(4):
            x = torch.randn(
                B, 3, generator=torch.Generator().manual_seed(step), dtype=torch.float64
            )
            losses = model(x).pow(2).sum(1)
            forwards[0] = 0
            gram = pe.gramian(losses)
            assert forwards[0] == (2 if step == 0 else 1)  # the check's backward, the one
            held = model(x).pow(2).sum(1)
            J = torch.stack(
                [
                    torch.cat(
                        [
                            g.flatten()
                            for g in torch.autograd.grad(held[b], params, retain_graph=True)
                        ]
                    )
                    for b in range(B)
                ]
            )
            assert torch.allclose(gram, J @ J.T, rtol=1e-10, atol=1e-12)
    assert count[0] == 1


def test_per_example_signature_unpacks_no_hooked_saved_tensor(monkeypatch):
    # under save_on_cpu (or checkpointing) each read of a saved tensor runs its unpack hook
    # (a copy back, a forward again): the signature runs none (a Python number's wrapped
    # tensor is never hooked, and is still read); it read a mul's second operand
    from funcgrad._per_example import _independence

    unpacked = [0]
    during = []
    signature = _independence._graph_signature

    def counted(*args, **kwargs):
        before = unpacked[0]
        result = signature(*args, **kwargs)
        during.append(unpacked[0] - before)
        return result

    monkeypatch.setattr(_independence, "_graph_signature", counted)

    def unpack(t: torch.Tensor) -> torch.Tensor:
        unpacked[0] += 1
        return t

    model = _model()
    with funcgrad.per_example(model) as pe:
        for number in (0.0, 0.5):
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
                o = model(_x())
                kept = o.detach() * o * _t(0.5) * 2.0 / 3.0
                losses = (kept + number * o.mean(0)).sum(1)
            if number == 0.0:
                pe.gramian(losses)
            else:  # the number, wrapped and not hooked, is read: the term is checked
                with pytest.raises(ValueError, match="do not treat the examples independently"):
                    pe.gramian(losses)
    assert during == [0, 0]


def test_per_example_gpt2_gradient_checkpointing_one_forward_per_call(monkeypatch):
    # HF GPT-2 under gradient_checkpointing_enable(use_reentrant=False): each block's
    # forward ran twice per call (the signature's read of a mul's saved operand recomputed
    # the segment), once on main
    transformers = pytest.importorskip("transformers")
    from transformers.utils import logging

    logging.set_verbosity_error()
    count = _count_checks(monkeypatch)
    config = transformers.GPT2Config(
        vocab_size=50, n_positions=16, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).double()
    with warnings.catch_warnings():  # (transformers 5 renames it; the alias warns)
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    forwards = [0]
    block = model.transformer.h[0].mlp.c_fc
    block.register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    n, t = 4, 6
    with funcgrad.per_example(model) as pe:
        for step in range(4):
            ids = torch.randint(0, 50, (n, t), generator=torch.Generator().manual_seed(step))
            logits = model(input_ids=ids).logits
            losses = nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, 50), ids[:, 1:].reshape(-1), reduction="none"
            )
            forwards[0] = 0
            pe.gramian(losses.view(n, -1).sum(1))
            assert forwards[0] == (2 if step == 0 else 1)
    assert count[0] == 1


class _Ema:
    """A stateful weighting: inverse square roots of an EMA of G's diagonal."""

    def __init__(self, detach: bool) -> None:
        self.ema: torch.Tensor | None = None
        self.detach = detach

    def __call__(self, G: torch.Tensor) -> torch.Tensor:
        d = G.diagonal().detach() if self.detach else G.diagonal()
        self.ema = d if self.ema is None else 0.9 * self.ema + 0.1 * d
        w = self.ema.rsqrt()
        return w / w.sum()


@pytest.mark.parametrize("level", ["params", "features"])
def test_combine_heads_create_graph_state_kept_across_calls_gets_a_clear_error(level):
    # review26 R2: under create_graph the weighting gets G with its graph; an EMA of
    # G.diagonal() kept across calls chained step 2's weights to step 1's freed graph, and
    # the user's backward raised torch's "backward through the graph a second time", naming
    # neither the weighting nor the fix. Now the call raises, before anything is written,
    # with the fix; the detached EMA is exact against the same EMA by hand.
    theta = _theta()
    fn = funcgrad.combine_heads(_f, HEADS, _Ema(False), level=level, create_graph=True)
    _, grad, _ = fn(theta)
    torch.autograd.grad(grad.sum(), theta)
    with pytest.raises(RuntimeError, match="state kept across calls must be detached"):
        fn(theta * 1.1)
    # graphs still held (retain_graph=True): the chain is what was asked, no error
    fn = funcgrad.combine_heads(_f, HEADS, _Ema(False), level=level, create_graph=True)
    _, grad, _ = fn(theta)
    torch.autograd.grad(grad.sum(), theta, retain_graph=True)
    fn(theta * 1.1)
    # the detached state: exact, step after step
    fn = funcgrad.combine_heads(_f, HEADS, _Ema(True), level=level, create_graph=True)
    by_hand = _Ema(True)
    for step in range(3):
        point = (theta * (1 + 0.1 * step)).detach().requires_grad_()
        _, grad, _ = fn(point)
        want, _ = _by_hand(point, by_hand, level)
        assert torch.allclose(grad, want, rtol=1e-10, atol=1e-12)
        got = torch.autograd.grad(grad.pow(2).sum(), point)[0]
        ref = torch.autograd.grad(want.pow(2).sum(), point)[0]
        assert torch.allclose(got, ref, rtol=1e-8, atol=1e-10)
