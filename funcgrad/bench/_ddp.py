"""The ``ddp`` benchmark case: 2 gloo ranks on this machine, one step of multi-task training
per method, time per step and bytes sent per rank.

Methods, all from the same initial weights, inputs (each rank its own) and heads:

- plain DDP with ``sum(losses).backward()`` (the floor), and ``funcgrad.backward`` with
  UPGrad at both levels through the DDP-wrapped encoder;
- the same three on a second Encoder instance sharded with FSDP2 (``fully_shard`` on each
  Linear, then the root, over ``init_device_mesh("cpu", (2,))``): plain FSDP
  ``torch.stack(losses).sum().backward()``, and ``funcgrad.backward(...,
  process_group=<the FSDP encoder>)`` at both levels (features: one backward through FSDP;
  params: one backward per task, a k x k Gramian all-reduced, then k weights and R flags).

The methods are timed in interleaved rounds (the order rotates every round), each step after
a barrier. The warm-up step of each method (FSDP's lazy initialisation included) also checks
agreement: the gathered FSDP gradients (``p.grad.full_tensor()``) against the DDP-wrapped
encoder's ``.grad`` of the same method (plain vs plain, features vs features, params vs
params), as the largest error relative to each parameter's largest gradient entry, on the
first rank (every rank holds the same full gradients).

Bytes sent per rank, per step, for a ring algorithm over R = 2 ranks (every collective here
spans both ranks), B the bytes of the full buffer:

- all-reduce: 2 (R-1)/R B (a reduce-scatter then an all-gather);
- all-gather and reduce-scatter: (R-1)/R B (B: the gathered output, or the scattered input);
- broadcast: B on every rank (what the source sends: an upper bound for the others).

Counted: every collective called through ``torch.distributed``'s Python functions, wrapped
here (funcgrad's all-reduces of the Gramian or the gradients and of the weights,
and FSDP2's all-gathers and reduce-scatters, which it calls as ``dist.all_gather_single``
and ``dist.reduce_scatter_single``), measured on every timed step. Computed: DDP's reducer
all-reduces the P parameter gradients in C++, unseen by the wrappers, so its rows add
2 (R-1)/R P from the parameter count. Not counted: funcgrad's agreement on the call's facts
(``all_gather_object``: a few hundred bytes of pickled metadata per call).
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

import funcgrad

from ._cases import Encoder, _mtl_heads
from .ranks import WORLD, gloo_group, spawn_ranks

DDP_METHODS = ("plain DDP sum(losses)", "funcgrad backward features", "funcgrad backward params")
FSDP_METHODS = (
    "plain FSDP sum(losses)",
    "funcgrad backward FSDP features",
    "funcgrad backward FSDP params",
)
METHODS = DDP_METHODS + FSDP_METHODS
# Each FSDP method is checked against the DDP method that computes the same update.
SAME_AS = dict(zip(FSDP_METHODS, DDP_METHODS, strict=True))
TOLERANCE = 1e-5  # max |FSDP - DDP| / max |DDP|, per parameter: float32 sums in another order
MISSING_TORCHJD = 'needs TorchJD: pip install -e ".[mtl]" (from the source tree)'


# Bytes each rank sends, by the function called: (the measured argument's position and
# keyword, its bytes' factor). Ring over R ranks: all-reduce 2 (R-1)/R B; all-gather and
# reduce-scatter (R-1)/R B, i.e. times the input of a gather, the output of a scatter.
SENT: dict[str, tuple[int, str, float]] = {
    "all_reduce": (0, "tensor", 2 * (WORLD - 1) / WORLD),
    "broadcast": (0, "tensor", 1.0),
    "all_gather": (1, "tensor", WORLD - 1),  # (list of R outputs, input)
    "all_gather_single": (1, "input_tensor", WORLD - 1),  # (output, input): FSDP2's
    "all_gather_into_tensor": (1, "input_tensor", WORLD - 1),
    "reduce_scatter_single": (0, "output", WORLD - 1),  # (output, input): FSDP2's
    "reduce_scatter_tensor": (0, "output", WORLD - 1),
}
REDUCER = "DDP reducer all_reduce"  # not seen from Python: computed from the parameter count
# Under the report's table, when the ddp case ran.
NOTE = (
    f"ddp: {WORLD} gloo ranks; MiB sent per rank per step, for a ring algorithm over R = {WORLD} "
    "ranks (all-reduce 2 (R-1)/R of the buffer, all-gather and reduce-scatter (R-1)/R of the "
    "full buffer, broadcast the buffer): *counted* by wrapping `torch.distributed`'s Python "
    "functions (funcgrad's all-reduce and broadcast, FSDP2's `all_gather_single` and "
    "`reduce_scatter_single`) on every timed step; DDP's reducer all-reduce (C++) *from P*, "
    "the parameter count. Each FSDP method's gradients after one step (`full_tensor()`) are "
    "checked against its DDP twin's `.grad`; its x base is against plain DDP, and the name "
    "also gives x plain FSDP."
)


def _counting(counter: dict[str, int]) -> None:
    """Count the bytes each rank sends in the collectives called through
    ``torch.distributed``'s Python functions (funcgrad's own, and FSDP2's all-gathers and
    reduce-scatters), by op: see the module's docstring. Each function is replaced on the
    ``torch.distributed`` module, where funcgrad and FSDP2 look it up at each call."""
    for name, (position, keyword, factor) in SENT.items():
        original = getattr(dist, name)

        def counted(
            *args: Any,
            _original: Callable[..., Any] = original,
            _name: str = name,
            _at: tuple[int, str, float] = (position, keyword, factor),
            **kwargs: Any,
        ) -> Any:
            tensor = args[_at[0]] if len(args) > _at[0] else kwargs[_at[1]]
            sent = round(_at[2] * tensor.numel() * tensor.element_size())
            counter[_name] = counter.get(_name, 0) + sent
            return _original(*args, **kwargs)

        setattr(dist, name, counted)


def _worker(rank: int, store: str, k: int, quick: bool, rounds: int, out: str) -> None:
    torch.set_num_threads(1)
    with gloo_group(120, init_method=f"file://{store}", rank=rank, world_size=WORLD):
        _run(rank, k, quick, rounds, out)


def _fully_shard(encoder: torch.nn.Module) -> torch.nn.Module:
    """FSDP2 over both ranks: each submodule with parameters (the Linears), then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    for part in list(encoder.modules())[1:]:
        if any(True for _ in part.parameters(recurse=False)):
            fully_shard(part, mesh=mesh)
    fully_shard(encoder, mesh=mesh)
    return encoder


def _disagreement(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """The largest |got - want| / max |want| over the parameters (a relative error per
    parameter, so that a small layer's error is not hidden by a large one's scale)."""
    worst = 0.0
    for g, w in zip(got, want, strict=True):
        scale = w.abs().max().item() or 1.0
        worst = max(worst, (g - w).abs().max().item() / scale)
    return worst


def _run(rank: int, k: int, quick: bool, rounds: int, out: str) -> None:
    import copy

    from torchjd.aggregation import UPGradWeighting

    counter: dict[str, int] = {}
    _counting(counter)
    widths, batch = ((64, 128, 128, 64), 32) if quick else ((512, 1024, 1024, 512), 128)
    torch.manual_seed(0)
    encoder = Encoder(widths)  # type: ignore[no-untyped-call]
    # A separate instance for FSDP (fully_shard changes its class, DDP keeps its own), from
    # the same initial weights.
    fsdp = _fully_shard(copy.deepcopy(encoder))
    ddp = torch.nn.parallel.DistributedDataParallel(encoder)
    heads = _mtl_heads(k, widths[-1], batch)
    inputs = torch.randn(batch, widths[0]) + rank
    shared = list(encoder.parameters())
    sharded = list(fsdp.parameters())  # the DTensor shards (every Linear is wrapped)
    p_bytes = sum(p.numel() * p.element_size() for p in shared)
    reducer = round(SENT["all_reduce"][2] * p_bytes)  # DDP's all-reduce of the P gradients

    def step(method: str) -> None:
        on_fsdp = method in FSDP_METHODS
        for p in sharded if on_fsdp else shared:
            p.grad = None
        module: torch.nn.Module = fsdp if on_fsdp else ddp
        features = module(inputs)
        losses = [h(features) for h in heads]
        if method in (DDP_METHODS[0], FSDP_METHODS[0]):
            torch.autograd.backward(torch.stack(losses).sum())
        else:
            level: Literal["params", "features"] = (
                "params" if method.endswith("params") else "features"
            )
            funcgrad.backward(
                losses,
                through=features,
                weighting=UPGradWeighting(),
                level=level,
                process_group=module,
            )

    grads: dict[str, list[torch.Tensor]] = {}
    for method in METHODS:  # warm-up (FSDP's lazy init), and the gradients of one step
        step(method)
        if method in FSDP_METHODS:  # (an all-gather on every rank, in the same order)
            grads[method] = [p.grad.full_tensor() for p in sharded]  # type: ignore[union-attr]
        else:
            grads[method] = [p.grad.clone() for p in shared]  # type: ignore[union-attr]
    errors = {m: _disagreement(grads[m], grads[SAME_AS[m]]) for m in FSDP_METHODS}
    samples: dict[str, list[float]] = {m: [] for m in METHODS}
    sent: dict[str, list[dict[str, int]]] = {m: [] for m in METHODS}
    for r in range(rounds):
        order = METHODS[r % len(METHODS) :] + METHODS[: r % len(METHODS)]
        for method in order:
            dist.barrier()
            counter.clear()
            start = time.perf_counter()
            step(method)
            samples[method].append(time.perf_counter() - start)
            ops = dict(counter)
            if method in DDP_METHODS:
                ops[REDUCER] = reducer
            sent[method].append(ops)
    # Every FSDP step all-gathers every parameter at least once (the forward): if the wrappers
    # saw less, FSDP called its collectives some other way (another torch), and its bytes
    # are undercounted: said, not hidden.
    gathered = {m: sum(b for op, b in sent[m][-1].items() if "gather" in op) for m in FSDP_METHODS}
    unseen = [m for m, b in gathered.items() if b < (WORLD - 1) / WORLD * p_bytes]
    if rank == 0:
        n = sum(p.numel() for p in shared)
        result = {"samples": samples, "bytes": sent, "n": n, "errors": errors, "unseen": unseen}
        Path(out).write_text(json.dumps(result))


def _bytes(steps: list[dict[str, int]]) -> dict[str, Any]:
    """The bytes a rank sent per step (every timed step's, which should all be equal), by op,
    and how they were obtained."""
    totals = [sum(ops.values()) for ops in steps]
    ops = steps[-1]
    how = ["counted"] if any(op != REDUCER for op in ops) else []
    how += ["DDP all-reduce from P"] if REDUCER in ops else []
    stats: dict[str, Any] = {
        "bytes_per_rank": statistics.median(totals),
        "bytes_by_op": ops,
        "bytes_how": " + ".join(how) or "nothing sent",
    }
    if min(totals) != max(totals):
        stats["bytes_range"] = [min(totals), max(totals)]
    return stats


def ddp_entry(k: int, quick: bool, rounds: int) -> dict[str, Any]:
    """The report entry of the ``ddp k=...`` case (run in 2 spawned ranks), or, without
    TorchJD, an entry that says it was skipped (one line on stderr, nothing spawned).

    ``agreement`` holds a verdict for each FSDP method against its DDP twin ("ok" within
    float32 tolerance); ``agreement_detail`` the largest relative error."""
    entry: dict[str, Any] = {"name": "ddp", "k": k, "m": 0, "auto": "", "rounds": rounds}
    entry |= {"agreement": {}, "skipped": {}, "baseline": DDP_METHODS[0]}
    entry |= {"fsdp_baseline": FSDP_METHODS[0], "world": WORLD}
    if importlib.util.find_spec("torchjd") is None:
        print(f"bench: skipping ddp k={k}: it {MISSING_TORCHJD}", file=sys.stderr)
        return entry | {"n": 0, "methods": {}, "skipped": {"all": MISSING_TORCHJD}}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "ddp.json")
        spawn_ranks(_worker, os.path.join(tmp, "store"), k, quick, rounds, out)
        result = json.loads(Path(out).read_text())
    methods = {
        m: {"median": statistics.median(s), "min": min(s), "max": max(s), "samples": s}
        | _bytes(result["bytes"][m])
        for m, s in result["samples"].items()
    }
    for m in result["unseen"]:
        methods[m]["bytes_how"] = "UNDERCOUNTED: FSDP's collectives not seen by the wrappers"
        print(f"bench: ddp k={k}: {m}: {methods[m]['bytes_how']}", file=sys.stderr)
    agreement, detail = {}, {}
    for m, error in result["errors"].items():
        agreement[m] = "ok" if error < TOLERANCE else f"DISAGREES (max rel. error {error:.2e})"
        detail[m] = f"vs {SAME_AS[m]}: max rel. error {error:.1e}"
    return entry | {
        "n": result["n"],
        "methods": methods,
        "agreement": agreement,
        "agreement_detail": detail,
    }
