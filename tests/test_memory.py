"""chunk_size="auto": the most directions that fit the memory budget, measured on the first
call (peak live bytes of one and two directions), remembered per shapes; the budget from
funcgrad.memory_budget, FUNCGRAD_MEMORY_BUDGET or free memory."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import autograd_reference

import funcgrad
from funcgrad import _memory

# f(x) whose backward allocates a 1024 x 1024 intermediate per direction (about 12 MiB of
# transient memory each), with small inputs and outputs: 64 directions at once need ~770 MiB.
SETUP = """
import torch, funcgrad
torch.set_num_threads(1)
torch.manual_seed(0)
U, V = torch.randn(1024, 64), torch.randn(1024, 64)
def f(x):
    return torch.tanh(torch.outer(U @ x, V @ x)).sum(0)
heads = [lambda y, i=i: y[i] for i in range(64)]
x = torch.randn(64)
"""


def _peak_mib(chunk_size: str) -> float:
    """Peak resident memory above the baseline during one call, in a fresh process. glibc is
    told to return freed blocks at once (mmap above 64 KiB, no trim threshold), so the peak
    resident size follows live memory instead of what the allocator keeps."""
    script = SETUP + textwrap.dedent(f"""
        def status(key):
            for line in open("/proc/self/status"):
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
        fn = funcgrad.compose_heads(f, heads, strategy="vjp", chunk_size={chunk_size!r})
        funcgrad.compose_heads(f, heads[:2], strategy="vjp")(x)  # warm up
        base = status("VmRSS:")
        open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM)
        with funcgrad.memory_budget("32MiB"):
            fn(x)
        print((status("VmHWM:") - base) / 2**20)
    """)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return float(done.stdout.split()[-1])


@pytest.mark.slow  # a subprocess that measures its peak memory
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="Linux only")
def test_peak_memory_stays_within_a_small_budget():
    unchunked = _peak_mib(None)
    assert unchunked > 10 * 32  # the case needs about 10x the budget at once
    # 32 MiB of budget, plus a stated margin of 16 MiB for what the measurement cannot see
    # (allocator rounding, the process's own growth)
    assert _peak_mib("auto") <= 32 + 16


def _small_budget_case():
    torch.manual_seed(0)
    w = torch.randn(40, 6)
    return (lambda x: torch.tanh(w @ x)), [lambda y, i=i: (y[i] * y).sum() for i in range(9)]


@pytest.mark.parametrize("strategy", ["vjp", "jacrev", "loop", "auto"])
def test_auto_chunks_agree_with_autograd_on_compose_heads(strategy):
    f, heads = _small_budget_case()
    x = torch.randn(6)
    fn = funcgrad.compose_heads(f, heads, strategy=strategy, chunk_size="auto")
    with funcgrad.memory_budget(2000):  # a few directions per chunk
        for _ in range(2):  # the first call measures, the second uses the fitted chunk
            values, grads = fn(x)
            want_values, want_grads = autograd_reference(f, heads, (x,))
            torch.testing.assert_close(values, torch.stack(want_values))
            torch.testing.assert_close(grads, torch.stack(want_grads))


def test_auto_chunks_agree_on_combine_pullback_grads_and_backward():
    f, heads = _small_budget_case()
    x = torch.randn(6)
    weights = torch.arange(1.0, 10.0)
    with funcgrad.memory_budget(50_000):  # a few directions per chunk
        _, grad, _ = funcgrad.combine_heads(f, heads, lambda g: weights, chunk_size="auto")(x)
        _, want, _ = funcgrad.combine_heads(f, heads, lambda g: weights)(x)
        torch.testing.assert_close(grad, want)

        _, pb = funcgrad.pullback(f, x, reuse=False)
        cotangents = torch.randn(9, 40)
        (got,) = pb.many(cotangents, chunk_size="auto")
        torch.testing.assert_close(got, torch.stack([pb(v)[0] for v in cotangents]))

        xr = x.clone().requires_grad_()
        y = f(xr)
        outputs = [head(y) for head in heads]
        (got,) = funcgrad.grads(outputs, xr, through=y, chunk_size="auto", retain_graph=True)
        want = torch.stack([torch.autograd.grad(z, xr, retain_graph=True)[0] for z in outputs])
        torch.testing.assert_close(got, want)

        encoder, batch = torch.nn.Linear(6, 40), torch.randn(5, 6)
        features = torch.tanh(encoder(batch))
        losses = [(features[:, i] ** 2).mean() for i in range(9)]
        funcgrad.backward(losses, through=features, weighting=lambda g: weights, chunk_size="auto")
        features = torch.tanh(encoder(batch))
        total = sum(w * (features[:, i] ** 2).mean() for i, w in enumerate(weights))
        want = torch.autograd.grad(total, list(encoder.parameters()))
        for p, expected in zip(encoder.parameters(), want):
            torch.testing.assert_close(p.grad, expected)


def test_the_fitted_chunk_is_measured_once_per_shapes(monkeypatch):
    measured = []
    original = _memory.peak_of
    monkeypatch.setattr(
        _memory, "peak_of", lambda call, device: measured.append(1) or original(call, device)
    )
    f, heads = _small_budget_case()
    fn = funcgrad.compose_heads(f, heads, strategy="vjp", chunk_size="auto")
    assert fn.plan(torch.randn(6)).chunk_size == "auto"
    with funcgrad.memory_budget(2000):
        fn(torch.randn(6))
        assert len(measured) == 2  # one direction, then two
        fn(torch.randn(6))
        assert len(measured) == 2  # remembered
        chunk = fn.plan(torch.randn(6)).chunk_size
        assert isinstance(chunk, int) and 1 <= chunk < 9
        fn(torch.randn(7)[:6].clone())  # same shapes: still remembered
        assert len(measured) == 2


def test_memory_budget_nests_and_restores(monkeypatch):
    monkeypatch.delenv("FUNCGRAD_MEMORY_BUDGET", raising=False)
    cpu = torch.device("cpu")
    default = _memory.budget(cpu)
    assert default > 0
    with funcgrad.memory_budget("1GiB"):
        assert _memory.budget(cpu) == 2**30
        with funcgrad.memory_budget(1000):
            assert _memory.budget(cpu) == 1000
        assert _memory.budget(cpu) == 2**30
    monkeypatch.setenv("FUNCGRAD_MEMORY_BUDGET", "512MiB")
    assert _memory.budget(cpu) == 512 * 2**20
    with funcgrad.memory_budget("2KB"):
        assert _memory.budget(cpu) == 2048


def test_bad_budgets_and_chunk_sizes_are_clear_errors(monkeypatch):
    with pytest.raises(ValueError, match=r"memory_budget\(nbytes\) must be a positive number"):
        funcgrad.memory_budget(0).__enter__()
    with pytest.raises(ValueError, match="is not understood; give bytes"):
        funcgrad.memory_budget("lots").__enter__()
    monkeypatch.setenv("FUNCGRAD_MEMORY_BUDGET", "much")
    with pytest.raises(ValueError, match="FUNCGRAD_MEMORY_BUDGET='much' is not understood"):
        _memory.budget(torch.device("cpu"))
    with pytest.raises(ValueError, match="or 'auto' \\(the most that fit the memory budget\\)"):
        funcgrad.compose_heads(torch.sin, [lambda y: y.sum()], chunk_size="some")


def test_a_budget_below_one_direction_warns_and_runs_one_at_a_time():
    f, heads = _small_budget_case()
    fn = funcgrad.compose_heads(f, heads, strategy="vjp", chunk_size="auto")
    with funcgrad.memory_budget(1), pytest.warns(funcgrad.FuncgradWarning, match="one direction"):
        fn(torch.randn(6))
    assert fn.plan(torch.randn(6)).chunk_size == 1
