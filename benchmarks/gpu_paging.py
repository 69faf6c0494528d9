"""Lesson 4 on a real CUDA GPU: the driver probed, paged optimizers measured, the simulator beside them.

    python benchmarks/gpu_paging.py [--part probe|demo|sweep|spike|all] [--capacity-gib 4] [--json PATH]

A big GPU is made to look `--capacity-gib` big (`paging.VirtualGPU`: a balloon of ordinary memory
leaves that much free after the CUDA context, and PyTorch's allocator is capped there). Every row
that creates paged state runs in a process of its own (bitsandbytes never frees it). Parts:
- probe: which 2 MB chunks the driver evicts (allocation order or LRU), and unified memory's rates:
  prefetch, GPU faults, host faults, beside pinned copies;
- demo: plain AdamW runs out of memory; bitsandbytes' AdamW8bit, PagedAdamW 32-bit and 8-bit and CPU
  offload complete; the "outside" column is what grew outside PyTorch's allocator after a warm-up,
  read against the unpaged rows;
- sweep: paged 32-bit AdamW at 1.6x, 1.0x and 0.8x the capacity: measured step time beside the
  simulator's, calibrated with the probe's rates and the fitting run's compute;
- spike: one long batch: bitsandbytes' unpaged 32-bit AdamW against the paged one, and the steps
  after it with and without `torch.cuda.empty_cache()`.
Every outcome the demo and the spike claim is at least 15% clear of the capacity in the simulator's
accounting (`paging.demo_claims`, `paging.spike_plan`): a PASS/FAIL line compares each with the GPU.
The numbers go to --json after every step (default: $OUT/gpu_paging.json when $OUT is set).
benchmarks/gpu_check.sh runs each part with a time budget. On a CPU it prints one line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GiB = 2**30
PARTS = ("probe", "demo", "sweep", "spike")


def median_step(run: dict, skip: int = 1) -> float:
    times = [s["seconds"] for s in run.get("steps", [])[skip:]] or [s["seconds"] for s in run.get("steps", [])]
    return statistics.median(times) if times else float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=(*PARTS, "all"), default="all")
    parser.add_argument("--capacity-gib", type=float, default=4.0, help="the small GPU to emulate (GiB)")
    parser.add_argument("--steps", type=int, default=4, help="training steps per run")
    parser.add_argument("--json", type=Path, default=Path(os.environ["OUT"]) / "gpu_paging.json"
                        if os.environ.get("OUT") else None, help="write every number here")
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("gpu_paging.py needs a CUDA GPU (paged optimizers fall back to unpaged on CPU); "
              "on CPU, benchmarks/paging_regimes.py shows the simulator's version.")
        return 0

    from course_lib import isolate, paging

    capacity = int(args.capacity_gib * GiB)
    shape = paging.demo_shape(capacity)
    results: dict = {"capacity": capacity, "shape": shape, "checks": []}
    parts = PARTS if args.part == "all" else (args.part,)

    def save() -> None:
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(results, indent=1, default=str))

    def check(what: str, ok: bool) -> None:
        results["checks"].append([what, bool(ok)])
        print(f"{'PASS' if ok else 'FAIL'} {what}")
        save()

    print(f"emulating a {args.capacity_gib:g} GiB GPU; demo model {shape}")
    if "probe" in parts:
        order = isolate.run("course_lib.paging.probe:eviction_order", timeout=60)
        results["eviction_order"] = order
        print(f"\neviction order (measured): first evicted chunks {order.get('evicted', [])[:6]} -> "
              f"{order.get('verdict', order.get('error'))}")
        save()
        rates = isolate.run("course_lib.paging.probe:measure_bandwidths", nbytes=256 * 2**20, timeout=60)
        results["bandwidth"] = rates
        if rates.get("status") != "crashed":
            print("rates (measured, GB/s): " + ", ".join(f"{k} {v / 1e9:.2f}" for k, v in rates.items() if k != "pid"))
            print(f"prefetch / pinned copy: {rates['um_prefetch_h2d'] / rates['pinned_h2d']:.2f} "
                  "(bitsandbytes' docs: about half)")
        save()

    if "demo" in parts:
        t = time.perf_counter()
        demo = paging.paging_demo(capacity, args.steps, shape=shape)
        results["demo"] = demo
        print(f"\ndemo at {args.capacity_gib:g} GiB, one process per row ({time.perf_counter() - t:.0f} s):")
        print(paging.runs_table(demo["runs"]))
        runs = demo["runs"]
        check("plain AdamW runs out of memory under the cap", runs["adamw"].get("status") == "out of memory")
        for name in paging.DEMO_OPTIMIZERS[1:]:
            check(f"{name} completes", runs[name].get("status") == "ok")
        floor = max((r["steps"][-1]["outside_allocator"] for n, r in runs.items()
                     if not n.startswith("paged") and r.get("steps")), default=0)
        for name in ("paged_adamw_32bit", "paged_adamw_8bit"):
            if runs[name].get("steps"):
                print(f"{name}: outside the allocator {runs[name]['steps'][-1]['outside_allocator'] / GiB:.2f} GiB "
                      f"against the unpaged rows' {floor / GiB:.2f} GiB")
        timeline = runs["paged_adamw_32bit"].get("timeline", [])
        prefetches = [e for e in timeline if e["kind"] == "prefetch"]
        if prefetches:
            results["prefetch_summary"] = {
                "state_bytes": sum(e["state_bytes"] for e in prefetches),
                "prefetch_s": sum(e["end"] - e["start"] for e in prefetches),
                "update_s": sum(e["end"] - e["start"] for e in timeline if e["kind"] == "update")}
            print(f"prefetch timeline (last paged 32-bit step, measured): {results['prefetch_summary']}")
        save()

    if "sweep" in parts:
        rows = paging.isolated_runs([{"optimizer": "paged_adamw_32bit", "shape": shape, "steps": args.steps,
                                       "capacity": int(capacity * f)} for f in (1.6, 1.0, 0.8)])
        results["sweep"] = rows
        fits = rows[0]
        rates = results.get("bandwidth") or isolate.run("course_lib.paging.probe:measure_bandwidths",
                                                        nbytes=256 * 2**20, timeout=60)
        print(f"\n{'capacity':>9} {'measured ms':>11} {'simulated ms':>12} {'simulated GB moved':>18}")
        if fits.get("status") == "ok" and rates.get("status") != "crashed":
            setup = paging.mlp_setup(shape)
            last = fits["steps"][-1]
            flops = 6 * setup.n_params * shape["tokens"] / (last["forward"] + last["backward"])
            cat = setup.bytes_by_category()
            update_bytes = (sum(p.numel * (2 * p.dtype_bytes + setup.grad_bytes) for p in setup.params)
                            + 2 * (cat["optimizer state (paged)"] + cat["optimizer state (ordinary)"]))
            for row in rows:
                hw = paging.Hardware(name="calibrated", memory=row.get("capacity", capacity),
                                     h2d_bandwidth=rates["um_prefetch_h2d"], d2h_bandwidth=rates["um_host_fault_d2h"],
                                     device_bandwidth=update_bytes / max(last["optimizer_step"], 1e-6),
                                     device_flops=flops, pinned_bandwidth=rates["pinned_h2d"])
                sim = paging.simulate(paging.training_trace(setup, [shape["tokens"]] * args.steps), hw,
                                      record_timeline=False)
                stats = None if sim.oom else sim.step_stats(sim.steps[-1])
                row["simulated"] = None if stats is None else {"step_s": stats.total,
                                                               "moved_bytes": stats.h2d_bytes + stats.d2h_bytes}
                measured = 1e3 * median_step(row) if row.get("status") == "ok" else float("nan")
                simulated = f"{1e3 * stats.total:12.1f}" if stats else f"{'OOM':>12}"
                moved = f"{(stats.h2d_bytes + stats.d2h_bytes) / 1e9:18.2f}" if stats else ""
                print(f"{row.get('capacity', 0) / GiB:>8.2f}G {measured:>11.1f} {simulated} {moved}")
            tight = rows[-1]
            if tight.get("status") == "ok":
                check("paging slows the tightest capacity down (measured)", median_step(tight) > 1.2 * median_step(fits))
        save()

    if "spike" in parts:
        plan = paging.spike_plan(capacity, shape)
        tokens = plan["tokens"]
        labels = (("unpaged 32-bit", "adamw_32bit", ()), ("paged, cache kept", "paged_adamw_32bit", ()),
                  ("paged, empty_cache", "paged_adamw_32bit", (plan["spike_step"],)))
        runs = paging.isolated_runs([{"optimizer": name, "shape": shape, "steps": len(tokens), "capacity": plan["capacity"],
                                       "tokens_per_step": tokens, "empty_cache_after": list(flush)}
                                      for _, name, flush in labels])
        spike = dict(zip([label for label, _, _ in labels], runs))
        results["spike"] = {"plan": plan, "runs": spike}
        print(f"\nspike at {plan['capacity'] / GiB:.2f} GiB, tokens per step {tokens} (simulated claims "
              f"{plan['claims']}):")
        for label, run in spike.items():
            times = " ".join(f"{1e3 * s['seconds']:.0f}" for s in run.get("steps", []))
            print(f"  {label:<20} {run.get('status', '?'):<14} step ms (measured): {times}")
        unpaged = spike["unpaged 32-bit"]
        check("unpaged 32-bit AdamW runs out of memory at the spike, not before",
              unpaged.get("status") == "out of memory" and len(unpaged.get("steps", [])) == plan["spike_step"])
        check("paged AdamW survives the spike", spike["paged, cache kept"].get("status") == "ok")
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
