"""A recipe measured beside the planner's prediction of it: peak memory of one whole optimizer step and
its time (lesson 5, "what each trick buys"). Memory is measured by `course_lib.measure` (its
live-storage tracker, or CUDA's allocator statistics) and predicted by `course_lib.planner.plan`: this
module writes neither a measurer nor a planner."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from course_lib.device import DtypePolicy, dtype_policy
from course_lib.errors import UserError
from course_lib.measure import optimizer_state_tensors, peak_bytes
from course_lib.models import build_model as meta_model
from course_lib.models import spec_from_model
from course_lib.paging import make_optimizer as lesson4_optimizer
from course_lib.paging import release_cuda_memory
from course_lib.planner import GPU, Setup, plan
from course_lib.qlora.building import build_model, quiet
from course_lib.qlora.recipe import PLANNER_OPTIM, Recipe, RecipeError, valid_recipe
from course_lib.validate import Device, checked


@checked(error=RecipeError)
def make_optimizer(model: torch.nn.Module, optim: str, lr: float = 2e-3) -> torch.optim.Optimizer:
    """The optimizer the Trainer builds for `optim`, over the trainable parameters (lesson 5); lesson
    4's `paging.make_optimizer` makes it."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    with quiet():
        return lesson4_optimizer("adamw" if optim == "adamw_torch" else optim, trainable, lr)


def planner_setup(recipe: Recipe, policy: DtypePolicy) -> Setup:
    """The planner's Setup for a recipe under a precision policy (lesson 5)."""
    valid_recipe(recipe)
    if recipe.lora_rank:  # frozen base in the compute dtype, fp32 adapters
        precision = {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(policy.autocast_dtype, "fp32")
    else:  # fp32 trainable weights (the policy's), autocast only changes activations
        precision = "fp32"
    return Setup(
        precision=precision,
        optimizer=PLANNER_OPTIM[recipe.optim],
        lora_rank=recipe.lora_rank,
        quant="nf4-dq" if recipe.nf4 else "none",
        prepare_kbit=recipe.nf4 and recipe.prepare_kbit,
        batch=recipe.batch,
        seq=recipe.seq,
        accum=recipe.accum,
        checkpointing="every-layer" if recipe.checkpointing else "none",
    )


def step_peak(planned) -> int:
    """A plan's peak without the CUDA context: what the allocator's peak statistic (or the CPU tracker)
    measures of a step (lesson 5)."""
    return planned.total - planned.bytes["overhead"]


@checked(error=RecipeError)
def predict(config, recipe: Recipe, policy: DtypePolicy | None = None, gpu=None):
    """The planner's prediction for a recipe (`course_lib.planner.plan`), as a Plan (lesson 5)."""

    policy = policy or dtype_policy(torch.device("cpu"))
    spec = spec_from_model(meta_model(config), getattr(config, "model_type", "model"), config)
    return plan(spec, planner_setup(recipe, policy), gpu=gpu, suggest=False)


@checked(error=RecipeError)
@dataclass
class Row:
    """One line of the ablation table: a recipe, its measured and predicted peak, its step time."""

    label: str
    recipe: Recipe
    measured_peak: int | None  # None: not measured, `status` says why
    predicted_peak: int
    step_ms: float | None
    trainable: int
    status: str = "measured"  # or "predicted not to fit", "out of memory"
    # on CUDA: torch.cuda.max_memory_reserved of the row's process, and the planner's reserved prediction
    measured_reserved: int | None = None
    predicted_reserved: int | None = None

    @property
    def error(self) -> float | None:
        """(predicted - measured) / measured; None when the row was not run."""
        if self.measured_peak is None:
            return None
        return (self.predicted_peak - self.measured_peak) / self.measured_peak


def measure_recipe(
    config,
    recipe: Recipe,
    device: Device = "cpu",
    *,
    timed_steps: int = 1,
    label: str = "",
    policy: DtypePolicy | None = None,
    gpu: GPU | None = None,
    weights: str | Path | None = None,
) -> Row:
    """Build the recipe's model, run one optimizer step unmeasured (the optimizer state appears), time
    whole optimizer steps (accum micro-batches and the update), then measure the peak of one more,
    beside the planner's prediction of the same recipe (lesson 5).

    On CUDA, a recipe the planner predicts not to fit `gpu` (default: the device itself) is not run,
    and one that runs out of memory is reported as such. `policy` and `gpu` default to the device's;
    those `emulate_t4()` returns run the T4 recipe on a larger GPU (benchmarks/gpu_qlora.py --as-t4).
    `timed_steps=0` measures the peak only (no step time). `weights` as in `build_model`. A paged
    optimizer's state stays in this process until it ends:
    on CUDA, measure each recipe in its own process (`ablation` does).
    """
    valid_recipe(recipe)
    if isinstance(timed_steps, bool) or not isinstance(timed_steps, int) or timed_steps < 0:
        raise UserError(f"timed_steps must be a whole number >= 0 (0: the peak only), got {timed_steps!r}")
    device = torch.device(device)
    if gpu is not None and device.type != "cuda":
        raise UserError("gpu= sets the memory a CUDA run may use: it needs device='cuda'")
    policy = policy or dtype_policy(device)
    if device.type == "cuda":
        gpu = gpu or _catalog_gpu(device)
    predicted = predict(config, recipe, policy, gpu=gpu)
    predicted_peak = step_peak(predicted)
    label = label or recipe.describe()
    # the card's memory against the whole plan; what CUDA says is free (the context already taken) against
    # the plan without its CUDA context, which would otherwise count twice
    if gpu is not None and (
        predicted.total > 0.95 * gpu.memory_bytes or predicted_peak > 0.95 * torch.cuda.mem_get_info(device)[0]
    ):
        return Row(
            label,
            recipe,
            None,
            predicted_peak,
            None,
            predicted.trainable_params,
            "predicted not to fit",
            predicted_reserved=predicted.reserved,
        )
    try:
        return _measure(
            config,
            recipe,
            device,
            policy,
            timed_steps,
            label,
            predicted_peak,
            weights,
            predicted_reserved=predicted.reserved,
        )
    except torch.cuda.OutOfMemoryError:
        pass  # leave the except block first: its traceback holds the model and the optimizer
    release_cuda_memory()
    return Row(
        label,
        recipe,
        None,
        predicted_peak,
        None,
        predicted.trainable_params,
        "out of memory",
        predicted_reserved=predicted.reserved,
    )


@checked(error=RecipeError)
def recipe_step(model, recipe: Recipe, policy: DtypePolicy, ids: torch.Tensor):
    """The optimizer and a function running one whole optimizer step of `recipe` (every micro-batch and
    the update, with the policy's autocast and GradScaler), as the Trainer runs it (lesson 5)."""
    device = ids.device
    optimizer = make_optimizer(model, recipe.optim)
    scaler = torch.amp.GradScaler(device.type) if policy.grad_scaler else None

    def optimizer_step():
        optimizer.zero_grad(set_to_none=True)
        for _ in range(recipe.accum):
            with torch.autocast(device.type, dtype=policy.autocast_dtype, enabled=policy.autocast_dtype is not None):
                loss = model(input_ids=ids, labels=ids).loss / recipe.accum
            (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()

    return optimizer, optimizer_step


def _measure(
    config,
    recipe: Recipe,
    device: torch.device,
    policy: DtypePolicy,
    timed_steps: int,
    label: str,
    predicted_peak: int,
    weights: str | Path | None = None,
    predicted_reserved: int | None = None,
) -> Row:
    model = build_model(config, recipe, device, policy, weights)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (recipe.batch, recipe.seq), generator=generator).to(device)
    optimizer, optimizer_step = recipe_step(model, recipe, policy, ids)

    with quiet():
        optimizer_step()  # unmeasured: the optimizer state appears
        times = []
        for _ in range(timed_steps):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            optimizer_step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        measured = _peak_of_step(optimizer_step, model, optimizer, ids, device)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    reserved = torch.cuda.max_memory_reserved(device) if device.type == "cuda" else None  # the process's, so far
    del model, optimizer
    if device.type == "cuda":
        release_cuda_memory()
    return Row(
        label,
        recipe,
        measured,
        predicted_peak,
        1000 * statistics.median(times) if times else None,
        trainable,
        measured_reserved=reserved,
        predicted_reserved=predicted_reserved,
    )


def _peak_of_step(step, model, optimizer, ids, device: torch.device) -> int:
    """Peak bytes of one whole optimizer step (every micro-batch and the update), measured by
    `course_lib.measure.peak_bytes` (lesson 0's measurer, run over the whole accumulation window)."""
    optimizer.zero_grad(set_to_none=True)
    return peak_bytes(step, [*model.parameters(), *model.buffers(), *optimizer_state_tensors(optimizer), ids], device)


def _catalog_gpu(device: torch.device):

    props = torch.cuda.get_device_properties(device)
    return GPU(props.name, props.total_memory, (props.major, props.minor), cuda_memory_bytes=props.total_memory)
