"""Never a silently wrong answer: check mode, automatic fallbacks, NaN/inf, memory."""

from __future__ import annotations

import copy
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


# -- f's side effects: as in one eager forward per call, or counted by plan() -------------------

SIDE_W = torch.randn(2, 5, dtype=torch.float64)
SIDE_HEADS = [lambda y, i=i: (y * (i + 1)).sin().sum() + y[i % 5] for i in range(16)]  # 2 n < k


class _Square(torch.autograd.Function):
    """No jvp: forward mode cannot differentiate it, reverse mode can."""

    @staticmethod
    def forward(x):
        return x * x

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 2 * x * grad


@pytest.mark.parametrize("check", [False, True])
@pytest.mark.parametrize("strategy", ["auto", "vjp", "jacrev", "jacfwd", "loop"])
def test_f_python_body_runs_as_often_as_plan_says(strategy, check):
    runs = []

    def f(x):  # n = 2, m = 5, k = 16: forward mode is a candidate under auto
        runs.append(1)
        return torch.tanh(x @ SIDE_W)

    x = torch.randn(2, dtype=torch.float64)
    fn = funcgrad.compose_heads(f, SIDE_HEADS, strategy=strategy, check=check)
    for call in range(3):
        plan = fn.plan(x)
        runs.clear()
        fn(x)
        assert len(runs) == plan.f_runs, (call, plan)
    timed = fn.plan(x).measured  # auto: the first call timed forward against reverse mode
    assert strategy != "auto" or timed is None or timed.startswith("reverse mode")
    if strategy == "jacfwd" and check:  # check's unbatched JVP calls at columns 0 and 1
        assert plan.f_runs == 3 and "f's Python body runs 3 times" in repr(plan)

    # Without plan(), the first call on new shapes where forward mode is a candidate also
    # runs f on fake tensors once (for y's size), as the README says.
    fresh = funcgrad.compose_heads(f, SIDE_HEADS, strategy=strategy, check=check)
    counts = []
    for _ in range(3):
        runs.clear()
        fresh(x)
        counts.append(len(runs))
    later = fresh.plan(x)  # after the first call
    assert counts[1:] == [later.f_runs, later.f_runs]
    expected = 1 + 2 * (strategy == "jacfwd" and check)
    # auto: on fake tensors, forward mode (and check's two JVP calls), reverse mode.
    assert counts[0] == (3 + 2 * check if strategy == "auto" else expected)


def _batchnorm_model():
    torch.manual_seed(3)
    return torch.nn.Sequential(
        torch.nn.Linear(3, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 20)
    ).double()


@pytest.mark.parametrize("strategy", ["auto", "vjp", "jacrev", "jacfwd", "loop"])
def test_buffers_are_updated_once_per_call(strategy):
    model, once = _batchnorm_model(), _batchnorm_model()
    heads = [lambda y, i=i: (y * (i + 1)).sin().sum() for i in range(16)]  # n = 6, m = 40
    fn = funcgrad.compose_heads(model, heads, strategy=strategy)
    x = torch.randn(2, 3, dtype=torch.float64)
    for _ in range(3):
        reference = copy.deepcopy(once)  # (its statistics move once per head)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", funcgrad.FuncgradWarning)  # the eager fallback's
            values, grads = fn(x)
        once(x)  # one eager forward per call
        want_values, want_grads = autograd_reference(reference, heads, (x,))
        torch.testing.assert_close(values, torch.stack(want_values))
        torch.testing.assert_close(grads, torch.stack(want_grads))
        assert int(model[1].num_batches_tracked) == int(once[1].num_batches_tracked)
        torch.testing.assert_close(model[1].running_mean, once[1].running_mean)
        torch.testing.assert_close(model[1].running_var, once[1].running_var)


def _generator_f(generator, *, batchnorm=None, no_jvp=False):
    def f(x):
        y = torch.tanh(x @ SIDE_W)
        mask = torch.rand(y.shape, generator=generator, dtype=y.dtype) > 0.5
        y = y * mask + torch.randn(y.shape, generator=generator, dtype=y.dtype)
        if no_jvp:  # after the draws: a failed forward-mode attempt has drawn
            y = _Square.apply(y)
        return y if batchnorm is None else batchnorm(y[None].expand(2, 5) * x.sum())[0]

    return f


def _eager_reference(f, heads, x, generator, seed):
    """Values, per-head gradients and the generator's final state of one eager forward."""
    generator.manual_seed(seed)
    xr = x.clone().requires_grad_()
    y = f(xr)
    state = generator.get_state()
    values = torch.stack([head(y) for head in heads]).detach()
    grads = torch.stack([torch.autograd.grad(head(y), xr, retain_graph=True)[0] for head in heads])
    return values, grads, state


@pytest.mark.parametrize("case", ["plain", "check", "eager fallback", "forward-mode fallback"])
@pytest.mark.parametrize("strategy", ["auto", "vjp", "jacrev", "jacfwd", "loop"])
def test_a_user_generator_draws_as_in_one_eager_forward(strategy, case):
    generator = torch.Generator().manual_seed(0)
    reference_generator = torch.Generator()
    kwargs = {"batchnorm": None, "no_jvp": case == "forward-mode fallback"}
    if case == "eager fallback":  # BatchNorm in training mode: torch.func refuses, eager runs
        kwargs["batchnorm"] = torch.nn.BatchNorm1d(5).double()
    f = _generator_f(generator, **kwargs)
    reference_kwargs = dict(
        kwargs, batchnorm=kwargs["batchnorm"] and copy.deepcopy(kwargs["batchnorm"])
    )
    reference_f = _generator_f(reference_generator, **reference_kwargs)
    fn = funcgrad.compose_heads(f, SIDE_HEADS, strategy=strategy, check=case == "check")
    x = torch.randn(2, dtype=torch.float64)
    for seed in range(3):  # the first call (auto: both modes, timed), then planned calls
        generator.manual_seed(seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", funcgrad.FuncgradWarning)  # the fallbacks'
            values, grads = fn(x)
        want_values, want_grads, want_state = _eager_reference(
            reference_f, SIDE_HEADS, x, reference_generator, seed
        )
        torch.testing.assert_close(values, want_values)
        torch.testing.assert_close(grads, want_grads)
        assert torch.equal(generator.get_state(), want_state)


def test_plan_leaves_a_user_generator_alone():
    generator = torch.Generator().manual_seed(0)

    def data_dependent(t):  # y's size depends on values: plan() runs one real forward
        y = t[: int(t.abs().sum() > 0) + 1].sin()
        return y * torch.rand(y.shape, generator=generator)

    fn = funcgrad.compose_heads(data_dependent, [lambda y: y.sum()] * 9)
    state = generator.get_state()
    assert fn.plan(torch.randn(4)).m == 2
    assert torch.equal(generator.get_state(), state)


@pytest.mark.parametrize("level", ["features", "params"])
def test_a_user_generator_in_the_eager_fallbacks_of_combine_heads_and_pullback(level):
    generator, reference_generator = torch.Generator(), torch.Generator()
    batchnorm = torch.nn.BatchNorm1d(5).double()
    f = _generator_f(generator, batchnorm=batchnorm)
    reference_f = _generator_f(reference_generator, batchnorm=copy.deepcopy(batchnorm))
    x = torch.randn(2, dtype=torch.float64)
    generator.manual_seed(4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", funcgrad.FuncgradWarning)
        values, grad, _ = funcgrad.combine_heads(f, SIDE_HEADS, level=level)(x)
    want_values, want_grads, want_state = _eager_reference(
        reference_f, SIDE_HEADS, x, reference_generator, 4
    )
    torch.testing.assert_close(values, want_values)
    torch.testing.assert_close(grad, want_grads.sum(0))
    assert torch.equal(generator.get_state(), want_state)

    generator.manual_seed(5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", funcgrad.FuncgradWarning)
        out, pb = funcgrad.pullback(f, x)
    state = generator.get_state()
    reference_generator.manual_seed(5)
    xr = x.clone().requires_grad_()
    y = reference_f(xr)
    assert torch.equal(state, reference_generator.get_state())
    torch.testing.assert_close(out, y.detach())
    cotangent = torch.randn(5, dtype=torch.float64)
    torch.testing.assert_close(pb(cotangent)[0], torch.autograd.grad(y, xr, cotangent)[0])


def test_f_is_watched_for_generators_only_where_it_drew_from_one():
    modes = []

    def f(x):
        modes.append(len(torch.overrides._get_current_function_mode_stack()))
        return torch.tanh(x @ SIDE_W)

    fn = funcgrad.compose_heads(f, SIDE_HEADS, strategy="vjp")
    x = torch.randn(2, dtype=torch.float64)
    fn(x)
    fn(x)
    assert modes == [1, 0]  # the first call on these shapes watched; the next one need not
    modes.clear()
    combined = funcgrad.combine_heads(f, SIDE_HEADS, level="features")
    combined(x)
    combined(x)
    assert modes == [1, 0]
