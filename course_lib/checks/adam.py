"""Checks for the exercises of lesson 1 (Adam memory arithmetic)."""

from __future__ import annotations

import warnings

import torch

from course_lib import memory
from course_lib.checks.hints import refuse_reference
from course_lib.memory import BNB_QMAPS_BYTES, optimizer_state_bytes, plan

__all__ = ["check_model_state_bytes", "check_adamw8bit_state_bytes"]

_PRECISIONS = ("fp32", "bf16", "mixed-bf16")
_OPTIMIZERS = ("sgd", "momentum", "adamw")


def check_model_state_bytes(model_state_bytes) -> None:
    """Exercise 1.1: `model_state_bytes(n_params, precision, optimizer)` is the planner's model-state total."""
    for n in (1, 1000, 7_000_000_000):
        for precision in _PRECISIONS:
            for optimizer in _OPTIMIZERS:
                expected = plan(n, precision=precision, optimizer=optimizer).total
                with refuse_reference(memory, instead="add up the bytes per parameter yourself"):
                    got = model_state_bytes(n, precision, optimizer)
                assert got is not None, "model_state_bytes returned None: return the number of bytes"
                case = f"{n:,} parameters, {precision}, {optimizer}"
                if precision == "mixed-bf16" and got == expected - 4 * n:
                    raise AssertionError(f"{case}: you left out the fp32 master copy of the weights (4 B/param): "
                                         "the optimizer updates fp32 weights, then copies them to bf16")
                if optimizer == "momentum" and got == expected + (4 if precision != "bf16" else 2) * n:
                    raise AssertionError(f"{case}: SGD with momentum keeps ONE buffer per parameter, Adam two")
                if precision == "bf16" and optimizer != "sgd" and got > expected:
                    raise AssertionError(f"{case}: too much. In pure bf16, torch keeps the optimizer state in the "
                                         "parameter's dtype (2 bytes per value), not in fp32")
                assert got == expected, (
                    f"{case}: expected {expected:,} bytes ({expected / n:g} B/param), got {got:,} "
                    f"({got / n:g} B/param). Add up weights, gradients, optimizer state and master weights.")
    print("Correct: 16 bytes per parameter for mixed-precision Adam (2 + 2 + 8 + 4), and every other recipe.")


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
    return sum(v.untyped_storage().nbytes() for k, v in state.items()
               if isinstance(v, torch.Tensor) and not k.startswith("qmap"))


def check_adamw8bit_state_bytes(adamw8bit_state_bytes) -> None:
    """Exercise 1.2: `adamw8bit_state_bytes(numel)` is bitsandbytes' AdamW8bit state for one tensor."""
    for numel in (10, 4095, 4096, 4097, 65536, 1_000_000, 7_000_003):
        expected = optimizer_state_bytes("adamw8bit", [numel], 4)
        if numel >= 4096:
            expected -= BNB_QMAPS_BYTES
        if numel <= 100_000:
            real = _real_8bit_state(numel)
            assert real is None or real == expected  # the formula the check uses is the real layout
        with refuse_reference(memory, instead="count the moments' bytes and their absmax values yourself"):
            got = adamw8bit_state_bytes(numel)
        assert got is not None, "adamw8bit_state_bytes returned None: return the number of bytes"
        if numel < 4096 and got != expected:
            raise AssertionError(f"numel={numel}: tensors with fewer than 4096 elements keep 32-bit state "
                                 f"(two fp32 moments: {expected} bytes), not 8-bit")
        if got == 2 * numel:
            raise AssertionError(f"numel={numel}: the two uint8 moments are right, but each block of 256 values "
                                 "also stores a float32 absmax, for each of the two moments")
        if got == 2 * numel + 8 * (numel // 256) and numel % 256:
            raise AssertionError(f"numel={numel}: a last, partial block also gets its absmax: round the number "
                                 "of blocks up (math.ceil)")
        assert got == expected, (f"numel={numel}: expected {expected} bytes "
                                 f"({expected / numel:.5f} B/param), got {got}")
    ratio = optimizer_state_bytes("adamw8bit", [2**20], 4) / 2**20
    print(f"Correct: {ratio:.5f} bytes per parameter on a 1M tensor (2 + 8/256, plus the two 1 KiB qmaps); "
          "small tensors fall back to 8.")
