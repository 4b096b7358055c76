"""Per-example heads on unmodified Hugging Face models (tiny random configs, nothing
downloaded) and on Hugging Face's ``Conv1D``, against a per-example loop of
torch.autograd.grad in float64: GPT-2 (its ``Conv1D`` projections, the (1, T) position ids
shared by the batch, the LM head tied to the token embedding, a padding mask), BERT with a
padding mask, ViT."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import per_example_jacobian
from realstacks_models import import_or_skip
from torch import nn

import funcgrad
from funcgrad.bench import models

B, T = 4, 6
TINY = dict(hidden=16, layers=1, heads=2)


loop_jacobian = per_example_jacobian


def flat_grads(model):
    return torch.cat(
        [
            (torch.zeros_like(p) if p.grad is None else p.grad).flatten()
            for p in model.parameters()
            if p.requires_grad
        ]
    )


def ids_and_mask():
    ids = torch.randint(50, (B, T))
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, 4:] = 0  # padded sequences
    mask[2, 5:] = 0
    return ids, mask


def gpt2_lm():
    """GPT2LMHeadModel (lm_head tied to wte), next-token losses on padded sequences."""
    transformers = import_or_skip("transformers")
    config = models.gpt2("eager", **TINY, vocab=50, positions=16).config
    model = transformers.GPT2LMHeadModel(config)
    assert model.lm_head.weight is model.transformer.wte.weight
    ids, mask = ids_and_mask()

    def losses(m):
        logits = m(ids, attention_mask=mask).logits[:, :-1]
        each = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        return (each * mask[:, 1:]).sum(1)

    return model, losses


def gpt2():
    import_or_skip("transformers")
    model = models.gpt2("eager", **TINY, vocab=50, positions=16)
    ids, _ = ids_and_mask()
    return model, lambda m: m(ids).last_hidden_state.pow(2).mean((1, 2))


def bert():
    import_or_skip("transformers")
    model = models.bert("eager", **TINY, intermediate=32, vocab=50, positions=16)
    ids, mask = ids_and_mask()
    return model, lambda m: m(ids, attention_mask=mask).pooler_output.pow(2).sum(1)


def vit():
    import_or_skip("transformers")
    model = models.vit("eager", image=8, patch=4, **TINY, intermediate=32)
    pixels = torch.randn(B, 3, 8, 8)
    return model, lambda m: m(pixels).pooler_output.pow(2).sum(1)


MODELS = {"gpt2_lm": gpt2_lm, "gpt2": gpt2, "bert": bert, "vit": vit}


@pytest.mark.parametrize("name", list(MODELS))
def test_hugging_face_models_run_unmodified_and_exact(name):
    model, losses_fn = MODELS[name]()
    model = model.double().eval()
    jac = loop_jacobian(model, losses_fn)
    with funcgrad.per_example(model) as pe:
        gram = funcgrad.per_example_gramian(losses_fn(model))
    torch.testing.assert_close(gram, jac @ jac.T, rtol=1e-10, atol=1e-12)
    weighting = lambda g: 1 / (g.diagonal().sqrt() + 1e-3)  # noqa: E731
    with funcgrad.per_example(model) as pe:
        weights = pe.backward(losses_fn(model), weighting=weighting)
    torch.testing.assert_close(weights, weighting(jac @ jac.T), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(flat_grads(model), weights @ jac, rtol=1e-10, atol=1e-12)
    rules = str(pe.plan)
    assert "vmap" not in rules or name == "vit", rules  # ViTEmbeddings: its own parameters


def test_gpt2_shared_position_ids_are_expanded_not_refused():
    """wpe is called on (1, T) ids: its output (1, T, d) is broadcast over the batch, which
    sums its output gradient over the examples. The recorded call is on (B, T) ids."""
    model, losses_fn = gpt2()
    model = model.double().eval()
    with funcgrad.per_example(model) as pe:
        losses = losses_fn(model)
        calls = [use for use in pe._uses if use.module is model.wpe]
        assert [tuple(use.args[0].shape) for use in calls] == [(B, T)]
        pe.gramian(losses)
    assert "wpe  Embedding  (4, 6)  pairs of rows with one index" in str(pe.plan)


class WithConv1D(nn.Module):
    def __init__(self):
        super().__init__()
        from transformers.pytorch_utils import Conv1D

        self.proj = Conv1D(5, 3)  # nf=5 outputs, nx=3 inputs: weight (3, 5)
        self.out = Conv1D(1, 5)

    def forward(self, x):
        return self.out(torch.tanh(self.proj(x)))


@pytest.mark.parametrize("shape", [(B, 3), (B, 7, 3)], ids=["flat", "sequence"])
def test_hf_conv1d_is_a_linear_with_a_transposed_weight(shape):
    import_or_skip("transformers")
    model = WithConv1D()
    with torch.no_grad():
        model.proj.bias.normal_()
    x = torch.randn(*shape)
    losses_fn = lambda m: m(x).pow(2).reshape(B, -1).sum(1)  # noqa: E731
    jac = loop_jacobian(model, losses_fn)
    with funcgrad.per_example(model) as pe:
        weights = pe.backward(losses_fn(model), weighting=lambda g: 1 / g.diagonal().sqrt())
    torch.testing.assert_close(flat_grads(model), weights @ jac, rtol=1e-10, atol=1e-12)
    rules = str(pe.plan)
    assert "Conv1D" in rules and "vmap" not in rules and "loop" not in rules, rules


@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_a_mask_shared_by_the_batch_fails_as_without_funcgrad_and_its_expansion_is_exact(name):
    """A (1, T) attention_mask: transformers itself refuses it at B > 1 (BERT: an IndexError
    in its masking utilities; GPT-2: a view error), with or without the hooks, so funcgrad
    changes nothing there; ``mask.expand(B, -1)``, the same mask for every example, is exact."""
    import_or_skip("transformers")
    make = {
        "bert": lambda: models.bert("eager", **TINY, intermediate=32, vocab=50, positions=16),
        "gpt2": lambda: models.gpt2("eager", **TINY, vocab=50, positions=16),
    }[name]
    model = make().double().eval()
    ids = torch.randint(50, (B, T))
    shared = torch.ones(1, T, dtype=torch.long)
    shared[0, 4:] = 0

    def losses_fn(m, mask):
        return m(ids, attention_mask=mask).last_hidden_state.pow(2).sum((1, 2))

    with pytest.raises((IndexError, RuntimeError)) as plain:
        losses_fn(model, shared)
    with funcgrad.per_example(model) as pe:
        with pytest.raises(type(plain.value), match=str(plain.value)[:30].replace("[", r"\[")):
            losses_fn(model, shared)
        expanded = shared.expand(B, -1)
        gram = pe.gramian(losses_fn(model, expanded))
    jac = loop_jacobian(model, lambda m: losses_fn(m, expanded))
    torch.testing.assert_close(gram, jac @ jac.T, rtol=1e-10, atol=1e-12)
