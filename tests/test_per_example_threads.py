"""Threads sharing one `funcgrad.per_example(model)`: each thread's forwards and calls are its
own (the records, the recording flag, the shared-index state), a generic-rule module's
functional calls change nothing that another thread sees (its forward, its call, its reads of
the model), and `.grad` is written by one call at a time. Against the per-example autograd
loop, in float64."""

from __future__ import annotations

import copy
import sys
import threading
import time

import pytest
import torch
from torch import nn

import funcgrad
from tests.helpers import per_example_jacobian

ROUNDS = 20


pytestmark = pytest.mark.usefixtures("float64_default")


class Scale(nn.Module):
    """A module with its own forward: the generic rule (its parameters swapped for vmap)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.randn(width))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h * self.s + h.sin() * self.s.cos()


def _run_threads(work, count=2):
    errors: list[BaseException] = []
    barrier = threading.Barrier(count)

    def target(i):
        try:
            work(i, barrier)
        except BaseException as error:  # reported in the main thread
            errors.append(error)
            barrier.abort()

    threads = [threading.Thread(target=target, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def _losses(model, x):
    return model(x).pow(2).squeeze(1)


@pytest.mark.parametrize("generic", [False, True])
def test_two_threads_with_different_batches_get_their_own_gramian(generic):
    """The recording flag and the records were the PerExample's: a call in one thread
    switched recording off during another thread's forward (a crash naming a parameter
    'outside the forward', or a silently wrong G), and consumed its records."""
    torch.manual_seed(0)
    middle = Scale(16) if generic else nn.Identity()
    model = nn.Sequential(
        nn.Linear(5, 16), middle, nn.Tanh(), nn.Sequential(nn.Linear(16, 16), nn.Tanh()),
        nn.Linear(16, 1),
    )  # fmt: skip
    xs = [torch.randn(6, 5), torch.randn(9, 5)]
    refs = []
    for x in xs:
        jac = per_example_jacobian(model, lambda m, x=x: _losses(m, x))
        refs.append(jac @ jac.T)
    results: list[list[torch.Tensor]] = [[], []]
    with funcgrad.per_example(model) as pe:

        def work(i, barrier):
            for _ in range(ROUNDS):
                barrier.wait()
                results[i].append(pe.gramian(_losses(model, xs[i]), check=False))

        _run_threads(work)
    for i in range(2):
        assert len(results[i]) == ROUNDS
        for gram in results[i]:
            torch.testing.assert_close(gram, refs[i], rtol=1e-10, atol=1e-12)
    assert all(p.grad is None for p in model.parameters())


def test_two_threads_accumulate_every_update_into_grad():
    """Each call's update lands in .grad, none lost to the other thread's write."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    xs = [torch.randn(5, 4), torch.randn(7, 4)]
    params = list(model.parameters())
    expected = (
        sum(per_example_jacobian(model, lambda m, x=x: _losses(m, x)).sum(0) for x in xs) * ROUNDS
    )
    with funcgrad.per_example(model) as pe:

        def work(i, barrier):
            for _ in range(ROUNDS):
                barrier.wait()
                pe.backward(_losses(model, xs[i]))
                funcgrad.per_example_clip(_losses(model, xs[i]), 1e9)  # factors 1: the sum

        _run_threads(work)
    found = torch.cat([p.grad.flatten() for p in params])
    torch.testing.assert_close(found, 2 * expected, rtol=1e-10, atol=1e-10)


def test_calls_in_two_threads_never_interleave_a_generic_modules_parameter_swap():
    """A call swapped a generic-rule module's parameters for its functional calls (vmap) and
    put them back after; two calls at once interleaved the swaps, and one put the other's
    transform tensors back as the parameters (every later G wrong: 0.43 off here). Without a
    barrier, the threads' calls overlap at every phase."""
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(5, 16), Scale(16), nn.Tanh(), nn.Linear(16, 1))
    xs = [torch.randn(6, 5), torch.randn(9, 5)]
    refs = []
    for x in xs:
        jac = per_example_jacobian(model, lambda m, x=x: _losses(m, x))
        refs.append(jac @ jac.T)
    found: list[list[torch.Tensor]] = [[], []]
    with funcgrad.per_example(model) as pe:

        def work(i, barrier):
            for _ in range(3 * ROUNDS):
                found[i].append(pe.gramian(_losses(model, xs[i]), check=False))

        _run_threads(work)
    for i in range(2):
        for gram in found[i]:
            torch.testing.assert_close(gram, refs[i], rtol=1e-10, atol=1e-12)
    assert all(isinstance(p, nn.Parameter) for p in model.parameters())


def test_a_call_in_another_thread_than_the_forward_is_refused_clearly():
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    x = torch.randn(4, 3)
    errors: list[BaseException] = []
    with funcgrad.per_example(model) as pe:
        losses = _losses(model, x)

        def other():
            for call in (pe.gramian, funcgrad.per_example_norms):
                try:
                    call(losses)
                except ValueError as error:
                    errors.append(error)

        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
        assert len(errors) == 2
        for error in errors:
            assert "ran in another thread" in str(error)
        # the records are still there for the forward's own thread
        jac = per_example_jacobian(model, lambda m: _losses(m, x))
        torch.testing.assert_close(pe.gramian(losses), jac @ jac.T, rtol=1e-10, atol=1e-12)


def test_a_hooked_model_can_be_deep_copied():
    """copy.deepcopy of a hooked model copies its hooks and so the PerExample: its
    per-thread state and lock are made anew (they cannot be copied)."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    with funcgrad.per_example(model):
        clone = copy.deepcopy(model)
    x = torch.randn(3, 3)
    jac = per_example_jacobian(clone, lambda m: _losses(m, x))
    with funcgrad.per_example(clone) as pe:
        torch.testing.assert_close(pe.gramian(_losses(clone, x)), jac @ jac.T)


def _clipped_sum(model, losses_fn, max_norm):
    """Σ_b min(1, C / (‖g_b‖ + 1e-6)) g_b from the per-example autograd loop, flattened."""
    jac = per_example_jacobian(model, losses_fn)
    return (max_norm / (jac.norm(dim=1) + 1e-6)).clamp(max=1.0) @ jac


def test_a_post_accumulate_hook_may_call_per_example_clip_on_another_model():
    """The hooks ran under the lock that serialises .grad writes: a hook calling
    per_example_clip (on another model) waited on it forever. Run in a thread, so that a
    hang fails the test instead of stalling the suite."""
    torch.manual_seed(3)
    first, second = nn.Linear(6, 2), nn.Linear(6, 2)
    x = torch.randn(5, 6)

    def losses_of(m):
        return m(x).pow(2).sum(-1)

    want = [_clipped_sum(m, losses_of, 1.0) for m in (first, second)]
    fired: list[int] = []

    def hook(param):
        if not fired:
            fired.append(1)
            with funcgrad.per_example(second):
                funcgrad.per_example_clip(losses_of(second), 1.0)

    first.weight.register_post_accumulate_grad_hook(hook)
    errors: list[BaseException] = []

    def run():
        try:
            with funcgrad.per_example(first):
                funcgrad.per_example_clip(losses_of(first), 1.0)
        except BaseException as error:  # reported in the main thread
            errors.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "per_example_clip hung: a hook ran under the .grad lock"
    if errors:
        raise errors[0]
    assert fired == [1]
    for model, expected in zip((first, second), want):
        found = torch.cat([p.grad.flatten() for p in model.parameters()])
        torch.testing.assert_close(found, expected, rtol=1e-10, atol=1e-12)


class _Expert(nn.Module):
    """A generic-rule module (its own forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 6) / 3)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(h @ self.w)


class _Ensemble(nn.Module):
    """Experts run in worker threads of a pool (an ensemble / mixture of experts), the
    parent waiting on them; with a gate of its own (a generic-rule parent) or not."""

    def __init__(self, pool, experts, gate: bool) -> None:
        super().__init__()
        self.pool, self.experts = pool, nn.ModuleList(experts)
        self.gate = nn.Parameter(torch.tensor([0.7, 1.3])) if gate else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        outs = [f.result() for f in [self.pool.submit(e, h) for e in self.experts]]
        if self.gate is None:
            return torch.tanh(outs[0]) + torch.tanh(outs[1])
        return self.gate[0] * outs[0] + self.gate[1] * outs[1]


@pytest.mark.parametrize("generic", [False, True])
def test_submodules_run_in_worker_threads_belong_to_the_forward(generic):
    """generic: the parent's forward held the one swap lock while waiting on the workers,
    whose experts' pre-hooks waited on it: the forward hung. Not generic (plain Linear
    experts, a parent without parameters): the experts' records went to the workers'
    threads, and the call refused 'the forward of these losses ran in another thread'."""
    from concurrent.futures import ThreadPoolExecutor

    torch.manual_seed(4)
    pool = ThreadPoolExecutor(2)
    experts = [_Expert(), _Expert()] if generic else [nn.Linear(6, 6), nn.Linear(6, 6)]
    model = nn.Sequential(nn.Linear(6, 6), _Ensemble(pool, experts, generic), nn.Linear(6, 1))
    x = torch.randn(5, 6)
    jac = per_example_jacobian(model, lambda m: _losses(m, x))
    found: dict[str, torch.Tensor] = {}
    errors: list[BaseException] = []

    def run():
        try:
            with funcgrad.per_example(model) as pe:
                found["G"] = pe.gramian(_losses(model, x))
                found["norms"] = funcgrad.per_example_norms(_losses(model, x))
        except BaseException as error:  # reported in the main thread
            errors.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "the forward or the call hung on the swap lock"
    pool.shutdown()
    if errors:
        raise errors[0]
    torch.testing.assert_close(found["G"], jac @ jac.T, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(found["norms"], jac.norm(dim=1), rtol=1e-10, atol=1e-12)


def test_a_call_after_the_forwards_thread_ended_says_so():
    """The records are the thread's own and end with it: the call said 'no
    funcgrad.per_example hooks recorded the forward', which they had."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    x = torch.randn(4, 3)
    found: dict[str, torch.Tensor] = {}
    with funcgrad.per_example(model) as pe:
        thread = threading.Thread(target=lambda: found.setdefault("losses", _losses(model, x)))
        thread.start()
        thread.join()
        del thread
        for call in (pe.gramian, funcgrad.per_example_norms):
            with pytest.raises(ValueError, match="the thread that ran their forward has ended"):
                call(found["losses"])
        jac = per_example_jacobian(model, lambda m: _losses(m, x))  # this thread: as before
        torch.testing.assert_close(pe.gramian(_losses(model, x)), jac @ jac.T)


def test_the_hooks_of_a_deep_copy_record_nothing_and_a_call_on_its_losses_says_so():
    """A copy's hooks recorded every forward into a PerExample that no call could find (not
    among the live ones): its records piled up, and a call said 'no funcgrad.per_example
    hooks recorded the forward'."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    x = torch.randn(4, 3)
    with funcgrad.per_example(model):
        clone = copy.deepcopy(model)
        copied = next(
            h.__self__ for h in clone[0]._forward_hooks.values() if hasattr(h, "__self__")
        )
        for _ in range(3):
            losses = _losses(clone, x)
        assert copied._uses == []
        for call in (funcgrad.per_example_gramian, funcgrad.per_example_norms):
            with pytest.raises(ValueError, match=r"a copy of a hooked model.*per_example\(copy\)"):
                call(losses)


@pytest.fixture
def fine_switching():
    """Python switches threads every microsecond for the test (5 ms by default), so that
    two threads' calls interleave at many more points; restored after."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


STRESS = 150  # calls per thread


class _Waits(Scale):
    """A generic-rule module whose forward lets other threads run a while (as one that
    logs, or waits on I/O): the other thread often runs while a call's functional calls of
    it are in progress."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        time.sleep(2e-4)
        return super().forward(h)


class _Gated(nn.Module):
    """A generic-rule parent (a parameter of its own) with a Linear child: the child's
    calls are recorded on their own, nested in the parent's."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.inner = nn.Linear(width, width)
        self.g = nn.Parameter(torch.randn(width))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.g) * self.inner(h).tanh() + h


@pytest.mark.usefixtures("fine_switching")
def test_two_threads_sharing_generic_rule_modules_get_exact_gramians_under_stress():
    """A call swapped a generic-rule module's parameters in the shared model for its
    functional calls (vmap, the independence check's float64 rerun): the other thread's
    call, listing the model's parameters meanwhile, took the swapped tensors for them and
    left that module out of G (or refused it as reading a foreign parameter). 0.4% to 130%
    off, 1 run in 15-20 of the older two-thread tests; this one failed 10 runs in 10 on the
    old code. Each thread its own batch, every G and every norm checked."""
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(5, 8), _Waits(8), nn.Tanh(), _Gated(8), nn.Linear(8, 1))
    xs = [torch.randn(6, 5), torch.randn(9, 5)]
    refs = []
    for x in xs:
        jac = per_example_jacobian(model, lambda m, x=x: _losses(m, x))
        refs.append(jac @ jac.T)
    wrong: list[tuple[int, int, float]] = []
    with funcgrad.per_example(model) as pe:

        def work(i, barrier):
            barrier.wait()
            for k in range(STRESS):
                check = None if k % 10 == 0 else False  # the float64 rerun swaps too
                if k % 3 == 2:
                    found = funcgrad.per_example_norms(_losses(model, xs[i]))
                    want = refs[i].diagonal().sqrt()
                else:
                    found = pe.gramian(_losses(model, xs[i]), check=check)
                    want = refs[i]
                if not torch.allclose(found, want, rtol=1e-10, atol=1e-12):
                    wrong.append((i, k, float((found - want).abs().max() / want.abs().max())))

        _run_threads(work)
    assert wrong == []
    assert all(isinstance(p, nn.Parameter) for p in model.parameters())
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.usefixtures("fine_switching")
def test_another_thread_reading_the_model_never_sees_a_generic_modules_parameters_swapped():
    """While one thread takes per-example Gramians, another reads the model (a checkpoint's
    named_parameters / state_dict, a plain forward and backward): that thread got the
    swapped tensors for a generic-rule module's parameters whenever a call's functional
    calls were in progress."""
    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(5, 8), _Waits(8), nn.Tanh(), nn.Linear(8, 1))
    x, y = torch.randn(7, 5), torch.randn(4, 5)
    jac = per_example_jacobian(model, lambda m: _losses(m, x))
    originals = dict(model.named_parameters())
    plain = torch.autograd.grad(model(y).sum(), list(originals.values()))
    wrong: list[str] = []
    done = threading.Event()
    with funcgrad.per_example(model) as pe:

        def work(i, barrier):
            barrier.wait()
            if i == 0:
                try:
                    for k in range(STRESS // 3):
                        gram = pe.gramian(_losses(model, x), check=False)
                        if not torch.allclose(gram, jac @ jac.T, rtol=1e-10, atol=1e-12):
                            wrong.append(f"G at call {k}")
                finally:
                    done.set()
                return
            k = 0
            while not done.is_set():
                k += 1
                named = dict(model.named_parameters())
                if any(named[n] is not p for n, p in originals.items()):
                    wrong.append(f"a swapped parameter seen at read {k}")
                if k % 50 == 0:
                    grads = torch.autograd.grad(model(y).sum(), list(originals.values()))
                    if not all(
                        torch.allclose(g, w, rtol=1e-10, atol=1e-12) for g, w in zip(grads, plain)
                    ):
                        wrong.append(f"plain gradients at read {k}")

        _run_threads(work)
    assert wrong == []


class _Listed(nn.Module):
    """A generic-rule module that reaches its child through a plain list too (not a
    registered attribute), so a copy of its module tree still reads the child's own
    parameter there."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.listed = [self.inner]
        self.s = nn.Parameter(torch.randn(4))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        # inner's weight read directly (not by a call of inner): the generic rule's
        return h * self.s + h @ self.listed[0].weight.T


def test_a_module_reaching_its_parameter_outside_its_attributes_is_still_exact():
    """The generic rule's functional calls run on a private copy of the module's tree;
    a forward that reaches a parameter through a plain list reads the original there, whose
    use the copy's swap does not see (without a check: inner.weight's share left out of
    G). Seen, and the rule takes its plain-autograd loop."""
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(3, 4), _Listed(), nn.Tanh(), nn.Linear(4, 1))
    x = torch.randn(6, 3)
    jac = per_example_jacobian(model, lambda m: _losses(m, x))
    with funcgrad.per_example(model) as pe:
        torch.testing.assert_close(pe.gramian(_losses(model, x)), jac @ jac.T)
        assert any("loop" in layer.rule for layer in pe.plan.layers if layer.kind == "_Listed")
        torch.testing.assert_close(funcgrad.per_example_norms(_losses(model, x)), jac.norm(dim=1))
