"""The static planner: which strategy pulls k head cotangents back through f most cheaply.

It looks at shapes only (k heads, m = real numel of y, n = real numel of the differentiated
inputs), never at values, so the choice is the same under vmap, grad and torch.compile.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

Strategy = Literal["auto", "vjp", "jacrev", "jacfwd", "loop"]
STRATEGIES: tuple[str, ...] = ("auto", "vjp", "jacrev", "jacfwd", "loop")

# A JVP of f costs about as much as a VJP but forward mode can disagree with autograd's
# conventions (DESIGN.md: cholesky, eigh, ...), so it must be clearly cheaper to be chosen.
FORWARD_MODE_PENALTY = 2


@dataclasses.dataclass(frozen=True)
class Plan:
    """How :func:`funcgrad.compose_heads` computes the gradients for given shapes.

    Attributes:
        strategy: ``"vjp"``, ``"jacrev"``, ``"jacfwd"`` or ``"loop"`` (never ``"auto"``);
            ``"weighted"`` for :func:`funcgrad.combine_heads` where one pullback of the
            weighted cotangent ``w @ V`` is all it needs (level ``"features"``, or no
            weighting).
        k: number of heads.
        m: real dimension of f's output (complex entries count twice).
        n: real dimension of the differentiated inputs.
        directions: how many directions go through f: pullbacks for ``vjp``, ``loop``,
            ``jacrev`` and ``weighted``, JVPs for ``jacfwd``.
    """

    strategy: str
    k: int
    m: int
    n: int

    @property
    def directions(self) -> int:
        return {"vjp": self.k, "loop": self.k, "jacrev": self.m, "jacfwd": self.n, "weighted": 1}[
            self.strategy
        ]


def choose(k: int, m: int, n: int, forward: bool = True) -> str:
    """Cheapest strategy by the number of directions that must pass through f.

    ``vjp`` costs k pullbacks, ``jacrev`` m pullbacks plus a (k, m) @ (m, n) product,
    ``jacfwd`` n JVPs plus a product. Ties go to ``vjp``, which needs no product. Empty
    inputs (n = 0) need no direction at all and go to ``vjp``, which returns zeros.
    """
    costs = {"vjp": k, "jacrev": m}
    if forward and n:
        costs["jacfwd"] = FORWARD_MODE_PENALTY * n
    return min(costs, key=lambda name: (costs[name], list(costs).index(name)))


def make_plan(strategy: str, k: int, m: int, n: int) -> Plan:
    return Plan(choose(k, m, n) if strategy == "auto" else strategy, k, m, n)
