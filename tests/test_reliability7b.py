"""Review 22's findings A-D (session 7): a hook registered after the plan settled, stacked
heads and whole pullbacks under torch.compile, notes added once. Each answer is compared
in float64 with plain ``torch.autograd.grad`` per head (or per cotangent)."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

import funcgrad
from funcgrad import _function

K = 12  # heads, more than y's size (8), fewer than x's (16): auto settles on jacrev


def _heads() -> list[Callable[[torch.Tensor], torch.Tensor]]:
    return [lambda y, i=i: torch.sin(y * (i + 1)).sum() for i in range(K)]


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 8), nn.Tanh()).double()


def _reference(f: Callable[..., Any], heads: list[Any], x: torch.Tensor) -> torch.Tensor:
    rows = []
    for head in heads:
        xs = x.detach().clone().requires_grad_()
        rows.append(torch.autograd.grad(head(f(xs)), xs)[0])
    return torch.stack(rows)


def _clamp(module: nn.Module, grad_input: Any, grad_output: Any) -> Any:
    return tuple(None if g is None else g.clamp(-0.05, 0.05) for g in grad_input)


def _add_hook(kind: str, net: nn.Sequential) -> Any:
    """Register a hook of ``kind`` on ``net`` (or globally); its handle."""
    if kind == "full_backward":
        return net[0].register_full_backward_hook(_clamp)
    if kind == "backward_old":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return net[1].register_backward_hook(_clamp)
    if kind == "backward_pre":
        return net[0].register_full_backward_pre_hook(
            lambda m, go: tuple(g.clamp(-0.05, 0.05) for g in go)
        )
    if kind == "forward_tensor_hook":  # (a forward hook that hooks the output's gradient)
        return net[0].register_forward_hook(
            lambda m, args, out: out.register_hook(lambda g: g.clamp(-0.05, 0.05)) and None
        )
    if kind == "global_backward":
        return torch.nn.modules.module.register_module_full_backward_hook(_clamp)
    raise AssertionError(kind)


HOOKS = ["full_backward", "backward_old", "backward_pre", "forward_tensor_hook", "global_backward"]


def _settled(fn: Any, x: torch.Tensor) -> None:
    for _ in range(3):
        fn(x)
    assert fn.plan(x).strategy == "jacrev"  # (the premise: f's pullback taken as linear)


@pytest.fixture
def removed() -> Iterator[list[Any]]:
    handles: list[Any] = []
    yield handles
    for handle in handles:
        handle.remove()


@pytest.mark.parametrize("kind", HOOKS)
@pytest.mark.parametrize("wrap", ["module", "partial", "method"])
def test_a_hook_registered_after_the_plan_settled_is_seen(kind, wrap, removed):
    net = _net()

    class Owner(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def run(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

    f: Any = {"module": net, "partial": functools.partial(net), "method": Owner().run}[wrap]
    heads = _heads()
    fn = funcgrad.compose_heads(f, heads)
    x = torch.randn(16, dtype=torch.float64)
    _settled(fn, x)
    torch.testing.assert_close(fn(x)[1], _reference(f, heads, x))
    removed.append(_add_hook(kind, net))
    expected = _reference(f, heads, x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):  # (every later call: the first re-watched, then the new plan)
            torch.testing.assert_close(fn(x)[1], expected)
    # (torch.func refuses a module's backward hook: the settled engine falls back, once)
    assert len(caught) <= 1 and all(w.category is funcgrad.FuncgradWarning for w in caught)


def test_the_hook_changes_the_answer(removed):
    """The premise of the test above: each hook kind moves the per-head gradients."""
    heads = _heads()
    x = torch.randn(16, dtype=torch.float64)
    for kind in HOOKS:
        net = _net()
        before = _reference(net, heads, x)
        handle = _add_hook(kind, net)
        try:
            assert (before - _reference(net, heads, x)).abs().max() > 0.1, kind
        finally:
            handle.remove()


def test_pullback_sees_a_hook_registered_after_its_first_call():
    net = _net()
    x = torch.randn(16, dtype=torch.float64)
    cotangents = torch.randn(K, 8, dtype=torch.float64)
    _, pb = funcgrad.pullback(net, x)
    pb.many(cotangents)
    handle = net[0].register_full_backward_hook(_clamp)
    try:
        _, pb = funcgrad.pullback(net, x)
        got = pb.many(cotangents)[0]
        rows = []
        for c in cotangents:
            xs = x.clone().requires_grad_()
            rows.append(torch.autograd.grad(net(xs), xs, c)[0])
        torch.testing.assert_close(got, torch.stack(rows))
    finally:
        handle.remove()


def test_the_hook_check_reads_nothing_and_rewatches_only_on_a_change(monkeypatch, removed):
    net, other = _net(), _net()
    fn = funcgrad.compose_heads(net, _heads())
    x = torch.randn(16, dtype=torch.float64)
    _settled(fn, x)
    watched = []
    seen = _function.module_hook_in_graph
    monkeypatch.setattr(
        _function, "module_hook_in_graph", lambda out: watched.append(1) or seen(out)
    )
    with funcgrad.HostReadCounter() as counter:
        fn(x)
    with monkeypatch.context() as patch:  # (the same call without the check)
        patch.setattr(_function.HookState, "changed", lambda self: False)
        with funcgrad.HostReadCounter() as unchecked:
            fn(x)
    assert counter.count == unchecked.count and watched == []
    state = _function.HookState(net)
    handle = net[1].register_full_backward_hook(_clamp)
    with funcgrad.HostReadCounter() as counter:
        assert state.changed() and not state.changed()
    handle.remove()
    assert counter.count == 0
    # Hooks elsewhere (another module, a tensor, a state-dict hook of f): not re-watched.
    removed.append(other[0].register_full_backward_hook(_clamp))
    removed.append(torch.zeros(1, requires_grad=True).register_hook(lambda g: g))
    removed.append(net.register_state_dict_pre_hook(lambda *a: None))
    fn(x)
    assert watched == []
    removed.append(net[0].register_forward_hook(lambda m, a, o: o))  # f's own: watched once
    fn(x)
    fn(x)
    assert watched == [1]


def test_compiled_stacked_heads_match_eager():
    x = torch.randn(4, dtype=torch.float64)
    params = torch.randn(3, 4, dtype=torch.float64)
    bare = funcgrad.stacked_heads(lambda p, y: (p * y).sum() ** 2, params)
    tree = funcgrad.stacked_heads(lambda p, y: (p * y["a"] * y["b"]).sum(), params)
    for f, heads in ((torch.sin, bare), (lambda x: {"b": x.cos(), "a": x.sin()}, tree)):
        fn = funcgrad.compose_heads(f, heads)
        expected = fn(x)
        for fullgraph in (True, False):
            torch._dynamo.reset()
            got = torch.compile(fn, backend="eager", fullgraph=fullgraph)(x)
            torch.testing.assert_close(got, expected)
    single = funcgrad.stacked_heads(lambda p, y: (p * y).sum() ** 2, params)
    reference = _reference(torch.sin, [lambda y, p=p: (p * y).sum() ** 2 for p in params], x)
    torch._dynamo.reset()
    got = torch.compile(funcgrad.compose_heads(torch.sin, single), backend="eager")(x)[1]
    torch.testing.assert_close(got, reference)


# (dynamo's own warning where a compiled pullback holds f's output: as on main)
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
@pytest.mark.parametrize("out", ["tensor", "tuple", "dict"])
def test_a_whole_pullback_compiles(out):
    x = torch.randn(3, dtype=torch.float64)
    f, tree = {
        "tensor": (torch.sin, lambda a: a),
        "tuple": (lambda x: (x.sin(), x.cos()), lambda a: (a, 2 * a)),
        "dict": (lambda x: {"b": x.cos(), "a": x.sin()}, lambda a: {"a": a, "b": 2 * a}),
    }[out]

    def whole(a: torch.Tensor) -> torch.Tensor:
        _, pb = funcgrad.pullback(f, x)
        return pb(tree(a))[0]

    a = torch.randn(3, dtype=torch.float64)
    xs = x.clone().requires_grad_()
    ys = f(xs)
    flat_y = [ys] if out == "tensor" else list(ys.values() if out == "dict" else ys)
    cot = tree(a)
    flat_c = [cot] if out == "tensor" else [cot[k] for k in ys] if out == "dict" else list(cot)
    expected = torch.autograd.grad(flat_y, xs, flat_c)[0]
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(whole, backend="eager")(a), expected)
    # A pullback made eagerly, called in compiled code.
    _, pb = funcgrad.pullback(f, x)
    torch._dynamo.reset()
    torch.testing.assert_close(
        torch.compile(lambda a: pb(tree(a))[0], backend="eager")(a), expected
    )


@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
def test_a_wrong_cotangent_tree_is_still_refused_in_compiled_code():
    x = torch.randn(3, dtype=torch.float64)
    _, pb = funcgrad.pullback(lambda x: (x.sin(), x.cos()), x)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="tree structure"):
        torch.compile(lambda a: pb([a, a])[0], backend="eager")(torch.ones(3, dtype=torch.float64))


def test_an_error_raised_twice_or_through_nested_compositions_is_named_once():
    error = ValueError("boom")

    def head(y: torch.Tensor) -> torch.Tensor:
        raise error

    fn = funcgrad.compose_heads(torch.sin, [lambda y: y.sum(), head])
    x = torch.randn(3, dtype=torch.float64)
    for _ in range(2):
        with pytest.raises(ValueError, match="boom") as info:
            fn(x)
    assert info.value.__notes__ == ["compose_heads(f, heads): raised by head 1."]

    inner = funcgrad.compose_heads(torch.sin, [lambda y: y.sum(), lambda y: y.prod() / 0 + head(y)])
    outer = funcgrad.compose_heads(lambda x: inner(x)[0], [lambda v: v.sum(), lambda v: head(v)])
    error.__notes__ = []
    with pytest.raises(ValueError, match="boom") as info:
        outer(x)
    notes = info.value.__notes__
    assert len(notes) == len(set(notes)), notes


def test_torch_compile_own_failures_are_not_blamed_on_a_head():
    from funcgrad._heads import _name_head

    error = torch._dynamo.exc.Unsupported("untraceable")
    _name_head(error, "head 0", "compose_heads(f, heads)")
    assert getattr(error, "__notes__", []) == []


@pytest.mark.filterwarnings("ignore::funcgrad.FuncgradWarning")
def test_an_explicit_jacrev_is_refused_once_a_later_hook_is_seen(removed):
    net = _net()
    fn = funcgrad.compose_heads(net, _heads(), strategy="jacrev")
    x = torch.randn(16, dtype=torch.float64)
    for _ in range(3):
        fn(x)
    removed.append(net[0].register_full_backward_hook(_clamp))
    for _ in range(2):
        with pytest.raises(ValueError, match="nonlinearly on its gradient"):
            fn(x)


class _Dropped(nn.Module):
    """Dropout on a non-contiguous tensor, where torch.func draws other masks than eager."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 6).double()
        self.drop = nn.Dropout(0.5)
        self.runs = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.runs += 1
        return self.drop(self.lin(x).reshape(2, 3).t()).sum(1)


def _dropped_head(i: int) -> Any:
    return lambda y: (y[i % 2] * (i + 1)).sin()


_DROPPED_HEADS = [_dropped_head(i) for i in range(6)]


def _eager_heads(f: Any, x: torch.Tensor, seed: int) -> Any:
    torch.manual_seed(seed)
    x = x.detach().requires_grad_()
    y = f(x)
    grads = [torch.autograd.grad(h(y), x, retain_graph=True)[0] for h in _DROPPED_HEADS]
    values = torch.stack([h(y) for h in _DROPPED_HEADS]).detach()
    return values, torch.stack(grads), torch.get_rng_state()


@pytest.mark.parametrize("strategy", ["auto", "jacrev", "vjp", "jacfwd"])
def test_compose_heads_on_a_module_put_in_training_mode_after_its_first_calls(strategy):
    # f is watched for random draws on a signature's first call; in eval mode it drew
    # nothing, so later calls ran under torch.func, whose dropout masks (on a non-contiguous
    # tensor) are not one eager forward's under the same seed (2.6 off once model.train()
    # was called; each answer consistent with its own masks). The modules' training flags
    # are now part of the state a plan was made under: a change watches f again.
    model = _Dropped()
    model.eval()
    fn = funcgrad.compose_heads(model, _DROPPED_HEADS, strategy=strategy)
    x = torch.linspace(-1.0, 1.0, 4, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", funcgrad.FuncgradWarning)  # (jacfwd: reverse mode)
        for _ in range(3):
            fn(x)
        model.train()
        for seed in range(4):
            torch.manual_seed(seed)
            before = model.runs
            values, grads = fn(x)
            runs, state = model.runs - before, torch.get_rng_state()
            want_values, want_grads, want_state = _eager_heads(model, x, seed)
            assert torch.allclose(torch.stack(list(grads)), want_grads, rtol=1e-10, atol=1e-12)
            assert torch.allclose(values, want_values, rtol=1e-10, atol=1e-12)
            assert torch.equal(state, want_state)
            # the watched call's fallback runs, on the first call in training mode only
            first = 3 if strategy == "jacfwd" else 2
            assert runs <= first if seed == 0 else runs == 1, (seed, runs)
        model.eval()  # and back: a plan without draws again, exact
        values, grads = fn(x)
        want_values, want_grads, _ = _eager_heads(model, x, 0)
        assert torch.allclose(torch.stack(list(grads)), want_grads, rtol=1e-10, atol=1e-12)


def test_combine_heads_on_a_module_put_in_training_mode_after_its_first_calls():
    model = _Dropped()
    model.eval()
    fn = funcgrad.combine_heads(model, _DROPPED_HEADS, lambda g: torch.ones(len(g), dtype=g.dtype))
    x = torch.linspace(-1.0, 1.0, 4, dtype=torch.float64)
    for _ in range(3):
        fn(x)
    model.train()
    for seed in range(3):
        torch.manual_seed(seed)
        values, grad, _ = fn(x)
        state = torch.get_rng_state()
        want_values, want_grads, want_state = _eager_heads(model, x, seed)
        assert torch.equal(state, want_state)
        assert torch.allclose(grad, want_grads.sum(0), rtol=1e-10, atol=1e-12)
        assert torch.allclose(values, want_values, rtol=1e-10, atol=1e-12)


def test_training_flags_are_read_without_rewatching_a_steady_module():
    # The flags are read every call (one attribute a submodule); f is watched again only
    # where one changed.
    model = _Dropped()
    model.eval()
    state = _function.HookState(model)
    assert not state.changed()
    model.drop.train()
    assert state.changed()
    assert not state.changed()
    model.eval()
    assert state.changed()
    assert not state.changed()
