"""QLoRA with every trick on, the capstone (lesson 5): a recipe, the model it builds, Hugging Face's
Trainer running it, and an ablation table of measured peak memory and step time beside the planner's
prediction.

The recipe is the one the earlier lessons end with: a frozen base stored in 4-bit NF4 with double
quantization (`BitsAndBytesConfig`), LoRA adapters (peft), activation checkpointing (lesson 3),
micro-batch 1 with gradient accumulation (lesson 2) and `paged_adamw_8bit` (lessons 1 and 4). The
precision follows `course_lib.device.dtype_policy`: fp32 on a CPU (every byte exact), bf16 autocast
from compute capability 8.0, fp16 autocast with fp32 trainable parameters and a GradScaler on a T4.

One module per job: `recipe` (the recipe and its tricks), `building` (configs, the saved random
checkpoint, the model, the data), `training` (the Trainer), `measuring` (one recipe measured beside
the planner's prediction), `ablation` (each trick off in turn), `gpu_rows` (each CUDA measurement in a
process of its own, the T4 emulation, `expandable_segments`, matmul rates). Lesson 5 stacks the
lessons before it and holds the planner's prediction beside each measured peak, so this package sits
above the planner (`course_lib.planner`), not beside the other lesson topics (CONTRIBUTING.md).
"""

from course_lib.qlora.ablation import (
    ablation,
    format_ablation,
    format_predicted_ablation,
    predicted_ablation,
)
from course_lib.qlora.building import (
    build_model,
    checkpoint_dir,
    compute_dtype,
    counting_dataset,
    llama_1b_config,
    quiet,
    tiny_llama_config,
)
from course_lib.qlora.gpu_rows import (
    emulate_t4,
    expandable_row,
    expandable_segments_effect,
    isolated_rows,
    matmul_rates,
    measure_row,
    train_row,
)
from course_lib.qlora.measuring import Row, make_optimizer, measure_recipe, planner_setup, predict, recipe_step
from course_lib.qlora.recipe import OPTIMS, PLANNER_OPTIM, TRICKS, Recipe, RecipeError
from course_lib.qlora.training import TrainResult, train, training_arguments

__all__ = [
    "OPTIMS",
    "PLANNER_OPTIM",
    "Recipe",
    "RecipeError",
    "Row",
    "TRICKS",
    "TrainResult",
    "ablation",
    "build_model",
    "checkpoint_dir",
    "compute_dtype",
    "counting_dataset",
    "emulate_t4",
    "expandable_row",
    "expandable_segments_effect",
    "format_ablation",
    "format_predicted_ablation",
    "isolated_rows",
    "llama_1b_config",
    "make_optimizer",
    "matmul_rates",
    "measure_recipe",
    "measure_row",
    "planner_setup",
    "predict",
    "predicted_ablation",
    "quiet",
    "recipe_step",
    "tiny_llama_config",
    "train",
    "train_row",
    "training_arguments",
]
