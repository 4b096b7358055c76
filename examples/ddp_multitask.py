"""Data-parallel multi-task training with funcgrad.backward on torch.distributed.

    torchrun --standalone --nproc_per_node=2 examples/ddp_multitask.py

CPU, gloo. Each rank trains on its half of every batch; the encoder is wrapped in
DistributedDataParallel (its reducer averages the shared gradients of funcgrad's one
backward), the heads are plain and funcgrad averages their gradients. Rank 0 prints the
weights and checks every step against one process on the whole batch.
"""

from __future__ import annotations

import copy
import datetime
import os
import sys

import torch
import torch.distributed as dist

# Before any process group exists: DistributedDataParallel imports this module, whose
# functions take `group=group.WORLD` as a default argument; imported later, they would keep
# the group (and gloo's threads and sockets) alive past destroy_process_group, into exit.
import torch.distributed.nn

import funcgrad

try:
    from torchjd.aggregation import UPGradWeighting
except ModuleNotFoundError:
    if os.environ.get("RANK", "0") == "0":  # one line, not one per rank
        print(
            'ddp_multitask.py needs TorchJD: pip install -e ".[mtl]" (from the source tree)',
            file=sys.stderr,
        )
    sys.exit(1)


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    try:
        train()
        dist.barrier()  # every rank's last collective: nothing is in flight anywhere after it
    finally:
        dist.destroy_process_group()


def train() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial model on every rank
    encoder = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))
    heads = torch.nn.ModuleList(torch.nn.Linear(8, 1) for _ in range(3))
    reference = copy.deepcopy((encoder, heads))  # one process on the whole batch
    ddp = torch.nn.parallel.DistributedDataParallel(encoder)
    optimizer = torch.optim.SGD([*encoder.parameters(), *heads.parameters()], lr=0.05)
    ref_optimizer = torch.optim.SGD(
        [*reference[0].parameters(), *reference[1].parameters()], lr=0.05
    )
    data = torch.Generator().manual_seed(1)
    for level in ("features", "params"):
        for step in range(3):
            x, y = (
                torch.randn(8 * world, 16, generator=data),
                torch.randn(8 * world, 3, generator=data),
            )
            shard = slice(8 * rank, 8 * rank + 8)
            for model, opt, inputs, targets, group in (
                ((ddp, heads), optimizer, x[shard], y[shard], ddp),
                (reference, ref_optimizer, x, y, None),
            ):
                opt.zero_grad()
                features = model[0](inputs)
                losses = [
                    torch.nn.functional.mse_loss(head(features), targets[:, i : i + 1])
                    for i, head in enumerate(model[1])
                ]
                weights = funcgrad.backward(
                    losses,
                    through=features,
                    weighting=UPGradWeighting(),
                    level=level,
                    process_group=group,
                )
                if group is None:
                    worst = max(
                        (p.grad - q.grad).abs().max().item()
                        for p, q in zip(
                            [*encoder.parameters(), *heads.parameters()],
                            [*reference[0].parameters(), *reference[1].parameters()],
                        )
                    )
                else:
                    distributed_weights = weights
                opt.step()
            if rank == 0:
                print(
                    f"{level:8s} step {step}: weights {distributed_weights.tolist()}, "
                    f"largest .grad difference from one process on the whole batch: {worst:.1e}"
                )
            assert worst < 1e-5, worst


if __name__ == "__main__":
    main()
