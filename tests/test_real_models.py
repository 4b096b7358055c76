"""Real models and everyday edges (issue 10): BatchNorm in training mode, empty tensors,
f's real forward run exactly once, named head errors."""

from __future__ import annotations

import copy
import warnings

import optree
import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

import funcgrad

STRATEGIES = ["auto", "vjp", "jacrev", "jacfwd", "loop"]


# -- BatchNorm in training mode ---------------------------------------------------------------


def _backbone():
    torch.manual_seed(3)
    encoder = nn.Sequential(nn.Linear(3, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 4))
    tasks = nn.ModuleList([nn.Linear(4, 1) for _ in range(3)])
    return encoder, tasks


@pytest.mark.parametrize("chunk_size", [None, 2])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_batchnorm_train_mode_matches_autograd_and_updates_statistics_once(strategy, chunk_size):
    encoder, tasks = _backbone()
    reference = copy.deepcopy(encoder)
    batch = torch.randn(8, 3)
    params = {name: p.detach() for name, p in encoder.named_parameters()}

    def features(p, x):
        return torch.func.functional_call(encoder, p, (x,))

    heads = [lambda y, t=t: t(y).pow(2).mean() for t in tasks]
    if strategy == "jacfwd":
        chunk_size = None  # forward mode takes all columns in one pass
    fn = funcgrad.compose_heads(features, heads, strategy=strategy, chunk_size=chunk_size)
    with pytest.warns(funcgrad.FuncgradWarning) as record:
        losses, grads = fn(params, batch)
    messages = [str(w.message) for w in record if issubclass(w.category, funcgrad.FuncgradWarning)]
    assert len(messages) == 1, messages
    assert "BatchNorm" in messages[0] and "replace_all_batch_norm_modules_" in messages[0]
    assert "eval mode" in messages[0]

    y = reference(batch)
    for i, head in enumerate(heads):
        expected = torch.autograd.grad(head(y), list(reference.parameters()), retain_graph=True)
        for name, e in zip(params, expected):
            torch.testing.assert_close(grads[name][i], e)
        torch.testing.assert_close(losses[i], head(y).detach())
    # The running statistics are those after ONE forward: the failed torch.func attempt
    # mutated nothing and the eager fallback ran f once.
    bn, bn_ref = encoder[1], reference[1]
    torch.testing.assert_close(bn.running_mean, bn_ref.running_mean)
    torch.testing.assert_close(bn.running_var, bn_ref.running_var)
    assert bn.num_batches_tracked.item() == bn_ref.num_batches_tracked.item() == 1


def test_batchnorm_fallback_still_batches_with_vmap(monkeypatch):
    """The eager path is vmap over torch.autograd.grad, as TorchJD batches: no loop."""
    from funcgrad import _engine

    loops = []
    original = _engine._loop
    monkeypatch.setattr(_engine, "_loop", lambda fn, args: loops.append(1) or original(fn, args))
    encoder, tasks = _backbone()
    params = {name: p.detach() for name, p in encoder.named_parameters()}
    heads = [lambda y, t=t: t(y).pow(2).mean() for t in tasks]
    features = lambda p, x: torch.func.functional_call(encoder, p, (x,))  # noqa: E731
    with pytest.warns(funcgrad.FuncgradWarning, match="BatchNorm"):
        funcgrad.compose_heads(features, heads, strategy="vjp")(params, torch.randn(8, 3))
    assert not loops


def test_batchnorm_eval_mode_needs_no_fallback():
    encoder, tasks = _backbone()
    encoder.eval()
    params = {name: p.detach() for name, p in encoder.named_parameters()}
    heads = [lambda y, t=t: t(y).pow(2).mean() for t in tasks]
    features = lambda p, x: torch.func.functional_call(encoder, p, (x,))  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("error", funcgrad.FuncgradWarning)
        funcgrad.compose_heads(features, heads)(params, torch.randn(8, 3))


def test_batchnorm_pullback_matches_autograd_and_updates_statistics_once():
    encoder, _ = _backbone()
    reference = copy.deepcopy(encoder)
    batch = torch.randn(8, 3)
    with pytest.warns(funcgrad.FuncgradWarning, match="BatchNorm"):
        out, pb = funcgrad.pullback(encoder, batch)
    xr = batch.clone().requires_grad_()
    y = reference(xr)
    torch.testing.assert_close(out, y.detach())
    cotangents = torch.randn(5, *y.shape)
    (many,) = pb.many(cotangents)
    for i in range(5):
        (expected,) = torch.autograd.grad(y, xr, cotangents[i], retain_graph=True)
        torch.testing.assert_close(many[i], expected)
    assert encoder[1].num_batches_tracked.item() == 1
    torch.testing.assert_close(encoder[1].running_mean, reference[1].running_mean)


# -- empty tensors -----------------------------------------------------------------------------


EMPTY_CASES = {
    "n=0": (lambda t: torch.sin(t).sum() + torch.ones(3), lambda: torch.randn(0)),
    "m=0": (lambda t: t[:0] * 2, lambda: torch.randn(3)),
    "one empty output leaf": (lambda t: (t[:0], t.sin()), lambda: torch.randn(3)),
    "one empty input leaf": (
        lambda p: p["a"].sin() * (p["b"].sum() + 1),
        lambda: {"a": torch.randn(3), "b": torch.randn(0)},
    ),
}


def _head(y):
    leaves = optree.tree_leaves(y)
    return sum((leaf**2).sum() for leaf in leaves)


@pytest.mark.parametrize("case", EMPTY_CASES)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_empty_tensors_give_zeros_of_the_right_shapes(case, strategy):
    f, make = EMPTY_CASES[case]
    x = make()
    heads = [_head, lambda y: 2 * _head(y)]
    values, grads = funcgrad.compose_heads(f, heads, strategy=strategy)(x)
    leaves = optree.tree_leaves(x)
    for g, leaf in zip(optree.tree_leaves(grads), leaves):
        assert g.shape == (2, *leaf.shape)
    for i, head in enumerate(heads):
        xs = optree.tree_map(lambda t: t.clone().requires_grad_(), x)
        z = head(f(xs))
        torch.testing.assert_close(values[i], z.detach())
        expected = torch.autograd.grad(z, optree.tree_leaves(xs), allow_unused=True)
        for g, e, leaf in zip(optree.tree_leaves(grads), expected, leaves):
            torch.testing.assert_close(g[i], torch.zeros_like(leaf) if e is None else e)


@pytest.mark.parametrize("case", EMPTY_CASES)
def test_empty_tensors_in_pullback(case):
    f, make = EMPTY_CASES[case]
    x = make()
    out, pb = funcgrad.pullback(f, x)
    cotangents = optree.tree_map(lambda o: torch.randn(4, *o.shape), out)
    (many,) = pb.many(cotangents)
    (one,) = pb(optree.tree_map(lambda c: c[0], cotangents))
    for g, g1, leaf in zip(
        optree.tree_leaves(many), optree.tree_leaves(one), optree.tree_leaves(x)
    ):
        assert g.shape == (4, *leaf.shape) and g1.shape == leaf.shape
    (none,) = pb.many(optree.tree_map(lambda o: torch.empty(0, *o.shape), out))
    assert all(g.shape[0] == 0 for g in optree.tree_leaves(none))


def test_empty_tensors_in_grads():
    x = torch.randn(3, requires_grad=True)
    e = torch.randn(0, requires_grad=True)
    y = x[:0] * 2
    (g,) = funcgrad.grads([y.sum(), 3 * y.sum()], x, through=y)
    assert g.shape == (2, 3) and not g.any()
    mixed = (x[:0] * 2, x.sin() * (e.sum() + 1))
    zs = [mixed[0].sum() + mixed[1].sum(), (mixed[1] ** 2).sum()]
    gx, ge = funcgrad.grads(zs, [x, e], through=mixed, retain_graph=True)
    assert ge.shape == (2, 0)
    for i, z in enumerate(zs):
        torch.testing.assert_close(gx[i], torch.autograd.grad(z, x, retain_graph=True)[0])


# -- f's real forward runs exactly once -------------------------------------------------------


class Counted:
    """f that counts its real (non-fake) calls; planning on fake tensors is free."""

    def __init__(self, m: int, n: int):
        self.weight = torch.randn(m, n)
        self.calls = 0

    def __call__(self, t):
        if not is_fake(t):
            self.calls += 1
        return torch.tanh(self.weight @ t)


# (m, n, k): auto goes vjp, jacrev and jacfwd respectively.
SHAPES = {"vjp": (6, 4, 2), "jacrev": (3, 4, 9), "jacfwd": (40, 2, 30)}


@pytest.mark.parametrize("chunk_size", [None, 1, 2])
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("shape", SHAPES)
def test_f_runs_exactly_once_per_call(shape, strategy, chunk_size):
    m, n, k = SHAPES[shape]
    f = Counted(m, n)
    heads = [lambda y, i=i: (y * y).sum() * (i + 1) + y[i % m] for i in range(k)]
    if strategy == "jacfwd" and chunk_size is not None:
        chunk_size = n  # forward mode takes all n columns in one pass
    fn = funcgrad.compose_heads(f, heads, strategy=strategy, chunk_size=chunk_size)
    x = torch.randn(n)
    plan = fn.plan(x)
    assert f.calls == 0  # planning runs f on fake tensors only
    if strategy == "auto" and chunk_size is None:
        assert plan.strategy == shape
    fn(x)
    # Where auto chose forward mode, the first call on new shapes times it against reverse
    # mode: f runs once per mode, that once.
    assert f.calls == (2 if strategy == "auto" and plan.strategy == "jacfwd" else 1)
    f.calls = 0
    fn(x)
    assert f.calls == 1


def test_pullback_runs_f_once():
    f = Counted(5, 3)
    _, pb = funcgrad.pullback(f, torch.randn(3))
    pb.many(torch.randn(7, 5))
    pb(torch.randn(5))
    assert f.calls == 1


def test_plan_runs_f_for_real_only_when_shapes_are_data_dependent():
    calls = []

    def data_dependent(t):
        calls.append(is_fake(t))
        return t[: int(t.abs().sum() > 0) + 1].sin()

    plan = funcgrad.compose_heads(data_dependent, [lambda y: y.sum()] * 9).plan(torch.randn(4))
    assert plan.m == 2
    assert calls.count(False) <= 1


# -- a head that raises is named ----------------------------------------------------------------


def _broken(y):
    return y[10]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_raising_head_in_a_list_is_named_by_index(strategy):
    with pytest.raises(IndexError, match="out of bounds") as info:
        funcgrad.compose_heads(torch.sin, [lambda y: y.sum(), _broken], strategy=strategy)(
            torch.randn(3)
        )
    assert any("raised by head 1" in note for note in info.value.__notes__)


def test_raising_head_in_a_dict_is_named_by_key():
    heads = {"ok": lambda y: y.sum(), "bad": _broken}
    with pytest.raises(IndexError) as info:
        funcgrad.compose_heads(torch.sin, heads)(torch.randn(3))
    assert any("raised by head 'bad'" in note for note in info.value.__notes__)


def test_raising_stacked_head_fn_is_named():
    heads = funcgrad.stacked_heads(lambda p, y: (p * y).sum() + y[10], torch.randn(4, 3))
    with pytest.raises(IndexError) as info:
        funcgrad.compose_heads(torch.sin, heads)(torch.randn(3))
    assert any("stacked head_fn" in note for note in info.value.__notes__)


def test_raising_module_dict_head_is_named_by_key():
    heads = nn.ModuleDict({"fine": nn.Linear(3, 1), "wrong": nn.Linear(5, 1)})
    with pytest.raises(RuntimeError) as info:
        funcgrad.compose_heads(torch.sin, heads)(torch.randn(3))
    assert any("raised by head 'wrong'" in note for note in info.value.__notes__)
