"""Presets of `course-lib plan --recipe NAME` (lesson 1, "the planner"), as torchtune names its recipes: each
sets several `Setup` fields at once; a flag given beside it overrides the field it names. A field a recipe
leaves out keeps `Setup`'s default (the precision: the GPU's, `gpus.default_precision`)."""

from __future__ import annotations

RECIPES: dict[str, dict] = {
    # a full fine-tune: every parameter trained, torch's AdamW
    "full": {"lora_rank": 0, "quant": "none", "optimizer": "adamw"},
    # LoRA on every linear layer but the output, rank 16 (peft's all-linear), over a 16-bit frozen base
    "lora": {"lora_rank": 16, "quant": "none"},
    # the QLoRA paper's stack: NF4 with double quantization, prepare_model_for_kbit_training, every layer
    # checkpointed, the paged 8-bit AdamW
    "qlora": {
        "lora_rank": 16,
        "quant": "nf4-dq",
        "prepare_kbit": True,
        "checkpointing": "every-layer",
        "optimizer": "paged_adamw8bit",
    },
    # lesson 5's recipe on a T4 (course_lib.qlora.Recipe's defaults): fp16 compute (a T4 has no bf16), the
    # QLoRA stack, 4 micro-batches accumulated
    "qlora-t4": {
        "precision": "fp16",
        "lora_rank": 16,
        "quant": "nf4-dq",
        "prepare_kbit": True,
        "checkpointing": "every-layer",
        "optimizer": "paged_adamw8bit",
        "accum": 4,
    },
    # Answer.AI's fsdp_qlora template (benchmarks_03_2024.md): 2 GPUs, FSDP1 full shard of a 4-bit base with
    # bf16 adapters (peft before 0.11), every layer checkpointed, the model wrapped from the CPU with
    # sync_module_states (tests/planner/test_fsdp_wrap.py plans the same setup)
    "fsdp-qlora": {
        "precision": "bf16",
        "lora_rank": 64,
        "lora_targets": ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "down_proj"),
        "lora_dropout": 0.1,
        "quant": "nf4-dq",
        "autocast_adapter_dtype": False,
        "checkpointing": "every-layer",
        "loop": "outputs-until-step",
        "legacy_causal_lm_loss": True,
        "gpus": 2,
        "shard": "zero3",
        "fsdp_version": 1,
        "fsdp_backward_prefetch": True,
        "fsdp_wrap_from": "cpu-broadcast",
    },
}


def describe(name: str, applied: dict) -> str:
    """One line: the `Setup` fields the recipe set (`applied`: those no option given beside it overrode)."""
    parts = [f"{field}={','.join(value) if isinstance(value, tuple) else value}" for field, value in applied.items()]
    return f"recipe {name} set " + (", ".join(parts) if parts else "nothing (every field it sets was given)")
