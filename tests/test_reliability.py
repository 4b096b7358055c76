"""Never a silently wrong answer: check mode, automatic fallbacks, NaN/inf, memory."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import torch
from helpers import autograd_reference

import funcgrad

POINTS = torch.randn(4, 3)


def cdist_f(x):
    return torch.cdist(x, POINTS)  # (5, 4): vmap over its backward is wrong in torch 2.13


CDIST_HEADS = [
    lambda y, i=i: (y * torch.linspace(-1, 1, 20).reshape(5, 4) ** i).sum() for i in range(6)
]


def _max_error(strategy, **kwargs):
    x = torch.randn(5, 3)
    _, grads = funcgrad.compose_heads(cdist_f, CDIST_HEADS, strategy=strategy, **kwargs)(x)
    _, reference = autograd_reference(cdist_f, CDIST_HEADS, (x,))
    return (grads - torch.stack(reference)).abs().max().item()


def test_the_cdist_bug_is_real_without_check():
    """If torch fixes its batching rule this test fails, and check becomes a safety net only."""
    assert _max_error("vjp") > 1e-3


@pytest.mark.parametrize("strategy", ["vjp", "jacrev"])
def test_check_catches_cdist_and_falls_back_to_the_loop(strategy):
    with pytest.warns(
        funcgrad.FuncgradWarning, match=r"check found that vmap computed f's pullback wrongly"
    ):
        error = _max_error(strategy, check=True)
    assert error < 1e-10


def test_check_strict_raises():
    with pytest.raises(
        funcgrad.BatchingMismatchError, match=r"vmap computed f's pullback wrongly.*strategy='loop'"
    ):
        _max_error("vjp", check="strict")


def test_check_from_set_check_and_environment(monkeypatch):
    funcgrad.set_check(True)
    with pytest.warns(funcgrad.FuncgradWarning, match="check found"):
        assert _max_error("vjp") < 1e-10
    funcgrad.set_check(None)
    monkeypatch.setenv("FUNCGRAD_CHECK", "strict")
    with pytest.raises(funcgrad.BatchingMismatchError):
        _max_error("vjp")


def test_pb_many_check_catches_cdist():
    x = torch.randn(5, 3)
    _, pb = funcgrad.pullback(cdist_f, x, reuse=False)
    cotangents = torch.randn(6, 5, 4)
    with pytest.warns(funcgrad.FuncgradWarning, match="check found"):
        (got,) = pb.many(cotangents, check=True)
    for i in range(6):
        torch.testing.assert_close(got[i], pb(cotangents[i])[0])


def test_check_is_skipped_inside_transforms():
    """check compares values, so it runs in eager mode only; vmap over x must still work."""
    w = torch.randn(4, 3)
    composed = funcgrad.compose_heads(
        lambda x: torch.tanh(w @ x), CDIST_HEADS[:1] * 3, strategy="vjp", check="strict"
    )
    xs = torch.randn(5, 3)
    _, grads = torch.func.vmap(composed)(xs)
    for i in range(5):
        torch.testing.assert_close(grads[i], composed(xs[i])[1])


def test_check_passes_silently_on_a_correct_batch():
    w = torch.randn(4, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        funcgrad.compose_heads(
            lambda x: torch.tanh(w @ x), CDIST_HEADS[:1] * 3, strategy="vjp", check=True
        )(torch.randn(3))


class NumpySin(torch.autograd.Function):
    """Its backward leaves PyTorch: vmap cannot batch it."""

    @staticmethod
    def forward(x):
        return torch.from_numpy(np.sin(x.detach().numpy()))

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return torch.from_numpy(grad.detach().numpy() * np.cos(x.detach().numpy()))


class OldStyleSin(torch.autograd.Function):
    """No setup_context: torch.func cannot differentiate it at all, autograd can."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.sin()

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * x.cos()


HEADS = [lambda y: y.sum(), lambda y: (y**2).sum(), lambda y: y[0] * y[-1]]


@pytest.mark.parametrize("strategy", ["auto", "vjp", "jacrev"])
def test_vmap_failure_falls_back_to_the_loop(strategy):
    f = lambda x: NumpySin.apply(x) * 2  # noqa: E731
    x = torch.randn(3)
    with pytest.warns(
        funcgrad.FuncgradWarning, match=r"vmap could not batch f's pullback .*fell back to a loop"
    ):
        _, grads = funcgrad.compose_heads(f, HEADS, strategy=strategy)(x)
    _, reference = autograd_reference(f, HEADS, (x,))
    torch.testing.assert_close(grads, torch.stack(reference))


def test_loop_strategy_needs_no_vmap():
    f = lambda x: NumpySin.apply(x) * 2  # noqa: E731
    x = torch.randn(3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, grads = funcgrad.compose_heads(f, HEADS, strategy="loop")(x)
    torch.testing.assert_close(grads, torch.stack(autograd_reference(f, HEADS, (x,))[1]))


@pytest.mark.parametrize("strategy", ["auto", "vjp", "jacrev", "jacfwd", "loop"])
def test_torch_func_failure_falls_back_to_eager_autograd(strategy):
    f = lambda x: OldStyleSin.apply(x) * 2  # noqa: E731
    x = torch.randn(3)
    with pytest.warns(
        funcgrad.FuncgradWarning,
        match=r"torch.func cannot differentiate f .*eager torch.autograd.grad",
    ):
        _, grads = funcgrad.compose_heads(f, HEADS, strategy=strategy)(x)
    torch.testing.assert_close(grads, torch.stack(autograd_reference(f, HEADS, (x,))[1]))
    with pytest.warns(funcgrad.FuncgradWarning, match="torch.func cannot differentiate f"):
        _, pb = funcgrad.pullback(f, x)
    torch.testing.assert_close(pb(torch.ones(3))[0], 2 * torch.cos(x))


def test_chunked_linear_cross_entropy_falls_back_to_autograd():
    weight, target = torch.randn(7, 5), torch.randint(0, 7, (6,))
    options = torch.nn.LinearCrossEntropyOptions()

    def f(x):
        return torch.nn.functional.linear_cross_entropy(
            x, weight, target, options=options, reduction="none"
        )

    def reference_f(x):
        return torch.nn.functional.linear_cross_entropy(x, weight, target, reduction="none")

    x = torch.randn(6, 5)
    with pytest.warns(funcgrad.FuncgradWarning, match="torch.func cannot differentiate f"):
        _, grads = funcgrad.compose_heads(f, HEADS)(x)
    torch.testing.assert_close(grads, torch.stack(autograd_reference(reference_f, HEADS, (x,))[1]))


@pytest.mark.parametrize("strategy", ["vjp", "jacrev", "jacfwd", "loop"])
def test_nan_and_inf_propagate_as_in_autograd(strategy):
    def f(x):
        return torch.stack([torch.log(x[0]), x[1] * x[2], torch.sqrt(x[2])])

    heads = [lambda y: y[0] + y[1], lambda y: y[1] * 2, lambda y: y.sum()]
    for x in [torch.tensor([-1.0, 2.0, 3.0]), torch.tensor([1.0, float("inf"), 0.0])]:
        values, grads = funcgrad.compose_heads(f, heads, strategy=strategy)(x)
        ref_values, ref_grads = autograd_reference(f, heads, (x,))
        torch.testing.assert_close(values, torch.stack(ref_values), equal_nan=True)
        torch.testing.assert_close(grads, torch.stack(ref_grads), equal_nan=True)


def test_nan_cotangent_in_pullback_propagates():
    w = torch.randn(3, 3)
    _, pb = funcgrad.pullback(lambda x: w @ x, torch.randn(3))
    pb(torch.ones(3))
    got = pb(torch.tensor([float("nan"), 1.0, 0.0]))[0]
    expected = torch.tensor([float("nan"), 1.0, 0.0]) @ w
    torch.testing.assert_close(got, expected, equal_nan=True)


def _live_tensors():
    gc.collect()
    return sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor))


@pytest.mark.slow  # thousands of calls
def test_no_growth_over_many_calls():
    w = torch.randn(8, 4)
    f = lambda x: torch.tanh(w @ x)  # noqa: E731
    composed = funcgrad.compose_heads(f, HEADS)
    x = torch.randn(4)
    for _ in range(50):
        composed(x)
        funcgrad.pullback(f, x)[1].many(torch.randn(3, 8))
    before = _live_tensors()
    for _ in range(2000):
        composed(x)
        _, pb = funcgrad.pullback(f, x)
        pb.many(torch.randn(3, 8))
        pb(torch.randn(8))
    del pb
    assert _live_tensors() <= before + 5


_PEAK_SCRIPT = textwrap.dedent(
    """
    import sys, torch, funcgrad
    torch.manual_seed(0)
    chunk = None if sys.argv[1] == "None" else int(sys.argv[1])
    w1, w2 = torch.randn(20000, 8), torch.randn(400, 20000) / 100
    f = lambda x: w2 @ torch.tanh(w1 @ x)
    stacked = funcgrad.stacked_heads(lambda w, y: (w * y).sum(), torch.randn(2000, 400))
    composed = funcgrad.compose_heads(f, stacked, strategy="vjp", chunk_size=chunk)
    x = torch.randn(8)
    warm_up = funcgrad.stacked_heads(lambda w, y: (w * y).sum(), torch.randn(2, 400))
    funcgrad.compose_heads(f, warm_up, strategy="vjp")(x)  # first-call allocations
    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1])
    base = status("VmRSS:")
    open("/proc/self/clear_refs", "w").write("5")  # reset the high-water mark (VmHWM)
    composed(x)
    print(status("VmHWM:") - base)
    """
)


def _peak_kib(chunk_size):
    # A fixed mmap threshold keeps glibc from growing its heap with fragmentation, so that the
    # RSS high-water mark follows the live tensors rather than the allocator's history.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    result = subprocess.run(
        [sys.executable, "-c", _PEAK_SCRIPT, str(chunk_size)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return int(result.stdout.strip())


@pytest.mark.slow  # subprocesses, 2000 cotangents through a wide layer
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="Linux only")
def test_chunk_size_bounds_peak_memory():
    """2000 cotangents through a 20000-wide layer: 160 MB per batched intermediate at once."""
    unchunked, chunked = _peak_kib(None), _peak_kib(20)
    assert chunked < unchunked / 4, (chunked, unchunked)


def test_checking_block_overrides_and_restores():
    with funcgrad.checking("strict"):
        with pytest.raises(funcgrad.BatchingMismatchError):
            _max_error("vjp")
        with funcgrad.checking(False):
            assert _max_error("vjp") > 1e-3  # the inner block turns check off
        with pytest.warns(funcgrad.FuncgradWarning, match="check found"):
            assert _max_error("vjp", check=True) < 1e-10  # the argument wins over the block
    assert _max_error("vjp") > 1e-3  # restored: off by default
    with (
        pytest.raises(ValueError, match=r"funcgrad.checking\(mode\).*'strict'"),
        funcgrad.checking("yes"),
    ):
        pass


def test_checking_is_per_thread():
    """Another thread does not see a block's mode (set_check would be process-wide)."""
    import threading

    seen = {}
    inside, release = threading.Event(), threading.Event()

    def worker():
        inside.wait()
        seen["error"] = _max_error("vjp")  # off: the main thread's block is not ours
        release.set()

    thread = threading.Thread(target=worker)
    thread.start()
    with funcgrad.checking("strict"):
        inside.set()
        release.wait(timeout=60)
    thread.join()
    assert seen["error"] > 1e-3
