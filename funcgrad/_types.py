"""Type aliases shared by every module (one definition each)."""

from __future__ import annotations

from typing import Literal

import torch

Tensors = tuple[torch.Tensor, ...]
# What a user may ask for, and what a plan runs ("weighted": one pullback of w @ V).
Strategy = Literal["auto", "vjp", "jacrev", "jacfwd", "loop"]
Executed = Literal["vjp", "jacrev", "jacfwd", "loop", "weighted"]
Level = Literal["params", "features"]
STRATEGIES: tuple[Strategy, ...] = ("auto", "vjp", "jacrev", "jacfwd", "loop")
LEVELS: tuple[Level, ...] = ("params", "features")
