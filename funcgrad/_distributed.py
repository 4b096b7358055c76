"""Data-parallel multi-task gradients: what ``backward(..., process_group=...)`` sends.

DDP's convention: every rank holds an equal shard, each loss is a mean over the local shard,
and the global loss is the average of the ranks'. So the global task gradient is the average
of the ranks' local ones, and:

- features level: the ranks' features are disjoint coordinates of the global features, so
  the global Gramian is ``(1/R^2) sum_r V_r V_r^T``: one all-reduce of k x k numbers, then
  the one backward of ``w @ V_r`` whose parameter gradients are averaged (by DDP's own
  reducer when the encoder is wrapped in DDP, else in one flat buffer here);
- params level: one all-reduce of the k x P per-task gradients (one flat buffer).

The weights are broadcast from the group's first rank, so that a weighting that draws random
numbers (PCGrad) still gives every rank the same update. Collectives are only ever entered
by all ranks together: every check that could fail on one rank alone is made on data that
all ranks share (the agreed signature, the all-reduced Gramian).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

Tensors = tuple[torch.Tensor, ...]


class Group:
    """The ranks of ``process_group`` (a ProcessGroup, or a DistributedDataParallel module
    whose reducer then averages the shared gradients of the final backward)."""

    def __init__(self, process_group: Any, call: str) -> None:
        if isinstance(process_group, torch.nn.parallel.DistributedDataParallel):
            self.ddp, self.group = True, process_group.process_group
        else:
            self.ddp, self.group = False, process_group
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                f"{call}: `process_group` was given but torch.distributed is not initialised; "
                "call torch.distributed.init_process_group first, or pass process_group=None."
            )
        if not isinstance(self.group, dist.ProcessGroup):
            raise TypeError(
                f"{call}: `process_group` must be a torch.distributed ProcessGroup (such as "
                "torch.distributed.group.WORLD) or the DistributedDataParallel module of the "
                f"shared encoder, got {type(process_group).__name__}."
            )
        self.call = call
        self.size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.source = dist.get_global_rank(self.group, 0)
        self.bytes = 0  # sent per rank in this call (all-reduce payloads), for the stats

    def agree(self, signature: Sequence[int], labels: Sequence[str], device: torch.device) -> None:
        """One all-gather of a few integers: every rank checks that all agree (k, level,
        parameter shapes, ...), so that a mismatch is the same clear error on every rank
        instead of a hang in a later collective."""
        mine = torch.tensor(list(signature), dtype=torch.int64, device=device)
        gathered = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(gathered, mine, group=self.group)
        for other, theirs in enumerate(gathered):
            if torch.equal(theirs, mine):
                continue
            diffs = [
                f"{label}: {int(a)} here (rank {self.rank}) vs {int(b)} on rank {other}"
                for label, a, b in zip(labels, mine.tolist(), theirs.tolist())
                if a != b
            ]
            raise ValueError(
                f"{self.call}: the ranks of `process_group` disagree ({'; '.join(diffs)}). "
                "Every rank must pass the same losses (same k, in the same order), the same "
                "`through` structure and the same model; nothing was communicated or written."
            )

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.contiguous()
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
        self.bytes += tensor.numel() * tensor.element_size()
        return tensor

    def average(self, tensors: Sequence[torch.Tensor]) -> Tensors:
        """The average over the ranks of every tensor, in one flat buffer per dtype."""
        result: list[torch.Tensor | None] = [None] * len(tensors)
        for dtype in dict.fromkeys(t.dtype for t in tensors):
            indices = [i for i, t in enumerate(tensors) if t.dtype == dtype]
            flat = self.sum(torch.cat([tensors[i].reshape(-1) for i in indices])) / self.size
            start = 0
            for i in indices:
                numel = tensors[i].numel()
                result[i] = flat[start : start + numel].view_as(tensors[i])
                start += numel
        return tuple(t for t in result if t is not None)  # every entry is set above

    def from_first_rank(self, weights: torch.Tensor) -> torch.Tensor:
        """The first rank's tensor on every rank (the k weights, or an aggregator's update)."""
        weights = weights.contiguous()
        dist.broadcast(weights, src=self.source, group=self.group)
        self.bytes += weights.numel() * weights.element_size()
        return weights
