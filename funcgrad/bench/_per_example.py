"""The per-example case: instance-wise risk minimisation (IWRM), B per-example losses as B
heads, one weighted update into ``.grad``, on an MLP, a CNN, a small transformer and
Hugging Face's GPT-2 (full runs). Beside it, per-example norms alone and DP-SGD's clipped
sum (``funcgrad.per_example_clip``), against ``vmap(grad)`` and Opacus's ghost clipping
where Opacus supports the layers.

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
    "full": [(variant, batch) for variant in VARIANTS for batch in (32, 128, 512)]
    + [("gpt2", 32), ("linear-transformer", 128)],
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
TARGETS += [
    ("per-example transformer k=128", "funcgrad per_example", "one fwd+bwd", 2.0),
    ("per-example transformer k=128", "funcgrad per_example", "torchjd autogram", 0.5),
    ("per-example gpt2 k=32", "funcgrad per_example", "one fwd+bwd", 2.0),
    *(
        (f"per-example {v}", "funcgrad norms only", "one fwd+bwd", 1.3)
        for v in ("transformer k=128", "gpt2 k=32")
    ),
    *(
        (f"per-example {v} k=128", "funcgrad clip (DP-SGD)", "opacus ghost clip", 0.6)
        for v in ("mlp", "cnn", "linear-transformer")
    ),
    *(
        (f"per-example {v} k=128", "funcgrad norms only", "opacus ghost norms", 0.8)
        for v in ("mlp", "cnn", "linear-transformer")
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


# Why TorchJD 0.18's autogram is expected to disagree on GPT-2 (the "agrees" column): its
# bug, not the bench's (same model, same inputs; minimal repro in
# docs/benchmarks_per_example.md, "TorchJD's autogram on GPT-2").
TORCHJD_GPT2 = (
    "expected: TorchJD 0.18's autogram is wrong on GPT-2, not the bench: it adds the "
    "batch-summed gradient of the position table (a (1, T) index shared by the batch) "
    "to every entry of G, and leaves out the cross terms of the LM head tied to the "
    "token embedding"
)

# The run lists that disagreement apart and does not fail for it, for TorchJD 0.18.x only;
# it fails where autogram agrees there ("now agrees, remove the note").
TORCHJD_GPT2_EXPECTED = {
    "package": "torchjd",
    "from": "0.18",
    "below": "0.19",
    "reason": "TorchJD's autogram bug on GPT-2's shared (1, T) position index and tied LM head, "
    'docs/benchmarks_per_example.md, "TorchJD\'s autogram on GPT-2"',
}


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


class LinearAttention(nn.Module):
    """Self-attention from Linear layers alone (q, k, v as one Linear of 3·d outputs, an
    out-projection), with a key padding mask: the layers Opacus's ghost clipping supports
    (as its DPMultiheadAttention)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, h: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        batch, length, width = h.shape
        q, k, v = (
            x.view(batch, length, self.heads, -1).transpose(1, 2) for x in self.qkv(h).chunk(3, -1)
        )
        mask = torch.zeros(pad.shape, dtype=h.dtype, device=h.device).masked_fill(pad, -1e9)
        attended = torch.nn.functional.scaled_dot_product_attention(q, k, v, mask[:, None, None])
        return self.out(attended.transpose(1, 2).reshape(batch, length, width))


class LinearTransformer(nn.Module):
    """The transformer variant with every parameter in a layer that Opacus's ghost clipping
    supports: Embedding, Linear self-attention (`LinearAttention`), LayerNorm (Opacus: its
    per-sample gradients), the feed-forward Linears, a Linear head; post-norm as
    nn.TransformerEncoderLayer."""

    def __init__(self, vocab: int, width: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width, padding_idx=0)
        self.attention = nn.ModuleList(LinearAttention(width, 4) for _ in range(layers))
        self.norm1 = nn.ModuleList(nn.LayerNorm(width) for _ in range(layers))
        self.up = nn.ModuleList(nn.Linear(width, 2 * width) for _ in range(layers))
        self.down = nn.ModuleList(nn.Linear(2 * width, width) for _ in range(layers))
        self.norm2 = nn.ModuleList(nn.LayerNorm(width) for _ in range(layers))
        self.head = nn.Linear(width, 10)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pad = tokens == 0
        h = self.embed(tokens)
        for i, attention in enumerate(self.attention):
            h = self.norm1[i](h + attention(h, pad))
            h = self.norm2[i](h + self.down[i](torch.relu(self.up[i](h))))
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
    if variant == "gpt2":  # the issue's: 4 layers, 256 wide, T = 64; LM losses, tied head
        import transformers

        from .models import gpt2

        length = 8 if quick else 64
        size = dict(hidden=32, layers=1, heads=2) if quick else dict(hidden=256, layers=4, heads=4)
        config: Any = gpt2("eager", **size, vocab=1000, positions=length).config
        lm = transformers.GPT2LMHeadModel(config).eval()  # its head tied to the embedding
        return lm, (torch.randint(1000, (batch, length)), None)
    assert variant in ("transformer", "linear-transformer")
    length = 8 if quick else 32
    kind = Transformer if variant == "transformer" else LinearTransformer
    transformer = kind(vocab=1000, width=32 if quick else 64, layers=1 if quick else 2).eval()
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

    def losses_from(m: Callable[[torch.Tensor], Any], x: torch.Tensor, y: Any) -> torch.Tensor:
        if variant == "gpt2":  # next-token losses, summed over each sequence
            logits = m(x).logits[:, :-1]
            return criterion(logits.transpose(1, 2), x[:, 1:]).sum(1)
        return criterion(m(x), y)

    def losses_of(m: nn.Module) -> torch.Tensor:
        return losses_from(m, inputs, targets)

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

    max_norm = 1.0  # set below: the median norm, so that about half the examples clip

    def norms_only() -> dict[str, torch.Tensor]:
        funcgrad.per_example_norms(losses_of(hooked))
        return {}

    def clip() -> None:
        funcgrad.per_example_clip(losses_of(hooked), max_norm)

    buffers = dict(model.named_buffers())

    def vmap_clip() -> None:  # torch.func's per-sample-gradients recipe, then the clipping
        detached = {name: p.detach() for name, p in model.named_parameters()}

        def one(p: dict[str, torch.Tensor], x: torch.Tensor, y: Any) -> torch.Tensor:
            call = lambda v: torch.func.functional_call(model, (p, buffers), (v,))  # noqa: E731
            return losses_from(call, x.unsqueeze(0), None if y is None else y.unsqueeze(0))[0]

        dims = (None, 0, None if targets is None else 0)
        with _torch_vmap_fallback_quiet():
            grads = torch.func.vmap(torch.func.grad(one), in_dims=dims)(detached, inputs, targets)
        norms = torch.stack([g.flatten(1).norm(dim=1) for g in grads.values()], 1).norm(dim=1)
        factors = (max_norm / (norms + 1e-6)).clamp(max=1.0)
        for name, p in model.named_parameters():
            p.grad = torch.tensordot(factors, grads[name], dims=1)

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
    case.methods["funcgrad norms only"] = norms_only
    case.methods["vmap(grad) clip"] = lambda: update(vmap_clip)
    case.methods["funcgrad clip (DP-SGD)"] = lambda: update(clip, hooked)
    case.reference_for["funcgrad clip (DP-SGD)"] = "vmap(grad) clip"
    _add_opacus_ghost(case, model, losses_from, inputs, targets, lambda: max_norm)
    case.reference_only = (
        "one fwd+bwd",
        "UPGrad QP alone (on G)",
        "funcgrad norms only",
        "opacus ghost norms",
    )
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
    if variant == "gpt2":  # B backward passes of GPT-2 (or their vmap): seconds a call here
        case.extra["agreement_detail"] = {"torchjd autogram": TORCHJD_GPT2}
        case.extra["expected_disagreements"] = {"torchjd autogram": TORCHJD_GPT2_EXPECTED}
        del case.methods["torchjd autojac"]
        case.skipped["torchjd autojac"] = "B vmapped GPT-2 backward passes: minutes a call"
        case.untimed = ("naive", "vmap(grad) clip")  # the references, run once
    # The QP's Gramian, and the plan: from one call of funcgrad's method.
    losses = losses_of(hooked)
    gramian = recorder.gramian(losses).detach()
    case.extra["per_example_plan"] = str(recorder.plan)
    max_norm = float(funcgrad.per_example_norms(losses_of(hooked)).median())
    funcgrad.per_example_norms(losses_of(hooked))
    case.extra["per_example_norms_plan"] = str(recorder.plan)
    return case


def _add_opacus_ghost(
    case: Case,
    model: nn.Module,
    losses_from: Callable[..., torch.Tensor],
    inputs: torch.Tensor,
    targets: Any,
    max_norm: Callable[[], float],
) -> None:
    """Opacus's ghost clipping (its norms, then the clipped sum: two backwards), on a copy,
    where Opacus supports every layer (ghost norms for Linear, Conv2d, Embedding; its
    per-sample gradients for LayerNorm: the MLP, the CNN and the Linear transformer); and
    its norms alone (the first of the two backwards, `get_norm_sample`)."""
    try:
        from opacus.grad_sample import GradSampleModuleFastGradientClipping
        from opacus.optimizers import DPOptimizerFastGradientClipping
        from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping
    except ImportError:
        case.skipped["opacus ghost clip"] = "opacus is not installed"
        return
    owners = [m for m in model.modules() if next(m.parameters(recurse=False), None) is not None]
    kinds = {type(m) for m in owners}
    supported = {nn.Linear, nn.Conv2d, nn.Embedding, nn.LayerNorm}
    if not kinds <= supported:
        names = sorted(k.__name__ for k in kinds - supported)
        case.skipped["opacus ghost clip"] = f"Opacus's ghost clipping does not support {names}"
        return
    # Opacus's hooks record only in training mode; these models have no dropout nor batch
    # statistics, so train() changes nothing else
    copied = copy.deepcopy(model).train()
    batch = inputs.shape[0]
    made: list[Any] = []

    def build() -> tuple[Any, Any]:
        """Opacus's module and loss, built once, as a training loop does (its hooks stay)."""
        if not made:
            module = GradSampleModuleFastGradientClipping(
                copied, max_grad_norm=max_norm(), use_ghost_clipping=True, loss_reduction="sum"
            )
            optimizer = DPOptimizerFastGradientClipping(
                torch.optim.SGD(module.parameters(), lr=0.1),
                noise_multiplier=0.0,
                max_grad_norm=max_norm(),
                expected_batch_size=batch,
                loss_reduction="sum",
            )
            loss = nn.CrossEntropyLoss(reduction="sum")
            made.append((module, DPLossFastGradientClipping(module, optimizer, loss, "sum")))
        found: tuple[Any, Any] = made[0]
        return found

    def norms() -> dict[str, torch.Tensor]:
        """Opacus's per-example norms alone: one backward of the summed losses through its
        hooks, then its norms (`get_norm_sample`)."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # its secure-RNG and hook warnings
            module, _ = build()
            for p in copied.parameters():
                p.grad = None
            losses_from(module, inputs, targets).sum().backward()
            module.get_norm_sample()
        return {}

    def run() -> dict[str, torch.Tensor | None]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # its secure-RNG and hook warnings
            module, criterion = build()
            for p in copied.parameters():
                p.grad = None
            criterion(module(inputs), targets).backward()
        return {name: p.grad for name, p in copied.named_parameters()}

    case.methods["opacus ghost clip"] = run
    case.reference_for["opacus ghost clip"] = "vmap(grad) clip"
    case.methods["opacus ghost norms"] = norms
