"""The benchmark runs (--quick) and writes its reports. It asserts no timing: speed is
measured by people on full runs, not by CI on a shared machine."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # minutes: the whole benchmark, quick


STANDARD = ["seed", "multi-output", "mtl", "mtl-weighting", "probes", "bridge", "ddp"]


def _bench(*options):
    return subprocess.run(
        [sys.executable, "-m", "funcgrad.bench", "--quick", *options],
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_quick_benchmark_runs_and_every_method_agrees(tmp_path):
    done = _bench("--out", str(tmp_path), "--plot", "--cases", *STANDARD)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "results.json").read_text())
    assert report["disagreements"] == []
    assert {entry["name"] for entry in report["cases"].values()} == set(STANDARD)
    for entry in report["cases"].values():
        baseline = entry.get("baseline", "naive")
        assert baseline in entry["methods"] and entry["methods"][baseline]["samples"]
        assert all(verdict == "ok" for verdict in entry["agreement"].values())
    assert report["targets"], "the targets table is empty"
    assert (tmp_path / "results.md").read_text().startswith("# funcgrad benchmarks")
    assert (tmp_path / "time_vs_heads.png").stat().st_size > 1000


def test_real_model_and_planner_cases_run_and_agree(tmp_path):
    """A few cells of each (one round): the real model with eager attention, the planner's
    seed and ODE simulator, and fn.plan's cost on the simulator."""
    done = _bench(
        "--cases", "real-model", "planner", "--variants", "eager", "seed", "ode n=2",
        "--rounds", "1", "--no-memory", "--out", str(tmp_path),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "results.json").read_text())
    assert report["disagreements"] == []
    labels = set(report["cases"])
    assert "real-model bert-eager k=4" in labels
    assert {"planner seed k=2", "planner ode n=2 k=32", "planner ode n=2 plan cost k=8"} <= labels
    real = report["cases"]["real-model bert-eager k=4"]
    if real["skipped"].get("all"):  # transformers missing: one clear line, nothing timed
        assert "transformers" in done.stderr
    else:
        assert real["methods"]["funcgrad compose_heads auto"]["samples"]
        assert all(verdict == "ok" for verdict in real["agreement"].values())
        assert real["plans"]["funcgrad compose_heads auto"]["strategy"] in ("vjp", "loop")
    planner = report["planner"]
    assert len(planner["cells"]) == 4 and planner["max_regret"] > 0
    for cell in planner["cells"]:
        assert cell["plan"]["strategy"] in ("vjp", "jacrev", "jacfwd", "loop")
        assert cell["first_call"]["strategy"] in ("vjp", "jacrev", "jacfwd", "loop")
    assert [cost["function"] for cost in planner["plan_cost"]] == ["ode n=2 plan cost"]
    markdown = (tmp_path / "results.md").read_text()
    assert "## Planner regret" in markdown and "fn.plan(*args) against one eager" in markdown


def test_per_example_case_runs_and_agrees(tmp_path):
    """IWRM on the three small models (one round): every method's update agrees with the
    per-example loop, and each cell reports funcgrad's per-layer plan."""
    pytest.importorskip("torchjd")
    done = _bench(
        "--cases", "per-example", "--rounds", "1", "--no-memory", "--out", str(tmp_path)
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "results.json").read_text())
    assert report["disagreements"] == []
    assert {e["variant"] for e in report["cases"].values()} == {"mlp", "cnn", "transformer"}
    for entry in report["cases"].values():
        assert entry["agreement"]["funcgrad per_example"] == "ok"
        assert "per-example plan, B=" in entry["per_example_plan"]
