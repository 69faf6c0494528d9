"""Checks for the exercises of lesson 1 (Adam memory arithmetic)."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

import course_lib
from course_lib.checks.hints import passed, refuse_reference
from course_lib.planner import BNB_QMAPS_BYTES, optimizer_state_bytes, plan
from course_lib.validate import checked

__all__ = ["check_model_state_bytes", "check_adamw8bit_state_bytes"]

_PRECISIONS = ("fp32", "mixed-bf16", "bf16")  # fp32 first: its hints say what each optimizer keeps
_OPTIMIZERS = ("sgd", "momentum", "adamw")
_BUFFERS = {"sgd": 0, "momentum": 1, "adamw": 2}
CATEGORIES = ("weights", "gradients", "optimizer_state", "master_weights")


def _layout_hint(got: dict, n: int, precision: str, optimizer: str) -> str | None:
    """The hint for a plausible wrong layout of one recipe's model states (bytes per category), None if it is
    none of them. Several layouts have the same total: torch AMP's 4 + 4 is the master copy's 2 + 2 + 4."""
    per = {category: got[category] / n for category in CATEGORIES}
    buffers = _BUFFERS[optimizer]
    if precision == "mixed-bf16":
        if per["weights"] == 4 and per["gradients"] == 4 and per["master_weights"] == 0:
            return (
                "that is torch AMP's layout (fp32 weights and gradients, bf16 only inside autocast, no copy): "
                "the same total, other tensors. Here the model itself is in bf16 (2 B weights, 2 B gradients) "
                "and the optimizer updates an fp32 master copy of the weights (4 B)"
            )
        if per["weights"] == 4 and per["master_weights"] == 4:
            return "the weights the model runs with are bf16 (2 B): the fp32 copy is master_weights, counted once"
        if per["master_weights"] == 0:
            return (
                "you left out the fp32 master copy of the weights (4 B/param): the optimizer updates fp32 "
                "weights, then copies them to bf16"
            )
        if per["gradients"] == 4:
            return (
                "the gradients are bf16 here, like the weights (2 B/param): fp32 gradients (Megatron's "
                "main_grad) are the 18 B/param recipe"
            )
        if buffers and per["optimizer_state"] == 2 * buffers:
            return "the optimizer state is fp32 (4 B a value): it updates the fp32 master weights"
    if precision != "mixed-bf16" and per["master_weights"]:
        return f"{precision} has no master copy: the optimizer updates the weights themselves"
    if optimizer == "sgd" and per["optimizer_state"]:
        return "plain SGD keeps no state: it updates each weight from its gradient alone"
    value = 2 if precision == "bf16" else 4
    if precision == "bf16" and buffers and per["optimizer_state"] == 4 * buffers:
        return "in pure bf16, torch keeps the optimizer state in the parameter's dtype (2 bytes a value), not in fp32"
    if optimizer == "momentum" and per["optimizer_state"] == 2 * value:
        return "SGD with momentum keeps ONE buffer per parameter (Adam keeps two)"
    if precision != "fp32" and (per["weights"] == 4 or per["gradients"] == 4):
        return f"in {precision} the weights and their gradients are bf16: 2 bytes each"
    return None


@checked
def check_model_state_bytes(model_state_bytes: Callable) -> None:
    """Exercise 1.1: `model_state_bytes(n_params, precision, optimizer)` is the planner's model states, by category."""
    for n in (1, 1000, 7_000_000_000):
        for precision in _PRECISIONS:
            for optimizer in _OPTIMIZERS:
                planned = plan(n, precision=precision, optimizer=optimizer).bytes
                expected = {category: planned[category] for category in CATEGORIES}
                with refuse_reference(course_lib, instead="add up the bytes per parameter yourself"):
                    got = model_state_bytes(n, precision, optimizer)
                case = f"{n:,} parameters, {precision}, {optimizer}"
                assert got is not None, "model_state_bytes returned None: return a dict of bytes by category"
                if not isinstance(got, dict):
                    per_param = f" ({got / n:g} B/param)" if isinstance(got, (int, float)) else ""
                    raise AssertionError(
                        f"{case}: you returned {got!r}{per_param}; return a dict with the bytes of "
                        f"each of {', '.join(CATEGORIES)}, not one number"
                    )
                assert set(got) == set(CATEGORIES), (
                    f"{case}: your dict has the keys {sorted(got)}; give exactly {', '.join(CATEGORIES)} "
                    "(0 where a recipe keeps none)"
                )
                hint = _layout_hint(got, n, precision, optimizer)
                assert hint is None or got == expected, f"{case}: {hint}"
                wrong = [
                    f"{c} {got[c]:,} B ({got[c] / n:g} B/param), expected {expected[c]:,} ({expected[c] / n:g} B/param)"
                    for c in CATEGORIES
                    if got[c] != expected[c]
                ]
                assert not wrong, f"{case}: " + "; ".join(wrong)
    passed("Correct: 16 bytes per parameter for mixed-precision Adam (2 + 2 + 8 + 4), and every other recipe.")


def _real_8bit_state(numel: int) -> int | None:
    """Bytes of a real bitsandbytes AdamW8bit's state for one tensor, qmaps excluded (None without bnb)."""
    try:
        import bitsandbytes as bnb  # off the import path: bitsandbytes loads its native library
    except Exception:
        return None
    param = torch.nn.Parameter(torch.randn(numel))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        optimizer = bnb.optim.AdamW8bit([param])
        param.grad = torch.randn_like(param)
        optimizer.step()
    state = optimizer.state[param]
    return sum(
        v.untyped_storage().nbytes()
        for k, v in state.items()
        if isinstance(v, torch.Tensor) and not k.startswith("qmap")
    )


@checked
def check_adamw8bit_state_bytes(adamw8bit_state_bytes: Callable) -> None:
    """Exercise 1.2: `adamw8bit_state_bytes(numel)` is bitsandbytes' AdamW8bit state for one tensor."""
    for numel in (10, 4095, 4096, 4097, 65536, 1_000_000, 7_000_003):
        expected = optimizer_state_bytes("adamw8bit", [numel], 4)
        if numel >= 4096:
            expected -= BNB_QMAPS_BYTES
        if numel <= 100_000:
            real = _real_8bit_state(numel)
            assert real is None or real == expected  # the formula the check uses is the real layout
        with refuse_reference(course_lib, instead="count the moments' bytes and their absmax values yourself"):
            got = adamw8bit_state_bytes(numel)
        assert got is not None, "adamw8bit_state_bytes returned None: return the number of bytes"
        if numel < 4096 and got != expected:
            raise AssertionError(
                f"numel={numel}: tensors with fewer than 4096 elements keep 32-bit state "
                f"(two fp32 moments: {expected} bytes), not 8-bit"
            )
        if got == 2 * numel:
            raise AssertionError(
                f"numel={numel}: the two uint8 moments are right, but each block of 256 values "
                "also stores a float32 absmax, for each of the two moments"
            )
        if got == 2 * numel + 8 * (numel // 256) and numel % 256:
            raise AssertionError(
                f"numel={numel}: a last, partial block also gets its absmax: round the number of blocks up (math.ceil)"
            )
        assert got == expected, f"numel={numel}: expected {expected} bytes ({expected / numel:.5f} B/param), got {got}"
    ratio = optimizer_state_bytes("adamw8bit", [2**20], 4) / 2**20
    passed(
        f"Correct: {ratio:.5f} bytes per parameter on a 1M tensor (2 + 8/256, plus the two 1 KiB qmaps); "
        "small tensors fall back to 8."
    )
