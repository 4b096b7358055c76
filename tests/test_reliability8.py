"""Reliability hunt (session 8): silently wrong answers found on main, each against its
independent reference in float64 (a per-example loop of torch.autograd.grad, per-head
autograd with create_graph)."""

from __future__ import annotations

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
}


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
