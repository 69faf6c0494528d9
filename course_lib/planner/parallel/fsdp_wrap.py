"""What FSDP1's wrap of a model on the CPU leaves in the caching allocator before the first step, and what
that does to the step's reserve (lesson 1, "the planner"; lesson 6). Predicted: a CPU has no caching allocator.

FullyShardedDataParallel(model, device_id=..., auto_wrap_policy=...) wraps the units innermost first
(`torch.distributed.fsdp.wrap._recursive_wrap`), and each unit's `_init_param_handle_from_module` (torch
2.2 to 2.13, `_init_utils.py`) runs on the GPU, in this order:
- `_move_module_to_device`: every parameter of the unit still on the CPU copied to the GPU, one block each;
- with `sync_module_states` (`Setup.fsdp_wrap_from == "cpu-broadcast"`: accelerate's
  cpu_ram_efficient_loading, Answer.AI's `low_memory`), `_sync_module_params_and_buffers` broadcasts them
  from rank 0 through `dist._broadcast_coalesced` in buckets of `PARAM_BROADCAST_BUCKET_SIZE` (250 MiB; a
  bucket closes once it holds that much, `compute_bucket_assignment_by_size`): a bucket of several
  tensors is copied into one flat tensor (`flatten_dense_tensors`; a bucket of one is broadcast in
  place), at most two in flight. NCCL records its stream on the tensors it sends, so the caching
  allocator gives such a block out again only once the broadcast has finished (`insert_events`,
  `process_events`): the plan takes it as free from the next unit's first parameter on, whose copy from
  pageable host memory waits for the broadcast;
- `FlatParamHandle`: the parameters concatenated into one flat parameter (`torch.cat`), then `shard()`:
  rank 0's chunk cloned (padded by `F.pad` when the flat parameter does not split evenly) and the flat
  storage freed (`_resize_(0)`); the copied parameters are freed when the unit's init returns. Under
  NO_SHARD the flat parameter is kept whole.
The shards stay; the rest is cached, and the step's allocations on the same stream reuse what they can.
The 4-bit quant_state (no parameter) is on the GPU before the wrap and stays.
"""

from __future__ import annotations

import math

from course_lib.caching_allocator import concatenated, replay, two_steps
from course_lib.models import ModelSpec
from course_lib.planner.config.setup import Setup, itemsize
from course_lib.planner.parallel.fsdp import stored_bytes
from course_lib.planner.states.model_states import target_match
from course_lib.planner.trace.step_trace import StepTrace

PARAM_BROADCAST_BUCKET_SIZE = 250 * 1024 * 1024  # torch.distributed.fsdp._init_utils
BROADCASTS_IN_FLIGHT = 2  # torch/csrc/distributed/c10d/comm.cpp broadcast_coalesced: max_in_flight


class _Stream:
    """A `caching_allocator.replay` stream being written: `alloc` returns the entry's index for `free`."""

    def __init__(self) -> None:
        self.entries: list[int] = []
        self._count = 0

    def alloc(self, nbytes: int) -> int:
        self.entries.append(nbytes)
        self._count += 1
        return self._count - 1

    def free(self, index: int) -> None:
        self.entries.append(~index)


def wrap_units(spec: ModelSpec, setup: Setup) -> list[list[int]]:
    """The bytes of each parameter of each FSDP1 unit in the order the wrap initialises them: per decoder
    layer each LoRA adapter (peft's fsdp_auto_wrap_policy makes every trainable leaf a unit), then the
    layer; last the root with everything outside the layers."""
    adapter = 4 if setup.autocast_adapter_dtype else itemsize(setup.weight_dtype)
    units: list[list[int]] = []
    for layer in range(spec.n_layers or 0):
        params = [info for info in spec.params if info.layer == layer]
        for info in params:
            if setup.lora_rank and target_match(info, setup.lora_targets):
                rows, cols = info.shape
                units += [[setup.lora_rank * cols * adapter], [rows * setup.lora_rank * adapter]]
        units.append([stored_bytes(info, setup) for info in params])
    units.append([stored_bytes(info, setup) for info in spec.params if info.layer is None])
    return [unit for unit in units if unit]


def quant_state_sizes(spec: ModelSpec, setup: Setup) -> list[int]:
    """The 4-bit quant_state's tensors of every quantized weight (absmax, code; with double quantization the
    nested absmax, its code and the offset), on the GPU before the wrap."""
    if setup.quant == "none":
        return []
    sizes = []
    for info in spec.params:
        if info.module == "linear" and not info.is_lm_head and info.name.endswith(".weight"):
            blocks = math.ceil(info.numel / 64)
            sizes += [blocks, 16 * 4] + ([4, math.ceil(blocks / 256) * 4, 256 * 4] if setup.quant == "nf4-dq" else [])
    return sizes


def wrap_stream(spec: ModelSpec, setup: Setup) -> tuple[list[int], list[int]]:
    """(the wrap's allocation stream on one rank, the bytes it leaves allocated), quant_state first."""
    stream = _Stream()
    kept = quant_state_sizes(spec, setup)
    for size in kept:
        stream.alloc(size)
    broadcast, sharded = setup.fsdp_wrap_from == "cpu-broadcast", setup.shard != "none"
    element = itemsize(setup.weight_dtype)
    pending: list[int] = []  # blocks NCCL used: free once the next unit's first copy has waited for them
    for unit in wrap_units(spec, setup):
        params = []
        for nbytes in unit:
            params.append(stream.alloc(nbytes))
            for index in pending:
                stream.free(index)
            pending = []
        sent: set[int] = set()
        if broadcast:
            in_flight: list[int | None] = []
            for bucket in _buckets(unit):
                if len(in_flight) == BROADCASTS_IN_FLIGHT:
                    done = in_flight.pop(0)
                    pending += [] if done is None else [done]
                if len(bucket) == 1:
                    sent.add(bucket[0])
                in_flight.append(None if len(bucket) == 1 else stream.alloc(sum(unit[i] for i in bucket)))
            pending += [index for index in in_flight if index is not None]
        total = sum(unit)
        flat = stream.alloc(total)
        if sharded:
            numel = math.ceil(total / element)
            chunk = math.ceil(numel / setup.gpus) * element  # rank 0's chunk, whole (only the last pads)
            stream.alloc(chunk)
            kept.append(chunk)
            stream.free(flat)
        else:
            kept.append(total)
        for position, index in enumerate(params):
            if position in sent:
                pending.append(index)
            else:
                stream.free(index)
    for index in pending:
        stream.free(index)
    return stream.entries, kept


def _buckets(unit: list[int]) -> list[list[int]]:
    """`compute_bucket_assignment_by_size`'s buckets of one dtype: positions, each bucket closed once it
    holds `PARAM_BROADCAST_BUCKET_SIZE` bytes."""
    buckets, current, size = [], [], 0
    for position, nbytes in enumerate(unit):
        current.append(position)
        size += nbytes
        if size >= PARAM_BROADCAST_BUCKET_SIZE:
            buckets.append(current)
            current, size = [], 0
    return buckets + ([current] if current else [])


def residue_extra(
    wrap: list[int], kept: list[int], step: list[int], states: list[int], empty_cache: bool = False
) -> int:
    """What the wrap's cache adds to the reserve of the steps after it (negative where the steps' blocks
    fit in it): the wrap, the optimizer's state, the step twice (`caching_allocator.two_steps`) replayed on one
    allocator, less the wrap's kept bytes with the state and the two steps each replayed on their own (what
    the plan's reserve counts without the wrap: `reserved.reserved_prediction`)."""
    together = replay(concatenated(wrap, states, two_steps(step, empty_cache))).peak_reserved
    apart = replay(kept + states).peak_reserved + replay(two_steps(step, empty_cache)).peak_reserved
    return together - apart


def wrap_extra(step: StepTrace, states: list[int]) -> int:
    """`residue_extra` of the planned step (`StepTrace.stream`: the checkpointed step's under a checkpointing
    plan, else the plain step's) after FSDP1's wrap from the CPU (`setup.fsdp_wrap_from`), on rank 0.
    Predicted."""
    spec, setup = step.spec, step.setup
    extra = (
        "fsdp-wrap",
        setup.fsdp_wrap_from,
        setup.shard,
        setup.gpus,
        setup.quant,
        setup.checkpointing,
        setup.empty_cache_each_step,
        tuple(states),
    )
    return step.answer(
        "wrap",
        extra,
        lambda: residue_extra(*wrap_stream(spec, setup), step.stream(), states, setup.empty_cache_each_step),
    )


def after_wrap(spec: ModelSpec, setup: Setup) -> tuple[int, int]:
    """(reserved, allocated) on rank 0 when the wrap returns, before the first step
    (Answer.AI's `reserved_after_model_wrap`). Predicted."""
    stats = replay(wrap_stream(spec, setup)[0])
    return stats.reserved, stats.allocated
