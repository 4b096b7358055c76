"""``python -m funcgrad.bench``: funcgrad against the alternatives, side by side.

Every method runs the whole job (f's forward included) and must agree with the naive
loop first. Then the methods are timed in interleaved rounds (the order rotates every
round), so that a slow moment of a shared machine hits all of them alike; figures are
medians and ratios within one run. Peak memory is measured per method in a fresh
subprocess: RSS high-water above the baseline on the CPU, ``torch.cuda.max_memory_allocated``
above the baseline with ``--device cuda``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import optree
import torch
from tqdm.auto import tqdm

import funcgrad

from ._cases import BUILDERS, HEAD_COUNTS, Case
from ._ddp import ddp_entry

DDP_HEAD_COUNTS = {"full": (8,), "quick": (2,)}

# Targets from the performance issue: (case label, method, baseline, limit).
TARGETS = [
    ("seed k=8", "funcgrad auto", "one f fwd+bwd", 1.2),
    ("seed k=8", "funcgrad auto", "naive", 0.2),
    ("mtl k=8", "funcgrad auto", "naive", 0.8),
    ("mtl k=8", "funcgrad auto", "torchjd jac", 0.9),
    ("probes k=512", "funcgrad auto", "torch.func vjp+vmap", 0.30),
    ("bridge k=4", "funcgrad.grads", "naive", 0.35),
    ("mtl-weighting k=8", "funcgrad backward features", "sum(losses) fwd+bwd", 1.25),
    ("mtl-weighting k=8", "funcgrad backward features", "torchjd mtl_backward+jac_to_grad", 0.3),
    ("mtl-weighting k=8", "funcgrad backward params", "torchjd mtl_backward+jac_to_grad", 0.85),
    ("mtl-weighting k=32", "funcgrad backward params", "torchjd mtl_backward+jac_to_grad", 0.5),
]
# Peak-memory targets: (case label, method, baseline, limit).
MEMORY_TARGETS = [
    ("mtl-weighting k=8", "funcgrad backward features", "sum(losses) fwd+bwd", 1.2),
]


def _leaves(result: Any) -> list[torch.Tensor]:
    return optree.tree_leaves(result)


def _agreement(case: Case, results: dict[str, Any]) -> dict[str, str]:
    verdicts = {}
    references = set(case.reference_for.values())
    for name, result in results.items():
        if name in case.reference_only or name in references:
            continue
        reference = _leaves(results[case.reference_for.get(name, "naive")])
        leaves = _leaves(result)
        worst = 0.0
        for got, want in zip(leaves, reference, strict=True):
            scale = want.abs().max().item() or 1.0
            worst = max(worst, (got - want).abs().max().item() / scale)
        verdicts[name] = "ok" if worst < 1e-3 else f"DISAGREES (max rel. error {worst:.2e})"
    return verdicts


def _finish() -> None:
    """Wait for queued GPU work, so that a method's time is its own."""
    if torch.get_default_device().type == "cuda":
        torch.cuda.synchronize()


def _time_case(case: Case, rounds: int) -> dict[str, list[float]]:
    names = list(case.methods)
    samples: dict[str, list[float]] = {name: [] for name in names}
    with tqdm(
        total=rounds * len(names), desc=f"timing {case.label}", leave=False, disable=None
    ) as bar:
        for r in range(rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                start = time.perf_counter()
                case.methods[name]()
                _finish()
                samples[name].append(time.perf_counter() - start)
                bar.update()
    return samples


def _peak_memory_child(
    case_name: str, k: int, quick: bool, method: str, threads: int, device: str
) -> None:
    """In a fresh process: run the method once to warm up, reset the peak, run it again."""
    torch.set_num_threads(threads)
    torch.set_default_device(device)
    case = BUILDERS[case_name](k, quick)
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
    names = list(case.methods)
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
        ]
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
        lines = done.stdout.strip().splitlines()
        peaks[name] = (
            json.loads(lines[-1])["peak_kib"] / 1024 if done.returncode == 0 and lines else None
        )
    return peaks


def _summary(samples: list[float]) -> dict[str, float]:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples)}


def _evaluate_targets(entries: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    verdicts = []
    for label, method, baseline, limit in TARGETS:
        entry = entries.get(label)
        if entry is None:
            continue
        times = entry["methods"]
        if method not in times or baseline not in times:
            verdicts.append(
                {
                    "case": label,
                    "target": f"{method} <= {limit} x {baseline}",
                    "ratio": None,
                    "met": None,
                    "why": f"{baseline} not measured",
                }
            )
            continue
        ratio = times[method]["median"] / times[baseline]["median"]
        verdicts.append(
            {
                "case": label,
                "target": f"{method} <= {limit} x {baseline}",
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
        f"{report['rounds']} interleaved rounds (3 for cases slower than 10 s a round), medians. "
        "Ratios are against `naive` (k x `torch.autograd.grad(..., retain_graph=True)`) "
        "in the same run.",
        "",
        "| case | method | median ms | min-max ms | x naive | peak MiB | agrees |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for label, entry in report["cases"].items():
        methods = entry["methods"]  # empty when the whole case was skipped
        naive = methods[entry.get("baseline", "naive")]["median"] if methods else None
        for name, stats in methods.items():
            peak = (entry.get("peak_mib") or {}).get(name)
            shown = f"{name} ({entry['auto']})" if name == "funcgrad auto" else name
            if "bytes_per_rank" in stats:
                shown += f", {stats['bytes_per_rank'] / 2**20:.2f} MiB all-reduced per rank"
            cells = [
                label,
                shown,
                f"{stats['median'] * 1e3:.2f}",
                f"{stats['min'] * 1e3:.2f}-{stats['max'] * 1e3:.2f}",
                f"{stats['median'] / naive:.3f}",
                "" if peak is None else f"{peak:.1f}",
                entry["agreement"].get(
                    name,
                    "tested in tests/test_distributed.py"
                    if entry["name"] == "ddp"
                    else "reference",
                ),
            ]
            lines.append("| " + " | ".join(cells) + " |")
        for name, why in entry["skipped"].items():
            lines.append(f"| {label} | {name} | skipped: {why} | | | | |")
    lines += ["", "## Targets", "", "| case | target | ratio | met |", "|---|---|---:|---|"]
    for t in report["targets"]:
        ratio = "" if t["ratio"] is None else f"{t['ratio']:.3f}"
        met = {True: "met", False: "MISSED", None: "not measured"}[t["met"]]
        lines.append(f"| {t['case']} | {t['target']} | {ratio} | {met} |")
    return "\n".join(lines) + "\n"


def _plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for entry in report["cases"].values():
        name, k = entry["name"], entry["k"]
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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--_memory-child"]:
        case_name, heads, size, method, threads, device = argv[1:7]
        _peak_memory_child(case_name, int(heads), size == "quick", method, int(threads), device)
        return 0
    parser = argparse.ArgumentParser(
        prog="python -m funcgrad.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="small sizes, few rounds (< 1 min)")
    parser.add_argument(
        "--cases", nargs="+", choices=[*BUILDERS, "ddp"], default=[*BUILDERS, "ddp"]
    )
    parser.add_argument("--out", type=Path, default=Path("bench-results"), help="output folder")
    parser.add_argument("--plot", action="store_true", help="draw time against k (matplotlib)")
    parser.add_argument(
        "--rounds", type=int, default=None, help="timed rounds (default 7, quick 3)"
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
    torch.set_default_device(args.device)
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
        "threads": torch.get_num_threads(),
        "device": args.device,
        "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores"
        + (f", {torch.cuda.get_device_name()}" if args.device.startswith("cuda") else ""),
        "versions": versions,
        "cases": {},
        "disagreements": [],
    }
    try:
        from importlib.metadata import version

        import torchjd  # noqa: F401

        versions["torchjd"] = version("torchjd")
    except ImportError:
        versions["torchjd"] = None
    for name in args.cases:
        if name == "ddp":  # 2 gloo ranks in subprocesses: time per step, bytes per rank
            for k in DDP_HEAD_COUNTS[mode]:
                report["cases"][f"ddp k={k}"] = ddp_entry(k, args.quick, rounds)
            continue
        for k in HEAD_COUNTS[name][mode]:
            case = BUILDERS[name](k, args.quick)
            results, start = {}, time.perf_counter()
            for method, fn in case.methods.items():  # warm-up, and the agreement check
                results[method] = fn()
            # Slow cases (a round over 10 s) get 3 rounds, unless --rounds says otherwise.
            case_rounds = args.rounds or (3 if time.perf_counter() - start > 10 else rounds)
            agreement = _agreement(case, results)
            report["disagreements"] += [
                f"{case.label}: {m}: {v}" for m, v in agreement.items() if v != "ok"
            ]
            samples = _time_case(case, case_rounds)
            entry = {
                "name": case.name,
                "k": case.k,
                "m": case.m,
                "n": case.n,
                "auto": case.auto,
                "methods": {m: {**_summary(s), "samples": s} for m, s in samples.items()},
                "rounds": case_rounds,
                "agreement": agreement,
                "skipped": case.skipped,
            }
            # Quick runs measure memory on the seed only: each method is a fresh process.
            if not args.no_memory and (not args.quick or case.label == "seed k=8"):
                entry["peak_mib"] = _peak_memory(case, args.quick, args.threads, args.device)
            report["cases"][case.label] = entry
    report["targets"] = _evaluate_targets(report["cases"])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(report, indent=2))
    markdown = _markdown(report)
    (args.out / "results.md").write_text(markdown)
    if args.plot:
        _plot(report, args.out / "time_vs_heads.png")
    print(markdown)
    for problem in report["disagreements"]:
        print(f"DISAGREEMENT: {problem}")
    print(f"wrote {args.out / 'results.json'} and {args.out / 'results.md'}")
    return 1 if report["disagreements"] else 0


if __name__ == "__main__":
    sys.exit(main())
