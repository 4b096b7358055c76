"""The benchmark runs (--quick) and writes its reports. It asserts no timing: speed is
measured by people on full runs, not by CI on a shared machine."""

from __future__ import annotations

import json
import subprocess
import sys


def test_quick_benchmark_runs_and_every_method_agrees(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "funcgrad.bench", "--quick", "--out", str(tmp_path), "--plot"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "results.json").read_text())
    assert report["disagreements"] == []
    assert {entry["name"] for entry in report["cases"].values()} == {
        "seed",
        "multi-output",
        "mtl",
        "mtl-weighting",
        "probes",
        "bridge",
        "ddp",
    }
    for entry in report["cases"].values():
        baseline = entry.get("baseline", "naive")
        assert baseline in entry["methods"] and entry["methods"][baseline]["samples"]
        assert all(verdict == "ok" for verdict in entry["agreement"].values())
    assert report["targets"], "the targets table is empty"
    assert (tmp_path / "results.md").read_text().startswith("# funcgrad benchmarks")
    assert (tmp_path / "time_vs_heads.png").stat().st_size > 1000
