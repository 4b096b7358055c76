"""The one engine: pull directions through f's linearisation, by a plan.

Everything that sends directions through f lives here (with :mod:`funcgrad._linearize`,
which builds the linearisation), for every public entry point:

- :func:`by_plan`, :func:`forward_columns` and :func:`through_heads` run the parts of a
  :class:`~funcgrad.Plan` that :func:`funcgrad._execute.execute` puts together: reverse
  mode (``vjp``, ``loop``, ``jacrev`` rows, the non-finite recompute), forward mode, each
  head pulled through the heads and f at once on eager autograd;
- :func:`batched` runs a linear map over a batch of directions: one vmap, chunks, a loop,
  the fallback when vmap cannot batch, the ``check`` comparison;
- :func:`weighted` pulls back the one weighted direction ``w @ V``;
- :class:`Basis` and :func:`by_linearity` send only directions outside a kept span through
  f (the eager, data-dependent reuse of ``Pullback``, ``grads`` and ``backward``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import re
import sys
import threading
import time
import types
import warnings
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch

from . import _coords, _graph, _linearize, _memory
from ._errors import BatchingMismatchError, FuncgradWarning, first_line
from ._function import FlatFunction
from ._linearize import Linearization, RandomState
from ._plan import FIT_MIN, FIT_PROBE, FIT_RANGES, Plan
from ._record import Timing
from ._types import ChunkSize, Tensors
from ._validate import mismatch, values_readable

# What the heads give for f's output: their values (k,) and cotangents (leaves (k, ...)).
CotangentsOf = Callable[[Tensors], tuple[torch.Tensor, Tensors]]
# The heads' k scalar values on f's output, recorded on autograd's graph: one per head, or
# stacked (k,) where the heads ran in one vmap.
ValuesOf = Callable[[Tensors], list[torch.Tensor] | torch.Tensor]


class CannotBatch(Exception):
    """vmap could not batch a map that must not be looped (forward mode): the caller
    chooses another way. Internal, never reaches the user."""


# torch's warning when vmap has no batching rule for an op and loops over the batch inside.
SLOW_PATH = ".*There is a performance drop because we have not yet implemented the batching rule"
# The filter warnings.filterwarnings("ignore", message=SLOW_PATH) adds, put in front of the
# filters for the time of one vmap (see _vmap).
_IGNORE_SLOW_PATH = ("ignore", re.compile(SLOW_PATH, re.I), Warning, None, 0)


def _loop(
    fn: Callable[..., Tensors],
    args: Sequence[torch.Tensor],
    last_fn: Callable[..., Tensors] | None = None,
) -> Tensors:
    n = args[0].shape[0]
    if n == 1:  # one call: its outputs take the batch dim as views (no stack, no copy)
        call = fn if last_fn is None else last_fn
        return tuple(output.unsqueeze(0) for output in call(*(arg[0] for arg in args)))
    calls = [last_fn if last_fn is not None and i == n - 1 else fn for i in range(n)]
    results = [call(*(arg[i] for arg in args)) for i, call in enumerate(calls)]
    return tuple(torch.stack(outputs) for outputs in zip(*results))


def _vmap_last(
    fn: Callable[..., Tensors],
    last_fn: Callable[..., Tensors],
    args: Sequence[torch.Tensor],
    chunk_size: int | None,
    log: Log | None = None,
) -> Tensors:
    """``_vmap`` whose last chunk maps ``last_fn`` (torch's own ``chunk_size`` would map one
    function over every chunk)."""
    if chunk_size is None or chunk_size >= args[0].shape[0]:  # (one chunk: no slices)
        return _vmap(last_fn, args, None, "error", log)
    spans = chunks(args[0].shape[0], chunk_size)
    parts = [
        _vmap(last_fn if i == len(spans) - 1 else fn, [a[s:e] for a in args], None, "error", log)
        for i, (s, e) in enumerate(spans)
    ]
    return tuple(torch.cat(outputs) for outputs in zip(*parts))


def _vmap_watched(
    mapped: Callable[..., Tensors], args: Sequence[torch.Tensor], log: Log
) -> Tensors:
    """``mapped(*args)``, noting in ``log`` whether vmap warned of its slow path (that
    warning swallowed; any other shown as it would be)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.filterwarnings("always", message=SLOW_PATH)
        result = mapped(*args)
    for warning in caught:
        if _IGNORE_SLOW_PATH[1].match(str(warning.message)):
            log.slow_path = True
        else:
            warnings.warn_explicit(
                warning.message, warning.category, warning.filename, warning.lineno
            )
    return result


def _loop_after(
    fn: Callable[..., Tensors],
    args: Sequence[torch.Tensor],
    last_fn: Callable[..., Tensors] | None,
    why: str,
    freer: str | None,
) -> Tensors:
    """The loop of unbatched calls after a batched attempt that went wrong (``why``). Where
    that attempt ran ``last_fn`` (``freer``: the call that did), the last pass through an
    autograd graph, which frees it (``retain_graph=False``), the nodes it ran may have freed
    their saved tensors: then a clear error, before any ``.grad`` is written. Otherwise the
    loop's own error, if any, is the one to see."""
    try:
        return _loop(fn, args, last_fn)
    except RuntimeError as error:
        if freer is None or _graph.FREED_GRAPH not in str(error):
            raise
        raise RuntimeError(
            f"funcgrad: {why}, but the loop of unbatched calls that would give the answer "
            f"cannot run: {freer}, the last pass through the graph (retain_graph=False), had "
            "already freed part of it. Nothing was written. Pass retain_graph=True (the graph "
            "is then kept for the loop, and freed when you drop its outputs), or chunk_size=1 "
            "(a loop from the start, whose last direction frees the graph)."
        ) from error


def _vmap(
    fn: Callable[..., Tensors],
    args: Sequence[torch.Tensor],
    chunk_size: int | None,
    randomness: str,
    log: Log | None = None,
) -> Tensors:
    # torch's own chunk_size concatenates even a single chunk (a full copy): pass it only
    # when there is more than one chunk.
    if chunk_size is not None and chunk_size >= args[0].shape[0]:
        chunk_size = None
    # vmap's warning that it loops inside for an op without a batching rule is not for the
    # user, who never called vmap: it is an observation (``log.watch``) for the planner.
    mapped = torch.func.vmap(fn, chunk_size=chunk_size, randomness=randomness)
    if torch.compiler.is_compiling():  # (dynamo cannot trace the warnings filters)
        return mapped(*args)
    if log is not None and log.watch:
        return _vmap_watched(mapped, args, log)
    # What warnings.catch_warnings() + filterwarnings(...) do for this one filter, without
    # copying and restoring every filter (docs/performance.md);
    # _filters_mutated tells the warnings' per-module registries that the filters changed,
    # as filterwarnings does (else a warning ignored here would stay ignored after).
    filters = cast(list[Any], warnings.filters)
    mutated = getattr(warnings, "_filters_mutated", None)
    if mutated is None:  # (another Python than 3.11's warnings module: the public way)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=SLOW_PATH)
            return mapped(*args)
    filters.insert(0, _IGNORE_SLOW_PATH)
    mutated()
    try:
        return mapped(*args)
    finally:
        if _IGNORE_SLOW_PATH in filters:  # (else f reset the filters)
            filters.remove(_IGNORE_SLOW_PATH)
        mutated()


@dataclasses.dataclass
class Log:
    """What a call's batched maps saw, for its observations (one per call, never shared):
    ``measure``, time the first vmapped call against one unbatched call; ``watch``, record
    whether vmap warned of an op without a batching rule (its slow path) or could not batch
    at all (``slow_path``)."""

    measure: bool = False
    watch: bool = False
    timing: Timing | None = None
    slow_path: bool = False


# The clock of auto's timed calls and of vmap's measurement: the calling thread's CPU time,
# not wall time, so that a call the operating system suspends for another process (on a
# loaded machine, for longer than the whole call) does not decide a plan. It assumes f's
# work runs on the calling thread (torch's intra-op threads are waited on by it; a
# thread f starts itself is not counted), and times the host's side of a GPU call, as
# wall time without a synchronize did (docs/planning.md). On Windows, whose thread times
# advance by scheduler ticks (longer than a small call), wall time.
clock = time.perf_counter if sys.platform == "win32" else time.thread_time


def _vmap_measured(
    fn: Callable[..., Tensors],
    args: Sequence[torch.Tensor],
    chunk_size: int | None,
    what: str,
    log: Log,
) -> Tensors:
    """``_vmap``, timed against one unbatched call (one direction more through f), for
    ``log`` (vmap loops inside for ops without a batching rule, such as CPU attention's
    backward; torch.func's decomposed RNN is slow under vmap without saying so). The
    unbatched call runs first: it pays the one-time costs of the shapes (a first backward's
    kernels and buffers), so that a loop is chosen only where it wins against a warm vmap."""
    start = clock()
    fn(*(arg[0] for arg in args))
    single_s = clock() - start
    start = clock()
    result = _vmap(fn, args, chunk_size, "error", log)
    batched_s = clock() - start
    directions = args[0].shape[0]
    log.timing = Timing(what, batched_s / directions, single_s, directions=directions)
    return result


@dataclasses.dataclass
class ChunkFit:
    """``chunk_size="auto"`` for one call signature (or one :class:`~funcgrad.Pullback`):
    what pulling directions through f's linearisation costs, once measured, and the chunk
    that this cost gives under the memory budget in force at each call (a smaller budget
    gives a smaller chunk at once, with no new measurement).

    Every direction through one linearisation costs the same, so one record serves every
    chunked map of a signature (``jacrev``'s unit rows, ``vjp``'s cotangents, the
    non-finite recompute). It holds no tensor. Measured on one direction alone (not
    ``paired``), a chunk of d directions is taken to cost d times its peak (never less than
    it does while the cost is a fixed part plus a part per direction); the first later call
    whose budget and directions allow it then fits on two vmapped chunks (see
    :func:`measure_fit`), so that the first call's budget does not stay in the record.
    """

    # (fixed bytes whatever the chunk, bytes for each direction in a chunk); None: not
    # measured yet. One tuple, replaced whole: a call in another thread reads either fit.
    cost: tuple[int, int] | None = None
    device: torch.device | None = None
    warned: int | None = None  # the budget last warned about (below one direction)
    paired: bool = False  # fitted on two vmapped chunks, not only on one direction alone

    @property
    def measured(self) -> bool:
        return self.cost is not None

    @property
    def per_direction(self) -> int:
        return 1 if self.cost is None else self.cost[1]

    def measures(self, total: int) -> bool:
        """Whether a call of ``total`` directions measures (:func:`measure_fit`) under the
        budget in force."""
        if total <= FIT_PROBE[1]:
            return False
        return self.cost is None or (not self.paired and self.pair_fits(total))

    def pair_fits(self, remaining: int) -> bool:
        """Whether :data:`FIT_RANGES` run with at least one direction left after them, and
        their larger chunk fits the budget by what is measured (never past it)."""
        largest = max(stop - start for start, stop in FIT_RANGES)
        return remaining > FIT_MIN and self.chunk(warn=False) >= largest

    def chunk(self, what: str = "f's pullback", *, warn: bool = True) -> int:
        """The most directions a chunk may hold under the budget in force, at least 1: below
        one direction, one at a time, with one warning per budget (``warn``)."""
        cost, device = self.cost, self.device
        assert cost is not None and device is not None, "measure first"
        fixed, per_direction = cost
        budget = _memory.budget(device)
        fit = (budget - fixed) // per_direction
        if fit >= 1:
            return int(fit)
        if warn and self.warned != budget:
            self.warned = budget
            warnings.warn(
                f"funcgrad: chunk_size='auto': one direction through {what} needs about "
                f"{(fixed + per_direction) / 2**20:.3g} MiB, more than the memory "
                f"budget of {budget / 2**20:.3g} MiB; running one direction at a time. Raise "
                "the budget (funcgrad.memory_budget, FUNCGRAD_MEMORY_BUDGET) or free memory.",
                FuncgradWarning,
                stacklevel=outside_funcgrad(),
            )
        return 1


def outside_funcgrad() -> int:
    """The ``stacklevel`` that points its caller's warning at the first frame outside
    funcgrad (the user's call), whichever entry point led there."""
    frame: types.FrameType | None = sys._getframe(2)
    level = 2
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def fit_chunk(
    run: Callable[[int, int], Tensors],
    like: Sequence[torch.Tensor],
    total: int,
    what: str,
    record: ChunkFit | None,
) -> tuple[list[tuple[int, int, Tensors]], int | None]:
    """``chunk_size="auto"``: (the directions run to measure, as (start, stop, results) in
    order, and the chunk for the rest). Where the running object's :class:`ChunkFit` needs
    no measurement, its chunk under the budget in force, nothing run; else
    :func:`measure_fit` runs the first directions (their results are kept: no direction is
    pulled twice). None where nothing is fitted: values cannot be read (compiled code,
    inside transforms: unchunked), or one direction and nothing measured yet. ``record``:
    the caller's fit, filled here (None: measure afresh)."""
    # Values first: inside compiled code, dynamo cannot trace the context variable.
    if torch.compiler.is_compiling():
        return [], None
    _memory.setting()  # a bad budget string is refused before any pass, fitted or not
    if not values_readable(like):
        return [], None
    record = record if record is not None else ChunkFit()  # (None: measure on every call)
    if not record.measures(total):
        return [], record.chunk(what) if record.measured else None
    return measure_fit(record, run, like[0].device, total), record.chunk(what)


def measure_fit(
    record: ChunkFit, run: Callable[[int, int], Tensors], device: torch.device, total: int
) -> list[tuple[int, int, Tensors]]:
    """Fill ``record`` from the peak memory of ``run`` on the first of ``total`` directions,
    leaving at least one for the caller (whose last pass may free a graph); the (start,
    stop, results) run, in order.

    Unmeasured, direction 0 alone first (:data:`FIT_PROBE`, an unbatched call): a budget
    below what it took is one direction a pass from the first, and a chunk is taken to cost
    that peak per direction. Where that allows the larger of :data:`FIT_RANGES` and more
    than :data:`FIT_MIN` directions remain, the next ones run as two vmapped chunks, whose
    difference is what a direction costs in a vmap (one direction alone runs unbatched,
    whose peak is not a vmapped direction's)."""
    parts: list[tuple[int, int, Tensors]] = []
    stop = 0
    if record.cost is None:
        start, stop = FIT_PROBE
        probe, peak = _memory.peak_of(lambda: run(start, stop), device)
        parts.append((start, stop, probe))
        record.device = device
        record.cost = (0, max(peak, 1))
    if record.paired or not record.pair_fits(total - stop):
        return parts
    (start, mid), (_, end) = ((stop + a, stop + b) for a, b in FIT_RANGES)
    # The larger chunk first: a one-time allocation in the first run (cuBLAS's workspace on
    # CUDA) then inflates the cost of a direction, which chunks more than needed, instead of
    # cancelling it, which chunked nothing (docs/benchmarks_cuda.md).
    second, two = _memory.peak_of(lambda: run(mid, end), device)
    first, one = _memory.peak_of(lambda: run(start, mid), device)
    few, more = mid - start, end - mid
    per_direction = max((two - one) // (more - few), 1)
    record.device = device
    record.cost = (max(one - few * per_direction, 0), per_direction)
    record.paired = True
    return [*parts, (start, mid, first), (mid, end, second)]


def batched(
    fn: Callable[..., Tensors],
    args: Sequence[torch.Tensor],
    *,
    chunk_size: ChunkSize,
    check: bool | str,
    what: str,
    can_vmap: bool = True,
    may_loop: bool = True,
    last_fn: Callable[..., Tensors] | None = None,
    log: Log | None = None,
    fit: ChunkFit | None = None,
) -> Tensors:
    """``fn`` over the leading dim of ``args`` (one vmap, one per chunk, or a loop).

    ``fn`` takes one slice of each arg and returns a flat tuple of tensors; every output
    gets the leading batch dim. With ``may_loop=False`` (forward mode, where each call runs
    f's forward and would draw new random numbers) the map is one vmap with
    ``randomness="same"`` or nothing: where vmap fails, :class:`CannotBatch` is raised (a
    limit of forward mode itself propagates).
    ``last_fn`` (optional): ``fn`` that frees an autograd graph, for the call that ends the
    map (the last chunk's vmap, a loop's last direction, ``check``'s last comparison); every
    call before it is ``fn``. ``log``: where it measures, its first batched call is timed
    against one unbatched call (:func:`_vmap_measured`). ``fit``: ``chunk_size="auto"``'s
    record (None: measured afresh).
    """
    batch = args[0].shape[0]
    if chunk_size == "auto":
        if not may_loop:  # forward mode: all n columns in one batch, or reverse mode
            chunk_size = None
        else:  # the measured directions, unchecked, then the rest in fitted chunks
            again = functools.partial(batched, fn, what=what, can_vmap=can_vmap, log=log)

            def run(start: int, stop: int) -> Tensors:
                return again([arg[start:stop] for arg in args], chunk_size=None, check=False)

            measured, chunk = fit_chunk(run, args, batch, what, fit)
            if measured:
                rest = [arg[measured[-1][1] :] for arg in args]
                parts = [results for _, _, results in measured]
                parts.append(again(rest, chunk_size=chunk, check=check, last_fn=last_fn))
                return tuple(torch.cat(outputs) for outputs in zip(*parts))
            chunk_size = chunk
    if may_loop and (batch == 1 or chunk_size == 1 or not can_vmap):
        return _loop(fn, args, last_fn)
    checking = bool(check) and values_readable(args)
    # With check, the vmap keeps the graph for the comparisons; the last of them frees it.
    freeing = last_fn if may_loop and not checking else None
    measuring = (
        log is not None
        and log.measure
        and log.timing is None  # (the first batched call's, once a call)
        and may_loop
        and last_fn is None
        and values_readable(args)
    )
    try:
        if freeing is not None:
            result = _vmap_last(fn, freeing, args, chunk_size, log)
        elif not measuring:
            result = _vmap(
                fn, args, chunk_size if may_loop else None, "error" if may_loop else "same", log
            )
        else:
            assert log is not None
            result = _vmap_measured(fn, args, chunk_size, what, log)
    except (RuntimeError, NotImplementedError) as error:
        # Not a batching problem: a loop would fail the same way (forward mode: nor one
        # where forward mode itself cannot differentiate f; the caller says so).
        if _linearize.is_torch_func_limit(error) or (
            not may_loop and _linearize.is_forward_mode_limit(error)
        ):
            raise
        if not may_loop:
            raise CannotBatch(first_line(error)) from error
        why = f"vmap could not batch {what} ({first_line(error)})"
        # (Where the last pull failed part-way, the nodes it ran first may have freed theirs:
        # torch's error then says so.)
        ran_last = freeing is not None and _graph.FREED_GRAPH not in str(error)
        looped = _loop_after(
            fn, args, last_fn, why, "the failed batched call" if ran_last else None
        )
        if log is not None:  # (the next calls plan the loop)
            log.slow_path = True
        warnings.warn(
            f"funcgrad: vmap could not batch {what} ({first_line(error)}); "
            "fell back to a loop of unbatched calls, which gives the right answer more slowly. "
            "Pass strategy='loop' or chunk_size=1 to choose the loop directly.",
            FuncgradWarning,
            stacklevel=4,
        )
        return looped
    # The comparison reads values: eager only (not inside vmap/grad or a compiled region).
    if checking:
        unbatched: list[Tensors] = []
        for index in sorted({0, batch // 2, batch - 1}):
            call = last_fn if last_fn is not None and index == batch - 1 else fn
            unbatched.append(call(*(arg[index] for arg in args)))
            problem = mismatch(result, unbatched[-1], index)
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
            if len(unbatched) == batch:  # every direction ran unbatched: the loop's answer
                looped = tuple(torch.stack(outputs) for outputs in zip(*unbatched))
            else:
                why = f"check found that vmap computed {what} wrongly ({problem})"
                freer = "the unbatched call of the last direction" if call is not fn else None
                looped = _loop_after(fn, args, last_fn, why, freer)
            warnings.warn(message + " Fell back to a loop.", FuncgradWarning, stacklevel=4)
            return looped
    return result


def chunks(total: int, chunk_size: int | None) -> list[tuple[int, int]]:
    """Ranges of at most ``chunk_size`` (all at once for None) covering ``range(total)``."""
    step = max(total if chunk_size is None else chunk_size, 1)
    return [(start, min(start + step, total)) for start in range(0, total, step)]


def zeros(k: int, like: Sequence[torch.Tensor]) -> Tensors:
    return tuple(torch.zeros((k, *x.shape), dtype=x.dtype, device=x.device) for x in like)


def nothing_to_pull(k: int, out_like: Tensors, x_like: Tensors) -> bool:
    """No direction needs f: no cotangents, or an empty y or x (every answer is zeros)."""
    return k == 0 or _coords.real_size(out_like) == 0 or _coords.real_size(x_like) == 0


def all_finite(leaves: Sequence[torch.Tensor]) -> bool:
    """Whether every entry is finite, in ONE read of a device value (see :func:`_finite`)."""
    return not leaves or bool(_finite(leaves))


def went_non_finite(grads: Tensors, out: Tensors) -> bool:
    """Whether a product ``V @ J`` produced inf/NaN, in eager mode only (data-dependent).

    A Jacobian row or column holds 0 * inf = NaN where autograd, pulling back the head's own
    cotangent, gives inf or a finite value: such results are recomputed by pulling back the
    cotangents themselves. Inside vmap/grad/compile this cannot be looked at (see README,
    Reliability).
    """
    return values_readable(out) and not all_finite(grads)


def pull(
    lin: Linearization,
    directions: Tensors,
    chunk_size: ChunkSize,
    check: bool | str,
    *,
    loop: bool = False,
    last: bool = False,
    log: Log | None = None,
    fit: ChunkFit | None = None,
) -> Tensors:
    """``J^T d`` for a batch of directions (leaves with a leading batch dim): one vmapped
    call of the linearisation, one per chunk, or a loop. ``last``: no pull through ``lin``
    follows, so the last pass of this one runs ``lin.last_vjp`` (on an autograd graph it
    frees the graph unless the user asked to retain it, as ``weighted``'s one pull does)."""
    last_vjp = lin.last_vjp if last else None
    try:
        return batched(
            lambda *direction: lin.vjp(direction),
            directions,
            chunk_size=chunk_size,
            check=check,
            what=lin.what,
            can_vmap=lin.can_vmap and not loop,
            last_fn=None if last_vjp is None else (lambda *direction: last_vjp(direction)),
            log=log,
            fit=fit,
        )
    except RuntimeError as error:
        if _linearize.torch_limit(error) != "donated buffers":
            raise
        raise RuntimeError(
            f"funcgrad: {lin.what} runs a torch.compile'd backward, which may run only once "
            f"(donated buffers), but {directions[0].shape[0]} directions must go through it one "
            "by one (a compiled backward cannot be vmapped). Set "
            "torch._functorch.config.donated_buffer = False before the module's first call, "
            "use level='features' (one backward), or compile the layers inside the encoder "
            "rather than the encoder as a whole."
        ) from error


def by_plan(
    plan: Plan,
    lin: Linearization,
    cotangents: Tensors,
    check: bool | str,
    log: Log | None = None,
    fit: ChunkFit | None = None,
) -> Tensors:
    """``J^T v_i`` for the k cotangents by a reverse-mode plan.

    ``vjp``/``loop``: pull back the k cotangents (batched, or a loop). ``jacrev``: pull back
    the m unit directions of y, chunk by chunk, each chunk of J's rows reduced at once into
    ``V @ J`` (J is never held whole); where that product went non-finite in eager mode, the
    cotangents themselves are pulled back instead.
    """
    out, x_like = lin.out, lin.x_like
    k, m = cotangents[0].shape[0], _coords.real_size(out)
    if nothing_to_pull(k, out, x_like):
        return zeros(k, x_like)
    if plan.strategy != "jacrev":
        loop = plan.strategy == "loop"
        return pull(lin, cotangents, plan.chunk_size, check, loop=loop, log=log, fit=fit)
    coords = _coords.to_coords(cotangents, k)
    grads: Tensors = ()

    def add(start: int, stop: int, rows: Tensors) -> None:
        nonlocal grads
        part = _coords.combine(coords[:, start:stop], rows)
        grads = part if not grads else tuple(g + p for g, p in zip(grads, part))

    chunk, first = plan.chunk_size, 0
    if chunk == "auto":  # measure on the first rows, keep their results
        measured, chunk = fit_chunk(
            lambda start, stop: pull(lin, _coords.unit_rows(out, start, stop), None, False),
            _coords.unit_rows(out, 0, 1),
            m,
            lin.what,
            fit,
        )
        for start, stop, rows in measured:
            add(start, stop, rows)
        first = measured[-1][1] if measured else 0
    for start, stop in chunks(m - first, chunk):
        rows = pull(
            lin, _coords.unit_rows(out, first + start, first + stop), chunk, check, log=log, fit=fit
        )
        add(first + start, first + stop, rows)
    if went_non_finite(grads, out):
        return pull(lin, cotangents, plan.chunk_size, check, fit=fit)
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


def forward_columns(
    flat: FlatFunction, check: bool | str, rng: RandomState
) -> tuple[Tensors, Tensors, Tensors] | str | None:
    """J's n columns by forward mode: f's JVP along every real unit direction of the inputs,
    in one vmap with ``randomness="same"``, so f's forward runs once. ``check``'s unbatched
    calls replay that forward's random draws (dropout masks), so they compare like with like
    and leave the generators where one forward of f leaves them.

    Returns (f's output, aux tensors, tangents with a leading n), or where forward mode
    cannot do it (no batching rule, an op without a forward derivative, ``check`` found a
    wrong batching rule) why, for the caller's one warning once reverse mode (which covers
    strictly more of PyTorch) gave the answer: an error that reverse mode raises too is
    f's own, and no limit of forward mode. None where torch.func itself cannot
    differentiate f (the reverse-mode fallback's warning says so). The generators are
    restored in both cases.
    """
    if torch.compiler.is_compiling():  # (dynamo cannot enter a lock; compiled code is traced)
        return _forward_columns(flat, check, rng)
    with _FORWARD_AD:
        return _forward_columns(flat, check, rng)


# torch's forward-mode AD levels are global to the process: two threads in forward mode at once
# corrupt each other's tangents (or raise, which read as a forward-mode limit). One at a time;
# re-entrant, for an f that calls funcgrad.
_FORWARD_AD = threading.RLock()


def _forward_columns(
    flat: FlatFunction, check: bool | str, rng: RandomState
) -> tuple[Tensors, Tensors, Tensors] | str | None:
    primals = flat.leaves
    jvp = _linearize.jvp_of(flat)
    # The watched call runs in grad mode, as reverse mode's: the ops that f itself runs in
    # no-grad mode are then the only ones seen in it (Facts.no_grad); no graph is kept.
    watched = flat.watch and not torch.is_grad_enabled() and not torch.compiler.is_compiling()
    flat.forward_mode = True
    try:
        with torch.enable_grad() if watched else contextlib.nullcontext():
            stacked = batched(
                rng.replaying(jvp) if check else jvp,
                _coords.unit_rows(primals, 0, _coords.real_size(primals)),
                chunk_size=None,
                check=check,
                what="f's JVP",
                may_loop=False,
            )
        if watched:
            stacked = tuple(s.detach() for s in stacked)
    except CannotBatch as error:
        why = f"vmap cannot batch its JVPs in one call ({error})"
    except (RuntimeError, NotImplementedError) as error:
        if _linearize.is_torch_func_limit(error):  # of_function's fallback reports this one
            rng.restore()
            return None
        if isinstance(error, BatchingMismatchError) or not _linearize.is_forward_mode_limit(error):
            raise
        why = f"forward mode cannot differentiate f ({first_line(error)})"
    else:
        if not (flat.drew and not torch.is_grad_enabled() and values_readable(primals)):
            n_out = flat.out_def.num_leaves  # known once f has run
            # Every output is batched (f's own as broadcast views): row 0 is f's output.
            out = tuple(s[0] for s in stacked[:n_out])
            return out, tuple(s[0] for s in stacked[2 * n_out :]), stacked[n_out : 2 * n_out]
        # f drew random numbers, which the batched JVP draws otherwise than one eager forward.
        why = "f draws random numbers, and its batched JVP draws other ones than eager"
    rng.restore()
    return why


def through_heads(lin: Linearization, values_of: ValuesOf) -> tuple[torch.Tensor, Tensors]:
    """(values (k,), per-head gradients) on eager autograd with the heads on f's graph: each
    head's value pulled back through its head and f in one ``torch.autograd.grad``, as the
    loop a user writes: one backward call a head where forming its cotangent first takes
    two. For the plans that loop (or have one head): a vmapped batch forms the cotangents
    first (``Plan.through_heads``)."""
    with torch.enable_grad():  # (the values, and the rows pulled, on f's graph)
        outputs = values_of(lin.attached)
        rows = outputs if isinstance(outputs, list) else list(outputs.unbind())
    with torch.no_grad():  # (the values alone are stacked off the graph: no node for them)
        values = outputs.detach() if isinstance(outputs, torch.Tensor) else torch.stack(rows)
    return values, output_grads(rows, lin.inputs)


def weighted_direction(weights: torch.Tensor, cotangents: Tensors, like: Tensors) -> Tensors:
    """``sum_i w_i v_i`` over k cotangent leaves (k, ...): the one direction to pull back,
    shaped like ``like``."""
    rows = _coords.to_coords(cotangents, cotangents[0].shape[0])
    return tuple(d[0] for d in _coords.from_coords((weights.to(rows.dtype) @ rows)[None], like))


def weighted(lin: Linearization, weights: torch.Tensor, cotangents: Tensors) -> Tensors:
    """``(w @ V) J``: ONE pull of the weighted cotangent, whatever k (the last pull: an
    autograd graph is then freed unless the user asked to retain it)."""
    direction = weighted_direction(weights, cotangents, lin.out)
    return (lin.last_vjp or lin.vjp)(direction)


# -- linearity: the kept basis of the eager paths ------------------------------------------

DEFAULT_BASIS_BYTES = 64 * 2**20


# Real dtypes that are their own work dtype (coordinates in them need no conversion).
_PLAIN_WORK = (torch.float32, torch.float64)


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    # Rank detection needs SVD/QR, which have no half-precision CPU kernels: detect in float32.
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _unit_scales(coords: torch.Tensor) -> torch.Tensor:
    """The factor (k, 1) that makes each row of norm 1 (1 for zero rows), computed without
    underflow: each row is first divided by its largest entry. It is inf where the factor
    overflows (a row of subnormal size, such as 1e-310 in float64): no image can be scaled
    up to such a row's unit direction (the row's own image has lost its precision), so
    :meth:`Basis.extension` sends its direction through f."""
    amax = coords.abs().amax(dim=1, keepdim=True)
    amax = torch.where(amax > 0, amax, 1)
    norms = (coords / amax).norm(dim=1, keepdim=True)
    return 1 / amax / torch.where(norms > 0, norms, 1)


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
        basis: torch.Tensor = q.T
        return basis
    return None


def _finite(leaves: Sequence[torch.Tensor]) -> torch.Tensor:
    """Whether every entry is finite, as a device boolean (read nothing): NaN and inf
    survive a sum (an overflow to inf only costs a needless, still correct, recomputation)."""
    sums = [torch.isfinite(leaf.sum()) for leaf in leaves if leaf.numel()]
    if not sums:
        return torch.ones((), dtype=torch.bool, device=leaves[0].device)
    return torch.stack([s.to(sums[0].device) for s in sums]).all()


def _error_level(dtype: torch.dtype) -> float:
    """How far off a derived image (see :meth:`Basis.extension`) may be, in eps times the
    Jacobian's scale: eps**(-1/4), an error of eps**(3/4) at most (float64: 2e-12, float32:
    7e-6); past it, the direction goes through f."""
    return 1 / math.sqrt(math.sqrt(torch.finfo(dtype).eps))


@dataclasses.dataclass
class _Extension:
    """Orthonormal directions spanning held rows outside a basis, with their pullbacks
    derived by linearity (no pass through f), and device flags for whether to trust them."""

    q: torch.Tensor  # (s, m) rows, orthogonal to the basis
    images: Tensors  # their pullbacks, leaves (s, ...)
    level: torch.Tensor  # a bound on their images' error, in eps times J's scale
    sound: torch.Tensor  # all finite, the level within _error_level
    broken: torch.Tensor  # finite held cotangents with non-finite pullbacks: J is not finite
    rest: torch.Tensor  # (t, m) rows of the held span outside q and these, to be pulled


_LAZY_CLONE = getattr(torch, "_lazy_clone", None)


def _owned(t: torch.Tensor) -> torch.Tensor:
    """A detached copy of ``t`` that no one else can write to. On the CPU a copy-on-write one
    (``torch._lazy_clone``): nothing is copied unless ``t`` or the copy is written to later,
    which then copies for itself (measured: a plain clone of the images of 8 directions on
    a 1.3M-parameter MLP took as long as their pullback). Elsewhere, and for a tensor
    subclass, a plain clone (copy-on-write is exercised here on the CPU only), as for memory
    torch did not allocate (``from_numpy``, ``frombuffer``, DLPack, shared memory), whose
    storage it cannot share."""
    t = t.detach() if t.requires_grad else t  # (no graph to cut otherwise)
    if _LAZY_CLONE is not None and t.is_cpu and type(t) is torch.Tensor:
        with contextlib.suppress(RuntimeError):
            copy: torch.Tensor = _LAZY_CLONE(t)
            return copy
    return t.clone()


class Basis:
    """Orthonormal directions of y's space (rows, real coordinates) and their pullbacks.

    Lazy: the cotangents pulled back as they are (a first call, or a call whose cotangents
    all lie outside the basis) are held with their pullbacks, unchecked; the next call turns
    them into orthonormal directions by linearity, with no pass through f, in the same host
    read as its own rank test (:func:`by_linearity`).

    Bounded: it holds at most ``max_bytes`` (directions and images together, held rows
    included); past that, cotangents outside its span are pulled back as they are and
    nothing new is kept.
    """

    def __init__(self, m: int, max_bytes: int = DEFAULT_BASIS_BYTES) -> None:
        self.m, self.max_bytes = m, max_bytes
        self.q: torch.Tensor | None = None  # (r, m), orthonormal rows
        self.images: Tensors = ()  # pullbacks of the rows, leaves (r, *x_leaf.shape)
        # A bound on each image's error, in eps times the Jacobian's scale (r,): 1 for an
        # image pulled through f, more for one derived by linearity (see extension).
        self.levels: torch.Tensor | None = None
        # Cotangents pulled back as they were, not yet in q: (their real coordinates
        # (p, m) in the work dtype, and their pullbacks, leaves (p, ...)), copies the basis
        # owns (see hold).
        self.held: tuple[torch.Tensor, Tensors] | None = None
        self.enabled = True
        self._row_bytes: int | None = None  # a direction and its image, once known

    @property
    def rank(self) -> int:
        """The orthonormal directions kept (held rows not included: see :meth:`settle`)."""
        return 0 if self.q is None else self.q.shape[0]

    @property
    def kept(self) -> int:
        """Directions kept: the orthonormal ones and the held rows."""
        return self.rank + (0 if self.held is None else self.held[0].shape[0])

    @property
    def nbytes(self) -> int:
        if self.q is None and self.held is None:
            return 0
        parts = [] if self.q is None else [self.q, *self.images]
        if self.held is not None:
            parts += [self.held[0], *self.held[1]]
        return sum(p.numel() * p.element_size() for p in parts)

    def fits(self, rows: int, out_like: Tensors, x_like: Tensors) -> bool:
        """Whether ``rows`` more directions and their images fit the budget."""
        if self._row_bytes is None:  # a direction in the work dtype, its image as the inputs
            item = _work_dtype(_coords.real_dtype([o.dtype for o in out_like])).itemsize
            self._row_bytes = self.m * item + sum(x.numel() * x.element_size() for x in x_like)
        return self.nbytes + rows * self._row_bytes <= self.max_bytes

    def clear(self, enabled: bool = True) -> None:
        self.q, self.images, self.held, self.enabled = None, (), None, enabled
        self.levels = None

    def hold(self, cotangents: Tensors, images: Tensors) -> None:
        """Keep cotangents pulled back as they are (at most ``m - rank`` of them), with their
        pullbacks, to be turned into directions by the next call.

        Both belong to the caller (its argument and the answer it gets) and may share
        storage with each other (a view's pullback is a view of the cotangent), so the
        basis keeps copies of its own: the cotangents as real coordinates in the work dtype
        (a copy only where :func:`_coords.to_coords` made none), and the pullbacks, each
        by :func:`_owned`. Then nothing the caller does in place to either can reach the
        basis."""
        p = cotangents[0].shape[0]
        assert self.held is None and p <= self.m - self.rank
        if len(cotangents) == 1 and cotangents[0].dtype in _PLAIN_WORK:  # (the usual case)
            # to_coords would return a view of the one leaf: the basis's own copy of it
            leaf = cotangents[0]
            coords = _owned(leaf if leaf.dim() == 2 else leaf.reshape(p, -1))
        else:
            coords = _coords.to_coords(tuple(c.detach() for c in cotangents), p)
            work = _work_dtype(coords.dtype)
            # (a view of the one leaf where to_coords converts and concatenates nothing)
            coords = _owned(coords) if len(cotangents) == 1 and coords.dtype == work else coords
            coords = coords.to(work)
        self.held = coords, tuple(_owned(image) for image in images)

    def extension(self, all_rows: bool = True) -> _Extension:
        """The held rows' orthonormal directions outside ``q`` and their pullbacks, derived
        by linearity: with ``Z = D P - C Q`` (P the held rows, D their unit scales, C their
        coordinates on q, projected twice for orthogonality) and ``Z = U S Vh``, the new
        directions are ``Vh = S^-1 U^T Z``, whose pullbacks are the same combination of the
        held pullbacks and q's images. Their error is bounded by ``||S^-1||`` (the held
        images' roundoff) plus ``||S^-1 U^T C||`` times q's own error levels: past
        :func:`_error_level` they are not sound. ``all_rows``: every singular direction (no
        read; the flags say whether to trust them); else (reads) those that keep the level
        within bounds, and in ``rest`` the other directions of the held span above roundoff,
        whose pullbacks must go through f."""
        assert self.held is not None
        coords, held_images = self.held
        scales = _unit_scales(coords)
        # The unit rows from _unit_rows, not coords * scales: finite where a scale overflows.
        residual = _unit_rows(coords)
        projection = None
        if self.q is not None:
            first = residual @ self.q.T
            residual = residual - first @ self.q
            second = residual @ self.q.T
            residual = residual - second @ self.q
            projection = first + second
        finite = torch.isfinite(coords).all()  # (the SVD refuses NaN: zeros, then not sound)
        u, s, vh = torch.linalg.svd(torch.where(finite, residual, 0), full_matrices=False)
        rest, limit = vh[:0], _error_level(coords.dtype)
        # A scale that overflows (a subnormal row) leaves no image to derive: no bound.
        unbounded = torch.where(torch.isfinite(scales).all(), 0, math.inf)

        def level(u: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            mix = u.T / torch.where(s > 0, s, 1)[:, None]
            bound = mix.norm() + unbounded
            if projection is not None and self.levels is not None:
                bound = bound + ((mix @ projection) * self.levels).norm()
            return mix, bound

        if not all_rows:  # the directions that keep the error level in bounds
            above = int((s > _roundoff(coords.dtype, s.shape[0] - 1)).sum())
            kept = int((s > 1 / limit).sum())
            if kept and float(level(u[:, :kept], s[:kept])[1]) > limit:
                kept = 0
            rest = vh[kept:above]
            u, s, vh = u[:, :kept], s[:kept], vh[:kept]
        # Vh = S^-1 U^T D P - S^-1 U^T C Q
        mix, bound = level(u, s)
        images = _coords.combine(mix * scales.T, held_images)
        if projection is not None and self.q is not None:
            images = tuple(
                a - b for a, b in zip(images, _coords.combine(mix @ projection, self.images))
            )
        images_finite = _finite(held_images)
        return _Extension(
            vh,
            images,
            level=bound,
            sound=finite & images_finite & (bound <= limit) & (s > 1 / limit).all(),
            broken=finite & ~images_finite,
            rest=rest,
        )

    def extend(self, ext: _Extension) -> None:
        """Add ``ext``'s directions; the held rows are then spent."""
        self.held = None
        if ext.q.shape[0]:
            self.add(ext.q, ext.images, ext.level.expand(ext.q.shape[0]))

    def settle(self, pull_rows: Callable[[torch.Tensor], Tensors], x_like: Tensors) -> int:
        """Turn the held rows into directions now (host reads): by linearity where that is
        well conditioned, the rest of their span pulled through f (``pull_rows``), as a
        fresh call would have; a non-finite pullback stops the reuse. Returns the
        directions pulled."""
        if self.held is None:
            return 0
        held, images = self.held
        code = int(_finite([held]) + 2 * _finite(images))
        if code != 3:
            if code == 1:  # finite cotangents, non-finite pullbacks: J is not finite
                self.clear(enabled=False)  # (it would smear NaN over every combination)
            self.held = None  # non-finite cotangents: nothing to learn from them
            return 0
        ext = self.extension(all_rows=False)
        self.extend(ext)
        rest = ext.rest
        if not rest.shape[0] or not self.fits(rest.shape[0], (held,), x_like):
            return 0
        if self.q is not None:  # small singular directions: once more against q, for orthogonality
            rest = rest - (rest @ self.q.T) @ self.q
            rest = torch.linalg.qr(rest.T).Q.T
        pulled = pull_rows(rest)
        if all_finite(pulled):
            self.add(rest, pulled)
        else:
            self.clear(enabled=False)
        return rest.shape[0]

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
        outside = residual.norm(dim=1) > _roundoff(units.dtype, r)
        if not bool(outside.any()):
            return None
        residual = residual[outside]
        new = _clearly_independent(residual)
        if new is None:  # the rank is in doubt: the SVD tells it
            eps = torch.finfo(units.dtype).eps
            _, singular, vh = torch.linalg.svd(residual, full_matrices=False)
            keep = singular > 16 * eps * math.sqrt(residual.shape[0])
            new = vh[: int(keep.sum())][: self.m - r]
        if self.q is not None and new.shape[0]:  # once more against the basis, for orthogonality
            new = new - (new @ self.q.T) @ self.q
            new = torch.linalg.qr(new.T).Q.T
        return new if new.shape[0] else None

    def add(self, new: torch.Tensor, images: Tensors, levels: torch.Tensor | None = None) -> None:
        """Add directions and their images (pulled through f, unless ``levels`` says how
        far off they may be)."""
        levels = new.new_ones(new.shape[0]) if levels is None else levels.to(new.dtype)
        if self.q is None or self.levels is None:
            self.q, self.images, self.levels = new, images, levels
        else:
            self.q = torch.cat([self.q, new])
            self.images = tuple(torch.cat([a, b]) for a, b in zip(self.images, images))
            self.levels = torch.cat([self.levels, levels])


def _roundoff(dtype: torch.dtype, rank: int) -> float:
    """A unit row's residual outside ``rank`` orthonormal directions below this is roundoff."""
    return 16 * float(torch.finfo(dtype).eps) * math.sqrt(rank + 1)


def once(
    plan: Plan, lin: Linearization, cotangents: Tensors, check: bool | str, last: bool
) -> Tensors:
    """``J^T v_i`` for k cotangents by a one-shot plan (``grads``, ``backward``; see
    :func:`funcgrad._plan.decide`): ``jacrev`` pulls y's m unit directions and combines them
    (one read: where the product is not finite, or values cannot be read, the cotangents
    themselves go through f, as autograd would), ``vjp`` the cotangents themselves. ``last``:
    no pull through ``lin`` follows (see :func:`pull`)."""
    k, chunk = cotangents[0].shape[0], plan.chunk_size
    if nothing_to_pull(k, lin.out, lin.x_like):
        return zeros(k, lin.x_like)
    if plan.strategy == "jacrev" and values_readable(cotangents):
        images = pull(lin, _coords.unit_rows(lin.out, 0, plan.m), chunk, check)
        result = _coords.combine(_coords.to_coords(cotangents, k), images)
        if all_finite(result):
            return result
    return pull(lin, cotangents, chunk, check, last=last)


def by_linearity(pulls: Pulls, basis: Basis) -> tuple[Tensors, int]:
    """``J^T v_i`` for k cotangents (a `Pullback`), sending through f only directions
    outside ``basis``.

    Every answer is a combination of the images of the kept (and new) directions, unless
    the product form could differ from autograd: non-finite cotangents, a non-finite image
    or product, differentiable cotangents facing a partial basis (the product would project
    their derivative), a basis over budget or turned off (``reuse=False``, or
    ``reuse="auto"`` chose to pull). Then the cotangents themselves go through f.
    Returns the answer and the number of directions pulled through f.

    It reads at most one value in the usual calls:
    - nothing kept yet and k < m: the k cotangents go through f as they are (no read), and
      are held (:meth:`Basis.hold`);
    - nothing kept and k >= m: y's m unit directions, combined (one read: finite?);
    - else one read tells, at once, whether the held rows turned into directions soundly,
      whether the cotangents are finite, how many lie outside the kept span and whether
      their product is finite. Inside the span: the product. All outside, and at most
      ``m - r`` of them: the cotangents go through f as they are, and are held. A mix of
      both, or more than ``m - r``: the rank is detected (a few reads), and only the new
      orthonormal directions go through f.
    """
    lin, cotangents = pulls.lin, pulls.cotangents
    k, m = cotangents[0].shape[0], basis.m
    out_like, x_like = lin.out, lin.x_like
    if k == 0 or m == 0 or _coords.real_size(x_like) == 0:  # (nothing_to_pull; m is y's)
        return zeros(k, x_like), 0
    direct = pulls.direct
    if not (basis.enabled and values_readable(cotangents)):  # reuse reads values: eager only
        return direct()
    if basis.kept == 0 and k <= m:
        # Nothing kept yet: pulled as they are (no read), held for the next call.
        result, pulled = direct()
        if basis.fits(k, out_like, x_like):
            basis.hold(cotangents, result)
        return result, pulled

    coords = _coords.to_coords(cotangents, k)
    work = coords.detach().to(_work_dtype(coords.dtype))
    if basis.kept == 0:
        return _unit_basis(pulls, coords, basis)
    pull_rows = pulls.rows
    settled = 0
    if coords.requires_grad:  # (create_graph) a product must not project their derivative
        settled = basis.settle(pull_rows, x_like)
        if basis.rank < m:
            return direct(settled)
    if basis.held is None and basis.rank == m:  # y's whole space: a product
        assert basis.q is not None
        coefficients = (coords if coords.requires_grad else work).to(basis.q.dtype) @ basis.q.T
        result = _coords.combine(coefficients, basis.images)
        return (result, settled) if bool(_finite([work, *result])) else direct(settled)

    # One read: the held rows' directions, the cotangents' residual and their product.
    q, images = basis.q, basis.images
    ext = pulls.setup(basis.extension) if basis.held is not None else None
    if ext is not None:
        q = ext.q if q is None else torch.cat([q, ext.q])
        images = ext.images if not images else tuple(map(torch.cat, zip(images, ext.images)))
    assert q is not None
    units = _unit_rows(work)
    residual = units - (units @ q.T) @ q
    outside = (residual.norm(dim=1) > _roundoff(work.dtype, q.shape[0])).sum()
    result = _coords.combine(work.to(q.dtype) @ q.T, images)
    flags = [_finite([work]), _finite(result)]
    if ext is not None:
        flags += [ext.broken, ext.sound]
    packed = outside << 4  # the count of rows outside above four flag bits
    for bit, flag in enumerate(flags):
        packed = packed + flag * (1 << bit)
    code = int(packed)
    finite, product_finite, outside_count = code & 1, code & 2, code >> 4
    if ext is not None:
        if code & 4:
            basis.clear(enabled=False)  # a non-finite Jacobian would smear NaN everywhere
            return direct()
        if code & 8:
            basis.extend(ext)
        else:  # dependent, ill-conditioned or non-finite held rows (host reads)
            settled = basis.settle(pull_rows, x_like)
            outside_count = -1  # the product above used other directions: detect the rank
            if not basis.enabled:
                return direct(settled)
    if not finite:  # NaN/inf cotangents go through f as they are, as in autograd
        return direct(settled)
    if outside_count == 0:
        return (result, 0) if product_finite else direct()
    if outside_count == k and k <= m - basis.rank:  # all new: pulled as they are, held
        result, pulled = direct()
        if basis.fits(k, out_like, x_like):
            basis.hold(cotangents, result)
        return result, pulled
    result, pulled = _new_directions(pulls, coords, units, basis)
    return result, settled + pulled


@dataclasses.dataclass(slots=True)
class Pulls:
    """One `Pullback` call's pulls through f, with its options: the cotangents themselves
    (``direct``), or other directions (``rows``: real coordinates on y; ``of``: leaves).
    ``timed`` (``reuse="auto"``'s first calls, :func:`funcgrad._plan.pullback_reuse`):
    ``seconds`` adds up their thread time (:data:`clock`), ``setup_seconds`` that of the
    work a later call need not repeat (the held rows turned into directions)."""

    lin: Linearization
    cotangents: Tensors
    chunk_size: ChunkSize
    check: bool | str
    fit: ChunkFit | None
    timed: bool = False
    seconds: float = 0.0
    setup_seconds: float = 0.0

    def of(self, directions: Tensors) -> Tensors:
        if not self.timed:
            return pull(self.lin, directions, self.chunk_size, self.check, fit=self.fit)
        start = clock()
        try:
            return pull(self.lin, directions, self.chunk_size, self.check, fit=self.fit)
        finally:
            self.seconds += clock() - start

    def setup(self, work: Callable[[], _Extension]) -> _Extension:
        if not self.timed:
            return work()
        start = clock()
        try:
            return work()
        finally:
            self.setup_seconds += clock() - start

    def rows(self, rows: torch.Tensor) -> Tensors:
        return self.of(_coords.from_coords(rows, self.lin.out))

    def direct(self, pulled: int = 0) -> tuple[Tensors, int]:
        """The cotangents themselves through f, and the directions pulled in all (``pulled``
        before them)."""
        return self.of(self.cotangents), pulled + self.cotangents[0].shape[0]


def _unit_basis(pulls: Pulls, coords: torch.Tensor, basis: Basis) -> tuple[Tensors, int]:
    """A fresh basis facing k >= m cotangents: y's m unit directions through f, combined;
    one read (whether the images and the product are finite)."""
    m, lin = basis.m, pulls.lin
    images = pulls.of(_coords.unit_rows(lin.out, 0, m))
    result = _coords.combine(coords, images)
    code = int(_finite(images).int() + 2 * _finite([coords.detach(), *result]).int())
    if code & 1:
        eye = torch.eye(m, dtype=_work_dtype(coords.dtype), device=coords.device)
        if basis.fits(m, lin.out, lin.x_like):
            basis.add(eye, tuple(image.detach() for image in images))
    else:
        basis.clear(enabled=False)  # a non-finite Jacobian would smear NaN everywhere
    if code & 2:
        return result, m
    return pulls.direct(m)


def _new_directions(
    pulls: Pulls, coords: torch.Tensor, units: torch.Tensor, basis: Basis
) -> tuple[Tensors, int]:
    """Cotangents partly outside the kept span, or more of them than the span lacks: the rank
    is detected (host reads), and only the new orthonormal directions go through f."""
    k, m, lin, direct = coords.shape[0], basis.m, pulls.lin, pulls.direct
    x_like = lin.x_like
    new = basis.new_directions(units)
    full = basis.rank + (0 if new is None else new.shape[0]) == m
    if coords.requires_grad and not full:
        return direct()
    pulled = 0
    if new is not None:
        if not basis.fits(new.shape[0], lin.out, x_like):
            return direct()
        images = pulls.rows(new)
        pulled = new.shape[0]
        if not all_finite(images):
            # A non-finite Jacobian would smear NaN over every combination: stop reusing.
            basis.clear(enabled=False)
            return direct(pulled)
        basis.add(new, images)
    if basis.q is None:  # every cotangent is zero
        return zeros(k, x_like), pulled
    work = coords if coords.requires_grad else coords.detach().to(_work_dtype(coords.dtype))
    result = _coords.combine(work.to(basis.q.dtype) @ basis.q.T, basis.images)
    if not all_finite(result):  # an overflow in the product that autograd may not have
        return direct(pulled)
    return result, pulled


# -- the cheap side: gradients of k scalar outputs (heads, task losses) --------------------


def output_grads(outputs: Sequence[torch.Tensor], inputs: Tensors) -> Tensors:
    """The gradients of each of k scalar ``outputs`` w.r.t. ``inputs``, stacked: leaves
    ``(k, *input.shape)``, zeros where an output does not reach an input, as k calls of
    ``torch.autograd.grad(output, inputs)`` give them (the graph is retained).

    One ``torch.autograd.grad`` per output: measured cheapest on the CPU and on a GPU
    (one batched backward with ``is_grads_batched`` runs the legacy vmap:
    docs/performance.md), and it reads no device value (a batched backward must be
    checked for 0 * inf, where an infinite derivative on one output's path meets the other
    rows' zero cotangents)."""
    rows = [
        _linearize.autograd_grad(o, inputs, None, retain_graph=True)
        if o.requires_grad
        else tuple(torch.zeros_like(x) for x in inputs)
        for o in outputs
    ]
    return tuple(torch.stack([row[j] for row in rows]) for j in range(len(inputs)))
