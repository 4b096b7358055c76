"""Exceptions and warnings raised by funcgrad."""

from __future__ import annotations

import torch


class ReleasedPullbackError(ValueError):
    """A `funcgrad.Pullback` was used after `funcgrad.Pullback.release`."""


class BatchingMismatchError(RuntimeError):
    """A vmapped result disagreed with the unbatched reference, with ``check="strict"``."""


class ForwardModeNoGradError(ValueError):
    """An explicit forward-mode request on an f seen running ops in no-grad mode on tensors
    that carry a tangent: forward mode would differentiate what autograd takes for a
    constant."""


class InputWrittenError(ValueError):
    """f wrote into a differentiated argument in place, and the call had to run f again,
    which would write it again and differentiate f at the changed value."""


class FuncgradWarning(UserWarning):
    """funcgrad fell back to a slower but correct method; the message says why."""


def first_line(error: BaseException) -> str:
    """``Type: first line of the message``, short enough to quote in a warning."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:300]


def describe(value: object) -> str:
    """A short description of a value for error messages: type, shape and dtype of tensors."""
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
    return f"{type(value).__name__} {value!r}"[:120]
