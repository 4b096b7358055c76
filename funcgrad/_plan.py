"""The planner: which way of pulling k head cotangents back through f is cheapest, and the
:class:`Plan` that the engine then runs.

It looks at shapes only (k heads, m = real numel of y, n = real numel of the differentiated
inputs) and the options, never at values, so the choice is the same under vmap, grad and
torch.compile. ``fn.plan(*args)`` and ``fn(*args)`` both call :func:`make_plan` with the
same inputs, so the plan reported is the plan run.
"""

from __future__ import annotations

import dataclasses
import math

from ._types import ChunkSize, Engine, Executed, Strategy

# chunk_size="auto": the directions run to measure a fit. Direction 0 alone first (an
# unbatched call): over the budget, every direction then goes alone. Where it says three
# fit and more than FIT_MIN remain, the next two and three in one vmap each (FIT_RANGES,
# after the probe), whose difference is a vmapped direction's cost (one direction alone
# peaks otherwise: on an MLP, 4 MiB alone, 4.25 MiB for two in one vmap, then 2.125 MiB
# more for each). Only a single direction runs unmeasured.
FIT_PROBE = (0, 1)
FIT_RANGES = ((0, 2), (2, 5))
FIT_MIN = FIT_RANGES[-1][1]

# A JVP of f costs about as much as a VJP but forward mode can disagree with autograd's
# conventions (cholesky, eigh, ...: see the README, Reliability), so it must be clearly
# cheaper to be chosen.
FORWARD_MODE_PENALTY = 2

_TORCH_FUNC = "torch.func cannot differentiate f (or f updates a buffer in place) -> eager autograd"
# Where no graph of the results is wanted, outside transforms: auto runs its first six calls
# on new shapes on torch.func and eager autograd in turn, each timed, and later calls run on
# eager autograd where its fastest call beat torch.func's by this factor (0: never, and no
# call is spent on it). 1: the faster wins. A margin for torch.func (0.9 until 2026-12)
# kept it on a loaded machine where eager autograd measured 10% faster by a hair (the
# quick nn.LSTM at k=3: 1.36 against 1.52 ms a call, then 1.5 ms against 1.27 a call for
# the rest of the run); between engines within noise of each other either choice costs
# about as much, so no side gets a handicap.
ENGINE_MARGIN = 1.0
_VMAP = "vmap cannot batch the pullback, or check finds it wrong -> a loop of unbatched pullbacks"
_NON_FINITE = "V @ J not finite -> the cotangents themselves are pulled back, as autograd does"
_FORWARD = "forward mode cannot differentiate f, or vmap cannot batch its JVPs -> reverse mode"
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
            shapes (by ``plan()`` or the first call); ``"auto"`` where that is not known
            yet: the call then measures on direction 0 alone, then (where three fit and
            more than 5 remain) on directions 1-2 and 3-5 (vmapped), and runs the rest in
            chunks of the size found, so ``passes`` is a lower bound (the rest counted as
            one chunk), exact with one direction.
        requested: the ``strategy`` argument (``"auto"`` lets the planner choose).
        costs: the candidates the planner weighed, as (name, directions) pairs; forward
            mode counts ``FORWARD_MODE_PENALTY`` per input coordinate.
        fallbacks: what the engine does, with one warning, where this strategy cannot run
            as planned; each entry reads "condition -> what runs instead".
        measured: why an earlier call on these shapes changed the plan, else None: reverse
            mode measured faster than forward mode, unbatched calls faster than vmap
            (which loops inside for an op without a batching rule, or is slow anyway), or
            eager autograd faster than torch.func.
        measure: the call times its first batched call against one unbatched call (the
            first two calls on new shapes under ``"auto"`` on each engine they run on: each
            side's fastest of the two decides, so that neither side's one-time costs decide
            alone): one direction more through f, in ``passes``; the result decides how
            later calls on these shapes run on that engine.
        engine: what f's linearisation runs on: ``"torch.func"`` (``torch.func.vjp``, vmapped
            pulls) or ``"autograd"`` (one eager forward that records an autograd graph, then
            ``torch.autograd.grad`` per direction or vmapped over them, as the loop a user
            writes, with autograd's fused backward kernels: RNNs, attention). Under
            ``"auto"``, where the call builds no graph of its results and runs outside
            transforms, the first six calls on new shapes run on torch.func and eager
            autograd in turn, each timed (`engine_trial`): on each engine, two that time
            vmap against one unbatched call (``measure``: each engine batches by its own),
            then one that runs the plan they chose. Each engine's first call pays its
            one-time costs, so each is weighed by its fastest call (a vmapped call counted
            at the loop's estimated cost where that engine's plan turned unbatched); later
            calls run on the faster of the two (``measured`` says why). Where f draws
            random numbers, or torch.func cannot differentiate it, always ``"autograd"``;
            ``"weighted"`` plans with no result graph run on ``"autograd"`` (one pullback:
            the eager backward is the floor).
        engine_trial: this call is one of the six that time the engines, on ``engine``
            (f runs once, as in any call).
        f_runs: how many times the call runs f's Python body, as planned: 1 (``"auto"``
            times forward against reverse mode on two separate calls), plus ``check``'s
            unbatched JVP calls in forward mode (up to 3). A fallback that runs f again adds
            one. ``plan()`` itself runs f's body on fake tensors (see
            `funcgrad.ComposedHeads.plan`); a call never does. Shown in the repr when not 1.

    Examples:
        >>> import torch, funcgrad
        >>> fn = funcgrad.compose_heads(torch.sin, [lambda y: y.sum()] * 8)
        >>> plan = fn.plan(torch.zeros(3))
        >>> plan.strategy, plan.directions, plan.passes  # the first call also times vmap
        ('jacrev', 3, 2)
        >>> plan
        Plan('jacrev': 3 directions through f in 2 passes; ...; auto chose the fewest: vjp=8, ...)
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
    engine_trial: bool = False

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
            # (two directions: the rest after the probe is one unbatched call, never timed)
            least = min(self.directions, 2 if self.directions <= FIT_MIN + 1 else 3)
            return least + (self.measure and self.directions > 2)
        return math.ceil(self.directions / (self.chunk_size or self.directions)) + self.measure

    @property
    def exact(self) -> bool:
        """Whether `passes` is the count the call runs; False only where
        ``chunk_size="auto"`` has not measured yet and more than one direction batches: the
        call measures, then runs the rest in chunks of a size not known before."""
        return not (
            self.chunk_size == "auto" and self.strategy in ("vjp", "jacrev") and self.directions > 1
        )

    def __repr__(self) -> str:
        d, p = self.directions, self.passes
        at_least = "" if self.exact else "at least "
        what = f"{d} direction{'s' * (d != 1)} through f in {at_least}{p} pass{'es' * (p != 1)}"
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
        measuring = "; times vmap against one unbatched call (this call)" * self.measure
        if self.engine_trial:
            other = "torch.func" if self.engine == "autograd" else "eager autograd"
            engine = "eager autograd" if self.engine == "autograd" else "torch.func"
            measuring += f"; times {engine} against {other} (this call)"
        what += " on eager autograd" * (self.engine == "autograd")
        runs = f"; f's Python body runs {self.f_runs} times" * (self.f_runs != 1)
        return f"Plan({self.strategy!r}: {what}; {shapes}; {why}{measuring}{runs})"


def make_plan(
    requested: Strategy,
    k: int,
    m: int,
    n: int,
    chunk_size: ChunkSize = None,
    *,
    forward: bool = True,
    weighted: bool = False,
    unbatched: str | None = None,
    measure: bool = False,
    not_forward: str | None = None,
    call: str = "funcgrad",
    engine: Engine = "torch.func",
    engine_trial: bool = False,
    engine_why: str | None = None,
    linear: bool = True,
) -> Plan:
    """The plan for k cotangents on an m-dimensional y and n-dimensional inputs.

    ``vjp`` costs k pullbacks, ``jacrev`` m pullbacks plus a (k, m) @ (m, n) product,
    ``jacfwd`` n JVPs plus a product, counted ``FORWARD_MODE_PENALTY`` times. Ties go to
    ``vjp``, which needs no product. Forward mode is a candidate only where ``forward`` (its
    choice is made before f runs, so y's size had to be known then) and all n tangents fit
    one batch (f's forward runs once, in that batch). ``weighted``: one pullback of ``w @ V``.
    ``unbatched`` (auto only): the reason an earlier call measured unbatched calls faster;
    then the fewer of k pullbacks (``loop``) or m rows one at a time (``jacrev``, chunks of 1).
    ``measure`` (auto only): this call times its first batched call (see :class:`Plan`).
    ``not_forward``: why an earlier call measured reverse mode faster than forward mode.
    ``engine``, ``engine_trial``: see :class:`Plan`; ``engine_why``: why the timed calls
    chose eager autograd. ``linear=False``: f's backward may not be linear in the cotangent
    (f registers a tensor hook): only the k cotangents themselves go through f (``vjp`` or
    ``loop``); ``jacrev`` and ``jacfwd`` are refused.
    """
    if not linear and requested in ("jacrev", "jacfwd"):
        raise ValueError(
            f"{call}: f registers a tensor hook (Tensor.register_hook) in its forward, and a "
            f"hook may act nonlinearly on its gradient (a clamp), while strategy={requested!r} "
            + (
                "combines the pullbacks of y's unit directions"
                if requested == "jacrev"
                else "runs forward mode, which never runs backward hooks"
            )
            + ": its answer would be autograd's only for a hook linear in its gradient. Use "
            "strategy='vjp', 'loop' or 'auto' (which pull each head's cotangent through f)."
        )
    one_batch = chunk_size is None or chunk_size == "auto" or chunk_size >= n
    if requested == "jacfwd" and not one_batch:
        raise ValueError(
            f"{call}: strategy='jacfwd' takes all n = {n} columns of J in one batched forward "
            f"pass; chunk_size={chunk_size} would run f's forward once per chunk. Pass "
            f"chunk_size=None (or >= {n}) with jacfwd, or use strategy='jacrev' or 'vjp' to "
            "bound memory with chunks."
        )
    costs = {"vjp": k, "jacrev": m}
    if n and one_batch and (forward or requested != "auto"):
        costs["jacfwd"] = FORWARD_MODE_PENALTY * n
    candidates: list[Executed] = ["vjp", "jacrev"] if linear else ["vjp"]
    if "jacfwd" in costs and forward and linear:
        candidates.append("jacfwd")
    strategy: Executed
    if weighted:
        strategy, costs = "weighted", {"weighted": 1}
    elif requested == "auto":
        strategy = min(candidates, key=lambda name: (costs[name], candidates.index(name)))
    elif requested == "jacfwd" and not n:
        strategy = "vjp"  # no input coordinate: every answer is zeros, no pass needed
    else:
        strategy = requested
    measured = not_forward if requested == "auto" and not weighted else None
    if unbatched is not None and requested == "auto" and not weighted and strategy != "jacfwd":
        strategy = "loop" if k <= m or not linear else "jacrev"
        chunk_size = None if strategy == "loop" else 1
        measured = unbatched if measured is None else f"{measured}; {unbatched}"
    if engine_why is not None and requested == "auto" and not weighted:
        measured = engine_why if measured is None else f"{measured}; {engine_why}"
    if strategy == "jacfwd":  # forward mode runs f itself, on torch.func
        engine, engine_trial = "torch.func", False
    batches = strategy in ("vjp", "jacrev") and chunk_size != 1 and min(k, m, n) > 0
    measure = measure and requested == "auto" and batches and (k if strategy == "vjp" else m) > 1
    fallbacks = _FALLBACKS[strategy]
    return Plan(
        strategy,
        k,
        m,
        n,
        chunk_size,
        requested,
        tuple(costs.items()),
        fallbacks,
        measured,
        measure,
        engine=engine,
        engine_trial=engine_trial and requested == "auto" and not weighted,
    )
