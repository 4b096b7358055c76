"""Running a linear map (a pullback or a JVP) on a batch of directions.

The one place that vmaps: chunking, the loop for ``chunk_size=1``, the fallback to a loop
when vmap cannot batch, and the ``check`` comparison of batched against unbatched results.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import torch

from ._errors import BatchingMismatchError, FuncgradWarning, first_line
from ._function import is_torch_func_limit, values_readable

Tensors = tuple[torch.Tensor, ...]


def _loop(fn: Callable[..., Tensors], args: Sequence[torch.Tensor]) -> Tensors:
    results = [fn(*(arg[i] for arg in args)) for i in range(args[0].shape[0])]
    return tuple(torch.stack(outputs) for outputs in zip(*results))


def _vmap(
    fn: Callable[..., Tensors], args: Sequence[torch.Tensor], chunk_size: int | None
) -> Tensors:
    # torch's own chunk_size concatenates even a single chunk (a full copy): pass it only
    # when there is more than one chunk.
    if chunk_size is not None and chunk_size >= args[0].shape[0]:
        chunk_size = None
    return torch.func.vmap(fn, chunk_size=chunk_size)(*args)


def _tolerances(dtype: torch.dtype) -> tuple[float, float]:
    if dtype in (torch.float64, torch.complex128):
        return 1e-9, 1e-12
    if dtype in (torch.float16, torch.bfloat16):
        return 2e-2, 1e-3
    return 1e-4, 1e-6


def _mismatch(batched: Tensors, reference: Tensors, index: int) -> str | None:
    """Where the batched result's row ``index`` differs from an unbatched call, if anywhere."""
    for j, (b, r) in enumerate(zip(batched, reference)):
        rtol, atol = _tolerances(r.dtype)
        scale = r.abs().max().item() if r.numel() else 0.0
        if not torch.allclose(b[index], r, rtol=rtol, atol=atol * max(scale, 1.0), equal_nan=True):
            diff = (b[index] - r).abs().max().item()
            return f"output {j} of direction {index} differs by up to {diff:.3g}"
    return None


def batched(
    fn: Callable[..., Tensors],
    args: Sequence[torch.Tensor],
    *,
    chunk_size: int | None,
    check: bool | str,
    what: str,
    can_vmap: bool = True,
) -> Tensors:
    """``fn`` over the leading dim of ``args`` (one vmap, one per chunk, or a loop).

    ``fn`` takes one slice of each arg and returns a flat tuple of tensors; every output
    gets the leading batch dim.
    """
    batch = args[0].shape[0]
    if batch == 1 or chunk_size == 1 or not can_vmap:
        return _loop(fn, args)
    try:
        result = _vmap(fn, args, chunk_size)
    except (RuntimeError, NotImplementedError) as error:
        if is_torch_func_limit(error):  # not a batching problem: a loop would fail the same way
            raise
        looped = _loop(fn, args)  # if the loop fails too, its error is the one to see
        warnings.warn(
            f"funcgrad: vmap could not batch {what} ({first_line(error)}); "
            "fell back to a loop of unbatched calls, which gives the right answer more slowly. "
            "Pass strategy='loop' or chunk_size=1 to choose the loop directly.",
            FuncgradWarning,
            stacklevel=4,
        )
        return looped
    # The comparison reads values: eager only (not inside vmap/grad or a compiled region).
    if check and values_readable(args):
        for index in sorted({0, batch // 2, batch - 1}):
            problem = _mismatch(result, fn(*(arg[index] for arg in args)), index)
            if problem is None:
                continue
            message = (
                f"funcgrad: check found that vmap computed {what} wrongly ({problem} against an "
                "unbatched call); this is a bug in a batching rule of torch, not in your code."
            )
            if check == "strict":
                raise BatchingMismatchError(message + " Use strategy='loop' to avoid vmap.")
            warnings.warn(message + " Fell back to a loop.", FuncgradWarning, stacklevel=4)
            return _loop(fn, args)
    return result
