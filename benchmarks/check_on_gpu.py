"""The GPU check's driver (benchmarks/gpu_check.sh runs it): each part in its own process with a time
budget, and benchmarks/results/gpu_check.json rewritten (atomically) after every part, so a run cut
short still brings back what it measured.

    python benchmarks/check_on_gpu.py [--budget 420] [--oversubscribe] [--json PATH]

The budget counts from the start of benchmarks/gpu_check.sh (GPU_CHECK_STARTED, seconds since the
epoch; the wheel install included), or from this script's start when run alone. The parts that do not
page come first. Nothing asks for more managed (unified) memory than the card has free unless
--oversubscribe is given: on a machine where that can hang the GPU (the lent one) the paging parts
run only their rows that stay under the free memory, and the parts that oversubscribe by design are
listed as skipped. Each part says in the JSON whether it oversubscribes (would, for a skipped one).

On a machine without CUDA (or without torch) every part is reported as skipped, one line each, and
the JSON says "device": "cpu".
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from results_io import read_json, write_json

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
KILL_WAIT = 10  # seconds to wait for a part killed at its limit to end (a process stuck in the driver may not)
# (name, seconds, command, pages): in this order. Each command gets the JSON path for its figures last;
# "{scratch}" is the run's scratch folder. pages: "never" (no managed memory beyond a few hundred MiB),
# "rows" (the part runs only its rows that stay under the free memory, every row with --oversubscribe),
# "by design" (the part oversubscribes: it runs only with --oversubscribe).
PARTS = [
    ("smoke", 30, [PY, "benchmarks/gpu_qlora.py", "--part", "smoke", "--json"], "never"),
    ("bf16-vs-fp16-matmul", 15, [PY, "benchmarks/gpu_qlora.py", "--part", "precision", "--json"], "never"),
    ("qlora-ablation-as-t4", 150, [PY, "benchmarks/gpu_qlora.py", "--as-t4", "--part", "ablation", "--json"], "never"),
    ("expandable-segments", 45, [PY, "benchmarks/gpu_qlora.py", "--as-t4", "--part", "expandable", "--json"], "never"),
    ("qlora-trainer", 40, [PY, "benchmarks/gpu_qlora.py", "--as-t4", "--part", "trainer", "--json"], "never"),
    ("bandwidth-probe", 25, [PY, "benchmarks/gpu_paging.py", "--part", "bandwidth", "--json"], "never"),
    # lessons 7 and 6 top to bottom with their %%gpu_only cells (activation offload; FSDP2's CPU
    # offload), which have never run on a GPU
    (
        "lesson-7-on-cuda",
        100,
        [PY, "benchmarks/gpu_lessons.py", "notebooks/07_the_rest_of_the_toolbox.ipynb", "--json"],
        "never",
    ),
    ("lesson-6-on-cuda", 150, [PY, "benchmarks/gpu_lessons.py", "notebooks/06_sharding.ipynb", "--json"], "never"),
    ("paging-demo", 70, [PY, "benchmarks/gpu_paging.py", "--part", "demo", "--json"], "rows"),
    (
        "paging-sweep",
        40,
        [PY, "benchmarks/gpu_paging.py", "--part", "sweep", "--rates", "{scratch}/bandwidth-probe.json", "--json"],
        "rows",
    ),
    ("eviction-probe", 35, [PY, "benchmarks/gpu_paging.py", "--part", "eviction", "--json"], "by design"),
    ("paging-spike", 35, [PY, "benchmarks/gpu_paging.py", "--part", "spike", "--json"], "by design"),
]
PAGING_SCRIPT = "benchmarks/gpu_paging.py"  # its parts take --oversubscribe


def environment() -> dict:
    """Device name and versions; "cpu" when there is no CUDA (or no torch)."""
    env = {"device": "cpu", "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
    try:
        import torch
    except ImportError:
        return {**env, "torch": None, "reason": "torch is not installed"}
    env["torch"] = torch.__version__
    if not torch.cuda.is_available():
        return {**env, "reason": "no CUDA device"}
    env.update(
        device=torch.cuda.get_device_name(),
        cuda=torch.version.cuda,
        capability=list(torch.cuda.get_device_capability()),
    )
    for module in ("bitsandbytes", "transformers", "peft"):
        try:
            env[module] = __import__(module).__version__
        except Exception as error:  # noqa: BLE001  a broken install is a finding, not a crash
            env[module] = f"not importable: {error!r}"[:200]
    if shutil.which("nvidia-smi"):
        try:
            smi = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,memory.total,memory.free,driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
            )
            env["nvidia_smi"] = smi.stdout.strip()
        except subprocess.TimeoutExpired:
            env["nvidia_smi"] = "nvidia-smi did not answer in 20 s"
    return env


def part_plan(oversubscribe: bool) -> list[tuple[str, int, list[str], bool, str]]:
    """(name, seconds, command, oversubscribes, why skipped or "") for every part, in order: a part
    that oversubscribes by design says so, and is skipped, without --oversubscribe."""
    plan = []
    for name, seconds, command, pages in PARTS:
        if PAGING_SCRIPT in command and oversubscribe:
            command = [*command[:-1], "--oversubscribe", command[-1]]
        skip = (
            "oversubscribes managed memory by design: only with --oversubscribe, on your own GPU"
            if pages == "by design" and not oversubscribe
            else ""
        )
        plan.append((name, seconds, command, pages == "by design" or (pages == "rows" and oversubscribe), skip))
    return plan


def run_part(command: list[str], limit: float, figures: Path, log: Path) -> dict:
    """Run one part in a session of its own for at most `limit` seconds; its status, seconds, output
    and figures. Every wait has a timeout; a torn or missing figures file is reported, not fatal."""
    entry: dict = {}
    t = time.monotonic()
    with open(log, "w") as out:
        # a session of its own, so that a part that runs out of time ends with its children (the
        # processes that hold paged state), not only itself
        child = subprocess.Popen(
            [*command, str(figures)],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, "GPU_CHECK_PART_SECONDS": f"{limit:.0f}"},
        )  # a part may stop itself
        try:
            child.wait(timeout=limit)
            entry["status"] = "ok" if child.returncode == 0 else f"failed (exit {child.returncode})"
        except subprocess.TimeoutExpired:
            entry["status"] = "timed out"
        try:
            os.killpg(child.pid, signal.SIGKILL)  # the part itself, if it ran out of time, and anything it left
        except ProcessLookupError:
            pass
        try:
            child.wait(timeout=KILL_WAIT)
        except subprocess.TimeoutExpired:
            entry["status"] += f"; still not ended {KILL_WAIT} s after SIGKILL"
    entry["seconds"] = round(time.monotonic() - t, 1)
    entry["output_tail"] = log.read_text(errors="replace")[-3000:]
    data, why = read_json(figures)
    if data is not None:
        entry["figures"] = data
    else:
        entry["figures_missing"] = why
    return entry


def run_parts(plan, report: dict, deadline: float, scratch: Path, save, on_cpu: bool) -> None:
    """Each part of `plan` (as `part_plan` gives it) in turn, until `deadline` (time.time());
    `report["parts"]` updated and `save()` called after each."""
    for name, budget, command, oversubscribes, skip in plan:
        entry = report["parts"][name] = {"budget_s": budget, "oversubscribes": oversubscribes}
        left = deadline - time.time()
        reason = "needs CUDA" if on_cpu else skip or ("out of time" if left < 10 else "")
        if reason:
            entry.update(status="skipped", reason=reason)
            print(f"== {name}: skipped, {reason}", flush=True)
            save()
            continue
        limit = min(budget, left)
        print(f"== {name} (up to {limit:.0f} s; {left:.0f} s left)", flush=True)
        command = [arg.replace("{scratch}", str(scratch)) for arg in command]
        entry.update(run_part(command, limit, scratch / f"{name}.json", scratch / f"{name}.log"))
        output = entry["output_tail"]
        print(output, end="" if output.endswith("\n") or not output else "\n", flush=True)
        if "figures_missing" in entry:
            print(f"   no figures: {entry['figures_missing']}", flush=True)
        print(f"== {name}: {entry['status']} after {entry['seconds']} s", flush=True)
        save()


def main(argv: list[str] | None = None) -> int:
    started = float(os.environ.get("GPU_CHECK_STARTED") or time.time())
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--budget",
        type=float,
        default=float(os.environ.get("GPU_CHECK_BUDGET", 420)),
        help="seconds for the whole check, counted from gpu_check.sh's start (default 420)",
    )
    parser.add_argument(
        "--oversubscribe",
        action="store_true",
        help="also run what asks for more managed memory than is free (your own GPU only: "
        "on some machines that can hang the GPU)",
    )
    parser.add_argument(
        "--json",
        type=Path,
        default=Path(os.environ.get("GPU_CHECK_JSON", ROOT / "benchmarks" / "results" / "gpu_check.json")),
    )
    args = parser.parse_args(argv)
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    report = {**environment(), "budget_s": args.budget, "oversubscribe": args.oversubscribe, "parts": {}}

    def save() -> None:
        report["seconds"] = round(time.time() - started, 1)
        write_json(args.json, report)
        if out_dir is not None:
            write_json(out_dir / "gpu_check.json", report)

    print(
        f"gpu check on {report['device']} ({report.get('reason') or report.get('nvidia_smi', '')}); "
        f"{time.time() - started:.0f} s of the {args.budget:.0f} s budget gone before the first part",
        flush=True,
    )
    scratch = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    run_parts(
        part_plan(args.oversubscribe), report, started + args.budget, scratch, save, on_cpu=report["device"] == "cpu"
    )
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
