"""Lesson 5 on CUDA: the QLoRA ablation (1B-class), measured beside the planner, one process per row.

    python benchmarks/gpu_qlora.py [--part smoke|ablation|precision|trainer|expandable|all] [--as-t4]
                                   [--seq 512] [--accum 4] [--json PATH]

Parts:
- smoke: the imports, one paged tensor filled and prefetched, one step of a tiny QLoRA model: what
  must work before anything else is worth running;
- ablation: Llama 3.2 1B's architecture (bundled config, random weights saved once) with a 4-bit NF4
  base, LoRA r=16 on every linear layer, checkpointing, accumulation and paged_adamw_8bit; each trick
  off in turn, then all; each row in its own process; measured peak beside `course-lib plan`'s
  prediction (without the CUDA context) and the error, reported (rows the planner predicts not to fit
  are not run; a row that runs out of memory or crashes says so);
- precision: the reason a T4 trains in fp16: measured matmul TFLOP/s in fp32, fp16 and bf16;
- trainer: a short Hugging Face Trainer run (the loss must fall, every LoRA parameter a gradient);
- expandable: expandable_segments:False and :True, a fresh process each, set in PYTORCH_ALLOC_CONF
  (which torch >= 2.9 reads first) and PYTORCH_CUDA_ALLOC_CONF, peak allocated and reserved of the
  training step alone.
`--as-t4` runs the T4's recipe on a larger GPU: fp16 autocast + GradScaler, the allocator capped at
15 GiB. None of them asks for more managed memory than a few MiB per paged optimizer state (LoRA's).
The numbers go to --json after every row, atomically (default $OUT/gpu_qlora[_t4].json when $OUT is
set). benchmarks/gpu_check.sh runs each part with a time budget (GPU_CHECK_PART_SECONDS: a row's
process is stopped 5 s before it). On a CPU it prints one line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PARTS = ("smoke", "ablation", "precision", "trainer", "expandable")


def smoke(out: dict, save) -> None:
    """Thirty seconds that say whether the rest can work: imports, a paged tensor, a tiny QLoRA step;
    `out` filled and `save()` called after each."""
    import bitsandbytes as bnb
    import peft
    import torch
    import transformers

    from course_lib import qlora
    from course_lib.paging import probe

    out.update(
        versions={m.__name__: m.__version__ for m in (torch, transformers, peft, bnb)},
        cuda=torch.version.cuda,
        device=torch.cuda.get_device_name(),
        capability=list(torch.cuda.get_device_capability()),
    )
    save()
    paged = probe.managed_buffer(8 * 2**20)
    out["paged_fill_s"] = probe.gpu_touch(paged)
    out["paged_prefetch_s"] = probe.gpu_prefetch(paged)
    out["paged_bytes_read_back"] = int(paged[:4096].sum())  # 4096: fill wrote ones, the host reads them
    save()
    t = time.perf_counter()
    row = qlora.measure_recipe(qlora.tiny_llama_config(), qlora.Recipe(seq=32, accum=1), "cuda")
    out["tiny_qlora"] = {
        "status": row.status,
        "measured_peak": row.measured_peak,
        "predicted_peak": row.predicted_peak,
        "error": row.error,
        "measured_reserved": row.measured_reserved,
        "predicted_reserved": row.predicted_reserved,
        "seconds": time.perf_counter() - t,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=(*PARTS, "all"), default="all")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--accum", type=int, default=4)
    parser.add_argument(
        "--as-t4", action="store_true", help="the T4 recipe (fp16 autocast + GradScaler) under a 15 GiB memory cap"
    )
    parser.add_argument("--json", type=Path, default=None, help="write every number here")
    args = parser.parse_args(argv)
    if args.json is None and os.environ.get("OUT"):
        args.json = Path(os.environ["OUT"]) / ("gpu_qlora_t4.json" if args.as_t4 else "gpu_qlora.json")

    import torch

    if not torch.cuda.is_available():
        print("gpu_qlora.py needs a CUDA GPU (the 1B-class configuration); on a CPU run the lesson 5 notebook")
        return 0
    from results_io import write_json

    from course_lib import isolate, qlora
    from course_lib.measure import format_bytes

    deadline = time.monotonic() + float(os.environ.get("GPU_CHECK_PART_SECONDS", "inf")) - 5

    parts = PARTS if args.part == "all" else (args.part,)
    results: dict = {"as_t4": args.as_t4, "seq": args.seq, "accum": args.accum}

    def save() -> None:
        if args.json:
            write_json(args.json, results)

    if "smoke" in parts:
        smoke(results.setdefault("smoke", {}), save)
        print(json.dumps(results["smoke"], indent=1, default=str))
        save()
    config = qlora.llama_1b_config()
    if "ablation" in parts:
        t = time.perf_counter()

        def partial(rows) -> None:  # a part cut short by its time budget still brings back its rows
            results["ablation"] = [{**asdict(r), "recipe": r.recipe.describe(), "error": r.error} for r in rows]
            save()

        rows = qlora.ablation(
            config, qlora.Recipe(seq=args.seq, batch=1, accum=args.accum), "cuda", as_t4=args.as_t4, progress=partial
        )
        print(
            f"ablation{' as a T4' if args.as_t4 else ''}, one process per row ({time.perf_counter() - t:.0f} s; "
            "measured peaks, planner predictions, error = (predicted - measured) / measured):"
        )
        print(qlora.format_ablation(rows))
        print("max_memory_reserved, measured (the row's process) and predicted (the planner's reserved):")
        for r in rows:
            shown = [format_bytes(v) if v is not None else "-" for v in (r.measured_reserved, r.predicted_reserved)]
            print(f"  {r.label:<40} {shown[0]:>12} {shown[1]:>12}")
        results["ablation"] = [{**asdict(r), "recipe": r.recipe.describe(), "error": r.error} for r in rows]
        save()
    if "precision" in parts:
        rates = qlora.matmul_rates()
        results["matmul_tflops"] = rates
        print("matmul TFLOP/s (measured): " + ", ".join(f"{k} {v:.1f}" for k, v in rates.items()))
        save()
    if "trainer" in parts:
        folder = str(qlora.checkpoint_dir(config))
        run = isolate.run(
            "course_lib.qlora.gpu_rows:train_row",
            config_dir=folder,
            seq=128,
            accum=4,
            max_steps=15,
            as_t4=args.as_t4,
            timeout=max(1.0, deadline - time.monotonic()),
        )
        results["trainer"] = run
        if run.get("status") == "ok":
            print(
                f"Trainer, 15 steps (measured): loss {run['losses'][0]:.3f} -> {run['losses'][-1]:.3f} in "
                f"{run['seconds']:.1f} s; {run['gradients_flow']}"
            )
        else:
            print(f"Trainer run: {run}")
        save()
    if "expandable" in parts:
        folder = str(qlora.checkpoint_dir(config))
        effect = results["expandable_segments"] = {}
        for value in ("False", "True"):  # as qlora.expandable_segments_effect, saved after each
            setting = f"expandable_segments:{value}"
            effect[value] = isolate.run(
                "course_lib.qlora.gpu_rows:expandable_row",
                config_dir=folder,
                seq=args.seq,
                accum=args.accum,
                as_t4=args.as_t4,
                timeout=max(1.0, deadline - time.monotonic()),
                env={"PYTORCH_ALLOC_CONF": setting, "PYTORCH_CUDA_ALLOC_CONF": setting},
            )
            save()
        print("expandable_segments, the training step alone (measured, a fresh process each):")
        for value, peaks in effect.items():
            if peaks.get("status") != "ok":
                print(f"  expandable_segments:{value:<5}  {peaks.get('status')}: {peaks.get('error')}")
                continue
            print(
                f"  expandable_segments:{value:<5}  allocated {format_bytes(peaks['allocated_peak']):>12}  "
                f"reserved {format_bytes(peaks['reserved_peak']):>12}"
            )
        save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
