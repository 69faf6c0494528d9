"""What makes it fit: the tricks, in order, each on top of the ones before, until the step fits
(lesson 1, "what makes it fit")."""

from __future__ import annotations

from dataclasses import replace

from course_lib.memory.gpus import GPU, get_gpu
from course_lib.memory.prediction import Plan, Trick, predict
from course_lib.memory.setup import DEFAULT_LORA_RANK, SHARDS, PlanError, Setup
from course_lib.memory.toolbox import toolbox_tricks


def _candidate_tricks(setup: Setup, card: GPU) -> list[tuple[str, Setup]]:
    """The tricks, cheapest in quality first: exact ones (time only), then approximations."""
    tricks = []
    if setup.checkpointing == "none":
        tricks.append(("activation checkpointing (every layer)", replace(setup, checkpointing="every-layer")))
    if setup.batch > 1:
        tricks.append((f"micro-batch 1 with gradient accumulation x{setup.batch * setup.accum}",
                       replace(setup, batch=1, accum=setup.batch * setup.accum)))
    if setup.gpus is not None and setup.gpus > 1 and setup.shard != "zero3":  # exact; costs communication (lesson 6)
        stage = SHARDS[SHARDS.index(setup.shard) + 1]
        tricks.append((f"shard across the {setup.gpus} GPUs: {stage}", replace(setup, shard=stage)))
    if setup.optimizer in ("adamw", "paged_adamw32bit"):
        tricks.append(("8-bit AdamW (bitsandbytes)", replace(setup, optimizer="adamw8bit")))
    if not setup.lora_rank:
        precision = setup.precision.replace("mixed-", "")
        if precision == "bf16" and not card.bf16:
            precision = "fp16"
        tricks.append((f"LoRA r={DEFAULT_LORA_RANK} on all linear layers, frozen {precision} base",
                       replace(setup, lora_rank=DEFAULT_LORA_RANK, precision=precision)))
    if setup.quant == "none":  # as peft's QLoRA recipe does it: prepare_model_for_kbit_training included
        tricks.append(("QLoRA: NF4-DQ base + prepare_model_for_kbit_training",
                       replace(setup, quant="nf4-dq", prepare_kbit=True)))
    return tricks + toolbox_tricks(setup)  # lesson 7's, after the recipe of lessons 1 to 5


def what_makes_it_fit(model, setup: Setup, gpu: str | GPU, current: Plan | None = None) -> list[Trick]:
    """The tricks, in order, each applied on top of the ones before, with the bytes each saves, until
    the step fits on `gpu` or no trick is left (lesson 1, "what makes it fit").

    At each round the first trick of the canonical order that lowers the predicted peak is taken: a
    trick that saves nothing now (checkpointing while the optimizer step is the peak) is tried again
    after the next one.
    """
    card = get_gpu(gpu)
    current = current or predict(model, setup, card)
    tricks: list[Trick] = []
    state = setup
    while not current.fits:
        for name, nxt in _candidate_tricks(state, card):
            if nxt.quant != "none" and nxt.precision.startswith("mixed"):
                nxt = replace(nxt, precision=nxt.precision.replace("mixed-", ""))
            try:  # a combination the planner refuses (Setup.validate) is no trick
                after = predict(model, nxt.validate(), card)
            except PlanError:
                continue
            if current.total - after.total > current.total // 200:  # saves something worth saying (> 0.5%)
                tricks.append(Trick(name, current.total - after.total, after.total, bool(after.fits), nxt))
                state, current = nxt, after
                break
        else:
            break
    return tricks
