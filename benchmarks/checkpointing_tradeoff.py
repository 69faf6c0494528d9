"""Gradient checkpointing, measured: peak memory and step time against the plan (lesson 3).

For each model, every plan is applied to the same model and batch; one training step is measured with
course_lib.measure.measure_step (the live-storage tracker on CPU, the allocator's peak on CUDA) and
timed (fastest of --repeats). Beside the measurement: the cost model's prediction (refined with the
profiled transients, and the simple one that knows only saved and input sizes), its error, and the
recompute cost by FLOPs. A last table shows what one decoder layer stores against sequence length,
eager attention against SDPA (the s^2 term).

    .venv/bin/python benchmarks/checkpointing_tradeoff.py            # CPU, a few minutes
    .venv/bin/python benchmarks/checkpointing_tradeoff.py --quick    # smaller, under a minute
    python benchmarks/checkpointing_tradeoff.py --device cuda --scale 8 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from dataclasses import asdict

import torch

from course_lib.checkpointing import (
    default_plans,
    format_tradeoff,
    measure_tradeoff,
    mlp_stack,
    profile_stack,
    tiny_decoder,
)
from course_lib.measure import MiB

warnings.filterwarnings("ignore", message=".*use_reentrant.*")


def cases(device: torch.device, scale: int, quick: bool):
    """(name, model, loss_fn, inputs) for each model of the benchmark, built on `device`."""
    torch.manual_seed(0)
    n = 8 if quick else 16
    batch = (512 if quick else 2048) * scale
    for activation, note in (
        ("relu", "each layer stores only its input"),
        ("gelu", "each layer stores twice its input"),
    ):
        model = mlp_stack(n, 256, activation).to(device)
        x = torch.randn(batch, 256, device=device)
        yield (
            f"MLP {n} x (Linear 256 + {activation.upper()}), batch {batch}: {note}",
            model,
            (lambda model=model, x=x: model(x).pow(2).mean()),
            [x],
        )
    layers = 8 if quick else 16
    seq = (128 if quick else 256) * min(scale, 8)
    for attn in ("sdpa", "eager"):
        model = tiny_decoder(
            "llama", n_layers=layers, hidden=128 * min(scale, 4), heads=4, attn_implementation=attn
        ).to(device)
        ids = torch.randint(0, 512, (4, seq), device=device)
        yield (
            f"Llama architecture (from config), {layers} layers, hidden {128 * min(scale, 4)}, "
            f"batch 4 x {seq} tokens, {attn} attention",
            model,
            (lambda model=model, ids=ids: model(input_ids=ids, labels=ids).loss),
            [ids],
        )


def attention_table(device: torch.device, quick: bool) -> list[dict]:
    """Bytes one decoder layer saves for backward against sequence length, eager vs SDPA."""
    rows = []
    hidden, batch = 128, 2
    for seq in (64, 128, 256) if quick else (128, 256, 512, 1024):
        row = {"seq": seq}
        for attn in ("sdpa", "eager"):
            torch.manual_seed(0)
            model = tiny_decoder("llama", n_layers=2, hidden=hidden, heads=4, attn_implementation=attn).to(device)
            ids = torch.randint(0, 512, (batch, seq), device=device)
            profile = profile_stack(model, lambda: model(input_ids=ids, labels=ids).loss, [ids])
            row[attn] = profile.saved_bytes[1]
        row["sbh"] = seq * batch * hidden * 4  # one fp32 hidden state
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", help="auto (CUDA when available), cpu or cuda")
    parser.add_argument("--quick", action="store_true", help="smaller models and fewer plans")
    parser.add_argument("--scale", type=int, default=1, help="multiply batch and widths (for a GPU)")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per plan (fastest counts)")
    parser.add_argument(
        "--selective",
        action="store_true",
        help="also run every plan with the selective policies (korthikanti, save-matmuls, save-all)",
    )
    parser.add_argument("--json", help="write the rows to this file")
    parser.add_argument(
        "--threads", type=int, default=1, help="CPU threads for torch (default 1: small shapes time steadier on one)"
    )
    args = parser.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        print("checkpointing_tradeoff: --device cuda but no CUDA GPU here", file=sys.stderr)
        return 2
    if args.scale < 1 or args.repeats < 0:
        print("checkpointing_tradeoff: --scale must be >= 1 and --repeats >= 0", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    if device.type == "cpu" and args.threads > 0:
        torch.set_num_threads(args.threads)
    print(
        f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}), "
        f"torch {torch.__version__}; peaks above what was live before the step, MiB"
    )
    print(
        "err: refined cost model vs measured; simple: saved + input sizes alone (all gradients added); "
        "recompute: extra forward FLOPs / one forward, predicted and measured (FlopCounterMode); "
        "time: vs the first row\n"
    )
    policies = ("full", "korthikanti", "save-matmuls", "save-all") if args.selective else ("full",)
    results = {"device": str(device), "torch": torch.__version__, "models": [], "attention": []}
    started = time.perf_counter()
    for name, model, loss_fn, inputs in cases(device, args.scale, args.quick):
        profile = profile_stack(model, loss_fn, inputs)
        plans = default_plans(profile)
        if args.quick:
            plans = {
                k: v
                for k, v in plans.items()
                if k in ("1 segments", "2 segments", "every-layer", "sqrt", "optimal @ sqrt peak")
            }
        rows = measure_tradeoff(
            model, loss_fn, inputs, plans, repeats=args.repeats, policies=policies, profile=profile, recompute=True
        )
        best = min(rows, key=lambda r: r.measured_peak)
        print(format_tradeoff(rows, name))
        print(
            f"lowest measured peak: {best.plan} ({best.measured_peak / MiB:.2f} MiB); "
            f"per layer: stores {profile.saved_bytes[0] / MiB:.2f} MiB, input {profile.input_bytes[0] / MiB:.2f} MiB\n"
        )
        results["models"].append({"name": name, "profile": asdict(profile), "rows": [asdict(r) for r in rows]})
    print("What one decoder layer saves for backward (MiB) against sequence length; sbh: one fp32 hidden state")
    print(f"{'seq':>6} {'sdpa':>9} {'eager':>9} {'sdpa/sbh':>9} {'eager/sbh':>10}")
    for row in attention_table(device, args.quick):
        print(
            f"{row['seq']:>6} {row['sdpa'] / MiB:9.2f} {row['eager'] / MiB:9.2f} "
            f"{row['sdpa'] / row['sbh']:9.1f} {row['eager'] / row['sbh']:10.1f}"
        )
        results["attention"].append(row)
    print(f"\n({time.perf_counter() - started:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
