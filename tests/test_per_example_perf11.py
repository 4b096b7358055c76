"""Session 11's per-example changes, exact in float64 against a per-example autograd loop
and counted (never timed): the hooks that track the model's own call (the batch size B
that a shared (1, T) index of an ``nn.Embedding`` is expanded to) are installed only on a
model that has such an Embedding."""

from __future__ import annotations

import torch
from helpers import per_example_jacobian
from torch import nn

import funcgrad


def _model_hooks(model: nn.Module) -> tuple[int, int]:
    return len(model._forward_pre_hooks), len(model._forward_hooks)


def test_a_model_without_an_embedding_gets_one_hook_each_way():
    """An MLP's own call gets one forward pre-hook and one forward hook (the call in
    progress), not the two more that track its B for an Embedding's (1, T) index (on main:
    two each, run on every forward, their `tree_leaves` of the arguments included). The
    Gramian and the clipped update are the loop's, and removal leaves no hook."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
    x = torch.randn(6, 5, dtype=torch.float64)

    def losses_of(m: nn.Module) -> torch.Tensor:
        return m(x).pow(2).sum(1)

    rows = per_example_jacobian(model, losses_of)
    with funcgrad.per_example(model):
        assert _model_hooks(model) == (1, 1)
        gram = funcgrad.per_example_gramian(losses_of(model))
        norms = funcgrad.per_example_clip(losses_of(model), 0.5)
    assert _model_hooks(model) == (0, 0)
    torch.testing.assert_close(gram, rows @ rows.T, rtol=1e-12, atol=1e-12)
    factors = (0.5 / (norms + 1e-6)).clamp(max=1)
    update = factors @ rows
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    torch.testing.assert_close(grads, update, rtol=1e-12, atol=1e-12)


class _Positions(nn.Module):
    """Token plus position embeddings, the positions a (1, T) index shared by the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(11, 4)
        self.positions = nn.Embedding(5, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        where = torch.arange(ids.shape[1]).unsqueeze(0)  # (1, T)
        return self.head(self.tokens(ids) + self.positions(where)).squeeze(-1).sum(1)


def test_a_model_with_an_embedding_keeps_the_call_hooks_and_is_exact():
    """With an Embedding the two hooks that track B stay, and the (1, T) index is still
    expanded: the position table's per-example gradients are each example's own."""
    torch.manual_seed(1)
    model = _Positions().double()
    ids = torch.randint(11, (3, 5))

    def losses_of(m: nn.Module) -> torch.Tensor:
        out: torch.Tensor = m(ids)
        return out.pow(2)

    rows = per_example_jacobian(model, losses_of)
    with funcgrad.per_example(model):
        assert _model_hooks(model) == (2, 2)
        gram = funcgrad.per_example_gramian(losses_of(model))
    torch.testing.assert_close(gram, rows @ rows.T, rtol=1e-12, atol=1e-12)
