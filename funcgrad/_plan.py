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

from ._types import Executed, Strategy

# A JVP of f costs about as much as a VJP but forward mode can disagree with autograd's
# conventions (cholesky, eigh, ...: see the README, Reliability), so it must be clearly
# cheaper to be chosen.
FORWARD_MODE_PENALTY = 2

_TORCH_FUNC = "torch.func cannot differentiate f (or f updates a buffer in place) -> eager autograd"
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

    Returned by ``fn.plan(*args)`` for the functions of :func:`funcgrad.compose_heads` and
    :func:`funcgrad.combine_heads`; the same plan drives the call.

    Attributes:
        strategy: ``"vjp"``, ``"jacrev"``, ``"jacfwd"`` or ``"loop"`` (never ``"auto"``);
            ``"weighted"`` where one pullback of the weighted cotangent ``w @ V`` is all that
            is needed (:func:`funcgrad.combine_heads` at level ``"features"``, or without a
            weighting).
        k: number of heads.
        m: real dimension of f's output (complex entries count twice).
        n: real dimension of the differentiated inputs.
        chunk_size: at most this many directions per batched call (None: all at once).
        requested: the ``strategy`` argument (``"auto"`` lets the planner choose).
        costs: the candidates the planner weighed, as (name, directions) pairs; forward
            mode counts ``FORWARD_MODE_PENALTY`` per input coordinate.
        fallbacks: what the engine does, with one warning, where this strategy cannot run
            as planned; each entry reads "condition -> what runs instead".

    Examples:
        >>> import torch, funcgrad
        >>> fn = funcgrad.compose_heads(torch.sin, [lambda y: y.sum()] * 8)
        >>> plan = fn.plan(torch.zeros(3))
        >>> plan.strategy, plan.directions, plan.passes
        ('jacrev', 3, 1)
        >>> plan
        Plan('jacrev': 3 directions through f in 1 pass; ...; auto chose the fewest: vjp=8, ...)
    """

    strategy: Executed
    k: int
    m: int
    n: int
    chunk_size: int | None = None
    requested: Strategy = "auto"
    costs: tuple[tuple[str, int], ...] = ()
    fallbacks: tuple[str, ...] = ()

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
        of its batched forward-mode pass: ``directions`` split by ``chunk_size``."""
        if not self.directions:
            return 0
        if self.strategy == "loop":
            return self.directions
        if self.strategy == "jacfwd":
            return 1
        return math.ceil(self.directions / (self.chunk_size or self.directions))

    def __repr__(self) -> str:
        d, p = self.directions, self.passes
        what = f"{d} direction{'s' * (d != 1)} through f in {p} pass{'es' * (p != 1)}"
        shapes = f"k={self.k}, m={self.m}, n={self.n}"
        if self.chunk_size is not None:
            shapes += f", chunk_size={self.chunk_size}"
        costs = ", ".join(f"{name}={cost}" for name, cost in self.costs)
        if self.strategy == "weighted":
            why = "one pullback of w @ V, whatever k"
        elif self.requested == "auto":
            why = f"auto chose the fewest: {costs}"
        else:
            why = f"strategy={self.requested!r} requested (costs: {costs})"
        return f"Plan({self.strategy!r}: {what}; {shapes}; {why})"


def make_plan(
    requested: Strategy,
    k: int,
    m: int,
    n: int,
    chunk_size: int | None = None,
    *,
    forward: bool = True,
    weighted: bool = False,
    call: str = "funcgrad",
) -> Plan:
    """The plan for k cotangents on an m-dimensional y and n-dimensional inputs.

    ``vjp`` costs k pullbacks, ``jacrev`` m pullbacks plus a (k, m) @ (m, n) product,
    ``jacfwd`` n JVPs plus a product, counted ``FORWARD_MODE_PENALTY`` times. Ties go to
    ``vjp``, which needs no product. Forward mode is a candidate only where ``forward`` (its
    choice is made before f runs, so y's size had to be known then) and all n tangents fit
    one batch (f's forward runs once, in that batch). ``weighted``: one pullback of ``w @ V``.
    """
    one_batch = chunk_size is None or chunk_size >= n
    if requested == "jacfwd" and not one_batch:
        raise ValueError(
            f"{call}: strategy='jacfwd' takes all n = {n} columns of J in one batched forward "
            f"pass; chunk_size={chunk_size} would run f's forward once per chunk. Pass "
            f"chunk_size=None (or >= {n}) with jacfwd, or use strategy='jacrev' or 'vjp' to "
            "bound memory with chunks."
        )
    costs = {"vjp": k, "jacrev": m}
    if n and one_batch:
        costs["jacfwd"] = FORWARD_MODE_PENALTY * n
    candidates: list[Executed] = ["vjp", "jacrev"]
    if "jacfwd" in costs and forward:
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
    fallbacks = _FALLBACKS[strategy]
    if requested == "auto" and len(candidates) < len(costs) and not weighted:
        fallbacks = ("jacfwd was not a candidate: y's size was unknown before f ran", *fallbacks)
    return Plan(strategy, k, m, n, chunk_size, requested, tuple(costs.items()), fallbacks)
