"""Session 13: an f that writes into its differentiated argument in place (under
``torch.no_grad()``, through ``.data`` or ``.detach()``: an in-place normalisation or
projection of the input). One eager forward writes it once; a call that runs f again (the
eager re-run of an f that draws random numbers, the eager fallback where torch.func refuses
f, ``check``'s unbatched JVP calls in forward mode) wrote it again and differentiated f at
the twice-written input, with no error (the input 4 times, not 2 times, its value, 8 or 16
times under forward mode; gradients 0.02-6.5 off per-head autograd in float64). Such a call
is now refused before the re-run, the input written once, as by one eager forward, and the
next calls run f once on eager autograd: exact. Against ``torch.autograd.grad`` per head in
float64, calls 1-3."""

from __future__ import annotations

import pytest
import torch

import funcgrad

D = torch.float64
WRITTEN = "f wrote in place into the differentiated argument"
W = torch.randn(6, 5, dtype=D, generator=torch.Generator().manual_seed(0))
HEADS = [lambda y, i=i: (y**3)[i % 6] + y.prod() * i for i in range(9)]


class Triple(torch.autograd.Function):
    """3 x, without ``setup_context``: torch.func refuses it, eager autograd runs it."""

    @staticmethod
    def forward(ctx, t):
        return t * 3

    @staticmethod
    def backward(ctx, g):
        return g * 3


def _writer(write, rerun):
    def f(x):
        if write == "no_grad":
            with torch.no_grad():
                x.mul_(2)
        else:
            x.detach().mul_(2)
        h = W @ x
        if rerun == "dropout":  # f runs under torch.func, then again eagerly with its draws
            h = torch.nn.functional.dropout(h, 0.3)
        elif rerun == "refused":  # torch.func fails after the write: eager autograd again
            h = Triple.apply(h)
        return torch.tanh(h)

    return f


CASES = [
    # (strategy, what makes the call run f again, check, the calls refused: the next ones
    # run f once, on eager autograd)
    ("vjp", "dropout", False, {0}),
    ("jacrev", "dropout", False, {0}),
    ("loop", "dropout", False, {0}),
    ("jacfwd", "dropout", False, {0, 1, 2}),  # an explicit jacfwd stays forward mode
    ("vjp", "refused", False, {0}),
    ("auto", "refused", False, {1}),  # auto's second call tries torch.func
    ("jacfwd", None, True, {0, 1, 2}),  # check's unbatched JVP calls: an explicit jacfwd stays
    ("auto", None, False, set()),  # one eager run per call: exact, never refused
]


@pytest.mark.filterwarnings("ignore::funcgrad.FuncgradWarning")
@pytest.mark.parametrize("write", ["no_grad", "detach"])
@pytest.mark.parametrize(("strategy", "rerun", "check", "refused"), CASES)
def test_a_write_into_the_input_is_never_made_twice(write, strategy, rerun, check, refused):
    f = _writer(write, rerun)
    fn = funcgrad.compose_heads(f, HEADS, strategy=strategy, check=check)
    for call in range(3):
        x0 = torch.randn(5, dtype=D, generator=torch.Generator().manual_seed(call))
        x = x0.clone()
        torch.manual_seed(10 + call)
        if call in refused:
            with pytest.raises(ValueError, match=WRITTEN):
                fn(x)
        else:
            values, grads = fn(x)
            torch.manual_seed(10 + call)  # one eager forward, its draws, then each head
            leaf = x0.clone().requires_grad_()
            y = f(leaf)
            want = [torch.autograd.grad(h(y), leaf, retain_graph=True)[0] for h in HEADS]
            torch.testing.assert_close(values, torch.stack([h(y) for h in HEADS]).detach())
            torch.testing.assert_close(grads, torch.stack(want), rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(x, 2 * x0, rtol=0, atol=0)  # written once, as one forward


@pytest.mark.filterwarnings("ignore::funcgrad.FuncgradWarning")
@pytest.mark.parametrize("call", ["compose_heads", "params", "features"])
def test_a_graph_of_the_results_refuses_a_write_into_the_input_on_every_call(call):
    """With create_graph=True f runs under torch.func on every call, and where torch.func
    refuses f, on eager autograd once more: before, every call wrote the input twice and
    answered at the twice-written value (compose_heads 2.3-8.9 off, combine_heads 0.03-3.8,
    max entry). Refused on every call now, the input written once."""
    f = _writer("no_grad", "refused")
    if call == "compose_heads":
        fn = funcgrad.compose_heads(f, HEADS, create_graph=True)
    else:
        weighting = lambda g: g.diagonal()  # noqa: E731
        fn = funcgrad.combine_heads(f, HEADS, weighting, level=call, create_graph=True)
    for _ in range(3):
        x0 = torch.randn(5, dtype=D, generator=torch.Generator().manual_seed(0))
        x = x0.clone()
        with pytest.raises(ValueError, match=WRITTEN):
            fn(x)
        torch.testing.assert_close(x, 2 * x0, rtol=0, atol=0)


@pytest.mark.parametrize("strategy", ["vjp", "jacrev", "auto"])
def test_plan_measures_the_chunk_on_copies_of_a_written_input(strategy):
    """plan() with chunk_size="auto" ran f's vjp on the caller's own leaves to measure the
    chunk: an f writing into its input wrote it once more, and the next call answered at
    the twice-written value (2.9 off per-head autograd). It measures on copies now."""
    f = _writer("no_grad", None)
    fn = funcgrad.compose_heads(f, HEADS, strategy=strategy, chunk_size="auto")
    x0 = torch.randn(5, dtype=D, generator=torch.Generator().manual_seed(1))
    x = x0.clone()
    fn.plan(x)
    torch.testing.assert_close(x, x0, rtol=0, atol=0)  # plan() leaves x as it found it
    _, grads = fn(x)
    leaf = x0.clone().requires_grad_()
    y = f(leaf)
    want = [torch.autograd.grad(h(y), leaf, retain_graph=True)[0] for h in HEADS]
    torch.testing.assert_close(grads, torch.stack(want), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(x, 2 * x0, rtol=0, atol=0)


def test_the_refusal_names_the_written_leaf_as_the_caller_passed_it():
    def f(params, x):
        with torch.no_grad():
            params["w"].clamp_(-0.5, 0.5)  # a projection of the weight, in place
        return torch.tanh(torch.nn.functional.dropout(params["w"] @ x, 0.3))

    params = {"b": torch.randn(6, dtype=D), "w": torch.randn(6, 5, dtype=D)}
    fn = funcgrad.compose_heads(f, HEADS, strategy="vjp")
    with pytest.raises(ValueError, match=r"differentiated argument 0\['w'\] \(a tensor of shape"):
        fn(params, torch.randn(5, dtype=D))
