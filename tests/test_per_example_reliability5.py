"""per_example reliability (session 5): compiled modules in the model, and
nn.MultiheadAttention under CPU autocast, against a per-example loop of
torch.autograd.grad (float64, or in the autocast dtype with a stated tolerance)."""

from __future__ import annotations

import collections

import pytest
import torch

import funcgrad


class _Custom(torch.nn.Module):
    """A module with parameters and its own forward: the generic rule."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3, 4))
        self.b = torch.nn.Parameter(torch.randn(4))

    def forward(self, x):
        return torch.tanh(x @ self.w + self.b)


def _reference_gramian(model, x, loss):
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for b in range(x.shape[0]):
        grads = torch.autograd.grad(loss(model(x[b : b + 1])).sum(), params)
        rows.append(
            torch.cat(
                [g.float().flatten() if g.dtype != torch.float64 else g.flatten() for g in grads]
            )
        )
    rows = torch.stack(rows)
    return rows @ rows.T


def _model(how):
    inner = _Custom()
    if how == "wrapper":  # torch.compile(custom_module) inside the model
        return torch.nn.Sequential(torch.compile(inner), torch.nn.Linear(4, 1)), None
    if how == "in_place":  # module.compile()
        inner.compile()
        return torch.nn.Sequential(inner, torch.nn.Linear(4, 1)), None
    if how == "whole":  # per_example(torch.compile(model))
        return torch.compile(torch.nn.Sequential(inner, torch.nn.Linear(4, 1))), None
    # compiled after per_example hooked the model
    model = torch.nn.Sequential(inner, torch.nn.Linear(4, 1))
    return model, lambda: model.__setitem__(0, torch.compile(inner))


def _loss(out):
    return out.squeeze(1) ** 2


# (dynamo, tracing a compiled forward resumed after a graph break, reads .grad of a non-leaf
# input and warns; the answer is exact)
DYNAMO_GRAD_WARNING = "ignore:The .grad attribute of a Tensor that is not a leaf"
# (compiled after per_example hooked it: dynamo traces the recorder's hooks, and warns about
# what it cannot trace in them; documented, the answer is exact)
DYNAMO_TRACES_HOOKS = "ignore::UserWarning"


@pytest.mark.parametrize(
    "how",
    [
        "wrapper",
        "in_place",
        pytest.param(
            "whole", marks=[pytest.mark.slow, pytest.mark.filterwarnings(DYNAMO_GRAD_WARNING)]
        ),
        pytest.param(
            "after", marks=[pytest.mark.slow, pytest.mark.filterwarnings(DYNAMO_TRACES_HOOKS)]
        ),
    ],
)
@pytest.mark.parametrize("make", ["per_example", "PerExample"])
def test_compiled_module_in_the_model_is_exact(how, make):
    """torch.compile(custom_module) in the model (the OptimizedModule wrapper) ended in
    dynamo's internal error (it traced the recorder's hooks). The recorder's hooks now run
    outside the compiled region (torch.compiler.disable: a graph break) where the model
    holds a compiled module: G and the update as the per-example loop, in float64, calls
    1-2; the same through the exported class ``funcgrad.PerExample(model)`` (before: only
    per_example() moved the hooks out)."""
    model, after = _model(how)
    pe = getattr(funcgrad, make)(model)
    if after is not None:
        after()
    x = torch.randn(5, 3)
    for _ in range(2):
        G = pe.gramian(_loss(model(x)))
        torch.testing.assert_close(G, _reference_gramian(model, x, _loss))
    model.zero_grad()
    weights = pe.backward(_loss(model(x)), weighting=lambda g: torch.ones(5))
    pe.remove()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    _loss(model(x)).sum().backward()
    torch.testing.assert_close(weights, torch.ones(5))
    for got, want in zip(grads, [p.grad for p in model.parameters()]):
        torch.testing.assert_close(got, want)


class _Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.mha = torch.nn.MultiheadAttention(8, 2, batch_first=True)
        self.lin = torch.nn.Linear(8, 1)

    def forward(self, x):
        return self.lin(self.mha(x, x, x, need_weights=False)[0]).sum((1, 2))


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.bfloat16, 2**-6), (torch.float16, 2**-9)])
def test_multihead_attention_under_cpu_autocast(dtype, tolerance):
    """nn.MultiheadAttention under CPU autocast (an internal error two sessions ago; a guard
    now): G as the per-example loop run under the same autocast, within two units of the
    autocast dtype's epsilon relative to G's largest entry (measured: 4e-3 in bfloat16,
    9e-5 in float16)."""
    torch.set_default_dtype(torch.float32)
    model, x = _Attention(), torch.randn(6, 5, 8)
    with funcgrad.per_example(model) as pe:
        with torch.autocast("cpu", dtype=dtype):
            losses = model(x) ** 2
        G = pe.gramian(losses)
    with torch.autocast("cpu", dtype=dtype):
        want = _reference_gramian(model, x, lambda out: out**2)
    assert G.dtype == torch.float32
    assert ((G - want).abs().max() / want.abs().max()).item() < tolerance


class _Stateful(torch.nn.Module):
    """A generic-rule module whose forward changes plain attributes (not what it computes)."""

    def __init__(self, loop=False):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3, 4))
        self.loop = loop
        self.count, self.seen, self.stats, self.tags = 0, [], {"n": 0}, set()
        self.history = collections.deque(maxlen=100)
        self.order = collections.OrderedDict(a=1, b=2)
        self.by_size = collections.defaultdict(int)
        self.counter = collections.Counter()

    def forward(self, x):
        self.count += 1
        self.seen.append(x.shape[0])
        self.stats["n"] += 1
        self.tags.add(self.count)
        self.history.append(x.shape[0])
        self.order.move_to_end(next(iter(self.order)))  # (rotated: its order changes)
        self.by_size[x.shape[0]] += 1
        self.counter["calls"] += 1
        self.last = x.detach()  # (added by the first forward, rebound by later ones)
        out = torch.tanh(x @ self.w)
        if self.loop:  # a value read: vmap cannot run it, the loop does
            out = out * (1 + 0 * float(x.sum() > 0))
        return out


def _state(module):
    return (
        module.count,
        list(module.seen),
        dict(module.stats),
        set(module.tags),
        list(module.history),
        list(module.order.items()),
        dict(module.by_size),
        dict(module.counter),
        module.last,
    )


@pytest.mark.parametrize("loop", [False, True], ids=["vmap", "loop"])
@pytest.mark.parametrize("entry", ["gramian", "backward", "norms"])
def test_plain_attributes_as_after_one_forward(loop, entry):
    """The generic rule calls the module again (once vmapped, or once per example, plus the
    independence check's calls on the first call): a counter went 1 -> 7, a list got 7
    more items. As Opacus and vmap(grad) leave them, the plain attributes are now those
    of the user's forwards alone (rebound, added, and lists/dicts/sets changed in place
    restored, and their subclasses: deque, OrderedDict with its order, defaultdict,
    Counter), and G is the per-example loop's (float64), on calls 1-3."""
    inner = _Stateful(loop)
    model = torch.nn.Sequential(inner, torch.nn.Linear(4, 1))
    pe = funcgrad.per_example(model)
    x = torch.randn(5, 3)
    for call in range(3):
        losses = _loss(model(x))
        after_forward = _state(inner)
        if entry == "gramian":
            G = pe.gramian(losses)
        elif entry == "backward":
            pe.backward(losses, weighting=lambda g: torch.ones(5))
        else:
            funcgrad.per_example_norms(losses)
        now = _state(inner)
        assert now[:-1] == after_forward[:-1], f"call {call + 1}: {now} != {after_forward}"
        assert now[-1] is after_forward[-1]
        assert inner.count == call + 1
    pe.remove()
    if entry == "gramian":
        torch.testing.assert_close(G, _reference_gramian(model, x, _loss))


def test_deepcopy_of_a_model_holding_a_compiled_module():
    """copy.deepcopy of a model hooked while it holds a compiled module (an EMA, a teacher):
    the copy's hooks belong to the copy's recorder, as without compile (before: their
    ``__self__`` stayed the original recorder, so a call on the copy's losses got "no hooks
    recorded" instead of the copy's message). The original's G stays the loop's."""
    import copy

    inner = _Custom()
    inner.compile()
    model = torch.nn.Sequential(inner, torch.nn.Linear(4, 1))
    pe = funcgrad.PerExample(model)
    ema = copy.deepcopy(model)
    copied = [
        hook.__self__
        for module in ema.modules()
        for hook in module._forward_hooks.values()
        if hasattr(hook, "__self__")
    ]
    assert copied and all(owner is not pe for owner in copied)
    x = torch.randn(5, 3)
    losses = _loss(model(x))
    _loss(ema(x)).sum()
    torch.testing.assert_close(pe.gramian(losses), _reference_gramian(model, x, _loss))
    with pytest.raises(ValueError, match="copy of a hooked model"):
        funcgrad.per_example_gramian(_loss(ema(x)))
    pe.remove()
