"""QLoRA with every trick on, 1B-class, on CUDA: the ablation table, predicted and measured (lesson 5).

Llama 3.2 1B's architecture (bundled config, random weights) fine-tuned with a 4-bit NF4 base
(double quantization), LoRA r=16 on every linear layer, checkpointing, micro-batch 1 x 16
accumulation steps and paged_adamw_8bit, under course_lib.device's precision policy (fp16 autocast +
GradScaler on a T4, bf16 from compute capability 8.0). Each trick is switched off in turn, then all
(a full fine-tune), and the measured peak (`torch.cuda.max_memory_allocated`, plus the paged
optimizer state) and step time are printed beside `course-lib plan`'s prediction (without the CUDA
context); rows the planner predicts not to fit are not run, and a row that runs out of memory says
so. Then a short Trainer run (loss must fall, gradients must flow), then the effect of
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True on reserved memory (a fresh process each, since it
must be set before the first CUDA call).

    python benchmarks/gpu_qlora.py              # the device's own precision and memory
    python benchmarks/gpu_qlora.py --as-t4      # Colab's T4 on a larger GPU: fp16 + GradScaler, 15 GiB cap
    python benchmarks/gpu_qlora.py --seq 256    # another sequence length

The numbers also go to --json (default $OUT/gpu_qlora.json, or gpu_qlora_t4.json with --as-t4, when
the device tool's $OUT is set). benchmarks/gpu_check.sh runs it. On a CPU it prints one line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--accum", type=int, default=16)
    parser.add_argument("--as-t4", action="store_true",
                        help="the T4 recipe (fp16 autocast + GradScaler) under a 15 GiB memory cap")
    parser.add_argument("--json", type=Path, default=None, help="write every number here")
    args = parser.parse_args(argv)
    if args.json is None and os.environ.get("OUT"):
        args.json = Path(os.environ["OUT"]) / ("gpu_qlora_t4.json" if args.as_t4 else "gpu_qlora.json")
    if not torch.cuda.is_available():
        print("gpu_qlora.py needs a CUDA GPU (the 1B-class configuration); on a CPU run the lesson 5 notebook")
        return 0
    import bitsandbytes
    import peft
    import transformers

    from course_lib import qlora
    from course_lib.checkpointing import assert_gradients_flow
    from course_lib.device import dtype_policy
    from course_lib.measure import format_bytes

    device = torch.device("cuda")
    policy, gpu = qlora.emulate_t4(device) if args.as_t4 else (dtype_policy(device), None)
    results = {"device": torch.cuda.get_device_name(), "as_t4": args.as_t4, "policy": policy.reason,
               "versions": {m.__name__: m.__version__ for m in (torch, transformers, peft, bitsandbytes)},
               "seq": args.seq, "accum": args.accum}

    def save() -> None:
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(results, indent=1, default=str))

    print(f"{results['device']}{' as a T4' if args.as_t4 else ''}: {policy.reason}; {results['versions']}")
    config = qlora.llama_1b_config()
    recipe = qlora.Recipe(seq=args.seq, batch=1, accum=args.accum)
    rows = qlora.ablation(config, recipe, device, timed_steps=2, policy=policy, gpu=gpu)
    print(qlora.format_ablation(rows))
    results["ablation"] = [{**asdict(r), "recipe": r.recipe.describe(), "error": r.error} for r in rows]
    save()

    data = qlora.counting_dataset(64, 128, config.vocab_size)
    result = qlora.train(config, qlora.Recipe(seq=128, accum=4), data, max_steps=15, learning_rate=2e-3,
                         device=device, policy=policy)
    print(f"Trainer, 15 steps: loss {result.losses[0]:.3f} -> {result.losses[-1]:.3f} in {result.seconds:.1f} s")
    ids = torch.randint(0, config.vocab_size, (1, 64), device=device)
    assert_gradients_flow(result.model, {"input_ids": ids, "labels": ids})
    print("assert_gradients_flow: every LoRA parameter gets a gradient")
    results["trainer"] = {"losses": result.losses, "seconds": result.seconds, "gradients_flow": True}
    del result
    save()

    print("expandable_segments (fresh process each, all tricks on, accum 4):")
    effect = qlora.expandable_segments_effect("1b", args.seq, 4, as_t4=args.as_t4)
    for value, peaks in effect.items():
        print(f"  expandable_segments:{value:<5}  allocated {format_bytes(peaks['allocated']):>11}  "
              f"reserved {format_bytes(peaks['reserved']):>11}")
    results["expandable_segments"] = effect
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
