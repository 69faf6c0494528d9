"""Checks for the exercises of lesson 6 (ZeRO and FSDP)."""

from __future__ import annotations

from dataclasses import replace

from course_lib import memory
from course_lib.checks.hints import passed, refuse_reference
from course_lib.memory import Setup, plan
from course_lib.memory.setup import SHARDS

__all__ = ["check_model_states_per_gpu", "check_fewest_gpus"]


def _states(p) -> int:
    return sum(p.bytes[c] for c in ("weights", "gradients", "optimizer_state", "master_weights"))


def check_model_states_per_gpu(model_states_per_gpu) -> None:
    """Exercise 6.1: `model_states_per_gpu(n_params, gpus, stage)` is one GPU's model states under
    mixed-precision AdamW, as the planner (and the ZeRO paper) counts them."""
    for n_params in (7_500_000_000, 1_000_003):
        for gpus in (1, 8, 64, 3):
            for stage in SHARDS:
                expected = _states(plan(n_params, precision="mixed-bf16", optimizer="adamw", gpus=gpus, shard=stage))
                with refuse_reference(memory, instead="add up the bytes each GPU keeps yourself"):
                    got = model_states_per_gpu(n_params, gpus, stage)
                assert got is not None, "model_states_per_gpu returned None: return a number of bytes"
                case = f"{n_params:,} parameters on {gpus} GPUs, {stage}"
                if stage != "none" and gpus > 1 and abs(got - 16 * n_params) <= gpus:
                    raise AssertionError(f"{case}: that is the unsharded 16 bytes per parameter; {stage} divides "
                                         "some of the model states by the number of GPUs")
                if stage == "zero1" and abs(got - (4 * n_params + 8 * n_params / gpus)) <= gpus:
                    raise AssertionError(f"{case}: the optimizer states of ZeRO stage 1 include the fp32 master "
                                         "weights: K = 12 bytes per parameter (4 + 4 + 4) are divided, not 8")
                assert abs(got - expected) <= gpus, (
                    f"{case}: expected {expected:,} bytes per GPU, got {got:,.0f}. Per parameter: 2 bytes of "
                    "16-bit weights, 2 of 16-bit gradients, K = 12 of optimizer states (fp32 master weights and "
                    "Adam's two moments); stage 1 divides K by N, stage 2 the gradients too, stage 3 everything")
    passed("Correct: 16, 4 + 12/N, 2 + 14/N and 16/N bytes per parameter, the ZeRO paper's Figure 1.")


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


def check_fewest_gpus(fewest_gpus) -> None:
    """Exercise 6.2: `fewest_gpus(model, setup, gpu, most=64)` is the smallest number of GPUs on which
    the planner says one GPU's share fits, or None."""
    cases = [(int(7e9), Setup(precision="mixed-bf16", shard="zero3"), "a100-40gb", 64),
             (int(7e9), Setup(precision="mixed-bf16", shard="zero1"), "a100-40gb", 64),
             (int(13e9), Setup(precision="mixed-fp16", shard="zero3"), "t4", 64),
             (int(13e9), Setup(precision="mixed-fp16", shard="zero2"), "t4", 64),
             (int(7e9), Setup(precision="mixed-bf16", shard="none"), "a100-80gb", 64),
             (int(1e9), Setup(precision="mixed-bf16", shard="zero3"), "a100-80gb", 64),  # one GPU is enough
             (int(7e9), Setup(precision="mixed-bf16", shard="zero3"), "a100-40gb", 2)]  # not within `most`
    for model, setup, gpu, most in cases:
        expected = _fewest(model, setup, gpu, most)
        got = fewest_gpus(model, setup, gpu, most=most)
        case = f"{model:,} parameters, {setup.precision}, {setup.shard}, on {gpu}, at most {most} GPUs"
        if expected is None:
            assert got is None, (f"{case}: no number of GPUs up to {most} makes it fit ({_NEVER[setup.shard]}); "
                                 f"return None, got {got!r}")
            continue
        assert got is not None, f"{case}: it fits on {expected} GPUs; got None"
        if got == expected - 1:
            raise AssertionError(f"{case}: on {got} GPUs the planner says it does not fit (the CUDA context "
                                 "counts too): ask plan(..., gpu=gpu).fits for each number of GPUs")
        if expected == 1 and got > 1:
            raise AssertionError(f"{case}: it fits on one GPU already; start counting at 1, got {got}")
        assert got == expected, f"{case}: the fewest GPUs on which it fits is {expected}, got {got}"
    passed("Correct: the fewest GPUs for each stage; note how much sooner zero3 fits than zero1.")
