"""The real-stacks case: per-task gradients of a real model's parameters, one cell per model.

Models (``models.py``, random weights, float32, ``eval()``, no dropout): ``nn.LSTM``,
``nn.GRU``, transformers' BERT with eager and with sdpa attention, a ResNet (basic blocks,
BatchNorm in eval; ``resnet-train``: in training mode, BatchNorm on the batch's statistics,
its running statistics updated by every forward), a ViT and GPT-2 (both with transformers'
default attention, sdpa). k task
heads on the pooled output (``nn.Linear`` to 1 output with MSE, to 5 classes with
cross-entropy, alternating), and the job is the k per-task gradients of the model's
parameters, three ways:

- ``naive``: the loop a user writes, one eager forward of the module and
  ``torch.autograd.grad(loss_i, params, retain_graph=True)`` per task (the reference and the
  baseline);
- ``funcgrad auto``: ``funcgrad.compose_heads(f, heads)`` on
  ``f(p) = pool(torch.func.functional_call(model, p, inputs))``;
- ``torch.func vjp+vmap``: what an expert writes with torch.func alone, ``vjp`` of the same
  ``f``, each head's cotangent by ``torch.func.grad``, then ``vmap`` of the pullback over the
  stacked cotangents (torch's warning that vmap loops per example, where an op has no
  batching rule, is silenced for this method only: it is the method's known cost). In
  training mode it runs on a copy of the module made by
  ``torch.func.replace_all_batch_norm_modules_`` (torch.func refuses the in-place update of
  the running statistics; the copy keeps none, and its gradients are the same).
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

import funcgrad

from . import models
from ._cases import Case, SkipCase, built, linear_task_heads, on, vjp

MODELS = (
    "lstm", "gru", "bert-eager", "bert-sdpa", "resnet", "resnet-train", "vit-sdpa", "gpt2-sdpa"
)  # fmt: skip
HEAD_COUNTS = (3, 8)
CELLS = {mode: [(model, k) for model in MODELS for k in HEAD_COUNTS] for mode in ("full", "quick")}
# Issue 43's target: every model at most 1.1x the faster of the per-task autograd loop and
# raw torch.func (a tuple of baselines: the fastest of them).
FASTER_OF = ("naive", "torch.func vjp+vmap")
TARGET = 1.1
TARGETS = [
    (f"real-stacks {model} k={k}", "funcgrad auto", FASTER_OF, TARGET) for model, k in CELLS["full"]
]
MISSING_TRANSFORMERS = (
    'transformers is not installed (pip install "torch==2.13.0" -e ".[test]" provides it)'
)
_VMAP_FALLBACK = "There is a performance drop because we have not yet implemented the batching"

# Sizes: full (forwards of a few ms on 2 threads) and quick (a smoke run in seconds).
SIZES: dict[str, dict[str, int]] = {
    "full": {"batch": 16, "seq": 32, "hidden": 128, "layers": 2, "heads": 4, "image": 32},
    "quick": {"batch": 4, "seq": 8, "hidden": 32, "layers": 1, "heads": 2, "image": 16},
}


@dataclasses.dataclass
class Stack:
    module: torch.nn.Module
    inputs: tuple[Any, ...]
    kwargs: dict[str, Any]
    pool: Callable[[Any], torch.Tensor]  # the model's output -> pooled features (B, d)


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(1)


def _tokens(size: dict[str, int], vocab: int) -> torch.Tensor:
    return on(torch.randint(vocab, (size["batch"], size["seq"]), generator=_generator()))


def _padding_mask(size: dict[str, int]) -> torch.Tensor:
    """Padded sequences of different lengths."""
    batch, seq = size["batch"], size["seq"]
    mask = torch.ones(batch, seq, dtype=torch.long)
    for i in range(batch):
        mask[i, seq - i % (seq // 2) :] = 0
    return on(mask)


def _images(size: dict[str, int]) -> torch.Tensor:
    shape = (size["batch"], 3, size["image"], size["image"])
    return on(torch.randn(shape, generator=_generator()))


def stack(variant: str, quick: bool) -> Stack:
    """The model of one cell, on the bench's device, in eval mode (``-train``: training
    mode), with its inputs."""
    size = SIZES["quick" if quick else "full"]
    hidden, layers, heads = size["hidden"], size["layers"], size["heads"]
    kind, _, attn = variant.partition("-")
    if kind in ("lstm", "gru"):
        features = hidden // 4
        module = built(lambda: models.rnn(kind, features=features, hidden=hidden, layers=layers))
        shape = (size["batch"], size["seq"], features)
        inputs: tuple[Any, ...] = (on(torch.randn(shape, generator=_generator())),)
        return Stack(module.eval(), inputs, {}, lambda out: out[0][:, -1])
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise SkipCase(MISSING_TRANSFORMERS) from None
    vocab = 1000 if not quick else 100
    transformer = {"hidden": hidden, "layers": layers, "heads": heads}
    positions = 2 * size["seq"]
    if kind == "bert":
        module = built(
            lambda: models.bert(
                attn, **transformer, intermediate=4 * hidden, vocab=vocab, positions=positions
            )
        )
        kwargs = {"attention_mask": _padding_mask(size)}
        return Stack(module.eval(), (_tokens(size, vocab),), kwargs, lambda out: out.pooler_output)
    if kind == "gpt2":
        module = built(
            lambda: models.gpt2(
                attn, hidden=hidden, layers=layers, heads=heads, vocab=vocab, positions=positions
            )
        )
        return Stack(
            module.eval(),
            (_tokens(size, vocab),),
            {},
            lambda out: out.last_hidden_state.mean(1),
        )
    if kind == "vit":
        module = built(
            lambda: models.vit(
                attn, image=size["image"], patch=8, **transformer, intermediate=4 * hidden
            )
        )
        return Stack(module.eval(), (_images(size),), {}, lambda out: out.pooler_output)
    if kind == "resnet":
        widths = [hidden // 4, hidden // 2, hidden] if not quick else [hidden // 4, hidden // 2]
        module = built(
            lambda: models.resnet(embedding=hidden // 4, widths=widths, depths=[1] * len(widths))
        )
        module.train(attn == "train")
        return Stack(module, (_images(size),), {}, lambda out: out.pooler_output.flatten(1))
    raise ValueError(f"real-stacks: no model {variant!r}; expected one of {MODELS}")


def real_stacks_case(k: int, quick: bool, variant: str) -> Case:
    torch.manual_seed(0)  # the model's initial weights
    model = stack(variant, quick)
    module, inputs, kwargs, pool = model.module, model.inputs, model.kwargs, model.pool
    with torch.no_grad():
        batch, width = pool(module(*inputs, **kwargs)).shape
    _, task_heads = linear_task_heads(k, width, batch, _generator())
    names = [name for name, _ in module.named_parameters()]
    shared = [p for _, p in module.named_parameters()]
    params = {name: p.detach() for name, p in zip(names, shared)}

    def per_task(features: torch.Tensor, leaves: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        """One torch.autograd.grad per task on the features' graph, stacked by name."""
        grads = [
            torch.autograd.grad(head(features), leaves, retain_graph=True) for head in task_heads
        ]
        return {name: torch.stack([g[j] for g in grads]) for j, name in enumerate(names)}

    def naive() -> dict[str, torch.Tensor]:
        """One eager forward, then one torch.autograd.grad per task on its graph."""
        return per_task(pool(module(*inputs, **kwargs)), shared)

    def f(p: dict[str, torch.Tensor]) -> torch.Tensor:
        return pool(torch.func.functional_call(module, p, inputs, kwargs))

    def naive_on_f() -> dict[str, torch.Tensor]:
        """The same loop on f (functional_call, as funcgrad and torch.func get it): what f's
        own cost adds to the loop's, so that auto / this is funcgrad's own overhead."""
        leaves = {name: p.detach().requires_grad_() for name, p in params.items()}
        with torch.enable_grad():
            return per_task(f(leaves), list(leaves.values()))

    # Training mode: torch.func refuses BatchNorm's in-place update of its running
    # statistics; torch's own recipe is a copy of the module that keeps none (the batch's
    # statistics, the same gradients).
    raw = module
    if module.training:
        raw = copy.deepcopy(module)
        torch.func.replace_all_batch_norm_modules_(raw)

    def raw_f(p: dict[str, torch.Tensor]) -> torch.Tensor:
        return pool(torch.func.functional_call(raw, p, inputs, kwargs))

    def torch_func() -> dict[str, torch.Tensor]:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", _VMAP_FALLBACK, UserWarning)
            y, vjp_fn = vjp(raw_f, params)
            cotangents = torch.stack([torch.func.grad(head)(y) for head in task_heads])
            return torch.func.vmap(vjp_fn)(cotangents)[0]

    auto = funcgrad.compose_heads(f, task_heads)
    case = Case("real-stacks", k, batch * width, sum(p.numel() for p in shared), {})
    case.variant = variant
    case.methods |= {
        "naive": naive,
        "loop on f": naive_on_f,
        "funcgrad auto": lambda: auto(params)[1],
        "torch.func vjp+vmap": torch_func,
    }
    case.plans = {"funcgrad auto": lambda: auto.plan(params)}
    return case
