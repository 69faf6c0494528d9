"""Lesson 5 on a CUDA GPU: each measurement in a process of its own, from one checkpoint saved once.

A paged optimizer's state is never freed (`course_lib.isolate`), so every ablation row, the Trainer
run and each `expandable_segments` setting run in a fresh process. The parent saves the random
checkpoint once (`building.checkpoint_dir`) and never touches the GPU itself; each child loads it with
`from_pretrained`. `emulate_t4` runs the T4's recipe on a larger GPU; `matmul_rates` measures why
the T4 recipe is fp16: sm_75 has fp16 tensor cores and none for bf16.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict

import torch

from course_lib import isolate
from course_lib.checkpointing import assert_gradients_flow
from course_lib.device import DtypePolicy, dtype_policy, policy_for_capability
from course_lib.errors import UserError
from course_lib.planner import CUDA_CONTEXT_BYTES, GPU, get_gpu
from course_lib.qlora.building import (
    build_model,
    checkpoint_dir,
    counting_dataset,
    llama_1b_config,
    quiet,
    tiny_llama_config,
)
from course_lib.qlora.measuring import Row, measure_recipe, predict, recipe_step, step_peak
from course_lib.qlora.recipe import Recipe
from course_lib.qlora.training import train
from course_lib.validate import Device


def emulate_t4(device: Device = "cuda") -> tuple[DtypePolicy, GPU]:
    """Make a larger CUDA GPU behave like Colab's T4 for lesson 5's recipe: cap this process's caching
    allocator at the T4's visible memory less the CUDA context, and return the T4's precision policy
    (fp16 autocast + GradScaler) and catalog entry, for `measure_recipe`, `ablation` and `train`.
    The cap binds PyTorch's allocator only: a paged optimizer's unified memory lies outside it, as on a
    T4, but is not squeezed by it, so a recipe that pages on a T4 may not page here."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise RuntimeError("emulate_t4 caps a CUDA GPU's memory: it needs a CUDA GPU")
    t4 = get_gpu("t4")
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, (t4.memory_bytes - CUDA_CONTEXT_BYTES) / total), device)
    return policy_for_capability(t4.compute_capability), t4


def _load(config_dir: str, device: str, as_t4: bool):
    from transformers import AutoConfig  # heavy: transformers, in the child only

    config = AutoConfig.from_pretrained(config_dir)
    config.use_cache = False
    policy, gpu = emulate_t4(device) if as_t4 else (None, None)
    return config, policy, gpu


def measure_row(
    config_dir: str, recipe: dict, device: str = "cuda", timed_steps: int = 1, label: str = "", as_t4: bool = False
) -> dict:
    """One ablation row, in a child process (`isolated_rows`): `measure_recipe` on the saved checkpoint."""
    config, policy, gpu = _load(config_dir, device, as_t4)
    row = measure_recipe(
        config,
        Recipe(**recipe),
        device,
        timed_steps=timed_steps,
        label=label,
        policy=policy,
        gpu=gpu,
        weights=config_dir,
    )
    return {"status": "ok", "row": asdict(row)}


def isolated_rows(
    config,
    cases: list[tuple[str, Recipe]],
    device: Device = "cuda",
    *,
    timed_steps: int = 1,
    as_t4: bool = False,
    progress=None,
) -> list[Row]:
    """`measure_recipe` of each (label, recipe) in a fresh process, from one saved checkpoint (lesson 5).
    A child that dies gives a row whose status says so, with the planner's prediction beside it."""
    folder = str(checkpoint_dir(config))
    rows = []
    for label, recipe in cases:
        out = isolate.run(
            "course_lib.qlora.gpu_rows:measure_row",
            config_dir=folder,
            recipe=asdict(recipe),
            device=str(device),
            timed_steps=timed_steps,
            label=label,
            as_t4=as_t4,
        )
        if out.get("status") == "ok":
            fields = out["row"]
            rows.append(Row(**{**fields, "recipe": Recipe(**fields["recipe"])}))
        else:
            policy = policy_for_capability((7, 5)) if as_t4 else dtype_policy(torch.device(device))
            predicted = predict(config, recipe, policy)
            rows.append(
                Row(
                    label,
                    recipe,
                    None,
                    step_peak(predicted),
                    None,
                    predicted.trainable_params,
                    f"crashed: {out.get('error', '')}"[:120],
                )
            )
        if progress is not None:
            progress(list(rows))
    return rows


def train_row(
    config_dir: str,
    seq: int = 128,
    accum: int = 4,
    max_steps: int = 15,
    learning_rate: float = 2e-3,
    as_t4: bool = False,
) -> dict:
    """A short Trainer run in a child process: the losses, the seconds, and whether every LoRA
    parameter gets a gradient (lesson 3's `assert_gradients_flow`)."""
    config, policy, _ = _load(config_dir, "cuda", as_t4)
    result = train(
        config,
        Recipe(seq=seq, accum=accum),
        counting_dataset(64, seq, 16),
        max_steps=max_steps,
        learning_rate=learning_rate,
        device="cuda",
        policy=policy,
        weights=config_dir,
    )
    ids = torch.randint(0, config.vocab_size, (1, 64), device="cuda")
    try:
        assert_gradients_flow(result.model, {"input_ids": ids, "labels": ids})
        flows = "every LoRA parameter gets a gradient"
    except AssertionError as error:
        flows = f"FAILED: {error}"
    return {"status": "ok", "losses": result.losses, "seconds": result.seconds, "gradients_flow": flows}


def expandable_row(config_dir: str, seq: int = 512, accum: int = 4, as_t4: bool = False) -> dict:
    """Peak allocated and reserved bytes of the all-on recipe's training step alone, in a child
    process started with the child's PYTORCH_CUDA_ALLOC_CONF (lesson 5): the model is built and one
    step runs first; then the peak statistics are reset and one more step is measured."""
    config, policy, _ = _load(config_dir, "cuda", as_t4)
    policy = policy or dtype_policy(torch.device("cuda"))
    recipe = Recipe(seq=seq, accum=accum)
    with quiet():
        model = build_model(config, recipe, "cuda", policy, weights=config_dir)
        ids = torch.randint(0, config.vocab_size, (recipe.batch, recipe.seq), device="cuda")
        _, step = recipe_step(model, recipe, policy, ids)
        step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_reserved()
        step()
        torch.cuda.synchronize()
    return {
        "status": "ok",
        "setting": os.environ.get("PYTORCH_ALLOC_CONF", os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")),
        "allocated_peak": torch.cuda.max_memory_allocated(),
        "reserved_peak": torch.cuda.max_memory_reserved(),
        "reserved_before_step": before,
    }


def expandable_segments_effect(
    model: str = "1b", seq: int = 512, accum: int = 4, *, as_t4: bool = False
) -> dict[str, dict]:
    """The training step's peak allocated and reserved bytes with PYTORCH_CUDA_ALLOC_CONF=
    expandable_segments:False and :True, each in a fresh process (the setting is read at the first
    CUDA call), from one saved checkpoint; CUDA only (lesson 5). A child that fails reports why."""
    if not torch.cuda.is_available():
        raise RuntimeError("expandable_segments is a CUDA allocator setting: this needs a CUDA GPU")
    if model not in ("1b", "tiny"):
        raise UserError(f"model must be '1b' or 'tiny', got {model!r}")
    config = llama_1b_config() if model == "1b" else tiny_llama_config()
    folder = str(checkpoint_dir(config))
    return {
        value: isolate.run(
            "course_lib.qlora.gpu_rows:expandable_row",
            config_dir=folder,
            seq=seq,
            accum=accum,
            as_t4=as_t4,
            env=_alloc_conf(f"expandable_segments:{value}"),
        )
        for value in ("False", "True")
    }


def _alloc_conf(setting: str) -> dict[str, str]:
    """The allocator setting under both names: torch >= 2.9 reads PYTORCH_ALLOC_CONF first and
    PYTORCH_CUDA_ALLOC_CONF after it (c10/core/AllocatorConfig.h), so one alone can be overridden."""
    return {"PYTORCH_ALLOC_CONF": setting, "PYTORCH_CUDA_ALLOC_CONF": setting}


def matmul_rates(n: int = 4096, repeats: int = 20) -> dict[str, float]:
    """Measured TFLOP/s of an n x n matmul in fp32, fp16 and bf16 on this GPU (lesson 5, "why fp16 on a
    T4"): on sm_75 fp16 runs on tensor cores, bf16 does not."""
    if not torch.cuda.is_available():
        raise RuntimeError("matmul_rates times a CUDA GPU")
    rates = {}
    for name, dtype in (("fp32", torch.float32), ("fp16", torch.float16), ("bf16", torch.bfloat16)):
        a = torch.randn(n, n, device="cuda", dtype=dtype)
        b = torch.randn(n, n, device="cuda", dtype=dtype)
        a @ b
        times = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            t = time.perf_counter()
            a @ b
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        rates[name] = 2 * n**3 / statistics.median(times) / 1e12
        del a, b
    return rates
