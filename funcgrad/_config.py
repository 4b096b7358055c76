"""Global settings: the ``check`` mode, also set by the ``FUNCGRAD_CHECK`` environment variable."""

from __future__ import annotations

import os
from typing import Literal

CheckMode = bool | Literal["strict"]
_ENV = "FUNCGRAD_CHECK"
_check: CheckMode | None = None  # None: follow the environment variable


def _from_env() -> CheckMode:
    value = os.environ.get(_ENV, "0").strip().lower()
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
    """Set the default ``check`` mode of every transform; returns the previous setting.

    Args:
        mode: ``True`` compares each batched (vmapped) result with unbatched pullbacks on a
            sample of cotangents and falls back to a loop, with a warning, on a mismatch;
            ``"strict"`` raises :class:`~funcgrad.BatchingMismatchError` instead; ``False``
            checks nothing; ``None`` restores the ``FUNCGRAD_CHECK`` environment variable
            (``0``, ``1`` or ``strict``).

    Returns:
        The previous setting, so that it can be restored.

    Example:
        >>> import funcgrad
        >>> previous = funcgrad.set_check(True)
        >>> funcgrad.set_check(previous)
        True
    """
    global _check
    previous = _check
    _check = None if mode is None else _validate(mode, "funcgrad.set_check(mode)")
    return previous


def resolve_check(mode: CheckMode | None, call: str) -> CheckMode:
    """The ``check`` argument of a call, or the global default when it is ``None``."""
    if mode is None:
        return _from_env() if _check is None else _check
    return _validate(mode, call)
