"""Paged optimizers on CUDA unified memory: a simulator true to the driver, and the real thing on a
CUDA GPU (lesson 4).

The simulator, every number it returns *simulated*:
- `policies`: the simulated GPU (`Hardware`, its inputs) and the driver's rules (`Policy`);
- `trace`: what a training step does to memory, as events;
- `simulator`: runs a trace (`simulate`); `results`: what it returns;
- `regimes`: the lesson's scenarios (the three regimes, cost per GB, paging against offload);
- `touches`: which memory a real step touches, measured.

The real GPU side, measured:
- `demo`: plain AdamW, bitsandbytes' 8-bit and paged optimizers and CPU offload on a GPU made small;
- `virtual_gpu`: a small GPU inside a big one (`VirtualGPU`), `release_cuda_memory`;
- `timeline`: when bitsandbytes prefetches and updates each parameter's state;
- `cpu_offload`: `CPUOffloadAdamW`, manual offload as torchao does it;
- `probe`: bitsandbytes' managed-memory calls, the link's rates, the driver's eviction order.

The public names of all of them are importable from `course_lib.paging`.
"""

from course_lib.measure import PHASES, GiB, KiB, MiB, format_bytes
from course_lib.paging.cpu_offload import CPUOffloadAdamW
from course_lib.paging.demo import (
    DEMO_OPTIMIZERS,
    MARGIN,
    DemoRun,
    StepRecord,
    demo_claims,
    demo_margins,
    demo_row,
    demo_shape,
    isolated_runs,
    make_optimizer,
    mlp,
    mlp_setup,
    paging_demo,
    run_training,
    runs_table,
    spike_plan,
    warm_up,
)
from course_lib.paging.policies import (
    ALLOCATOR_ROUND,
    BNB_BLOCKSIZE,
    BNB_MIN_8BIT_SIZE,
    BNB_PAGED_MIN_NUMEL,
    EVICTION_POLICIES,
    GB,
    GRANULARITIES,
    OPTIMIZERS,
    PCIE3_X16,
    ROOT_CHUNK,
    T4_FP32_FLOPS,
    VA_BLOCK,
    Hardware,
    OutOfDeviceMemory,
    PagingError,
    Policy,
    block_bytes,
    segment_bytes,
    sweep_faults,
)
from course_lib.paging.probe import eviction_order, measure_bandwidths
from course_lib.paging.regimes import (
    OffloadResult,
    RegimeResult,
    StrategyRow,
    bnb_estimate_ms,
    compare_strategies,
    evicted_per_step_cost,
    lesson_model,
    regimes,
    simulate_offload,
)
from course_lib.paging.results import PhaseStats, Segment, SimulationResult
from course_lib.paging.simulator import chunk_migrations, simulate
from course_lib.paging.timeline import PrefetchTimeline, TimelineEntry
from course_lib.paging.touches import TOUCH_CATEGORIES, Touch, measure_touches, touch_summary
from course_lib.paging.trace import (
    OPS,
    Event,
    ParamSpec,
    StateTensor,
    TrainingSetup,
    activation_bytes_per_token,
    alloc,
    chunk_trace,
    compute,
    empty_cache,
    free,
    optimizer_state,
    params_from_module,
    prefetch,
    touch,
    training_trace,
    transformer_params,
)
from course_lib.paging.virtual_gpu import VirtualGPU, release_cuda_memory

__all__ = [
    "activation_bytes_per_token",
    "alloc",
    "ALLOCATOR_ROUND",
    "block_bytes",
    "BNB_BLOCKSIZE",
    "bnb_estimate_ms",
    "BNB_MIN_8BIT_SIZE",
    "BNB_PAGED_MIN_NUMEL",
    "chunk_migrations",
    "chunk_trace",
    "compare_strategies",
    "compute",
    "CPUOffloadAdamW",
    "demo_claims",
    "demo_margins",
    "DEMO_OPTIMIZERS",
    "demo_row",
    "demo_shape",
    "DemoRun",
    "empty_cache",
    "Event",
    "evicted_per_step_cost",
    "eviction_order",
    "EVICTION_POLICIES",
    "format_bytes",
    "free",
    "GB",
    "GiB",
    "GRANULARITIES",
    "Hardware",
    "isolated_runs",
    "KiB",
    "lesson_model",
    "make_optimizer",
    "MARGIN",
    "measure_bandwidths",
    "measure_touches",
    "MiB",
    "mlp",
    "mlp_setup",
    "OffloadResult",
    "OPS",
    "optimizer_state",
    "OPTIMIZERS",
    "OutOfDeviceMemory",
    "paging_demo",
    "PagingError",
    "params_from_module",
    "ParamSpec",
    "PCIE3_X16",
    "PHASES",
    "PhaseStats",
    "Policy",
    "prefetch",
    "PrefetchTimeline",
    "RegimeResult",
    "regimes",
    "release_cuda_memory",
    "ROOT_CHUNK",
    "run_training",
    "runs_table",
    "Segment",
    "segment_bytes",
    "simulate",
    "simulate_offload",
    "SimulationResult",
    "spike_plan",
    "StateTensor",
    "StepRecord",
    "StrategyRow",
    "sweep_faults",
    "T4_FP32_FLOPS",
    "TimelineEntry",
    "Touch",
    "touch",
    "TOUCH_CATEGORIES",
    "touch_summary",
    "training_trace",
    "TrainingSetup",
    "transformer_params",
    "VA_BLOCK",
    "VirtualGPU",
    "warm_up",
]
