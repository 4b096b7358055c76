"""f that re-enters funcgrad, or computes part of its output in a thread.

1. A funcgrad entry point called inside f (f computes gradients itself): every inner entry
   point under every outer strategy, on calls 1-4 (auto changes its plan over calls 1-3),
   against torch.autograd.grad with create_graph=True in float64, or a clear refusal.
2. Threads inside f: torch.func's transforms do not follow f into a worker thread, so the
   thread's part would be taken for a constant; the watched first call of a signature sees
   it, auto keeps to eager autograd and explicit torch.func strategies refuse.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import warnings

import pytest
import torch

import funcgrad
from funcgrad._plan import Request, decide, pullback_engine
from funcgrad._record import Record

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


@pytest.mark.parametrize("strategy", ["vjp", "jacrev"])
def test_explicit_strategy_falls_back_once(strategy):
    """torch.func refused f on the first call (``grads`` to a captured parameter inside f):
    later calls of the signature run f once, on eager autograd (before: twice on every
    call, torch.func's try and the fallback), with autograd's answer."""
    runs = []

    def f(x):
        runs.append(1)
        return _outer_f(_grads_w)(x)

    x = torch.randn(4)
    xr = x.clone().requires_grad_()
    y = _outer_f(_grads_w_ref)(xr)
    expected = torch.stack([torch.autograd.grad(h(y), xr, retain_graph=True)[0] for h in HEADS])
    fn = funcgrad.compose_heads(f, HEADS, strategy=strategy)
    counts = []
    for call in range(CALLS):
        runs.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", funcgrad.FuncgradWarning)
            _, grads = fn(x)
        counts.append(len(runs))
        torch.testing.assert_close(grads, expected, msg=f"call {call + 1}")
    assert counts == [2] + [1] * (CALLS - 1)
    assert fn.plan(x).engine == "autograd"


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


# ---------------------------------------------------------------- 2. threads inside f

_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=2)


def _in_thread(fn, *args):
    return _POOL.submit(fn, *args).result()


THREADED = {
    # part of f from x (and a captured parameter) in a worker
    "mixed": lambda x: _in_thread(lambda: torch.tanh(W @ x)) * torch.sin(x),
    # from x alone (under torch.func: a plain tensor with no graph at all)
    "x_only": lambda x: _in_thread(torch.tanh, x) + x**2,
    # f's output itself from the worker
    "output": lambda x: _in_thread(lambda: torch.tanh(W @ x) * x),
    # from an intermediate the calling thread computed
    "intermediate": lambda x: (lambda u: _in_thread(torch.sin, u) * u)(torch.cos(x)),
    # threading.Thread, the result passed back in a list
    "thread": lambda x: _by_thread(x) + x,
}


def _by_thread(x):
    box = []
    worker = threading.Thread(target=lambda: box.append(torch.tanh(W @ x) ** 2))
    worker.start()
    worker.join()
    return box[0]


def _expected(f, x, heads=HEADS):
    xr = x.clone().requires_grad_()
    y = f(xr)
    return torch.stack([torch.autograd.grad(h(y), xr, retain_graph=True)[0] for h in heads])


@pytest.mark.parametrize("case", list(THREADED))
def test_threads_auto_is_autograds_on_every_call(case):
    """auto's first call of a signature runs eager autograd (which follows threads) and sees
    the worker's part; later calls stay there instead of trying torch.func, which took that
    part for a constant (before: calls 2-4 were off by 0.1-1)."""
    f, x = THREADED[case], torch.randn(4)
    want = _expected(f, x)
    fn = funcgrad.compose_heads(f, HEADS)
    for call in range(CALLS):
        torch.testing.assert_close(fn(x)[1], want, msg=f"call {call + 1}")
        assert fn.plan(x).engine == "autograd"


@pytest.mark.parametrize("level", ["params", "features"])
def test_threads_combine_heads_is_autograds_on_every_call(level):
    f, x = THREADED["mixed"], torch.randn(4)
    want = _expected(f, x).sum(0)
    fn = funcgrad.combine_heads(f, HEADS, lambda g: torch.ones(len(HEADS)), level=level)
    for call in range(CALLS):
        torch.testing.assert_close(fn(x)[1], want, msg=f"call {call + 1}")


def test_threads_pullback_is_autograds():
    """pullback runs f once on eager autograd: right already (a guard, it passed before)."""
    f, x = THREADED["mixed"], torch.randn(4)
    cotangents = torch.randn(3, 4)
    for _ in range(2):
        _, pb = funcgrad.pullback(f, x)
        xr = x.clone().requires_grad_()
        y = f(xr)
        want = torch.stack(
            [torch.autograd.grad(y, xr, v, retain_graph=True)[0] for v in cotangents]
        )
        torch.testing.assert_close(pb.many(cotangents)[0], want)


def test_decide_once_threads_are_known():
    """With the thread known for a signature: auto plans eager autograd without a torch.func
    trial or forward mode; a plan that would run f under torch.func (an explicit strategy,
    forward mode, a graph of the results wanted) is refused before f runs, naming threads
    and the fix."""
    record = Record(m=4, threads=True, draws=False)
    for request in (
        Request("vjp", 3, 4, 4),
        Request("jacrev", 3, 4, 4),
        Request("jacfwd", 3, 4, 4),
        Request("auto", 3, 4, 4, graph=True),
        Request("auto", 3, 4, 4, weighted=True, eager=False),
    ):
        with pytest.raises(ValueError, match=r"another thread.*calling thread"):
            decide(request, record)
    for k in (3, 9):  # (k > 2n: forward mode would be cheaper)
        plan = decide(Request("auto", k, 1, 4), record)
        assert plan.engine == "autograd" and not plan.timed and plan.strategy != "jacfwd"
    assert pullback_engine(True, dataclasses.replace(record, compiled=True)) == "autograd"


def test_threads_explicit_strategy_that_runs_eagerly_is_autograds():
    """An explicit strategy runs f on eager autograd where f draws random numbers: there the
    thread is seen, and every call is autograd's (nothing to refuse)."""

    def f(x):
        return THREADED["mixed"](x) + 0 * torch.rand(())

    x = torch.randn(4)
    want = _expected(f, x)
    fn = funcgrad.compose_heads(f, HEADS, strategy="vjp")
    for call in range(CALLS):
        torch.testing.assert_close(fn(x)[1], want, msg=f"call {call + 1}")


@pytest.mark.parametrize("strategy", ["vjp", "jacrev", "jacfwd"])
@pytest.mark.parametrize("function", ["old_style", "mark_dirty"])
def test_threads_explicit_strategy_that_falls_back_to_autograd(strategy, function):
    """f that torch.func refuses (an old-style autograd.Function, ``mark_dirty``) runs on
    eager autograd under an explicit strategy too, where the thread is seen: every call is
    autograd's (before: calls 2+ were refused, although eager autograd is what runs)."""
    custom = {"old_style": _OldStyle.apply, "mark_dirty": lambda x: _Dirty.apply(x * 1)}[function]

    def f(x):
        return THREADED["mixed"](x) * custom(x)

    x = torch.randn(4)
    want = _expected(f, x)
    fn = funcgrad.compose_heads(f, HEADS, strategy=strategy)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", funcgrad.FuncgradWarning)
        for call in range(CALLS):
            torch.testing.assert_close(fn(x)[1], want, msg=f"call {call + 1}")
    assert _threads_seen(fn)


@pytest.mark.parametrize("transform", ["grad", "vmap"])
def test_threads_seen_then_inside_a_transform_refused(transform):
    """Once an eager call saw the thread, the function called inside a user's torch.func
    transform (which cannot follow the thread either) is refused clearly (before: grad was
    silently wrong, vmap failed with torch's internal error)."""
    fn = funcgrad.compose_heads(THREADED["mixed"], HEADS)
    x = torch.randn(4)
    fn(x)
    with pytest.raises(ValueError, match=r"another thread.*inside a transform"):
        if transform == "grad":
            torch.func.grad(lambda x: fn(x)[1].sum())(x)
        else:
            torch.func.vmap(fn)(x.expand(3, 4))


def test_threads_seen_then_pullback_inside_a_transform_refused():
    """pullback of f that an eager pullback saw run a thread, inside a user's transform:
    refused clearly (before: torch.func.grad through it was silently wrong, 0.36 off)."""
    f, x, v = THREADED["mixed"], torch.randn(4), torch.randn(4)
    funcgrad.pullback(f, x)

    def g(x):
        _, pb = funcgrad.pullback(f, x)
        return pb(v)[0].sum()

    with pytest.raises(ValueError, match=r"another thread.*outside transforms"):
        torch.func.grad(g)(x)


def _threads_seen(fn):
    return fn._composition._records.facts.threads


class _OldStyle(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g


class _NewStyle(torch.autograd.Function):
    @staticmethod
    def forward(x):
        return x.view_as(x)  # (its own output is a view of the input)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return g


class _Dirty(torch.autograd.Function):
    """Writes into its input and marks it dirty: apply rebases the input's history."""

    @staticmethod
    def forward(ctx, x):
        x.mul_(2)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return 2 * g


def _setitem(x):
    out = torch.zeros(4)
    out[0] = x[0] * 2
    out[1:] = x[1:] ** 2
    return out * 1


def _in_place_on_view(x):
    h = x * 1
    h[:2].mul_(3)
    return h.sin()


def _view_after_base(x):
    h = x * 1
    v = h[:2]
    h.mul_(2)
    return v.sin().sum() * x


def _setitem_through_view(x):
    h = torch.zeros(2, 2)
    h.T[0] = x[:2]
    return h.flatten() * x


def _out_argument(x):
    out = torch.empty(4)
    out.copy_(x * 2)
    return out.sin()


def _no_thread_cases():
    """f's that run everything on the calling thread, with what could look foreign."""
    lin, norm = torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4).eval()
    before = torch.tanh(lin(torch.randn(4)))  # captured, with a graph, computed before
    mha = torch.nn.MultiheadAttention(4, 2, batch_first=True)
    lstm = torch.nn.LSTM(4, 4, batch_first=True)
    layer = torch.nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0, batch_first=True)
    hooked = torch.nn.Linear(4, 4)
    hooked.register_full_backward_hook(lambda module, grad_in, grad_out: None)
    previous = []

    def remember(x):  # a tensor from the previous call of f, captured
        y = torch.sin(x) + (previous[-1] if previous else 0)
        previous.append(y)
        return y

    def seq(x):
        return x.view(1, 2, 2)

    return {
        "captured_with_graph": lambda x: before * x,
        "parameters_and_buffers": lambda x: norm(lin(x).view(1, 4)).view(4),
        "previous_call": remember,
        "layer_norm_gelu": lambda x: torch.nn.functional.gelu(
            torch.nn.functional.layer_norm(x, (4,))
        ),
        "sdpa": lambda x: torch.nn.functional.scaled_dot_product_attention(
            seq(x)[None], seq(x)[None], seq(x)[None]
        ).flatten(),
        "multi_head_attention": lambda x: mha(x.view(1, 1, 4), x.view(1, 1, 4), x.view(1, 1, 4))[
            0
        ].flatten(),
        "lstm": lambda x: lstm(x.view(1, 1, 4))[0].flatten(),
        "transformer_layer": lambda x: layer(x.view(1, 1, 4)).flatten(),
        "multi_output": lambda x: (
            torch.max(x.view(2, 2), dim=1).values.repeat(2) * torch.stack(x.unbind(0)[::-1]).flip(0)
        ),
        "properties": lambda x: x.view(2, 2).T.mT.flatten() + x[1:].sum(),
        "module_hook": lambda x: hooked(x),
        "tensor_hook": lambda x: (lambda t: (t.register_hook(lambda g: g * 1), t)[1])(x * 2),
        "custom_functions": lambda x: _OldStyle.apply(_NewStyle.apply(x)) + 1,
        "pass_counter": lambda x: funcgrad.PassCounter()(x) * 2,
        "checkpoint": lambda x: torch.utils.checkpoint.checkpoint(
            torch.sin, x * 2, use_reentrant=False
        ),
        "autograd_grad": lambda x: torch.autograd.grad(
            torch.tanh(W @ x).sum(), x, create_graph=True
        )[0],
        "nested_grads": lambda x: _grads_h(x),
        "nested_compose_heads": lambda x: _compose_h(x) + x,
        # in place: the written tensor's (or its base's) node is not what the op returned
        "setitem": _setitem,
        "in_place_on_view": _in_place_on_view,
        "view_after_base_changed": _view_after_base,
        "setitem_through_view": _setitem_through_view,
        "copy_into": _out_argument,
        "mark_dirty": lambda x: _Dirty.apply(x * 1) * 1,
    }


NO_THREAD = list(_no_thread_cases())


@pytest.mark.parametrize("case", NO_THREAD)
def test_no_thread_seen_where_f_stays_on_the_calling_thread(case):
    """No false positive: captured tensors with a graph, parameters, buffers, a tensor from
    an earlier call, composite ops (several autograd nodes an op), multi-output ops, hooks,
    autograd.Functions (whose apply no mode sees), checkpointing, gradients taken inside f.
    The answer is autograd's on every call either way."""
    f, x = _no_thread_cases()[case], torch.randn(4)
    fn = funcgrad.compose_heads(f, HEADS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", funcgrad.FuncgradWarning)
        for _ in range(3):
            fn(x)
    assert not _threads_seen(fn)


def test_no_thread_seen_for_a_compiled_module():
    module = torch.compile(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU()))
    fn = funcgrad.compose_heads(lambda x: module(x) * x, HEADS)
    fn(torch.randn(4))
    assert not _threads_seen(fn)


def test_no_thread_seen_when_several_threads_call_the_function():
    """A compose_heads function called from several threads at once: each call runs f on
    its own thread, watched there; no thread is taken for f's own."""
    fn = funcgrad.compose_heads(lambda x: torch.tanh(W @ x) * x, HEADS)
    xs = [torch.randn(4) for _ in range(4)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(fn, xs))
    for x, (_, grads) in zip(xs, results):
        torch.testing.assert_close(grads, _expected(lambda x: torch.tanh(W @ x) * x, x))
    assert not _threads_seen(fn)


@pytest.mark.parametrize("case", list(THREADED))
def test_threads_seen_on_the_first_call(case):
    fn = funcgrad.compose_heads(THREADED[case], HEADS)
    fn(torch.randn(4))
    assert _threads_seen(fn)
