"""Reliability hunt (session 9, rel9a): an f that runs part of its work in no-grad mode.

Forward-mode AD ignores grad mode: ops that f runs under ``torch.no_grad()`` (a norm taken
as a constant, a straight-through scale) are differentiated by forward mode and not by
autograd. ``auto`` tried forward mode on its second call of a signature (and kept it where
it won the timing), so that call's answer was another function's derivative (523 off on
the f below, float64). Checked against per-head ``torch.autograd.grad``, calls 1-8."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch

import funcgrad

HEADS = [lambda y, i=i: y[i] ** 2 + y.sum() for i in range(12)]  # k = 12 > n: forward mode


def _no_grad(x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        scale = x.norm()  # a constant to autograd
    return torch.cat([x / scale * j for j in range(1, 13)])


def _grad_disabled(x: torch.Tensor) -> torch.Tensor:
    with torch.set_grad_enabled(False):
        s = x * 2
    return torch.cat([x * s * j for j in range(1, 13)])


@torch.no_grad()
def _detached_norm(x: torch.Tensor) -> torch.Tensor:
    return x.norm()


def _decorated(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.sin(x) * _detached_norm(x) * j for j in range(1, 13)])


def _per_head(f: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    x = x.detach().clone().requires_grad_()
    y = f(x)
    return torch.stack([torch.autograd.grad(h(y), x, retain_graph=True)[0] for h in HEADS])


@pytest.mark.parametrize("f", [_no_grad, _grad_disabled, _decorated])
def test_auto_answers_autograd_where_f_runs_ops_in_no_grad_mode(
    f: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    fn = funcgrad.compose_heads(f, HEADS)
    for shape in ((1,), (2,)):  # the fact seeds the function's new signatures
        x = torch.linspace(0.3, 0.7, shape[0], dtype=torch.float64)
        expected = _per_head(f, x)
        for call in range(1, 9):
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                _, grads = fn(x)
            torch.testing.assert_close(grads, expected, msg=f"shape {shape}, call {call}")
        assert fn.plan(x).strategy != "jacfwd"


def test_no_grad_on_tensors_that_need_no_gradient_keeps_forward_mode() -> None:
    """Only an op on a tensor that requires grad counts: a constant computed under
    ``no_grad`` from captured tensors that need none leaves forward mode a candidate."""
    table = torch.linspace(1.0, 2.0, 12, dtype=torch.float64)

    def f(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            scale = table.exp()
        return torch.sin(x) * scale

    fn = funcgrad.compose_heads(f, HEADS)
    x = torch.tensor([0.4], dtype=torch.float64)
    expected = _per_head(f, x)
    _, grads = fn(x)
    torch.testing.assert_close(grads, expected)
    assert fn.plan(x).strategy == "jacfwd"  # auto's second call: forward mode's timed trial
    for _ in range(3):
        torch.testing.assert_close(fn(x)[1], expected)


def _branch_on_grad_mode(x: torch.Tensor) -> torch.Tensor:
    z = x**2 if x.requires_grad else x**3  # forward mode: x does not require grad
    return torch.cat([z * j for j in range(1, 13)])


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="documented (docs/reliability.md), silently wrong: forward mode runs f in no-grad "
    "mode on inputs that do not require grad (explicit jacfwd; a branch on either)",
)
@pytest.mark.parametrize(
    ("f", "strategy"),
    [(_no_grad, "jacfwd"), (_branch_on_grad_mode, "auto")],
    ids=["jacfwd", "branch"],
)
def test_known_limit_forward_mode_and_grad_mode(
    f: Callable[[torch.Tensor], torch.Tensor], strategy: funcgrad.Strategy
) -> None:
    fn = funcgrad.compose_heads(f, HEADS, strategy=strategy)
    x = torch.tensor([0.4], dtype=torch.float64)
    expected = _per_head(f, x)
    for _ in range(2):  # auto: forward mode is the second call's challenger
        torch.testing.assert_close(fn(x)[1], expected)
