"""Gradient accumulation done right, measured (lesson 2).

Accumulating K micro-batches gives the gradient of the whole batch only when every micro-batch's
loss sum is divided by the item count of the whole window (tokens, for a token loss), and only for
models whose per-item loss does not depend on the other rows of the batch (no BatchNorm in training
mode). One module per job:

- `losses`, `batches`, `tiny_models`: losses as (sum, count), micro-batches, the lesson's models;
- `equivalence`: `compare_accumulation`, the whole batch vs K micro-batches in fp32 and fp64;
- `batchnorm`: the BatchNorm failure and its remedies, `compare_batchnorm_remedies`;
- `loop`: the reference loop `train_with_accumulation` (`AccumulationLoop`) and its ground truth;
- `broken`: deliberately broken loops, one classic mistake each (`MISTAKES`, `demonstrate_mistakes`);
- `crosschecks`: the reference loop against Hugging Face's Trainer and against DDP in 2 processes;
- `cost`: time, memory and counted FLOPs vs micro-batch size (`measure_accumulation_cost`).
"""

from course_lib.accumulation.batches import (
    batch_size,
    cast_batch,
    check_accumulation_steps,
    collate_padded,
    concat_batches,
    padded_token_batches,
    padded_token_examples,
    regression_batches,
    split_batch,
)
from course_lib.accumulation.batchnorm import (
    REMEDY_NOTES,
    FrozenStatsBatchNorm1d,
    FrozenStatsBatchNorm2d,
    GhostBatchNorm1d,
    GhostBatchNorm2d,
    RemedyReport,
    RemedyRow,
    compare_batchnorm_remedies,
    freeze_batchnorm_stats,
    ghost_batchnorm,
    replace_batchnorm,
)
from course_lib.accumulation.broken import (
    BROKEN_LOOPS,
    DDP_MISTAKES,
    MISTAKES,
    demonstrate_mistakes,
    loop_class,
    train_with_mistake,
)
from course_lib.accumulation.cost import CostRow, cost_model, format_cost_table, measure_accumulation_cost
from course_lib.accumulation.crosschecks import DDPReport, TrainerCrossCheck, ddp_accumulation_demo, trainer_cross_check
from course_lib.accumulation.equivalence import (
    AccumulationReport,
    BufferDiff,
    DtypeComparison,
    GradientDiff,
    compare_accumulation,
    micro_batch_losses,
)
from course_lib.accumulation.loop import (
    AccumulationLoop,
    TrainResult,
    max_weight_difference,
    train_whole_windows,
    train_with_accumulation,
    windows,
)
from course_lib.accumulation.losses import IGNORE_INDEX, Batch, SampleLoss, TokenLoss, default_loss
from course_lib.accumulation.tiny_models import TinyTokenLM, tiny_causal_lm_config, tiny_mlp

__all__ = [
    "IGNORE_INDEX",
    "Batch",
    "SampleLoss",
    "TokenLoss",
    "default_loss",
    "batch_size",
    "cast_batch",
    "check_accumulation_steps",
    "collate_padded",
    "concat_batches",
    "padded_token_batches",
    "padded_token_examples",
    "regression_batches",
    "split_batch",
    "TinyTokenLM",
    "tiny_causal_lm_config",
    "tiny_mlp",
    "AccumulationReport",
    "BufferDiff",
    "DtypeComparison",
    "GradientDiff",
    "compare_accumulation",
    "micro_batch_losses",
    "REMEDY_NOTES",
    "FrozenStatsBatchNorm1d",
    "FrozenStatsBatchNorm2d",
    "GhostBatchNorm1d",
    "GhostBatchNorm2d",
    "RemedyReport",
    "RemedyRow",
    "compare_batchnorm_remedies",
    "freeze_batchnorm_stats",
    "ghost_batchnorm",
    "replace_batchnorm",
    "AccumulationLoop",
    "TrainResult",
    "max_weight_difference",
    "train_whole_windows",
    "train_with_accumulation",
    "windows",
    "BROKEN_LOOPS",
    "DDP_MISTAKES",
    "MISTAKES",
    "demonstrate_mistakes",
    "loop_class",
    "train_with_mistake",
    "DDPReport",
    "TrainerCrossCheck",
    "ddp_accumulation_demo",
    "trainer_cross_check",
    "CostRow",
    "cost_model",
    "format_cost_table",
    "measure_accumulation_cost",
]
