"""A torch function replaced by a wrapper (session 8): torch hands a TorchFunctionMode the
function it finds under the called name at call time, so a mode that calls ``func`` ran
the wrapper a second time. funcgrad watches the first call of each shape with such modes:
that call was silently wrong, later calls right. Each entry point against plain eager
autograd per head in float64, on calls 1, 2 and 3."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import funcgrad
from funcgrad._function import ReplacedTorchFunction


def _lambda_relu(orig: Any) -> Any:
    return lambda x, inplace=False: orig(x + 1)


def _wraps_relu(orig: Any) -> Any:
    @functools.wraps(orig)
    def relu(x: torch.Tensor, inplace: bool = False) -> torch.Tensor:
        return orig(x + 1, inplace=inplace)

    return relu


def _tensor_method(orig: Any) -> Any:
    def method(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return orig(torch._C._VariableFunctions.add(self, 1), *args, **kwargs)

    return method


# (where, name, make the wrapper from the original, f's use of it)
PATCHES: dict[str, tuple[Any, str, Callable[[Any], Any], Callable[[torch.Tensor], Any]]] = {
    "F.relu lambda": (F, "relu", _lambda_relu, lambda x: F.relu(2 * x)),
    "F.relu functools.wraps": (F, "relu", _wraps_relu, lambda x: F.relu(2 * x)),
    "F.silu": (F, "silu", _lambda_relu, lambda x: F.silu(2 * x)),
    "Tensor.exp (C method)": (torch.Tensor, "exp", _tensor_method, lambda x: (0.5 * x).exp()),
    # (a control: x * x hands the mode TensorBase.__mul__, not the replacement)
    "Tensor.__mul__ (C slot)": (
        torch.Tensor,
        "__mul__",
        _tensor_method,
        lambda x: (x * x).sin(),
    ),
    "Tensor.split (Python method)": (
        torch.Tensor,
        "split",
        _tensor_method,
        lambda x: torch.cat(x.split(2)).cos(),
    ),
    # (boolean_dispatch: _max_pool1d dispatches the public max_pool1d)
    "F.max_pool1d": (
        F,
        "max_pool1d",
        _tensor_method,
        lambda x: F.max_pool1d(x.unsqueeze(-2).exp(), 1).squeeze(-2),
    ),
    # (eager F.gelu is the C function itself and never calls the replacement: a mode was
    # handed it and ran it once)
    "torch._C._nn.gelu": (torch._C._nn, "gelu", _lambda_relu, lambda x: F.gelu(2 * x)),
    # (a replacement passed through a torch decorator: its code is in torch's folder)
    "Tensor.exp torch.compiler.disable": (
        torch.Tensor,
        "exp",
        lambda orig: torch.compiler.disable(_tensor_method(orig)),
        lambda x: (0.5 * x).exp(),
    ),
    "F.silu torch.enable_grad": (
        F,
        "silu",
        lambda orig: torch.enable_grad()(_lambda_relu(orig)),
        lambda x: F.silu(2 * x),
    ),
}
try:  # (wrapt's proxies forward __module__, __code__, __name__ of what they wrap)
    import wrapt

    def _wrapt(orig: Any) -> Any:
        return wrapt.FunctionWrapper(orig, lambda w, i, a, k: w(*a, **k) + 1)

    PATCHES["F.silu wrapt"] = (F, "silu", _wrapt, lambda x: F.silu(2 * x))
    PATCHES["torch._C._nn.gelu wrapt"] = (torch._C._nn, "gelu", _wrapt, lambda x: F.gelu(2 * x))
    PATCHES["Tensor.exp wrapt"] = (torch.Tensor, "exp", _wrapt, lambda x: (0.5 * x).exp())
except ImportError:
    pass


@pytest.fixture(params=list(PATCHES))
def patched(request: pytest.FixtureRequest) -> Iterator[Callable[[torch.Tensor], Any]]:
    owner, name, wrap, use = PATCHES[request.param]
    orig = getattr(owner, name)
    setattr(owner, name, wrap(orig))
    try:
        yield use
    finally:
        setattr(owner, name, orig)


def _x() -> torch.Tensor:
    return torch.linspace(-1.0, 1.5, 4, dtype=torch.float64)


HEADS = [lambda y: y.sum(), lambda y: (y**2).sum(), lambda y: y[1] * y[2]]


def _reference(f: Callable[[torch.Tensor], Any], x: torch.Tensor) -> tuple[Any, Any]:
    values, grads = [], []
    for head in HEADS:
        leaf = x.detach().requires_grad_()
        value = head(f(leaf))
        values.append(value.detach())
        grads.append(torch.autograd.grad(value, leaf)[0])
    return torch.stack(values), torch.stack(grads)


def _f(use: Callable[[torch.Tensor], Any]) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: use(x) * 1.0


@pytest.mark.parametrize("strategy", ["vjp", "jacrev", "loop"])
def test_compose_heads_matches_eager(patched, strategy):
    f = _f(patched)
    want_values, want_grads = _reference(f, _x())
    fn = funcgrad.compose_heads(f, HEADS, strategy=strategy)
    for _ in range(3):
        values, grads = fn(_x())
        torch.testing.assert_close(values, want_values)
        torch.testing.assert_close(grads, want_grads)


def test_stacked_heads_matches_eager(patched):
    f = _f(patched)
    w = torch.linspace(0.5, 2.0, 12, dtype=torch.float64).reshape(3, 4)
    heads = funcgrad.stacked_heads(lambda w_j, y: (w_j * y).sum() ** 2, w)
    want_v, want_g = [], []
    for j in range(3):
        leaf = _x().requires_grad_()
        value = ((w[j] * f(leaf)).sum()) ** 2
        want_v.append(value.detach())
        want_g.append(torch.autograd.grad(value, leaf)[0])
    fn = funcgrad.compose_heads(f, heads)
    for _ in range(3):
        values, grads = fn(_x())
        torch.testing.assert_close(values, torch.stack(want_v))
        torch.testing.assert_close(grads, torch.stack(want_g))


def test_pullback_matches_eager(patched):
    f = _f(patched)
    leaf = _x().requires_grad_()
    y_want = f(leaf)
    cotangents = [torch.ones(4, dtype=torch.float64), torch.arange(4.0, dtype=torch.float64)]
    want = [torch.autograd.grad(y_want, leaf, v, retain_graph=True)[0] for v in cotangents]
    for _ in range(3):
        y, pb = funcgrad.pullback(f, _x())
        torch.testing.assert_close(y, y_want.detach())
        for v, g in zip(cotangents, want):
            torch.testing.assert_close(pb(v)[0], g)


@pytest.mark.parametrize("level", ["features", "params"])
def test_combine_heads_matches_eager(patched, level):
    f = _f(patched)
    _, jac = _reference(f, _x())
    weights = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)
    want = weights @ jac
    fn = funcgrad.combine_heads(f, HEADS, lambda gramian: weights, level=level)
    for _ in range(3):
        _, grad, _ = fn(_x())
        torch.testing.assert_close(grad, want)


class _Net(nn.Module):
    """A module of its own (no per-example rule): the generic rule calls its forward a
    second time under its modes."""

    def __init__(self, use: Callable[[torch.Tensor], Any]) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 4, dtype=torch.float64))
        self.use = use

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.use(x * self.w).sum(-1)


def _assert_gramian_matches_a_loop(net: torch.nn.Module) -> None:
    """per_example's Gramian on calls 1-3 against a per-example loop of autograd.grad."""
    x = torch.linspace(-1.0, 1.0, 24, dtype=torch.float64).reshape(6, 4)
    params = list(net.parameters())
    rows = []
    for b in range(6):
        grads = torch.autograd.grad(net(x[b : b + 1]).sum(), params)
        rows.append(torch.cat([g.flatten() for g in grads]))
    jac = torch.stack(rows)
    pe = funcgrad.per_example(net)
    for _ in range(3):
        torch.testing.assert_close(pe.gramian(net(x)), jac @ jac.T)


def test_per_example_matches_a_loop(patched):
    net = _Net(patched)
    _assert_gramian_matches_a_loop(net)


def test_grads_and_backward_match_eager(patched):
    # (they take a graph f already built eagerly: no mode; kept as the reference's check)
    f = _f(patched)
    for _ in range(3):
        leaf = _x().requires_grad_()
        y = f(leaf)
        losses = [h(y) for h in HEADS]
        _, want = _reference(f, _x())
        got = funcgrad.grads(losses, leaf, through=y)[0]
        torch.testing.assert_close(got, want)


def _my_op(x: torch.Tensor) -> torch.Tensor:
    if torch.overrides.has_torch_function_unary(x):
        return torch.overrides.handle_torch_function(_my_op, (x,), x)
    return 3 * x.sin()


def _public(x: torch.Tensor) -> torch.Tensor:
    return _dispatch(x)


def _dispatch(x: torch.Tensor) -> torch.Tensor:
    if torch.overrides.has_torch_function_unary(x):
        # (a library dispatching its public function from a private helper)
        return torch.overrides.handle_torch_function(_public, (x,), x)
    return x.cos() * 2


@pytest.mark.parametrize("strategy", ["vjp", "jacrev", "jacfwd", "loop"])
def test_a_users_own_overridable_function_still_runs(strategy):
    def f(x: torch.Tensor) -> torch.Tensor:
        return _my_op(x) + _public(x)

    want_values, want_grads = _reference(f, _x())
    fn = funcgrad.compose_heads(f, HEADS, strategy=strategy)
    for _ in range(3):
        values, grads = fn(_x())
        torch.testing.assert_close(values, want_values)
        torch.testing.assert_close(grads, want_grads)


def test_an_unresolvable_replacement_is_refused_before_any_backward(monkeypatch):
    # A C namespace's function replaced before funcgrad's import (its snapshot is emptied
    # here): no original is known, so the watched call refuses, naming it, before any
    # backward, and .grad is untouched.
    import funcgrad._function as function

    monkeypatch.setattr(function, "_C_NAMESPACES", ((torch._C._nn, {}),))
    monkeypatch.setattr(torch._C._nn, "gelu", _lambda_relu(torch._C._nn.gelu))
    x = torch.nn.Parameter(_x())
    fn = funcgrad.combine_heads(
        lambda x: F.gelu(x), HEADS, lambda g: torch.ones(3, dtype=g.dtype), level="params"
    )
    with pytest.raises(ReplacedTorchFunction, match=r"torch\._C\._nn\.gelu") as info:
        fn(x)
    assert "was replaced by a Python function that is not torch's (function " in str(info.value)
    assert x.grad is None


def test_a_wrapped_c_function_replaced_before_import_runs_its_original(monkeypatch):
    # The same, with functools.wraps: the original is the replacement's __wrapped__.
    import funcgrad._function as function

    monkeypatch.setattr(function, "_C_NAMESPACES", ((torch._C._nn, {}),))
    orig = torch._C._nn.gelu
    inner = functools.wraps(orig)(_lambda_relu(orig))
    # (two libraries' wrappers: the whole __wrapped__ chain is followed)
    monkeypatch.setattr(torch._C._nn, "gelu", functools.wraps(inner)(_lambda_relu(inner)))
    want_values, want_grads = _reference(F.gelu, _x())
    fn = funcgrad.compose_heads(F.gelu, HEADS)
    for _ in range(3):
        values, grads = fn(_x())
        torch.testing.assert_close(values, want_values)
        torch.testing.assert_close(grads, want_grads)


def test_new_shapes_and_a_worker_thread_match_eager(patched):
    # each new shape's first call is watched again; a call from another thread too
    import threading

    f = _f(patched)
    fn = funcgrad.compose_heads(f, HEADS)
    for n in (4, 5, 4, 7):
        x = torch.linspace(-1.0, 1.5, n, dtype=torch.float64)
        want_values, want_grads = _reference(f, x)
        values, grads = fn(x)
        torch.testing.assert_close(values, want_values)
        torch.testing.assert_close(grads, want_grads)
    x = torch.linspace(-1.0, 1.5, 6, dtype=torch.float64)
    got: list[Any] = []
    worker = threading.Thread(target=lambda: got.append(fn(x)))
    worker.start()
    worker.join()
    want_values, want_grads = _reference(f, x)
    torch.testing.assert_close(got[0][0], want_values)
    torch.testing.assert_close(got[0][1], want_grads)


class _Twice(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return 2 * x

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        pass

    @staticmethod
    def jvp(ctx: Any, tangent: torch.Tensor) -> torch.Tensor:
        return 2 * tangent

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return 2 * grad


@pytest.mark.parametrize("strategy", ["vjp", "jacrev", "jacfwd", "loop"])
def test_torch_callables_that_are_not_functions_still_run(strategy):
    # (an autograd.Function's apply hands the mode a HigherOrderOperator instance under
    # torch.func; a partial of a torch function stays torch's)
    def f(x: torch.Tensor) -> torch.Tensor:
        return _Twice.apply(x).sin() + functools.partial(torch.mul, other=3.0)(x)

    want_values, want_grads = _reference(f, _x())
    fn = funcgrad.compose_heads(f, HEADS, strategy=strategy)
    for _ in range(3):
        values, grads = fn(_x())
        torch.testing.assert_close(values, want_values)
        torch.testing.assert_close(grads, want_grads)


def _my_op_kw(x: torch.Tensor, scale: float = 3.0) -> torch.Tensor:
    if torch.overrides.has_torch_function_unary(x):
        return torch.overrides.handle_torch_function(_my_op_kw, (x,), x, scale=scale)
    return scale * x.sin()


def test_a_users_own_function_with_keywords_runs_under_every_mode():
    # (NoOutsideWrites hands an op with keywords on to _Draws: found once, not twice)
    from funcgrad._function import NoOutsideWrites, _Draws

    x = _x()
    want = 2.0 * x.sin()
    for mode in (lambda: _Draws({}), lambda: NoOutsideWrites({}, [x])):
        with torch.inference_mode(), mode():
            torch.testing.assert_close(_my_op_kw(x, scale=2.0), want)
    fn = funcgrad.compose_heads(lambda x: _my_op_kw(x, scale=2.0), HEADS)
    fn.plan(_x())
    want_values, want_grads = _reference(lambda x: _my_op_kw(x, scale=2.0), _x())
    for _ in range(3):
        values, grads = fn(_x())
        torch.testing.assert_close(values, want_values)
        torch.testing.assert_close(grads, want_grads)


@dataclasses.dataclass
class _Scale:
    # (a user's overridable op as a dataclass instance: eq=True makes it unhashable)
    s: float

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if torch.overrides.has_torch_function_unary(x):
            return torch.overrides.handle_torch_function(self, (x,), x)
        return x * self.s


def test_an_unhashable_users_callable_runs_under_every_entry_point():
    op = _Scale(3.0)
    with pytest.raises(TypeError):
        hash(op)

    def f(x: torch.Tensor) -> torch.Tensor:
        return op(x).sin()

    want_values, want_grads = _reference(f, _x())
    fn = funcgrad.compose_heads(f, HEADS)
    fn.plan(_x())
    combined = funcgrad.combine_heads(f, HEADS, lambda g: torch.ones(3, dtype=g.dtype))
    for _ in range(3):
        values, grads = fn(_x())
        torch.testing.assert_close(values, want_values)
        torch.testing.assert_close(grads, want_grads)
        y, pb = funcgrad.pullback(f, _x())
        torch.testing.assert_close(y, f(_x()))
        torch.testing.assert_close(pb(torch.ones(4, dtype=torch.float64))[0], want_grads[0])
        torch.testing.assert_close(combined(_x())[1], want_grads.sum(0))
    net = _Net(op)
    _assert_gramian_matches_a_loop(net)
