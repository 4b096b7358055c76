"""Run a function on several gloo ranks of this machine, and shut each down cleanly: the
harness of the ``ddp`` benchmark case and of the distributed tests (tests/test_distributed.py,
tests/test_fsdp.py), one copy for both."""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


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


def spawn_ranks(worker: Callable[..., None], *args: Any, nprocs: int = WORLD) -> None:
    """Run ``worker(rank, *args)`` in ``nprocs`` spawned processes; raise if any rank fails.

    A rank that returns leaves with ``os._exit(0)``, skipping the interpreter's teardown.
    Whatever torch keeps that holds the group (DTensor's sharding-propagation cache holds every
    DeviceMesh FSDP2 used, and a mesh holds its ProcessGroup) outlives
    ``destroy_process_group``, and gloo's threads are then destroyed in teardown, in no set
    order: "terminate called without an active exception", SIGABRT, now and then, after every
    check had passed. A rank that raises goes through ``mp.spawn``'s own error path, and
    ``faulthandler`` prints the Python stacks of a rank that aborts or crashes.
    """
    mp.spawn(_rank_main, args=(worker, *args), nprocs=nprocs, join=True)  # type: ignore[no-untyped-call]


def _rank_main(rank: int, worker: Callable[..., None], *args: Any) -> None:
    faulthandler.enable()
    worker(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
