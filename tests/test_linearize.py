"""f's linearisation (``funcgrad._linearize``).

Every message piece in funcgrad._linearize.TORCH_LIMITS, triggered on the installed
torch: a torch upgrade that rewords one fails here, instead of silently changing which path
funcgrad takes (a fallback to eager autograd, to a loop, or to reverse mode). Then the eager
fallback where torch.func cannot differentiate f (old-style custom Functions, BatchNorm in
training mode), on every entry point, and the replay of random draws: every re-run of f
draws as one eager forward, against that forward."""

from __future__ import annotations

import ast
import contextlib
import copy
import pathlib
import warnings

import pytest
import torch
import torch.utils.checkpoint
from helpers import (
    DROPOUT_BN_HEADS,
    HEADS,
    SIDE_HEADS,
    SIDE_W,
    _dropout_batchnorm,
    autograd_reference,
    compiled_stand_in,
    one_input_function,
)
from torch import nn

import funcgrad
from funcgrad import _linearize
from funcgrad._types import STRATEGIES


class _WithoutSetupContext(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


class _WithoutJvp(torch.autograd.Function):
    @staticmethod
    def forward(x):
        return x * 2

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return g * 2


def _x():
    return torch.rand(3, dtype=torch.float64) + 1


_CAPTURED = torch.ones(3, dtype=torch.float64, requires_grad=True)


def _grads_to_captured(t):
    y = _CAPTURED * t
    return funcgrad.grads(y.sum(), _CAPTURED, through=y)[0].sum()


TRIGGERS = {
    "function without setup_context": lambda: torch.func.vjp(_WithoutSetupContext.apply, _x()),
    "no storage": lambda: torch.func.vmap(lambda t: t.data_ptr())(torch.randn(3, 4)),
    "wrapper storage": lambda: torch.func.grad(lambda t: (t.untyped_storage(), t.sum())[1])(_x()),
    "saved tensor hooks": lambda: torch.func.vjp(
        lambda x: torch.utils.checkpoint.checkpoint(torch.sin, x, use_reentrant=False), _x()
    ),
    "requires_grad_": lambda: torch.func.vjp(lambda x: x.detach().requires_grad_() * x, _x()),
    "retain_grad": lambda: torch.func.vjp(lambda x: (x * 2).retain_grad(), _x()),
    "mutates a captured tensor": lambda: torch.func.vjp(
        torch.nn.BatchNorm1d(3).double(), torch.randn(4, 3, dtype=torch.float64)
    ),
    "no forward AD formula": lambda: torch.func.jvp(
        lambda t: torch.special.zeta(t, t), (_x(),), (_x(),)
    ),
    "custom Function without jvp": lambda: torch.func.jvp(_WithoutJvp.apply, (_x(),), (_x(),)),
    "custom Function jvp": lambda: torch.func.jvp(_WithoutJvp.apply, (_x(),), (_x(),)),
    # torch.autograd.grad, and funcgrad.grads, inside a transform to a captured tensor.
    "unused": lambda: torch.func.grad(
        lambda t: torch.autograd.grad((_CAPTURED * t).sum(), _CAPTURED)[0].sum()
    )(_x()),
    "untracked": lambda: torch.func.grad(_grads_to_captured)(_x()),
    # torch.autograd.grad inside f under forward mode.
    "no grad_fn": lambda: torch.func.jvp(
        lambda t: torch.autograd.grad((_CAPTURED * t).sum(), _CAPTURED)[0].sum(), (_x(),), (_x(),)
    ),
    # not_implemented(...) formulas: the same helper words forward and reverse formulas.
    "derivative not implemented": lambda: torch.func.vjp(
        lambda t: torch.special.zeta(t, _x()), _x()
    )[1](_x()),
}


@pytest.mark.parametrize("name", sorted(TRIGGERS))
def test_each_limit_is_recognised_on_the_installed_torch(name):
    with warnings.catch_warnings(), pytest.raises((RuntimeError, NotImplementedError)) as error:
        warnings.simplefilter("ignore")
        TRIGGERS[name]()
    assert _linearize.TORCH_LIMITS[name].pattern in str(error.value)


def test_the_cpp_custom_function_message_is_in_the_installed_torch():
    """A C++ custom Function cannot be built from here (no compiler in the tests): the
    message is read from libtorch itself."""
    lib = pathlib.Path(torch.__file__).parent / "lib"
    pattern = _linearize.TORCH_LIMITS["C++ custom Function jvp"].pattern.encode()
    assert any(pattern in path.read_bytes() for path in lib.glob("libtorch_cpu.*"))


def test_the_donated_buffers_message_is_in_the_installed_torch():
    """Whether a compiled backward donates its buffers depends on the process's compile
    state (tests/test_real_stacks.py meets it on a compiled encoder): the message is read
    from the string constants of the aot_autograd module that raises it."""
    from torch._functorch._aot_autograd import runtime_wrappers

    tree = ast.parse(pathlib.Path(runtime_wrappers.__file__).read_text())
    strings = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)]
    pattern = _linearize.TORCH_LIMITS["donated buffers"].pattern
    assert any(isinstance(text, str) and pattern in text for text in strings)


def test_every_limit_has_a_trigger():
    assert set(TRIGGERS) | {"C++ custom Function jvp", "donated buffers"} == set(
        _linearize.TORCH_LIMITS
    )


def test_the_users_own_errors_are_no_limit():
    assert _linearize.torch_limit(RuntimeError("shapes cannot be multiplied")) is None
    assert _linearize.torch_limit(ValueError("forward AD")) is None
    # (review core5 F5: the patterns were pieces a user's own message may hold)
    assert _linearize.torch_limit(RuntimeError("my library: forward AD is off")) is None
    assert _linearize.torch_limit(RuntimeError("no forward mode AD here")) is None


# -- torch.func cannot differentiate f: one eager autograd graph ------------------------------


class OldStyleSin(torch.autograd.Function):
    """No setup_context: torch.func cannot differentiate it at all, autograd can."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.sin()

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * x.cos()


@pytest.mark.parametrize("strategy", ["auto", "vjp", "jacrev", "jacfwd", "loop"])
def test_torch_func_failure_falls_back_to_eager_autograd(strategy):
    f = lambda x: OldStyleSin.apply(x) * 2  # noqa: E731
    x = torch.randn(3)
    want = torch.stack(autograd_reference(f, HEADS, (x,))[1])
    fn = funcgrad.compose_heads(f, HEADS, strategy=strategy)
    if strategy == "auto":  # eager autograd first, then torch.func tried quietly: no fallback
        for _ in range(4):  # to warn about
            torch.testing.assert_close(fn(x)[1], want)
        assert fn.plan(x).engine == "autograd"
    # (auto: with a graph of the results wanted, torch.func it is, and its fallback warns)
    fn = funcgrad.compose_heads(f, HEADS, strategy=strategy, create_graph=strategy == "auto")
    with pytest.warns(
        funcgrad.FuncgradWarning,
        match=r"torch.func cannot differentiate f .*eager torch.autograd.grad",
    ):
        _, grads = fn(x)
    torch.testing.assert_close(grads, want)
    # pullback runs f on eager autograd from the start (outside transforms): no fallback.
    _, pb = funcgrad.pullback(f, x)
    torch.testing.assert_close(pb(torch.ones(3))[0], 2 * torch.cos(x))


class _VmappableWithoutJvp(_WithoutJvp):
    generate_vmap_rule = True  # (vmap can batch it; forward mode has no formula)


_W = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)  # captured by f


def _autograd_to_captured(x):  # torch.autograd.grad inside f, to a captured parameter
    y = torch.tanh(_W @ torch.sin(x))
    (g,) = torch.autograd.grad((y**2).sum(), _W, create_graph=True)
    return g.sum(0) * y + torch.cos(x)


def _grads_to_captured_w(x):  # funcgrad.grads inside f, to a captured parameter
    y = torch.tanh(_W @ torch.sin(x))
    (g,) = funcgrad.grads((y**2).sum(), _W, through=y, create_graph=True)
    return g[0].sum(0) * y + torch.cos(x)  # (one output: g is (1, 3, 3))


_FALLBACK_CASES = {
    # forward mode cannot differentiate f; reverse mode on torch.func can
    "custom Function without jvp": (lambda x: _VmappableWithoutJvp.apply(x).sin(), 2, 1),
    # forward mode and torch.func both refuse f (a backward inside f to a captured
    # tensor): eager autograd
    "torch.autograd.grad inside f": (_autograd_to_captured, 3, 2),
    "funcgrad.grads inside f": (_grads_to_captured_w, 3, 1),
}


@pytest.mark.parametrize("case", list(_FALLBACK_CASES))
def test_jacfwd_remembers_its_fallback(case):
    """strategy="jacfwd" on f that forward mode cannot run: the first call of the signature
    falls back (f's runs and warnings as listed), and every later call goes the same way at
    once: f runs once, no warning, the answer autograd's, and plan() says so (before: forward
    mode was tried again on every call, f ran up to three times, with the warnings)."""
    f, first_runs, first_warnings = _FALLBACK_CASES[case]
    runs = []

    def counted(x):
        runs.append(1)
        return f(x)

    x = _x()
    want = torch.stack(autograd_reference(f, HEADS, (x,))[1])
    fn = funcgrad.compose_heads(counted, HEADS, strategy="jacfwd")
    for call in range(4):
        runs.clear()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always", funcgrad.FuncgradWarning)
            _, grads = fn(x)
        ours = [w for w in seen if issubclass(w.category, funcgrad.FuncgradWarning)]
        torch.testing.assert_close(grads, want, msg=f"call {call + 1}")
        if call == 0:
            assert (len(runs), len(ours)) == (first_runs, first_warnings)
            # forward mode itself failed, not vmap's batching of it
            assert not any("vmap cannot batch" in str(w.message) for w in ours)
        else:
            assert (len(runs), len(ours)) == (1, 0), f"call {call + 1}"
    plan = fn.plan(x)
    assert plan.strategy == "vjp" and plan.measured.startswith("forward mode fell back")
    assert plan.engine == ("torch.func" if first_runs == 2 else "autograd")


class _NoJvpNoVmap(torch.autograd.Function):
    """No jvp and no vmap rule: forward mode cannot batch it."""

    @staticmethod
    def forward(x):
        return x.sin()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * x.cos()


@pytest.mark.parametrize(
    "order", [(5, 5, 2, 2, 7, 3), (2, 5, 2, 3, 7)], ids=["lost first", "worked first"]
)
def test_jacfwd_fallback_is_remembered_for_every_signature(order):
    """Found by review (core5 F2): the function's facts, which seed a new signature, were the
    last-written signature's, so whether a new shape tried forward mode again (a warning, f
    twice) flipped with the order the shapes came in. Once forward mode fell back on one
    signature, every signature runs reverse mode from the next call: f once, no warning."""

    def f(x):  # forward mode cannot run it where x has more than 3 entries
        runs.append(1)
        return (_NoJvpNoVmap.apply(x) if x.shape[0] > 3 else x.sin()) * 2

    runs: list[int] = []
    fn = funcgrad.compose_heads(f, HEADS, strategy="jacfwd")
    lost = False
    for n in order:
        x = torch.randn(n, dtype=torch.float64)
        runs.clear()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always", funcgrad.FuncgradWarning)
            _, grads = fn(x)
        ran = len(runs)
        torch.testing.assert_close(grads, torch.stack(autograd_reference(f, HEADS, (x,))[1]))
        fell_back = not lost and n > 3
        assert (ran, len(seen)) == ((2, 1) if fell_back else (1, 0)), n
        lost = lost or fell_back
        assert fn.plan(x).strategy == ("vjp" if lost else "jacfwd"), n


def test_jacfwd_fallback_inside_a_transform_is_remembered():
    """Found by review (core5 F4): inside a user's vmap no record is kept, and the fallback
    was not carried either: forward mode was tried again on every call (f twice, a
    warning). It is remembered for the function, inside the transform and out."""
    runs: list[int] = []

    def f(x):
        runs.append(1)
        return _VmappableWithoutJvp.apply(x).sin()

    fn = funcgrad.compose_heads(f, HEADS, strategy="jacfwd")
    xs = torch.randn(2, 3, dtype=torch.float64)
    for call in range(3):
        runs.clear()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always", funcgrad.FuncgradWarning)
            grads = torch.func.vmap(lambda x: fn(x)[1])(xs)
        ran = len(runs)
        ours = [w for w in seen if issubclass(w.category, funcgrad.FuncgradWarning)]
        for row, x in zip(grads, xs):
            torch.testing.assert_close(row, torch.stack(autograd_reference(f, HEADS, (x,))[1]))
        assert (ran, len(ours)) == ((2, 1) if call == 0 else (1, 0)), f"call {call + 1}"
    x = xs[0]
    runs.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error", funcgrad.FuncgradWarning)
        fn(x)
    assert len(runs) == 1 and fn.plan(x).strategy == "vjp"


def test_a_quiet_jacfwd_fallback_claims_no_warning():
    """Found by review (core5 F3): where forward mode fell back without a warning (f turns
    on its own input's grad to take a gradient inside: torch.func's limit, run on eager
    autograd), plan() said "(one warning then)". It claims no warning now."""

    def f(x):  # a force field: minus the gradient of an energy, taken inside f
        with torch.enable_grad():
            if not x.requires_grad:
                x = x.requires_grad_()
            energy = (x.sin() ** 2).sum() + (x[:-1] * x[1:]).sum()
            return -torch.autograd.grad(energy, x, create_graph=True)[0]

    fn = funcgrad.compose_heads(f, HEADS, strategy="jacfwd")
    x = _x()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", funcgrad.FuncgradWarning)
        _, grads = fn(x)
    assert not [w for w in seen if issubclass(w.category, funcgrad.FuncgradWarning)]
    torch.testing.assert_close(grads, torch.stack(autograd_reference(f, HEADS, (x,))[1]))
    plan = fn.plan(x)
    assert plan.strategy == "vjp" and plan.measured.startswith("forward mode fell back")
    assert "warning" not in plan.measured


def _raises_its_own(x):
    raise RuntimeError("config error: forward AD is disabled in my library")


def _misuses_autograd(x):
    constant = torch.ones(3, dtype=torch.float64)
    torch.autograd.grad(constant.sum(), constant)  # the user's bug: raises under any mode
    return x.sin()


@pytest.mark.parametrize("f", [_raises_its_own, _misuses_autograd], ids=["own", "misuse"])
def test_a_users_own_error_under_jacfwd_is_not_called_a_forward_mode_limit(f):
    """Found by review (core5 F5): f's own RuntimeError under jacfwd came with a warning
    "forward mode cannot differentiate f" (its message held a limit's pattern, or read as
    one), then the same error from reverse mode. An error that reverse mode raises too is
    f's own: it propagates, with no warning about forward mode."""
    fn = funcgrad.compose_heads(f, HEADS, strategy="jacfwd")
    for _ in range(2):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always", funcgrad.FuncgradWarning)
            with pytest.raises(RuntimeError, match=r"config error|does not require grad"):
                fn(_x())
        assert not [w for w in seen if issubclass(w.category, funcgrad.FuncgradWarning)]


def test_a_vmap_only_limit_under_jacfwd_says_vmap():
    """Found by review (core5 F8): a limit of vmap alone (f reads a data pointer, which a
    batched tensor has not) under jacfwd was called "forward mode cannot differentiate f".
    It says vmap cannot batch the JVPs; the warning points at the user's call."""

    def f(x):
        x.data_ptr()
        return x.sin() * 2

    fn = funcgrad.compose_heads(f, HEADS, strategy="jacfwd")
    x = _x()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", funcgrad.FuncgradWarning)
        _, grads = fn(x)
    torch.testing.assert_close(grads, torch.stack(autograd_reference(f, HEADS, (x,))[1]))
    ours = [w for w in seen if issubclass(w.category, funcgrad.FuncgradWarning)]
    forward = [w for w in ours if "JVP" in str(w.message) or "forward mode" in str(w.message)]
    assert len(forward) == 1 and "vmap cannot batch its JVPs" in str(forward[0].message)
    assert forward[0].filename == __file__


def test_forward_mode_limit_is_named_as_such():
    """An op without a forward-mode formula under jacfwd: the warning says forward mode
    cannot differentiate f (before: "vmap cannot batch its JVPs", which was not the cause)."""
    fn = funcgrad.compose_heads(
        lambda x: _VmappableWithoutJvp.apply(x).sin(), HEADS, strategy="jacfwd"
    )
    with pytest.warns(funcgrad.FuncgradWarning, match="forward mode cannot differentiate f"):
        fn(_x())


def test_chunked_linear_cross_entropy_falls_back_to_autograd():
    weight, target = torch.randn(7, 5), torch.randint(0, 7, (6,))
    options = torch.nn.LinearCrossEntropyOptions()

    def f(x):
        return torch.nn.functional.linear_cross_entropy(
            x, weight, target, options=options, reduction="none"
        )

    def reference_f(x):
        return torch.nn.functional.linear_cross_entropy(x, weight, target, reduction="none")

    x = torch.randn(6, 5)
    want = torch.stack(autograd_reference(reference_f, HEADS, (x,))[1])
    with pytest.warns(funcgrad.FuncgradWarning, match="torch.func cannot differentiate f"):
        _, grads = funcgrad.compose_heads(f, HEADS, strategy="vjp")(x)
    torch.testing.assert_close(grads, want)
    # auto runs eager autograd first, whose vmap cannot batch this backward (one warning;
    # the loop from the next call on); no torch.func to fall back from
    fn = funcgrad.compose_heads(f, HEADS)
    with pytest.warns(funcgrad.FuncgradWarning, match="vmap could not batch f's pullback"):
        torch.testing.assert_close(fn(x)[1], want)
    for _ in range(3):
        torch.testing.assert_close(fn(x)[1], want)
    assert fn.plan(x).strategy == "loop" and fn.plan(x).engine == "autograd"


# -- every re-run of f replays the first run's draws: as one eager forward -------------------


def _batchnorm_model():
    torch.manual_seed(3)
    return torch.nn.Sequential(
        torch.nn.Linear(3, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 20)
    ).double()


@pytest.mark.parametrize("strategy", ["auto", "vjp", "jacrev", "jacfwd", "loop"])
def test_buffers_are_updated_once_per_call(strategy):
    model, once = _batchnorm_model(), _batchnorm_model()
    heads = [lambda y, i=i: (y * (i + 1)).sin().sum() for i in range(16)]  # n = 6, m = 40
    fn = funcgrad.compose_heads(model, heads, strategy=strategy)
    x = torch.randn(2, 3, dtype=torch.float64)
    for _ in range(3):
        reference = copy.deepcopy(once)  # (its statistics move once per head)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", funcgrad.FuncgradWarning)  # the eager fallback's
            values, grads = fn(x)
        once(x)  # one eager forward per call
        want_values, want_grads = autograd_reference(reference, heads, (x,))
        torch.testing.assert_close(values, torch.stack(want_values))
        torch.testing.assert_close(grads, torch.stack(want_grads))
        assert int(model[1].num_batches_tracked) == int(once[1].num_batches_tracked)
        torch.testing.assert_close(model[1].running_mean, once[1].running_mean)
        torch.testing.assert_close(model[1].running_var, once[1].running_var)


# No jvp: forward mode cannot differentiate it, reverse mode can.
_Square = one_input_function(lambda x: x * x, lambda x, grad: 2 * x * grad)


def _generator_f(generator, *, batchnorm=None, no_jvp=False):
    def f(x):
        y = torch.tanh(x @ SIDE_W)
        mask = torch.rand(y.shape, generator=generator, dtype=y.dtype) > 0.5
        y = y * mask + torch.randn(y.shape, generator=generator, dtype=y.dtype)
        if no_jvp:  # after the draws: a failed forward-mode attempt has drawn
            y = _Square.apply(y)
        return y if batchnorm is None else batchnorm(y[None].expand(2, 5) * x.sum())[0]

    return f


def _eager_reference(f, heads, x, generator, seed):
    """Values, per-head gradients and the generator's final state of one eager forward."""
    generator.manual_seed(seed)
    xr = x.clone().requires_grad_()
    y = f(xr)
    state = generator.get_state()
    values = torch.stack([head(y) for head in heads]).detach()
    grads = torch.stack([torch.autograd.grad(head(y), xr, retain_graph=True)[0] for head in heads])
    return values, grads, state


@pytest.mark.parametrize("case", ["plain", "check", "eager fallback", "forward-mode fallback"])
@pytest.mark.parametrize("strategy", ["auto", "vjp", "jacrev", "jacfwd", "loop"])
def test_a_user_generator_draws_as_in_one_eager_forward(strategy, case):
    generator = torch.Generator().manual_seed(0)
    reference_generator = torch.Generator()
    kwargs = {"batchnorm": None, "no_jvp": case == "forward-mode fallback"}
    if case == "eager fallback":  # BatchNorm in training mode: torch.func refuses, eager runs
        kwargs["batchnorm"] = torch.nn.BatchNorm1d(5).double()
    f = _generator_f(generator, **kwargs)
    reference_kwargs = dict(
        kwargs, batchnorm=kwargs["batchnorm"] and copy.deepcopy(kwargs["batchnorm"])
    )
    reference_f = _generator_f(reference_generator, **reference_kwargs)
    fn = funcgrad.compose_heads(f, SIDE_HEADS, strategy=strategy, check=case == "check")
    x = torch.randn(2, dtype=torch.float64)
    for seed in range(3):  # the first call (auto: both modes, timed), then planned calls
        generator.manual_seed(seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", funcgrad.FuncgradWarning)  # the fallbacks'
            values, grads = fn(x)
        want_values, want_grads, want_state = _eager_reference(
            reference_f, SIDE_HEADS, x, reference_generator, seed
        )
        torch.testing.assert_close(values, want_values)
        torch.testing.assert_close(grads, want_grads)
        assert torch.equal(generator.get_state(), want_state)


@pytest.mark.parametrize("level", ["features", "params"])
def test_a_user_generator_in_the_eager_fallbacks_of_combine_heads_and_pullback(level):
    generator, reference_generator = torch.Generator(), torch.Generator()
    batchnorm = torch.nn.BatchNorm1d(5).double()
    f = _generator_f(generator, batchnorm=batchnorm)
    reference_f = _generator_f(reference_generator, batchnorm=copy.deepcopy(batchnorm))
    x = torch.randn(2, dtype=torch.float64)
    generator.manual_seed(4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", funcgrad.FuncgradWarning)
        values, grad, _ = funcgrad.combine_heads(f, SIDE_HEADS, level=level)(x)
    want_values, want_grads, want_state = _eager_reference(
        reference_f, SIDE_HEADS, x, reference_generator, 4
    )
    torch.testing.assert_close(values, want_values)
    torch.testing.assert_close(grad, want_grads.sum(0))
    assert torch.equal(generator.get_state(), want_state)

    generator.manual_seed(5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", funcgrad.FuncgradWarning)
        out, pb = funcgrad.pullback(f, x)
    state = generator.get_state()
    reference_generator.manual_seed(5)
    xr = x.clone().requires_grad_()
    y = reference_f(xr)
    assert torch.equal(state, reference_generator.get_state())
    torch.testing.assert_close(out, y.detach())
    cotangent = torch.randn(5, dtype=torch.float64)
    torch.testing.assert_close(pb(cotangent)[0], torch.autograd.grad(y, xr, cotangent)[0])


def test_f_is_watched_for_generators_only_where_it_drew_from_one():
    modes = []

    def f(x):
        modes.append(len(torch.overrides._get_current_function_mode_stack()))
        return torch.tanh(x @ SIDE_W)

    fn = funcgrad.compose_heads(f, SIDE_HEADS, strategy="vjp")
    x = torch.randn(2, dtype=torch.float64)
    fn(x)
    fn(x)
    assert modes == [1, 0]  # the first call on these shapes watched; the next one need not
    modes.clear()
    combined = funcgrad.combine_heads(f, SIDE_HEADS, level="features")
    combined(x)
    combined(x)
    assert modes == [1, 0]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_dropout_before_batchnorm_through_the_eager_fallback_equals_one_eager_forward(strategy):
    model, x = _dropout_batchnorm(), torch.randn(6, 4)
    reference = copy.deepcopy(model)
    params = {name: p.detach() for name, p in model.named_parameters()}

    def f(p, inputs):
        return torch.func.functional_call(model, p, (inputs,))

    fn = funcgrad.compose_heads(f, DROPOUT_BN_HEADS, strategy=strategy)
    torch.manual_seed(11)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", funcgrad.FuncgradWarning)  # the fallback's warning
        values, grads = fn(params, x)
    state_after = torch.get_rng_state()

    torch.manual_seed(11)
    y = reference(x)  # one eager forward under the same seed
    assert torch.equal(torch.get_rng_state(), state_after)
    for i, head in enumerate(DROPOUT_BN_HEADS):
        z = head(y)
        torch.testing.assert_close(values[i], z.detach())
        expected = torch.autograd.grad(z, list(reference.parameters()), retain_graph=True)
        for name, e in zip(params, expected):
            torch.testing.assert_close(grads[name][i], e)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(model[2], name), getattr(reference[2], name))


@pytest.mark.parametrize("level", ["params", "features"])
def test_dropout_before_batchnorm_in_combine_heads_and_pullback(level):
    model, x = _dropout_batchnorm(), torch.randn(6, 4)
    reference = copy.deepcopy(model)
    params = {name: p.detach() for name, p in model.named_parameters()}

    def f(p, inputs):
        return torch.func.functional_call(model, p, (inputs,))

    torch.manual_seed(11)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", funcgrad.FuncgradWarning)
        _values, grad, _ = funcgrad.combine_heads(f, DROPOUT_BN_HEADS, level=level)(params, x)
    state_after = torch.get_rng_state()
    torch.manual_seed(11)
    y = reference(x)
    assert torch.equal(torch.get_rng_state(), state_after)
    total = sum(head(y) for head in DROPOUT_BN_HEADS)
    expected = torch.autograd.grad(total, list(reference.parameters()))
    for name, e in zip(params, expected):
        torch.testing.assert_close(grad[name], e)
    torch.testing.assert_close(model[2].running_mean, reference[2].running_mean)

    model, reference = _dropout_batchnorm(), _dropout_batchnorm()
    torch.manual_seed(11)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", funcgrad.FuncgradWarning)
        out, _pb = funcgrad.pullback(lambda p: torch.func.functional_call(model, p, (x,)), params)
    state_after = torch.get_rng_state()
    torch.manual_seed(11)
    torch.testing.assert_close(out, reference(x))
    assert torch.equal(torch.get_rng_state(), state_after)


# -- BatchNorm in training mode: the eager fallback, statistics updated once -------------------


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
    if strategy == "auto":  # its first call runs on eager autograd: no fallback, no warning
        with warnings.catch_warnings():
            warnings.simplefilter("error", funcgrad.FuncgradWarning)
            losses, grads = fn(params, batch)
    else:
        with pytest.warns(funcgrad.FuncgradWarning) as record:
            losses, grads = fn(params, batch)
        messages = [
            str(w.message) for w in record if issubclass(w.category, funcgrad.FuncgradWarning)
        ]
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


@pytest.mark.parametrize(("strategy", "passes"), [("vjp", 1), ("loop", 3)])
def test_batchnorm_fallback_still_batches_with_vmap(strategy, passes):
    """The eager path is vmap over torch.autograd.grad, as TorchJD batches: the 3 heads'
    cotangents go through f in one backward pass (counted at f's output); a loop, asked
    for, takes one a head."""
    encoder, tasks = _backbone()
    params = {name: p.detach() for name, p in encoder.named_parameters()}
    heads = [lambda y, t=t: t(y).pow(2).mean() for t in tasks]
    counter = funcgrad.PassCounter()

    def features(p, x):
        return counter(torch.func.functional_call(encoder, p, (x,)))

    fn = funcgrad.compose_heads(features, heads, strategy=strategy)
    batch = torch.randn(8, 3)
    with pytest.warns(funcgrad.FuncgradWarning, match="BatchNorm"):
        fn(params, batch)
    assert counter.backward == passes
    plan = fn.plan(params, batch)
    assert (plan.engine, plan.passes) == ("autograd", passes)


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
    out, pb = funcgrad.pullback(encoder, batch)  # on eager autograd: no fallback, no warning
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


@pytest.mark.parametrize("entry", ["compose_heads", "combine_heads", "pullback"])
def test_create_graph_on_the_eager_fallback(entry):
    """BatchNorm in training mode: torch.func refuses f, funcgrad runs it on eager autograd;
    with create_graph=True the results still carry their graph (found by the adversarial
    review: they came back with requires_grad=False), against autograd's double backward."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(3, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh(), torch.nn.Linear(8, 2)
    ).double()
    x = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    heads = [lambda y: y[:, 0].sum(), lambda y: y[:, 1].pow(2).sum()]
    # (pullback runs f on eager autograd from the start: no fallback, no warning)
    falls_back = entry != "pullback"
    with (
        pytest.warns(funcgrad.FuncgradWarning, match="captured tensor")
        if falls_back
        else (contextlib.nullcontext())
    ):
        if entry == "compose_heads":
            got = funcgrad.compose_heads(model, heads, create_graph=True)(x)[1].sum(0)
        elif entry == "combine_heads":
            got = funcgrad.combine_heads(model, heads, create_graph=True)(x)[1]
        else:
            y, pb = funcgrad.pullback(model, x)
            assert not pb(torch.ones_like(y))[0].requires_grad
            got = pb(torch.stack([torch.ones(6), 2 * y[:, 1]], 1), create_graph=True)[0]
    (second,) = torch.autograd.grad(got.sum(), x)
    want = torch.zeros_like(x)
    for head in heads:
        (g,) = torch.autograd.grad(head(model(x)), x, create_graph=True)
        want += torch.autograd.grad(g.sum(), x)[0]
    torch.testing.assert_close(second, want)


# -- autograd_grad: torch's engine entry where torch.autograd.grad has nothing to do ----------


class _Recording(torch.overrides.TorchFunctionMode):
    """Records the torch functions called under it."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls.append(func)
        return func(*args, **(kwargs or {}))


def _autograd_grad_cases():
    """(outputs, inputs, cotangents) on one small float64 graph: scalar losses with implicit
    ones, vector outputs with their cotangents, an input that one output does not reach."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, generator=gen, dtype=torch.float64, requires_grad=True)
    unused = torch.randn(2, generator=gen, dtype=torch.float64, requires_grad=True)
    y = torch.tanh(x) * 2
    losses = (y.pow(2).sum(), y.sin().sum())
    v = torch.randn(3, generator=gen, dtype=torch.float64)
    return {
        "scalars": (losses, (x,), None),
        "one scalar, unused input": ((losses[0],), (x, unused), None),
        "cotangents": ((y, y.exp()), (x,), (v, 2 * v)),
    }


@pytest.mark.parametrize("case", ["scalars", "one scalar, unused input", "cotangents"])
@pytest.mark.parametrize("create_graph", [False, True])
def test_autograd_grad_equals_torch_autograd_grad(case, create_graph):
    """The engine's own entry (no mode, plain tensors) against torch.autograd.grad, with zeros
    for an unreached input; with create_graph the result is differentiable again."""
    outputs, inputs, cotangents = _autograd_grad_cases()[case]
    assert _linearize._plain(outputs, inputs, cotangents)
    got = _linearize.autograd_grad(outputs, inputs, cotangents, True, create_graph)
    expected = torch.autograd.grad(
        outputs, inputs, cotangents, retain_graph=True, allow_unused=True
    )
    for g, e, x in zip(got, expected, inputs, strict=True):
        torch.testing.assert_close(g, torch.zeros_like(x) if e is None else e, rtol=0, atol=0)
        assert g.requires_grad == (create_graph and e is not None)


@pytest.mark.parametrize("case", ["scalars", "cotangents"])
def test_autograd_grad_under_a_mode_goes_through_torch_autograd_grad(case):
    """A TorchFunctionMode (or a __torch_function__ tensor: DTensor) sees the call as
    torch.autograd.grad, as it would from the user's own code; the answer is the same."""
    outputs, inputs, cotangents = _autograd_grad_cases()[case]
    expected = _linearize.autograd_grad(outputs, inputs, cotangents, True)
    with _Recording() as mode:
        assert not _linearize._plain(outputs, inputs, cotangents)
        got = _linearize.autograd_grad(outputs, inputs, cotangents, True)
    assert torch.autograd.grad in mode.calls
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


def test_autograd_grad_leaves_torch_its_own_checks():
    """What torch.autograd.grad checks beyond the engine goes to it: a non-scalar output
    without a cotangent, a cotangent of another shape or dtype, an output that does not
    require grad, no inputs. Its own message reaches the caller (funcgrad validates before
    this)."""
    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    y = x * 2
    for outputs, cotangents, message in [
        ((y,), None, "grad can be implicitly created only for scalar outputs"),
        ((y,), (torch.ones(2, dtype=torch.float64),), "Mismatch in shape"),
        ((y.sum().detach(),), None, "does not require grad"),
    ]:
        assert not _linearize._plain(outputs, (x,), cotangents)
        with pytest.raises(RuntimeError, match=message):
            _linearize.autograd_grad(outputs, (x,), cotangents, True)
    assert not _linearize._plain((y.sum(),), (), None)
    with pytest.raises(RuntimeError, match="cannot be empty"):
        _linearize.autograd_grad((y.sum(),), (), None, True)
    complex_y = y.to(torch.complex128)
    assert not _linearize._plain((complex_y,), (x,), (torch.ones(3, dtype=torch.float64),))


# -- a torch.compile'd backward run twice: checked (torch 2.13 may answer wrongly) ----------


def test_the_stand_in_is_named_as_torch_names_a_compiled_backward():
    x = torch.randn(3, requires_grad=True)
    y = compiled_stand_in(False).apply(x)
    assert type(y.grad_fn).__name__ == funcgrad._graph.COMPILED_BACKWARD


@pytest.mark.parametrize("wrong", [False, True], ids=["right", "wrong-twice"])
def test_grads_through_a_compiled_backward_checks_its_second_pass(wrong):
    """grads pulls k directions through the compiled part one by one (chunk_size=1, as
    vmap cannot run a compiled backward): the second pass is checked against the first."""
    function = compiled_stand_in(wrong)
    x = torch.randn(4, requires_grad=True)
    y = function.apply(x)
    weights = torch.randn(3, 4)
    outputs = [(y * w).sum() for w in weights]
    if wrong:
        with pytest.raises(RuntimeError, match="ran it a second time on the same graph"):
            funcgrad.grads(outputs, x, through=y, chunk_size=1)
        return
    (got,) = funcgrad.grads(outputs, x, through=y, chunk_size=1)
    torch.testing.assert_close(got, weights * x.detach().cos())


@pytest.mark.parametrize("wrong", [False, True], ids=["right", "wrong-twice"])
def test_pullback_through_a_compiled_backward_checks_its_second_pass(wrong):
    """On eager autograd, a pullback whose graph holds a compiled backward checks its second
    pass; later pullbacks of that f on those shapes are torch.func.vjp's (which does not
    run the compiled backward twice on one graph)."""
    function = compiled_stand_in(wrong)
    f = lambda x: function.apply(x) * 2  # noqa: E731
    x = torch.randn(4)
    _, pb = funcgrad.pullback(f, x)
    v = torch.randn(2, 4)
    torch.testing.assert_close(pb(v[0])[0], 2 * v[0] * x.cos())
    if wrong:
        with pytest.raises(RuntimeError, match="ran it a second time on the same graph"):
            pb(v[1])
    else:
        torch.testing.assert_close(pb(v[1])[0], 2 * v[1] * x.cos())
    _, again = funcgrad.pullback(f, x)
    assert again._lin.engine == "torch.func"
    torch.testing.assert_close(again(v[1])[0], 2 * v[1] * x.cos())


class _WritesIntoItsCotangent(torch.autograd.Function):
    """Identity whose backward doubles its cotangent in place (allowed: it is its own)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad.mul_(2)


@pytest.mark.parametrize("mixed", [False, True])
def test_losses_backward_builds_the_unit_cotangents_in_one_tensor(mixed):
    # k scalar losses of one dtype: one tensor of ones, not one ones_like per loss; each
    # loss's cotangents as autograd's own (float64), also where a backward writes into its
    # cotangent, and with losses of two dtypes (one ones_like each).
    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    y = x.sin()
    losses = [(y * i).sum() for i in range(1, 5)]
    losses[1] = _WritesIntoItsCotangent.apply(losses[1])
    if mixed:
        losses[2] = losses[2].float()
    want = [torch.autograd.grad(z, y, retain_graph=True)[0] for z in losses]
    with torch.autograd.profiler.profile() as prof:
        (v,), _, _, _ = _linearize.losses_backward(losses, (y,), [()] * 4, [False] * 4, retain=True)
    ops = [e.name for e in prof.function_events if e.cpu_parent is None]
    assert ops.count("aten::ones_like") == (4 if mixed else 0), ops
    assert ops.count("aten::ones") == (0 if mixed else 1), ops
    for row, w in zip(v, want):
        torch.testing.assert_close(row, w)


def test_a_head_writing_into_its_cotangent_leaves_second_order_intact():
    """With the k unit cotangents as views of one tensor (one version counter), a head whose
    hook scales its cotangent in place broke the graph of an earlier head that saved its own
    (review of session 12): `create_graph` gives each torch's own."""
    torch.manual_seed(0)
    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    a = torch.randn(3, dtype=torch.float64, requires_grad=True)
    y = x.sin()
    z1, z2 = (y * a).sum(), (y * y).sum()
    z2.register_hook(lambda g: g.mul_(3))
    want = [torch.autograd.grad(z, x, create_graph=True, retain_graph=True)[0] for z in (z1, z2)]
    (got,) = funcgrad.grads([z1, z2], x, through=y, create_graph=True)
    torch.testing.assert_close(got[1], want[1])
    torch.testing.assert_close(
        torch.autograd.grad(got[0].sum(), a)[0], torch.autograd.grad(want[0].sum(), a)[0]
    )
