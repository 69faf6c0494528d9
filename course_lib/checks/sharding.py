"""Checks for the exercises of lesson 6 (ZeRO and FSDP)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace

from course_lib import planner
from course_lib.checkpointing.demo_models import tiny_decoder
from course_lib.checks.hints import passed, refuse_reference
from course_lib.planner import CUDA_CONTEXT_BYTES, Setup, get_gpu, plan
from course_lib.planner.config.fields import SHARDS
from course_lib.planner.predict import predict
from course_lib.sharding import STAGES, measure_sharding
from course_lib.validate import checked

__all__ = ["check_model_states_per_gpu", "check_fewest_gpus", "check_never_fits", "check_bytes_sent"]

_KINDS = ("weights", "gradients", "optimizer_states")


def _by_kind(p) -> dict[str, int]:
    b = p.bytes
    return {
        "weights": b["weights"],
        "gradients": b["gradients"],
        "optimizer_states": b["optimizer_state"] + b["master_weights"],
    }


@checked
def check_model_states_per_gpu(model_states_per_gpu: Callable) -> None:
    """Exercise 6.1: `model_states_per_gpu(n_params, gpus, stage)` is one GPU's model states under
    mixed-precision AdamW by kind, {"weights", "gradients", "optimizer_states"} in bytes, as the
    planner (and the ZeRO paper) counts them: a stage that divides the wrong kind fails even where the
    total is the same."""
    for n_params in (7_500_000_000, 1_000_003):
        for gpus in (1, 8, 64, 3):
            for stage in SHARDS:
                expected = _by_kind(plan(n_params, precision="mixed-bf16", optimizer="adamw", gpus=gpus, shard=stage))
                with refuse_reference(planner, instead="add up the bytes each GPU keeps yourself"):
                    got = model_states_per_gpu(n_params, gpus, stage)
                case = f"{n_params:,} parameters on {gpus} GPUs, {stage}"
                assert isinstance(got, dict) and set(got) == set(_KINDS), (
                    f"{case}: return a dict with the keys {', '.join(_KINDS)} (bytes per GPU of each), got {got!r}"
                )
                wrong = [kind for kind in _KINDS if abs(got[kind] - expected[kind]) > gpus]
                if not wrong:
                    continue
                if (
                    stage == "zero2"
                    and gpus > 1
                    and abs(got["weights"] - expected["gradients"]) <= gpus
                    and abs(got["gradients"] - expected["weights"]) <= gpus
                ):
                    raise AssertionError(
                        f"{case}: ZeRO stage 2 partitions the gradients, not the weights (the "
                        "total is the same, 2 + 2/N bytes per parameter either way, but only the "
                        "gradients' partition lets each GPU run every layer without gathering)"
                    )
                if (
                    stage == "zero1"
                    and min(
                        abs(got["optimizer_states"] - 8 * n_params / gpus),  # K = 8 divided,
                        abs(got["optimizer_states"] - 8 * n_params / gpus - 4 * n_params),
                    )
                    <= gpus
                ):  # master whole
                    raise AssertionError(
                        f"{case}: the optimizer states of ZeRO stage 1 include the fp32 master "
                        "weights: K = 12 bytes per parameter (4 + 4 + 4) are divided, not 8"
                    )
                kind = wrong[0]
                raise AssertionError(
                    f"{case}: {kind} expected {expected[kind]:,} bytes per GPU, got {got[kind]:,.0f}. Per "
                    "parameter: 2 bytes of 16-bit weights, 2 of 16-bit gradients, K = 12 of optimizer states (fp32 "
                    "master weights and Adam's two moments); stage 1 divides K by N, stage 2 the gradients too, "
                    "stage 3 the weights too"
                )
    passed("Correct: 16, 4 + 12/N, 2 + 14/N and 16/N bytes per parameter, the ZeRO paper's Figure 1, kind by kind.")


def _fewest(model, setup: Setup, gpu: str, most: int) -> int | None:
    for n in range(1, most + 1):
        if plan(model, replace(setup, gpus=n), gpu=gpu, suggest=False).fits:
            return n
    return None


_NEVER = {  # why no number of GPUs makes a stage fit, when the undivided part alone is too large
    "none": "plain data parallelism divides nothing: every GPU keeps all the model states",
    "zero1": "zero1 divides only the optimizer states: the 16-bit weights and gradients stay whole on every GPU",
    "zero2": "zero2 divides the gradients and optimizer states: the 16-bit weights stay whole on every GPU",
    "zero3": "zero3 divides everything, but `most` GPUs are too few",
}


@checked
def check_fewest_gpus(fewest_gpus: Callable) -> None:
    """Exercise 6.2: `fewest_gpus(model, setup, gpu, most=64)` is the smallest number of GPUs on which
    the planner says one GPU's share fits, or None."""
    cases = [
        (int(7e9), Setup(precision="mixed-bf16", shard="zero3"), "a100-40gb", 64),
        (int(7e9), Setup(precision="mixed-bf16", shard="zero1"), "a100-40gb", 64),
        (int(13e9), Setup(precision="mixed-fp16", shard="zero3"), "t4", 64),
        (int(13e9), Setup(precision="mixed-fp16", shard="zero2"), "t4", 64),
        (int(7e9), Setup(precision="mixed-bf16", shard="none"), "a100-80gb", 64),
        (int(1e9), Setup(precision="mixed-bf16", shard="zero3"), "a100-80gb", 64),  # one GPU is enough
        (int(7e9), Setup(precision="mixed-bf16", shard="zero3"), "a100-40gb", 2),
    ]  # not within `most`
    for model, setup, gpu, most in cases:
        expected = _fewest(model, setup, gpu, most)
        got = fewest_gpus(model, setup, gpu, most=most)
        case = f"{model:,} parameters, {setup.precision}, {setup.shard}, on {gpu}, at most {most} GPUs"
        if expected is None:
            assert got is None, (
                f"{case}: no number of GPUs up to {most} makes it fit ({_NEVER[setup.shard]}); return None, got {got!r}"
            )
            continue
        assert got is not None, f"{case}: it fits on {expected} GPUs; got None"
        if got == expected - 1:
            raise AssertionError(
                f"{case}: on {got} GPUs the planner says it does not fit (the CUDA context "
                "counts too): ask plan(..., gpu=gpu).fits for each number of GPUs"
            )
        if expected == 1 and got > 1:
            raise AssertionError(f"{case}: it fits on one GPU already; start counting at 1, got {got}")
        assert got == expected, f"{case}: the fewest GPUs on which it fits is {expected}, got {got}"
    passed("Correct: the fewest GPUs for each stage; note how much sooner zero3 fits than zero1.")


@checked
def check_never_fits(never_fits: Callable) -> None:
    """Exercise 6.3: `never_fits(n_params, stage, gpu)` is True when no number of GPUs makes one GPU's
    model states (mixed-precision AdamW, `--params` only) fit at that stage, from what the stage does
    not divide; the check compares with the planner at 4096 GPUs."""
    # 7.9e9 on a T4 at zero2: the undivided 2 bytes per parameter fit, the CUDA context on top does not
    cases = [
        (int(n), stage, gpu)
        for n in (7e9, 7.9e9, 13e9, 70e9)
        for stage in SHARDS
        for gpu in ("t4", "a100-40gb", "h200")
    ]
    for n_params, stage, gpu in cases:
        card = get_gpu(gpu)
        expected = not plan(
            n_params,
            precision="mixed-bf16" if card.bf16 else "mixed-fp16",
            gpus=4096,
            shard=stage,
            gpu=gpu,
            suggest=False,
        ).fits
        with refuse_reference(planner.plan, predict, instead="reason from what the stage leaves whole on every GPU"):
            got = never_fits(n_params, stage, gpu)
        case = f"{n_params:,} parameters, {stage}, on {gpu}"
        assert isinstance(got, bool), f"{case}: return True or False, got {got!r}"
        if got != expected:
            undivided = {"none": 16, "zero1": 4, "zero2": 2, "zero3": 0}[stage] * n_params
            raise AssertionError(
                f"{case}: expected {expected}. {_NEVER[stage].split(':')[0].capitalize()}: what it leaves whole is "
                f"{undivided / 2**30:.2f} GiB on every GPU, however many there are, and the CUDA context "
                f"({CUDA_CONTEXT_BYTES / 2**30:.2f} GiB) comes on top, against the {gpu}'s "
                f"{card.memory_bytes / 2**30:.2f} GiB"
            )
    passed(
        "Correct: none, zero1 and zero2 leave 16, 4 and 2 bytes per parameter whole on every GPU; only zero3 "
        "always fits with enough GPUs."
    )


# what each rank of the lesson's engines sends per step, in ring passes P of the parameter bytes
_SENT_HINTS = {
    "none": "DDP all-reduces the gradients: a reduce-scatter and an all-gather, 2 P",
    "zero1": "torch's ZeroRedundancyOptimizer sits on DDP (an all-reduce, 2 P) and then broadcasts the parameters "
    "each rank updated (1 P): 3 P, not the paper's 2",
    "zero2": "FSDP2 without resharding after forward gathers the weights once (1 P) and reduce-scatters the "
    "gradients (1 P): 2 P",
    "zero3": "FSDP2 gathers the weights in forward and again in backward and reduce-scatters the gradients: 3 P",
}


@functools.lru_cache(maxsize=1)
def _measured_sent() -> dict[tuple[int, str], tuple[int, int]]:
    """(world size, stage) -> (the parameters' bytes, what rank 0 sent), measured on gloo."""
    build = functools.partial(tiny_decoder, "llama", n_layers=2, hidden=32, vocab=128)
    param_bytes = sum(p.numel() for p in build().parameters()) * 4
    return {
        (s.world_size, s.stage): (param_bytes, s.bytes_sent)
        for n in (2, 4)
        for s in measure_sharding(build, n, STAGES, batch=1, seq=8, repeats=1)
        if s.rank == 0
    }


@checked
def check_bytes_sent(bytes_sent_per_rank: Callable) -> None:
    """Exercise 6.4: `bytes_sent_per_rank(param_bytes, world_size, stage)` is what each rank of the
    lesson's engines sends in one step (ring algorithm), checked against a step measured on 2 and 4
    gloo ranks (lesson 6, section 4)."""
    for (n, stage), (param_bytes, sent) in _measured_sent().items():
        got = bytes_sent_per_rank(param_bytes, n, stage)
        case = f"{stage} on {n} ranks, {param_bytes:,} bytes of parameters"
        assert isinstance(got, (int, float)), f"{case}: return a number of bytes, got {got!r}"
        ring = param_bytes * (n - 1) / n
        if abs(got - sent) <= 0.01 * sent:
            continue
        if abs(got - sent * n / (n - 1)) <= 0.01 * sent * n / (n - 1):
            raise AssertionError(
                f"{case}: a ring pass sends (N-1)/N of the tensor per rank, not all of it: P = {ring:,.0f} bytes here"
            )
        raise AssertionError(
            f"{case}: measured {sent:,} bytes ({sent / ring:.2f} P), got {got:,.0f}: {_SENT_HINTS[stage]}"
        )
    passed("Correct: 2 P, 3 P, 2 P and 3 P, as measured on the engines (P = (N-1)/N x the parameters' bytes).")
