"""Training a recipe with Hugging Face's Trainer: the four tricks are four arguments (lesson 5)."""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from course_lib import validate
from course_lib.device import DtypePolicy, dtype_policy
from course_lib.errors import UserError
from course_lib.qlora.building import build_model, quiet
from course_lib.qlora.recipe import Recipe, RecipeError, valid_recipe
from course_lib.validate import Device, checked


def training_arguments(
    recipe: Recipe,
    output_dir: str | Path,
    *,
    max_steps: int,
    learning_rate: float = 2e-3,
    device: Device = "cpu",
    policy: DtypePolicy | None = None,
):
    """The Trainer's arguments for a recipe (lesson 5): the four tricks are four arguments, the
    precision is the device's policy (fp16=True on a T4, bf16=True from compute capability 8.0)."""
    from transformers import TrainingArguments  # heavy: transformers

    valid_recipe(recipe)
    device = torch.device(device)
    policy = policy or dtype_policy(device)
    # transformers 5.23 renamed gradient_checkpointing to activation_checkpointing (the old name warns)
    name = (
        "activation_checkpointing"
        if "activation_checkpointing" in TrainingArguments.__dataclass_fields__
        else "gradient_checkpointing"
    )
    checkpointing = {
        name: recipe.checkpointing,
        f"{name}_kwargs": {"use_reentrant": False} if recipe.checkpointing else None,
    }
    return TrainingArguments(
        output_dir=str(output_dir),
        per_device_train_batch_size=recipe.batch,
        gradient_accumulation_steps=recipe.accum,
        **checkpointing,
        optim=recipe.optim,
        learning_rate=learning_rate,
        max_steps=max_steps,
        warmup_steps=0,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        fp16=policy.autocast_dtype == torch.float16,
        bf16=policy.autocast_dtype == torch.bfloat16,
        use_cpu=device.type == "cpu",
        dataloader_num_workers=0,
        seed=0,
        disable_tqdm=True,
        remove_unused_columns=False,
    )


@checked(error=RecipeError)
@dataclass
class TrainResult:
    losses: list[float]
    seconds: float
    model: torch.nn.Module


def train(
    config,
    recipe: Recipe,
    dataset: list[dict],
    *,
    max_steps: int,
    learning_rate: float = 2e-3,
    device: Device = "cpu",
    policy: DtypePolicy | None = None,
    weights: str | Path | None = None,
) -> TrainResult:
    """Fine-tune with Hugging Face's Trainer and return the loss of every optimizer step (lesson 5).
    `policy` defaults to the device's (`course_lib.device.dtype_policy`); `weights` as in `build_model`."""
    from transformers import PrinterCallback, Trainer  # heavy: transformers

    recipe = valid_recipe(recipe)  # all before the model is built
    max_steps = validate.positive_int("max_steps", max_steps)
    validate.positive("learning_rate", learning_rate)
    dataset = validate.non_empty("dataset", dataset, "rows (dicts of input_ids and labels)")
    if len(dataset) < recipe.effective_batch:
        raise UserError(
            f"the dataset has {len(dataset)} rows, fewer than one effective batch ({recipe.effective_batch})"
        )
    model = build_model(config, recipe, device, policy, weights)
    with tempfile.TemporaryDirectory() as folder, quiet():
        args = training_arguments(
            recipe, folder, max_steps=max_steps, learning_rate=learning_rate, device=device, policy=policy
        )
        trainer = Trainer(model=model, args=args, train_dataset=dataset)
        trainer.remove_callback(PrinterCallback)  # the losses are returned, not printed
        start = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - start
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    return TrainResult(losses, seconds, model)
