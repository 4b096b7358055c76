"""The real-model case: a tiny random BERT (transformers) with task heads on its pooled output.

Two jobs on the same model, timed side by side: one weighted update into ``.grad``
(``funcgrad.backward`` at both levels with TorchJD's UPGrad, against TorchJD's
``mtl_backward`` + ``jac_to_grad`` and against ``sum(losses).backward()``, the floor), and the
per-task gradients of the encoder's parameters (``funcgrad.compose_heads`` on
``torch.func.functional_call``, against a loop of ``torch.autograd.grad``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

import funcgrad

from . import models
from ._cases import Case, SkipCase, built, linear_task_heads, on

MISSING_TRANSFORMERS = (
    'transformers is not installed (pip install "torch==2.13.0" -e ".[test]" provides it)'
)
MISSING_TORCHJD = "torchjd is not installed (pip install funcgrad[bench])"
VOCAB, SEQ, LAYERS, ATTENTION_HEADS = 1000, 32, 2, 4
SIZES = {"quick": {"hidden": 64, "batch": 8}, "full": {"hidden": 128, "batch": 16}}
# TorchJD vmaps autograd.grad over the losses; where an op has no batching rule (CPU sdpa's
# backward) torch warns that it loops per example. Expected here: not an error of the bench.
_VMAP_FALLBACK = "There is a performance drop because we have not yet implemented the batching"


def real_model_case(k: int, quick: bool, variant: str = "eager") -> Case:
    """``variant``: the attention implementation, ``"eager"`` or ``"sdpa"`` (or the case's
    own variant, ``"bert-eager"``, as the peak-memory subprocess passes it back)."""
    variant = variant.removeprefix("bert-")
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise SkipCase(MISSING_TRANSFORMERS) from None
    size = SIZES["quick" if quick else "full"]
    hidden, batch = size["hidden"], size["batch"]
    torch.manual_seed(0)
    model = built(
        lambda: models.bert(
            variant,
            hidden=hidden,
            layers=LAYERS,
            heads=ATTENTION_HEADS,
            intermediate=4 * hidden,
            vocab=VOCAB,
            positions=2 * SEQ,
        ).eval()
    )
    ids = on(torch.randint(0, VOCAB, (batch, SEQ), device="cpu"))
    mask = torch.ones(batch, SEQ, dtype=torch.long, device="cpu")
    for i in range(batch):  # padded sequences of different lengths
        mask[i, SEQ - i % (SEQ // 2) :] = 0
    mask = on(mask)
    heads, task_heads = linear_task_heads(k, hidden, batch)

    def losses_on(features: torch.Tensor) -> list[torch.Tensor]:
        return [head(features) for head in task_heads]

    def pooled() -> torch.Tensor:
        return model(ids, attention_mask=mask).pooler_output

    shared = list(model.parameters())
    names = [name for name, _ in model.named_parameters()]
    leaves = shared + [p for head in heads for p in head.parameters()]
    leaf_names = names + [
        f"head{t}.{n}" for t, h in enumerate(heads) for n, _ in h.named_parameters()
    ]

    def update(run: Callable[[], None]) -> Callable[[], dict[str, torch.Tensor | None]]:
        """An imperative method from zeroed grads: the update it wrote into every .grad."""

        def method() -> dict[str, torch.Tensor | None]:
            for p in leaves:
                p.grad = None
            run()
            return {name: p.grad for name, p in zip(leaf_names, leaves)}

        return method

    def floor() -> None:
        torch.stack(losses_on(pooled())).sum().backward()

    def per_task_grads() -> dict[str, torch.Tensor]:
        """The reference for compose_heads: k x torch.autograd.grad on one graph."""
        losses = losses_on(pooled())
        grads = [torch.autograd.grad(z, shared, retain_graph=True) for z in losses]
        return {name: torch.stack([g[j] for g in grads]) for j, name in enumerate(names)}

    params = {name: p.detach() for name, p in model.named_parameters()}

    def f(p: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.func.functional_call(model, p, (ids,), {"attention_mask": mask}).pooler_output

    auto = funcgrad.compose_heads(f, task_heads, strategy="auto")
    vjp = funcgrad.compose_heads(f, task_heads, strategy="vjp")
    case = Case("real-model", k, batch * hidden, sum(p.numel() for p in shared), {})
    case.variant = f"bert-{variant}"
    case.methods["sum(losses) fwd+bwd"] = update(floor)
    case.baseline = "sum(losses) fwd+bwd"
    case.reference_only = ("sum(losses) fwd+bwd",)
    try:
        from torchjd.aggregation import UPGrad, UPGradWeighting
        from torchjd.autojac import jac_to_grad, mtl_backward
    except ImportError:
        for name in ("torchjd mtl_backward+jac_to_grad", "funcgrad backward params/features"):
            case.skipped[name] = MISSING_TORCHJD
    else:
        weighting = UPGradWeighting()

        def upgrad_by_hand() -> None:  # untimed reference at the params level
            losses = losses_on(pooled())
            grads = [torch.autograd.grad(z, shared, retain_graph=True) for z in losses]
            rows = torch.stack([torch.cat([g.flatten() for g in gs]) for gs in grads])
            weights = weighting(rows @ rows.T)
            # each head gets its own loss's gradient
            torch.stack(losses).sum().backward(inputs=leaves[len(shared) :])
            for j, p in enumerate(shared):
                p.grad = torch.tensordot(weights, torch.stack([g[j] for g in grads]), dims=1)

        def torchjd_autojac() -> None:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", _VMAP_FALLBACK, UserWarning)
                features = pooled()
                mtl_backward(losses_on(features), features)
                jac_to_grad(shared, UPGrad())

        def libmtl_recipe() -> None:  # LibMTL's rep_grad: the losses on detached features
            features = pooled()
            rep = features.detach().requires_grad_()
            losses = losses_on(rep)
            rows = torch.stack(
                [torch.autograd.grad(z, rep, retain_graph=True)[0].flatten() for z in losses]
            )
            weights = weighting(rows @ rows.T)
            torch.stack(losses).sum().backward(inputs=leaves[len(shared) :])
            features.backward((weights @ rows).reshape(features.shape))

        def funcgrad_backward(level: Any) -> Callable[[], None]:
            def run() -> None:
                features = pooled()
                funcgrad.backward(
                    losses_on(features), through=features, weighting=weighting, level=level
                )

            return run

        case.methods |= {
            "UPGrad by hand (params)": update(upgrad_by_hand),
            "torchjd mtl_backward+jac_to_grad": update(torchjd_autojac),
            "funcgrad backward params": update(funcgrad_backward("params")),
            "LibMTL recipe (features)": update(libmtl_recipe),
            "funcgrad backward features": update(funcgrad_backward("features")),
        }
        case.untimed = ("UPGrad by hand (params)",)
        case.reference_for |= {
            "torchjd mtl_backward+jac_to_grad": "UPGrad by hand (params)",
            "funcgrad backward params": "UPGrad by hand (params)",
            "funcgrad backward features": "LibMTL recipe (features)",
        }
    case.methods |= {
        "naive": per_task_grads,
        "funcgrad compose_heads auto": lambda: auto(params)[1],
        "funcgrad compose_heads vjp": lambda: vjp(params)[1],
    }
    case.reference_for |= {
        "funcgrad compose_heads auto": "naive",
        "funcgrad compose_heads vjp": "naive",
    }
    case.plans = {
        "funcgrad compose_heads auto": lambda: auto.plan(params),
        "funcgrad compose_heads vjp": lambda: vjp.plan(params),
    }
    return case
