"""f that re-enters funcgrad, or computes part of its output in a thread.

1. A funcgrad entry point called inside f (f computes gradients itself): every inner entry
   point under every outer strategy, on calls 1-4 (auto changes its plan over calls 1-3),
   against torch.autograd.grad with create_graph=True in float64, or a clear refusal.
2. Threads inside f: torch.func's transforms do not follow f into a worker thread, so the
   thread's part would be taken for a constant; the watched first call of a signature sees
   it, auto keeps to eager autograd and explicit torch.func strategies refuse.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import funcgrad

STRATEGIES = ["auto", "vjp", "jacrev", "jacfwd", "loop"]
CALLS = 4


# ---------------------------------------------------------------- 1. funcgrad inside f

W = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)  # a captured parameter
INNER_HEADS = [lambda y: y.sum(), lambda y: (y**2).sum()]
HEADS = [lambda y: y.sum(), lambda y: (y**3).sum(), lambda y: y[0]]


def _g(h):
    return torch.tanh(W @ h)


def _ag(z, xs):
    return torch.autograd.grad(z, xs, create_graph=True)


def _grads_h(h):
    y = _g(h)
    (gh,) = funcgrad.grads([head(y) for head in INNER_HEADS], h, through=y, create_graph=True)
    return gh[0] * gh[1]


def _grads_h_ref(h):
    y = _g(h)
    return _ag(INNER_HEADS[0](y), h)[0] * _ag(INNER_HEADS[1](y), h)[0]


def _grads_w(h):  # the captured parameter among the inputs: untracked under torch.func
    y = _g(h)
    gh, gw = funcgrad.grads([head(y) for head in INNER_HEADS], (h, W), through=y, create_graph=True)
    return gh[0] * gh[1] + gw[0].sum(0) * gw[1].sum(1)


def _grads_w_ref(h):
    y = _g(h)
    a, b = _ag(INNER_HEADS[0](y), (h, W))
    c, d = _ag(INNER_HEADS[1](y), (h, W))
    return a * c + b.sum(0) * d.sum(1)


def _torch_grad_w(h):  # the same with torch.autograd.grad itself inside f
    return _grads_w_ref(h)


def _compose_h(h):
    _, gh = funcgrad.compose_heads(_g, INNER_HEADS, create_graph=True)(h)
    return gh[0] * gh[1]


def _compose_w(h):
    fn = funcgrad.compose_heads(
        lambda w, h: torch.tanh(w @ h), INNER_HEADS, argnums=(0, 1), create_graph=True
    )
    _, (gw, gh) = fn(W, h)
    return gh[0] * gh[1] + gw[0].sum(0) * gw[1].sum(1)


def _stacked_h(h):
    heads = funcgrad.stacked_heads(lambda c, y: (c * y**2).sum(), torch.tensor([1.0, 2.0]))
    _, gh = funcgrad.compose_heads(_g, heads, create_graph=True)(h)
    return gh[0] * gh[1]


def _stacked_h_ref(h):
    y = _g(h)
    return _ag((y**2).sum(), h)[0] * _ag((2 * y**2).sum(), h)[0]


def _combine_h(h):
    _, grad, _ = funcgrad.combine_heads(_g, INNER_HEADS, create_graph=True)(h)
    return grad**2


def _combine_h_ref(h):
    y = _g(h)
    return _ag(INNER_HEADS[0](y) + INNER_HEADS[1](y), h)[0] ** 2


def _pullback_h(h):
    y, pb = funcgrad.pullback(_g, h)
    return pb(y)[0] * pb.many(torch.stack([y, y**2]))[0][1]


def _pullback_h_ref(h):
    y = _g(h)
    a = torch.autograd.grad(y, h, y, create_graph=True)[0]
    return a * torch.autograd.grad(y, h, y**2, create_graph=True)[0]


INNER = {
    "grads": (_grads_h, _grads_h_ref),
    "grads_captured": (_grads_w, _grads_w_ref),
    "autograd_captured": (_torch_grad_w, _grads_w_ref),
    "compose_heads": (_compose_h, _grads_h_ref),
    "compose_heads_params": (_compose_w, _grads_w_ref),
    "stacked_heads": (_stacked_h, _stacked_h_ref),
    "combine_heads": (_combine_h, _combine_h_ref),
    "pullback": (_pullback_h, _pullback_h_ref),
}


def _outer_f(inner):
    return lambda x: inner(torch.sin(x)) + torch.cos(x)


def _reference(inner, x, cotangents):
    xr = x.clone().requires_grad_()
    y = _outer_f(inner)(xr)
    return torch.stack([torch.autograd.grad(y, xr, v, retain_graph=True)[0] for v in cotangents])


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("inner", list(INNER))
def test_funcgrad_inside_f_is_autograds_on_every_call(inner, strategy):
    """Every inner entry point, under every outer strategy, calls 1-4: autograd's answer.
    (Before: `grads` to a captured parameter raised a bare AssertionError under torch.func,
    and torch.autograd.grad to one failed from auto's second call: torch.func does not
    track a captured tensor; f now runs on eager autograd there.)"""
    mine, ref = INNER[inner]
    x = torch.randn(4)
    xr = x.clone().requires_grad_()
    y = _outer_f(ref)(xr)
    expected = torch.stack([torch.autograd.grad(h(y), xr, retain_graph=True)[0] for h in HEADS])
    fn = funcgrad.compose_heads(_outer_f(mine), HEADS, strategy=strategy)
    for call in range(CALLS):
        with warnings.catch_warnings():
            # (an explicit torch.func strategy falls back to eager autograd, and says so)
            warnings.simplefilter("ignore", funcgrad.FuncgradWarning)
            _, grads = fn(x)
        torch.testing.assert_close(grads, expected, msg=f"call {call + 1}")


@pytest.mark.parametrize("inner", list(INNER))
def test_funcgrad_inside_f_of_pullback(inner):
    """The same under an outer `pullback` (pb.many), two pullbacks in a row."""
    mine, ref = INNER[inner]
    x = torch.randn(4)
    for _ in range(2):
        y, pb = funcgrad.pullback(_outer_f(mine), x)
        cotangents = [torch.ones(4), y.detach() ** 2, torch.eye(4)[0]]
        torch.testing.assert_close(
            pb.many(torch.stack(cotangents))[0], _reference(ref, x, cotangents)
        )


def test_explicit_strategy_says_why_it_runs_eagerly():
    """An explicit torch.func strategy warns once per call that f runs on eager autograd,
    naming the tensor the transform does not track."""
    fn = funcgrad.compose_heads(_outer_f(_grads_w), HEADS, strategy="vjp")
    with pytest.warns(funcgrad.FuncgradWarning, match=r"`inputs`\[1\] is not tracked"):
        fn(torch.randn(4))


def test_grads_inside_a_users_transform_names_the_untracked_input():
    """Inside the user's own torch.func transform, `grads` to a captured parameter is a clear
    error naming the input and the fix (torch.autograd.grad refuses it there too), not an
    AssertionError; under forward mode likewise for the outputs."""
    x = torch.randn(4)
    with pytest.raises(RuntimeError, match=r"`inputs`\[1\] is not tracked by the torch.func"):
        torch.func.grad(lambda x: _grads_w(torch.sin(x)).sum())(x)
    with pytest.raises(RuntimeError, match=r"`outputs`\[0\] is not tracked by the torch.func"):
        torch.func.jacfwd(lambda x: _grads_h(torch.sin(x)))(x)


def test_grads_outside_transforms_unchanged():
    """Outside transforms an input that does not require grad is still the ValueError."""
    with pytest.raises(ValueError, match=r"`inputs`\[0\] does not require grad"):
        y = W.sum() * 2
        funcgrad.grads([y], torch.ones(2), through=y)


def test_backward_inside_f_refused_on_every_call():
    """`backward` (it writes .grad) inside f: the same clear refusal on calls 1-4."""

    def f(x):
        y = _g(torch.sin(x))
        funcgrad.backward([y.sum(), (y**2).sum()], through=y)
        return y

    for strategy in ("auto", "vjp", "jacfwd"):
        fn = funcgrad.compose_heads(f, HEADS, strategy=strategy)
        for _ in range(CALLS):
            with pytest.raises(RuntimeError, match=r"inside a torch\.func transform"):
                fn(torch.randn(4))
    assert W.grad is None


@pytest.mark.parametrize(
    "entry",
    [funcgrad.per_example_norms, funcgrad.per_example_gramian],
    ids=["per_example_norms", "per_example_gramian"],
)
def test_per_example_inside_f_refused_on_every_call(entry):
    """The per-example functions inside f (hooks do not record there): a clear refusal on
    calls 1-4 (before: 'no hooks recorded ... hook the model before the forward')."""
    model = torch.nn.Linear(4, 1)

    def f(x):
        with funcgrad.per_example(model):
            losses = model(x).squeeze(1) ** 2
            return x * entry(losses).sum()

    fn = funcgrad.compose_heads(f, [lambda y: y.sum()])
    for _ in range(CALLS):
        with pytest.raises(RuntimeError, match=r"inside a torch\.func transform or an f"):
            fn(torch.randn(3, 4))
