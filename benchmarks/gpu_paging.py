"""Lesson 4 on a real CUDA GPU: paged optimizers measured, and the simulator checked against them.

    python benchmarks/gpu_paging.py [--capacity-gib 4] [--steps 5] [--json results.json]

A big GPU is made to look `--capacity-gib` big (a balloon of ordinary memory takes the rest, and
`torch.cuda.set_per_process_memory_fraction` caps PyTorch there). Then:
1. link: pinned copies and unified-memory prefetches, both ways (bitsandbytes says prefetch gets
   about half of the link);
2. demo: plain AdamW runs out of memory; bitsandbytes PagedAdamW 32-bit and 8-bit complete; manual
   CPU offload completes; step times, memory allocated / reserved / used (as nvidia-smi shows it);
   the prefetch timeline of one paged step;
3. sweep: paged 32-bit AdamW at several capacities, measured step time against the simulator's
   prediction (calibrated with the measured link and compute speed): ms per GB evicted;
4. spike: one long batch; the steps after it with and without `torch.cuda.empty_cache()`.
It prints PASS/FAIL for what lesson 4 claims and exits 1 on a FAIL. On CPU it prints one line.
benchmarks/gpu_check.sh runs it with the rest of the GPU check; the numbers go to --json (by default
$OUT/gpu_paging.json when the device tool's $OUT is set).
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


def median_step(run: dict, skip: int = 1) -> float:
    times = [s["seconds"] for s in run["steps"][skip:]] or [s["seconds"] for s in run["steps"]]
    return statistics.median(times) if times else float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capacity-gib", type=float, default=4.0, help="the small GPU to emulate (GiB)")
    parser.add_argument("--steps", type=int, default=5, help="training steps per run")
    parser.add_argument("--json", type=Path, default=Path(os.environ["OUT"]) / "gpu_paging.json" if os.environ.get("OUT")
                        else None, help="write every number here (default: $OUT/gpu_paging.json when $OUT is set)")
    parser.add_argument("--skip-sweep", action="store_true", help="only the link, the demo and the spike")
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("gpu_paging.py needs a CUDA GPU (paged optimizers fall back to unpaged on CPU); "
              "on CPU, benchmarks/paging_regimes.py shows the simulator's version.")
        return 0

    import bitsandbytes

    from course_lib import offload, paging

    capacity = int(args.capacity_gib * GiB)
    shape = offload.demo_shape(capacity)
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                     "bitsandbytes": bitsandbytes.__version__, "capacity": capacity, "shape": shape}
    checks: list[tuple[str, bool]] = []

    def save() -> None:
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({**results, "checks": checks}, indent=1, default=str))

    print(f"{results['device']}: torch {torch.__version__}, bitsandbytes {bitsandbytes.__version__}; "
          f"emulating a {args.capacity_gib:g} GiB GPU; model {shape}")

    # 1. the link
    try:
        bw = offload.measure_bandwidths()
    except Exception as error:  # keep going: the demo does not need it
        bw = None
        results["bandwidth_error"] = repr(error)
        checks.append((f"measure the link ({error!r})", False))
    if bw:
        results["bandwidth"] = bw
        print("\nlink (GB/s): " + ", ".join(f"{k} {v / 1e9:.2f}" for k, v in bw.items()))
        print(f"unified-memory prefetch / pinned copy: in {bw['um_prefetch_h2d'] / bw['pinned_h2d']:.2f}, "
              f"out {bw['um_prefetch_d2h'] / bw['pinned_d2h']:.2f} (bitsandbytes: about half)")
    save()

    # 2. the demo
    t = time.perf_counter()
    demo = offload.paging_demo(capacity, args.steps, shape=shape)
    results["demo"] = demo
    print(f"\ndemo at {args.capacity_gib:g} GiB ({time.perf_counter() - t:.0f} s); "
          f"used before training {demo['used_at_start'] / GiB:.2f} GiB")
    print(offload.runs_table(demo["runs"]))
    runs = demo["runs"]
    checks.append(("plain AdamW runs out of memory under the cap", runs["adamw"]["status"] == "out of memory"))
    for name in ("paged_adamw_32bit", "paged_adamw_8bit", "cpu_offload_adamw"):
        checks.append((f"{name} completes", runs[name]["status"] == "ok"))
    timeline = runs["paged_adamw_32bit"].get("timeline", [])
    prefetches = [e for e in timeline if e["kind"] == "prefetch"]
    if prefetches:
        moved = sum(e["state_bytes"] for e in prefetches)
        spent = sum(e["end"] - e["start"] for e in prefetches)
        updates = sum(e["end"] - e["start"] for e in timeline if e["kind"] == "update")
        print(f"prefetch timeline (last paged 32-bit step): {len(prefetches)} prefetches of "
              f"{moved / GiB:.2f} GiB state took {1e3 * spent:.1f} ms, updates {1e3 * updates:.1f} ms")
        results["prefetch_summary"] = {"state_bytes": moved, "prefetch_s": spent, "update_s": updates}
    save()

    # 3. the sweep: measured against the simulator
    if not args.skip_sweep and bw:
        setup = offload.mlp_setup(shape)
        sweep = []
        for factor in (1.6, 1.25, 1.0, 0.85):
            cap = int(capacity * factor)
            with offload.VirtualGPU(cap) as gpu:
                baseline = gpu.baseline
                run = offload.run_training("paged_adamw_32bit", shape, max(4, args.steps), gpu).to_dict()
            sweep.append({"capacity": cap, "baseline": baseline, "run": run})
            print(f"  sweep {cap / GiB:.2f} GiB: {run['status']}, median step {1e3 * median_step(run):.1f} ms")
        fits = sweep[0]["run"]
        if fits["status"] == "ok":
            last = fits["steps"][-1]
            compute = last["forward"] + last["backward"]
            flops = 6 * setup.n_params * shape["tokens"] / compute
            cat = setup.bytes_by_category()
            update_bytes = (sum(p.numel * (2 * p.dtype_bytes + setup.grad_bytes) for p in setup.params)
                            + 2 * (cat["optimizer state (paged)"] + cat["optimizer state (ordinary)"]))
            device_bw = update_bytes / max(last["optimizer_step"], 1e-6)  # what the update moves, measured
            print(f"\n{'capacity':>9} {'measured ms':>11} {'simulated ms':>12} {'ratio':>6} {'sim moved':>10} "
                  f"{'measured ms/GB':>14}")
            base_ms = 1e3 * median_step(fits)
            for row in sweep:
                hw = paging.Hardware(name=results["device"], memory=row["capacity"] - row["baseline"],
                                     h2d_bandwidth=bw["um_prefetch_h2d"], d2h_bandwidth=bw["um_prefetch_d2h"],
                                     device_bandwidth=device_bw, device_flops=flops,
                                     pinned_bandwidth=bw["pinned_h2d"])
                sim = paging.simulate(paging.training_trace(setup, [shape["tokens"]] * max(4, args.steps)), hw,
                                      record_timeline=False)
                row["simulated"] = None if sim.oom else {
                    "step_s": sim.step_time(sim.steps[-1]),
                    "moved_bytes": sim.step_stats(sim.steps[-1]).h2d_bytes + sim.step_stats(sim.steps[-1]).d2h_bytes,
                    "evicted_bytes": sim.step_stats(sim.steps[-1]).d2h_bytes}
                measured = 1e3 * median_step(row["run"]) if row["run"]["status"] == "ok" else float("nan")
                if row["simulated"] is None:
                    print(f"{row['capacity'] / GiB:>8.2f}G {measured:>11.1f} {'OOM':>12}")
                    continue
                simulated = 1e3 * row["simulated"]["step_s"]
                evicted_gb = row["simulated"]["evicted_bytes"] / 1e9
                per_gb = (measured - base_ms) / evicted_gb if evicted_gb > 0.05 else float("nan")
                row["measured_ms_per_gb_evicted"] = per_gb
                print(f"{row['capacity'] / GiB:>8.2f}G {measured:>11.1f} {simulated:>12.1f} "
                      f"{measured / simulated:>6.2f} {row['simulated']['moved_bytes'] / GiB:>8.2f}Gi {per_gb:>14.1f}")
            link_ms_per_gb = 1e3 * 1e9 / bw["pinned_h2d"]
            print(f"(a pinned copy of 1 GB takes {link_ms_per_gb:.1f} ms on this link; bitsandbytes' estimate is "
                  f"1 GB at half the link: {2 * link_ms_per_gb:.1f} ms)")
            tight = sweep[-1]["run"]
            if tight["status"] == "ok":
                checks.append(("paging slows the tightest capacity down", median_step(tight) > 1.2 * median_step(fits)))
        results["sweep"] = sweep
        save()

    # 4. the spike
    spike_cap = int(capacity * 1.6)
    tokens = [shape["tokens"]] * 2 + [5 * shape["tokens"]] + [shape["tokens"]] * 3
    spike = {}
    for label, name, flush in (("adamw", "adamw", ()), ("paged, cache kept", "paged_adamw_32bit", ()),
                               ("paged, empty_cache", "paged_adamw_32bit", (2,))):
        with offload.VirtualGPU(spike_cap) as gpu:
            spike[label] = offload.run_training(name, shape, len(tokens), gpu, tokens, flush).to_dict()
    results["spike"] = {"capacity": spike_cap, "tokens": tokens, "runs": spike}
    print(f"\nspike at {spike_cap / GiB:.2f} GiB, tokens per step {tokens}:")
    for label, run in spike.items():
        times = " ".join(f"{1e3 * s['seconds']:.0f}" for s in run["steps"])
        print(f"  {label:<20} {run['status']:<14} step ms: {times}")
    checks.append(("plain AdamW runs out of memory at the spike", spike["adamw"]["status"] == "out of memory"))
    checks.append(("paged AdamW survives the spike", spike["paged, cache kept"]["status"] == "ok"))
    save()

    print()
    for what, ok in checks:
        print(f"{'PASS' if ok else 'FAIL'} {what}")
    save()
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
