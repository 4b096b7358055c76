"""Counting what a call costs: :class:`PassCounter` (passes through f's backward) and
:class:`HostReadCounter` (reads of tensor values by the host, each a stall of a GPU's
stream), public, so that users can check the cost claims themselves.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
# The aten ops through which the host reads a tensor's value. ``t.item()``, ``bool(t)`` and
# ``float(t)`` reach the dispatcher as ``_local_scalar_dense`` (``item`` and ``is_nonzero``
# are composite and decompose to it before a dispatch mode sees them); ``torch.equal`` and
# ``torch.allclose`` as themselves. ``is_nonzero`` and ``item`` are listed for the builds
# that dispatch them.
HOST_READS = frozenset(
    {
        _aten._local_scalar_dense.default,
        _aten.is_nonzero.default,
        _aten.equal.default,
        _aten.allclose.default,
        _aten.item.default,
    }
)
# Ops whose output's shape depends on the values: the host must read a count from the
# device before it can allocate the result (a stall too). Indexing with a boolean mask
# (``t[t > 0]``) is ``index.Tensor`` with a bool index, counted as well.
DATA_DEPENDENT_SHAPES = frozenset(
    {
        _aten.nonzero.default,
        _aten.masked_select.default,
        _aten._unique2.default,
        _aten.unique_dim.default,
        _aten.unique_consecutive.default,
    }
)
# Frames in these folders are torch's (or this file's): a read is reported at the first
# frame outside them, the line of funcgrad or of the user's code that asked for the value.
_SKIPPED = (os.path.dirname(torch.__file__) + os.sep, __file__)


@dataclasses.dataclass
class PassCounter:
    """Counts the backward passes through a point of f: ``counter(x)`` is the identity on
    ``x``, and each backward pass that reaches it adds one to ``counter.backward``. A
    vmapped (batched) backward counts once, a loop of k backward passes k times. It works
    under torch.func transforms and ``torch.compile``.

    Attributes:
        backward: backward passes counted since creation or the last `reset`.

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


BackwardCounter = PassCounter  # (another name, used by some tests)


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


@dataclasses.dataclass(frozen=True)
class HostRead:
    """One read of a tensor value by the host: the aten op and where it was asked for."""

    op: str
    where: str  # "path:line in function", the first frame outside torch

    def __str__(self) -> str:
        return f"{self.op} at {self.where}"


class _HostReadMode(TorchDispatchMode):  # type: ignore[no-untyped-call]
    def __init__(self, counter: HostReadCounter) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.counter = counter

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in HOST_READS or func in DATA_DEPENDENT_SHAPES or _masked(func, args):
            self.counter.reads.append(HostRead(str(func.overloadpacket), _caller()))
        return func(*args, **(kwargs or {}))


def _masked(func: Any, args: Any) -> bool:
    """``t[mask]``: ``index.Tensor`` with a boolean index (a ``nonzero`` inside)."""
    return func is _aten.index.Tensor and any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1]
    )


def _caller() -> str:
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_SKIPPED):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return "<torch>"
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


class HostReadCounter:
    """Counts the reads of tensor values by the host (each one a stall of the stream on a
    GPU) during a ``with`` block: ``bool(t)``, ``t.item()``, ``float(t)``, ``torch.equal``,
    ``torch.allclose``, ``if t.any():``, and the ops whose output's shape depends on the
    values (``torch.nonzero``, ``t[mask]``, ``torch.unique``, ``masked_select``). It watches
    the dispatcher (a ``TorchDispatchMode``), so it counts on CPU tensors what would stall a
    GPU; pure tensor operations count nothing.

    Attributes:
        count: reads counted since creation or the last `reset`.
        reads: one ``HostRead`` per read: the aten op and the first frame outside torch
            that asked for the value (``"path:line in function"``).

    Examples:
        >>> import torch, funcgrad
        >>> x = torch.tensor([1.0, -2.0])
        >>> with funcgrad.HostReadCounter() as counter:
        ...     y = torch.where(x > 0, x, 0.0).sum()  # stays on the device
        ...     if y > 0:  # the host reads y
        ...         z = y.item()  # and again
        >>> counter.count
        2

    Notes:
        Reads that bypass the dispatcher are not seen: ``t.tolist()``, ``t.numpy()`` and
        ``t.cpu()`` of a CPU tensor (on a GPU, ``.cpu()`` and ``.tolist()`` copy, and stall).
        Under ``torch.compile`` the mode sees the compiled graph's ops, not the Python.
        A few ops validate their input on the host on the CPU only (``one_hot`` reads the
        index's min and max there, not on CUDA), so a CPU count can exceed the GPU's.
    """

    def __init__(self) -> None:
        self.reads: list[HostRead] = []
        self._mode: _HostReadMode | None = None

    @property
    def count(self) -> int:
        return len(self.reads)

    def reset(self) -> None:
        """Set the count back to zero."""
        self.reads.clear()

    def __enter__(self) -> HostReadCounter:
        if self._mode is not None:
            raise RuntimeError("HostReadCounter: this counter is already counting a block.")
        self._mode = _HostReadMode(self)
        self._mode.__enter__()  # type: ignore[no-untyped-call]
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._mode is not None
        mode, self._mode = self._mode, None
        mode.__exit__(*exc)  # type: ignore[no-untyped-call]

    def __repr__(self) -> str:
        return f"HostReadCounter(count={self.count})"
