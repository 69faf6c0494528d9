"""QLoRA with every trick on, 1B-class, on CUDA: the ablation table, predicted and measured (lesson 5).

Llama 3.2 1B's architecture (bundled config, random weights) fine-tuned with a 4-bit NF4 base
(double quantization), LoRA r=16 on every linear layer, checkpointing, micro-batch 1 x 16
accumulation steps and paged_adamw_8bit, under course_lib.device's precision policy (fp16 autocast +
GradScaler on a T4, bf16 from compute capability 8.0). Each trick is switched off in turn, then all
(a full fine-tune), and the measured peak (`torch.cuda.max_memory_allocated`) and step time are
printed beside `course-lib plan`'s prediction (without the CUDA context). Then a short Trainer run
(loss must fall, gradients must flow), then the effect of PYTORCH_CUDA_ALLOC_CONF=
expandable_segments:True on reserved memory (a fresh process each, since it must be set before
the first CUDA call).

    .venv/bin/python benchmarks/gpu_qlora.py              # the whole table (minutes on a T4)
    .venv/bin/python benchmarks/gpu_qlora.py --seq 256    # other sequence length

On a CPU it prints one line saying that it needs CUDA.
"""

from __future__ import annotations

import argparse
import sys

import torch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--accum", type=int, default=16)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_qlora.py needs a CUDA GPU (the 1B-class configuration); on a CPU run the lesson 5 notebook")
        return 0
    from course_lib import qlora
    from course_lib.checkpointing import assert_gradients_flow
    from course_lib.device import dtype_policy

    device = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}: {dtype_policy(device).reason}")
    config = qlora.llama_1b_config()
    recipe = qlora.Recipe(seq=args.seq, batch=1, accum=args.accum)
    rows = qlora.ablation(config, recipe, device, timed_steps=2)
    print(qlora.format_ablation(rows))

    data = qlora.counting_dataset(64, 128, config.vocab_size)
    result = qlora.train(config, qlora.Recipe(seq=128, accum=4), data, max_steps=15, learning_rate=2e-3,
                         device=device)
    print(f"Trainer, 15 steps: loss {result.losses[0]:.3f} -> {result.losses[-1]:.3f} in {result.seconds:.1f} s")
    ids = torch.randint(0, config.vocab_size, (1, 64), device=device)
    assert_gradients_flow(result.model, {"input_ids": ids, "labels": ids})
    print("assert_gradients_flow: every LoRA parameter gets a gradient")

    print("expandable_segments (fresh process each, all tricks on, accum 4):")
    for value, peaks in qlora.expandable_segments_effect("1b", args.seq, 4).items():
        print(f"  expandable_segments:{value:<5}  allocated {peaks['allocated'] / 2**20:8.1f} MiB  "
              f"reserved {peaks['reserved'] / 2**20:8.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
