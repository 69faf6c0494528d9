"""Lesson 4 on the simulator: the three paging regimes, bitsandbytes' 125 ms/GB (an input of the
simulator, not a result), the driver's policy against the seed's, paging against offload, 8-bit state
and LoRA, and the simulator's own speed. Every figure is simulated, from `Hardware.t4()`'s inputs.
Runs on CPU in seconds.

    python benchmarks/paging_regimes.py
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from course_lib import paging as pg  # noqa: E402


def main() -> int:
    hw = pg.Hardware.t4()
    print(
        f"Device: {hw.name}, {pg.format_bytes(hw.memory)} usable, unified-memory transfers at "
        f"{hw.h2d_bandwidth / 1e9:.2f} GB/s in, {hw.d2h_bandwidth / 1e9:.2f} GB/s out\n"
    )

    t = time.perf_counter()
    regimes = pg.regimes(hw)
    elapsed = time.perf_counter() - t
    print("Regimes, simulated (paged 32-bit AdamW; unpaged = torch AdamW on the same device)")
    print(f"{'regime':<10} {'params':>7} {'paged':>10} {'worst step':>10} {'last step':>9} {'unpaged':>14}")
    for name, r in regimes.items():
        unpaged = f"OOM in step {r.unpaged.oom.step}" if r.unpaged.oom else "fits"
        print(
            f"{name:<10} {r.setup.n_params / 1e9:>6.2f}B {'completes' if r.paged.oom is None else 'OOM':>10} "
            f"{r.worst_slowdown:>9.2f}x {r.steady_slowdown:>8.2f}x {unpaged:>14}"
        )
    spike = regimes["spike"]
    kept = pg.simulate(pg.training_trace(spike.setup, list(spike.tokens_per_step)), hw, record_timeline=False)
    print(
        f"spike without empty_cache: last step {kept.slowdown(kept.steps[-1]):.2f}x "
        "(the allocator keeps the spike's memory reserved)\n"
    )

    print(
        "bitsandbytes' estimate, 1 GB evicted per step on PCIe 3.0 x16 costs 125 ms, is the simulator's input "
        "(half the link); the way out comes on top"
    )
    print(f"{'link':<40} {'evicted GB':>10} {'in ms/GB':>9} {'out ms/GB':>9} {'total ms/GB':>11} {'vs 125':>7}")
    for link in (pg.Hardware.pcie3_x16(), hw):
        cost = pg.evicted_per_step_cost(1.0, link)
        print(
            f"{link.name:<40} {cost['evicted_gb']:>10.3f} {cost['ms_per_gb_in']:>9.1f} {cost['ms_per_gb_out']:>9.1f} "
            f"{cost['ms_per_gb_total']:>11.1f} {cost['ms_per_gb_in'] / 125:>6.2f}x"
        )
    print()

    thrash = regimes["thrashing"].setup
    print("Policy and granularity on the thrashing model (steady step, simulated). Without prefetch the fault")
    print("counts are illustrative: the driver services faults in batches, and the simulator has no time for them")
    print(f"{'policy':<42} {'prefetch':>8} {'slowdown':>9} {'faults':>9} {'migrated':>11} {'sim s':>6}")
    policies = [
        ("driver: 64K pages, 2M chunks, alloc order", pg.Policy.driver()),
        ("2M blocks, alloc order", pg.Policy(granularity=2 * pg.MiB)),
        ("LRU (2M chunks)", pg.Policy(eviction="lru")),
        ("seed: 4K pages, 4K LRU", pg.Policy.seed()),
        ("MRU (2M chunks)", pg.Policy(eviction="mru")),
    ]
    for label, policy in policies:
        for use_prefetch in (True, False):
            t = time.perf_counter()
            r = pg.simulate(
                pg.training_trace(thrash, [2048] * 3, use_prefetch=use_prefetch), hw, policy, record_timeline=False
            )
            sim_s = time.perf_counter() - t
            st = r.step_stats(2)
            slowdown = f"{r.slowdown(2):>8.2f}x" if use_prefetch else f"{'-':>9}"
            print(
                f"{label:<42} {'yes' if use_prefetch else 'no':>8} {slowdown} {st.faults:>9} "
                f"{pg.format_bytes(st.h2d_bytes):>11} {sim_s:>6.2f}"
            )
    print()

    print("Steady-step slowdown by strategy, simulated (T4 inputs; OOM: out of memory)")
    rows = pg.compare_strategies(hardware=hw)
    labels = list(rows[0].slowdown)
    print(f"{'params':>7} {'unpaged':>8} " + " ".join(f"{label:>12}" for label in labels))
    for row in rows:
        cells = " ".join(f"{'OOM' if v is None else f'{v:.2f}x':>12}" for v in row.slowdown.values())
        print(f"{row.n_params / 1e9:>6.2f}B {'fits' if row.unpaged_fits else 'OOM':>8} {cells}")
    fast_cpu = pg.compare_strategies((20,), hardware=replace(hw, cpu_adam_rate=4e9))[0]
    print(
        f"with a 4e9 params/s host AdamW (many cores) at {fast_cpu.n_params / 1e9:.2f}B: CPU offload "
        f"{fast_cpu.slowdown['CPU offload']:.2f}x vs paged 32-bit {fast_cpu.slowdown['paged 32-bit']:.2f}x"
    )
    print(
        f"\nSimulator speed: the three regimes ({sum(len(r.paged.steps) + len(r.unpaged.steps) for r in regimes.values())} "
        f"simulated steps) in {elapsed:.2f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
