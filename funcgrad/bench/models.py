"""Small random-weight models of real training stacks, built from their libraries' configs
(nothing downloaded): the modules the real-stacks bench times and tests/realstacks_models.py
tests, at the sizes each asks for.

Each builder returns the module only (its weights drawn from torch's global generator, float32,
in training mode as constructed; the caller casts, calls ``eval()`` and makes the inputs). The
transformers builders import it themselves, so a missing library fails only its own models.
Dropout is 0 everywhere: in ``eval()`` it draws nothing anyway, and in training mode (the
checkpointing tests) the forward stays deterministic.
"""

from __future__ import annotations

from typing import Any, cast

from torch import nn


def _transformers() -> Any:
    import transformers

    return transformers


def _bert_encoder(
    attn: str, hidden: int, layers: int, heads: int, intermediate: int
) -> dict[str, Any]:
    """The encoder's fields of a BERT-style config (``BertConfig`` and ``ViTConfig`` name them
    alike; GPT-2's config names its own): its sizes, its attention, no dropout."""
    return {
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "intermediate_size": intermediate,
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
        "attn_implementation": attn,
    }


def bert(
    attn: str = "eager",
    *,
    hidden: int,
    layers: int,
    heads: int,
    intermediate: int,
    vocab: int,
    positions: int,
) -> nn.Module:
    """``transformers.BertModel``; ``attn``: ``"eager"`` or ``"sdpa"``."""
    tf = _transformers()
    config = tf.BertConfig(
        vocab_size=vocab,
        max_position_embeddings=positions,
        **_bert_encoder(attn, hidden, layers, heads, intermediate),
    )
    return cast(nn.Module, tf.BertModel(config))


def gpt2(
    attn: str = "eager",
    *,
    hidden: int,
    layers: int,
    heads: int,
    vocab: int,
    positions: int,
) -> nn.Module:
    """``transformers.GPT2Model`` (its config ties an LM head's weight to the token
    embedding)."""
    tf = _transformers()
    config = tf.GPT2Config(
        vocab_size=vocab,
        n_embd=hidden,
        n_layer=layers,
        n_head=heads,
        n_positions=positions,
        bos_token_id=None,
        eos_token_id=None,
        tie_word_embeddings=True,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        attn_implementation=attn,
    )
    return cast(nn.Module, tf.GPT2Model(config))


def vit(
    attn: str = "eager",
    *,
    image: int,
    patch: int,
    hidden: int,
    layers: int,
    heads: int,
    intermediate: int,
) -> nn.Module:
    """``transformers.ViTModel`` on 3-channel square images."""
    tf = _transformers()
    config = tf.ViTConfig(
        image_size=image,
        patch_size=patch,
        num_channels=3,
        **_bert_encoder(attn, hidden, layers, heads, intermediate),
    )
    return cast(nn.Module, tf.ViTModel(config))


def resnet(*, embedding: int, widths: list[int], depths: list[int]) -> nn.Module:
    """``transformers.ResNetModel`` with basic blocks (conv-BatchNorm-ReLU), one stage per
    entry of ``widths``; its ``pooler_output`` is (B, widths[-1], 1, 1)."""
    tf = _transformers()
    config = tf.ResNetConfig(
        num_channels=3,
        embedding_size=embedding,
        hidden_sizes=widths,
        depths=depths,
        layer_type="basic",
    )
    return cast(nn.Module, tf.ResNetModel(config))


def rnn(kind: str, *, features: int, hidden: int, layers: int = 1) -> nn.Module:
    """``nn.LSTM`` or ``nn.GRU`` (``kind``: ``"lstm"``, ``"gru"``), batch first."""
    make = {"lstm": nn.LSTM, "gru": nn.GRU}[kind]
    return cast(nn.Module, make(features, hidden, num_layers=layers, batch_first=True))
