"""Paged optimizers on CUDA unified memory: a simulator true to the driver (lesson 4).

- `policies`: the simulated GPU (`Hardware`, its inputs) and the driver's rules (`Policy`);
- `trace`: what a training step does to memory, as events;
- `simulator`: runs a trace (`simulate`), every number it returns *simulated*;
- `regimes`: the lesson's scenarios (the three regimes, cost per GB, paging against offload);
- `touches`: which memory a real step touches, measured.

The public names of all five are importable from `course_lib.paging`.
"""

from course_lib.measure import GiB, KiB, MiB, PHASES, format_bytes
from course_lib.paging.policies import (ALLOCATOR_ROUND, BNB_BLOCKSIZE, BNB_MIN_8BIT_SIZE, BNB_PAGED_MIN_NUMEL,
                                        EVICTION_POLICIES, GB, GRANULARITIES, OPTIMIZERS, PCIE3_X16, ROOT_CHUNK,
                                        T4_FP32_FLOPS, VA_BLOCK, Hardware, OutOfDeviceMemory, PagingError, Policy,
                                        block_bytes, segment_bytes, sweep_faults)
from course_lib.paging.regimes import (OffloadResult, RegimeResult, StrategyRow, bnb_estimate_ms,
                                       compare_strategies, evicted_per_step_cost, lesson_model, regimes,
                                       simulate_offload)
from course_lib.paging.simulator import PhaseStats, Segment, SimulationResult, chunk_migrations, simulate
from course_lib.paging.touches import TOUCH_CATEGORIES, Touch, measure_touches, touch_summary
from course_lib.paging.trace import (OPS, Event, ParamSpec, StateTensor, TrainingSetup, activation_bytes_per_token,
                                     alloc, chunk_trace, compute, empty_cache, free, optimizer_state,
                                     params_from_module, prefetch, touch, training_trace, transformer_params)

__all__ = [name for name in dir() if not name.startswith("_")]
