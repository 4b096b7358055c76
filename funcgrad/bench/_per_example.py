"""The per-example case: instance-wise risk minimisation (IWRM), B per-example losses as B
heads, one weighted update into ``.grad``, on an MLP, a CNN and a small transformer.

Every method returns the update it wrote into ``.grad``; they must agree with the
per-example loop (B backward passes, then the weighting on their Gramian). The weighting is
a cheap torch-native one (inverse gradient norms, from the Gramian's diagonal), so that the
times are those of the Gramian machinery; UPGrad's QP on the same (B, B) Gramian is timed
in its own row (``reference_only``: it computes no update).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

import funcgrad

from ._cases import Case, device

VARIANTS = ("mlp", "cnn", "transformer")
CELLS = {
    "full": [(variant, batch) for variant in VARIANTS for batch in (32, 128, 512)],
    "quick": [(variant, 8) for variant in VARIANTS],
}
# (case label, method, baseline, limit), as in __main__'s TARGETS.
TARGETS = [
    *(
        (f"per-example {v} k=128", "funcgrad per_example", "one fwd+bwd", 1.5)
        for v in ("mlp", "cnn")
    ),
    *(
        (f"per-example {v} k=128", "funcgrad per_example", "torchjd autogram", 0.5)
        for v in ("mlp", "cnn")
    ),
]
MEMORY_TARGETS = [
    (f"per-example {v} k=128", "funcgrad per_example", "one fwd+bwd", 2.0) for v in ("mlp", "cnn")
]


@contextlib.contextmanager
def _torch_vmap_fallback_quiet() -> Iterator[None]:
    """torch's UserWarning when TorchJD's vmap meets an op without a batching rule (CPU
    attention's backward): the peer's, not funcgrad's, and an error under CI's
    PYTHONWARNINGS=error::UserWarning."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*There is a performance drop")
        yield


def inverse_norms(gramian: torch.Tensor) -> torch.Tensor:
    """A cheap torch-native weighting: each example's loss scaled by 1 / its gradient norm."""
    return 1 / (gramian.diagonal().sqrt() + 1e-6) / gramian.shape[0]


class Transformer(nn.Module):
    """Token classification of padded sequences: an embedding, two encoder layers (eval,
    dropout 0), a mean over the real tokens, a linear head."""

    def __init__(self, vocab: int, width: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width, padding_idx=0)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(width, 4, 2 * width, dropout=0.0, batch_first=True)
            for _ in range(layers)
        )
        self.head = nn.Linear(width, 10)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pad = tokens == 0
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h, src_key_padding_mask=pad)
        keep = (~pad).unsqueeze(-1).to(h.dtype)
        return self.head((h * keep).sum(1) / keep.sum(1))


def _model(variant: str, batch: int, quick: bool) -> tuple[nn.Module, tuple[Any, ...]]:
    """(model, (inputs, targets)) in float32, seeded, made on the bench's device (only
    the construction runs under it: the timed calls see no default-device mode)."""
    with torch.device(device()):
        return _make_model(variant, batch, quick)


def _make_model(variant: str, batch: int, quick: bool) -> tuple[nn.Module, tuple[Any, ...]]:
    torch.manual_seed(0)
    targets = torch.randint(10, (batch,))
    if variant == "mlp":
        widths = (64, 128, 128) if quick else (256, 512, 512)
        layers: list[nn.Module] = []
        for a, b in itertools.pairwise(widths):
            layers += [nn.Linear(a, b), nn.ReLU()]
        return nn.Sequential(*layers, nn.Linear(widths[-1], 10)), (
            torch.randn(batch, widths[0]),
            targets,
        )
    if variant == "cnn":
        side = 16 if quick else 32
        model = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv2d(32, 32, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(32 * (side // 4) ** 2, 10),
        )
        return model, (torch.randn(batch, 3, side, side), targets)
    assert variant == "transformer"
    length = 8 if quick else 32
    transformer = Transformer(
        vocab=1000, width=32 if quick else 64, layers=1 if quick else 2
    ).eval()
    tokens = torch.randint(1, 1000, (batch, length))
    lengths = torch.randint(length // 2, length + 1, (batch,))
    tokens[torch.arange(length) >= lengths[:, None]] = 0  # padded sequences
    return transformer, (tokens, targets)


def per_example_case(batch: int, quick: bool, variant: str) -> Case:
    """IWRM on ``variant`` with B = ``batch`` per-example losses (k = B heads)."""
    try:
        from torchjd.aggregation import UPGradWeighting
        from torchjd.autogram import Engine
        from torchjd.autojac import backward as autojac_backward
    except ImportError:
        case = Case("per-example", batch, 0, 0, {"naive": lambda: None}, variant=variant)
        case.skipped["all"] = "torchjd is not installed (pip install funcgrad[bench])"
        return case
    model, (inputs, targets) = _model(variant, batch, quick)
    criterion = nn.CrossEntropyLoss(reduction="none")
    params = list(model.parameters())
    names = [name for name, _ in model.named_parameters()]

    def losses_of(m: nn.Module) -> torch.Tensor:
        return criterion(m(inputs), targets)

    def update(run: Callable[[], None], m: nn.Module = model) -> dict[str, torch.Tensor | None]:
        """Run an imperative method from zeroed grads; the update it wrote into .grad."""
        for p in m.parameters():
            p.grad = None
        run()
        return {name: p.grad for name, p in zip(names, m.parameters())}

    def floor() -> None:
        losses_of(model).sum().backward()

    def loop() -> None:
        losses = losses_of(model)
        grads = [torch.autograd.grad(losses[b], params, retain_graph=True) for b in range(batch)]
        rows = torch.stack([torch.cat([g.flatten() for g in gs]) for gs in grads])
        weights = inverse_norms(rows @ rows.T)
        for j, p in enumerate(params):
            p.grad = torch.tensordot(weights, torch.stack([g[j] for g in grads]), dims=1)

    def autojac() -> None:  # TorchJD's Jacobian (.jac), then the same weighting on J J^T
        with _torch_vmap_fallback_quiet():  # TorchJD's vmap over CPU attention's backward
            autojac_backward(losses_of(model), inputs=params)
        jacobians: list[torch.Tensor] = [getattr(p, "jac") for p in params]  # noqa: B009
        rows = [j.flatten(1) for j in jacobians]
        weights = inverse_norms(sum((r @ r.T for r in rows[1:]), rows[0] @ rows[0].T))
        for p, jac in zip(params, jacobians):
            p.grad = torch.tensordot(weights, jac, dims=1)
            delattr(p, "jac")

    # autogram and per_example hook the modules for good: each on its own copy, so that
    # the other methods run plain.
    engine_model = copy.deepcopy(model)
    engine = Engine(engine_model, batch_dim=0)

    def autogram() -> None:
        losses = losses_of(engine_model)
        with _torch_vmap_fallback_quiet():
            losses.backward(inverse_norms(engine.compute_gramian(losses)))

    hooked = copy.deepcopy(model)
    recorder = funcgrad.per_example(hooked)

    def ours() -> None:
        recorder.backward(losses_of(hooked), weighting=inverse_norms)

    gramian = torch.empty(0, device=device())

    def qp() -> dict[str, torch.Tensor]:
        UPGradWeighting()(gramian)
        return {}

    case = Case(
        "per-example",
        batch,
        batch,
        sum(p.numel() for p in params),
        {
            "naive": lambda: update(loop),
            "one fwd+bwd": lambda: update(floor),
            "torchjd autojac": lambda: update(autojac),
            "torchjd autogram": lambda: update(autogram, engine_model),
            "funcgrad per_example": lambda: update(ours, hooked),
            "UPGrad QP alone (on G)": qp,
        },
        variant=variant,
        baseline="one fwd+bwd",
    )
    case.reference_only = ("one fwd+bwd", "UPGrad QP alone (on G)")
    if batch >= 512 and variant != "mlp" and not quick:  # too slow or too big here
        case.skipped["naive"] = (
            f"B = {batch} full-batch backward passes: about a minute a call on 2 CPU cores"
        )
        case.skipped["torchjd autojac"] = (
            "its backward vmapped over B cotangents holds B copies of the activations' "
            "gradients: over the 23 GiB of this machine (the first full run was killed for it)"
        )
        del case.methods["naive"], case.methods["torchjd autojac"]
        case.reference_for = {"funcgrad per_example": "torchjd autogram"}
    # The QP's Gramian, and the plan: from one call of funcgrad's method.
    losses = losses_of(hooked)
    gramian = recorder.gramian(losses).detach()
    case.extra["per_example_plan"] = str(recorder.plan)
    return case
