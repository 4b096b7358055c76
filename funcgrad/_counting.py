"""Counting passes through f's backward, for the demo, the benchmarks and the tests.

``counted(x, counter)`` is the identity on x, and each backward pass that reaches it adds
one to ``counter.backward`` (a vmapped backward is one pass). It works under torch.func
transforms: it has ``setup_context`` and a vmap rule.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch


@dataclasses.dataclass
class BackwardCounter:
    backward: int = 0

    def reset(self) -> None:
        self.backward = 0


class _CountedIdentity(torch.autograd.Function):
    @staticmethod
    def forward(x: torch.Tensor, counter: BackwardCounter) -> torch.Tensor:
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
    def vmap(info: Any, in_dims: Any, x: torch.Tensor, counter: BackwardCounter) -> Any:
        return x.view_as(x), in_dims[0]


def counted(x: torch.Tensor, counter: BackwardCounter) -> torch.Tensor:
    """The identity on ``x``; counts the backward passes that flow through it."""
    result: torch.Tensor = _CountedIdentity.apply(x, counter)  # type: ignore[no-untyped-call]
    return result
