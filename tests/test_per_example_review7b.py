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

import pytest
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


class _Hooked(nn.Module):
    """GPT-2's shared position rows, with a tensor hook on them (``ret``: it returns 2 g)."""

    def __init__(self, ret: bool, seen: list[torch.Tensor]) -> None:
        super().__init__()
        self.tok, self.pos, self.f = nn.Embedding(5, D), nn.Embedding(T, D), nn.Linear(D, D)
        self.ret, self.seen = ret, seen

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        p = self.pos(torch.arange(ids.shape[1])[None])
        p.register_hook(self._hook)
        return self.f(self.tok(ids) + p)

    def _hook(self, g: torch.Tensor) -> torch.Tensor | None:
        self.seen.append(g.clone())
        return 2 * g if self.ret else None


@pytest.mark.parametrize("ret", [False, True])
def test_user_hook_on_shared_rows_fires_as_outside(float64_default, ret) -> None:
    """A tensor hook on the (1, T) rows went to a throw-away view (row 0): it never fired
    inside per_example, and a gradient it returned was lost. Now it fires once with the
    gradient torch gives outside, its returned gradient reaches the table as outside, and
    the per-example call refuses the Embedding (the hook saw the batch's sum); the rest is
    exact against the loop."""
    seen: list[torch.Tensor] = []
    model = _Hooked(ret, seen)
    ids = torch.randint(5, (B, T))
    model(ids).sum().backward()
    outside = [p.grad.clone() for p in model.parameters()]
    (seen_outside,) = seen
    model.zero_grad()
    seen.clear()
    with funcgrad.per_example(model):
        model(ids).sum().backward()
        assert len(seen) == 1 and seen[0].shape == (1, T, D)
        torch.testing.assert_close(seen[0], seen_outside, rtol=1e-14, atol=0)
        for p, want in zip(model.parameters(), outside):
            torch.testing.assert_close(p.grad, want, rtol=1e-14, atol=1e-15)
        with pytest.raises(
            ValueError, match=r"'pos' \(Embedding\) was called with an index shared"
        ):
            funcgrad.per_example_norms(model(ids).pow(2).sum((1, 2)))
        params = [model.tok.weight, *model.f.parameters()]
        norms = funcgrad.per_example_norms(model(ids).pow(2).sum((1, 2)), inputs=params)
    model.ret = False  # (the loop's rows: the hook returns nothing there)
    rows = []
    for b in range(B):
        got = torch.autograd.grad(model(ids[b : b + 1]).pow(2).sum(), params)
        rows.append(torch.cat([g.flatten() for g in got]))
    torch.testing.assert_close(norms, torch.stack(rows).norm(dim=1), rtol=1e-10, atol=1e-12)


# -- item 2: the bench's expected disagreement (TorchJD 0.18's autogram on GPT-2) -----------
# A full run (--variants gpt2) exited 1 for TorchJD's documented bug. Unit tests of the
# classification; none runs GPT-2.

_NOTE = {"package": "torchjd", "from": "0.18", "below": "0.19", "reason": "its bug"}
_WRONG = "DISAGREES (max rel. error 2.50e-01)"


def _classify(agreement, installed="0.18.0", expected=None):
    from funcgrad.bench import __main__ as bench

    expected = {"torchjd autogram": _NOTE} if expected is None else expected
    return bench._classify("gpt2 k=32", agreement, expected, lambda package: installed)


def test_bench_expected_disagreement_is_listed_apart_and_not_counted() -> None:
    failing, listed = _classify({"funcgrad per_example": "ok", "torchjd autogram": _WRONG})
    assert failing == []
    assert listed == [
        "gpt2 k=32: torchjd autogram: DISAGREES (max rel. error 2.50e-01), torchjd 0.18.0 "
        "(expected for >=0.18,<0.19): its bug"
    ]


def test_bench_expected_disagreement_that_disappears_fails_the_run() -> None:
    failing, listed = _classify({"funcgrad per_example": "ok", "torchjd autogram": "ok"})
    assert listed == []
    assert len(failing) == 1 and "torchjd autogram: now agrees, remove the note" in failing[0]


def test_bench_funcgrads_own_disagreement_always_fails() -> None:
    failing, listed = _classify({"funcgrad per_example": _WRONG, "torchjd autogram": _WRONG})
    assert failing == [f"gpt2 k=32: funcgrad per_example: {_WRONG}"] and len(listed) == 1
    with pytest.raises(ValueError, match="funcgrad's own rows cannot be expected to disagree"):
        _classify({"funcgrad per_example": _WRONG}, expected={"funcgrad per_example": _NOTE})


@pytest.mark.parametrize("installed", [None, "0.17.2", "0.19.0", "1.0", "0.180.1"])
def test_bench_expected_disagreement_only_for_the_named_versions(installed) -> None:
    failing, listed = _classify({"torchjd autogram": _WRONG}, installed=installed)
    assert failing == [f"gpt2 k=32: torchjd autogram: {_WRONG}"] and listed == []
    assert _classify({"torchjd autogram": "ok"}, installed=installed) == ([], [])


@pytest.mark.parametrize("installed", ["0.18", "0.18.0", "0.18.3", "0.18.1rc1", "0.18.0.post1"])
def test_bench_expected_disagreement_in_range(installed) -> None:
    assert _classify({"torchjd autogram": _WRONG}, installed=installed)[0] == []


def test_bench_unchecked_expected_method_still_fails() -> None:
    """A verdict that is neither ok nor DISAGREES (its reference errored) is no known bug."""
    verdict = "not checked: its reference 'naive' errored"
    assert _classify({"torchjd autogram": verdict}) == (
        [f"gpt2 k=32: torchjd autogram: {verdict}"],
        [],
    )


def test_bench_run_case_counts_only_the_unexpected(monkeypatch) -> None:
    """Through _run_case with a toy case: the expected method's disagreement goes to its own
    list; the GPT-2 case's note names the installed TorchJD (0.18 here: not stale)."""
    import argparse

    from funcgrad.bench import __main__ as bench
    from funcgrad.bench._cases import Case
    from funcgrad.bench._per_example import TORCHJD_GPT2_EXPECTED

    monkeypatch.setattr(bench, "_installed", lambda package: "0.18.0")
    threads = torch.get_num_threads()
    try:
        cells = [  # (methods that give a wrong answer, counted, listed as expected)
            ({"torchjd autogram"}, 0, 1),
            ({"torchjd autogram", "funcgrad per_example"}, 1, 1),
            (set(), 1, 0),  # "now agrees, remove the note"
        ]
        for wrong, counted, listed in cells:
            methods = {
                m: (lambda: torch.full((2,), 2.0)) if m in wrong else (lambda: torch.ones(2))
                for m in ("naive", "funcgrad per_example", "torchjd autogram")
            }
            case = Case("toy", 2, 1, 1, methods)
            case.extra["expected_disagreements"] = {"torchjd autogram": TORCHJD_GPT2_EXPECTED}
            args = argparse.Namespace(rounds=1, quick=True, no_memory=True, threads=1, device="cpu")
            report: dict[str, list[str]] = {"disagreements": [], "errors": []}
            bench._run_case(case, args, 1, report)
            assert len(report["disagreements"]) == counted, (wrong, report)
            assert len(report["expected_disagreements"]) == listed, (wrong, report)
    finally:
        torch.set_num_threads(threads)
    installed = bench._installed("torchjd")
    if installed is not None:  # the note covers the installed TorchJD: re-check it on upgrade
        low, high = TORCHJD_GPT2_EXPECTED["from"], TORCHJD_GPT2_EXPECTED["below"]
        assert bench._release(low) <= bench._release(installed) < bench._release(high)


if __name__ == "__main__":
    _main()
