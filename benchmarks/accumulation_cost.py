"""What gradient accumulation costs: time and peak memory vs micro-batch size at a fixed effective batch.

    .venv/bin/python benchmarks/accumulation_cost.py                 # CPU, or the GPU when there is one
    .venv/bin/python benchmarks/accumulation_cost.py --device cpu --plot benchmarks/accumulation_cost.png

Prints one table from one run: the FLOPs PyTorch's counter sees per optimizer step (matrix products
only, so equal for every micro-batch size), the memory traffic of the K-1 additions into `.grad` it
does not see, time per step and peak memory, each also as a ratio to the largest micro-batch, the bytes autograd saves for one
micro-batch (the part that shrinks) and the fixed part (parameters, gradients, AdamW state). Writes a
two-panel plot. Lesson 2, "what accumulation costs", shows the same measurement.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from course_lib.accumulation import format_cost_table, measure_accumulation_cost  # noqa: E402
from course_lib.plots import plot_accumulation_cost  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--effective-batch", type=int, default=64)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[64, 32, 16, 8, 4, 2, 1])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--plot", default=str(Path(__file__).with_suffix(".png")), help="where to write the plot")
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    rows = measure_accumulation_cost(
        args.effective_batch,
        args.micro_batches,
        width=args.width,
        depth=args.depth,
        seq_len=args.seq_len,
        repeats=args.repeats,
        device=device,
    )
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(
        f"effective batch {args.effective_batch} sequences of {args.seq_len} x {args.width}, "
        f"{args.depth}-block MLP, AdamW, on {name}"
    )
    print(format_cost_table(rows))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        title = f"effective batch {args.effective_batch}, {name}"
        plot_accumulation_cost(rows, title=title).savefig(args.plot, dpi=120)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
