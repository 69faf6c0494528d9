"""Lesson 4 on a real CUDA GPU: the driver probed, paged optimizers measured, the simulator beside them.

    python benchmarks/gpu_paging.py [--part bandwidth|eviction|demo|sweep|spike|all] [--capacity-gib 4]
                                    [--oversubscribe] [--rates PATH] [--json PATH]

A big GPU is made to look `--capacity-gib` big (`paging.VirtualGPU`: a balloon of ordinary memory
leaves that much free after the CUDA context, and PyTorch's allocator is capped there). Every row
that creates paged state runs in a process of its own (bitsandbytes never frees it).

Asking for more managed memory than the card has free can hang the GPU on some machines (the lent
one's rules forbid it). So a paged row whose state and PyTorch's reserve the simulator does not put at
least `paging.MARGIN` under the capacity (`oversubscribes`) runs only with --oversubscribe, on your
own GPU; without it the row is listed as skipped. Every row says whether it oversubscribes. Parts:
- bandwidth: unified memory's rates (prefetch, GPU faults, host faults) beside pinned copies, on the
  whole card (256 MiB of managed memory);
- eviction: which 2 MB chunks the driver evicts (allocation order or LRU); it oversubscribes by design;
- demo: plain AdamW runs out of memory; bitsandbytes' AdamW8bit, PagedAdamW 32-bit and 8-bit and CPU
  offload complete; the "outside" column is what grew outside PyTorch's allocator after a warm-up,
  read against the unpaged rows (without --oversubscribe, paged 32-bit is skipped: it pages);
- sweep: paged 32-bit AdamW at 1.6x, 1.0x and 0.8x the capacity: measured step time beside the
  simulator's, calibrated with the bandwidth part's rates (--rates: that part's JSON, as
  benchmarks/check_on_gpu.py passes it; otherwise measured here) and the fitting run's compute
  (without --oversubscribe only 1.6x runs);
- spike: one long batch: bitsandbytes' unpaged 32-bit AdamW against the paged one, and the steps
  after it with and without `torch.cuda.empty_cache()` (the paged rows oversubscribe by design).
Every outcome the demo and the spike claim is at least 15% clear of the capacity in the simulator's
accounting (`paging.demo_claims`, `paging.spike_plan`): a PASS/FAIL line compares each with the GPU.
The numbers go to --json after every row, atomically (default: $OUT/gpu_paging.json when $OUT is set).
benchmarks/gpu_check.sh runs each part with a time budget (GPU_CHECK_PART_SECONDS: each row's
process is stopped 5 s before it). On a CPU it prints one line.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GiB = 2**30
PARTS = ("bandwidth", "eviction", "demo", "sweep", "spike")
SKIPPED = {"status": "skipped", "error": "it would oversubscribe managed memory: --oversubscribe, on your own GPU"}


def median_step(run: dict, skip: int = 1) -> float:
    times = [s["seconds"] for s in run.get("steps", [])[skip:]] or [s["seconds"] for s in run.get("steps", [])]
    return statistics.median(times) if times else float("nan")


def oversubscribes(optimizer: str, capacity: int, shape: dict[str, int], tokens: int | None = None) -> bool:
    """Whether a row may ask for more managed memory than a `capacity`-byte GPU has free, simulated: a
    paged optimizer whose resident state, PyTorch's reserve and the activations (freed blocks never
    reused) are not `paging.MARGIN` under the capacity. Unpaged rows never do: cudaMalloc fails cleanly."""
    from course_lib import paging

    if not optimizer.startswith("paged"):
        return False
    need = paging.demo_margins(capacity, shape, (optimizer,), tokens)[optimizer]
    return need["total"] + need["activations"] > 1 - paging.MARGIN


def read_rates(path: Path | None) -> dict | None:
    """The bandwidth part's measured rates from its JSON (benchmarks/check_on_gpu.py passes it), or None."""
    from results_io import read_json

    data, why = read_json(path) if path else (None, "")
    if why:
        print(f"no rates from the bandwidth part: {why}")
    rates = (data or {}).get("bandwidth")
    return rates if rates and rates.get("status") != "crashed" else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=(*PARTS, "all"), default="all")
    parser.add_argument("--capacity-gib", type=float, default=4.0, help="the small GPU to emulate (GiB)")
    parser.add_argument("--steps", type=int, default=4, help="training steps per run")
    parser.add_argument(
        "--oversubscribe",
        action="store_true",
        help="also run the rows that ask for more managed memory than is free (your own GPU only)",
    )
    parser.add_argument("--rates", type=Path, default=None, help="the bandwidth part's JSON, for the sweep")
    parser.add_argument(
        "--json",
        type=Path,
        default=Path(os.environ["OUT"]) / "gpu_paging.json" if os.environ.get("OUT") else None,
        help="write every number here",
    )
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print(
            "gpu_paging.py needs a CUDA GPU (paged optimizers fall back to unpaged on CPU); "
            "on CPU, benchmarks/paging_regimes.py shows the simulator's version."
        )
        return 0

    from results_io import write_json

    from course_lib import isolate, paging

    deadline = time.monotonic() + float(os.environ.get("GPU_CHECK_PART_SECONDS", "inf")) - 5
    capacity = int(args.capacity_gib * GiB)
    shape = paging.demo_shape(capacity)
    results: dict = {"capacity": capacity, "shape": shape, "oversubscribe": args.oversubscribe, "checks": []}
    parts = PARTS if args.part == "all" else (args.part,)

    def save() -> None:
        if args.json:
            write_json(args.json, results)

    def check(what: str, ok: bool) -> None:
        results["checks"].append([what, bool(ok)])
        print(f"{'PASS' if ok else 'FAIL'} {what}")
        save()

    def run_row(row: dict) -> dict:
        """`paging.demo_row(**row)` in its own process, stopped before the part's limit, with whether it
        oversubscribes; a row that does runs only with --oversubscribe (the caller saves the result)."""
        over = oversubscribes(
            row["optimizer"], row["capacity"], shape, max(row.get("tokens_per_step") or [shape["tokens"]])
        )
        if over and not args.oversubscribe:
            return {**SKIPPED, "oversubscribes": True, "capacity": row["capacity"]}
        return {**paging.isolated_runs([row], timeout=max(1.0, deadline - time.monotonic()))[0], "oversubscribes": over}

    print(f"emulating a {args.capacity_gib:g} GiB GPU; demo model {shape}")
    if "bandwidth" in parts:
        rates = isolate.run(
            "course_lib.paging.probe:measure_bandwidths",
            nbytes=256 * 2**20,
            timeout=max(1.0, min(60.0, deadline - time.monotonic())),
        )
        results["bandwidth"] = {**rates, "oversubscribes": False}
        if rates.get("status") != "crashed":
            print("rates (measured, GB/s): " + ", ".join(f"{k} {v / 1e9:.2f}" for k, v in rates.items() if k != "pid"))
            print(
                f"prefetch / pinned copy: {rates['um_prefetch_h2d'] / rates['pinned_h2d']:.2f} "
                "(bitsandbytes' docs: about half)"
            )
        else:
            print(f"bandwidth probe: {rates}")
        save()

    if "eviction" in parts:
        if args.oversubscribe:
            order = isolate.run(
                "course_lib.paging.probe:eviction_order", timeout=max(1.0, min(60.0, deadline - time.monotonic()))
            )
            print(
                f"\neviction order (measured): first evicted chunks {order.get('evicted', [])[:6]} -> "
                f"{order.get('verdict', order.get('error'))}"
            )
        else:
            order = dict(SKIPPED)
            print(f"\neviction order: {order['error']}")
        results["eviction_order"] = {**order, "oversubscribes": True}
        save()

    if "demo" in parts:
        t = time.perf_counter()
        runs: dict = {}
        results["demo"] = {
            "capacity": capacity,
            "shape": shape,
            "runs": runs,
            "margins": paging.demo_margins(capacity, shape),
        }
        for name in paging.DEMO_OPTIMIZERS:
            runs[name] = run_row({"optimizer": name, "shape": shape, "steps": args.steps, "capacity": capacity})
            save()
        print(f"\ndemo at {args.capacity_gib:g} GiB, one process per row ({time.perf_counter() - t:.0f} s):")
        print(paging.runs_table(runs))
        check("plain AdamW runs out of memory under the cap", runs["adamw"].get("status") == "out of memory")
        for name in paging.DEMO_OPTIMIZERS[1:]:
            if runs[name]["status"] != "skipped":
                check(f"{name} completes", runs[name].get("status") == "ok")
        floor = max(
            (
                r["steps"][-1]["outside_allocator"]
                for n, r in runs.items()
                if not n.startswith("paged") and r.get("steps")
            ),
            default=0,
        )
        for name in ("paged_adamw_32bit", "paged_adamw_8bit"):
            if runs[name].get("steps"):
                print(
                    f"{name}: outside the allocator {runs[name]['steps'][-1]['outside_allocator'] / GiB:.2f} GiB "
                    f"against the unpaged rows' {floor / GiB:.2f} GiB"
                )
        timeline = runs["paged_adamw_32bit"].get("timeline", [])
        prefetches = [e for e in timeline if e["kind"] == "prefetch"]
        if prefetches:
            results["prefetch_summary"] = {
                "state_bytes": sum(e["state_bytes"] for e in prefetches),
                "prefetch_s": sum(e["end"] - e["start"] for e in prefetches),
                "update_s": sum(e["end"] - e["start"] for e in timeline if e["kind"] == "update"),
            }
            print(f"prefetch timeline (last paged 32-bit step, measured): {results['prefetch_summary']}")
        save()

    if "sweep" in parts:
        rows = results["sweep"] = []
        for factor in (1.6, 1.0, 0.8):
            rows.append(
                run_row(
                    {
                        "optimizer": "paged_adamw_32bit",
                        "shape": shape,
                        "steps": args.steps,
                        "capacity": int(capacity * factor),
                    }
                )
            )
            save()
        fits = rows[0]
        rates = results.get("bandwidth") or (
            read_rates(args.rates)
            if args.rates
            else isolate.run("course_lib.paging.probe:measure_bandwidths", nbytes=256 * 2**20, timeout=60)
        )
        print(f"\n{'capacity':>9} {'measured ms':>11} {'simulated ms':>12} {'simulated GB moved':>18}")
        if fits.get("status") == "ok" and rates and rates.get("status") != "crashed":
            setup = paging.mlp_setup(shape)
            last = fits["steps"][-1]
            flops = 6 * setup.n_params * shape["tokens"] / (last["forward"] + last["backward"])
            cat = setup.bytes_by_category()
            update_bytes = sum(p.numel * (2 * p.dtype_bytes + setup.grad_bytes) for p in setup.params) + 2 * (
                cat["optimizer state (paged)"] + cat["optimizer state (ordinary)"]
            )
            for row, factor in zip(rows, (1.6, 1.0, 0.8)):
                row_capacity = int(capacity * factor)
                hw = paging.Hardware(
                    name="calibrated",
                    memory=row_capacity,
                    h2d_bandwidth=rates["um_prefetch_h2d"],
                    d2h_bandwidth=rates["um_host_fault_d2h"],
                    device_bandwidth=update_bytes / max(last["optimizer_step"], 1e-6),
                    device_flops=flops,
                    pinned_bandwidth=rates["pinned_h2d"],
                )
                sim = paging.simulate(
                    paging.training_trace(setup, [shape["tokens"]] * args.steps), hw, record_timeline=False
                )
                stats = None if sim.oom else sim.step_stats(sim.steps[-1])
                row["simulated"] = (
                    None if stats is None else {"step_s": stats.total, "moved_bytes": stats.h2d_bytes + stats.d2h_bytes}
                )
                measured = f"{1e3 * median_step(row):11.1f}" if row.get("status") == "ok" else f"{row['status']:>11}"
                simulated = f"{1e3 * stats.total:12.1f}" if stats else f"{'OOM':>12}"
                moved = f"{(stats.h2d_bytes + stats.d2h_bytes) / 1e9:18.2f}" if stats else ""
                print(f"{row_capacity / GiB:>8.2f}G {measured} {simulated} {moved}")
                save()
            tight = rows[-1]
            if tight.get("status") == "ok":
                check(
                    "paging slows the tightest capacity down (measured)", median_step(tight) > 1.2 * median_step(fits)
                )
        else:
            print(f"(no simulated column: the 1.6x row is {fits.get('status')}; measured rates: {bool(rates)})")
        save()

    if "spike" in parts:
        plan = paging.spike_plan(capacity, shape)
        tokens = plan["tokens"]
        labels = (
            ("unpaged 32-bit", "adamw_32bit", ()),
            ("paged, cache kept", "paged_adamw_32bit", ()),
            ("paged, empty_cache", "paged_adamw_32bit", (plan["spike_step"],)),
        )
        spike: dict = {}
        results["spike"] = {"plan": plan, "runs": spike}
        for label, name, flush in labels:
            spike[label] = run_row(
                {
                    "optimizer": name,
                    "shape": shape,
                    "steps": len(tokens),
                    "capacity": plan["capacity"],
                    "tokens_per_step": tokens,
                    "empty_cache_after": list(flush),
                }
            )
            save()
        print(
            f"\nspike at {plan['capacity'] / GiB:.2f} GiB, tokens per step {tokens} (simulated claims "
            f"{plan['claims']}):"
        )
        for label, run in spike.items():
            times = " ".join(f"{1e3 * s['seconds']:.0f}" for s in run.get("steps", []))
            print(f"  {label:<20} {run.get('status', '?'):<14} step ms (measured): {times}")
        unpaged = spike["unpaged 32-bit"]
        check(
            "unpaged 32-bit AdamW runs out of memory at the spike, not before",
            unpaged.get("status") == "out of memory" and len(unpaged.get("steps", [])) == plan["spike_step"],
        )
        if spike["paged, cache kept"]["status"] != "skipped":
            check("paged AdamW survives the spike", spike["paged, cache kept"].get("status") == "ok")
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
