"""Bad input shared by several entry points (the checks of ``funcgrad._validate`` and the
``check`` setting): a clear error that names the call and the argument, before f's (slow)
backward runs; f must not run at all where the mistake is visible earlier. Each entry point's
own bad input is tested in its file (test_compose_heads.py, test_pullback.py, ...)."""

from __future__ import annotations

import pytest
import torch
from helpers import HEAD, CountingF

import funcgrad


@pytest.mark.parametrize("chunk_size", [0, -2, 1.5, "2", True])
def test_bad_chunk_size(chunk_size):
    with pytest.raises(ValueError, match=r"`chunk_size` must be None .*, a positive int"):
        funcgrad.compose_heads(torch.tanh, [HEAD], chunk_size=chunk_size)
    _, pb = funcgrad.pullback(torch.tanh, torch.randn(3))
    with pytest.raises(ValueError, match=r"Pullback.many\(cotangents\): `chunk_size`"):
        pb.many(torch.randn(2, 3), chunk_size=chunk_size)


def test_bad_check_and_callable_f():
    with pytest.raises(ValueError, match=r"`check` must be True, False or 'strict', got 'yes'"):
        funcgrad.compose_heads(torch.tanh, [HEAD], check="yes")
    with pytest.raises(TypeError, match=r"`f` must be callable, got int 3"):
        funcgrad.compose_heads(3, [HEAD])
    with pytest.raises(TypeError, match=r"pullback\(f, \*primals\): `f` must be callable"):
        funcgrad.pullback(3, torch.randn(2))
    with pytest.raises(ValueError, match=r"give at least one primal"):
        funcgrad.pullback(torch.tanh)


@pytest.mark.parametrize(
    ("primal", "match"),
    [
        (
            torch.arange(3),
            r"argument 0, leaf <root>, must be a floating-point or complex tensor.*int64",
        ),
        (
            {"w": torch.ones(2), "n": torch.tensor([True])},
            r"argument 0, leaf \['n'\], .*torch.bool",
        ),
        ((torch.ones(2), 3), r"argument 0, leaf \[1\], .*got int 3"),
        ({"only": None}, r"argument 0 contains no tensor to differentiate"),
    ],
)
def test_integer_bool_or_missing_primal_before_f_runs(primal, match):
    f = CountingF()
    with pytest.raises((TypeError, ValueError), match=r"compose_heads\(f, heads\): " + match):
        funcgrad.compose_heads(lambda p: f(torch.ones(2)), [HEAD])(primal)
    with pytest.raises((TypeError, ValueError), match=r"pullback\(f, \*primals\): " + match):
        funcgrad.pullback(lambda p: f(torch.ones(2)), primal)
    assert f.calls == 0


@pytest.mark.parametrize(
    ("f", "match"),
    [
        (lambda x: 3.0, r"f returned no tensor|f's output, leaf <root>, must be a floating-point"),
        (lambda x: x > 0, r"f's output, leaf <root>, must be a floating-point .* torch.bool"),
        (lambda x: {"a": x, "n": x.long()}, r"f's output, leaf \['n'\], .*torch.int64"),
        (lambda x: None, r"f returned no tensor"),
    ],
)
def test_f_returning_non_float(f, match):
    with pytest.raises(TypeError, match=match):
        funcgrad.compose_heads(f, [HEAD])(torch.randn(3))
    with pytest.raises(TypeError, match=match):
        funcgrad.pullback(f, torch.randn(3))


def test_environment_variable_is_validated(monkeypatch):
    monkeypatch.setenv("FUNCGRAD_CHECK", "maybe")
    with pytest.raises(ValueError, match=r"FUNCGRAD_CHECK='maybe' is not understood"):
        funcgrad.compose_heads(torch.tanh, [HEAD])(torch.randn(2))
    with pytest.raises(ValueError, match=r"funcgrad.set_check\(mode\): `check` must be"):
        funcgrad.set_check("always")


def test_compose_and_combine_heads_refuse_inference_mode():
    """Autograd records nothing there: the heads' gradients came out zero (before) or raised
    torch's 'does not require grad'; now a clear error names the call."""
    heads = [lambda y: y.sum(), lambda y: y[0]]
    with torch.inference_mode():
        with pytest.raises(RuntimeError, match=r"compose_heads\(f, heads\): cannot run inside"):
            funcgrad.compose_heads(torch.sin, heads)(torch.zeros(3))
        with pytest.raises(RuntimeError, match=r"combine_heads\(f, heads\): cannot run inside"):
            funcgrad.combine_heads(torch.sin, heads)(torch.zeros(3))
    with torch.no_grad():  # fine
        _, grads = funcgrad.compose_heads(torch.sin, heads)(torch.zeros(3))
    torch.testing.assert_close(grads, torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]]))


def test_create_graph_must_be_a_bool():
    with pytest.raises(TypeError, match=r"compose_heads\(f, heads\): `create_graph` must be"):
        funcgrad.compose_heads(torch.sin, [torch.sum], create_graph="yes")
    _, pb = funcgrad.pullback(torch.sin, torch.zeros(2))
    with pytest.raises(TypeError, match=r"pb\(cotangent\): `create_graph` must be"):
        pb(torch.ones(2), create_graph=1)
