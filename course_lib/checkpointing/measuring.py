"""A plan's measured peak, time and recompute beside the cost model's prediction (lesson 3, "the
measured trade-off")."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from course_lib.checkpointing.apply import apply_plan
from course_lib.checkpointing.plans import Plan, named_plan, segments_plan, validate_plan
from course_lib.checkpointing.profile import StackProfile, flop_counter, profile_stack
from course_lib.checkpointing.selective import policy_name
from course_lib.layers import find_layer_stack
from course_lib.measure import MiB, measure_step, training_loss
from course_lib.validate import NonNegative, checked


@checked
@dataclass
class PlanMeasurement:
    """One plan, measured and predicted (lesson 3, "the measured trade-off").

    Peaks are above what was live before the step (measure_step's peak - baseline). The predictions
    are None for a selective policy (the cost model describes full checkpointing).
    `measured_recompute`: the backward's FLOPs beyond the unchecked backward's, as a fraction of one
    forward of the stack (FlopCounterMode; None: not measured).
    """

    plan: str
    segments: Plan
    measured_peak: int
    predicted_peak: int | None  # the refined cost model (StackProfile.predicted_step_peak)
    simple_predicted_peak: int | None  # saved and input sizes alone, all gradients added
    recompute_fraction: float | None  # predicted by the cost model, by FLOPs (full checkpointing)
    step_seconds: float | None = None  # fastest timed forward + backward (None: not timed)
    policy: str = "full"
    measured_recompute: float | None = None

    @property
    def error(self) -> float | None:
        """(predicted - measured) / measured, refined model."""
        if self.predicted_peak is None:
            return None
        return (self.predicted_peak - self.measured_peak) / self.measured_peak

    @property
    def simple_error(self) -> float | None:
        if self.simple_predicted_peak is None:
            return None
        return (self.simple_predicted_peak - self.measured_peak) / self.measured_peak


def _timed_step(model: nn.Module, loss_fn: Callable[[], torch.Tensor], device: torch.device) -> float:
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    training_loss(loss_fn).backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return seconds


def _backward_flops(model, loss_fn, plan, policy, layers) -> float:
    with apply_plan(model, plan, policy=policy, stack=layers):
        counter = flop_counter()
        with counter:
            loss = training_loss(loss_fn)
            forward = counter.get_total_flops()
            loss.backward()
            del loss
        model.zero_grad(set_to_none=True)
    return float(counter.get_total_flops() - forward)


@checked
def measure_recompute(
    model: nn.Module,
    loss_fn: Callable[[], torch.Tensor],
    plan,
    *,
    policy="full",
    profile: StackProfile | None = None,
    stack: nn.Module | None = None,
) -> float:
    """What a plan recomputes, measured: the backward's FLOPs under the plan minus the unchecked
    backward's, as a fraction of one forward of the stack (lesson 3, "selective checkpointing").

    FlopCounterMode counts matmuls and attention kernels (pointwise ops count as free)."""
    layers = stack if stack is not None else find_layer_stack(model)
    if profile is None:
        profile = profile_stack(model, loss_fn, stack=layers)
    extra = _backward_flops(model, loss_fn, plan, policy, layers) - _backward_flops(model, loss_fn, [], "full", layers)
    return extra / sum(profile.compute)


@checked
def time_plans(
    model: nn.Module,
    loss_fn: Callable[[], torch.Tensor],
    plans: Sequence[tuple[object, object]],
    *,
    repeats: NonNegative = 3,
    stack: nn.Module | None = None,
) -> list[float | None]:
    """Fastest forward + backward time of each (plan, policy), in seconds (lesson 3).

    The plans take turns, `repeats` rounds after one warm-up round, so that a machine whose load
    changes slows them all alike; the fastest run of each counts.
    """
    layers = stack if stack is not None else find_layer_stack(model)
    device = next(model.parameters()).device
    best = [float("inf")] * len(plans)
    for round_ in range(repeats + 1):
        for index, (plan, policy) in enumerate(plans):
            with apply_plan(model, plan, policy=policy, stack=layers):
                seconds = _timed_step(model, loss_fn, device)
            if round_:
                best[index] = min(best[index], seconds)
    return best if repeats else [None] * len(plans)  # 0 repeats: not timed


@checked
def measure_plan(
    model: nn.Module,
    loss_fn: Callable[[], torch.Tensor],
    inputs: Iterable[torch.Tensor],
    plan,
    *,
    profile: StackProfile | None = None,
    policy="full",
    stack: nn.Module | None = None,
    repeats: int = 0,
    label: str | None = None,
    recompute: bool = False,
) -> PlanMeasurement:
    """Apply a plan, measure one training step's peak with course_lib.measure.measure_step (the live-
    storage tracker on CPU, the allocator on CUDA), put the cost model's prediction beside it, with
    `recompute=True` measure what it recomputes (`measure_recompute`), and with `repeats` > 0 time
    that many steps (the fastest counts) (lesson 3, "the measured trade-off").

    `profile` defaults to `profile_stack(model, loss_fn, inputs)`. To compare times between plans,
    prefer `measure_tradeoff` or `time_plans`, which interleave the plans' runs.
    """
    layers = stack if stack is not None else find_layer_stack(model)
    inputs = list(inputs)
    segments = validate_plan(plan, len(layers))
    if profile is None:
        profile = profile_stack(model, loss_fn, inputs, stack=layers)
    full = policy in (None, "full")
    with apply_plan(model, segments, policy=policy, stack=layers):
        memory = measure_step(model, None, loss_fn, inputs)
    model.zero_grad(set_to_none=True)
    seconds = None
    if repeats:
        seconds = time_plans(model, loss_fn, [(segments, policy)], repeats=repeats, stack=layers)[0]
    measured = (
        measure_recompute(model, loss_fn, segments, policy=policy, profile=profile, stack=layers) if recompute else None
    )
    return PlanMeasurement(
        plan=label or (plan if isinstance(plan, str) else str(segments)),
        segments=segments,
        measured_peak=memory.peak - memory.baseline,
        predicted_peak=profile.predicted_step_peak(segments) if full else None,
        simple_predicted_peak=profile.predicted_step_peak(segments, refined=False) if full else None,
        recompute_fraction=profile.cost(segments).recompute_fraction if full else None,
        step_seconds=seconds,
        policy=policy_name(policy),
        measured_recompute=measured,
    )


@checked
def measure_tradeoff(
    model: nn.Module,
    loss_fn: Callable[[], torch.Tensor],
    inputs: Iterable[torch.Tensor],
    plans: dict | None = None,
    *,
    repeats: int = 3,
    policies: Sequence = ("full",),
    profile: StackProfile | None = None,
    recompute: bool = False,
) -> list[PlanMeasurement]:
    """Measure many plans on one model: the trade-off curve (lesson 3, "the measured trade-off").

    `plans` maps a label to segments or a plan name; the default is `default_plans(profile)`. Each
    plan runs once per policy in `policies` ("full", "korthikanti", ...): one measured step for the
    peak (and its measured recompute with `recompute=True`), then `repeats` timed rounds in which the
    plans take turns (`time_plans`).
    """
    inputs = list(inputs)
    layers = find_layer_stack(model)
    if profile is None:
        profile = profile_stack(model, loss_fn, inputs, stack=layers)
    if plans is None:
        plans = default_plans(profile)
    rows = [
        measure_plan(
            model,
            loss_fn,
            inputs,
            plan,
            profile=profile,
            policy=policy,
            stack=layers,
            repeats=0,
            label=label,
            recompute=recompute,
        )
        for label, plan in plans.items()
        for policy in policies
    ]
    if repeats > 0:
        runs = [(row.segments, policy) for row, policy in zip(rows, [p for _ in plans for p in policies])]
        times = time_plans(model, loss_fn, runs, repeats=repeats, stack=layers)
        for row, seconds in zip(rows, times):
            row.step_seconds = seconds
    return rows


@checked
def default_plans(profile: StackProfile) -> dict[str, Plan]:
    """k segments for a few k from 1 to n (the last segment unchecked), every layer, sqrt, and the
    optimal plan within the sqrt plan's predicted peak (lesson 3)."""
    n = profile.n_layers
    root = round(math.sqrt(n))
    ks = sorted({1, 2, 3, root - 1, root, root + 1, 2 * root, n // 2, n} & set(range(1, n + 1)))
    plans = {f"{k} segments": segments_plan(n, k) for k in ks}
    plans["every-layer"] = named_plan(n, "every-layer")
    plans["sqrt"] = named_plan(n, "sqrt")
    plans["optimal @ sqrt peak"] = profile.optimal_plan(profile.cost("sqrt").peak_bytes)
    return plans


@checked
def format_tradeoff(rows: Sequence[PlanMeasurement], title: str = "") -> str:
    """The trade-off as a text table: peaks in MiB, errors in %, recompute predicted (and measured
    when it was), time relative to the first row (lesson 3, "the measured trade-off")."""
    base = rows[0].step_seconds if rows else None
    measured = any(r.measured_recompute is not None for r in rows)
    lines = [title] if title else []
    header = (
        f"{'plan':<22} {'policy':<12} {'measured':>9} {'model':>9} {'err':>6} {'simple':>7} "
        f"{'recompute':>9}" + (f" {'measured':>8}" if measured else "") + f" {'step ms':>8} {'time':>6}"
    )
    lines += [header, "-" * len(header)]
    for r in rows:
        timed = r.step_seconds is not None
        model = f"{r.predicted_peak / MiB:8.2f}M" if r.predicted_peak is not None else f"{'n/a':>9}"
        err = f"{100 * r.error:+5.1f}%" if r.error is not None else f"{'':>6}"
        simple = f"{100 * r.simple_error:+6.1f}%" if r.simple_error is not None else f"{'':>7}"
        predicted = f"{r.recompute_fraction:9.2f}" if r.recompute_fraction is not None else f"{'n/a':>9}"
        seen = (
            ""
            if not measured
            else (f" {r.measured_recompute:8.2f}" if r.measured_recompute is not None else f" {'':>8}")
        )
        ms = f"{r.step_seconds * 1e3:8.1f}" if timed else f"{'':>8}"
        ratio = f"{r.step_seconds / base:5.2f}x" if base and timed else ""
        lines.append(
            f"{r.plan[:22]:<22} {r.policy[:12]:<12} {r.measured_peak / MiB:8.2f}M {model} {err} {simple} "
            f"{predicted}{seen} {ms} {ratio:>6}"
        )
    return "\n".join(lines)
