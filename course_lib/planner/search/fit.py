"""What makes it fit: the tricks the step needs, exact ones (time only) before lossy ones, each tried on
top of the ones before, then every trick the final setup does not need dropped (lesson 1, "what makes
it fit")."""

from __future__ import annotations

from dataclasses import replace

from course_lib import validate
from course_lib.planner.config.errors import PlanError
from course_lib.planner.config.fields import SHARDS
from course_lib.planner.config.gpus import GPU, get_gpu
from course_lib.planner.config.setup import DEFAULT_LORA_RANK, Setup
from course_lib.planner.predict import Plan, Trick, predict
from course_lib.planner.trace.toolbox import toolbox_tricks


def _candidate_tricks(setup: Setup, card: GPU) -> list[tuple[str, Setup, bool]]:
    """(name, the setup with it, exact?): the exact tricks first (same result, more time or
    communication), lesson 7's among them, then the lossy ones (8-bit state, adapters, a 4-bit base)."""
    exact = []
    if setup.checkpointing == "none":
        exact.append(("activation checkpointing (every layer)", replace(setup, checkpointing="every-layer")))
    if setup.batch > 1:
        exact.append(
            (
                f"micro-batch 1 with gradient accumulation x{setup.batch * setup.accum}",
                replace(setup, batch=1, accum=setup.batch * setup.accum),
            )
        )
    if setup.gpus is not None and setup.gpus > 1 and setup.shard != "zero3":  # costs communication (lesson 6)
        stage = SHARDS[SHARDS.index(setup.shard) + 1]
        exact.append((f"shard across the {setup.gpus} GPUs: {stage}", replace(setup, shard=stage)))
    if setup.optimizer == "adamw":  # the same update, no sqrt(v) temporaries
        exact.append(
            ("fused AdamW (fused=True, the Trainer's adamw_torch_fused)", replace(setup, optimizer="adamw_fused"))
        )
    # lesson 7's: the step in backward, a chunked loss, activation offloading; the step in backward refuses
    # accumulation, so it waits until the micro-batch is 1 (accumulation is the more common trick)
    exact += [(name, nxt) for name, nxt in toolbox_tricks(setup) if not (nxt.optimizer_in_backward and setup.batch > 1)]
    lossy = []
    if setup.optimizer in ("adamw", "adamw_fused", "paged_adamw32bit"):
        lossy.append(("8-bit AdamW (bitsandbytes)", replace(setup, optimizer="adamw8bit")))
    if not setup.lora_rank:
        precision = setup.compute_name  # the 16-bit dtype of mixed-* and amp-*
        if precision == "bf16" and not card.bf16:
            precision = "fp16"
        lossy.append(
            (
                f"LoRA r={DEFAULT_LORA_RANK} on all linear layers, frozen {precision} base",
                replace(setup, lora_rank=DEFAULT_LORA_RANK, precision=precision),
            )
        )
    if setup.quant == "none":  # as peft's QLoRA recipe does it: prepare_model_for_kbit_training included
        lossy.append(
            ("QLoRA: NF4-DQ base + prepare_model_for_kbit_training", replace(setup, quant="nf4-dq", prepare_kbit=True))
        )
    return [(name, nxt, True) for name, nxt in exact] + [(name, nxt, False) for name, nxt in lossy]


# the fields of the tricks that change only what the forward and backward hold: none of them changes the
# optimizer step's phase, whose gradients, state and temporaries hold no activations
ACTIVATION_FIELDS = frozenset({"checkpointing", "batch", "accum", "chunked_loss", "offload_activations"})


def _worth_saying(total: int, lower: int) -> bool:
    """Whether a peak of `lower` bytes is below `total` by something worth saying (more than 0.5%)."""
    return total - lower > total // 200


def _saves_enough(current: Plan, after: Plan) -> bool:
    """Whether `after`'s peak is lower than `current`'s by something worth saying."""
    return _worth_saying(current.total, after.total)


def _cannot_save(current: Plan, change: dict) -> bool:
    """Whether a trick that changes `change`'s fields cannot be worth saying, known without planning it: it
    changes activations only, and the optimizer step, which holds none, is within 0.5% of the peak (as with
    checkpointing a full fine-tune whose peak is the step). Spares the fit search the trace of a trick
    that cannot help, activation offloading's above all (a deep model's is traced in full)."""
    phases, peak_phase = current.detail.get("phases", {}), current.detail.get("peak_phase")
    if not change.keys() <= ACTIVATION_FIELDS or "optimizer step" not in phases or peak_phase is None:
        return False
    lowest = current.total - sum(phases[peak_phase].values()) + sum(phases["optimizer step"].values())
    return not _worth_saying(current.total, lowest)


def _with(setup: Setup, changes: list[dict]) -> Setup:
    """`setup` with each trick's changed fields applied in order; a 4-bit base has no master copy and is
    planned in its compute dtype."""
    for change in changes:
        setup = replace(setup, **change)
    if setup.quant != "none" and setup.precision.startswith(("mixed", "amp")):
        setup = replace(setup, precision=setup.compute_name)
    return setup.validate()


def what_makes_it_fit(model, setup: Setup, gpu: str | GPU, current: Plan | None = None) -> list[Trick]:
    """The tricks the step needs on `gpu`, in order, each on top of the ones before (lesson 1, "what
    makes it fit").

    Found in two passes. Adding: at each round the first trick of `_candidate_tricks`' order (exact
    before lossy) that lowers the predicted peak is taken, until the step fits or none is left; a
    trick that saves nothing yet (checkpointing while the optimizer step holds the peak) is tried again
    after the next one. Pruning: once it fits, every trick the final setup does not need is dropped,
    the lossy ones first (they cost quality, the exact ones only time). Each `Trick.saves` is what it
    saves in the final setup (the peak without it, the others kept, less the final peak; None when
    another needs it, as QLoRA needs LoRA); `total_after` and `setup` are cumulative.
    """
    validate.instance("setup", setup, Setup, "a memory.Setup", error=PlanError)
    card = get_gpu(gpu)
    current = current or predict(model, setup, card)
    kept: list[tuple[str, dict, bool]] = []  # (name, the fields it changes, exact?)
    state = setup
    while not current.fits:
        for name, nxt, exact in _candidate_tricks(state, card):
            change = {key: value for key, value in vars(nxt).items() if getattr(state, key) != value}
            if _cannot_save(current, change):
                continue
            try:  # a combination the planner refuses (Setup.validate, or its reserve's trace) is no trick
                candidate = _with(setup, [c for _, c, _ in kept] + [change])
                after = predict(model, candidate, card)
                saves = _saves_enough(current, after)
                if saves:
                    after.oom_line  # noqa: B018 (made here, where a refusal is caught; only for a trick kept)
            except PlanError:
                continue
            if saves:
                kept.append((name, change, exact))
                state, current = candidate, after
                break
        else:
            break
    if current.fits:
        for index in sorted(range(len(kept)), key=lambda i: (kept[i][2], -i)):  # lossy first, the last first
            rest = [trick for trick in kept if trick is not kept[index]]
            try:
                without = predict(model, _with(setup, [c for _, c, _ in rest]), card)
                if without.fits:
                    kept = rest
            except PlanError:
                continue
    final = predict(model, _with(setup, [c for _, c, _ in kept]), card) if kept else current
    tricks: list[Trick] = []
    for index, (name, _, _) in enumerate(kept):
        upto = predict(model, _with(setup, [c for _, c, _ in kept[: index + 1]]), card)
        try:
            without = predict(model, _with(setup, [c for j, (_, c, _) in enumerate(kept) if j != index]), card)
            saves = without.total - final.total
        except PlanError:  # another trick needs it (QLoRA needs LoRA)
            saves = None
        tricks.append(Trick(name, saves, upto.total, bool(upto.fits), upto.setup))
    return tricks
