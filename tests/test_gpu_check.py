"""The GPU check's driver and result files, on a CPU (benchmarks/gpu_check.sh, check_on_gpu.py,
results_io.py, gpu_paging.py's oversubscription gate): what must hold before a GPU run is worth its
minutes."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import check_on_gpu  # noqa: E402
import gpu_paging  # noqa: E402
from results_io import read_json, write_json  # noqa: E402

# the order: the parts that do not page first, then the paging ones
ORDER = [
    "smoke",
    "bf16-vs-fp16-matmul",
    "qlora-ablation-as-t4",
    "expandable-segments",
    "qlora-trainer",
    "bandwidth-probe",
    "lesson-7-on-cuda",
    "lesson-6-on-cuda",
    "paging-demo",
    "paging-sweep",
    "eviction-probe",
    "paging-spike",
]
ROWS = {"paging-demo", "paging-sweep"}  # only their rows under the free memory, unless asked
BY_DESIGN = {"eviction-probe", "paging-spike"}  # they oversubscribe: only when asked


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU run")
@pytest.mark.parametrize("oversubscribe", [False, True])
def test_gpu_check_on_cpu_writes_every_part_in_order_marked(tmp_path, oversubscribe):
    out = tmp_path / "check.json"
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "GPU_CHECK_STARTED")}
    done = subprocess.run(
        [
            "bash",
            str(ROOT / "benchmarks" / "gpu_check.sh"),
            "--json",
            str(out),
            *(["--oversubscribe"] if oversubscribe else []),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**env, "PYTHON": sys.executable},
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["oversubscribe"] is oversubscribe
    assert list(report["parts"]) == ORDER
    for name, part in report["parts"].items():
        assert part["status"] == "skipped" and part["reason"] == "needs CUDA", part
        assert part["oversubscribes"] is (name in BY_DESIGN or (oversubscribe and name in ROWS)), name
    assert 0 < report["seconds"] < report["budget_s"] == 420


def test_the_budget_counts_from_the_scripts_start(tmp_path, monkeypatch):
    monkeypatch.setenv("GPU_CHECK_STARTED", str(time.time() - 1000))  # the wheel install took 1000 s
    monkeypatch.delenv("OUT", raising=False)
    check_on_gpu.main(["--json", str(tmp_path / "check.json")])
    assert json.loads((tmp_path / "check.json").read_text())["seconds"] >= 1000


def test_without_oversubscribe_every_part_that_oversubscribes_is_skipped():
    for asked in (False, True):
        plan = check_on_gpu.part_plan(asked)
        assert [name for name, *_ in plan] == ORDER
        for name, _, command, oversubscribes, skip in plan:
            assert command[-1] == "--json"  # the figures' path goes last
            assert ("--oversubscribe" in command) is (asked and "benchmarks/gpu_paging.py" in command)
            assert oversubscribes is (name in BY_DESIGN or (asked and name in ROWS))
            assert bool(skip) is (not asked and name in BY_DESIGN), name


PART = """
import sys, time
sys.path.insert(0, {benchmarks!r})
from results_io import write_json
path = sys.argv[-1]
{body}
"""


def _part(body: str) -> list[str]:
    return [sys.executable, "-c", PART.format(benchmarks=str(ROOT / "benchmarks"), body=body), "--json"]


def test_the_driver_goes_on_after_a_part_killed_mid_write(tmp_path):
    torn = (
        "f = open(path, 'w'); f.write('{\"rows\": [1, 2'); f.flush(); print('wrote half', flush=True); time.sleep(600)"
    )
    atomic = (
        "write_json(path, {'rows': [1]}); print('row 1', flush=True); "
        "f = open(path + '.tmp', 'w'); f.write('{\"rows\": [1, '); f.flush(); time.sleep(600)"
    )
    plan = [
        ("torn", 3, _part(torn), False, ""),
        ("atomic-then-killed", 3, _part(atomic), False, ""),
        ("writes-nothing", 30, _part("pass"), False, ""),
        ("good", 30, _part("write_json(path, {'rows': [1, 2, 3]})"), False, ""),
        ("skipped", 30, _part("pass"), True, "oversubscribes managed memory by design"),
    ]
    report = {"parts": {}}
    saved = []
    check_on_gpu.run_parts(
        plan, report, time.time() + 300, tmp_path, lambda: saved.append(json.dumps(report)), on_cpu=False
    )
    parts = report["parts"]
    assert len(saved) == len(plan)
    assert parts["torn"]["status"] == "timed out" and "wrote half" in parts["torn"]["output_tail"]
    assert "unreadable" in parts["torn"]["figures_missing"] and "figures" not in parts["torn"]
    assert parts["atomic-then-killed"]["status"] == "timed out"
    assert parts["atomic-then-killed"]["figures"] == {"rows": [1]}  # the last whole write survives the kill
    assert parts["writes-nothing"]["status"] == "ok" and "was not written" in parts["writes-nothing"]["figures_missing"]
    assert parts["good"] == {**parts["good"], "status": "ok", "figures": {"rows": [1, 2, 3]}, "oversubscribes": False}
    assert parts["skipped"] == {
        "budget_s": 30,
        "oversubscribes": True,
        "status": "skipped",
        "reason": "oversubscribes managed memory by design",
    }


def test_a_part_that_would_start_with_under_10_s_left_is_skipped(tmp_path):
    report = {"parts": {}}
    check_on_gpu.run_parts(
        [("late", 30, _part("pass"), False, "")], report, time.time() + 5, tmp_path, lambda: None, on_cpu=False
    )
    assert report["parts"]["late"]["status"] == "skipped" and report["parts"]["late"]["reason"] == "out of time"


def test_write_json_keeps_the_last_whole_file_when_a_write_fails(tmp_path):
    path = tmp_path / "figures.json"
    write_json(path, {"rows": [1]})
    circular: dict = {}
    circular["self"] = circular
    with pytest.raises(ValueError, match="Circular"):
        write_json(path, {"rows": [1, 2], "bad": circular})
    assert read_json(path) == ({"rows": [1]}, "")
    assert [p.name for p in tmp_path.iterdir()] == ["figures.json"]  # no temporary file left


def test_read_json_says_why_in_one_line(tmp_path):
    data, why = read_json(tmp_path / "none.json")
    assert data is None and "was not written" in why
    (tmp_path / "torn.json").write_text('{"bandwidth": {"pinned_h2d": 1')
    data, why = read_json(tmp_path / "torn.json")
    assert data is None and "unreadable" in why and "\n" not in why


def test_the_sweep_reads_the_probes_rates(tmp_path):
    rates = {"pinned_h2d": 2e10, "um_prefetch_h2d": 1e10, "um_host_fault_d2h": 5e9}
    write_json(tmp_path / "probe.json", {"bandwidth": rates})
    assert gpu_paging.read_rates(tmp_path / "probe.json") == rates
    write_json(tmp_path / "crashed.json", {"bandwidth": {"status": "crashed"}})
    assert gpu_paging.read_rates(tmp_path / "crashed.json") is None
    (tmp_path / "torn.json").write_text('{"bandwidth": ')
    assert gpu_paging.read_rates(tmp_path / "torn.json") is None


def test_the_paging_rows_that_oversubscribe_are_the_ones_that_page():
    from course_lib import paging

    capacity = 4 * 2**30
    shape = paging.demo_shape(capacity)
    over = {name: gpu_paging.oversubscribes(name, capacity, shape) for name in paging.DEMO_OPTIMIZERS}
    # the demo's claim that paged 32-bit state pages is exactly why it may not run on the lent machine
    assert paging.demo_claims(paging.demo_margins(capacity, shape))["paged_adamw_32bit pages"]
    assert over == {
        "adamw": False,
        "adamw_8bit": False,
        "paged_adamw_32bit": True,
        "paged_adamw_8bit": False,
        "cpu_offload_adamw": False,
    }
    # the sweep: only 1.6x the capacity stays under it; the spike's paged rows page at the long batch
    assert [gpu_paging.oversubscribes("paged_adamw_32bit", int(capacity * f), shape) for f in (1.6, 1.0, 0.8)] == [
        False,
        True,
        True,
    ]
    plan = paging.spike_plan(capacity, shape)
    assert gpu_paging.oversubscribes("paged_adamw_32bit", plan["capacity"], shape, max(plan["tokens"]))
    assert not gpu_paging.oversubscribes("adamw_32bit", plan["capacity"], shape, max(plan["tokens"]))


def _fake_row(row: dict) -> dict:
    """What paging.demo_row returns, without a GPU: plain AdamW runs out of memory, the rest complete."""
    seconds = 0.1 * 2**32 / row["capacity"]  # slower on a smaller GPU, as paging makes it
    steps = [
        {
            "seconds": seconds,
            "forward": 0.02,
            "backward": 0.04,
            "optimizer_step": 0.04,
            "allocated": 1,
            "reserved": 2,
            "used": 3,
            "outside_allocator": 0,
        }
    ] * len(row.get("tokens_per_step") or [0] * row["steps"])
    if row["optimizer"] in ("adamw", "adamw_32bit"):
        return {"status": "out of memory", "error": "CUDA out of memory", "steps": steps[:2]}
    return {"status": "ok", "steps": steps, "timeline": [], "capacity": row["capacity"]}


@pytest.mark.parametrize("oversubscribe", [False, True])
def test_gpu_paging_runs_a_row_that_oversubscribes_only_when_asked(tmp_path, monkeypatch, oversubscribe):
    from course_lib import isolate, paging

    ran = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        paging, "isolated_runs", lambda rows, timeout=None: [ran.append(r) or _fake_row(r) for r in rows]
    )
    rates = {
        "pinned_h2d": 2e10,
        "pinned_d2h": 2e10,
        "um_prefetch_h2d": 1e10,
        "um_fault_h2d": 5e9,
        "um_host_fault_d2h": 5e9,
    }
    monkeypatch.setattr(
        isolate, "run", lambda target, **kw: {"verdict": "allocation order"} if "eviction" in target else dict(rates)
    )
    out = tmp_path / "paging.json"
    assert gpu_paging.main(["--json", str(out), *(["--oversubscribe"] if oversubscribe else [])]) == 0
    results = json.loads(out.read_text())
    capacity = results["capacity"]
    paged_32 = [r["capacity"] for r in ran if r["optimizer"] == "paged_adamw_32bit"]
    if oversubscribe:  # every row ran: 1 in the demo, 3 in the sweep, 2 in the spike
        assert len(paged_32) == 6 and results["eviction_order"]["verdict"] == "allocation order"
    else:  # only the sweep's 1.6x row stays under the free memory
        assert paged_32 == [int(1.6 * capacity)]
        assert results["demo"]["runs"]["paged_adamw_32bit"]["status"] == "skipped"
        assert [r["status"] for r in results["sweep"]] == ["ok", "skipped", "skipped"]
        assert results["eviction_order"]["status"] == "skipped"
        assert {label: r["status"] for label, r in results["spike"]["runs"].items()} == {
            "unpaged 32-bit": "out of memory",
            "paged, cache kept": "skipped",
            "paged, empty_cache": "skipped",
        }
    assert results["demo"]["runs"]["paged_adamw_32bit"]["oversubscribes"] is True
    assert results["demo"]["runs"]["paged_adamw_8bit"]["status"] == "ok"
    assert results["demo"]["runs"]["paged_adamw_8bit"]["oversubscribes"] is False
    assert results["sweep"][0]["simulated"]["step_s"] > 0  # the probe's rates reached the sweep
    assert all(ok for what, ok in results["checks"]), results["checks"]
