"""Review of perex7, item 1: a hooked module that reads the output of an nn.Embedding called
on an index shared by the batch, (1, T), killed the process (segfault, on main too).

The cause: that output is handed on as `_SharedRows`, whose ``__torch_function__`` sends
every use but a broadcast against the batch to its row 0, a new view; attribute reads and
writes go through ``__torch_function__`` too. The recorder's ``_hook_dict`` set
``_backward_hooks`` on the reader's input: the dict landed on that throw-away view, and
``grad_fn._register_hook_dict(tensor)`` then read the tensor's own dict, still null. Fixed by
reading and setting them with subclasses' ``__torch_function__`` off.

The cases run in a subprocess (this file as a script): a segfault fails the test instead of
killing pytest. Each case: the forward and a plain backward inside ``per_example`` equal to
those outside; ``per_example_norms`` exact against a per-example autograd loop (float64,
rtol 1e-10), or the documented refusal naming the Embedding."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

import funcgrad

B, T, D = 3, 4, 6
KINDS = ("linear", "layernorm", "groupnorm", "conv1d", "mha")
ROOT = Path(__file__).resolve().parents[1]


def _reader(kind: str) -> nn.Module:
    if kind == "linear":
        return nn.Linear(D, D)
    if kind == "layernorm":
        return nn.LayerNorm(D)
    if kind == "groupnorm":  # channels at dim 1: T of (1, T, D) and (B, T, D)
        return nn.GroupNorm(2, T)
    if kind == "conv1d":
        return nn.Conv1d(T, T, 3, padding=1)
    assert kind == "mha"
    return nn.MultiheadAttention(D, 2, batch_first=True)


class _Model(nn.Module):
    """``index``: "1T" (a (1, T) index, shared by the batch) or "T" (a (T,) index);
    ``mode``: "direct" (the reader reads the position rows alone) or "added" (the rows added
    to the per-example token rows first: GPT-2's case)."""

    def __init__(self, kind: str, index: str, mode: str) -> None:
        super().__init__()
        self.tok, self.pos, self.f = nn.Embedding(5, D), nn.Embedding(T, D), _reader(kind)
        self.kind, self.index, self.mode = kind, index, mode

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos_ids = torch.arange(ids.shape[1])
        if self.index == "1T":
            pos_ids = pos_ids[None]
        x = self.pos(pos_ids)
        if self.mode == "added":
            x = self.tok(ids) + x
        if self.kind == "groupnorm" and x.ndim == 2:
            x = x[None]  # (T, D) as one sample: GroupNorm needs (N, C, ...)
        y = self.f(x, x, x)[0] if self.kind == "mha" else self.f(x)
        return y + 0 * self.tok(ids)  # broadcast to (B, T, D)


def _losses(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(ids).pow(2).sum((1, 2))


def _loop_norms(model: nn.Module, ids: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
    rows = []
    for b in range(ids.shape[0]):
        loss = _losses(model, ids[b : b + 1]).sum()
        got = torch.autograd.grad(loss, params, allow_unused=True)
        rows.append(
            torch.cat(
                [(torch.zeros_like(p) if g is None else g).flatten() for g, p in zip(got, params)]
            )
        )
    return torch.stack(rows).norm(dim=1)


def _case(kind: str, index: str, mode: str) -> str:
    model = _Model(kind, index, mode)
    ids = torch.randint(5, (B, T))
    params = list(model.parameters())
    outside = _losses(model, ids)
    grads = torch.autograd.grad(outside.sum(), params, allow_unused=True)
    with funcgrad.per_example(model):
        inside = _losses(model, ids)
        if not torch.equal(inside, outside):
            return "wrong: the forward differs"
        again = torch.autograd.grad(inside.sum(), params, allow_unused=True)
        for a, b in zip(again, grads):
            if (a is None) != (b is None) or (a is not None and not torch.equal(a, b)):
                return "wrong: a plain backward differs"
        try:
            norms = funcgrad.per_example_norms(_losses(model, ids))
        except ValueError as e:
            return "refused: " + " ".join(str(e).split())
    ref = _loop_norms(model, ids, params)
    if torch.allclose(norms, ref, rtol=1e-10, atol=1e-12):
        return "exact"
    return f"wrong: {norms.tolist()} against the loop's {ref.tolist()}"


def _reviewers_repro() -> str:
    """The review's repro, as written (float32)."""

    class P(nn.Module):
        def __init__(s) -> None:
            super().__init__()
            s.pos = nn.Embedding(4, 6)
            s.f = nn.Linear(6, 6)

        def forward(s, ids: torch.Tensor) -> torch.Tensor:
            return s.f(s.pos(torch.arange(ids.shape[1])[None])) + 0 * ids[..., None]

    m = P()
    ids = torch.randint(5, (3, 4))
    with funcgrad.per_example(m):
        m(ids)
    return "ran"


def _main() -> None:
    torch.manual_seed(0)
    print(f"repro: {_reviewers_repro()}", flush=True)
    torch.set_default_dtype(torch.float64)
    for kind in KINDS:
        for index in ("1T", "T"):
            for mode in ("direct", "added"):
                print(f"{kind}/{index}/{mode}: {_case(kind, index, mode)}", flush=True)


def test_embedding_shared_rows_read_by_a_hooked_module_is_exact_or_refused() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-W", "error", __file__],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr[-3000:])
    results = dict(line.split(": ", 1) for line in done.stdout.splitlines())
    assert results.pop("repro") == "ran"
    assert len(results) == len(KINDS) * 4, done.stdout
    for name, result in results.items():
        _kind, index, mode = name.split("/")
        if index == "1T" and mode == "added":  # GPT-2's case: the rows stay per example
            assert result == "exact", (name, result)
        elif index == "1T":  # the (1, T, d) rows read by the module: the documented refusal
            assert result.startswith(
                "refused: funcgrad.per_example_norms(losses): module 'pos' (Embedding) was "
                "called with an index shared by the batch"
            ), (name, result)
        else:  # a (T, d) output, not batched
            assert result.startswith(
                "refused: funcgrad.per_example_norms(losses): module 'pos' (Embedding) has an "
                "output that has shape (4, 6)"
            ), (name, result)


if __name__ == "__main__":
    _main()
