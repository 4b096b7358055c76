"""Counting passes through f's backward: :class:`PassCounter`, public, so that users can
check the cost claims themselves (the demo, the notebooks, the benchmarks and the tests use
it too).

``counted(x, counter)`` is the identity on x, and each backward pass that reaches it adds
one to ``counter.backward`` (a vmapped backward is one pass). It works under torch.func
transforms: it has ``setup_context`` and a vmap rule.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch


@dataclasses.dataclass
class PassCounter:
    """Counts the backward passes through a point of f: ``counter(x)`` is the identity on
    ``x``, and each backward pass that reaches it adds one to ``counter.backward``. A
    vmapped (batched) backward counts once, a loop of k backward passes k times. It works
    under torch.func transforms and ``torch.compile``.

    Attributes:
        backward: backward passes counted since creation or the last :meth:`reset`.

    Examples:
        >>> import torch, funcgrad
        >>> counter = funcgrad.PassCounter()
        >>> def f(x):
        ...     return torch.sin(counter(x))
        >>> heads = [lambda y, i=i: y[i] for i in range(3)]
        >>> _ = funcgrad.compose_heads(f, heads, strategy="vjp")(torch.zeros(3))
        >>> counter.backward  # 3 heads, one batched backward through f
        1
        >>> counter.reset()
        >>> _ = funcgrad.compose_heads(f, heads, strategy="loop")(torch.zeros(3))
        >>> counter.backward
        3
    """

    backward: int = 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return counted(x, self)

    def reset(self) -> None:
        """Set the count back to zero."""
        self.backward = 0


BackwardCounter = PassCounter  # the name the tests and benchmarks have used


class _CountedIdentity(torch.autograd.Function):
    @staticmethod
    def forward(x: torch.Tensor, counter: PassCounter) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        ctx.counter = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.counter.backward += 1
        return grad, None

    @staticmethod
    def jvp(ctx: Any, x_tangent: torch.Tensor, counter_tangent: Any) -> torch.Tensor:
        return x_tangent

    @staticmethod
    def vmap(info: Any, in_dims: Any, x: torch.Tensor, counter: PassCounter) -> Any:
        return x.view_as(x), in_dims[0]


def counted(x: torch.Tensor, counter: PassCounter) -> torch.Tensor:
    """The identity on ``x``; counts the backward passes that flow through it."""
    result: torch.Tensor = _CountedIdentity.apply(x, counter)  # type: ignore[no-untyped-call]
    return result
