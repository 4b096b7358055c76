"""Every bad input gets a clear error that names the call, the argument and the head,
before f's (slow) backward runs: f must not run at all where the mistake is visible earlier."""

from __future__ import annotations

import pytest
import torch

import funcgrad


class CountingF:
    """f = tanh, counting its calls, to show that validation comes first."""

    def __init__(self):
        self.calls = 0

    def __call__(self, x):
        self.calls += 1
        return torch.tanh(x)


HEAD = lambda y: y.sum()  # noqa: E731


@pytest.mark.parametrize(
    ("heads", "error", "match"),
    [
        (
            [HEAD, "not a function"],
            TypeError,
            r"compose_heads\(f, heads\): head at index 1 must be callable",
        ),
        (
            {"a": HEAD, "b": 3},
            TypeError,
            r"head at key 'b' must be callable y -> scalar, got int 3",
        ),
        ([], ValueError, r"compose_heads\(f, heads\): `heads` is empty"),
        ({}, ValueError, r"`heads` is empty"),
        (HEAD, TypeError, r"got a single callable .* Wrap it in a list: heads=\[head\]"),
        (42, TypeError, r"`heads` must be a sequence or a mapping of callables"),
    ],
)
def test_bad_heads(heads, error, match):
    with pytest.raises(error, match=match):
        funcgrad.compose_heads(torch.tanh, heads)


def test_unknown_strategy():
    with pytest.raises(
        ValueError, match=r"unknown `strategy` 'fast'; expected one of 'auto', 'vjp'"
    ):
        funcgrad.compose_heads(torch.tanh, [HEAD], strategy="fast")


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
    ("argnums", "error", "match"),
    [
        (2, ValueError, r"`argnums` entry 2 is out of range: f was called with 2 positional"),
        ((0, -2), ValueError, r"`argnums` \(0, -2\) names the same argument twice"),
        ((), TypeError, r"`argnums` must be an int or a non-empty tuple of ints"),
        ("0", TypeError, r"`argnums` must be an int or a tuple of ints, got '0'"),
    ],
)
def test_bad_argnums_before_f_runs(argnums, error, match):
    f = CountingF()
    with pytest.raises(error, match=match):
        funcgrad.compose_heads(lambda x, y: f(x * y), [HEAD], argnums=argnums)(
            torch.randn(2), torch.randn(2)
        )
    assert f.calls == 0


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


def test_has_aux_without_a_pair():
    with pytest.raises(TypeError, match=r"with has_aux=True, f must return a pair \(output, aux\)"):
        funcgrad.compose_heads(torch.tanh, [HEAD], has_aux=True)(torch.randn(3))


@pytest.mark.parametrize("strategy", ["auto", "vjp", "jacrev", "jacfwd", "loop"])
@pytest.mark.parametrize(
    ("bad_head", "error", "match"),
    [
        (lambda y: y, ValueError, r"head 1 must return a scalar, got shape \(3,\)\. Reduce it"),
        (
            lambda y: (y > 0).sum(),
            TypeError,
            r"head 1 must return a real floating-point scalar, got dtype torch.int64",
        ),
        (
            lambda y: (1j * y).sum(),
            TypeError,
            r"head 1 must return a real .*complex128\. Take \.real",
        ),
        (lambda y: 1.0, TypeError, r"head 1 must return a real scalar tensor, got float 1.0"),
    ],
)
def test_bad_head_outputs_name_the_head(strategy, bad_head, error, match):
    with pytest.raises(error, match=r"compose_heads\(f, heads\): " + match):
        funcgrad.compose_heads(torch.tanh, [HEAD, bad_head], strategy=strategy)(torch.randn(3))


def test_bad_head_in_a_mapping_and_in_stacked_heads():
    with pytest.raises(ValueError, match=r"head 'bad' must return a scalar"):
        funcgrad.compose_heads(torch.tanh, {"ok": HEAD, "bad": lambda y: y})(torch.randn(3))
    stacked = funcgrad.stacked_heads(lambda w, y: w * y, torch.randn(4, 3))
    with pytest.raises(ValueError, match=r"stacked head_fn must return a scalar, got shape \(3,\)"):
        funcgrad.compose_heads(torch.tanh, stacked)(torch.randn(3))


def test_bad_stacked_params():
    with pytest.raises(ValueError, match=r"same leading size k .* got sizes \[3, 4\]"):
        funcgrad.stacked_heads(lambda p, y: y.sum(), {"a": torch.ones(3, 2), "b": torch.ones(4)})
    with pytest.raises(ValueError, match=r"`params` leaf \['s'\] must be a tensor with a leading"):
        funcgrad.stacked_heads(lambda p, y: y.sum(), {"s": torch.tensor(1.0)})
    with pytest.raises(TypeError, match=r"`head_fn` must be callable"):
        funcgrad.stacked_heads("f", torch.ones(3))


def _pb():
    def f(d):
        return {"a": torch.tanh(d), "b": d.sum()}

    return funcgrad.pullback(f, torch.randn(3))[1]


@pytest.mark.parametrize(
    ("cotangent", "error", "match"),
    [
        (
            {"a": torch.ones(4), "b": torch.tensor(1.0)},
            ValueError,
            r"leaf \['a'\] must have f's output shape \(3,\), got \(4,\)",
        ),
        (
            {"a": torch.ones(3, dtype=torch.float32), "b": torch.tensor(1.0)},
            TypeError,
            r"leaf \['a'\] must have f's output dtype torch.float64, got torch.float32",
        ),
        (
            {"a": torch.ones(3)},
            ValueError,
            r"tree structure of f's output, expected PyTreeSpec\(\{'a': \*, 'b': \*\}\), "
            r"got PyTreeSpec\(\{'a': \*\}\)",
        ),
        (torch.ones(3), ValueError, r"tree structure of f's output"),
        ({"a": [1.0, 2.0, 3.0], "b": torch.tensor(1.0)}, ValueError, r"tree structure"),
        ({"a": "x", "b": torch.tensor(1.0)}, TypeError, r"leaf \['a'\] must be a tensor, got str"),
    ],
)
def test_bad_cotangent(cotangent, error, match):
    with pytest.raises(error, match=r"pb\(cotangent\): .*" + match):
        _pb()(cotangent)


def test_many_needs_a_leading_batch_dimension():
    pb = _pb()
    with pytest.raises(
        ValueError,
        match=r"must have shape \(k, \*\(3,\)\).*got \(3,\)\. It has no leading batch dimension",
    ):
        pb.many({"a": torch.ones(3), "b": torch.tensor(1.0)})
    with pytest.raises(
        ValueError,
        match=r"same leading batch size; cotangent leaf \['b'\] has 2, an earlier leaf has 5",
    ):
        pb.many({"a": torch.ones(5, 3), "b": torch.ones(2)})


def test_pb_single_call_rejects_a_batch():
    with pytest.raises(ValueError, match=r"For k cotangents at once, stack them and call pb.many"):
        _pb()({"a": torch.ones(2, 3), "b": torch.tensor(1.0)})


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
