"""Sharded multi-task training with funcgrad.backward on FSDP2 (fully_shard).

    torchrun --standalone --nproc_per_node=2 examples/fsdp_multitask.py

CPU, gloo. The shared encoder is sharded with per-layer wraps (each rank holds half of every
parameter); each rank trains on its half of every batch. ``process_group=encoder`` makes
funcgrad use FSDP's own backward: at the features level one backward of ``w @ V`` (FSDP's
reduce-scatter averages it), at the params level one backward per task, each rank reading
its shard of the averaged per-task gradients and all-reducing their k x k Gramian. Rank 0
prints the weights; every rank checks its gathered parameters after every step against one
process on the whole batch.
"""

from __future__ import annotations

import copy
import datetime
import os
import sys

import torch
import torch.distributed as dist

# Before any process group exists (see examples/ddp_multitask.py).
import torch.distributed.nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import funcgrad

try:
    from torchjd.aggregation import UPGradWeighting
except ModuleNotFoundError:
    if os.environ.get("RANK", "0") == "0":  # one line, not one per rank
        print(
            'fsdp_multitask.py needs TorchJD: pip install -e ".[mtl]" (from the source tree)',
            file=sys.stderr,
        )
    sys.exit(1)


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    try:
        train()
        dist.barrier()  # every rank's last collective: nothing is in flight anywhere after it
        if dist.get_rank() == 0:  # past the barrier: every rank finished train()
            print("every rank finished: the FSDP steps equal one process on the whole batch")
    finally:
        dist.destroy_process_group()


def train() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial model on every rank
    encoder = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))
    heads = torch.nn.ModuleList(torch.nn.Linear(8, 1) for _ in range(3))
    reference = copy.deepcopy((encoder, heads))  # one process on the whole batch
    mesh = init_device_mesh("cpu", (world,))
    for layer in (encoder[0], encoder[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(encoder, mesh=mesh)
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
                ((encoder, heads), optimizer, x[shard], y[shard], encoder),
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
                opt.step()
                if group is not None:
                    sharded_weights = weights
            # The sharded parameters, gathered, against the one process's.
            worst = max(
                (p.full_tensor() - q).abs().max().item()
                for p, q in zip(encoder.parameters(), reference[0].parameters())
            )
            if rank == 0:
                print(
                    f"{level:8s} step {step}: weights {sharded_weights.tolist()}, largest "
                    f"parameter difference, equal to one process on the whole batch: {worst:.1e}"
                )
            assert worst < 1e-5, worst


if __name__ == "__main__":
    main()
