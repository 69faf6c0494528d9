"""The course's figures: matplotlib only here, so the numeric modules never import it (lessons 2 and 4).

Each function takes what a lesson's module computed and returns the matplotlib figure or axes it drew,
with labelled axes in readable units.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING

import matplotlib.pyplot as plt

from course_lib.measure import PHASES, MiB
from course_lib.paging import TOUCH_CATEGORIES
from course_lib.planner.predict import STEP_PHASES

if TYPE_CHECKING:
    from course_lib.accumulation import CostRow
    from course_lib.paging import SimulationResult, Touch
    from course_lib.paging.timeline import TimelineEntry


# ---------------------------------------------------------------------------------------------------
# Lesson 1: the planner
# ---------------------------------------------------------------------------------------------------

CATEGORY_COLORS = {
    "weights": "#4c72b0",
    "quantization": "#8172b3",
    "optimizer_state": "#55a868",
    "master_weights": "#c44e52",
    "gradients": "#dd8452",
    "activations": "#937860",
    "optimizer_temporaries": "#da8bc3",
    "overhead": "#999999",
}


def plot_recipe_phases(plans: dict, gpus: Sequence = (), title: str | None = None):
    """For each planned recipe, a bar per phase of the step (end of forward, backward, optimizer step)
    stacked by what is live then (`Plan.by_phase`); the phase that holds the predicted peak is outlined and
    starred, and each GPU's memory is a line (lesson 1, "one bar per recipe, one bar per phase"). `gpus`:
    GPU objects (name, memory_bytes)."""
    fig, ax = plt.subplots(figsize=(10, 4.8))
    width, gap = 0.28, 0.25
    ticks = []
    for i, plan in enumerate(plans.values()):
        phases = plan.by_phase()
        peak_bar = max(phases, key=lambda bar: sum(phases[bar].values()))
        left = i * (len(STEP_PHASES) * width + gap)
        ticks.append(left + width)
        for j, (bar, live) in enumerate(phases.items()):
            bottom = 0.0
            for category, color in CATEGORY_COLORS.items():
                value = live.get(category, 0) / 2**30
                ax.bar(
                    left + j * width,
                    value,
                    width,
                    bottom=bottom,
                    color=color,
                    label=category.replace("_", " ") if i == j == 0 else None,
                )
                bottom += value
            if bar == peak_bar:
                ax.bar(left + j * width, bottom, width, fill=False, edgecolor="black", linewidth=1.5)
                ax.text(left + j * width, bottom, "*", ha="center", va="bottom", fontsize=14)
    for gpu, style in zip(gpus, ("--", ":")):
        ax.axhline(gpu.memory_bytes / 2**30, color="black", linestyle=style, linewidth=1, label=gpu.name)
    ax.set_xticks(ticks, list(plans), rotation=15, fontsize=8)
    ax.set_ylabel("predicted memory (GiB)")
    ax.set_xlabel("each recipe: end of forward | backward | optimizer step (* outlined: the peak)")
    if title:
        ax.set_title(title)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------------------------------
# Lesson 2: gradient accumulation
# ---------------------------------------------------------------------------------------------------


def plot_accumulation_cost(rows: Sequence[CostRow], title: str | None = None):
    """Two panels: time per optimizer step and peak memory (split by category) vs micro-batch size
    (lesson 2, "what accumulation costs")."""
    rows = sorted(rows, key=lambda r: r.micro_batch)
    sizes = [r.micro_batch for r in rows]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(10, 3.8))
    ax_t.plot(sizes, [r.ms_per_step for r in rows], "o-")
    ax_t.set_xscale("log", base=2)
    ax_t.set_xticks(sizes, [str(s) for s in sizes])
    ax_t.minorticks_off()
    ax_t.set_xlabel("micro-batch size (samples), effective batch fixed")
    ax_t.set_ylabel("time per optimizer step (ms)")
    ax_t.set_ylim(bottom=0)
    flops = {r.flops for r in rows}
    ax_t.set_title("same FLOPs per step" if len(flops) == 1 else "FLOPs differ")
    fixed = [r.fixed_bytes / MiB for r in rows]
    data = [r.inputs / MiB for r in rows]
    rest = [max(r.peak_bytes / MiB - f - d, 0.0) for r, f, d in zip(rows, fixed, data)]
    positions = range(len(rows))
    ax_m.bar(positions, fixed, label="parameters + gradients + Adam state")
    ax_m.bar(positions, data, bottom=fixed, label="the window's data")
    ax_m.bar(positions, rest, bottom=[f + d for f, d in zip(fixed, data)], label="activations and temporaries")
    ax_m.set_xticks(list(positions), [str(s) for s in sizes])
    ax_m.set_xlabel("micro-batch size (samples)")
    ax_m.set_ylabel("peak memory of one step (MiB)")
    ax_m.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------------------------------
# Lesson 4: paged optimizers
# ---------------------------------------------------------------------------------------------------


def plot_touches(touches: Sequence[Touch], ax=None):
    """Dots: operator number (x) against the category it touches (y), coloured by phase (lesson 4)."""
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 2.6))
    colors = {"forward": "#4c72b0", "backward": "#dd8452", "optimizer": "#55a868"}
    for phase in PHASES:
        pts = [(t.index, TOUCH_CATEGORIES.index(t.category)) for t in touches if t.phase == phase]
        if pts:
            xs, ys = zip(*pts)
            ax.scatter(xs, ys, s=8, color=colors[phase], label=phase)
    ax.set_yticks(range(len(TOUCH_CATEGORIES)), TOUCH_CATEGORIES)
    ax.set_xlabel("operator number in the step")
    ax.set_title("Which memory each operator of one training step touches (measured)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    return ax


def plot_prefetch_timeline(entries: Sequence[TimelineEntry | dict], ax=None):
    """Prefetch and update of each parameter inside one `optimizer.step()` (lesson 4): milliseconds (x)
    against the parameter's number (y)."""
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 3))
    rows = [e if isinstance(e, dict) else asdict(e) for e in entries]
    for kind, color in (("prefetch", "#55a868"), ("update", "#4c72b0")):
        for e in (r for r in rows if r["kind"] == kind):
            ax.broken_barh(
                [(1e3 * e["start"], 1e3 * (e["end"] - e["start"]))],
                (e["index"] - 0.4, 0.8),
                facecolors=color,
                label=kind,
            )
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    ax.legend(unique.values(), unique.keys(), loc="lower right", fontsize=8)
    ax.set_xlabel("time since the start of optimizer.step() (ms)")
    ax.set_ylabel("parameter")
    ax.set_title("bitsandbytes prefetches each parameter's state right before its update (measured)")
    return ax


LANES = ("compute", "faults", "H2D", "D2H")
LANE_COLORS = {"compute": "#4c72b0", "faults": "#c44e52", "H2D": "#55a868", "D2H": "#dd8452"}


def plot_paging_timeline(
    result: SimulationResult, ax=None, *, steps: Sequence[int] | None = None, title: str | None = None
):
    """Draw the simulated timeline: one lane per kind of work, milliseconds on the x axis (lesson 4)."""
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 2.6))
    keep = set(steps) if steps is not None else None
    segments = [s for s in result.timeline if keep is None or s.step in keep]
    t0 = min((s.start for s in segments), default=0.0)
    for row, lane in enumerate(LANES):
        bars = [(1e3 * (s.start - t0), 1e3 * (s.end - s.start)) for s in segments if s.lane == lane]
        if bars:
            ax.broken_barh(bars, (row - 0.4, 0.8), facecolors=LANE_COLORS[lane])
    for step in sorted({s.step for s in segments}):
        first = min(s.start for s in segments if s.step == step)
        ax.axvline(1e3 * (first - t0), color="grey", lw=0.8, ls=":")
        ax.text(1e3 * (first - t0), len(LANES) - 0.5, f" step {step}", fontsize=8, va="bottom")
    ax.set_yticks(range(len(LANES)), ["compute", "faults", "migrate in (H2D)", "evict (D2H)"])
    ax.set_xlabel("time (ms)")
    ax.set_ylim(-0.6, len(LANES) + 0.2)
    title = title or f"Timeline on {result.hardware.name}"
    ax.set_title(title if "simulated" in title.lower() else f"Simulated: {title}")  # never read as measured
    return ax


# ---------------------------------------------------------------------------------------------------
# Lesson 6: sharding
# ---------------------------------------------------------------------------------------------------


def plot_sharding(steps: Sequence, predicted: dict | None = None, title: str | None = None):
    """Rank 0's measured peak for each (world size, stage), stacked: the model states measured after the
    step (a step starts with no gradients), then the rest of the peak; the planner's peak as a marker when
    `predicted` maps (world size, stage) to bytes; the legend below the axes (lesson 6, "measured, rank by
    rank")."""
    rows = sorted((s for s in steps if s.rank == 0), key=lambda s: (s.world_size, s.stage))
    positions = range(len(rows))
    parts = [
        ("parameters (after the step)", [s.parameters for s in rows]),
        ("gradients (after the step)", [s.gradients for s in rows]),
        ("optimizer state (after the step)", [s.optimizer_state for s in rows]),
        ("the rest of the peak (peak minus those)", [s.peak - s.model_states for s in rows]),
    ]
    fig, ax = plt.subplots(figsize=(10, 3.8))
    bottom = [0.0] * len(rows)
    for label, values in parts:
        mib = [v / MiB for v in values]
        ax.bar(positions, mib, bottom=bottom, label=label)
        bottom = [b + m for b, m in zip(bottom, mib)]
    if predicted:
        ax.plot(
            list(positions),
            [predicted[s.world_size, s.stage] / MiB for s in rows],
            "k_",
            markersize=18,
            markeredgewidth=2,
            label="predicted peak (planner)",
        )
    stage = {"zero2": "zero2 (FSDP2\nstand-in)"}
    ax.set_xticks(
        list(positions),
        [f"{stage.get(s.stage, s.stage)}\n{s.world_size} rank{'s' * (s.world_size > 1)}" for s in rows],
        fontsize=8,
    )
    ax.set_ylabel("peak memory of one rank (MiB)")
    # below the stage names, outside the axes: inside, it hides the tallest bars and their markers
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3, frameon=False)
    if title:
        ax.set_title(title)
    fig.tight_layout()
    return fig
