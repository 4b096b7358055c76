"""The plan of a call, and :func:`decide`, the only place where a choice is made.

``decide(request, record)`` is pure: from the call's shapes and options (:class:`Request`)
and what is known of its signature (:class:`~funcgrad._record.Record`) it returns the
complete :class:`Plan`: the strategy (``k`` against ``m`` against ``2 n``), the engine, the
chunk, what the call times, the fallback order. ``fn.plan(*args)`` and ``fn(*args)`` both
call it with the same inputs, so the plan reported is the plan run. When y's size is known
only after f runs, the call decides again with it (the k > m rule is here too).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

from ._record import Choice, Record, ReuseRecord, Trial
from ._types import ChunkSize, Engine, Executed, Reuse, Strategy

# chunk_size="auto": the directions run to measure a fit. Direction 0 alone first (an
# unbatched call); where three fit and more than FIT_MIN remain, the next two and three in
# one vmap each, whose difference is a vmapped direction's cost (docs/planning.md).
FIT_PROBE = (0, 1)
FIT_RANGES = ((0, 2), (2, 5))
FIT_MIN = FIT_RANGES[-1][1]

# A JVP of f costs about as much as a VJP but forward mode can disagree with autograd's
# conventions (cholesky, eigh, ...: docs/reliability.md), so it must be clearly cheaper.
FORWARD_MODE_PENALTY = 2

# auto's trial: at most this many timed calls on a new signature (the plan is final from
# the next one), and a challenger must beat the first call, which paid the signature's
# one-time costs, by this factor where it is forward mode (which may disagree with
# autograd's conventions); reverse mode on torch.func, the same pulls as eager autograd's
# after its own first-use costs, wins where its call was the faster (docs/planning.md).
TRIAL_CALLS = 2
CHALLENGER_MARGIN = 0.9

_TORCH_FUNC = "torch.func cannot differentiate f (or f updates a buffer in place) -> eager autograd"
_VMAP = "vmap cannot batch the pullback, or check finds it wrong -> a loop of unbatched pullbacks"
_NON_FINITE = "V @ J not finite -> the cotangents themselves are pulled back, as autograd does"
_FORWARD = (
    "forward mode cannot differentiate f, or vmap cannot batch its JVPs -> reverse mode "
    "(this call and the later ones)"
)
_FORWARD_LOST = (
    "forward mode fell back on an earlier call of f -> reverse mode, the k cotangents pulled back"
)
_CUSTOM = (
    "f runs a custom autograd.Function whose backward may be nonlinear in its cotangent (a "
    "clamp) -> each head's cotangent is pulled through f, as vmap(vjp) does"
)
_ASSERTED = (
    "f runs a custom autograd.Function: strategy={!r} assumes its backward is linear in its "
    "cotangent (as torch.func.{} does; jacfwd runs its jvp instead); 'auto' would pull each "
    "head's cotangent"
)
_FALLBACKS: dict[str, tuple[str, ...]] = {
    "vjp": (_TORCH_FUNC, _VMAP),
    "loop": (_TORCH_FUNC,),
    "jacrev": (_TORCH_FUNC, _VMAP, _NON_FINITE),
    "jacfwd": (_FORWARD, _NON_FINITE),
    "weighted": (_TORCH_FUNC,),
}


@dataclasses.dataclass(frozen=True)
class Plan:
    """How the gradients are computed for given shapes: what ``fn(*args)`` runs.

    Returned by ``fn.plan(*args)`` for the functions of `funcgrad.compose_heads` and
    `funcgrad.combine_heads`; the same plan drives the call.

    Attributes:
        strategy: ``"vjp"``, ``"jacrev"``, ``"jacfwd"`` or ``"loop"`` (never ``"auto"``);
            ``"weighted"`` where one pullback of the weighted cotangent ``w @ V`` is all that
            is needed (`funcgrad.combine_heads` at level ``"features"``, or without a
            weighting).
        k: number of heads.
        m: real dimension of f's output (complex entries count twice).
        n: real dimension of the differentiated inputs.
        chunk_size: at most this many directions per batched call (None: all at once).
            Under ``chunk_size="auto"``, the chunk that the memory budget in force allows,
            from what one direction through f was measured to cost on these argument
            shapes; ``"auto"`` where the call measures it (direction 0 alone, then, where
            three fit and more than 5 remain, directions 1-2 and 3-5 vmapped), so
            ``passes`` is a lower bound.
        requested: the ``strategy`` argument (``"auto"`` lets the planner choose).
        costs: the candidates the planner weighed, as (name, directions) pairs; forward
            mode counts ``FORWARD_MODE_PENALTY`` per input coordinate.
        fallbacks: what the engine does, with one warning, where this strategy cannot run
            as planned, in order; each entry reads "condition -> what runs instead".
        measured: why what earlier calls saw changed the plan, else None.
        measure: the call times its first batched call against one unbatched call (one
            direction more through f, in ``passes``), to learn whether a loop is faster.
        f_runs: how many times the call runs f's Python body: 1, plus ``check``'s
            unbatched JVP calls in forward mode (up to 3). A fallback that runs f again
            adds one. ``plan()`` itself may run f's body on fake tensors; a call never does.
        engine: what f's linearisation runs on: ``"torch.func"`` (``torch.func.vjp``) or
            ``"autograd"`` (one eager forward that records an autograd graph, then
            ``torch.autograd.grad`` per direction or vmapped over them).
        timed: this call is one of auto's timed calls on a new signature (at most two;
            see docs/planning.md): its time decides the later calls' plan.
        final: no later call on these shapes plans otherwise (unless f is seen to do
            something new: draw random numbers, register a hook).
        advice: what the user could pass instead to run faster, never applied by funcgrad
            (a TorchJD UPGrad or DualProj with its default quadprog projector: the
            batched `funcgrad.DualConeProjector`), else None.

    Examples:
        >>> import torch, funcgrad
        >>> fn = funcgrad.compose_heads(torch.sin, [lambda y: y.sum()] * 8)
        >>> plan = fn.plan(torch.zeros(3))
        >>> plan.strategy, plan.directions, plan.passes  # the first call also times vmap
        ('jacrev', 3, 2)
        >>> plan
        Plan('jacrev': 3 directions through f in 2 passes on eager autograd; ...)
    """

    strategy: Executed
    k: int
    m: int
    n: int
    chunk_size: ChunkSize = None
    requested: Strategy = "auto"
    costs: tuple[tuple[str, int], ...] = ()
    fallbacks: tuple[str, ...] = ()
    measured: str | None = None
    measure: bool = False
    f_runs: int = 1
    engine: Engine = "torch.func"
    timed: bool = False
    final: bool = True
    watch: bool = dataclasses.field(default=True, repr=False)
    # On eager autograd: each head's value pulled through its head and f in one backward
    # (the heads on f's graph), not its cotangent formed first and then pulled through f
    # (a loop, or one head: see _through_heads).
    through_heads: bool = dataclasses.field(default=False, repr=False)
    choice: Choice | None = dataclasses.field(default=None, repr=False)
    advice: str | None = None

    @property
    def directions(self) -> int:
        """How many directions go through f: pullbacks for ``vjp``, ``loop``, ``jacrev``
        and ``weighted``, JVPs for ``jacfwd``; 0 when an empty x or y makes every answer
        zero."""
        if not (self.k and self.m and self.n):
            return 0
        return {"vjp": self.k, "loop": self.k, "jacrev": self.m, "jacfwd": self.n}.get(
            self.strategy, 1
        )

    @property
    def passes(self) -> int:
        """How many calls of f's backward (a vmapped call counts once) or, for ``jacfwd``,
        of its batched forward-mode pass: ``directions`` split by ``chunk_size``. A lower
        bound where `exact` is False (``chunk_size="auto"`` not measured yet)."""
        if not self.directions:
            return 0
        if self.strategy == "loop":
            return self.directions
        if self.strategy == "jacfwd":
            return 1
        if self.chunk_size == "auto":  # not measured yet: 1 (then 2 and 3), then the rest
            least = min(self.directions, 2 if self.directions <= FIT_MIN + 1 else 3)
            return least + (self.measure and self.directions > 2)
        return math.ceil(self.directions / (self.chunk_size or self.directions)) + self.measure

    @property
    def exact(self) -> bool:
        """Whether `passes` is the count the call runs; False only where
        ``chunk_size="auto"`` has not measured yet and more than one direction batches."""
        return not (
            self.chunk_size == "auto" and self.strategy in ("vjp", "jacrev") and self.directions > 1
        )

    def __repr__(self) -> str:
        d, p = self.directions, self.passes
        at_least = "" if self.exact else "at least "
        what = f"{d} direction{'s' * (d != 1)} through f in {at_least}{p} pass{'es' * (p != 1)}"
        what += " on eager autograd" * (self.engine == "autograd")
        shapes = f"k={self.k}, m={self.m}, n={self.n}"
        if self.chunk_size is not None:
            shapes += f", chunk_size={self.chunk_size}"
        costs = ", ".join(f"{name}={cost}" for name, cost in self.costs)
        if self.measured is not None:
            why = f"measured: {self.measured}"
        elif self.strategy == "weighted":
            why = "one pullback of w @ V, whatever k"
        elif self.requested == "auto":
            why = f"auto chose the fewest: {costs}"
        else:
            why = f"strategy={self.requested!r} requested (costs: {costs})"
        timing = "; times vmap against one unbatched call (this call)" * self.measure
        timing += "; this call is timed against auto's other candidate" * self.timed
        runs = f"; f's Python body runs {self.f_runs} times" * (self.f_runs != 1)
        advice = "" if self.advice is None else f"; advice: {self.advice}"
        return f"Plan({self.strategy!r}: {what}; {shapes}; {why}{timing}{runs}{advice})"


@dataclasses.dataclass(frozen=True)
class Request:
    """What a call asks for, as :func:`decide` needs it: no tensor, nothing to read.

    ``m``: y's real size where known before f runs (None: the call runs f first, then
    decides again with it). ``fitted``: ``chunk_size="auto"``'s chunk under the budget in
    force (None: not measured), ``paired``: fitted on two vmapped chunks. ``eager``: outside
    transforms and compiled code (records are kept); ``graph``: a graph of the results is
    wanted (grad mode on). ``forward``: forward mode may still run (False once f ran).
    ``hooked``: this call's run of f registered a tensor hook; ``custom``: it ran a custom
    autograd.Function not known to be linear in its cotangent. ``check``: ``check`` is on.
    ``once``: a one-shot pull through a recorded graph (``grads``, ``backward``): nothing is
    timed or learnt; ``last``: its pull frees the graph, so nothing can be recomputed after
    it; ``sparse``: the graph gives a sparse gradient, which vmap cannot batch. ``engine``:
    the engine an explicit strategy runs on where it may (eager, no graph of the results),
    as its caller knows f (None: torch.func, see :func:`_choose`).
    """

    requested: Strategy
    k: int
    n: int
    m: int | None = None
    chunk_size: ChunkSize = None
    fitted: int | None = None
    paired: bool = False
    weighted: bool = False
    eager: bool = True
    graph: bool = False
    forward: bool = True
    hooked: bool = False
    custom: bool = False
    check: bool = False
    call: str = "funcgrad"
    once: bool = False
    last: bool = False
    sparse: bool = False
    engine: Engine | None = None


def decide(request: Request, record: Record) -> Plan:
    """The plan for ``request`` given what ``record`` knows: pure (no clock, no tensor, no
    global state), so its answers are memoised (a steady-state call asks the same
    question every time; what that saves is measured in docs/benchmarks.md), except for
    a record holding a chunk fit or a field that does not hash, and under torch.compile.

    The strategy is the fewest directions: ``vjp`` k pullbacks, ``jacrev`` m (plus a
    product), ``jacfwd`` n JVPs counted ``FORWARD_MODE_PENALTY`` times (only where y's size
    is known before f runs and all n fit one batch). Under ``"auto"``, eager and without a
    graph of the results, the engine and a loop are chosen by :func:`_choose`.
    """
    # (a ChunkFit is mutable, so not hashable; dynamo traces through the cache, and warns)
    if record.fit is not None or torch.compiler.is_compiling():
        return _decide(request, record)
    try:
        return _memoised(request, record)
    except TypeError:  # (a field that does not hash: a symbolic size under tracing)
        return _decide(request, record)


def _decide(request: Request, record: Record) -> Plan:
    """:func:`decide`, not memoised."""
    r, k, n = request, request.k, request.n
    m = r.m if r.m is not None else 0
    hooked = r.hooked or record.hooked
    # (an explicit jacrev or jacfwd asserts a custom Function's linearity, as torch.func's)
    custom = (r.custom or record.custom) and not hooked
    linear = not (hooked or custom)
    _refuse(r, not hooked)
    if r.once:
        return _once(r, linear)
    if r.weighted:
        engine: Engine = "autograd" if r.eager and not r.graph else "torch.func"
        _refuse_threads(r, record, engine, "strategy='auto'")
        return Plan(
            "weighted", k, m, n, r.chunk_size, r.requested, (("weighted", 1),),
            _FALLBACKS["weighted"], engine=engine, watch=_watch(r, record),
        )  # fmt: skip
    one_batch = _one_batch(r)
    costs = {"vjp": k, "jacrev": m if r.m is not None else k}
    may_forward = bool(n) and one_batch and (r.requested != "auto" or _forward_ok(r, record))
    if may_forward:
        costs["jacfwd"] = FORWARD_MODE_PENALTY * n
    names = (
        ["vjp", "jacrev", "jacfwd"] if linear and may_forward else ["vjp", "jacrev"][: 1 + linear]
    )
    fewest = min(names, key=lambda name: (costs[name], names.index(name)))
    choice, timed, why = _choose(r, record, fewest == "jacfwd")
    strategy: Executed
    chunk = r.chunk_size
    if r.requested == "jacfwd" and not n:
        strategy = "vjp"  # no input coordinate: every answer is zeros, no pass needed
    elif r.requested == "jacfwd" and (record.forward_lost or not r.forward):
        # Forward mode fell back (this call, or an earlier one of f, with its one warning):
        # reverse mode, as that fallback ran, without trying forward mode again.
        strategy = "vjp"
        why = _FORWARD_LOST if r.forward else why
    elif r.requested != "auto":
        strategy = r.requested
        if custom and strategy in ("jacrev", "jacfwd"):
            why = _ASSERTED.format(strategy, strategy)
    elif choice.forward:
        strategy = "jacfwd"
    else:  # reverse mode: the k > m rule (once f ran, where m was not known before)
        strategy = "jacrev" if r.m is not None and linear and m < k else "vjp"
        if custom and r.m is not None and m < k:
            why = _CUSTOM if why is None else f"{why}; {_CUSTOM}"
        if choice.loop:  # the fewer of k pullbacks or m rows, one at a time
            strategy, chunk = ("jacrev", 1) if strategy == "jacrev" else ("loop", None)
    engine = "torch.func" if strategy == "jacfwd" else choice.engine
    _refuse_threads(r, record, engine, f"strategy={r.requested!r}")
    directions = {"vjp": k, "loop": k, "jacrev": m, "jacfwd": n}[strategy]
    chunk = _chunk(r, chunk, strategy, directions)
    batches = strategy in ("vjp", "jacrev") and chunk != 1 and min(k, m, n) > 0
    measure = timed and batches and directions > 1 and _loop(record, engine) is None
    forward = strategy == "jacfwd"
    return Plan(
        strategy,
        k,
        m,
        n,
        chunk,
        r.requested,
        tuple(costs.items()),
        _FALLBACKS[strategy],
        why,
        measure,
        1 + (len({0, n // 2, n - 1}) if forward and r.check and r.eager else 0),
        engine,
        timed,
        not timed,
        _watch(r, record),
        through_heads=engine == "autograd" and not record.compiled and _through_heads(k, strategy),
        choice=dataclasses.replace(choice, engine=engine, forward=forward),
    )


# (Requests and records are frozen and hold no tensor: the cache keeps nothing alive but
# them; a refusal, raised, is not cached and is raised again.)
_memoised = functools.lru_cache(maxsize=1024)(_decide)


def decide_once(
    k: int, n: int, m: int, chunk_size: ChunkSize, call: str, *, hooked: bool = False,
    last: bool = False, sparse: bool = False,
) -> Plan:  # fmt: skip
    """:func:`decide` for a one-shot pull through a recorded graph (``grads``, ``backward``)
    with a fresh record, memoised on these few numbers and flags (a steady call builds no
    Request and hashes no Record)."""
    try:
        return _decide_once(k, n, m, chunk_size, call, hooked, last, sparse)
    except TypeError:  # (a symbolic size under tracing does not hash)
        return _decide_once.__wrapped__(k, n, m, chunk_size, call, hooked, last, sparse)


@functools.lru_cache(maxsize=256)
def _decide_once(
    k: int, n: int, m: int, chunk_size: ChunkSize, call: str, hooked: bool, last: bool,
    sparse: bool,
) -> Plan:  # fmt: skip
    request = Request(
        "auto", k, n, m, chunk_size, hooked=hooked, call=call, once=True, last=last, sparse=sparse
    )
    return decide(request, Record())


def after_f(request: Request, m: int, hooked: bool, custom: bool = False) -> Request:
    """``request`` once f ran: y's real size ``m`` known, forward mode no longer possible,
    ``hooked`` and ``custom`` as f's run found. Memoised as :func:`decide` is: a
    steady-state call asks the same every time (docs/performance.md)."""
    if torch.compiler.is_compiling():
        return _after_f(request, m, hooked, custom)
    try:
        return _after_f_memoised(request, m, hooked, custom)
    except TypeError:  # (a field that does not hash: a symbolic size under tracing)
        return _after_f(request, m, hooked, custom)


def _after_f(request: Request, m: int, hooked: bool, custom: bool) -> Request:
    return dataclasses.replace(request, m=m, forward=False, hooked=hooked, custom=custom)


_after_f_memoised = functools.lru_cache(maxsize=1024)(_after_f)


def _through_heads(k: int, strategy: str) -> bool:
    """Whether eager autograd pulls each head's value through its head and f in one
    backward (the loop a user writes), rather than the heads' cotangents formed on y first,
    then pulled through f: for a loop of unbatched pulls (or one head), which saves a
    backward call a head and wastes nothing. Not for a vmapped batch: each of the k unit
    directions on the stacked values would run every head's backward, k x k head rows
    against k (a vocabulary-wide output layer per head: 6x the rows), and where the heads
    are cheap the calls it saves did not pay either (docs/planning.md)."""
    return strategy == "loop" or k == 1


def _once(r: Request, linear: bool) -> Plan:
    """A one-shot pull through a recorded graph (``grads``, ``backward``): the k cotangents
    themselves, or, with more cotangents than y has coordinates (k > m), y's m unit
    directions combined (one read: the product must be finite, else the cotangents go
    through, which the graph must still allow: not where the pull frees it, and not where
    hooks must see each cotangent). A sparse gradient: one direction at a time."""
    m = r.m or 0
    strategy: Executed = "jacrev" if linear and not r.last and m < r.k else "vjp"
    return Plan(
        strategy, r.k, m, r.n, 1 if r.sparse else r.chunk_size, r.requested,
        (("vjp", r.k), ("jacrev", m)), _FALLBACKS[strategy][1:], engine="autograd",
    )  # fmt: skip


def pullback_engine(eager: bool, record: Record) -> Engine:
    """`funcgrad.pullback`'s engine: eager autograd where f's graph can be recorded (eager,
    no inference tensor) and f's backward is not torch.compile'd (torch may run that wrongly
    twice on one graph: it was seen on this signature; its second passes are checked), or
    part of f runs in another thread (torch.func would not follow it), else torch.func."""
    return "autograd" if eager and (record.threads or not record.compiled) else "torch.func"


def pullback_reuse(reuse: bool | str, record: ReuseRecord) -> Reuse:
    """How a `Pullback` call answers: ``"basis"`` (from its kept directions, pulling only
    new ones, :func:`funcgrad._engine.by_linearity`) or ``"pull"`` (the cotangents through
    f as they are, nothing kept); ``"measure"``: the basis, timed (``record`` learns).

    ``reuse=True`` always keeps, ``False`` never. ``"auto"`` times its first
    ``TRIAL_CALLS`` calls (the first holds its cotangents, the second answers from them
    where it can), then from the next call on, for good, pulls only where the second
    call answered cotangents without a pass and that saved less pull time than the
    basis's own work cost; else keeps the basis (a second call that answered none from the
    span says nothing of what a later one in the span would save)."""
    if reuse is True:
        return "basis"
    if reuse != "auto":
        return "pull"
    if record.calls < TRIAL_CALLS:
        return "measure"
    if record.pull_s is None or record.basis_s is None or not record.saved:
        return "basis"  # (nothing pulled, or nothing answered from the span yet)
    return "basis" if record.saved * record.pull_s >= record.basis_s else "pull"


def _refuse_threads(r: Request, record: Record, engine: Engine, requested: str) -> None:
    """Part of f ran in another thread on an earlier call of this signature (eager autograd
    followed it), and this plan would run f under torch.func, which does not. Not where
    torch.func refused f before (``mutates``) and the call may fall back to eager autograd
    (as the call that saw the thread did)."""
    if record.threads and engine == "torch.func" and not (record.mutates and r.eager):
        raise ValueError(
            f"{r.call}: f computes part of its output in another thread (a thread pool, "
            "threading.Thread), seen on an earlier call of these shapes. torch.func's "
            "transforms do not follow f into other threads, so that part would be taken "
            f"for a constant, a wrong gradient; {requested} here runs f under torch.func "
            + (
                "(forward mode). "
                if r.requested == "jacfwd"
                else "(explicitly, or a graph of the results is wanted, or inside a transform). "
            )
            + "Keep f's differentiable work on the calling thread, or use strategy='auto' "
            "without create_graph, outside transforms (eager autograd, which follows threads), "
            "or funcgrad.pullback."
        )


def _refuse(r: Request, linear: bool) -> None:
    """The options that no plan can run, refused before f runs."""
    if not linear and r.requested in ("jacrev", "jacfwd"):
        raise ValueError(
            f"{r.call}: f registers a tensor hook (Tensor.register_hook) or calls a module with "
            "a backward hook in its forward, and a "
            f"hook may act nonlinearly on its gradient (a clamp), while strategy={r.requested!r} "
            + (
                "combines the pullbacks of y's unit directions"
                if r.requested == "jacrev"
                else "runs forward mode, which never runs backward hooks"
            )
            + ": its answer would be autograd's only for a hook linear in its gradient. Use "
            "strategy='vjp', 'loop' or 'auto' (which pull each head's cotangent through f)."
        )
    chunk = r.chunk_size
    if r.requested == "jacfwd" and isinstance(chunk, int) and chunk < r.n:
        raise ValueError(
            f"{r.call}: strategy='jacfwd' takes all n = {r.n} columns of J in one batched "
            f"forward pass; chunk_size={chunk} would run f's forward once per chunk. Pass "
            f"chunk_size=None (or >= {r.n}) with jacfwd, or use strategy='jacrev' or 'vjp' to "
            "bound memory with chunks."
        )


def _one_batch(r: Request) -> bool:
    """Whether all n input coordinates fit one batch (forward mode's one batched pass)."""
    return r.chunk_size is None or r.chunk_size == "auto" or r.chunk_size >= r.n


def _forward_ok(r: Request, record: Record) -> bool:
    """Whether auto may run forward mode: y's size known before f runs, f neither draws
    (forward mode draws its own) nor registers hooks (it runs none), nor did forward mode
    fall back or lose its timed call on this signature."""
    return (
        r.forward
        and r.m is not None
        and not (record.random or record.hooked or record.forward_lost or record.threads)
        and not record.custom
        and not record.no_grad
    )


def _watch(r: Request, record: Record) -> bool:
    """Whether f's ops are watched (explicit generators, random ops, hooks, RNNs, norms):
    on a signature's first call, and later only where f drew from an explicit generator
    (a re-run of f must restore it); always inside transforms (nothing is kept there)."""
    return not r.eager or record.draws is None or record.draws


def _chunk(r: Request, chunk: ChunkSize, strategy: str, directions: int) -> ChunkSize:
    """``chunk_size="auto"``: the fitted chunk, or "auto" where the call measures (nothing
    fitted yet, or fitted on one direction alone and the budget now allows two vmapped
    chunks); unchunked inside transforms, where nothing can be measured."""
    if chunk != "auto":
        return chunk
    if not r.eager:
        return None
    if r.fitted is None:
        return "auto"
    if strategy in ("vjp", "jacrev") and not r.paired and directions > FIT_MIN and r.fitted >= 3:
        return "auto"
    return r.fitted


def _loop(record: Record, engine: Engine) -> tuple[bool, str | None] | None:
    """Whether calls on ``engine`` loop over the directions unbatched, and why: vmap said it
    has no batching rule (known before timing), what another signature settled on, else
    this engine's timed call; None while the question is open (nothing timed it, and
    nothing known answers it). An RNN is not known to loop: on eager autograd its backward
    batches as well as a loop or better (docs/benchmarks.md), so call 1's timed vmap
    decides; it is torch.func's decomposed RNN that batches badly (``_choose`` leaves
    torch.func out)."""
    if record.slow_path:
        return True, "vmap has no batching rule for an op of f's backward (torch warned) -> a loop"
    if record.prior is not None and record.prior.engine == engine:
        return record.prior.loop, None
    for trial in record.trials:
        if trial.timing is not None and trial.choice.engine == engine:
            faster = trial.timing.unbatched_faster
            return faster, trial.timing.why() + " (measured)" if faster else None
    return None


def _cost(trial: Trial, record: Record) -> float:
    """A timed call's cost as the settled plan would run it: where its engine then loops
    but the call ran vmap, at the timed loop's cost."""
    timing, loops = trial.timing, _loop(record, trial.choice.engine)
    if timing is None or trial.choice.forward or loops is None or not loops[0]:
        return trial.seconds
    return max(trial.seconds + timing.directions * (timing.single - timing.batched), 0.0)


def _choose(r: Request, record: Record, forward_wins: bool) -> tuple[Choice, bool, str | None]:
    """(what the call runs, whether it is timed, why earlier calls changed it).

    Under ``"auto"``, eager and without a graph of the results: the first call on a new
    signature runs reverse mode on eager autograd (or what another signature of f settled
    on), timed; the second, timed too, runs the challenger: forward mode where the shapes
    now choose it, else reverse mode on torch.func. From the third, the faster (the
    challenger must beat the first call by ``CHALLENGER_MARGIN``: that call paid the
    signature's one-time costs). Known before timing: f that draws, or an RNN, runs on eager
    autograd; an op vmap cannot batch loops on eager autograd; a compiled backward, or f
    torch.func refuses, leaves one engine. Elsewhere: the shapes, on torch.func (eager
    autograd for f that draws, or where the caller names it, where no graph is wanted)."""
    eager_ok = r.eager and not r.graph
    if r.requested != "auto" or not eager_ok:
        # (torch.func refused f on an earlier call, ``mutates``: an explicit strategy goes
        # to eager autograd at once, as that call fell back to, without running f twice)
        eager = (
            r.engine == "autograd" or record.random or (record.mutates and r.requested != "auto")
        )
        engine: Engine = "autograd" if eager and eager_ok else "torch.func"
        return Choice(engine, forward=forward_wins and r.requested == "auto"), False, None
    knows = record.rnn or record.slow_path
    if record.compiled and not record.threads:
        first = Choice("torch.func")
    elif knows or record.random or record.mutates or record.threads:
        first = Choice("autograd")
    elif record.prior is not None:
        first = Choice(record.prior.engine)
    else:
        first = Choice("autograd")
    candidates = [first]
    if forward_wins:
        candidates.append(Choice("torch.func", forward=True))
    elif (
        record.prior is None
        and first.engine == "autograd"
        and not (knows or record.random or record.mutates or record.threads)
    ):
        candidates.append(Choice("torch.func"))
    tried = {(t.choice.engine, t.choice.forward): t for t in record.trials}
    untried = [c for c in candidates if (c.engine, c.forward) not in tried]
    if untried and len(record.trials) < TRIAL_CALLS and (len(candidates) > 1 or not tried):
        choice = untried[0]
        loop, why = _loop(record, choice.engine) or (False, None)
        timed = len(candidates) > 1 or _forward_possible(r, record)
        return dataclasses.replace(choice, loop=loop and not choice.forward), timed, why
    choice, why = _settle(candidates, tried, record)
    loop, loop_why = _loop(record, choice.engine) or (False, None)
    if loop_why is not None and not choice.forward:
        why = loop_why if why is None else f"{why}; {loop_why}"
    if loop and not choice.forward and choice.engine == "torch.func" and first.engine == "autograd":
        # A loop of unbatched pulls runs on eager autograd where it may: the same pulls,
        # without torch.func's wrapping of every op, each head pulled through its head and
        # f at once (the race between the engines timed their vmaps, on cold first calls).
        choice, on_eager = Choice("autograd"), "a loop runs on eager autograd"
        why = on_eager if why is None else f"{why}; {on_eager}"
    return dataclasses.replace(choice, loop=loop and not choice.forward), False, why


def _forward_possible(r: Request, record: Record) -> bool:
    """Whether forward mode may become a candidate once y's size is known (so that the
    first call is timed, to compare with it)."""
    return (
        r.m is None
        and _one_batch(r)
        and 0 < FORWARD_MODE_PENALTY * r.n < r.k
        and not (record.random or record.hooked or record.forward_lost or record.threads)
        and not record.custom
        and not record.no_grad
    )


def _settle(
    candidates: list[Choice], tried: dict[tuple[Engine, bool], Trial], record: Record
) -> tuple[Choice, str | None]:
    """The candidate to run from now on: the first, unless a timed challenger beat it (by
    ``CHALLENGER_MARGIN`` where it is forward mode); and the times that said so."""
    first = candidates[0]
    best, base = first, tried.get((first.engine, first.forward))
    why = None
    for challenger in candidates[1:]:
        trial = tried.get((challenger.engine, challenger.forward))
        if trial is None:
            continue
        margin = CHALLENGER_MARGIN if challenger.forward else 1.0
        if base is None or _cost(trial, record) < margin * _cost(base, record):
            best = challenger
            why = None if base is None else _versus(challenger, trial, first, base, record)
        else:
            why = _versus(first, base, challenger, trial, record)
    return best, why


def _versus(won: Choice, won_t: Trial, lost: Choice, lost_t: Trial, record: Record) -> str:
    """Why the plan changed, in the timed calls' own times: the signature's first calls,
    which pay its one-time costs (call 1 the process's first use of the shapes too: seconds
    where later calls take milliseconds), so not what a call costs from then on."""
    return (
        f"{won.name} {1e3 * _cost(won_t, record):.3g} ms, {lost.name} "
        f"{1e3 * _cost(lost_t, record):.3g} ms (one timed call each, on the first calls: "
        "one-time costs included)"
    )
