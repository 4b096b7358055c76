"""The ``ddp`` benchmark case: 2 gloo ranks on this machine, one step of multi-task training
per method, time per step and numbers communicated per rank.

Methods: plain DDP with ``sum(losses).backward()`` (the floor), and ``funcgrad.backward``
with UPGrad at both levels through the DDP-wrapped encoder. The bytes of funcgrad's own
collectives are counted by wrapping ``torch.distributed``'s functions; DDP's reducer
(C++) all-reduces the P parameter gradients, counted from the parameter count.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import funcgrad

from ._cases import Encoder, _mtl_heads

WORLD = 2
METHODS = ("plain DDP sum(losses)", "funcgrad backward features", "funcgrad backward params")
MISSING_TORCHJD = 'needs TorchJD: pip install -e ".[mtl]" (from the source tree)'


@contextlib.contextmanager
def gloo_group(timeout_s: float, **init: Any) -> Iterator[None]:
    """A gloo process group for the body, shut down the same way on every rank.

    ``torch.distributed.nn`` is imported first: DistributedDataParallel imports it on first
    use, and its functions take ``group=group.WORLD`` as a default argument, evaluated at
    import. Imported while a group is initialised, they would hold that ProcessGroup for the
    life of the process, so that ``destroy_process_group`` could not free it: gloo's threads
    and sockets would live on into interpreter exit, racing the other rank's exit.

    If the body succeeds, a barrier is every rank's last collective (nothing is left in
    flight, DDP's reducer included, on either side) before the group is destroyed. If it
    raises, the group is destroyed without a barrier (the other rank may be in another
    collective) and the error propagates; every collective keeps ``timeout_s``.
    """
    import torch.distributed.nn  # noqa: F401  (before the group exists: see above)

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s), **init)
    try:
        yield
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _counting(counter: dict[str, int]) -> None:
    """Count the bytes of the collectives called from Python (funcgrad's own)."""
    for name in ("all_reduce", "broadcast", "all_gather"):
        original = getattr(dist, name)

        def counted(tensor, *args, _original=original, _name=name, **kwargs):
            first = tensor[0] if isinstance(tensor, list) else tensor
            counter["bytes"] += first.numel() * first.element_size()
            return _original(tensor, *args, **kwargs)

        setattr(dist, name, counted)


def _worker(rank: int, store: str, k: int, quick: bool, rounds: int, out: str) -> None:
    torch.set_num_threads(1)
    with gloo_group(120, init_method=f"file://{store}", rank=rank, world_size=WORLD):
        _run(rank, k, quick, rounds, out)


def _run(rank: int, k: int, quick: bool, rounds: int, out: str) -> None:
    from torchjd.aggregation import UPGradWeighting

    counter = {"bytes": 0}
    _counting(counter)
    widths, batch = ((64, 128, 128, 64), 32) if quick else ((512, 1024, 1024, 512), 128)
    torch.manual_seed(0)
    encoder = Encoder(widths)
    ddp = torch.nn.parallel.DistributedDataParallel(encoder)
    heads = _mtl_heads(k, widths[-1], batch)
    inputs = torch.randn(batch, widths[0]) + rank
    shared = list(encoder.parameters())
    p_bytes = sum(p.numel() * p.element_size() for p in shared)

    def step(method: str) -> None:
        for p in shared:
            p.grad = None
        features = ddp(inputs)
        losses = [h(features) for h in heads]
        if method == METHODS[0]:
            torch.stack(losses).sum().backward()
        else:
            level: Literal["params", "features"] = (
                "params" if method.endswith("params") else "features"
            )
            funcgrad.backward(
                losses,
                through=features,
                weighting=UPGradWeighting(),
                level=level,
                process_group=ddp,
            )

    samples: dict[str, list[float]] = {m: [] for m in METHODS}
    sent: dict[str, int] = {}
    for method in METHODS:  # warm-up, and the bytes of one step
        counter["bytes"] = 0
        step(method)
        sent[method] = counter["bytes"] + p_bytes
    for r in range(rounds):
        order = METHODS[r % 3 :] + METHODS[: r % 3]
        for method in order:
            dist.barrier()
            start = time.perf_counter()
            step(method)
            samples[method].append(time.perf_counter() - start)
    if rank == 0:
        n = sum(p.numel() for p in shared)
        Path(out).write_text(json.dumps({"samples": samples, "bytes": sent, "n": n}))


def ddp_entry(k: int, quick: bool, rounds: int) -> dict[str, Any]:
    """The report entry of the ``ddp k=...`` case (run in 2 spawned ranks), or, without
    TorchJD, an entry that says it was skipped (one line on stderr, nothing spawned)."""
    entry: dict[str, Any] = {"name": "ddp", "k": k, "m": 0, "auto": "", "rounds": rounds}
    entry |= {"agreement": {}, "skipped": {}, "baseline": METHODS[0]}
    if importlib.util.find_spec("torchjd") is None:
        print(f"bench: skipping ddp k={k}: it {MISSING_TORCHJD}", file=sys.stderr)
        return entry | {"n": 0, "methods": {}, "skipped": {"all": MISSING_TORCHJD}}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "ddp.json")
        mp.spawn(
            _worker,
            args=(os.path.join(tmp, "store"), k, quick, rounds, out),
            nprocs=WORLD,
            join=True,
        )
        result = json.loads(Path(out).read_text())
    methods = {
        m: {
            "median": statistics.median(s),
            "min": min(s),
            "max": max(s),
            "samples": s,
            "bytes_per_rank": result["bytes"][m],
        }
        for m, s in result["samples"].items()
    }
    return entry | {"n": result["n"], "methods": methods}
