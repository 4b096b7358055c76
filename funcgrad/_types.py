"""Type aliases shared by every module (one definition each)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Literal, TypeAlias, Union

import torch

if TYPE_CHECKING:
    import torch.distributed

Tensors = tuple[torch.Tensor, ...]
Strategy: TypeAlias = Literal["auto", "vjp", "jacrev", "jacfwd", "loop"]
"""How the k head cotangents are pulled back through f: `"vjp"` (the k cotangents), `"jacrev"`
(the m unit directions of y, then a product), `"jacfwd"` (the n columns of the Jacobian, in
forward mode), `"loop"` (one unbatched backward per head), or `"auto"` (the fewest passes,
from the shapes, then measured on the first call on new shapes). `"jacrev"` and `"jacfwd"`
assume f's pullback linear in the cotangent, as `torch.func.jacrev` does; `"auto"` pulls each
head's cotangent where f runs a backward hook or a custom `autograd.Function` not of torch's
own."""
# What a plan runs ("weighted": one pullback of w @ V).
Executed = Literal["vjp", "jacrev", "jacfwd", "loop", "weighted"]
Engine = Literal["torch.func", "autograd"]
"""What f's linearisation runs on: torch.func's `vjp` (composable with transforms) or one eager
autograd graph (autograd's own fused backward kernels: RNNs, attention, cuDNN)."""
# How a Pullback call answers (funcgrad._plan.pullback_reuse).
Reuse = Literal["measure", "basis", "pull"]
Level: TypeAlias = Literal["params", "features"]
"""Where the Gramian of the task gradients is formed: `"params"`, on the shared parameters
(exact Jacobian descent, k directions through the shared part); `"features"`, on the features
that the losses are computed from (one backward whatever k; MGDA-UB's upper bound)."""
ChunkSize: TypeAlias = int | Literal["auto"] | None
"""How many directions one batched (vmapped) call pulls through f: None, all at once; an int,
at most that many per call (1: a plain loop); `"auto"`, the most that fit the memory budget
(`funcgrad.memory_budget`), measured on the first call on new shapes."""
STRATEGIES: tuple[Strategy, ...] = ("auto", "vjp", "jacrev", "jacfwd", "loop")
LEVELS: tuple[Level, ...] = ("params", "features")

# The public annotations of backward and combine_heads, exported by name so that the API
# reference shows and explains them (a TypeAlias keeps its name in the rendered signatures).
Weighting: TypeAlias = Callable[[torch.Tensor], torch.Tensor]
"""A task weighting: a callable from the k x k Gramian of the task gradients to k weights.

`funcgrad.backward` and `funcgrad.combine_heads` call `weighting(G)` with G of shape (k, k)
and expect weights of shape (k,). Any function does, such as
`lambda gramian: torch.ones(len(gramian))`. TorchJD's objects are accepted as they are
(funcgrad never imports TorchJD): every `*Weighting` (`UPGradWeighting()`, `MGDAWeighting()`,
...), and at `level="params"` every `Aggregator` (`UPGrad()`, `NashMTL(...)`, `GradDrop()`),
which is called on the k x n Jacobian where it needs more than the Gramian. Each of them is a
`torch.nn.Module` from a tensor to a tensor, so it type-checks as this callable.
"""

# (A Union with a forward reference, not a string: a string inside `ProcessGroupLike | None`
# breaks typing.get_type_hints. The reference resolves where torch.distributed is available.)
ProcessGroupLike: TypeAlias = Union["torch.distributed.ProcessGroup", torch.nn.Module]
"""Where data-parallel training communicates (`process_group=` of `funcgrad.backward` and
`funcgrad.combine_heads`).

A `torch.distributed.ProcessGroup` (funcgrad averages the gradients itself); a
`DistributedDataParallel` module that wraps the shared encoder (its reducer averages them);
or, for `backward`, the shared encoder sharded by FSDP2's `fully_shard` (an `nn.Module`; its
reduce-scatter averages them). None (the default): nothing is communicated.
"""

InputsLike: TypeAlias = (
    torch.Tensor
    | torch.nn.Module
    | Mapping[str, torch.Tensor]
    | Iterable[torch.Tensor]
    | Iterable[tuple[str, torch.Tensor]]
)
"""The shared leaves that `funcgrad.backward` updates (`inputs=`): a tensor, several tensors
(`model.parameters()`), a Module (its parameters), or named tensors (a mapping, or
`model.named_parameters()`), which name them in error messages."""
