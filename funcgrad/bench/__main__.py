"""``python -m funcgrad.bench``: funcgrad against the alternatives, side by side.

Every method runs the whole job (f's forward included) and must agree with the naive loop
first (a disagreement fails the run, except an expected one: a named third-party method's
known bug for named versions of it, listed apart; the run fails where it agrees). Then the
methods are timed in interleaved rounds (the order rotates every round), so that a slow
moment of a shared machine hits all of them alike; each sample repeats the call until it
lasts about 25 ms (as timeit's autorange does); in a full run the methods within 2x of the
fastest then get twice as many more rounds; figures are medians and ratios within one run.
Peak memory is measured per method in a fresh subprocess: RSS high-water above the baseline
on the CPU, ``torch.cuda.max_memory_allocated`` above the baseline with ``--device cuda``.

With ``--device cuda`` every tensor and module is placed with ``.to(device)`` (never
``torch.set_default_device``, whose TorchFunctionMode taxes every torch call), and each
sample is bracketed by ``torch.cuda.synchronize()``. The ``overhead`` case times every entry
point on a tiny problem (one thread) against the batched recipe an expert writes by hand,
with the host reads of one steady-state call (``funcgrad.HostReadCounter``).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import itertools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optree
import torch
from tqdm.auto import tqdm

import funcgrad

from . import _planner
from ._attribution import CELLS as ATTRIBUTION_CELLS
from ._attribution import TARGETS as ATTRIBUTION_TARGETS
from ._attribution import attribution_case
from ._cases import BUILDERS as STANDARD_BUILDERS
from ._cases import HEAD_COUNTS, Case, SkipCase, device, set_device
from ._ddp import NOTE as DDP_NOTE
from ._ddp import ddp_entry
from ._overhead import names as overhead_names
from ._overhead import overhead_case
from ._per_example import CELLS as PER_EXAMPLE_CELLS
from ._per_example import MEMORY_TARGETS as PER_EXAMPLE_MEMORY_TARGETS
from ._per_example import TARGETS as PER_EXAMPLE_TARGETS
from ._per_example import per_example_case
from ._projector import CELLS as PROJECTOR_CELLS
from ._projector import TARGETS as PROJECTOR_TARGETS
from ._projector import projector_case
from ._real_model import real_model_case
from ._real_stacks import CELLS as REAL_STACKS_CELLS
from ._real_stacks import FASTER_OF, TARGET, real_stacks_case
from ._real_stacks import TARGETS as REAL_STACKS_TARGETS

# A builder makes the case of one cell: (k, quick), or (k, quick, variant) for the cases
# with several functions or settings.
BUILDERS: dict[str, Callable[..., Case]] = {
    **STANDARD_BUILDERS,
    "real-model": real_model_case,
    "real-stacks": real_stacks_case,
    "overhead": overhead_case,
    "per-example": per_example_case,
    "attribution": attribution_case,
    "projector": projector_case,
}
# Not in a default run: the planner's grid (funcgrad against itself), the chunk-memory
# case (gigabytes at full size: a GPU check), per-example (minutes at B = 512) and
# attribution (captum's loop: minutes; docs/benchmarks_attribution.md).
NOT_BY_DEFAULT = ("planner", "chunk-memory", "per-example", "attribution", "projector")
_PLANNER_NOTE = (
    "Per cell: a fresh `compose_heads` per method on a new signature, the methods taking their "
    "calls in turn (Python's garbage collector off, as timeit), each call number's time its "
    "fastest over the reps; **regret** = auto's "
    f"median over calls {_planner.CALLS + 1}-{_planner.CALLS + _planner.STEADY} over the best "
    "fixed strategy's (**(all calls)**: the median of every such call, rep by rep); "
    f"**first 8 ratio** = auto's calls 1-{_planner.CALLS} summed over the best fixed "
    "strategy's; **plan ms** = a fresh function's `plan()`, **plan forwards** = that over one "
    "eager forward of f. A fixed strategy that falls back, or is 2.5x slower than the fastest "
    "on a warm call, is not timed."
)
REAL_MODEL_CELLS = {mode: [("eager", 4), ("sdpa", 4)] for mode in ("full", "quick")}

DDP_HEAD_COUNTS = {"full": (8,), "quick": (2,)}

# Targets from the performance issue: (case label, method, baseline, limit); a tuple of
# baselines: the fastest of those measured.
TARGETS = [
    ("seed k=8", "funcgrad auto", "one f fwd+bwd", 1.2),
    ("seed k=8", "funcgrad auto", "naive", 0.2),
    ("mtl k=8", "funcgrad auto", "naive", 0.9),
    ("mtl k=8", "funcgrad auto", "torchjd jac", 0.9),
    ("probes k=512", "funcgrad auto", "torch.func vjp+vmap", 0.40),
    ("bridge k=4", "funcgrad.grads", "naive", 0.35),
    ("mtl-weighting k=8", "funcgrad backward features", "sum(losses) fwd+bwd", 1.25),
    ("mtl-weighting k=8", "funcgrad backward features", "torchjd mtl_backward+jac_to_grad", 0.3),
    ("mtl-weighting k=8", "funcgrad backward params", "torchjd mtl_backward+jac_to_grad", 0.85),
    ("mtl-weighting k=32", "funcgrad backward params", "torchjd mtl_backward+jac_to_grad", 0.5),
    *PER_EXAMPLE_TARGETS,
    *REAL_STACKS_TARGETS,
    *ATTRIBUTION_TARGETS,
    *PROJECTOR_TARGETS,
]
OVERHEAD_TARGETS = [
    (f"overhead {name} k=8", "funcgrad", "recipe", 1.2) for name in overhead_names()
]
# On a GPU (issue 28), where a call costs what the host does: --device cuda.
CUDA_TARGETS = [
    ("seed k=8", "funcgrad auto", "one f fwd+bwd", 1.3),
    ("mtl-weighting k=8", "funcgrad backward features", "sum(losses) fwd+bwd", 1.3),
    ("mtl-weighting k=8", "funcgrad backward params", "torchjd mtl_backward+jac_to_grad", 1.0),
    ("probes k=512", "funcgrad auto", "torch.func vjp+vmap", 1.05),
    *OVERHEAD_TARGETS,
]
# Host reads of one steady-state call, per overhead cell (issue 28).
HOST_READS_TARGET = 1
# chunk_size="auto" peaks within this many budgets plus the answer.
CHUNK_MEMORY_TARGET = 1.5
# Peak-memory targets: (case label, method, baseline, limit).
MEMORY_TARGETS = [
    ("mtl-weighting k=8", "funcgrad backward features", "sum(losses) fwd+bwd", 1.2),
    *PER_EXAMPLE_MEMORY_TARGETS,
]


def _cells(name: str, mode: str) -> list[tuple[str, int]]:
    """(variant, k) of every cell of a case; variant "" for the cases with one function."""
    if name == "real-model":
        return REAL_MODEL_CELLS[mode]
    if name == "real-stacks":
        return REAL_STACKS_CELLS[mode]
    if name == "per-example":
        return PER_EXAMPLE_CELLS[mode]
    if name == "attribution":
        return ATTRIBUTION_CELLS[mode]
    if name == "projector":
        return PROJECTOR_CELLS[mode]
    if name == "overhead":
        return [(entry, 8) for entry in overhead_names()]
    return [("", k) for k in HEAD_COUNTS[name][mode]]


def _build(name: str, k: int, quick: bool, variant: str) -> Case:
    return BUILDERS[name](k, quick, variant) if variant else BUILDERS[name](k, quick)


def _leaves(result: Any) -> list[torch.Tensor]:
    return optree.tree_leaves(result)


# Each leaf's error is relative to its own largest entry, but at least this fraction of the
# largest entry of all the reference's leaves: a gradient that is exactly zero in exact
# arithmetic (a BERT key bias: softmax ignores a shift of the logits) is rounding noise, and
# is checked against the scale of the others (to 1e-6 of it) instead of its own.
SCALE_FLOOR = 1e-3


def _agreement(case: Case, results: dict[str, Any]) -> dict[str, str]:
    verdicts = {}
    references = set(case.reference_for.values())
    for name, result in results.items():
        if name in case.reference_only or name in references:
            continue
        wanted = case.reference_for.get(name, "naive")
        if wanted not in results:
            verdicts[name] = f"not checked: its reference {wanted!r} errored"
            continue
        reference = _leaves(results[wanted])
        leaves = _leaves(result)
        overall = max((want.abs().max().item() for want in reference if want.numel()), default=0)
        worst = 0.0
        for got, want in zip(leaves, reference, strict=True):
            if not want.numel():
                continue
            scale = max(want.abs().max().item(), SCALE_FLOOR * overall) or 1.0
            worst = max(worst, (got - want).abs().max().item() / scale)
        verdicts[name] = "ok" if worst < 1e-3 else f"DISAGREES (max rel. error {worst:.2e})"
    return verdicts


def _release(version: str) -> tuple[int, ...]:
    """The leading numbers of a version string ("0.18.1rc1" -> (0, 18, 1))."""
    numbers = []
    for part in version.split("."):
        digits = "".join(itertools.takewhile(str.isdigit, part))
        if not digits:
            break
        numbers.append(int(digits))
        if len(digits) < len(part):
            break
    return tuple(numbers)


def _installed(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _classify(
    label: str,
    agreement: dict[str, str],
    expected: dict[str, dict[str, str]],
    installed: Callable[[str], str | None] = _installed,
) -> tuple[list[str], list[str]]:
    """The case's disagreements that fail the run, and those expected (listed, not counted).

    ``expected`` names a third-party method (never one of funcgrad's) whose disagreement is
    that package's bug: {method: {"package", "from", "below", "reason"}}, for installed
    versions in [from, below). Such a method's DISAGREES verdict is expected; its "ok" there
    fails the run ("now agrees: remove the note"), so that the note cannot go stale. Outside
    that range, or with the package absent, the method is checked as any other; so is every
    verdict that is neither "ok" nor DISAGREES (an unchecked reference)."""
    failing, listed = [], []
    for method, verdict in agreement.items():
        note = expected.get(method)
        if note is not None:
            if method.startswith("funcgrad"):
                raise ValueError(
                    f"{label}: {method}: funcgrad's own rows cannot be expected to disagree"
                )
            version = installed(note["package"])
            if version is not None and (
                _release(note["from"]) <= _release(version) < _release(note["below"])
            ):
                where = (
                    f"{note['package']} {version} (expected for >={note['from']},<{note['below']})"
                )
                if verdict.startswith("DISAGREES"):
                    listed.append(f"{label}: {method}: {verdict}, {where}: {note['reason']}")
                    continue
                if verdict == "ok":
                    failing.append(
                        f"{label}: {method}: now agrees, remove the note: {where} was expected "
                        f"to disagree ({note['reason']})"
                    )
                    continue
        if verdict != "ok":
            failing.append(f"{label}: {method}: {verdict}")
    return failing, listed


def _finish() -> None:
    """Wait for queued GPU work, so that a method's time is its own."""
    if device().type == "cuda":
        torch.cuda.synchronize(device())


# A sample repeats a call until it lasts about this long (as timeit's autorange does): a
# single call of a few ms is at the mercy of the scheduler on a shared machine.
SAMPLE_S = 0.025


def _calls_per_sample(call: Any) -> int:
    start = time.perf_counter()
    call()
    _finish()
    return max(1, math.ceil(SAMPLE_S / max(time.perf_counter() - start, 1e-6)))


def _time_case(case: Case, rounds: int, only: list[str] | None = None) -> dict[str, list[float]]:
    """Seconds a call, per method and round (each sample the mean of enough calls to last
    about ``SAMPLE_S``), the methods (those of ``only``, if given) interleaved in an order
    that rotates every round."""
    names = [name for name in case.methods if name not in case.untimed]
    names = names if only is None else [name for name in names if name in only]
    samples: dict[str, list[float]] = {name: [] for name in names}
    if not names:  # every method was dropped or skipped: nothing to time
        return samples
    number = {name: _calls_per_sample(case.methods[name]) for name in names}
    with tqdm(
        total=rounds * len(names), desc=f"timing {case.label}", leave=False, disable=None
    ) as bar:
        for r in range(rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                _finish()  # the sample starts with no earlier work queued
                start = time.perf_counter()
                for _ in range(number[name]):
                    case.methods[name]()
                _finish()
                samples[name].append((time.perf_counter() - start) / number[name])
                bar.update()
    return samples


def _peak_memory_child(
    case_name: str, k: int, quick: bool, method: str, threads: int, device: str, variant: str
) -> None:
    """In a fresh process: run the method once to warm up, reset the peak, run it again."""
    torch.set_num_threads(threads)
    set_device(device)
    case = _build(case_name, k, quick, variant)
    fn = case.methods[method]
    fn()
    _finish()
    if device.startswith("cuda"):  # allocated memory above the baseline, on the GPU
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        _finish()
        peak_kib = (torch.cuda.max_memory_allocated() - base) // 1024
    else:  # RSS high-water above the baseline
        with open("/proc/self/clear_refs", "w") as handle:  # resets VmHWM, the peak RSS
            handle.write("5")
        base = _status_kib("VmRSS")
        fn()
        peak_kib = _status_kib("VmHWM") - base
    print(json.dumps({"peak_kib": peak_kib}))


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _peak_memory(case: Case, quick: bool, threads: int, device: str) -> dict[str, float | None]:
    if not device.startswith("cuda") and not os.path.exists("/proc/self/clear_refs"):
        return {}
    peaks: dict[str, float | None] = {}
    # A fixed mmap threshold keeps glibc's heap from holding freed memory, so that RSS
    # follows the live tensors.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    names = [name for name in case.methods if name not in case.untimed]
    for name in tqdm(names, desc=f"memory {case.label}", leave=False, disable=None):
        command = [
            sys.executable,
            "-m",
            "funcgrad.bench",
            "--_memory-child",
            case.name,
            str(case.k),
            "quick" if quick else "full",
            name,
            str(threads),
            device,
            case.variant,
        ]
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
        lines = done.stdout.strip().splitlines()
        peaks[name] = (
            json.loads(lines[-1])["peak_kib"] / 1024 if done.returncode == 0 and lines else None
        )
    return peaks


# A warm-up round over SLOW_ROUND_S gets 3 timed rounds. In a full run, the contenders (each
# method within CONTENDER_RATIO of the fastest median) then get MORE_ROUNDS x as many more: a
# median of 21 samples is not moved by the few that a stall of a shared machine makes several
# times slower, and a method several times slower than the fastest changes no ratio to it.
SLOW_ROUND_S, CONTENDER_RATIO, MORE_ROUNDS = 10.0, 2.0, 2


def _contenders(samples: dict[str, list[float]]) -> list[str]:
    medians = {name: statistics.median(times) for name, times in samples.items()}
    fastest = min(medians.values(), default=0.0)
    return [name for name, median in medians.items() if median <= CONTENDER_RATIO * fastest]


def _run_case(case: Case, args: argparse.Namespace, rounds: int, report: dict[str, Any]) -> Any:
    """Warm up and check agreement (every method once), time, read the plans, and measure
    peak memory: the case's report entry."""
    results: dict[str, Any] = {}
    first_call: dict[str, float] = {}
    start = time.perf_counter()
    errors: dict[str, str] = {}
    for method, fn in list(case.methods.items()):  # warm-up, and the agreement check
        try:
            if not case.drop_on_warning:
                results[method] = _first_call(fn, first_call, method)
                continue
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", funcgrad.FuncgradWarning)
                results[method] = _first_call(fn, first_call, method)
        except Exception as error:  # an error cell in the report, not a crash of the run
            del case.methods[method]
            errors[method] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
            continue
        fallbacks = [w for w in caught if issubclass(w.category, funcgrad.FuncgradWarning)]
        for other in caught:  # the rest as they would have been
            if other not in fallbacks:
                warnings.warn_explicit(other.message, other.category, other.filename, other.lineno)
        if fallbacks:  # it did not run as asked: not timed
            del case.methods[method], results[method], first_call[method]
            case.skipped[method] = f"does not run as asked: {fallbacks[0].message}"
    slow = time.perf_counter() - start > SLOW_ROUND_S
    case_rounds = args.rounds or (3 if slow else rounds)
    agreement = _agreement(case, results)
    failing, listed = _classify(case.label, agreement, case.extra.get("expected_disagreements", {}))
    report["disagreements"] += failing
    report.setdefault("expected_disagreements", []).extend(listed)
    report.setdefault("errors", []).extend(f"{case.label}: {m}: {e}" for m, e in errors.items())
    reads = _host_reads(case) if case.count_reads else None
    threads = torch.get_num_threads()
    torch.set_num_threads(case.threads or threads)
    try:
        samples = _time_case(case, case_rounds)
        contenders = [] if args.quick or args.rounds else _contenders(samples)
        more_rounds = MORE_ROUNDS * case_rounds if len(contenders) > 1 else 0
        if more_rounds:
            for name, times in _time_case(case, more_rounds, contenders).items():
                samples[name] += times
    finally:
        torch.set_num_threads(threads)
    # (after the timed rounds: auto's plan read after the warm-up is call 2's challenger)
    plans = {
        method: _plan_record(plan()) for method, plan in case.plans.items() if method not in errors
    }
    entry = {
        "name": case.name,
        "variant": case.variant,
        "k": case.k,
        "m": case.m,
        "n": case.n,
        "auto": case.auto,
        "baseline": case.baseline,
        "methods": {
            m: {**_summary(s), "first_call": first_call[m], "samples": s}
            for m, s in samples.items()
        },
        "rounds": case_rounds,
        "more_rounds": {"rounds": more_rounds, "methods": contenders} if more_rounds else None,
        "agreement": agreement,
        "errors": errors,
        "skipped": case.skipped,
        "untimed": list(case.untimed),
        "plans": plans,
        "threads": case.threads or threads,
        **case.extra,
    }
    if reads is not None:
        entry["host_reads"] = reads
    # Quick runs measure memory on the seed and chunk-memory only: each method is a fresh
    # process.
    if (
        not args.no_memory
        and case.memory
        and (not args.quick or case.label == "seed k=8" or case.name == "chunk-memory")
    ):
        entry["peak_mib"] = _peak_memory(case, args.quick, args.threads, args.device)
    return entry


def _host_reads(case: Case) -> dict[str, dict[str, Any]]:
    """The host reads of one more call of each method (after its warm-up call): how many,
    and where (the first frame outside torch of each)."""
    reads = {}
    for name, fn in case.methods.items():
        with funcgrad.HostReadCounter() as counter:
            fn()
        _finish()
        reads[name] = {"count": counter.count, "where": [str(read) for read in counter.reads]}
    return reads


def _first_call(fn: Callable[[], Any], times: dict[str, float], name: str) -> Any:
    """The method's first (warm-up) call, its time in ``times``: under auto it includes
    the plan's one-off costs (y's size on fake tensors, vmap timed against a loop)."""
    start = time.perf_counter()
    result = fn()
    _finish()
    times[name] = time.perf_counter() - start
    return result


def _plan_record(plan: funcgrad.Plan) -> dict[str, Any]:
    return {
        "strategy": plan.strategy,
        "directions": plan.directions,
        "passes": plan.passes,
        "chunk_size": plan.chunk_size,
        "measure": plan.measure,
        "measured": plan.measured,
        "engine": plan.engine,
        "final": plan.final,
        "repr": repr(plan),
    }


def _summary(samples: list[float]) -> dict[str, float]:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples)}


def _evaluate_targets(
    entries: dict[str, dict[str, Any]], device: str = "cpu"
) -> list[dict[str, Any]]:
    verdicts = []
    targets = CUDA_TARGETS if device.startswith("cuda") else [*TARGETS, *OVERHEAD_TARGETS]
    for label, method, baseline, limit in targets:
        entry = entries.get(label)
        if entry is None:
            continue
        times = entry["methods"]
        baselines = (baseline,) if isinstance(baseline, str) else baseline
        named = baseline if isinstance(baseline, str) else f"the faster of {', '.join(baseline)}"
        measured = [times[b]["median"] for b in baselines if b in times]
        if method not in times or not measured:
            verdicts.append(
                {
                    "case": label,
                    "target": f"{method} <= {limit} x {named}",
                    "ratio": None,
                    "met": None,
                    "why": f"{named} not measured",
                }
            )
            continue
        ratio = times[method]["median"] / min(measured)
        verdicts.append(
            {
                "case": label,
                "target": f"{method} <= {limit} x {named}",
                "ratio": ratio,
                "met": ratio <= limit,
            }
        )
    for label, method, baseline, limit in MEMORY_TARGETS:
        peaks = (entries.get(label) or {}).get("peak_mib") or {}
        if peaks.get(method) is not None and peaks.get(baseline) is not None:
            verdicts.append(
                {
                    "case": label,
                    "target": f"{method} peak memory <= {limit} x {baseline}'s",
                    "ratio": peaks[method] / max(peaks[baseline], 1e-9),
                    "met": peaks[method] <= limit * peaks[baseline] + 1.0,
                }
            )
    for label, entry in entries.items():
        reads = (entry.get("host_reads") or {}).get("funcgrad")
        if reads is not None:
            verdicts.append(
                {
                    "case": label,
                    "target": f"funcgrad host reads per call <= {HOST_READS_TARGET}",
                    "ratio": reads["count"],
                    "met": reads["count"] <= HOST_READS_TARGET,
                }
            )
        chunk = entry.get("chunk_memory")
        peak = (entry.get("peak_mib") or {}).get(chunk["method"]) if chunk else None
        if chunk and peak is not None:
            verdicts.append(
                {
                    "case": label,
                    "target": f"{chunk['method']}: peak <= {CHUNK_MEMORY_TARGET} x budget + "
                    f"the answer ({chunk['answer_mib']:.1f} MiB); ratio: peak / budget",
                    "ratio": peak / chunk["budget_mib"],
                    "met": peak <= CHUNK_MEMORY_TARGET * chunk["budget_mib"] + chunk["answer_mib"],
                }
            )
    for label, entry in entries.items():
        peaks = entry.get("peak_mib") or {}
        naive = peaks.get("naive")
        for method in ("funcgrad auto", "funcgrad.grads"):
            if peaks.get(method) is not None and naive is not None:
                slack = max(1.0, 0.05 * naive)  # RSS is counted in pages: a few MiB of noise
                verdicts.append(
                    {
                        "case": label,
                        "target": f"{method} peak memory <= naive's",
                        "ratio": peaks[method] / max(naive, 1e-9),
                        "met": peaks[method] <= naive + slack,
                    }
                )
    return verdicts


def _markdown(report: dict[str, Any]) -> str:
    lines = [
        f"# funcgrad benchmarks ({'quick' if report['quick'] else 'full'} run)",
        "",
        f"{report['machine']}; torch {report['versions']['torch']}, {report['threads']} threads; "
        f"{report['rounds']} interleaved rounds"
        + (
            ""
            if report.get("rounds_fixed")
            else " (3 for cases slower than 10 s a round"
            + (
                ""
                if report["quick"]
                else "; then twice as many more for the methods within 2x of the fastest median"
            )
            + ")"
        )
        + ", each "
        "sample the mean of enough calls to last ~25 ms (ddp: one step a sample), medians. "
        "Ratios (x base) are against the case's baseline in the same run: `naive` "
        "(k x `torch.autograd.grad(..., retain_graph=True)`)"
        + "".join(
            f"; for {name}, `{base}`"
            for name, base in {
                e["name"]: e.get("baseline", "naive")
                for e in report["cases"].values()
                if e.get("baseline", "naive") != "naive"
            }.items()
        )
        + ".",
        "",
        "| case | method | median ms | min-max ms | x base | peak MiB | agrees |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for label, entry in report["cases"].items():
        if entry["name"] in ("overhead", "real-stacks"):
            continue  # their own tables below
        methods = entry["methods"]  # empty when the whole case was skipped
        # None when the whole case was skipped, or its baseline raised
        naive = (methods.get(entry.get("baseline", "naive")) or {}).get("median")
        for name, stats in methods.items():
            peak = (entry.get("peak_mib") or {}).get(name)
            shown = f"{name} ({entry['auto']})" if name == "funcgrad auto" else name
            if "bytes_per_rank" in stats:  # the ddp case: see DDP_NOTE
                shown += (
                    f", {stats['bytes_per_rank'] / 2**20:.2f} MiB sent per rank "
                    f"({stats.get('bytes_how', 'DDP all-reduce from P')})"
                )
                fsdp = methods.get(entry.get("fsdp_baseline", ""))
                if fsdp is not None and "FSDP" in name:
                    shown += f", {stats['median'] / fsdp['median']:.3f} x plain FSDP"
            cells = [
                label,
                shown,
                f"{stats['median'] * 1e3:.2f}",
                f"{stats['min'] * 1e3:.2f}-{stats['max'] * 1e3:.2f}",
                "—" if naive is None else f"{stats['median'] / naive:.3f}",
                "" if peak is None else f"{peak:.1f}",
                entry["agreement"].get(
                    name,
                    "tested in tests/test_distributed.py"
                    if entry["name"] == "ddp"
                    else "reference",
                )
                + (
                    f" ({entry['agreement_detail'][name]})"
                    if name in entry.get("agreement_detail", {})
                    else ""
                ),
            ]
            lines.append("| " + " | ".join(cells) + " |")
        for name, why in entry["skipped"].items():
            lines.append(f"| {label} | {name} | skipped: {why} | | | | |")
        for name, error in (entry.get("errors") or {}).items():
            lines.append(f"| {label} | {name} | error: {error} | | | | |")
    if any(e["name"] == "ddp" and e.get("methods") for e in report["cases"].values()):
        lines += ["", DDP_NOTE]
    plans = [
        f"- {label}, {method}: `{plan['repr']}`"
        for label, entry in report["cases"].items()
        for method, plan in (entry.get("plans") or {}).items()
    ]
    if plans:
        lines += ["", "Plans (`fn.plan(...)` after the timed rounds):", "", *plans]
    if report.get("planner"):
        lines += ["", "## Planner: auto's learning", "", _PLANNER_NOTE, ""]
        lines += _planner.markdown(report["planner"])
    lines += _overhead_markdown(report["cases"])
    lines += _real_stacks_markdown(report["cases"])
    lines += ["", "## Targets", "", "| case | target | ratio | met |", "|---|---|---:|---|"]
    for t in report["targets"]:
        ratio = "" if t["ratio"] is None else f"{t['ratio']:.3f}"
        met = {True: "met", False: "MISSED", None: "not measured"}[t["met"]]
        lines.append(f"| {t['case']} | {t['target']} | {ratio} | {met} |")
    return "\n".join(lines) + "\n"


def _overhead_markdown(entries: dict[str, dict[str, Any]]) -> list[str]:
    cells = {label: e for label, e in entries.items() if e["name"] == "overhead"}
    if not cells:
        return []
    threads = {e.get("threads") for e in cells.values()}
    lines = [
        "",
        "## Fixed cost per call (overhead)",
        "",
        "Each entry point on a tiny problem (k=8, float32; its kernels take microseconds, so "
        "the fixed cost per call is all there is), the whole job per call (f's forward "
        "included), against the batched recipe a torch.func expert writes by hand for the "
        f"same answer; {'/'.join(str(t) for t in sorted(threads, key=str))} thread(s), µs per "
        "call (median of the samples, each the mean of enough calls to last ~25 ms). Host "
        "reads: of one steady-state call, counted with `funcgrad.HostReadCounter` "
        "(funcgrad / recipe); where they come from: the JSON's `host_reads`.",
        "",
        "| entry point | recipe | funcgrad µs | recipe µs | ratio | host reads | agrees |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for entry in cells.values():
        methods = entry["methods"]
        if "funcgrad" not in methods or "recipe" not in methods:
            lines.append(f"| {entry['variant']} | skipped: {entry['skipped']} | | | | | |")
            continue
        ours, theirs = methods["funcgrad"]["median"], methods["recipe"]["median"]
        reads = entry.get("host_reads") or {}
        shown = "/".join(str(reads.get(m, {}).get("count", "?")) for m in ("funcgrad", "recipe"))
        lines.append(
            f"| {entry['variant']} | {entry['overhead']['recipe']} | {ours * 1e6:.0f} | "
            f"{theirs * 1e6:.0f} | {ours / theirs:.2f} | {shown} | "
            f"{entry['agreement'].get('funcgrad', '?')} |"
        )
    return lines


def _real_stacks_markdown(entries: dict[str, dict[str, Any]]) -> list[str]:
    cells = {label: e for label, e in entries.items() if e["name"] == "real-stacks"}
    if not cells:
        return []
    methods = ("naive", "loop on f", "funcgrad auto", "torch.func vjp+vmap")
    lines = [
        "",
        "## Real stacks: per-task gradients of a model's parameters",
        "",
        "k task heads on a real model's pooled output, the k gradients w.r.t. its parameters "
        "(docs/benchmarks_real_model.md): `funcgrad.compose_heads` (auto) and raw torch.func "
        "(`vjp`, then `vmap` of the pullback over the heads' cotangents) on "
        "`functional_call`, against the loop a user writes (one eager forward, then "
        "`torch.autograd.grad(loss_i, params, retain_graph=True)` per task), and against "
        "the same loop on f (**loop on f**: `functional_call` costs f more than the module's "
        "own call, so auto / loop on f is funcgrad's own overhead). Median ms; "
        "ratios to the loop; peak MiB in the order loop / loop on f / auto / torch.func; "
        "agrees: each method's answer against the loop's before timing. **auto / faster**: "
        f"auto over the faster of the loop and torch.func (issue 43's target: <= {TARGET}).",
        "",
        "| model | k | loop ms | loop on f ms | auto ms | torch.func ms | loop on f / loop "
        "| auto / loop | torch.func / loop | auto / loop on f | auto / faster | peak MiB "
        "| auto's plan | agrees |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|",
    ]
    notes = []
    for label, entry in cells.items():
        if entry["skipped"].get("all"):
            lines.append(
                f"| {entry['variant']} | {entry['k']} | skipped: {entry['skipped']['all']} "
                "| | | | | | | | | | | |"
            )
            continue
        times = {m: entry["methods"][m]["median"] for m in methods if m in entry["methods"]}
        errors = entry.get("errors") or {}
        shown = [
            f"{times[m] * 1e3:.2f}" if m in times else ("error" if m in errors else "—")
            for m in methods
        ]
        loop = times.get("naive")
        ratios = [f"{times[m] / loop:.2f}" if loop and m in times else "—" for m in methods[1:]]
        on_f = times.get("loop on f")
        ratios.append(
            f"{times['funcgrad auto'] / on_f:.2f}" if on_f and "funcgrad auto" in times else "—"
        )
        faster = min((times[m] for m in FASTER_OF if m in times), default=None)
        if faster and "funcgrad auto" in times:
            ratio = times["funcgrad auto"] / faster
            ratios.append(f"{ratio:.2f}" + f" **>{TARGET}**" * (ratio > TARGET))
        else:
            ratios.append("—")
        peaks = entry.get("peak_mib") or {}
        peak = (
            "/".join("?" if peaks.get(m) is None else f"{peaks[m]:.0f}" for m in methods)
            if peaks
            else ""
        )
        plan = (entry.get("plans") or {}).get("funcgrad auto")
        planned = f"{plan['strategy']}, {plan['passes']} passes" if plan else "—"
        agrees = [
            f"{m}: {entry['agreement'][m]}"
            for m in methods[1:]
            if entry["agreement"].get(m, "ok") != "ok"
        ]
        lines.append(
            f"| {entry['variant']} | {entry['k']} | "
            + " | ".join(shown + ratios)
            + f" | {peak} | {planned} | {'; '.join(agrees) or 'ok'} |"
        )
        notes += [f"- {label}, {m}: {e}" for m, e in errors.items()]
    if notes:
        lines += ["", "Errors (the warm-up call raised; the method was not timed):", "", *notes]
    return lines


def _plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for entry in report["cases"].values():
        name, k = entry["name"], entry["k"]
        if name not in STANDARD_BUILDERS:  # planner, real-model, ddp: their own tables
            continue
        families.setdefault(name, []).append((k, entry))
    families = {n: sorted(v, key=lambda item: item[0]) for n, v in families.items() if len(v) > 1}
    if not families:
        return
    fig, axes = plt.subplots(1, len(families), figsize=(5.5 * len(families), 4), squeeze=False)
    for ax, (name, variants) in zip(axes[0], families.items()):
        methods = [
            m
            for m in variants[0][1]["methods"]
            if m
            in ("naive", "torch.func vjp+vmap", "torchjd jac", "funcgrad auto", "seed chain rule")
        ]
        for method in methods:
            ks = [k for k, e in variants if method in e["methods"]]
            ts = [
                e["methods"][method]["median"] * 1e3 for _, e in variants if method in e["methods"]
            ]
            ax.plot(ks, ts, marker="o", label=method)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("number of heads k")
        ax.set_ylabel("median time per job (ms)")
        ax.set_title(f"{name}: time against the number of heads")
        ax.legend(fontsize=8)
    fig.suptitle(
        f"funcgrad {report['versions']['funcgrad']}, {report['threads']} threads, "
        f"{report['machine']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _cpu_model() -> str:
    """(the model name from /proc/cpuinfo), or "" where there is none."""
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return f" ({line.split(':', 1)[1].strip()})"
    except OSError:
        pass
    return ""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--_memory-child"]:
        case_name, heads, size, method, threads, device, variant = argv[1:8]
        _peak_memory_child(
            case_name, int(heads), size == "quick", method, int(threads), device, variant
        )
        return 0
    parser = argparse.ArgumentParser(
        prog="python -m funcgrad.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="small sizes, few rounds (< 1 min)")
    parser.add_argument(
        "--cases",
        nargs="+",
        choices=[*BUILDERS, "ddp", "planner"],
        default=[name for name in BUILDERS if name not in NOT_BY_DEFAULT] + ["ddp"],
        help="default: all but planner (funcgrad's auto against its own fixed strategies), "
        "chunk-memory (gigabytes: a GPU check) and per-example (IWRM, B = 32/128/512: minutes)",
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        default=None,
        help="only these functions or settings of the cases that have several (planner: "
        "'seed', 'ode n=2', ...; real-model: eager, sdpa; real-stacks: "
        + ", ".join(model for model, _ in REAL_STACKS_CELLS["full"][::2])
        + ")",
    )
    parser.add_argument(
        "--heads",
        nargs="+",
        type=int,
        default=None,
        help="only the cells with these numbers of heads k (e.g. 8 512)",
    )
    parser.add_argument("--out", type=Path, default=Path("bench-results"), help="output folder")
    parser.add_argument("--plot", action="store_true", help="draw time against k (matplotlib)")
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="timed rounds for every method (planner: fresh functions per method, default 4, "
        "quick 2; else default: 7, 3 for cases over 10 s a round, then "
        "twice as many more for the methods within 2x of the fastest; quick: 3)",
    )
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument(
        "--device", default="cpu", help="where the cases live: cpu (default) or cuda"
    )
    parser.add_argument(
        "--no-memory", action="store_true", help="skip the peak-memory subprocesses"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    set_device(args.device)
    rounds = args.rounds or (3 if args.quick else 7)
    mode = "quick" if args.quick else "full"
    versions: dict[str, str | None] = {
        "funcgrad": funcgrad.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    report: dict[str, Any] = {
        "quick": args.quick,
        "rounds": rounds,
        "rounds_fixed": args.rounds is not None,
        "threads": torch.get_num_threads(),
        "device": args.device,
        "machine": f"{platform.machine()} CPU{_cpu_model()}, {os.cpu_count()} cores"
        + (f", {torch.cuda.get_device_name()}" if args.device.startswith("cuda") else ""),
        "versions": versions,
        "cases": {},
        "disagreements": [],
        "expected_disagreements": [],  # a named third-party method's known bug: not counted
        "errors": [],
    }
    try:
        from importlib.metadata import version

        import torchjd  # noqa: F401

        versions["torchjd"] = version("torchjd")
    except ImportError:
        versions["torchjd"] = None
    for name in args.cases:
        if name == "planner":  # funcgrad's auto against its fixed strategies: its own table
            cells = tuple(
                (variant, k)
                for variant, k in _planner.CELLS
                if (not args.variants or variant in args.variants)
                and (not args.heads or k in args.heads)
            )
            reps = args.rounds or (2 if args.quick else 4)
            report["planner"] = _planner.learning(cells, quick=True, reps=reps)
            continue
        if name == "ddp":  # 2 gloo ranks in subprocesses: time per step, bytes per rank
            for k in DDP_HEAD_COUNTS[mode]:
                entry = ddp_entry(k, args.quick, rounds)
                report["cases"][f"ddp k={k}"] = entry
                report["disagreements"] += [
                    f"ddp k={k}: {m}: {v}" for m, v in entry["agreement"].items() if v != "ok"
                ]
            continue
        for variant, k in _cells(name, mode):
            if args.heads and k not in args.heads:
                continue
            if (
                variant
                and args.variants
                and variant.removesuffix(" plan cost") not in args.variants
            ):
                continue
            try:
                case = _build(name, k, args.quick, variant)
            except SkipCase as why:  # a missing extra: one line per case, not per cell
                if not any(e["name"] == name for e in report["cases"].values()):
                    print(f"bench: skipping {name}: {why}", file=sys.stderr)
                label = f"{name} {variant} k={k}" if variant else f"{name} k={k}"
                report["cases"][label] = {
                    "name": name,
                    "variant": variant,
                    "k": k,
                    "methods": {},
                    "agreement": {},
                    "skipped": {"all": str(why)},
                }
                continue
            report["cases"][case.label] = _run_case(case, args, rounds, report)
    report["targets"] = _evaluate_targets(report["cases"], args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(report, indent=2))
    markdown = _markdown(report)
    (args.out / "results.md").write_text(markdown)
    if args.plot:
        _plot(report, args.out / "time_vs_heads.png")
    print(markdown)
    for known in report["expected_disagreements"]:
        print(f"EXPECTED DISAGREEMENT (not counted): {known}")
    for problem in report["disagreements"]:
        print(f"DISAGREEMENT: {problem}")
    for problem in report["errors"]:
        print(f"ERROR: {problem}")
    print(f"wrote {args.out / 'results.json'} and {args.out / 'results.md'}")
    return 1 if report["disagreements"] or report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
