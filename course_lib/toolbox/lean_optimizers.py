"""Lean optimizers measured on real optimizer objects, tensor by tensor (lesson 7, "lean optimizers").

SGD keeps nothing; SGD with momentum one buffer per parameter; torch AdamW two moments and a step
counter; transformers' Adafactor (the one the Trainer's `optim="adafactor"` builds) a row and a
column statistic per matrix (its factored second moment), a full second moment per vector, and
an fp32 RMS scalar per tensor (no first moment: beta1=None);
bitsandbytes' AdamW8bit two uint8 moments with a float32 absmax per 256 values (32-bit state for
tensors under 4096 values). Each is built, stepped once on random gradients (state is created
lazily in the first step) and its state counted storage by storage. Under transformers' Trainer an
8-bit optimizer keeps 32-bit state for every nn.Embedding (`embeddings_in_32_bits` does the same).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from course_lib.errors import UserError
from course_lib.measure import optimizer_state_tensors, storage_bytes, storage_key
from course_lib.validate import checked


def _adafactor(params):
    from transformers.optimization import Adafactor  # off the import path: transformers takes seconds to import

    # the Trainer's optim="adafactor": a fixed learning rate (transformers/trainer.py)
    return Adafactor(params, lr=1e-3, scale_parameter=False, relative_step=False, warmup_init=False)


def _adamw8bit(params):
    import bitsandbytes as bnb  # off the import path: bitsandbytes loads its native library

    return bnb.optim.AdamW8bit(params, lr=1e-3)


# name -> (what it is, factory); the names are the planner's (course_lib.planner.OPTIMIZERS)
LEAN_OPTIMIZERS: dict[str, tuple[str, Callable]] = {
    "sgd": ("torch SGD", lambda ps: torch.optim.SGD(ps, lr=1e-3)),
    "momentum": ("torch SGD, momentum 0.9", lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9)),
    "adamw": ("torch AdamW", lambda ps: torch.optim.AdamW(ps, lr=1e-3)),
    "adafactor": ("transformers Adafactor", _adafactor),
    "adamw8bit": ("bitsandbytes AdamW8bit", _adamw8bit),
}


@contextlib.contextmanager
@checked
def embeddings_in_32_bits(model: torch.nn.Module):
    """Inside, a bitsandbytes 8-bit optimizer initialises 32-bit state for the model's nn.Embedding
    weights, as transformers' Trainer registers it (trainer.py, `register_module_override` with
    optim_bits=32; lesson 7). Keyed by the parameters themselves (`override_config`), removed on exit;
    the state is made at the optimizer's first step, so take that step inside."""
    import bitsandbytes as bnb  # off the import path: bitsandbytes loads its native library

    manager = bnb.optim.GlobalOptimManager.get_instance()
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Embedding) and m.weight.requires_grad]
    if weights:
        manager.override_config(weights, "optim_bits", 32)
    try:
        yield
    finally:
        for weight in weights:
            manager.pid2config.pop(id(weight), None)


@checked
@dataclass(frozen=True)
class StateTensor:
    """One tensor of an optimizer's state; `bytes` is 0 for a storage already counted (shared)."""

    parameter: str
    key: str
    shape: tuple[int, ...]
    dtype: str
    bytes: int


@checked
def state_tensors(optimizer: torch.optim.Optimizer, names: dict[torch.Tensor, str]) -> list[StateTensor]:
    """Every tensor of `optimizer.state`, named by its parameter, each storage counted once (lesson 7)."""
    seen: set[tuple[str, int]] = set()
    rows = []
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                continue
            nbytes = 0 if storage_key(value) in seen else value.untyped_storage().nbytes()
            seen.add(storage_key(value))
            rows.append(
                StateTensor(
                    names.get(param, "?"), key, tuple(value.shape), str(value.dtype).replace("torch.", ""), nbytes
                )
            )
    return rows


@checked
def stepped_optimizer(model: torch.nn.Module, name: str, seed: int = 0) -> torch.optim.Optimizer:
    """The optimizer `name` of LEAN_OPTIMIZERS over the model's trainable parameters, after one step on
    random gradients (its state exists from then on; lesson 7)."""
    if name not in LEAN_OPTIMIZERS:
        raise UserError(f"unknown optimizer {name!r}: use one of {', '.join(LEAN_OPTIMIZERS)}")
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise UserError(f"{type(model).__name__} has no trainable parameter: there is no optimizer state to count")
    generator = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator, dtype=p.dtype).to(p.device)
    optimizer = LEAN_OPTIMIZERS[name][1](params)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return optimizer


@checked
def bytes_per_parameter(model: torch.nn.Module, name: str) -> tuple[int, float]:
    """(state bytes, bytes per trainable parameter) of optimizer `name`, measured (lesson 7)."""
    optimizer = stepped_optimizer(model, name)
    total = storage_bytes(optimizer_state_tensors(optimizer))
    n = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return total, total / n
