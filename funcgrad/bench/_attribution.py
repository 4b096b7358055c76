"""The attribution case: every target token's attribution to every prompt token of a causal
LM (issue 44), as captum 0.9's ``LLMGradientAttribution`` gives it.

A random-weight GPT-2 (4 layers, 256 wide, a 4096-token vocabulary, eager attention so that
forward mode runs), float32. Methods: captum's loop (a prefix forward and a backward per
target; ``LayerIntegratedGradients`` adds n_steps + 2 forwards per target), the hand loop
(one teacher-forced forward, then T ``torch.autograd.grad``), the expand trick (T copies of
the sequence in one batch, one backward), ``funcgrad.attribution.token_attr`` in reverse
mode, forward mode and auto, and the floor (one forward and one backward of the summed
log-probabilities: a bound, not an answer). Every answer is checked against the hand loop.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import torch

from funcgrad.attribution import Method, Mode, token_attr

from ._cases import Case, SkipCase, device

METHODS = ("grad_x_input", "integrated_gradients")
PROMPTS = (16, 64)
TARGET_COUNTS = (8, 32, 128)
N_STEPS = {"full": 16, "quick": 4}
CELLS = {
    "full": [
        (f"{method} L={prompt}", targets)
        for method in METHODS
        for prompt in PROMPTS
        for targets in TARGET_COUNTS
        # captum's integrated gradients at T = 128: ~128 x 18 forwards a call; too slow for
        # a shared 2-core machine.
        if not (method == "integrated_gradients" and targets == 128)
    ]
    # the grad x input target cell (L_in = 32, T = 16)
    + [("grad_x_input L=32", 16)],
    "quick": [("grad_x_input L=8", 4), ("integrated_gradients L=8", 4)],
}
# (case label, method, baseline, limit), as in __main__'s TARGETS (issue 44).
TARGETS = [
    ("attribution grad_x_input L=32 k=16", "funcgrad auto", "captum", 0.35),
    ("attribution integrated_gradients L=16 k=32", "funcgrad auto", "captum", 0.5),
    ("attribution grad_x_input L=16 k=128", "funcgrad forward", "funcgrad reverse", 0.33),
]
MEMORY_TARGETS: list[tuple[str, str, str, float]] = []


class WordTokenizer:
    """The least of a Hugging Face tokenizer that captum's LLM attribution calls: token id i
    is the word ``w{i}`` (nothing to download)."""

    def encode(
        self, text: str, return_tensors: str | None = None, add_special_tokens: bool = True
    ) -> Any:
        ids = [int(word[1:]) for word in text.split()]
        return torch.tensor([ids], device="cpu") if return_tensors == "pt" else ids

    def decode(self, ids: Any) -> str:
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else ids
        return " ".join(f"w{i}" for i in ([ids] if isinstance(ids, int) else ids))

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [f"w{i}" for i in ids]

    def convert_tokens_to_ids(self, tokens: list[str]) -> list[int]:
        return [int(token[1:]) for token in tokens]

    def __call__(
        self, text: str, return_offsets_mapping: bool = False, add_special_tokens: bool = True
    ) -> dict[str, Any]:
        spans = [(m.start(), m.end()) for m in re.finditer(r"\S+", text)]
        return {"input_ids": self.encode(text), "offset_mapping": spans}


def _gpt2(quick: bool) -> torch.nn.Module:
    try:
        transformers: Any = importlib.import_module("transformers")
    except ImportError as error:
        raise SkipCase(
            "transformers is not installed (pip install funcgrad[attribution])"
        ) from error
    size = (
        {"n_embd": 32, "n_layer": 2, "n_head": 2}
        if quick
        else {"n_embd": 256, "n_layer": 4, "n_head": 4}
    )
    config = transformers.GPT2Config(
        vocab_size=256 if quick else 4096,
        n_positions=256,
        bos_token_id=None,
        eos_token_id=None,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        attn_implementation="eager",
        **size,
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).to(device()).eval()


def _quadrature(method: str, n_steps: int) -> tuple[list[float], list[float]]:
    if method != "integrated_gradients":
        return [1.0], [1.0]
    nodes, weights = np.polynomial.legendre.leggauss(n_steps)
    steps = torch.tensor((0.5 * weights).tolist(), device="cpu").float().tolist()
    return (0.5 * (1 + nodes)).tolist(), steps


def attribution_case(targets: int, quick: bool, variant: str) -> Case:
    """``variant`` is ``"<method> L=<prompt length>"``; k is T, the number of targets."""
    method, prompt_text = variant.split(" L=")
    prompt = int(prompt_text)
    model: Any = _gpt2(quick)
    emb: Any = model.get_input_embeddings()
    vocabulary = emb.num_embeddings
    generator = torch.Generator(device="cpu").manual_seed(prompt * 1000 + targets)
    ids = torch.randint(1, vocabulary, (prompt + targets,), generator=generator).to(device())
    input_ids, target_ids = ids[:prompt], ids[prompt:]
    n_steps = N_STEPS["quick" if quick else "full"]
    alphas, steps = _quadrature(method, n_steps)
    rows = len(alphas)
    step_sizes = torch.tensor(steps, device=device())
    sequence = torch.cat([input_ids, target_ids[:-1]])
    width = emb.embedding_dim

    def inputs_of() -> tuple[torch.Tensor, torch.Tensor]:
        """(the rows' embeddings: the path's points or the input's; what the gradient is
        multiplied by), as captum forms them."""
        with torch.no_grad():
            embeds = emb(sequence[None])
            if method != "integrated_gradients":
                return embeds, embeds[0, :prompt]
            base_ids = sequence.clone()
            base_ids[:prompt] = 0
            baseline = emb(base_ids[None])
            path = torch.cat([baseline + a * (embeds - baseline) for a in alphas])
            return path, (embeds - baseline)[0, :prompt]

    def teacher_forced() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(leaf, (rows, T) log-probs, direction) after one teacher-forced forward."""
        path, direction = inputs_of()
        leaf = path.clone().requires_grad_()
        handle = emb.register_forward_hook(lambda module, args, output: leaf)
        try:
            logits = model(sequence.expand(rows, -1)).logits[:, prompt - 1 :]
        finally:
            handle.remove()
        chosen = target_ids.expand(rows, -1)[..., None]
        return leaf, logits.log_softmax(-1).gather(-1, chosen)[..., 0], direction

    def hand_loop() -> torch.Tensor:
        leaf, logp, direction = teacher_forced()
        weighted = logp * step_sizes[:, None]
        grads = [
            torch.autograd.grad(weighted[:, t].sum(), leaf, retain_graph=t < targets - 1)[0]
            for t in range(targets)
        ]
        total = torch.stack([g.sum(0)[:prompt] for g in grads])
        return (total * direction).sum(-1)

    def floor() -> None:
        _, logp, _ = teacher_forced()
        (logp * step_sizes[:, None]).sum().backward()

    def expand_trick() -> torch.Tensor:
        """T copies of the sequence (times the path's rows) in one batch: copy t reads
        target t's log-prob; one backward of their sum."""
        path, direction = inputs_of()
        leaf = path.repeat(targets, 1, 1).requires_grad_()  # (T * rows, L, d)
        handle = emb.register_forward_hook(lambda module, args, output: leaf)
        try:
            logits = model(sequence.expand(targets * rows, -1)).logits
        finally:
            handle.remove()
        copy = torch.arange(targets, device=device()).repeat_interleave(rows)
        logp = logits[torch.arange(targets * rows, device=device()), prompt - 1 + copy]
        logp = logp.log_softmax(-1).gather(-1, target_ids[copy][:, None])[:, 0]
        (grad,) = torch.autograd.grad((logp * step_sizes.repeat(targets)).sum(), leaf)
        total = grad.reshape(targets, rows, -1, width).sum(1)[:, :prompt]
        return (total * direction).sum(-1)

    def funcgrad_mode(mode: Mode) -> Callable[[], torch.Tensor]:
        return lambda: token_attr(
            model, input_ids, target_ids, method=cast(Method, method), n_steps=n_steps, mode=mode
        )

    methods: dict[str, Callable[[], Any]] = {"naive": hand_loop}
    skipped: dict[str, str] = {}
    try:
        from captum.attr import (
            LayerGradientXActivation,
            LayerIntegratedGradients,
            LLMGradientAttribution,
            TextTokenInput,
        )
    except ImportError:
        skipped["captum"] = "captum is not installed (pip install funcgrad[attribution])"
    else:
        tokenizer = WordTokenizer()
        layer = (
            LayerIntegratedGradients(model, emb)
            if method == "integrated_gradients"
            else LayerGradientXActivation(model, emb)
        )
        llm = LLMGradientAttribution(layer, tokenizer)
        text = TextTokenInput(tokenizer.decode(input_ids), tokenizer)
        kwargs = {"n_steps": n_steps} if method == "integrated_gradients" else {}

        def captum() -> torch.Tensor:
            return llm.attribute(text, target=target_ids, **kwargs).token_attr

        methods["captum"] = captum
    if targets * rows <= 128:  # T x n_steps copies of the sequence: memory grows as T^2
        methods["expand trick"] = expand_trick
    else:
        skipped["expand trick"] = f"T x rows = {targets * rows} copies of the sequence"
    methods["funcgrad reverse"] = funcgrad_mode("reverse")
    methods["funcgrad forward"] = funcgrad_mode("forward")
    methods["funcgrad auto"] = funcgrad_mode("auto")
    methods["floor"] = floor
    return Case(
        "attribution",
        targets,
        rows * targets,
        prompt * width,
        methods,
        skipped=skipped,
        reference_only=("floor",),
        variant=variant,
        baseline="captum" if "captum" in methods else "naive",
        extra={"n_steps": n_steps if method == "integrated_gradients" else None},
    )
