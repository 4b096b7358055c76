"""Reliability (session 10, rel10): `token_attr`'s message for an embedding layer that runs
more than once in one forward.

A causal model that applies its (shared) embedding layer to the previous tokens as well was
refused as one that "changes the ids before the layer" (the second run's output is not the
ids' embeddings), and one whose second run has another shape as one whose layer "returned a
tensor of shape ...": neither names the cause. The layer's second run is now refused as such,
whichever run comes first."""

from __future__ import annotations

import pytest
import torch

from funcgrad import attribution

VOCAB = 11
TWICE = r"the embedding layer \(Embedding\) ran more than once in one forward of the model"


class _Twice(torch.nn.Module):
    """Causal (a cumulative sum), with its embedding layer run twice: on the ids and on
    ``other(ids)``, first or second."""

    def __init__(self, other: str, first: bool) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 6)
        self.mix = torch.nn.Linear(6, 6)
        self.out = torch.nn.Linear(6, VOCAB)
        self.other, self.first = other, first

    def _other(self, ids: torch.Tensor) -> torch.Tensor:
        if self.other == "previous":  # (causal: position t reads tokens t and t - 1)
            return torch.cat([torch.zeros_like(ids[:, :1]), ids[:, :-1]], 1)
        if self.other == "first token":  # another shape
            return ids[:, :1]
        return ids  # the same ids again

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.first:
            extra = self.embed(self._other(ids))
            e = self.embed(ids)
        else:
            e = self.embed(ids)
            extra = self.embed(self._other(ids))
        h = torch.tanh(self.mix(e + 0.5 * extra[:, : e.shape[1]]))  # (broadcast: one token)
        return self.out(h.cumsum(1) + h**2)


@pytest.mark.parametrize("mode", ["reverse", "forward"])
@pytest.mark.parametrize("first", [False, True])
@pytest.mark.parametrize("other", ["previous", "first token", "same"])
def test_an_embedding_run_twice_is_named_as_such(other, first, mode):
    model = _Twice(other, first)
    with pytest.raises(ValueError, match=TWICE + r".*shared embedding used twice"):
        attribution.token_attr(model, [1, 2, 3, 4], [5, 6], embedding=model.embed, mode=mode)


def test_a_model_that_changes_the_ids_once_keeps_its_message():
    """The message for a model that changes the ids before its one run of the layer."""

    class Remapped(_Twice):
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.mix(self.embed((ids + 1) % VOCAB)))
            return self.out(h.cumsum(1) + h**2)

    model = Remapped("same", False)
    with pytest.raises(ValueError, match=r"returned other values than on the token ids alone"):
        attribution.token_attr(model, [1, 2, 3, 4], [5, 6], embedding=model.embed)
