"""Fixes from the sixth adversarial review of the per-example code: each against the
per-example autograd loop (`tests.helpers.per_example_jacobian`) in float64, or a clear
refusal with .grad untouched."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import funcgrad
from tests.helpers import per_example_jacobian

pytestmark = pytest.mark.usefixtures("float64_default")


def _clipped(jac, max_norm):
    """per_example_clip's update from the loop's (B, P) rows."""
    return (max_norm / (jac.norm(dim=1) + 1e-6)).clamp(max=1.0) @ jac


def _flat_grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


# -- S1: a NaN output gradient at padding positions ------------------------------------------


class _PaddedMean(nn.Module):
    """Token embeddings normalised per token: the zero padding rows give NaN there, masked
    out after, so the loss never reads them, but their output gradient is NaN."""

    def __init__(self, padding_idx: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4, padding_idx=padding_idx)
        self.lin = nn.Linear(4, 1)
        self.pad = self.emb.padding_idx

    def forward(self, index: torch.Tensor) -> torch.Tensor:
        h = self.emb(index)
        h = h / h.norm(dim=-1, keepdim=True)  # NaN at padding positions (0 / 0)
        h = torch.where((index != self.pad).unsqueeze(-1), h, 0.0)
        return self.lin(h).squeeze(-1).sum(1)


@pytest.mark.parametrize("padding_idx", [0, -1])
def test_a_nan_output_gradient_at_padding_positions_leaves_the_padding_row_zero(padding_idx):
    """The padding positions were masked by d * (index != padding_idx): NaN * 0 = NaN, and
    the update wrote it into the padding row; torch's backward gives 0 there."""
    torch.manual_seed(0)
    model = _PaddedMean(padding_idx)
    pad = model.pad
    index = torch.tensor([[3, 5, pad, pad], [7, pad, pad, pad], [2, 2, 8, 1]])
    jac = per_example_jacobian(model, lambda m: m(index))
    assert torch.isfinite(jac).all()
    with funcgrad.per_example(model) as pe:
        torch.testing.assert_close(pe.gramian(model(index)), jac @ jac.T)
        funcgrad.per_example_clip(model(index), 1.0)
        torch.testing.assert_close(_flat_grads(model), _clipped(jac, 1.0))
        model.zero_grad(set_to_none=True)
        pe.backward(model(index))
        torch.testing.assert_close(_flat_grads(model), jac.sum(0))


# -- S2 / S3: gradients scaled by counts over the whole batch --------------------------------


class _CustomLookup(nn.Module):
    """A module of its own (the generic rule) calling F.embedding / F.embedding_bag."""

    def __init__(self, bag: bool, **options) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(10, 4))
        self.bag, self.options = bag, options

    def forward(self, index: torch.Tensor) -> torch.Tensor:
        if self.bag:
            return nn.functional.embedding_bag(index, self.table, mode="sum", **self.options)
        return nn.functional.embedding(index, self.table, **self.options).sum(1)


def _counted_models():
    yield "EmbeddingBag", nn.EmbeddingBag(10, 4, mode="sum", scale_grad_by_freq=True)
    yield "EmbeddingBag", nn.EmbeddingBag(10, 4, mode="mean", sparse=True)
    yield "_CustomLookup", _CustomLookup(False, scale_grad_by_freq=True)
    yield "_CustomLookup", _CustomLookup(True, scale_grad_by_freq=True)
    yield "_CustomLookup", _CustomLookup(False, sparse=True)


@pytest.mark.parametrize("case", range(5))
@pytest.mark.parametrize("call", ["gramian", "norms", "clip"])
def test_lookups_scaled_by_counts_over_the_batch_are_refused(case, call):
    """nn.EmbeddingBag(scale_grad_by_freq=True) and a module's own F.embedding(...,
    scale_grad_by_freq=True) gave silently wrong G, norms and updates (the gradient scales
    each row by its count over the whole batch: the examples mix); sparse crashed."""
    torch.manual_seed(1)
    name, lookup = list(_counted_models())[case]
    model = nn.Sequential(lookup, nn.Tanh(), nn.Linear(4, 1))
    index = torch.tensor([[1, 2, 2], [2, 3, 4], [5, 1, 1]])
    with funcgrad.per_example(model) as pe:
        losses = model(index).squeeze(1)
        run = {
            "gramian": lambda: pe.gramian(losses),
            "norms": lambda: funcgrad.per_example_norms(losses),
            "clip": lambda: funcgrad.per_example_clip(losses, 1.0),
        }[call]
        with pytest.raises(ValueError, match=rf"\({name}\).*scale_grad_by_freq=True or sparse"):
            run()
    assert all(p.grad is None for p in model.parameters())


def test_lookups_without_counts_stay_exact():
    """The refusal is for the options alone: the same modules without them are exact."""
    torch.manual_seed(2)
    index = torch.tensor([[1, 2, 2], [2, 3, 4], [5, 1, 1]])
    for lookup in (nn.EmbeddingBag(10, 4, mode="sum"), _CustomLookup(False), _CustomLookup(True)):
        model = nn.Sequential(lookup, nn.Tanh(), nn.Linear(4, 1))
        jac = per_example_jacobian(model, lambda m: m(index).squeeze(1))
        with funcgrad.per_example(model) as pe:
            torch.testing.assert_close(pe.gramian(model(index).squeeze(1)), jac @ jac.T)


# -- G exactly symmetric ---------------------------------------------------------------------


@pytest.mark.parametrize("masked", [False, True])
def test_the_gramian_is_exactly_symmetric(masked):
    """The ghost products computed each block's diagonal square in full and wrote its
    transpose below: G was symmetric to rounding only (7e-15 here)."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 8))
    x = torch.randn(5, 6, 32)
    mask = (torch.rand(5, 6) > 0.4).double() if masked else torch.ones(5, 6)

    def losses(m):
        return (m(x).pow(2).sum(-1) * mask).sum(1)

    jac = per_example_jacobian(model, losses)
    with funcgrad.per_example(model) as pe:
        gram = pe.gramian(losses(model))
    assert torch.equal(gram, gram.T)
    torch.testing.assert_close(gram, jac @ jac.T)


# -- rows whose output gradient is zero: the same in G, the norms and the update --------------


@pytest.mark.parametrize("value", [1e160, float("inf")])
@pytest.mark.parametrize("shape", [(6, 32, 32), (40, 8, 8)])  # ghost, materialised diagonal
def test_a_never_read_row_adds_nothing_to_any_entry_point(value, shape):
    """A row that the losses never read (Δ_bt = 0) holding 1e160 (its square overflows) or
    inf: the Gramian skipped it, but the norms' ghost diagonal did not, so norms and clip
    refused ('not finite') where the Gramian was finite. Now it adds nothing everywhere;
    the reference is the loop on the input with that row zeroed (in exact arithmetic the
    same gradients; torch's dense product gives NaN for an inf there)."""
    torch.manual_seed(4)
    rows, width, out = shape
    model = nn.Linear(width, out)
    x = torch.randn(5, rows, width)
    mask = torch.ones(5, rows)
    mask[1, 2] = 0.0
    unread = x.clone()
    unread[1, 2] = value

    def losses(m, inputs):  # a where, so that Δ there is exactly 0 (inf * 0 is NaN)
        return torch.where(mask.bool().unsqueeze(-1), m(inputs), 0.0).pow(2).sum((1, 2))

    jac = per_example_jacobian(model, lambda m: losses(m, x * mask.unsqueeze(-1)))
    with funcgrad.per_example(model) as pe:
        torch.testing.assert_close(pe.gramian(losses(model, unread)), jac @ jac.T)
        norms = funcgrad.per_example_norms(losses(model, unread))
        torch.testing.assert_close(norms, jac.norm(dim=1))
        funcgrad.per_example_clip(losses(model, unread), 1.0)
    torch.testing.assert_close(_flat_grads(model), _clipped(jac, 1.0))
