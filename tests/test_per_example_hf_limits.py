"""The Hugging Face models that the per-example rules refuse, and why (docs/per_example.md,
"Models refused"): OPT flattens its tokens to (B·T, d) before its feed-forward layers;
DeBERTa-v2 with relative attention (its released configurations) reads its relative
position table outside that Embedding's forward. Tiny random configs, nothing downloaded;
the refusals come before anything is written, and DeBERTa-v2 without relative attention is
exact against a per-example loop in float64."""

from __future__ import annotations

import pytest
import torch
from helpers import per_example_jacobian
from realstacks_models import import_or_skip
from torch import nn

import funcgrad

B, T = 4, 6


def _ids() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randint(5, 60, (B, T))


def test_opt_is_refused_naming_its_flattened_tokens():
    """OPT's decoder layer runs ``hidden.reshape(-1, d)`` before ``final_layer_norm``, fc1
    and fc2: their rows are (B·T, d). The refusal names the layer, the shape, that dim 0 is
    B·T (the tokens flattened into the batch: new in session 10; main gave only the
    generic batched-along-dim-0 message), and what to do; no .grad is written."""
    transformers = import_or_skip("transformers")
    config = transformers.OPTConfig(
        vocab_size=60,
        hidden_size=16,
        num_hidden_layers=1,
        ffn_dim=32,
        num_attention_heads=2,
        max_position_embeddings=32,
        word_embed_proj_dim=16,
    )
    model = transformers.OPTForCausalLM(config).double().eval()
    ids = _ids()
    with funcgrad.per_example(model):
        losses = model(input_ids=ids).logits.pow(2).sum((1, 2))
        with pytest.raises(ValueError) as error:
            funcgrad.per_example_clip(losses, 1.0)
    message = str(error.value)
    assert "final_layer_norm" in message, message
    assert f"({B * T}, 16)" in message, message
    assert f"Its dim 0 is {B * T} = B·{T}" in message, message
    assert "OPT" in message and "inputs=" in message, message
    assert all(p.grad is None for p in model.parameters())


def _deberta(relative: bool) -> nn.Module:
    transformers = import_or_skip("transformers")
    extra = (
        dict(relative_attention=True, pos_att_type=["p2c", "c2p"], position_buckets=8)
        if relative
        else {}
    )
    config = transformers.DebertaV2Config(
        vocab_size=60,
        hidden_size=16,
        num_hidden_layers=1,
        intermediate_size=32,
        num_attention_heads=2,
        max_position_embeddings=32,
        num_labels=3,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        **extra,
    )
    torch.manual_seed(1)
    return transformers.DebertaV2ForSequenceClassification(config).double().eval()


def test_deberta_v2_with_relative_attention_is_refused_naming_its_shared_rows():
    """DeBERTa-v2's disentangled attention projects its relative position table, (1, 2k, d)
    rows shared by the batch, with ``pos_key_proj`` / ``pos_query_proj`` (with
    ``share_att_key=False``; with True, with the key and query projections themselves),
    and reads ``rel_embeddings.weight`` directly (not a call of that Embedding): refused,
    naming the module and ``inputs=``, nothing written; leaving those parameters out with
    ``inputs=`` is exact for the others."""
    model = _deberta(relative=True)
    ids = _ids()
    labels = torch.tensor([0, 1, 2, 1])

    def losses_of(m: nn.Module) -> torch.Tensor:
        return nn.functional.cross_entropy(m(input_ids=ids).logits, labels, reduction="none")

    shared = [
        p
        for name, p in model.named_parameters()
        if "rel_embeddings" in name or ".pos_key_proj." in name or ".pos_query_proj." in name
    ]
    assert shared
    others = [p for p in model.parameters() if all(p is not q for q in shared)]
    with funcgrad.per_example(model):
        named = r"(rel_embeddings\.weight|pos_key_proj|pos_query_proj).*inputs="
        with pytest.raises(ValueError, match=named):
            funcgrad.per_example_clip(losses_of(model), 1.0)
        with pytest.raises(ValueError, match=named):
            funcgrad.per_example_norms(losses_of(model))
        norms = funcgrad.per_example_norms(losses_of(model), inputs=others)
    assert all(p.grad is None for p in model.parameters())
    rows = per_example_jacobian(model, losses_of, others)
    torch.testing.assert_close(norms, rows.norm(dim=1), rtol=1e-10, atol=1e-12)


def test_deberta_v2_without_relative_attention_is_exact():
    """DeBERTa-v2's default config (absolute positions, no relative attention) runs as it
    is: its Gramian equals the loop's in float64."""
    model = _deberta(relative=False)
    ids = _ids()
    labels = torch.tensor([2, 0, 1, 1])

    def losses_of(m: nn.Module) -> torch.Tensor:
        return nn.functional.cross_entropy(m(input_ids=ids).logits, labels, reduction="none")

    rows = per_example_jacobian(model, losses_of)
    with funcgrad.per_example(model):
        gram = funcgrad.per_example_gramian(losses_of(model))
    torch.testing.assert_close(gram, rows @ rows.T, rtol=1e-10, atol=1e-12)
