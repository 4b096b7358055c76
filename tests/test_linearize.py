"""Every message piece in funcgrad._linearize.TORCH_LIMITS, triggered on the installed
torch: a torch upgrade that rewords one fails here, instead of silently changing which path
funcgrad takes (a fallback to eager autograd, to a loop, or to reverse mode)."""

from __future__ import annotations

import ast
import pathlib
import warnings

import pytest
import torch
import torch.utils.checkpoint

from funcgrad import _linearize


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


TRIGGERS = {
    "function without setup_context": lambda: torch.func.vjp(_WithoutSetupContext.apply, _x()),
    "no storage": lambda: torch.func.vmap(lambda t: t.data_ptr())(torch.randn(3, 4)),
    "wrapper storage": lambda: torch.func.grad(lambda t: (t.untyped_storage(), t.sum())[1])(_x()),
    "saved tensor hooks": lambda: torch.func.vjp(
        lambda x: torch.utils.checkpoint.checkpoint(torch.sin, x, use_reentrant=False), _x()
    ),
    "requires_grad_": lambda: torch.func.vjp(lambda x: x.detach().requires_grad_() * x, _x()),
    "mutates a captured tensor": lambda: torch.func.vjp(
        torch.nn.BatchNorm1d(3).double(), torch.randn(4, 3, dtype=torch.float64)
    ),
    "no forward AD formula": lambda: torch.func.jvp(
        lambda t: torch.special.zeta(t, t), (_x(),), (_x(),)
    ),
    "custom Function without jvp": lambda: torch.func.jvp(_WithoutJvp.apply, (_x(),), (_x(),)),
    "custom Function jvp": lambda: torch.func.jvp(_WithoutJvp.apply, (_x(),), (_x(),)),
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
