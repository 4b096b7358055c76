"""Running a linear map (a pullback or a JVP) on a batch of directions.

The one place that vmaps: chunking, the loop for ``chunk_size=1``, the fallback to a loop
when vmap cannot batch, and the ``check`` comparison of batched against unbatched results.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import torch

from ._errors import BatchingMismatchError, FuncgradWarning

Tensors = tuple[torch.Tensor, ...]


def _loop(fn: Callable[..., Tensors], args: Sequence[torch.Tensor], out_dims: Sequence[int | None]) -> Tensors:
    results = [fn(*(arg[i] for arg in args)) for i in range(args[0].shape[0])]
    return tuple(
        torch.stack([r[j] for r in results]) if dim == 0 else results[0][j]
        for j, dim in enumerate(out_dims)
    )


def _vmap_chunks(fn, args, out_dims, chunk_size):
    batch = args[0].shape[0]
    if chunk_size is None or chunk_size >= batch:
        return torch.func.vmap(fn, out_dims=tuple(out_dims))(*args)
    # Own chunking: torch's chunk_size cannot concatenate outputs with out_dims=None.
    parts = [
        torch.func.vmap(fn, out_dims=tuple(out_dims))(*(arg[start : start + chunk_size] for arg in args))
        for start in range(0, batch, chunk_size)
    ]
    return tuple(
        torch.cat([p[j] for p in parts]) if dim == 0 else parts[0][j] for j, dim in enumerate(out_dims)
    )


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


def _tolerances(dtype: torch.dtype) -> tuple[float, float]:
    if dtype in (torch.float64, torch.complex128):
        return 1e-9, 1e-12
    if dtype in (torch.float16, torch.bfloat16):
        return 2e-2, 1e-3
    return 1e-4, 1e-6


def _mismatch(batched: Tensors, reference: Tensors, index: int) -> str | None:
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
    out_dims: Sequence[int | None],
    chunk_size: int | None,
    check: bool | str,
    what: str,
    can_vmap: bool = True,
) -> Tensors:
    """``fn`` over the leading dim of ``args``: one vmap per chunk, or a loop.

    ``fn`` returns a flat tuple of tensors; ``out_dims[j]`` is 0 for outputs that are batched
    and ``None`` for outputs that do not depend on the batch (taken from the first call).
    """
    batch = args[0].shape[0]
    if batch == 1 or chunk_size == 1 or not can_vmap:
        return _loop(fn, args, out_dims)
    try:
        result = _vmap_chunks(fn, args, out_dims, chunk_size)
    except (RuntimeError, NotImplementedError) as error:
        warnings.warn(
            f"funcgrad: vmap could not batch {what} ({_first_line(error)}); "
            "fell back to a loop of unbatched calls, which gives the right answer more slowly. "
            "Pass strategy='loop' or chunk_size=1 to choose the loop directly.",
            FuncgradWarning,
            stacklevel=4,
        )
        return _loop(fn, args, out_dims)
    if check:
        batched_only = tuple(r for r, dim in zip(result, out_dims) if dim == 0)
        for index in sorted({0, batch // 2, batch - 1}):
            single = fn(*(arg[index] for arg in args))
            reference = tuple(s for s, dim in zip(single, out_dims) if dim == 0)
            problem = _mismatch(batched_only, reference, index)
            if problem is None:
                continue
            message = (
                f"funcgrad: check found that vmap computed {what} wrongly ({problem} against an "
                "unbatched call); this is a bug in a batching rule of torch, not in your code."
            )
            if check == "strict":
                raise BatchingMismatchError(message + " Use strategy='loop' to avoid vmap.")
            warnings.warn(message + " Fell back to a loop.", FuncgradWarning, stacklevel=4)
            return _loop(fn, args, out_dims)
    return result
