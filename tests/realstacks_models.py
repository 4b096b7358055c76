"""Tiny real-stack models for tests/test_real_stacks.py: random weights, nothing downloaded.

Each builder returns a :class:`Case`: the shared model, its inputs, how the pooled features
(the ``through`` tensor the task heads read) come out of the model's output, the dtype, and
the tolerance the comparison with plain autograd uses. A builder imports its library itself,
so a missing library skips only its own cases.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from funcgrad.bench import models


def import_or_skip(name: str) -> Any:
    """pytest.importorskip, but any failure to import skips (not only ImportError): the
    PyPI torchvision 0.28.0 wheel is a CUDA build, and importing it beside the CPU torch
    raises RuntimeError ("operator torchvision::nms does not exist"), which in turn breaks
    ``import timm`` (timm imports torchvision at module level)."""
    try:
        return importlib.import_module(name)
    except Exception as error:
        pytest.skip(f"{name} does not import here: {type(error).__name__}: {error}")


@dataclasses.dataclass
class Case:
    model: nn.Module
    inputs: tuple[Any, ...]
    pool: Callable[[Any], torch.Tensor]  # model output -> pooled features (B, d)
    dtype: torch.dtype = torch.float64
    rtol: float = 1e-7
    atol: float = 1e-9
    # a context every forward runs in (autocast); the reference runs in it too
    context: Callable[[], Any] = contextlib.nullcontext
    # the model draws random numbers in its forward (dropout in training mode)
    random: bool = False

    def features(self, model: nn.Module | None = None) -> torch.Tensor:
        """The pooled features of one eager forward (the graph built by plain autograd)."""
        with self.context():
            model = self.model if model is None else model
            return self.pool(model(*self.inputs)).to(self.dtype)

    def functional(self, params: dict[str, torch.Tensor], *inputs: Any) -> torch.Tensor:
        """f(params, *inputs): the pooled features through ``functional_call``."""
        with self.context():
            out = torch.func.functional_call(self.model, params, inputs or self.inputs)
            return self.pool(out).to(self.dtype)

    @property
    def width(self) -> int:
        with torch.no_grad():
            return self.features().shape[-1]


# -- transformers (the modules: funcgrad/bench/models.py, which the bench times) ------------

_TINY = dict(hidden=16, layers=1, heads=2)


def _ids(batch: int = 2, seq: int = 5, vocab: int = 50) -> torch.Tensor:
    return torch.randint(vocab, (batch, seq), generator=torch.Generator().manual_seed(1))


def _eval64(model: nn.Module) -> nn.Module:
    return model.to(torch.float64).eval()


def _bert(attn: str = "eager") -> nn.Module:
    import_or_skip("transformers")
    return models.bert(attn, **_TINY, intermediate=32, vocab=50, positions=16)


def bert(attn: str = "eager") -> Case:
    return Case(_eval64(_bert(attn)), (_ids(),), lambda out: out.pooler_output)


def gpt2(attn: str = "eager") -> Case:
    import_or_skip("transformers")
    model = _eval64(models.gpt2(attn, **_TINY, vocab=50, positions=16))
    return Case(model, (_ids(),), lambda out: out.last_hidden_state.mean(1))


def gpt2_lm_tied() -> Case:
    """GPT2LMHeadModel with lm_head.weight tied to transformer.wte.weight: the features are
    the last position's logits, so the tied weight is reached along both paths."""
    transformers = import_or_skip("transformers")
    config = models.gpt2("eager", **_TINY, vocab=50, positions=16).config
    model = _eval64(transformers.GPT2LMHeadModel(config))
    assert model.lm_head.weight is model.transformer.wte.weight
    return Case(model, (_ids(),), lambda out: out.logits[:, -1])


def vit(attn: str = "eager") -> Case:
    import_or_skip("transformers")
    model = _eval64(models.vit(attn, image=8, patch=4, **_TINY, intermediate=32))
    pixels = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    return Case(model, (pixels,), lambda out: out.pooler_output)


def resnet() -> Case:
    """transformers' ResNetModel (basic blocks, BatchNorm in eval), the one the bench times."""
    import_or_skip("transformers")
    model = _eval64(models.resnet(embedding=4, widths=[4, 8], depths=[1, 1]))
    pixels = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    return Case(model, (pixels,), lambda out: out.pooler_output.flatten(1))


def bert_checkpointed(use_reentrant: bool) -> Case:
    """BERT in training mode (dropout 0, so deterministic) with transformers' gradient
    checkpointing: a forward hook that calls requires_grad_() on the embeddings' output, and
    torch.utils.checkpoint (reentrant: an autograd.Function; non-reentrant: saved-tensor
    hooks)."""
    model = _bert().to(torch.float64)
    with warnings.catch_warnings():  # deprecated alias of activation_checkpointing_enable (5.x)
        warnings.filterwarnings(
            "ignore", "`gradient_checkpointing_enable` is deprecated", FutureWarning
        )
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": use_reentrant}
        )
    model.train()
    return Case(model, (_ids(),), lambda out: out.pooler_output)


# -- timm -------------------------------------------------------------------------------------


def timm_resnet(train: bool) -> Case:
    timm = import_or_skip("timm")
    model = timm.create_model("resnet10t", pretrained=False, num_classes=0).to(torch.float64)
    model.train(train)
    return Case(model, (torch.randn(2, 3, 16, 16, dtype=torch.float64),), lambda out: out)


def timm_vit() -> Case:
    timm = import_or_skip("timm")
    model = (
        timm.models.vision_transformer.VisionTransformer(
            img_size=8, patch_size=4, embed_dim=16, depth=1, num_heads=2, num_classes=0
        )
        .to(torch.float64)
        .eval()
    )
    return Case(model, (torch.randn(2, 3, 8, 8, dtype=torch.float64),), lambda out: out)


# -- torchvision ------------------------------------------------------------------------------


def torchvision_resnet18() -> Case:
    tv = import_or_skip("torchvision")
    model = tv.models.resnet18(num_classes=8).to(torch.float64).eval()
    return Case(model, (torch.randn(2, 3, 16, 16, dtype=torch.float64),), lambda out: out)


# -- torch.nn ---------------------------------------------------------------------------------


class TinyResNet(nn.Module):
    """conv-BN-ReLU stem and one basic residual block with BatchNorm: the BatchNorm cases
    that timm's resnet10t would cover, in plain torch.nn."""

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
        )
        self.conv1 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        y = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        return F.relu(x + y).mean((2, 3))


def nn_resnet(train: bool) -> Case:
    torch.manual_seed(5)
    model = TinyResNet().to(torch.float64).train(train)
    return Case(model, (torch.randn(4, 3, 6, 6, dtype=torch.float64),), lambda out: out)


def lstm() -> Case:
    torch.manual_seed(5)
    model = models.rnn("lstm", features=5, hidden=8).to(torch.float64)
    return Case(model, (torch.randn(3, 4, 5, dtype=torch.float64),), lambda out: out[0][:, -1])


def gru() -> Case:
    torch.manual_seed(5)
    model = models.rnn("gru", features=5, hidden=8).to(torch.float64)
    return Case(model, (torch.randn(3, 4, 5, dtype=torch.float64),), lambda out: out[0][:, -1])


def _encoder(dropout: float, dtype: torch.dtype = torch.float64) -> nn.Module:
    torch.manual_seed(5)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=dropout, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).to(dtype)


def transformer_encoder_eval() -> Case:
    """eval mode: nn.TransformerEncoderLayer takes its fused fast path
    (torch._transformer_encoder_layer_fwd) whenever it thinks no gradient is needed."""
    model = _encoder(0.1).eval()
    return Case(model, (torch.randn(2, 5, 16, dtype=torch.float64),), lambda out: out.mean(1))


def transformer_encoder_train() -> Case:
    """training mode with dropout 0.1: random draws in the forward."""
    model = _encoder(0.1).train()
    return Case(
        model, (torch.randn(2, 5, 16, dtype=torch.float64),), lambda out: out.mean(1), random=True
    )


def compiled_encoder(backend: str = "aot_eager") -> Case:
    """torch.compile of a TransformerEncoder (eval, dropout 0), float32."""
    torch._dynamo.reset()  # a fresh compile: no cache entry left by another test's call
    model = torch.compile(_encoder(0.0, torch.float32).eval(), backend=backend)
    return Case(
        model,
        (torch.randn(2, 5, 16, dtype=torch.float32),),
        lambda out: out.mean(1),
        dtype=torch.float32,
        rtol=1e-4,
        atol=1e-5,
    )


def compiled_mlp(backend: str = "aot_eager") -> Case:
    """torch.compile of a small MLP with LayerNorm, float32: its backward is compiled too, and
    a compiled backward cannot run under vmap."""
    torch._dynamo.reset()  # a fresh compile: no cache entry left by another test's call
    torch.manual_seed(5)
    mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 8))
    model = torch.compile(mlp.to(torch.float32), backend=backend)
    return Case(
        model,
        (torch.randn(4, 8, dtype=torch.float32),),
        lambda out: out,
        dtype=torch.float32,
        rtol=1e-4,
        atol=1e-5,
    )


def vit_input_requires_grad() -> Case:
    """ViT whose input requires grad (as wav2vec2's feature encoder does in training): a leaf
    that is not a parameter reaches the features."""
    case = vit()
    case.inputs = (case.inputs[0].requires_grad_(),)
    return case


def autocast_encoder() -> Case:
    """float32 TransformerEncoder (dropout 0) run under CPU autocast to bfloat16; the
    features are cast back to float32 for the heads."""
    model = _encoder(0.0, torch.float32).eval()
    return Case(
        model,
        (torch.randn(2, 5, 16, dtype=torch.float32),),
        lambda out: out.mean(1),
        dtype=torch.float32,
        rtol=2e-2,
        atol=2e-2,
        context=lambda: torch.autocast("cpu", dtype=torch.bfloat16),
    )


# -- the k task heads on the pooled features -----------------------------------------------------


class Tasks(nn.Module):
    """k = 3 task-specific heads on features (B, d): regression (MSE), classification (CE)
    and a softplus score; each is a module with its own parameters."""

    def __init__(self, width: int, batch: int, dtype: torch.dtype) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.reg = nn.Linear(width, 1).to(dtype)
        self.cls = nn.Linear(width, 3).to(dtype)
        self.score = nn.Linear(width, 2).to(dtype)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=dtype) * 0.5)
        self.register_buffer("y_reg", torch.randn(batch, 1, generator=g, dtype=dtype))
        self.register_buffer("y_cls", torch.randint(3, (batch,), generator=g))

    def losses(self, features: torch.Tensor) -> list[torch.Tensor]:
        return [
            F.mse_loss(self.reg(features), self.y_reg),
            F.cross_entropy(self.cls(features), self.y_cls),
            F.softplus(self.score(features)).mean() * 2,
        ]

    def heads(self) -> list[Callable[[torch.Tensor], torch.Tensor]]:
        return [lambda y, i=i: self.losses(y)[i] for i in range(3)]


CASES: dict[str, Callable[[], Case]] = {
    "bert": bert,
    "bert-sdpa": lambda: bert("sdpa"),
    "gpt2": gpt2,
    "gpt2-lm-tied": gpt2_lm_tied,
    "vit": vit,
    "resnet": resnet,
    "bert-ckpt-reentrant": lambda: bert_checkpointed(True),
    "bert-ckpt-nonreentrant": lambda: bert_checkpointed(False),
    "timm-resnet-train": lambda: timm_resnet(True),
    "timm-resnet-eval": lambda: timm_resnet(False),
    "timm-vit": timm_vit,
    "torchvision-resnet18": torchvision_resnet18,
    "nn-resnet-train": lambda: nn_resnet(True),
    "nn-resnet-eval": lambda: nn_resnet(False),
    "lstm": lstm,
    "gru": gru,
    "encoder-eval": transformer_encoder_eval,
    "encoder-train-dropout": transformer_encoder_train,
    "compiled-aot-eager": compiled_encoder,
    "compiled-inductor": lambda: compiled_encoder("inductor"),
    "compiled-mlp-aot-eager": compiled_mlp,
    "compiled-mlp-inductor": lambda: compiled_mlp("inductor"),
    "vit-input-requires-grad": vit_input_requires_grad,
    "autocast-bf16": autocast_encoder,
}
