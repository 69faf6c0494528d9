"""The ablation: each trick of the recipe switched off in turn, then all off, measured and predicted
(lesson 5, "what each trick buys")."""

from __future__ import annotations

from collections.abc import Callable

import torch

from course_lib import validate
from course_lib.device import DtypePolicy, policy_for_capability
from course_lib.errors import UserError
from course_lib.measure import format_bytes
from course_lib.planner import GPU, get_gpu
from course_lib.qlora.building import causal_lm_config
from course_lib.qlora.gpu_rows import isolated_rows
from course_lib.qlora.measuring import Row, measure_recipe, predict, step_peak
from course_lib.qlora.recipe import Recipe, RecipeError, valid_recipe
from course_lib.validate import Device, NonNegative, checked

NAMES = {
    "nf4": "no 4-bit base (16/32-bit base)",
    "prepare_kbit": "no prepare_model_for_kbit_training",
    "checkpointing": "no checkpointing",
    "accumulation": "no accumulation (batch {effective_batch})",
    "optimizer": "32-bit AdamW, not paged 8-bit",
    "lora": "no LoRA (full fine-tune, no NF4)",
}


def ablation_cases(recipe: Recipe) -> list[tuple[str, Recipe]]:
    """The ablation's rows, labelled: the recipe, each trick it uses switched off in turn, all off."""
    cases = [("all tricks on", recipe)]
    for trick, name in NAMES.items():
        if (off := recipe.without(trick)) != recipe:
            cases.append((name.format(effective_batch=recipe.effective_batch), off))
    return [*cases, ("all tricks off", recipe.all_off())]


@checked(error=RecipeError)
def ablation(
    config,
    recipe: Recipe | None = None,
    device: Device = "cpu",
    *,
    timed_steps: NonNegative = 1,
    policy: DtypePolicy | None = None,
    gpu: GPU | None = None,
    isolate: bool | None = None,
    as_t4: bool = False,
    progress: Callable | None = None,
) -> list[Row]:
    """Each trick switched off in turn, then all off, measured and predicted (lesson 5, "what each
    trick buys"). `policy` and `gpu` as in `measure_recipe`.

    `isolate` (the default on CUDA) measures each row in its own process from one checkpoint saved
    once: paged optimizer state is never freed, so rows in one process would see each other's. There
    `as_t4` runs each row under `emulate_t4` (policy and gpu are then the child's, not arguments).
    `progress(rows)` is called with the rows so far after each isolated row (to save them)."""
    causal_lm_config(config)
    recipe = valid_recipe(recipe or Recipe())
    device = torch.device(device)
    cases = ablation_cases(recipe)
    if isolate if isolate is not None else device.type == "cuda":
        if policy is not None or gpu is not None:
            raise UserError("isolated rows pick their policy in the child: pass as_t4=True, not policy/gpu")
        return isolated_rows(config, cases, device, timed_steps=timed_steps, as_t4=as_t4, progress=progress)
    return [
        measure_recipe(config, r, device, timed_steps=timed_steps, label=label, policy=policy, gpu=gpu)
        for label, r in cases
    ]


@checked(error=RecipeError)
def format_ablation(rows: list[Row]) -> str:
    """The ablation as a text table: measured and predicted peak, the error, the step time."""
    rows = validate.non_empty("rows", rows, "rows of qlora.ablation", error=RecipeError)
    head = rows[0].measured_peak or 1
    width = max(len(r.label) for r in rows)
    lines = [
        f"{'configuration':<{width}}  {'measured':>10}  {'predicted':>10}  {'error':>6}  "
        f"{'x all-on':>8}  {'step ms':>8}"
    ]
    for r in rows:
        if r.measured_peak is None:
            lines.append(f"{r.label:<{width}}  {'-':>10}  {format_bytes(r.predicted_peak):>10}  ({r.status})")
            continue
        lines.append(
            f"{r.label:<{width}}  {format_bytes(r.measured_peak):>10}  {format_bytes(r.predicted_peak):>10}"
            f"  {r.error:>+6.1%}  {r.measured_peak / head:>8.2f}  {'-' if r.step_ms is None else f'{r.step_ms:.0f}':>8}"
        )
    return "\n".join(lines)


@checked(error=RecipeError)
def predicted_ablation(config, recipe: Recipe | None = None, gpu: str = "t4") -> list[Row]:
    """The ablation as the planner predicts it on `gpu`, in that card's precision (a T4's: fp16
    autocast, GradScaler): nothing is run, so every row's `measured_peak` is None (lesson 5, "what
    each trick buys on a T4"). A row that does not fit has no reserved peak: past the card, the
    allocator frees its cache and retries, so what it would reserve is capped at the card's capacity."""
    causal_lm_config(config)
    card = get_gpu(gpu)
    policy = policy_for_capability(card.compute_capability)
    rows = []
    for label, case in ablation_cases(valid_recipe(recipe or Recipe())):
        planned = predict(config, case, policy, gpu=card)
        status = f"predicted {'to fit' if planned.fits else 'not to fit'} a {card.name}"
        reserved = planned.reserved if planned.fits else None
        rows.append(Row(label, case, None, step_peak(planned), None, planned.trainable_params, status, None, reserved))
    return rows


@checked(error=RecipeError)
def format_predicted_ablation(rows: list[Row]) -> str:
    """`predicted_ablation`'s rows as a text table: allocated and reserved peaks, the verdict."""
    rows = validate.non_empty("rows", rows, "rows of qlora.predicted_ablation", error=RecipeError)
    width = max(len(r.label) for r in rows)
    head = rows[0].predicted_peak or 1
    lines = [f"{'configuration':<{width}}  {'allocated':>10}  {'reserved':>10}  {'x all-on':>8}  verdict"]
    for r in rows:
        reserved = "-" if r.predicted_reserved is None else format_bytes(r.predicted_reserved)
        lines.append(
            f"{r.label:<{width}}  {format_bytes(r.predicted_peak):>10}  {reserved:>10}  "
            f"{r.predicted_peak / head:>8.2f}  {r.status}"
        )
    return "\n".join(lines)
