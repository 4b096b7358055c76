"""nn.EmbeddingBag's two input forms in per-example mode (session 6's review): the 2-D
(B, bag size) form is exact against a per-example loop; the 1-D form with `offsets` (the
bags cut from one flat list of indices) is refused by name, not torch's "offsets[0] has to
be 0" from a per-row call, nor a wrong answer where the flat list has B entries."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import funcgrad


def _loop_gramian(losses, params):
    rows = [torch.autograd.grad(losses[b], params, retain_graph=True) for b in range(len(losses))]
    jac = torch.stack([torch.cat([g.reshape(-1) for g in row]) for row in rows])
    return jac @ jac.T


def test_embedding_bag_2d_is_exact():
    torch.manual_seed(0)
    bag = nn.EmbeddingBag(6, 5, mode="sum").double()
    ids = torch.randint(0, 6, (4, 3))
    with funcgrad.per_example(bag) as pe:
        gram = pe.gramian(bag(ids).pow(2).sum(1))
    want = _loop_gramian(bag(ids).pow(2).sum(1), list(bag.parameters()))
    torch.testing.assert_close(gram, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "flat, offsets",
    [
        (torch.tensor([1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 0]), torch.tensor([0, 3, 5, 7, 10])),
        (torch.tensor([1, 2, 3, 4, 5]), torch.tensor([0, 0, 0, 0, 0])),  # N == B
    ],
)
def test_embedding_bag_with_offsets_is_refused_by_name(flat, offsets):
    torch.manual_seed(0)
    bag = nn.EmbeddingBag(6, 5, mode="sum").double()
    bag.weight.grad = torch.ones_like(bag.weight)
    with funcgrad.per_example(bag) as pe:
        losses = bag(flat, offsets).pow(2).sum(1)
        with pytest.raises(
            ValueError, match=r"'<model>' \(EmbeddingBag\) takes a 1-D input with offsets"
        ):
            pe.backward(losses, weighting=lambda g: torch.ones(5, dtype=torch.float64))
    assert torch.equal(bag.weight.grad, torch.ones_like(bag.weight))
