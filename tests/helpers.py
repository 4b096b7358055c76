"""References for the tests (plain torch.autograd, head by head, in float64), and the
fixtures that the tests of several files share."""

from __future__ import annotations

import collections
import os

import optree
import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

import funcgrad
from funcgrad._counting import BackwardCounter, counted

Pair = collections.namedtuple("Pair", ["p", "q"])


# The per-example entry points that read G (or its diagonal), by name, each on its losses.
PER_EXAMPLE_CALLS = {
    "gramian": funcgrad.per_example_gramian,
    "norms": funcgrad.per_example_norms,
    "backward": lambda losses: funcgrad.backward(losses, batch_dim=0),
    "clip": lambda losses: funcgrad.per_example_clip(losses, 1.0),
}


def autograd_reference(f, heads, args, argnums=0, has_aux=False):
    """values and per-head grads by torch.autograd.grad, one backward of f per head."""
    nums = argnums if isinstance(argnums, tuple) else (argnums,)
    values, grads = [], []
    for head in heads:
        args_ = list(args)
        leaves_per_arg = []
        for a in nums:
            leaves, treedef = optree.tree_flatten(args[a])
            leaves = [leaf.detach().clone().requires_grad_() for leaf in leaves]
            leaves_per_arg.append((leaves, treedef))
            args_[a] = optree.tree_unflatten(treedef, leaves)
        y = f(*args_)
        if has_aux:
            y = y[0]
        z = head(y)
        flat = [leaf for leaves, _ in leaves_per_arg for leaf in leaves]
        g = torch.autograd.grad(z, flat, allow_unused=True)
        g = [torch.zeros_like(x) if gi is None else gi for gi, x in zip(g, flat)]
        trees, start = [], 0
        for leaves, treedef in leaves_per_arg:
            trees.append(optree.tree_unflatten(treedef, g[start : start + len(leaves)]))
            start += len(leaves)
        values.append(z.detach())
        grads.append(trees[0] if isinstance(argnums, int) else tuple(trees))
    return values, grads


def per_example_jacobian(model, losses_fn, params=None):
    """(B, P): the per-example gradients, one ``torch.autograd.grad(losses[b], params)`` each
    (zeros for a parameter the example does not reach); params: the trainable ones."""
    if params is None:
        params = [p for p in model.parameters() if p.requires_grad]
    losses = losses_fn(model)
    rows = []
    for b in range(losses.shape[0]):
        grads = torch.autograd.grad(losses[b], params, retain_graph=True, allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)]
        rows.append(torch.cat([g.flatten() for g in grads]))
    return torch.stack(rows)


def tree_index(tree, i):
    return optree.tree_map(lambda leaf: leaf[i], tree)


def assert_tree_close(actual, expected, rtol=1e-9, atol=1e-11):
    a_leaves, a_def = optree.tree_flatten(actual)
    e_leaves, e_def = optree.tree_flatten(expected)
    assert a_def == e_def, f"{a_def} != {e_def}"
    for a, e in zip(a_leaves, e_leaves):
        torch.testing.assert_close(a, e, rtol=rtol, atol=atol)


def autograd_vjp(f, primal, cotangent):
    """J_f(primal)^T cotangent by torch.autograd.grad, with pytrees through optree."""
    leaves, treedef = optree.tree_flatten(primal)
    leaves = [leaf.detach().clone().requires_grad_() for leaf in leaves]
    out = optree.tree_leaves(f(optree.tree_unflatten(treedef, leaves)))
    grads = torch.autograd.grad(out, leaves, optree.tree_leaves(cotangent), allow_unused=True)
    grads = [torch.zeros_like(x) if g is None else g for g, x in zip(grads, leaves)]
    return optree.tree_unflatten(treedef, grads)


def one_input_function(forward, backward):
    """A ``torch.autograd.Function`` of one tensor ``x``: ``forward(x)``, and in its backward
    ``backward(x, grad)`` with ``x`` saved. It has no jvp and no vmap rule, which is what the
    tests that use it need (forward mode or vmap must fail on it)."""

    class OneInput(torch.autograd.Function):
        @staticmethod
        def forward(x):
            return forward(x)

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(inputs[0])

        @staticmethod
        def backward(ctx, grad):
            (x,) = ctx.saved_tensors
            return backward(x, grad)

    return OneInput


def _read_then_double(x, grad):
    float(grad.sum().item())  # a read of a value: vmap cannot batch this backward
    return grad * 2


# x * 2, saving x; its backward reads a value (.item()), which vmap cannot batch.
Unbatchable = one_input_function(lambda x: x * 2, _read_then_double)


def assert_rows_close(got, expected, rtol):
    """Row by row, each against its own scale: a small head is not judged by a big one."""
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=rtol, atol=rtol * float(e.abs().max()))


def rank_group(rank, store, timeout_s=30):
    """The gloo group of this rank (of funcgrad.bench.ranks.WORLD, a spawned test worker's):
    on loopback, with one thread, every collective timing out after ``timeout_s``."""
    from funcgrad.bench.ranks import WORLD, gloo_group

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    return gloo_group(timeout_s, init_method=f"file://{store}", rank=rank, world_size=WORLD)


def task_losses(encoder, heads, x, y):
    """(features, one mean squared error per head): the multi-task step of the
    distributed tests."""
    features = encoder(x)
    losses = [
        torch.nn.functional.mse_loss(head(features), y[:, i : i + 1])
        for i, head in enumerate(heads)
    ]
    return features, losses


# -- fixtures shared by the tests of several files ---------------------------------------------

# three heads on a vector y (test_engine.py, test_linearize.py, test_memory.py)
HEADS = [lambda y: y.sum(), lambda y: (y**2).sum(), lambda y: y[0] * y[-1]]

# f's side effects (test_plan.py, test_linearize.py)
SIDE_W = torch.randn(2, 5, dtype=torch.float64)
SIDE_HEADS = [lambda y, i=i: (y * (i + 1)).sin().sum() + y[i % 5] for i in range(16)]  # 2 n < k


# dropout before BatchNorm (test_plan.py, test_linearize.py)
def _dropout_batchnorm():
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.BatchNorm1d(8), nn.Linear(8, 3))


DROPOUT_BN_HEADS = [
    lambda y: y[:, 0].pow(2).mean(),
    lambda y: y.sin().sum(),
    lambda y: y[:, 2].mean(),
]


EMPTY_CASES = {
    "n=0": (lambda t: torch.sin(t).sum() + torch.ones(3), lambda: torch.randn(0)),
    "m=0": (lambda t: t[:0] * 2, lambda: torch.randn(3)),
    "one empty output leaf": (lambda t: (t[:0], t.sin()), lambda: torch.randn(3)),
    "one empty input leaf": (
        lambda p: p["a"].sin() * (p["b"].sum() + 1),
        lambda: {"a": torch.randn(3), "b": torch.randn(0)},
    ),
}


class Counted:
    """f that counts its real (non-fake) calls; planning on fake tensors is free."""

    def __init__(self, m: int, n: int):
        self.weight = torch.randn(m, n)
        self.calls = 0

    def __call__(self, t):
        if not is_fake(t):
            self.calls += 1
        return torch.tanh(self.weight @ t)


def _module_case():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    model.double()
    heads = [lambda y: y.sum(), lambda y: (y**2).sum(), lambda y: y[0]]
    return model, heads, torch.randn(4, dtype=torch.float64)


def _requires_grad(tree) -> bool:
    return any(leaf.requires_grad for leaf in torch.utils._pytree.tree_leaves(tree))


class CountingF:
    """f = tanh, counting its calls, to show that validation comes first."""

    def __init__(self):
        self.calls = 0

    def __call__(self, x):
        self.calls += 1
        return torch.tanh(x)


HEAD = lambda y: y.sum()  # noqa: E731


# -- the multi-task model of test_backward.py and test_weighting.py ---------------------------


class Model(torch.nn.Module):
    """A shared encoder (one or two feature tensors) and k heads, some sharing a layer."""

    def __init__(self, k: int = 3, two_features: bool = False, counter=None) -> None:
        super().__init__()
        self.encoder = torch.nn.Sequential(
            torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 6)
        )
        self.other = torch.nn.Linear(5, 4) if two_features else None
        self.heads = torch.nn.ModuleList(torch.nn.Linear(6, 2) for _ in range(k))
        self.shared_head = torch.nn.Linear(2, 1)  # task-specific, shared by every head
        self.counter = counter

    def features(self, x):
        z = self.encoder(x)
        if self.counter is not None:
            z = counted(z, self.counter)
        return (z,) if self.other is None else (z, torch.sin(self.other(x)))

    def losses(self, features, targets):
        z = features[0]
        extra = features[1].sum(1, keepdim=True) if len(features) > 1 else 0.0
        losses = []
        for i, head in enumerate(self.heads):
            out = self.shared_head(torch.tanh(head(z))) + extra * (i + 1)
            losses.append((out - targets[:, i : i + 1]).pow(2).mean() * (i + 1))
        return losses

    def shared(self):
        return list(self.encoder.parameters()) + (
            [] if self.other is None else list(self.other.parameters())
        )


def _setup(k=3, two_features=False, counter=None):
    torch.manual_seed(0)
    model = Model(k, two_features, counter)
    x, targets = torch.randn(10, 5), torch.randn(10, k)
    return model, x, targets


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _counted_graph(k=3):
    counter = BackwardCounter()
    model, x, targets = _setup(k, counter=counter)
    features = model.features(x)
    return counter, model, features, model.losses(features, targets)


def _raises(match, *, losses=None, through=None, error=ValueError, **kwargs):
    """The error, with no pass through the shared part (where the weights can be known
    before it: not at level "params") and no .grad written."""
    counter, model, features, default_losses = _counted_graph()
    with pytest.raises(error, match=match):
        funcgrad.backward(
            default_losses if losses is None else losses(default_losses, model, features),
            through=features if through is None else through(features, model),
            **kwargs,
        )
    if kwargs.get("level") == "features" or kwargs.get("weighting") is None:
        assert counter.backward == 0, "the shared part ran before the error"
    assert not _grads(model), ".grad was written before the error"


def compiled_stand_in(wrong_after_first: bool):
    """An autograd.Function whose backward node is named as AOTAutograd's compiled region's
    (CompiledFunctionBackward); with ``wrong_after_first`` it answers wrongly from its second
    run on, as torch 2.13's inductor backward can (no error), else it is sin's."""

    class CompiledFunction(torch.autograd.Function):
        @staticmethod
        def forward(x):
            return x.sin()

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(inputs[0])
            ctx.runs = 0

        @staticmethod
        def backward(ctx, grad):
            (x,) = ctx.saved_tensors
            ctx.runs += 1
            return grad * x.cos() * (2.0 if wrong_after_first and ctx.runs > 1 else 1.0)

    return CompiledFunction
