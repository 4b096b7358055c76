"""Memory: the budget that ``chunk_size="auto"`` fits its chunks into, and the measurement
of what one chunk of directions really allocates.

The budget comes from :func:`memory_budget` (a block), else ``FUNCGRAD_MEMORY_BUDGET`` (bytes,
or with a unit: ``512MiB``, ``2GB``), else half of the memory free now (``torch.cuda.
mem_get_info`` on CUDA, ``MemAvailable`` on the CPU).

The measurement counts live bytes, not resident size (docs/performance.md says why):
:class:`LivePeak`, a TorchDispatchMode below vmap, sees every tensor a chunk allocates and
every release; on CUDA, ``max_memory_allocated`` says the same.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import os
import re
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ._validate import is_count

T = TypeVar("T")
_ENV = "FUNCGRAD_MEMORY_BUDGET"
_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
_block: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "funcgrad_memory_budget", default=None
)
# What is left of free memory for funcgrad's chunks by default.
DEFAULT_SHARE = 0.5


# A number (digits with an optional fraction and exponent), then an optional unit: K, M, G
# or T (powers of 1024), each alone or followed by B or iB, or B alone.
_BYTES = re.compile(
    r"\s*((?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:e[+-]?[0-9]+)?)\s*(?:([kmgt])i?b?|b)?\s*",
    re.IGNORECASE,
)
_FORMS = (
    "Give a positive int of bytes, or a string: a number, then optionally K, M, G or T "
    "(powers of 1024), alone or with B or iB, e.g. '536870912', '1e9', '512MiB', '2GB', '1.5K'."
)


def _check(nbytes: object, where: str) -> int:
    if not is_count(nbytes):
        raise ValueError(
            f"{where} must be a positive int (a number of bytes) or a string, got {nbytes!r}. "
            f"{_FORMS}"
        )
    return nbytes


def parse_bytes(text: str, where: str) -> int:
    """``"512MiB"``, ``"2GB"``, ``"1e9"`` or ``"1000000"`` as bytes (units are powers of 1024).
    Anything else, zero and what a float cannot hold (``"1e400"``) are a ValueError."""
    match = _BYTES.fullmatch(text)
    if match is None:
        raise ValueError(f"{where}: {text!r} is not a number of bytes. {_FORMS}")
    value = float(match.group(1)) * _UNITS[(match.group(2) or "").lower()]
    if not math.isfinite(value) or value < 1:
        raise ValueError(
            f"{where}: {text!r} is {'too large' if value >= 1 else 'below one byte'}. {_FORMS}"
        )
    return int(value)


@contextlib.contextmanager
def memory_budget(nbytes: int | str) -> Iterator[None]:
    """The memory that ``chunk_size="auto"`` may use for one chunk of directions, inside a
    ``with`` block (this thread or asyncio task only: a thread started inside it does not
    see it; a task created inside it does, asyncio copying the context); blocks nest, the
    innermost wins at each call.

    Args:
        nbytes: bytes, or a string with a unit (``"512MiB"``, ``"2GB"``).

    Examples:
        >>> import torch, funcgrad
        >>> heads = [lambda y, i=i: y[i] for i in range(64)]
        >>> fn = funcgrad.compose_heads(torch.sin, heads, strategy="vjp", chunk_size="auto")
        >>> with funcgrad.memory_budget("64MiB"):
        ...     values, grads = fn(torch.zeros(64))
        >>> grads.shape
        torch.Size([64, 64])

    Notes:
        Without a block, ``FUNCGRAD_MEMORY_BUDGET`` (same forms), else half of the memory
        free when the call starts. The budget bounds the transient memory of one chunk (what
        its pullbacks allocate above what is already held, temporaries included); the
        answer itself, k gradients, is held whatever the chunks. Below one direction, each
        direction runs alone (one warning per budget), from the first.
    """
    where = "funcgrad.memory_budget(nbytes)"
    value = parse_bytes(nbytes, where) if isinstance(nbytes, str) else _check(nbytes, where)
    token = _block.set(value)
    try:
        yield
    finally:
        _block.reset(token)


def _available(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    pages = os.sysconf("SC_AVPHYS_PAGES") if hasattr(os, "sysconf") else 0
    return int(pages * os.sysconf("SC_PAGE_SIZE")) if pages else 8 * 2**30


def setting() -> int | None:
    """The budget set: the block's, else the environment's (read at every call: it may
    change; a bad string is a ValueError), else None."""
    block = _block.get()
    if block is not None:
        return block
    env = os.environ.get(_ENV, "").strip()
    return parse_bytes(env, f"environment variable {_ENV}") if env else None


def budget(device: torch.device) -> int:
    """The budget in force: the block's, else the environment's, else half of free memory."""
    nbytes = setting()
    return nbytes if nbytes is not None else int(DEFAULT_SHARE * _available(device))


class LivePeak(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """The peak of live bytes allocated by the ops run inside it (views and in-place ops of
    existing tensors do not count; a storage counts until its last tensor made here dies)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}
        self._holders: dict[int, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        existing = {
            t.untyped_storage().data_ptr()
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor) and not t._is_zerotensor()
        }
        for t in tree_leaves(out):
            # (an efficient zero tensor, forward mode's zero tangent, allocates nothing and
            # has no storage to read)
            if not isinstance(t, torch.Tensor) or t.device.type == "meta" or t._is_zerotensor():
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if not key or key in existing:
                continue
            if key not in self._sizes:
                self._sizes[key] = storage.nbytes()
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
            self._holders[key] = self._holders.get(key, 0) + 1
            weakref.finalize(t, self._release, key)
        return out

    def _release(self, key: int) -> None:
        self._holders[key] -= 1
        if not self._holders[key]:
            del self._holders[key]
            self.live -= self._sizes.pop(key)


def peak_of(call: Callable[[], T], device: torch.device) -> tuple[T, int]:
    """(call's result, the peak bytes it allocated above what was live before it)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        result = call()
        torch.cuda.synchronize(device)
        return result, int(torch.cuda.max_memory_allocated(device) - before)
    with LivePeak() as mode:
        result = call()
    return result, mode.peak
