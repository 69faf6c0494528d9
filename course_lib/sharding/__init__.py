"""Sharding across ranks: ZeRO's stages on real engines (DDP, ZeroRedundancyOptimizer, FSDP2), measured
per rank in gloo processes on one machine (lesson 6).

- `launch`: N processes in one gloo group on 127.0.0.1 (also lesson 2's DDP cross-check);
- `engines`: which engine configuration stands for which ZeRO stage, and wrapping a model with it;
- `tracking`: the live-storage tracker that follows FSDP2's storage resizes; collectives and bytes sent;
- `measuring`: one measured step per rank and stage, in one spawn per world size.
"""

from course_lib.sharding.engines import ENGINES, STAGES, WRAPPINGS, FSDPOptions, wrap
from course_lib.sharding.launch import free_port, run_ranks
from course_lib.sharding.measuring import RankStep, measure_offload_on_cuda, measure_sharding
from course_lib.sharding.tracking import CommCounter, RankTracker

__all__ = [
    "ENGINES",
    "STAGES",
    "WRAPPINGS",
    "FSDPOptions",
    "wrap",
    "free_port",
    "run_ranks",
    "RankStep",
    "measure_offload_on_cuda",
    "measure_sharding",
    "CommCounter",
    "RankTracker",
]
