"""What auto knows of a function: one frozen :class:`Record` per call signature, the
:class:`Observations` a call makes, and :func:`learn`, the only writer of a record.

The pipeline of every entry point is ``record -> decide -> execute -> learn``:
:func:`funcgrad._plan.decide` reads a record (and never a clock or a tensor),
:func:`funcgrad._execute.execute` runs its plan and returns what it saw, and :func:`learn`
turns that into the next record. :class:`Records` is the one bounded cache of records, per
function; what one signature learnt seeds the records of its new signatures.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import torch

from ._types import Engine

# A loop must beat vmap by this factor a direction, and save this much over the directions
# of the timed batch, to be chosen: one timed call decides, and on a loaded machine one call
# can be off by 2x (docs/benchmarks_planner.md); below either, vmap (one call) is kept. The
# loops that matter by far (no batching rule) are known before timing.
LOOP_MARGIN = 0.5
LOOP_MIN_SAVING_S = 2e-5
# ... except for a batch of at most FEW_DIRECTIONS: vmap can then save at most two calls'
# fixed costs while it wraps every op, so the loop is chosen wherever it was faster a
# direction (and saved LOOP_MIN_SAVING_S): a wrong choice costs a call's noise, not 2x.
# (A real model's heads, k = 3: its loop 1.1-1.5x faster a direction, docs/benchmarks.md.)
FEW_DIRECTIONS = 3
FEW_LOOP_MARGIN = 1.0


@dataclasses.dataclass(frozen=True)
class Timing:
    """One batched call timed against one unbatched call, in the same call (seconds)."""

    what: str
    batched: float  # a direction, in one vmap
    single: float  # one unbatched call
    directions: int = 1  # in the timed vmap

    @property
    def unbatched_faster(self) -> bool:
        saving = (self.batched - self.single) * self.directions
        margin = FEW_LOOP_MARGIN if self.directions <= FEW_DIRECTIONS else LOOP_MARGIN
        return self.single < margin * self.batched and saving > LOOP_MIN_SAVING_S

    def why(self) -> str:
        return (
            f"{self.what}: {1e3 * self.batched:.2g} ms a direction in one vmap, "
            f"{1e3 * self.single:.2g} ms unbatched"
        )


@dataclasses.dataclass(frozen=True)
class Choice:
    """What a call runs besides the shapes' strategy: the engine, forward mode, a loop."""

    engine: Engine = "torch.func"
    forward: bool = False
    loop: bool = False

    @property
    def name(self) -> str:
        if self.forward:
            return "forward mode"
        return "reverse mode on " + (
            "eager autograd" if self.engine == "autograd" else "torch.func"
        )


@dataclasses.dataclass(frozen=True)
class Trial:
    """One timed call: what it ran, its seconds (without the unbatched call that timed
    vmap), and that timing, if it made one."""

    choice: Choice
    seconds: float
    timing: Timing | None = None


@dataclasses.dataclass(frozen=True)
class Facts:
    """What f was seen to do when it ran, as a call reports it (:class:`Observations`) and a
    record holds it (:class:`Record`): each fact only accumulates (:func:`learn`), and a new
    signature of the function starts from them (:func:`function_facts`)."""

    random: bool = False  # f draws random numbers: eager autograd, no forward mode
    hooked: bool = False  # f runs a (tensor or module) backward hook: cotangents only
    custom: bool = False  # f runs a custom autograd.Function maybe nonlinear: auto, cotangents only
    compiled: bool = False  # f's graph holds a torch.compile'd backward: torch.func
    mutates: bool = False  # torch.func refuses f (a buffer updated in place, ...)
    rnn: bool = False  # f runs an RNN, whose backward vmap batches badly
    slow_path: bool = False  # vmap warned it has no batching rule for an op of f
    threads: bool = False  # part of f ran in another thread: eager autograd only
    no_grad: bool = False  # f ran ops in no-grad mode on tensors that require grad: no forward mode


FACTS = tuple(field.name for field in dataclasses.fields(Facts))


@dataclasses.dataclass(frozen=True)
class Record(Facts):
    """What is known of one call signature of a function (or, as ``Records.facts``, of the
    function): y's size, what f does when it runs (its :class:`Facts`), the timed calls,
    the chunk fit. It holds no tensor, and is replaced whole by :func:`learn`."""

    m: int | None = None  # y's real size (a call's output, or plan()'s runs)
    shape_tried: bool = False  # plan() ran f on fake tensors for m
    draws: bool | None = None  # f drew from an explicit torch.Generator (None: not watched)
    forward_lost: bool = False  # forward mode fell back, or lost its timed call
    trials: tuple[Trial, ...] = ()
    settled: Choice | None = None  # what decide settled on (the plan's choice, final)
    prior: Choice | None = None  # what another signature of this function settled on
    fit: Any = None  # chunk_size="auto": _engine.ChunkFit (a copy; never changed in place)
    # A steady call's plans (see ``Composition.per_head``): by (grad mode, check), the plans
    # ``decide`` made for a final call that taught this record nothing, and what that call
    # saw. Held by the record, so a record that learns (a new one) starts without them.
    steady: dict[Any, Any] = dataclasses.field(
        default_factory=dict, init=False, repr=False, compare=False, hash=False
    )


@dataclasses.dataclass(frozen=True)
class Observations(Facts):
    """What one call saw (:func:`funcgrad._execute.execute`), for :func:`learn`: its
    :class:`Facts` (where it watched f), y's size, what ran, its times."""

    m: int | None = None
    ran: Choice | None = None  # what ran, after any fallback
    seconds: float | None = None  # timed calls: without the unbatched call timing vmap
    timing: Timing | None = None  # a batched call timed against one unbatched call
    watched: bool = False  # f's ops were watched (then ``generators`` is known)
    generators: bool = False  # f drew from an explicit torch.Generator
    forward_failed: bool = False  # forward mode fell back on this call
    final: bool = False  # the plan run was final: ``ran`` is what decide settled on
    fit: Any = None  # chunk_size="auto": the working fit, as measured
    shape_tried: bool = False  # plan() ran f on fake tensors


def learn(record: Record, seen: Observations) -> Record:
    """The next record of a signature from what a call (or ``plan()``) saw: facts only
    accumulate; a timed call adds its :class:`Trial`."""
    trials = record.trials
    if seen.seconds is not None and seen.ran is not None:
        trials = (*trials, Trial(seen.ran, seen.seconds, seen.timing))
    return dataclasses.replace(
        record,
        **{name: getattr(record, name) or getattr(seen, name) for name in FACTS},
        m=seen.m if seen.m is not None else record.m,
        shape_tried=record.shape_tried or seen.shape_tried,
        draws=seen.generators if record.draws is None and seen.watched else record.draws,
        forward_lost=record.forward_lost or seen.forward_failed,
        trials=trials,
        settled=seen.ran if seen.final and seen.ran is not None else record.settled,
        fit=seen.fit if seen.fit is not None else record.fit,
    )


def adds_nothing(record: Record, seen: Observations) -> bool:
    """Whether ``learn(record, seen) == record``, found without building the new record:
    a steady-state call, whose record need not be written again."""
    return (
        (seen.seconds is None or seen.ran is None)
        and (seen.m is None or seen.m == record.m)
        and (record.shape_tried or not seen.shape_tried)
        and not (record.draws is None and seen.watched)
        and not any(getattr(seen, name) and not getattr(record, name) for name in FACTS)
        and (record.forward_lost or not seen.forward_failed)
        and (not seen.final or seen.ran is None or seen.ran == record.settled)
        and (seen.fit is None or seen.fit == record.fit)
    )


def function_facts(record: Record) -> Record:
    """What a new signature of the function starts from: what f does, and what this one
    settled on (not y's size, the timings or the chunk fit, which depend on the shapes)."""
    return Record(
        **{name: getattr(record, name) for name in FACTS},
        forward_lost=record.forward_lost,
        # None: a new signature's first call is watched again (f may take another branch at
        # other shapes: a hook, a draw).
        draws=None,
        prior=record.settled if record.settled is not None else record.prior,
    )


@dataclasses.dataclass(frozen=True)
class ReuseRecord:
    """What one `Pullback` has learnt of answering from its kept directions (see
    :func:`funcgrad._plan.pullback_reuse`); it holds no tensor, and is replaced whole by
    :func:`learn_reuse`."""

    calls: int = 0  # calls timed (those that reached the basis with readable cotangents)
    pull_s: float | None = None  # a direction through f, in one pull (the cheapest seen)
    basis_s: float | None = None  # the last timed call's own work, beside its pulls
    saved: int = 0  # the last timed call's cotangents answered with no pass through f


@dataclasses.dataclass(frozen=True)
class ReuseSeen:
    """What one timed `Pullback` call saw: its cotangents, the directions it pulled through
    f, the thread time (seconds) of those pulls, of the work a later call need not repeat
    (the held cotangents turned into directions) and of the whole call."""

    cotangents: int
    pulled: int
    pull_s: float
    setup_s: float
    total_s: float


def learn_reuse(record: ReuseRecord, seen: ReuseSeen) -> ReuseRecord:
    """The next :class:`ReuseRecord` from a timed call: a direction's cost from its pulls,
    the basis's own cost (the call without its pulls and its setup) and what it saved."""
    pull_s = record.pull_s
    if seen.pulled:
        per_direction = seen.pull_s / seen.pulled
        pull_s = per_direction if pull_s is None else min(pull_s, per_direction)
    return ReuseRecord(
        calls=record.calls + 1,
        pull_s=pull_s,
        basis_s=max(seen.total_s - seen.pull_s - seen.setup_s, 0.0),
        saved=max(seen.cotangents - seen.pulled, 0),
    )


class Records:
    """The records of one function, one per call signature, the least recently used
    dropped past ``size`` (a jit cache's bound), and the function's facts, which seed each
    new signature's record."""

    def __init__(self, size: int = 64) -> None:
        self.size = size
        self._records: collections.OrderedDict[Any, Record] = collections.OrderedDict()
        self.facts = Record()
        self._last: Any = None  # the key last written (its record gave ``facts``)
        # f's hooks as last seen (a funcgrad._function.HookState, set by the owner)
        self.hooks: Any = None

    def __len__(self) -> int:
        return len(self._records)

    def get(self, key: Any) -> Record:
        record = self._records.get(key)
        if record is None:
            return self.facts
        self._records.move_to_end(key)
        return record

    def is_last(self, key: Any) -> bool:
        """Whether ``key``'s record is held and was the last one written."""
        return key == self._last and key in self._records

    def learn(self, key: Any, record: Record, seen: Observations) -> Record:
        """``key``'s next record (:func:`learn`), written, unless it is the record last
        written and ``seen`` adds nothing to it (a steady-state call writes nothing)."""
        if adds_nothing(record, seen) and self.is_last(key):
            return record
        record = learn(record, seen)
        self.put(key, record)
        return record

    def put(self, key: Any, record: Record) -> None:
        if record.forward_lost and not self.facts.forward_lost:
            self.lose_forward()
        elif self.facts.forward_lost and not record.forward_lost:
            record = dataclasses.replace(record, forward_lost=True)
        self._last = key
        self._records[key] = record
        self._records.move_to_end(key)
        if len(self._records) > self.size:
            self._records.popitem(last=False)
        facts = function_facts(record)
        if facts.prior is None:  # (a signature still learning keeps another's choice)
            facts = dataclasses.replace(facts, prior=self.facts.prior)
        self.facts = facts

    def rewatch(self) -> None:
        """f's hooks or its modules' training flags changed
        (:class:`~funcgrad._function.HookState`): the next call of every held signature is
        watched again, as a first call is, so that a backward hook registered since its
        plan settled (``hooked``), or random draws a module began in training mode
        (``draws``), are seen."""
        for key, held in list(self._records.items()):  # (a copy: another thread may put)
            if held.draws is not None:
                self._records[key] = dataclasses.replace(held, draws=None)

    def lose_forward(self) -> None:
        """Forward mode fell back on one call of the function (any signature, or inside a
        transform, where no record is kept): every signature of the function, held or new,
        runs reverse mode from now on, whatever order the shapes come in."""
        for key, held in list(self._records.items()):  # (a copy: another thread may put)
            self._records[key] = dataclasses.replace(held, forward_lost=True)
        self.facts = dataclasses.replace(self.facts, forward_lost=True)


def signature_key(argnums: Any, in_defs: Any, leaves: Any, others: Any = ()) -> Any:
    """A call signature: the trees, and every leaf's shape, dtype, device and requires_grad
    (a hashable non-tensor leaf by its value, another by its type)."""
    other_leaves, other_def = others if others else ((), None)
    return (
        argnums,
        tuple(in_defs),
        tuple(map(_leaf_key, leaves)),
        other_def,
        tuple(map(_leaf_key, other_leaves)),
    )


def _leaf_key(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor):
        return (leaf.shape, leaf.dtype, leaf.device, leaf.requires_grad)
    try:
        hash(leaf)
    except TypeError:
        return type(leaf)
    return (type(leaf), leaf)
