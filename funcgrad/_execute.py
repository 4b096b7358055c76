"""``execute``: run a :class:`~funcgrad.Plan` for k heads, exactly, and report what it saw.

It decides nothing: where y's size is known only once f ran, it asks ``replan`` (the
caller's :func:`~funcgrad._plan.decide` with that size), and every fallback it takes is one
the plan lists. f runs once (forward mode, or reverse mode on the plan's engine); a
fallback that runs it again replays its random draws (:class:`RandomState`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib
import sys
import warnings
from collections.abc import Callable, Iterator

import torch

from . import _coords, _engine, _linearize
from ._engine import ChunkFit, CotangentsOf, Log, ValuesOf
from ._errors import ForwardModeNoGradError, FuncgradWarning
from ._function import FlatFunction
from ._linearize import RandomState
from ._plan import Plan
from ._record import Choice, Observations
from ._types import Engine, Tensors

# The plan for y's real size m, after f ran (forward mode no longer a candidate).
Replan = Callable[[int, bool], Plan]


@dataclasses.dataclass
class Result:
    """What :func:`execute` returns: the heads' values (k,), the per-head gradient leaves
    (k, ...), the aux tensors, and what the call saw."""

    values: torch.Tensor
    grads: Tensors
    aux: Tensors
    seen: Observations


def execute(
    plan: Plan,
    flat: FlatFunction,
    replan: Replan,
    cotangents_of: CotangentsOf,
    values_of: ValuesOf | None,
    check: bool | str,
    fit: ChunkFit | None,
) -> Result:
    """Run ``plan`` (made before f runs) for the heads whose cotangents ``cotangents_of``
    forms on f's output. ``values_of``: the heads' values on f's graph, so that on eager
    autograd each head is pulled through the heads and f at once (``vjp``, ``loop``).
    ``fit``: ``chunk_size="auto"``'s working record (returned in the observations)."""
    flat.watch, timed, asked_forward = plan.watch, plan.timed, plan.strategy == "jacfwd"
    if timed and "torch._dynamo" not in sys.modules:
        # (the first use of a dispatch mode in a process imports it, about 2 s: a one-time
        # cost that must not be timed against auto's other candidate; docs/planning.md)
        importlib.import_module("torch._dynamo")
    with gc_paused(timed):  # (a collection must not decide auto's plan: docs/planning.md)
        log = _engine.Log(watch=plan.watch or timed)
        start = _engine.clock() if timed else 0.0
        forward = _forward(plan, flat, cotangents_of, check) if asked_forward else None
        compiled, why = False, None
        if isinstance(forward, tuple):
            values, grads, aux, m = forward
            ran, engine = plan, plan.engine
        else:
            why, forward = forward, None
            if asked_forward:  # forward mode could not run: the reverse-mode plan
                plan = replan(plan.m, flat.hooked)
            rng = None if plan.engine == "autograd" else RandomState(flat)
            # (auto's timed call of torch.func only tries it: no warning where it cannot)
            quiet = timed and plan.requested == "auto"
            lin = _linearize.of_function(flat, rng, plan.engine, warn=not quiet)
            m = _coords.real_size(lin.out)
            ran = replan(m, flat.hooked)
            log.measure = ran.measure
            values, grads = _reverse(ran, lin, cotangents_of, values_of, check, log, fit)
            aux, engine, compiled = lin.aux, lin.engine, lin.compiled
        end = _engine.clock() if timed else 0.0
    if why is not None:  # (reverse mode gave the answer: forward mode's own limit it was)
        warnings.warn(
            f"{flat.call}: {why}; used reverse mode instead (f's forward ran once more, with "
            "the same random draws).",
            FuncgradWarning,
            stacklevel=_engine.outside_funcgrad(),
        )
    seconds = None
    if timed:
        measuring = log.timing.single if log.timing is not None else 0.0
        seconds = max(end - start - measuring, 0.0)
    seen = observed(
        flat,
        ran,
        engine,
        m=m,
        forward=forward is not None,
        seconds=seconds,
        log=log,
        compiled=compiled,
        forward_failed=asked_forward and forward is None,
        fit=fit,
    )
    return Result(values, grads, aux, seen)


@contextlib.contextmanager
def gc_paused(paused: bool) -> Iterator[None]:
    """Python's cyclic garbage collector off for a timed call, as ``timeit`` times: a
    collection within one of auto's timed calls would decide its plan."""
    if not (paused and gc.isenabled()):
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def observed(
    flat: FlatFunction,
    plan: Plan,
    engine: Engine,
    *,
    m: int,
    forward: bool = False,
    seconds: float | None = None,
    log: Log | None = None,
    compiled: bool = False,
    forward_failed: bool = False,
    fit: ChunkFit | None = None,
) -> Observations:
    """What a call saw: what ``flat``'s (watched) run of f recorded, what ran (``plan`` on
    ``engine``, which differs where torch.func refused f), and the rest as given."""
    return Observations(
        m=m,
        ran=Choice(engine, forward=forward, loop=plan.strategy == "loop"),
        seconds=seconds,
        timing=None if log is None else log.timing,
        watched=flat.watch,
        generators=bool(flat.generators),
        random=flat.drew,
        hooked=flat.hooked,
        custom=flat.custom,
        compiled=compiled,
        # (torch.func refused f: eager autograd ran instead; f that draws goes there too)
        mutates=flat.norm or (engine != plan.engine and not flat.drew),
        rnn=flat.rnn,
        slow_path=log is not None and log.slow_path,
        forward_failed=forward_failed,
        threads=flat.threads,
        no_grad=flat.no_grad,
        final=plan.final,
        fit=fit,
    )


_NO_GRAD = (
    "f runs ops in no-grad mode (torch.no_grad() inside f) on tensors that depend on the "
    "inputs, which forward mode differentiates and autograd takes for constants"
)


def _forward(
    plan: Plan, flat: FlatFunction, cotangents_of: CotangentsOf, check: bool | str
) -> tuple[torch.Tensor, Tensors, Tensors, int] | str | None:
    """Forward mode: J's n columns in one batched JVP (f runs once), then ``V @ J``; where
    that went non-finite, f again in reverse mode (same draws) for the cotangents
    themselves. Where forward mode could not run (the generators restored): why, to warn
    of once reverse mode gave the answer, or None (nothing to warn of)."""
    rng = RandomState(flat)
    columns = _engine.forward_columns(flat, check, rng)
    if columns is None or isinstance(columns, str):
        return columns
    if flat.hooked:  # f called a module with a backward hook, which forward mode never runs:
        rng.restore()  # reverse mode's plan (an explicit strategy='jacfwd' is refused there)
        return None
    if flat.no_grad:  # (seen on this watched call: the ops' arguments carried a tangent)
        if plan.requested == "jacfwd":
            raise ForwardModeNoGradError(
                f"{flat.call}: strategy='jacfwd', and f runs ops in no-grad mode "
                "(torch.no_grad() inside f) on tensors that depend on the inputs. Autograd "
                "takes what they compute for a constant; forward mode differentiates through "
                "it, a wrong gradient. Use strategy='vjp' (or 'auto', which sees it)."
            )
        rng.restore()
        return _NO_GRAD
    out, aux, tangents = columns
    m = _coords.real_size(out)
    values, cotangents = cotangents_of(out)
    grads = _engine.by_columns(cotangents, tangents, out, flat.leaves)
    if grads is None:  # V @ J went non-finite: the cotangents themselves, as autograd does
        rng.restore()
        lin = _linearize.of_function(flat, rng)
        values, cotangents = cotangents_of(lin.out)
        grads, aux = _engine.pull(lin, cotangents, plan.chunk_size, check), lin.aux
    return values, grads, aux, m


def _reverse(
    plan: Plan,
    lin: _linearize.Linearization,
    cotangents_of: CotangentsOf,
    values_of: ValuesOf | None,
    check: bool | str,
    log: Log,
    fit: ChunkFit | None,
) -> tuple[torch.Tensor, Tensors]:
    """Reverse mode by ``plan`` on ``lin``: where the plan says ``through_heads`` (a loop, or
    one head, on eager autograd), each head pulled through its head and f at once; else
    the heads' cotangents formed on f's output, then pulled back."""
    # (f's graph at hand, and no compiled backward, which checks its second pass on lin's
    # own pulls)
    fused = plan.through_heads and values_of is not None and lin.attached and not lin.compiled
    if fused and not _engine.nothing_to_pull(plan.k, lin.out, lin.x_like):
        assert values_of is not None
        return _engine.through_heads(lin, values_of)
    values, cotangents = cotangents_of(lin.out)
    return values, _engine.by_plan(plan, lin, cotangents, check, log, fit)
