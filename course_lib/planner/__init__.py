"""The memory planner: predicted bytes of a training step by category, a GPU catalog, a fit verdict,
and "what makes it fit" (lesson 1, "the planner").

Model states (weights, gradients, optimizer state, fp32 master weights, quantization metadata) are
counted exactly, tensor by tensor, from the model's real parameter shapes (a meta-device build, see
`course_lib.models`), with each optimizer's real layout: torch AdamW's two moments and its step
counters, bitsandbytes' blockwise 8-bit state with its small-tensor fallback, Adafactor's factored
second moment, NF4's packed weights and block statistics.

Activations are not a formula. The planner runs one real training step of the Hugging Face
implementation on the meta device at the target size (shapes only, no memory) and records every
tensor it creates and frees: what each decoder layer saves for backward, the logits and loss
buffers, the gradients as they appear. A deep model is traced as two shallow copies of itself and
composed exactly (`compose`); traces are kept on disk (`cache`). Korthikanti et al.'s formula is
reported beside it. Checkpointing plans go through lesson 3's cost model
(`course_lib.checkpointing.plan_cost`), fed with the per-layer bytes of that trace, so the planner and
lesson 3 share one source of truth. `benchmarks/planner_accuracy.py` checks the predictions against
real training steps measured by `course_lib.measure`.

Its stages, one sub-package each, and their modules: docs/architecture.md.
"""

from course_lib.planner.allocator.reserved import Reserved, cublas_workspaces
from course_lib.planner.config.errors import PlanError
from course_lib.planner.config.fields import ATTENTIONS, LOOPS, OPTIMIZERS, PRECISIONS, QUANTS, SHARDS
from course_lib.planner.config.gpus import CUDA_CONTEXT_BYTES, GPU, GPUS, get_gpu
from course_lib.planner.config.setup import CATEGORIES, DEFAULT_LORA_RANK, Setup, default_precision
from course_lib.planner.entry import plan, plan_from_cli
from course_lib.planner.parallel.sharded import offload_prediction
from course_lib.planner.phases.activations import korthikanti_bytes
from course_lib.planner.predict import Plan, Trick
from course_lib.planner.search.fit import what_makes_it_fit
from course_lib.planner.states.model_states import (
    BNB_BLOCK,
    BNB_MIN_8BIT_SIZE,
    BNB_QMAPS_BYTES,
    NF4_BLOCK,
    NF4_DQ_BLOCK,
    ModelStates,
    model_states,
    nf4_bytes,
    optimizer_state_bytes,
)
from course_lib.planner.trace.step import Trace, trace_step

__all__ = [
    "ATTENTIONS",
    "BNB_BLOCK",
    "BNB_MIN_8BIT_SIZE",
    "BNB_QMAPS_BYTES",
    "CATEGORIES",
    "CUDA_CONTEXT_BYTES",
    "DEFAULT_LORA_RANK",
    "GPU",
    "GPUS",
    "LOOPS",
    "ModelStates",
    "NF4_BLOCK",
    "NF4_DQ_BLOCK",
    "OPTIMIZERS",
    "PRECISIONS",
    "Plan",
    "PlanError",
    "QUANTS",
    "Reserved",
    "SHARDS",
    "Setup",
    "Trace",
    "Trick",
    "cublas_workspaces",
    "default_precision",
    "get_gpu",
    "korthikanti_bytes",
    "model_states",
    "nf4_bytes",
    "offload_prediction",
    "optimizer_state_bytes",
    "plan",
    "plan_from_cli",
    "trace_step",
    "what_makes_it_fit",
]
