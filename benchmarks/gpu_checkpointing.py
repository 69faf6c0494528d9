"""Lesson 3's checks on a CUDA GPU, as one short script: what the CPU tests assert, at GPU shapes, with the
allocator's peak (course_lib.measure.measure_step on CUDA) instead of the CPU tracker.

    python benchmarks/gpu_checkpointing.py --out results_dir      # on the GPU machine, about a minute
    .venv/bin/python benchmarks/gpu_checkpointing.py --allow-cpu --quick   # smoke run of the script here

It checks, and prints as tables (written to OUT/gpu_checkpointing.txt and .json too):
  1. loss and gradients under plans with multi-layer segments and gaps, and under the selective
     policies, equal the unchecked run, on every bundled architecture (Gemma-2's sliding layers too);
  2. the cost model (refined and simple) against the measured peak for the trade-off of an MLP and a
     decoder, on CUDA; the sqrt plan within 15% and below every-layer on the GELU MLP;
  3. Hugging Face's one-liner against apply_plan("every-layer");
  4. full against the selective policies (Korthikanti's, save-matmuls, the save-all control), eager and
     SDPA: memory, measured recompute and step time;
  5. the seed's "every layer: 1.40x" time ratio, measured.
Exit status 1 when a check fails (the tables are printed first).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from dataclasses import asdict

import torch

from course_lib.checkpointing import (
    apply_plan,
    default_plans,
    format_tradeoff,
    hf_checkpointing,
    measure_plan,
    measure_tradeoff,
    mlp_stack,
    profile_stack,
    time_plans,
    tiny_decoder,
)
from course_lib.measure import MiB, measure_step

warnings.filterwarnings("ignore", message=".*(use_reentrant|deprecated).*")


class Report:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.failures: list[str] = []
        self.data: dict = {}

    def say(self, text: str = "") -> None:
        print(text, flush=True)
        self.lines.append(text)

    def check(self, ok: bool, what: str) -> None:
        self.say(f"{'PASS' if ok else 'FAIL'}  {what}")
        if not ok:
            self.failures.append(what)


def grads_equal(report: Report, device: torch.device, quick: bool) -> None:
    from course_lib.checkpointing import ARCHITECTURES

    hidden, seq = (64, 64) if quick else (256, 512)
    for arch in ARCHITECTURES:
        model = tiny_decoder(arch, n_layers=4, hidden=hidden, heads=4, vocab=512, sliding_window=seq // 4).to(device)
        ids = torch.randint(0, 512, (2, seq), device=device)
        loss_fn = lambda: model(input_ids=ids, labels=ids).loss  # noqa: E731

        def grads():
            model.zero_grad(set_to_none=True)
            loss = loss_fn()
            loss.backward()
            out = [loss.detach()] + [p.grad.detach().clone() for p in model.parameters()]
            model.zero_grad(set_to_none=True)
            return out

        reference = grads()
        for plan, policy in (
            ([(0, 2), (3, 4)], "full"),
            ("sqrt", "full"),
            ([(0, 3)], "korthikanti"),
            ("every-2", "save-matmuls"),
        ):
            with apply_plan(model, plan, policy=policy):
                got = grads()
            worst = max(float((a - b).abs().max() / (b.abs().max() + 1e-12)) for a, b in zip(got, reference))
            report.check(
                worst < 1e-4,
                f"{arch}: loss and gradients of plan {plan} ({policy}) equal the unchecked "
                f"run (max relative difference {worst:.1e})",
            )
        model = None


def tradeoffs(report: Report, device: torch.device, quick: bool, repeats: int) -> None:
    torch.manual_seed(0)
    width, batch = (256, 2048) if quick else (1024, 16384)
    cases = []
    for act in ("relu", "gelu"):
        model = mlp_stack(16, width, act).to(device)
        x = torch.randn(batch, width, device=device)
        cases.append(
            (
                f"MLP 16 x (Linear {width} + {act}), batch {batch}",
                model,
                lambda model=model, x=x: model(x).pow(2).mean(),
                [x],
            )
        )
    hidden, seq, layers = (128, 256, 8) if quick else (1024, 2048, 16)
    for attn in ("sdpa", "eager"):
        model = tiny_decoder("llama", n_layers=layers, hidden=hidden, heads=8, attn_implementation=attn).to(device)
        ids = torch.randint(0, 512, (2, seq), device=device)
        cases.append(
            (
                f"Llama architecture, {layers} layers, hidden {hidden}, 2 x {seq} tokens, {attn}",
                model,
                lambda model=model, ids=ids: model(input_ids=ids, labels=ids).loss,
                [ids],
            )
        )
    report.data["tradeoffs"] = []
    for name, model, loss_fn, inputs in cases:
        profile = profile_stack(model, loss_fn, inputs)
        rows = measure_tradeoff(model, loss_fn, inputs, default_plans(profile), repeats=repeats, profile=profile)
        report.say(format_tradeoff(rows, name))
        worst = max(abs(r.error) for r in rows)
        by_plan = {r.plan: r for r in rows}
        report.check(worst <= 0.15, f"{name}: refined cost model within 15% of every plan (worst {worst:.1%})")
        sqrt = by_plan["sqrt"]
        report.check(
            abs(sqrt.simple_error) <= 0.15,
            f"{name}: simple cost model within 15% on the sqrt plan ({sqrt.simple_error:+.1%})",
        )
        if "gelu" in name:
            report.check(
                sqrt.measured_peak < by_plan["every-layer"].measured_peak,
                f"{name}: sqrt plan measured below every-layer",
            )
        report.say()
        report.data["tradeoffs"].append({"name": name, "profile": asdict(profile), "rows": [asdict(r) for r in rows]})
        model = inputs = None
        torch.cuda.empty_cache() if device.type == "cuda" else None


def one_liner_and_selective(report: Report, device: torch.device, quick: bool, repeats: int) -> None:
    torch.manual_seed(0)
    hidden, seq = (128, 256) if quick else (1024, 2048)
    model = tiny_decoder("llama", n_layers=8, hidden=hidden, heads=8).to(device)
    ids = torch.randint(0, 512, (2, seq), device=device)
    loss_fn = lambda: model(input_ids=ids, labels=ids).loss  # noqa: E731
    hf_checkpointing(model)
    hf = measure_step(model, None, loss_fn, [ids])
    hf_checkpointing(model, False)
    with apply_plan(model, "every-layer"):
        ours = measure_step(model, None, loss_fn, [ids])
    a, b = hf.peak - hf.baseline, ours.peak - ours.baseline
    report.check(abs(a - b) <= 0.02 * b, f"HF one-liner {a / MiB:.1f} MiB == apply_plan every-layer {b / MiB:.1f} MiB")
    report.data["selective"] = []
    for attn in ("eager", "sdpa"):
        torch.manual_seed(0)
        model = tiny_decoder("llama", n_layers=8, hidden=hidden, heads=8, attn_implementation=attn).to(device)
        loss_fn = lambda: model(input_ids=ids, labels=ids).loss  # noqa: E731
        profile = profile_stack(model, loss_fn, [ids])
        plans = [("none", [], "full"), ("every-layer", "every-layer", "full")] + [
            ("every-layer", "every-layer", policy) for policy in ("korthikanti", "save-matmuls", "save-all")
        ]
        rows = [
            measure_plan(model, loss_fn, [ids], plan, profile=profile, policy=policy, label=label, recompute=True)
            for label, plan, policy in plans
        ]
        for row, seconds in zip(
            rows, time_plans(model, loss_fn, [(plan, policy) for _, plan, policy in plans], repeats=repeats)
        ):
            row.step_seconds = seconds
        report.say(format_tradeoff(rows, f"selective policies, {attn}, 8 layers, hidden {hidden}, 2 x {seq} tokens"))
        none, full, korthikanti, matmuls, save_all = rows
        report.check(
            full.measured_peak < korthikanti.measured_peak < none.measured_peak,
            f"{attn}: peak full < korthikanti < none",
        )
        report.check(save_all.measured_recompute == 0.0, f"{attn}: save-all recomputes nothing (measured)")
        report.say(
            f"{attn}: every layer {full.step_seconds / none.step_seconds:.2f}x the step time of no "
            f"checkpointing (the seed: 1.40x), korthikanti {korthikanti.step_seconds / none.step_seconds:.2f}x, "
            f"save-all {save_all.step_seconds / none.step_seconds:.2f}x; memory "
            f"{full.measured_peak / none.measured_peak:.2f}x of no checkpointing"
        )
        report.data["selective"].append({"attention": attn, "rows": [asdict(r) for r in rows]})
        model = None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT"), help="folder for the .txt and .json results")
    parser.add_argument("--quick", action="store_true", help="small shapes (a smoke run)")
    parser.add_argument("--allow-cpu", action="store_true", help="run on the CPU when there is no GPU")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds per plan")
    args = parser.parse_args(argv)
    if torch.cuda.is_available():
        device = torch.device("cuda")
    elif args.allow_cpu:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    else:
        print("gpu_checkpointing.py needs a CUDA GPU (pass --allow-cpu for a smoke run on this CPU)")
        return 0
    report = Report()
    started = time.perf_counter()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    report.say(f"device {device} ({name}), torch {torch.__version__}; peaks above what was live before the step")
    report.data["device"], report.data["torch"] = name, torch.__version__
    grads_equal(report, device, args.quick)
    tradeoffs(report, device, args.quick, args.repeats)
    one_liner_and_selective(report, device, args.quick, args.repeats)
    report.say(f"\n{len(report.failures)} failed; {time.perf_counter() - started:.0f} s")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gpu_checkpointing.txt"), "w") as f:
            f.write("\n".join(report.lines) + "\n")
        with open(os.path.join(args.out, "gpu_checkpointing.json"), "w") as f:
            json.dump({**report.data, "failures": report.failures}, f, indent=1)
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
