"""One training step per rank under each engine, measured (lesson 6, "measured, rank by rank").

`measure_sharding(model, world_size, stages)` starts `world_size` gloo processes once; inside them
each stage in turn builds the same Hugging Face model from its config (same seed), wraps it with
that stage's engine (`engines.wrap`), runs a warm-up step (AdamW creates its state, FSDP2 its
buffers), then `repeats` measured steps (two by default; optionally of K accumulated micro-batches each) under
`RankTracker` (every storage the rank holds, the model's own included, from before the engine
wrapped it) and `CommCounter` (the collectives of the step).
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass

import torch

from course_lib import validate
from course_lib.errors import UserError
from course_lib.measure import PHASES, PlainTextTable, format_bytes, optimizer_state_tensors, storage_bytes
from course_lib.sharding.engines import ENGINES, STAGES, FSDPOptions, wrap
from course_lib.sharding.launch import run_ranks
from course_lib.sharding.tracking import CommCounter, RankTracker
from course_lib.validate import checked

# Measured steps per stage. The collectives run asynchronously (gloo's worker thread drops its references
# to a collective's buffers on its own schedule), so which buffers are alive together moves from step to
# step, and so does the peak (lesson 6, "the spread"). A step's `peak` is the highest of its repeats: the
# peak that can happen; every repeat's is kept (`repeat_peaks`).
REPEATS = 2


@checked
@dataclass
class RankStep(PlainTextTable):
    """What one rank held and sent in one training step, in bytes (lesson 6)."""

    stage: str
    engine: str
    world_size: int
    rank: int
    micro_batches: int  # micro-batches in the measured step (gradient accumulation)
    skip_sync: bool  # all but the last micro-batch skip the gradient sync (DDP no_sync, FSDP2
    # set_requires_gradient_sync(False))
    parameters: int  # this rank's parameters (its shards under FSDP2), after the step
    gradients: int  # this rank's gradients (shards under FSDP2), after the step
    optimizer_state: int  # this rank's AdamW state
    peak: int  # the most live at any moment of forward, backward and the optimizer step,
    # the highest of the measured steps
    phase_peaks: dict  # of the measured step with the highest peak
    repeat_peaks: list  # the peak of each measured step
    bytes_sent: int  # by this rank, ring algorithm, all collectives of the step
    sent_by_collective: dict
    calls: dict

    @property
    def model_states(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        return (
            f"{self.stage} ({self.engine}), rank {self.rank} of {self.world_size}: peak {format_bytes(self.peak)}, "
            f"model states {format_bytes(self.model_states)} (parameters {format_bytes(self.parameters)}, "
            f"gradients {format_bytes(self.gradients)}, optimizer {format_bytes(self.optimizer_state)}), "
            f"sent {format_bytes(self.bytes_sent)}"
        )


def _local(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """The rank's own part of a DTensor (an FSDP2 shard); a plain tensor as it is."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _loss(model, batch) -> torch.Tensor:
    return model(**batch).loss


def _no_sync(engine, skip: bool):
    """The context of a micro-batch whose gradients are not synchronised (lesson 2's no_sync; lesson 6)."""
    if hasattr(engine, "set_requires_gradient_sync"):  # FSDP2: keeps this micro-batch's gradients unsharded
        engine.set_requires_gradient_sync(not skip)
        return contextlib.nullcontext()
    return engine.no_sync() if skip else contextlib.nullcontext()


def _measure_stage(
    rank: int,
    world_size: int,
    build,
    stage: str,
    batch_size: int,
    seq: int,
    seed: int,
    micro_batches: int = 1,
    skip_sync: bool = False,
    repeats: int = REPEATS,
    fsdp: FSDPOptions = FSDPOptions(),
) -> RankStep:
    torch.manual_seed(seed)
    model = build()
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(seed + rank)  # each rank trains on its own micro-batch
    ids = torch.randint(0, vocab, (batch_size, seq), generator=generator)
    batch = {"input_ids": ids, "labels": ids}
    tracker = RankTracker()
    for tensor in [*model.parameters(), *model.buffers(), ids]:
        tracker.watch(tensor)
    with tracker:
        engine, optimizer = wrap(model, stage, world_size, fsdp=fsdp)
        del model
        _loss(engine, batch).backward()  # warm-up: optimizer state, engine buffers
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        measured = []
        for _ in range(repeats):
            peaks: dict[str, int] = {}

            def begin(phase: str) -> None:  # fold the phase that ends into `peaks`, start the next
                if tracker.phase in PHASES:
                    peaks[tracker.phase] = max(peaks.get(tracker.phase, 0), tracker.phase_peaks[tracker.phase])
                tracker.set_phase(phase)

            optimizer.zero_grad(set_to_none=True)
            tracker.set_phase("between steps")
            counter = CommCounter(world_size)
            with counter.counting():
                for i in range(micro_batches):
                    with _no_sync(engine, skip_sync and i < micro_batches - 1):
                        begin("forward")
                        loss = _loss(engine, batch) / micro_batches
                        begin("backward")
                        loss.backward()
                        del loss
                begin("optimizer")
                optimizer.step()
                begin("between steps")
            measured.append(peaks)
    params = [_local(p) for p in engine.parameters()]
    grads = [_local(p.grad) for p in engine.parameters()]
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer's local AdamW
    state = [_local(t) for t in optimizer_state_tensors(inner)]
    peaks = max(measured, key=lambda p: max(p.values()))
    return RankStep(
        stage=stage,
        engine=ENGINES[stage],
        world_size=world_size,
        rank=rank,
        micro_batches=micro_batches,
        skip_sync=skip_sync,
        parameters=storage_bytes(params),
        gradients=storage_bytes(grads),
        optimizer_state=storage_bytes(state),
        peak=max(peaks.values()),
        phase_peaks=peaks,
        repeat_peaks=[max(p.values()) for p in measured],
        bytes_sent=counter.bytes_sent,
        sent_by_collective=dict(counter.sent),
        calls=dict(counter.calls),
    )


def _worker(
    rank: int,
    world_size: int,
    build,
    runs,
    batch_size: int,
    seq: int,
    seed: int,
    micro_batches: int,
    repeats: int,
    fsdp: FSDPOptions,
) -> list[dict]:
    return [
        _measure_stage(
            rank, world_size, build, stage, batch_size, seq, seed, micro_batches, skip, repeats, fsdp
        ).to_dict()
        for stage, skip in runs
    ]


def measure_sharding(
    build,
    world_size: int,
    stages=STAGES,
    *,
    batch: int = 2,
    seq: int = 64,
    seed: int = 0,
    micro_batches: int = 1,
    skip_sync=(False,),
    repeats: int = REPEATS,
    fsdp: FSDPOptions = FSDPOptions(),
    timeout_s: float = 300.0,
) -> list[RankStep]:
    """Every rank's memory and traffic for one step of each stage, in one start of the processes (lesson 6).

    `build`: a picklable function returning a fresh fp32 Hugging Face causal LM (e.g.
    `functools.partial(course_lib.checkpointing.tiny_decoder, "llama", n_layers=4)`); `batch` is
    each rank's micro-batch; `micro_batches` > 1 accumulates gradients over that many, once for each
    value of `skip_sync` (False: sync every micro-batch; True: only the last, lesson 2's no_sync).
    `repeats` measured steps per stage (the peak moves from step to step: each RankStep keeps all);
    `fsdp`: how zero2 and zero3 configure FSDP2 (wrapping, MixedPrecisionPolicy, the root's resharding).
    Returns one RankStep per (stage, skip_sync, rank), in that order.
    """
    stages = validate.choices("stage", stages, tuple(ENGINES))  # all before any process starts
    world_size = validate.positive_int("world_size (processes on this machine)", world_size, maximum=64)
    batch, seq, micro_batches, repeats = (
        validate.positive_int(name, value)
        for name, value in (("batch", batch), ("seq", seq), ("micro_batches", micro_batches), ("repeats", repeats))
    )
    skip_sync = [validate.strict_bool("skip_sync", skip) for skip in validate.non_empty("skip_sync", skip_sync)]
    validate.positive("timeout_s", timeout_s)
    if not callable(build):
        raise UserError(f"build must be a function returning a fresh model, got {build!r}")
    runs = [(stage, bool(skip)) for stage in stages for skip in skip_sync]
    per_rank = run_ranks(
        _worker,
        world_size,
        build,
        runs,
        batch,
        seq,
        seed,
        micro_batches,
        repeats,
        fsdp,
        timeout_s=timeout_s,
        what="sharding processes",
    )
    return [RankStep(**per_rank[r][i]) for i in range(len(runs)) for r in range(world_size)]


def _offload_worker(rank: int, world_size: int, build, batch_size: int, seq: int) -> dict:
    # off the import path: torch.distributed.fsdp takes most of a second to import
    from torch.distributed.fsdp import CPUOffloadPolicy

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    torch.manual_seed(0)
    model, optimizer = wrap(build(), "zero3", world_size, device="cuda", offload_policy=CPUOffloadPolicy())
    ids = torch.randint(0, model.config.vocab_size, (batch_size, seq), device=device)
    for step in range(2):  # the first creates AdamW's state (in CPU RAM) and FSDP2's buffers
        if step == 1:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize(device)
    return {
        "peak_gpu_bytes": torch.cuda.max_memory_allocated(device),
        "parameters_on": str(next(model.parameters()).to_local().device),
    }


def measure_offload_on_cuda(build, *, batch: int = 2, seq: int = 64, timeout_s: float = 300.0) -> dict:
    """One FSDP2 zero3 step with CPUOffloadPolicy on one CUDA GPU, in its own process: the GPU's peak
    (the caching allocator's) and where the parameters live (lesson 6, "offloading the shards")."""
    if not torch.cuda.is_available():
        raise RuntimeError("measure_offload_on_cuda needs a CUDA GPU")
    return run_ranks(
        _offload_worker,
        1,
        build,
        batch,
        seq,
        timeout_s=timeout_s,
        what="offload processes",
        backend="cuda:nccl,cpu:gloo",
    )[0]
