"""Real coordinates of tuples of (possibly complex) tensors.

A pullback is linear over the reals, also when ``y`` or ``x`` is complex: a complex entry
counts as two real coordinates (real and imaginary part). Stacking the real coordinates of
k cotangents gives the k x m matrix ``V`` that every strategy works with, and
``unit_rows(like, 0, m)`` is the basis of y's space that ``jacrev`` pulls back.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._types import Tensors


def real_size(leaves: Sequence[torch.Tensor]) -> int:
    """m: the real dimension of the space of ``leaves`` (complex entries count twice)."""
    return sum(leaf.numel() * (2 if leaf.is_complex() else 1) for leaf in leaves)


def real_dtype(dtypes: Sequence[torch.dtype]) -> torch.dtype:
    """The common real dtype of ``dtypes`` (float64 for complex128, ...)."""
    common = dtypes[0]
    for dtype in dtypes[1:]:
        common = torch.promote_types(common, dtype)
    return _REAL.get(common, common)


# (A table: dynamo cannot trace dtype.to_real().)
_REAL = {
    torch.complex32: torch.float16,
    torch.complex64: torch.float32,
    torch.complex128: torch.float64,
}


def to_coords(leaves: Sequence[torch.Tensor], batch: int) -> torch.Tensor:
    """Real coordinates of leaves that carry a leading batch dim: shape ``(batch, m_real)``."""
    dtype = real_dtype([leaf.dtype for leaf in leaves])
    parts = []
    for leaf in leaves:
        if leaf.is_complex():
            leaf = torch.view_as_real(leaf.resolve_conj())
        leaf = leaf.reshape(batch, -1)
        parts.append(leaf if leaf.dtype == dtype else leaf.to(dtype))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def from_coords(coords: torch.Tensor, like: Sequence[torch.Tensor]) -> Tensors:
    """Inverse of :func:`to_coords`: leaves shaped ``(batch, *like[i].shape)``, like's dtypes."""
    batch = coords.shape[0]
    leaves, start = [], 0
    for leaf in like:
        stop = start + leaf.numel() * (2 if leaf.is_complex() else 1)
        part = coords[:, start:stop]
        if leaf.is_complex():
            real = part.to(leaf.real.dtype).reshape(batch, *leaf.shape, 2).contiguous()
            leaves.append(torch.view_as_complex(real))
        else:
            leaves.append(part.to(leaf.dtype).reshape(batch, *leaf.shape))
        start = stop
    return tuple(leaves)


def unit_rows(like: Sequence[torch.Tensor], start: int, stop: int) -> Tensors:
    """Unit directions ``start..stop-1`` of the real space of ``like``, stacked on a leading
    dim: rows of the identity, built a chunk at a time (never the whole m x m identity)."""
    m, device = real_size(like), like[0].device
    # A comparison, not one_hot: one_hot reads its indices' range (a host read on the CPU).
    rows = torch.arange(start, stop, device=device)[:, None] == torch.arange(m, device=device)
    return from_coords(rows.to(real_dtype([leaf.dtype for leaf in like])), like)


def combine(coefficients: torch.Tensor, rows: Sequence[torch.Tensor]) -> Tensors:
    """``coefficients @ rows`` leaf by leaf: (k, r) times leaves (r, ...) gives leaves (k, ...)."""
    return tuple(torch.tensordot(coefficients.to(row.dtype), row, dims=1) for row in rows)
