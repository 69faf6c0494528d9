"""Where a step fits when no trick makes it fit on one GPU: the smallest catalog GPU that takes it, or
how many of this GPU take it with zero3 (lesson 1, "what makes it fit"; lesson 6 for zero3)."""

from __future__ import annotations

from dataclasses import replace

from course_lib.measure import format_bytes
from course_lib.planner.config.errors import PlanError
from course_lib.planner.config.gpus import GPU, GPUS
from course_lib.planner.config.setup import Setup
from course_lib.planner.predict import Trick, predict

ZERO3_GPUS = (2, 4, 8, 16, 32, 64)


def where_it_fits(model, setup: Setup, card: GPU, tricks: list[Trick]) -> str:
    """The closing line of a plan that nothing makes fit on one `card` (lesson 1, "what makes it fit"):
    the smallest catalog GPU that takes the setup with every trick found, and the fewest of `card` (up to
    64) that take `setup` under zero3 (FSDP2) with checkpointing, its base as asked (a 4-bit base is
    sharded as FSDP + QLoRA shards it, lesson 6; lesson 7's tricks under sharding are not modelled)."""
    final = tricks[-1].setup if tricks else setup
    bigger = next(
        (
            gpu
            for gpu in sorted(GPUS.values(), key=lambda g: g.memory_bytes)
            if gpu.memory_bytes > card.memory_bytes and predict(model, final, gpu).fits
        ),
        None,
    )
    sharded = replace(
        setup,
        prepare_kbit=False,
        optimizer_in_backward=False,
        chunked_loss=None,
        offload_activations=False,
        checkpointing="every-layer",
        shard="zero3",
    )
    many = None
    for count in ZERO3_GPUS:
        try:
            if predict(model, replace(sharded, gpus=count).validate(), card).fits:
                many = count
                break
        except PlanError:  # a setup zero3 cannot take
            break
    first = (
        f"the smallest GPU that fits is {bigger.name} ({format_bytes(bigger.memory_bytes)})"
        if bigger
        else "no GPU in the catalog fits it"
    )
    second = f"or {many} {card.name}s with zero3" if many else f"not even {ZERO3_GPUS[-1]} {card.name}s with zero3"
    base = "the 4-bit base sharded as FSDP + QLoRA shards it" if setup.quant != "none" else "the base as asked"
    return f"nothing on one {card.name} fits; {first}, {second}\n  (zero3: FSDP2, every-layer checkpointing, {base})"
