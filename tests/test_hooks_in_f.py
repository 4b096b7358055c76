"""Backward hooks that f runs, seen by the planner (review of 2026-12-06 evening): a module's
backward hook inside f, and a hook that f runs only at other shapes. Each case against k
calls of ``torch.autograd.grad``, in float64, on every call number (auto changes its plan
on calls 1-3)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import funcgrad
from tests.helpers import autograd_reference


def _per_head_autograd(f, heads, x):
    return torch.stack(autograd_reference(f, heads, (x,))[1])


def _heads(k):
    return [lambda y, i=i: torch.sin(y * (i + 1)).sum() for i in range(k)]


def _clamp(module, grad_input, grad_output):
    return tuple(None if g is None else g.clamp(-0.05, 0.05) for g in grad_input)


def _double(module, grad_input, grad_output):
    return tuple(None if g is None else 2 * g for g in grad_input)


def _double_pre(module, grad_output):
    return tuple(None if g is None else 2 * g for g in grad_output)


@pytest.mark.parametrize("width", [30, 10], ids=["k<m", "k>m"])
@pytest.mark.parametrize(
    "register",
    [
        lambda m: m.register_full_backward_hook(_clamp),
        lambda m: m.register_full_backward_hook(_double),
        lambda m: m.register_full_backward_pre_hook(_double_pre),
    ],
    ids=["clamp", "double", "pre-hook"],
)
def test_a_module_backward_hook_inside_f_gives_autograds_answer_on_every_call(width, register):
    """Found by review: a module's backward hook acts through its own autograd node, which
    the first call's watch (a torch function mode) did not see; auto then planned forward
    mode (no backward hook runs: half the answer for a hook doubling its gradient) or jacrev
    (a clamp's unit directions combined), and switched answers between calls 1 and 2."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(2, width), nn.Tanh()).double()
    register(module[0])
    heads = _heads(12)
    fn = funcgrad.compose_heads(module, heads)
    for _ in range(6):
        x = torch.randn(2, dtype=torch.float64)
        torch.testing.assert_close(fn(x)[1], _per_head_autograd(module, heads, x))
    assert fn.plan(x).strategy in ("vjp", "loop")


def test_a_global_module_backward_hook_is_seen():
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(2, 30), nn.Tanh()).double()
    heads = _heads(12)
    handle = nn.modules.module.register_module_full_backward_hook(_clamp)
    try:
        fn = funcgrad.compose_heads(module, heads)
        for _ in range(4):
            x = torch.randn(2, dtype=torch.float64)
            torch.testing.assert_close(fn(x)[1], _per_head_autograd(module, heads, x))
    finally:
        handle.remove()


# torch.func refuses the hook's node, and warns of its eager fallback first.
@pytest.mark.filterwarnings("ignore::funcgrad.FuncgradWarning")
def test_jacrev_is_refused_for_an_f_that_calls_a_hooked_module():
    module = nn.Sequential(nn.Linear(3, 5), nn.Tanh()).double()
    module[0].register_full_backward_hook(_double)
    fn = funcgrad.compose_heads(module, _heads(2), strategy="jacrev")
    with pytest.raises(ValueError, match=r"module with a backward hook.*strategy='jacrev'"):
        fn(torch.randn(3, dtype=torch.float64))


def test_a_hook_that_f_runs_only_at_new_shapes_is_seen_there():
    """Found by review: a new signature started from the function's facts, without the watch
    of its first call, so a hook f registers only at other shapes was never seen (forward
    mode ran there, 70-180 off)."""
    torch.manual_seed(0)
    weights = {n: torch.randn(8, n, dtype=torch.float64) for n in (2, 3)}

    def f(x):
        h = torch.sin(weights[x.shape[0]] @ x)
        if x.shape[0] == 3 and h.requires_grad:
            h.register_hook(lambda g: g.clamp(-0.05, 0.05))
        return h

    heads = _heads(12)
    fn = funcgrad.compose_heads(f, heads)
    for n in (2, 2, 2, 2, 3, 3, 3, 3):
        x = torch.randn(n, dtype=torch.float64)
        torch.testing.assert_close(fn(x)[1], _per_head_autograd(f, heads, x))


def test_the_watch_sets_no_global_module_hook():
    """A global module hook would make every torch.compile'd module warn ("global hooks on
    modules ... fire an extra time"): on eager autograd the watch reads the graph instead."""
    seen = []

    def f(x):
        seen.append(nn.modules.module._has_any_global_hook())
        return torch.sin(x)

    funcgrad.compose_heads(f, _heads(3))(torch.randn(4, dtype=torch.float64))
    assert seen and not any(seen)


@pytest.mark.parametrize(
    "register",
    [
        lambda m: m.register_full_backward_hook(_double),
        lambda m: m.register_full_backward_pre_hook(_double_pre),
        lambda m: nn.modules.module.register_module_full_backward_hook(_double),
    ],
    ids=["full", "pre-hook", "global"],
)
def test_jacfwd_is_refused_for_an_f_that_calls_a_hooked_module(register):
    """Found by review (core5 F1): forward mode builds no graph, so the hook's node that the
    watch reads was never there: an explicit strategy='jacfwd' ran no hook, silently, on
    every call (1.37 off). The watch of a call under torch.func now sees the module called."""
    torch.manual_seed(0)
    module = nn.Linear(4, 6).double()
    handle = register(module)
    try:
        fn = funcgrad.compose_heads(lambda x: torch.tanh(module(x)), _heads(4), strategy="jacfwd")
        for _ in range(2):
            with pytest.raises(ValueError, match=r"module with a backward hook.*'jacfwd'"):
                fn(torch.randn(4, dtype=torch.float64))
        auto = funcgrad.compose_heads(lambda x: torch.tanh(module(x)), _heads(4))
        x = torch.randn(4, dtype=torch.float64)
        reference = _per_head_autograd(lambda x: torch.tanh(module(x)), _heads(4), x)
        torch.testing.assert_close(auto(x)[1], reference)
    finally:
        handle.remove()


def test_jacfwd_runs_where_the_hooked_module_takes_no_differentiated_input():
    """The forward-mode watch flags only a hooked module called on what is differentiated:
    one applied to a constant runs no hook on x's gradient, and jacfwd gives autograd's
    answer."""
    torch.manual_seed(0)
    module = nn.Linear(4, 4).double()
    module.register_full_backward_hook(_double)
    const = torch.randn(4, dtype=torch.float64)

    def f(x):
        return torch.tanh(x * module(const))

    heads = _heads(3)
    fn = funcgrad.compose_heads(f, heads, strategy="jacfwd")
    x = torch.randn(4, dtype=torch.float64)
    torch.testing.assert_close(fn(x)[1], _per_head_autograd(f, heads, x))
    assert fn.plan(x).strategy == "jacfwd"
