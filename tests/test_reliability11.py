"""Session 11's reliability hunt: changes between calls that a settled (steady) plan must
not replay past. Each case against ``torch.autograd.grad`` per head (or per cotangent), in
float64, on the calls after the change."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import funcgrad
from tests.helpers import autograd_reference

D = torch.float64


def _per_head_autograd(f, heads, x):
    return torch.stack(autograd_reference(f, heads, (x,))[1])


def _heads(k):
    return [lambda y, i=i: torch.sin(y * (i + 1)).sum() + y[i % y.shape[0]] ** 3 for i in range(k)]


def _clamp(module, grad_input, grad_output):
    return tuple(None if g is None else g.clamp(-0.05, 0.05) for g in grad_input)


def _clamp_output(module, inputs, output):
    output.register_hook(lambda g: g.clamp(-0.05, 0.05))


def _net():
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double()


# torch.func refuses a module backward hook's node, and warns of its eager fallback.
@pytest.mark.filterwarnings("ignore::funcgrad.FuncgradWarning")
@pytest.mark.parametrize(
    "register",
    [
        lambda net: net[2].register_full_backward_hook(_clamp),
        lambda net: net[0].register_forward_hook(_clamp_output),
    ],
    ids=["module backward hook", "forward hook's tensor hook"],
)
@pytest.mark.parametrize("strategy", ["auto", "jacrev"])
def test_a_hook_on_a_module_f_calls_registered_after_the_plan_settled(register, strategy):
    """Found in session 11: f a closure over a model (its modules are not f's own, so the
    hook state between calls does not list them) and k > m: calls 1-3 settled on jacrev,
    whose unit directions a nonlinear hook (a clamp) registered later acts on one by one;
    call 4 on replayed the plan unwatched, 0.1-0.8 off autograd's answer. The hook state
    now lists the modules a closure names too: the next call is watched, auto pulls the
    cotangents themselves, and an explicit jacrev is refused, as on a first call."""
    torch.manual_seed(0)
    net = _net()
    heads = _heads(8)
    fn = funcgrad.compose_heads(lambda x: net(x), heads, strategy=strategy)
    x = torch.randn(5, dtype=D)
    for _ in range(4):
        fn(x)
    handle = register(net)
    try:
        for _ in range(3):
            x = torch.randn(5, dtype=D)
            if strategy == "jacrev":
                with pytest.raises(ValueError, match="strategy='jacrev'"):
                    fn(x)
            else:
                expected = _per_head_autograd(lambda x: net(x), heads, x)
                torch.testing.assert_close(fn(x)[1], expected)
    finally:
        handle.remove()


def _f_hooked_from(state):
    weight = torch.randn(3, 5, dtype=D)

    def f(x):
        h = torch.tanh(weight @ x)
        if state["hook"]:
            h.register_hook(lambda g: g.clamp(-0.05, 0.05))
        return h

    return f


@pytest.mark.xfail(strict=True, reason="known limit (docs/reliability.md): f's own new hook")
def test_a_tensor_hook_that_f_starts_to_register_on_a_later_call_is_not_seen():
    torch.manual_seed(0)
    state = {"hook": False}
    f, heads = _f_hooked_from(state), _heads(8)
    fn = funcgrad.compose_heads(f, heads, strategy="jacrev")
    for _ in range(4):
        fn(torch.randn(5, dtype=D))
    state["hook"] = True
    x = torch.randn(5, dtype=D)
    torch.testing.assert_close(fn(x)[1], _per_head_autograd(f, heads, x))


@pytest.mark.filterwarnings("ignore::funcgrad.FuncgradWarning")
def test_forward_mode_is_refused_for_a_module_backward_hook_registered_after_it_settled():
    """Found in session 11: strategy='jacfwd' on a closure over a model, a clamping module
    backward hook registered after call 4: forward mode never runs it, and the unwatched
    calls after returned J's columns times the cotangents, 148 off autograd's answer. The
    next call is now watched, which refuses it as on a first call."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 30), nn.Tanh(), nn.Linear(30, 40)).double()
    fn = funcgrad.compose_heads(lambda x: net(x), _heads(50), strategy="jacfwd")
    x = torch.randn(2, dtype=D)
    for _ in range(4):
        fn(x)
    handle = net[2].register_full_backward_hook(_clamp)
    try:
        for _ in range(2):
            with pytest.raises(ValueError, match="backward hook"):
                fn(x)
    finally:
        handle.remove()
    fn(x)  # (and answers again once it is gone)


def test_pullback_sees_a_hook_registered_on_a_module_f_calls_after_earlier_pullbacks():
    """Found in session 11: the first pullback of a signature is watched, later ones not,
    so a clamping tensor hook that a forward hook (registered after them) puts in f's graph
    went unseen, and the Pullback reused the span of earlier cotangents through it."""
    torch.manual_seed(0)
    net = _net()

    def f(x):
        return net(x)

    x, cotangents = torch.randn(5, dtype=D), torch.randn(8, 3, dtype=D)
    for _ in range(3):
        pb = funcgrad.pullback(f, x)[1]
        pb.many(cotangents)
    handle = net[0].register_forward_hook(_clamp_output)
    try:
        pb = funcgrad.pullback(f, x)[1]
        (first,) = pb.many(cotangents[:4])
        (every,) = pb.many(cotangents)
        leaf = x.clone().requires_grad_()
        y = f(leaf)
        expected = torch.stack(
            [torch.autograd.grad(y, leaf, v, retain_graph=True)[0] for v in cotangents]
        )
    finally:
        handle.remove()
    torch.testing.assert_close(first, expected[:4])
    torch.testing.assert_close(every, expected)


class _Holder:
    def __init__(self, net):
        self.net = net


def _run(net, x):
    return net(x)


_GLOBAL_NET = None


def _through_global(x):
    return torch.stack([_GLOBAL_NET(x) for _ in range(1)])[0]  # (a comprehension's code)


def _decorated(net):
    import functools

    def decorate(g):
        @functools.wraps(g)
        def wrapper(*args):
            return g(*args)

        return wrapper

    @decorate
    def f(x):
        return net(x)

    return f


def _routes():
    import functools

    def nested(net):
        inner = lambda x: net(x)  # noqa: E731
        return lambda x: inner(x)

    def through_list(net):
        held = [net]
        return lambda x: held[0](x)

    def through_global(net):
        global _GLOBAL_NET
        _GLOBAL_NET = net
        return _through_global

    return {
        "a list in a cell": through_list,
        "partial's argument": lambda net: functools.partial(_run, net),
        "a nested closure": nested,
        "functools.wraps": _decorated,
        "an object's attribute": lambda net: (lambda h: lambda x: h.net(x))(_Holder(net)),
        "a global in a comprehension": through_global,
    }


@pytest.mark.filterwarnings("ignore::funcgrad.FuncgradWarning")
@pytest.mark.parametrize("route", list(_routes()))
def test_a_hook_registered_later_is_seen_on_every_route_to_the_model(route):
    """Found by session 11's review: the modules a closure named were listed from its cells
    and its own code's globals only, so a model reached through a list, a partial's
    argument, a nested closure, a decorator's ``__wrapped__``, an object's attribute or a
    global named in a comprehension was not watched, and a clamping backward hook
    registered after the plan settled was silently ignored (0.05-0.5 off)."""
    torch.manual_seed(0)
    net = _net()
    f = _routes()[route](net)
    heads = _heads(8)
    fn = funcgrad.compose_heads(f, heads)
    for _ in range(4):
        fn(torch.randn(5, dtype=D))
    handle = net[2].register_full_backward_hook(_clamp)
    try:
        for _ in range(2):
            x = torch.randn(5, dtype=D)
            torch.testing.assert_close(fn(x)[1], _per_head_autograd(f, heads, x))
    finally:
        handle.remove()


def test_the_hook_state_keeps_no_model_of_a_closure_alive():
    """Found by session 11's review of its first fix: the hook state held every submodule of
    the modules a closure names strongly, so a closure kept on its model (a cycle through
    the weak key of pullback's records) or a global model rebound stayed alive. Only f's
    own module's parts are held (their training flags are read each call)."""
    import gc
    import weakref

    def build():
        net = _net()
        net.f = lambda x: net(x)  # (the value would reach the weak key through net)
        _, pb = funcgrad.pullback(net.f, torch.randn(5, dtype=D))
        pb(torch.ones(3, dtype=D))
        return weakref.ref(net)

    alive = build()
    gc.collect()
    assert alive() is None
