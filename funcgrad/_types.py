"""Type aliases shared by every module (one definition each)."""

from __future__ import annotations

from typing import Literal

import torch

Tensors = tuple[torch.Tensor, ...]
# What a user may ask for, and what a plan runs ("weighted": one pullback of w @ V).
Strategy = Literal["auto", "vjp", "jacrev", "jacfwd", "loop"]
Executed = Literal["vjp", "jacrev", "jacfwd", "loop", "weighted"]
Level = Literal["params", "features"]
# None: all directions at once; an int: at most that many per batched call (1: a loop);
# "auto": the most that fit the memory budget, measured on the first call.
ChunkSize = int | Literal["auto"] | None
STRATEGIES: tuple[Strategy, ...] = ("auto", "vjp", "jacrev", "jacfwd", "loop")
LEVELS: tuple[Level, ...] = ("params", "features")
