"""Settings: the ``check`` mode for a block of code (:func:`checking`, per thread and task),
for the process (:func:`set_check`), or from the ``FUNCGRAD_CHECK`` environment variable."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
from collections.abc import Iterator
from typing import Literal

import torch

CheckMode = bool | Literal["strict"]
"""`check=`: True compares every batched (vmapped) result with unbatched calls on a sample of
directions and, on a mismatch, warns and falls back to a loop; `"strict"` raises
`funcgrad.BatchingMismatchError` instead; False compares nothing. None (where accepted): the
global setting (`funcgrad.set_check`, `funcgrad.checking`, or `FUNCGRAD_CHECK`)."""
_ENV = "FUNCGRAD_CHECK"
_check: CheckMode | None = None  # None: follow the environment variable
# Set by `checking` for a block; a ContextVar, so other threads and asyncio tasks keep theirs.
_block_check: contextvars.ContextVar[CheckMode | None] = contextvars.ContextVar(
    "funcgrad_check", default=None
)


@functools.lru_cache(maxsize=16)
def _parse_env(raw: str) -> CheckMode:
    value = raw.strip().lower()
    if value == "strict":
        return "strict"
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(
        f"funcgrad: environment variable {_ENV}={value!r} is not understood; "
        "expected one of 0, 1, strict."
    )


def _validate(mode: object, call: str) -> CheckMode:
    if mode is True or mode is False or mode == "strict":
        return mode
    raise ValueError(
        f"{call}: `check` must be True, False or 'strict', got {mode!r}. "
        "Use check=True to compare batched results with unbatched ones."
    )


def set_check(mode: CheckMode | None) -> CheckMode | None:
    """Set the default ``check`` mode of every transform, for the whole process (every
    thread); returns the previous setting. For one block of code, use `checking`.

    Args:
        mode: ``True`` compares each batched (vmapped) result with unbatched pullbacks on a
            sample of cotangents and falls back to a loop, with a warning, on a mismatch;
            ``"strict"`` raises `funcgrad.BatchingMismatchError` instead; ``False``
            checks nothing; ``None`` restores the ``FUNCGRAD_CHECK`` environment variable
            (``0``, ``1`` or ``strict``).

    Returns:
        The previous setting, so that it can be restored.

    Examples:
        >>> import funcgrad
        >>> previous = funcgrad.set_check(True)
        >>> funcgrad.set_check(previous)
        True
    """
    global _check
    previous = _check
    _check = None if mode is None else _validate(mode, "funcgrad.set_check(mode)")
    return previous


@contextlib.contextmanager
def checking(mode: CheckMode) -> Iterator[None]:
    """The default ``check`` mode inside a ``with`` block, for this thread (or asyncio task)
    only; other threads keep theirs. It overrides `set_check` and ``FUNCGRAD_CHECK``; a
    ``check=`` argument of a call still overrides it.

    Args:
        mode: ``True``, ``False`` or ``"strict"``, as for `set_check`.

    Examples:
        >>> import torch, funcgrad
        >>> fn = funcgrad.compose_heads(torch.sin, [lambda y: y.sum(), lambda y: y[0]])
        >>> with funcgrad.checking("strict"):  # a wrong batching rule raises in this block
        ...     values, grads = fn(torch.zeros(3))
        >>> grads[1]
        tensor([1., 0., 0.])
    """
    token = _block_check.set(_validate(mode, "funcgrad.checking(mode)"))
    try:
        yield
    finally:
        _block_check.reset(token)


def resolve_check(mode: CheckMode | None, call: str) -> CheckMode:
    """The ``check`` argument of a call; when it is ``None``, the block's (:func:`checking`),
    else the process's (:func:`set_check`), else the environment's."""
    if mode is not None:
        return _validate(mode, call)
    if torch.compiler.is_compiling():  # check reads values, so it is off in compiled code
        return False  # (and dynamo cannot trace ContextVar.get)
    block = _block_check.get()
    if block is not None:
        return block
    if _check is None:  # the environment, read at every call: it may change
        return _parse_env(os.environ.get(_ENV, "0"))
    return _check
