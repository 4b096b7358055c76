"""The one engine: pull directions through f, by a plan.

Everything that sends directions through f lives here, for ``compose_heads``, ``Pullback``
and ``grads`` alike:

- :func:`batched` runs a linear map (a pullback or a JVP) over a batch of directions: one
  vmap, chunks, a loop, the fallback when vmap cannot batch, the ``check`` comparison.
- :func:`by_plan` forms the k products ``J^T v_i`` by a shape-only plan (vjp, loop, jacrev
  rows), with the non-finite recompute.
- :func:`forward_columns` takes J's columns by forward mode in ONE vmapped JVP (f's forward
  runs once, randomness shared), or says it cannot; :func:`by_columns` reduces them to
  ``V @ J``.
- :class:`Basis` and :func:`by_linearity` send only directions outside a kept span through
  f (the eager, data-dependent reuse of ``Pullback`` and ``grads``), with the non-finite,
  scale and half-precision handling.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence

import torch

from . import _coords
from ._errors import BatchingMismatchError, FuncgradWarning, first_line
from ._function import is_torch_func_limit, values_readable

Tensors = tuple[torch.Tensor, ...]
Pull = Callable[[Tensors], Tensors]


class CannotBatch(Exception):
    """vmap could not batch a map that must not be looped (forward mode): the caller
    chooses another way. Internal, never reaches the user."""


def _loop(fn: Callable[..., Tensors], args: Sequence[torch.Tensor]) -> Tensors:
    results = [fn(*(arg[i] for arg in args)) for i in range(args[0].shape[0])]
    return tuple(torch.stack(outputs) for outputs in zip(*results))


def _vmap(
    fn: Callable[..., Tensors],
    args: Sequence[torch.Tensor],
    chunk_size: int | None,
    randomness: str,
) -> Tensors:
    # torch's own chunk_size concatenates even a single chunk (a full copy): pass it only
    # when there is more than one chunk.
    if chunk_size is not None and chunk_size >= args[0].shape[0]:
        chunk_size = None
    return torch.func.vmap(fn, chunk_size=chunk_size, randomness=randomness)(*args)


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
    may_loop: bool = True,
) -> Tensors:
    """``fn`` over the leading dim of ``args`` (one vmap, one per chunk, or a loop).

    ``fn`` takes one slice of each arg and returns a flat tuple of tensors; every output
    gets the leading batch dim. With ``may_loop=False`` (forward mode, where each call runs
    f's forward and would draw new random numbers) the map is one vmap with
    ``randomness="same"`` or nothing: where that fails, :class:`CannotBatch` is raised.
    """
    batch = args[0].shape[0]
    if may_loop and (batch == 1 or chunk_size == 1 or not can_vmap):
        return _loop(fn, args)
    try:
        result = _vmap(fn, args, chunk_size if may_loop else None, "error" if may_loop else "same")
    except (RuntimeError, NotImplementedError) as error:
        if is_torch_func_limit(error):  # not a batching problem: a loop would fail the same way
            raise
        if not may_loop:
            raise CannotBatch(first_line(error)) from error
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
            if not may_loop:
                raise CannotBatch(message)
            warnings.warn(message + " Fell back to a loop.", FuncgradWarning, stacklevel=4)
            return _loop(fn, args)
    return result


def chunks(total: int, chunk_size: int | None) -> list[tuple[int, int]]:
    step = max(total if chunk_size is None else chunk_size, 1)
    return [(start, min(start + step, total)) for start in range(0, total, step)]


def zeros(k: int, like: Sequence[torch.Tensor]) -> Tensors:
    return tuple(torch.zeros((k, *x.shape), dtype=x.dtype, device=x.device) for x in like)


def nothing_to_pull(k: int, out_like: Tensors, x_like: Tensors) -> bool:
    """No direction needs f: no cotangents, or an empty y or x (every answer is zeros)."""
    return k == 0 or _coords.real_size(out_like) == 0 or _coords.real_size(x_like) == 0


def all_finite(leaves: Sequence[torch.Tensor]) -> bool:
    # One reduction per leaf: NaN and inf survive a sum (an overflow to inf only costs a
    # needless, still correct, recomputation).
    return all(bool(torch.isfinite(leaf.sum())) for leaf in leaves if leaf.numel())


def went_non_finite(grads: Tensors, out: Tensors) -> bool:
    """Whether a product ``V @ J`` produced inf/NaN, in eager mode only (data-dependent).

    A Jacobian row or column holds 0 * inf = NaN where autograd, pulling back the head's own
    cotangent, gives inf or a finite value: such results are recomputed by pulling back the
    cotangents themselves. Inside vmap/grad/compile this cannot be looked at (see README,
    Reliability).
    """
    return values_readable(out) and not all_finite(grads)


def by_plan(
    strategy: str,
    pull: Callable[..., Tensors],
    cotangents: Tensors,
    out: Tensors,
    x_like: Tensors,
    chunk_size: int | None,
) -> Tensors:
    """``J^T v_i`` for the k cotangents by a shape-only plan.

    ``vjp``/``loop``: pull back the k cotangents (``pull`` batches or loops). ``jacrev``:
    pull back the m unit directions of y, chunk by chunk, each chunk of J's rows reduced at
    once into ``V @ J`` (J is never held whole); where that product went non-finite in eager
    mode, the cotangents themselves are pulled back instead.
    """
    k, m = cotangents[0].shape[0], _coords.real_size(out)
    if nothing_to_pull(k, out, x_like):
        return zeros(k, x_like)
    if strategy in ("vjp", "loop"):
        return pull(cotangents)
    coords = _coords.to_coords(cotangents, k)
    grads: Tensors = ()
    for start, stop in chunks(m, chunk_size):
        part = _coords.combine(coords[:, start:stop], pull(_coords.unit_rows(out, start, stop)))
        grads = part if not grads else tuple(g + p for g, p in zip(grads, part))
    if went_non_finite(grads, out):
        return pull(cotangents)
    return grads


def by_columns(
    cotangents: Tensors, tangents: Tensors, out: Tensors, x_like: Tensors
) -> Tensors | None:
    """``J^T v_i`` for the k cotangents from J's n columns (forward mode): ``V @ J``. None
    where that product went non-finite in eager mode: the caller then pulls the cotangents
    themselves back, as autograd does."""
    k, n = cotangents[0].shape[0], tangents[0].shape[0]
    columns = _coords.to_coords(cotangents, k) @ _coords.to_coords(tangents, n).T
    grads = _coords.from_coords(columns, x_like)
    return None if went_non_finite(grads, out) else grads


def _replaying_random_draws(fn: Callable[..., Tensors], like: Sequence[torch.Tensor]):
    """``fn`` that, from its second call on, first restores the random number generators of
    ``like``'s devices to their state before the first call: every call of a forward-mode
    map then differentiates the same draw of f's random ops (dropout masks)."""
    devices = sorted({t.device.index or 0 for t in like if t.device.type == "cuda"})
    cpu_state = torch.get_rng_state()
    cuda_states = [torch.cuda.get_rng_state(d) for d in devices]
    calls = 0

    def replayed(*args: torch.Tensor) -> Tensors:
        nonlocal calls
        if calls:
            torch.set_rng_state(cpu_state)
            for device, state in zip(devices, cuda_states):
                torch.cuda.set_rng_state(state, device)
        calls += 1
        return fn(*args)

    return replayed


def forward_columns(jvp: Callable[..., Tensors], primals: Tensors, check: bool | str) -> Tensors:
    """J's n columns by forward mode: ``jvp`` along every real unit direction of the inputs,
    in one vmap with ``randomness="same"``, so f's forward runs once. The ``check`` calls
    replay the random draws of that one (dropout masks), so they compare like with like and
    leave the generators where one forward of f leaves them.

    Raises :class:`CannotBatch` where that is not possible (no batching rule, or ``check``
    found a wrong batching rule); the caller then uses reverse mode.
    """
    # One call needs no replay; and dynamo cannot trace reading the generator state.
    replay = check and not torch.compiler.is_compiling()
    return batched(
        _replaying_random_draws(jvp, primals) if replay else jvp,
        _coords.unit_rows(primals, 0, _coords.real_size(primals)),
        chunk_size=None,
        check=check,
        what="f's JVP",
        may_loop=False,
    )


# -- linearity: the kept basis of the eager paths ------------------------------------------

DEFAULT_BASIS_BYTES = 64 * 2**20


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    # Rank detection needs SVD/QR, which have no half-precision CPU kernels: detect in float32.
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _unit_rows(coords: torch.Tensor) -> torch.Tensor:
    """Every row divided by its norm (zero rows stay zero), computed without over- or
    underflow: each row is first divided by its largest entry. Rank detection on these rows
    is invariant to each row's scale."""
    amax = coords.abs().amax(dim=1, keepdim=True)
    scaled = coords / torch.where(amax > 0, amax, 1)
    norms = scaled.norm(dim=1, keepdim=True)
    return scaled / torch.where(norms > 0, norms, 1)


def _clearly_independent(rows: torch.Tensor) -> torch.Tensor | None:
    """An orthonormal basis of the rows' span (as rows) when a QR shows them clearly
    independent (every |R_ii| above sqrt(eps)), else None. Several times cheaper than an SVD
    for k << m (the usual multi-task case). It can only err towards more directions, which
    is still exact: each is pulled back through f."""
    if rows.shape[0] > rows.shape[1]:
        return None
    q, r = torch.linalg.qr(rows.T)
    if bool((torch.diagonal(r).abs() > math.sqrt(torch.finfo(rows.dtype).eps)).all()):
        return q.T
    return None


class Basis:
    """Orthonormal directions of y's space (rows, real coordinates) and their pullbacks.

    Bounded: it holds at most ``max_bytes`` (directions and images together); past that,
    cotangents outside its span are pulled back as they are and nothing new is kept.
    """

    def __init__(self, m: int, max_bytes: int = DEFAULT_BASIS_BYTES) -> None:
        self.m, self.max_bytes = m, max_bytes
        self.q: torch.Tensor | None = None  # (r, m), orthonormal rows
        self.images: Tensors = ()  # pullbacks of the rows, leaves (r, *x_leaf.shape)
        self.enabled = True

    @property
    def rank(self) -> int:
        return 0 if self.q is None else self.q.shape[0]

    @property
    def nbytes(self) -> int:
        if self.q is None:
            return 0
        return self.q.numel() * self.q.element_size() + sum(
            i.numel() * i.element_size() for i in self.images
        )

    def fits(self, new: torch.Tensor, x_like: Sequence[torch.Tensor]) -> bool:
        per_row = new.shape[1] * new.element_size() + sum(
            x.numel() * x.element_size() for x in x_like
        )
        return self.nbytes + new.shape[0] * per_row <= self.max_bytes

    def clear(self, enabled: bool = True) -> None:
        self.q, self.images, self.enabled = None, (), enabled

    def new_directions(self, units: torch.Tensor) -> torch.Tensor | None:
        """Orthonormal directions that, added to the kept ones, span the rows of ``units``
        (rows of norm 1 or 0); None when nothing is new. At most ``min(k, m - r)``. A row is
        new when its residual is above roundoff relative to its own norm, whatever the
        other rows' scales; a fresh basis facing k >= m rows takes y's unit basis (jacrev)."""
        k, r = units.shape[0], self.rank
        if r == self.m:
            return None
        if r == 0 and k >= self.m:
            return torch.eye(self.m, dtype=units.dtype, device=units.device)
        residual = units if self.q is None else units - (units @ self.q.T) @ self.q
        eps = torch.finfo(units.dtype).eps
        outside = residual.norm(dim=1) > 16 * eps * math.sqrt(r + 1)
        if not bool(outside.any()):
            return None
        residual = residual[outside]
        new = _clearly_independent(residual)
        if new is None:  # the rank is in doubt: the SVD tells it
            _, singular, vh = torch.linalg.svd(residual, full_matrices=False)
            keep = singular > 16 * eps * math.sqrt(residual.shape[0])
            new = vh[: int(keep.sum())][: self.m - r]
        if self.q is not None and new.shape[0]:  # once more against the basis, for orthogonality
            new = new - (new @ self.q.T) @ self.q
            new = torch.linalg.qr(new.T).Q.T
        return new if new.shape[0] else None

    def add(self, new: torch.Tensor, images: Tensors) -> None:
        if self.q is None:
            self.q, self.images = new, images
        else:
            self.q = torch.cat([self.q, new])
            self.images = tuple(torch.cat([a, b]) for a, b in zip(self.images, images))


def by_linearity(
    pull: Pull,
    cotangents: Tensors,
    out_like: Tensors,
    x_like: Tensors,
    basis: Basis,
    *,
    keep: bool,
) -> tuple[Tensors, int]:
    """``J^T v_i`` for k cotangents, sending through f only directions outside ``basis``.

    Every answer is a combination of the images of the kept (and new) directions, unless
    the product form could differ from autograd: non-finite cotangents, a non-finite image
    or product, differentiable cotangents facing a partial basis (the product would project
    their derivative), a basis over budget, or (``keep=False``) as many new directions as
    cotangents. Then the cotangents themselves go through f. Returns the answer and the
    number of directions pulled through f.
    """
    k, m = cotangents[0].shape[0], basis.m
    if nothing_to_pull(k, out_like, x_like):
        return zeros(k, x_like), 0
    coords = _coords.to_coords(cotangents, k)

    def direct(pulled: int = 0) -> tuple[Tensors, int]:
        return pull(cotangents), pulled + k

    if not basis.enabled or not bool(torch.isfinite(coords).all()):
        # NaN/inf cotangents go through f as they are, so they propagate as in autograd.
        return direct()
    work = coords.detach().to(_work_dtype(coords.dtype))
    new = basis.new_directions(_unit_rows(work))
    full = basis.rank + (0 if new is None else new.shape[0]) == m
    if coords.requires_grad and not full:
        return direct()
    pulled = 0
    if new is not None:
        if (not keep and new.shape[0] >= k) or not basis.fits(new, x_like):
            return direct()
        images = pull(_coords.from_coords(new, out_like))
        pulled = new.shape[0]
        if not all_finite(images):
            # A non-finite Jacobian would smear NaN over every combination: stop reusing.
            basis.clear(enabled=False)
            return direct(pulled)
        basis.add(new, images)
    if basis.q is None:  # every cotangent is zero
        return zeros(k, x_like), pulled
    coefficients = (coords if coords.requires_grad else work).to(basis.q.dtype) @ basis.q.T
    result = _coords.combine(coefficients, basis.images)
    if not all_finite(result):  # an overflow in the product that autograd may not have
        return direct(pulled)
    return result, pulled
