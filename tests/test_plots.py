"""The course's figures (course_lib.plots): what they draw matches the numbers they are given, with
labelled axes and units."""

import matplotlib
import pytest
import torch

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

from course_lib import paging as pg  # noqa: E402
from course_lib import plots  # noqa: E402
from course_lib.accumulation import CostRow  # noqa: E402
from course_lib.measure import MiB  # noqa: E402
from course_lib.paging import TimelineEntry  # noqa: E402


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def test_accumulation_cost_stacks_to_the_measured_peak():
    rows = [
        CostRow(
            micro_batch=m,
            k=64 // m,
            flops=10**9,
            ms_per_step=100.0 + 400 / m,
            peak_bytes=(5 + m) * MiB,
            parameters=MiB,
            gradients=MiB,
            optimizer_state=2 * MiB,
            saved_per_micro_batch=m * MiB // 2,
            inputs=MiB // 4,
        )
        for m in (1, 4, 16, 64)
    ]
    fig = plots.plot_accumulation_cost(list(reversed(rows)), title="test")
    ax_time, ax_memory = fig.axes
    assert ax_time.get_ylabel() == "time per optimizer step (ms)" and ax_time.get_title() == "same FLOPs per step"
    assert list(ax_time.lines[0].get_xdata()) == [1, 4, 16, 64]  # sorted by micro-batch
    assert "(MiB)" in ax_memory.get_ylabel()
    heights = [0.0] * len(rows)
    for container in ax_memory.containers:
        for i, bar in enumerate(container):
            heights[i] += bar.get_height()
    assert heights == pytest.approx([r.peak_bytes / MiB for r in rows])


def test_touches_put_each_operator_on_its_category():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), foreach=False)
    x = torch.randn(4, 8)
    touches = pg.measure_touches(model, optimizer, lambda: model(x).pow(2).mean())
    ax = plots.plot_touches(touches)
    drawn = {(round(x), round(y)) for collection in ax.collections for x, y in collection.get_offsets()}
    assert drawn == {(t.index, pg.TOUCH_CATEGORIES.index(t.category)) for t in touches}
    assert [label.get_text() for label in ax.get_yticklabels()] == list(pg.TOUCH_CATEGORIES)


def test_prefetch_timeline_draws_each_entry_in_milliseconds():
    entries = [
        TimelineEntry("prefetch", 0, 0.000, 0.002, 100),
        TimelineEntry("update", 0, 0.002, 0.005, 100),
        {"kind": "prefetch", "index": 1, "start": 0.003, "end": 0.004, "state_bytes": 10},
    ]
    ax = plots.plot_prefetch_timeline(entries)
    spans = sorted(
        tuple(round(v, 6) for v in path.get_extents().bounds[:3:2])
        for collection in ax.collections
        for path in collection.get_paths()
    )
    assert spans == [(0.0, 2.0), (2.0, 3.0), (3.0, 1.0)]  # (start ms, length ms)
    assert ax.get_xlabel().endswith("(ms)") and {t.get_text() for t in ax.get_legend().get_texts()} == {
        "prefetch",
        "update",
    }


def test_paging_timeline_has_one_lane_per_kind_of_work():
    result = pg.regimes()["spike"].paged
    ax = plots.plot_paging_timeline(result, steps=[1, 2])
    assert ax.get_xlabel() == "time (ms)"
    assert [label.get_text() for label in ax.get_yticklabels()] == [
        "compute",
        "faults",
        "migrate in (H2D)",
        "evict (D2H)",
    ]
    lanes = {s.lane for s in result.timeline if s.step in (1, 2)}
    assert len(ax.collections) == len(lanes)
    assert [t.get_text().strip() for t in ax.texts] == ["step 1", "step 2"]


def test_sharding_bars_stack_to_each_peak_with_the_legend_clear_of_the_axes():
    from types import SimpleNamespace

    steps = [
        SimpleNamespace(
            rank=rank,
            world_size=n,
            stage=stage,
            parameters=MiB // n,
            gradients=MiB // n,
            optimizer_state=2 * MiB // n,
            model_states=4 * MiB // n,
            peak=(5 + n) * MiB,
        )
        for n in (1, 2)
        for stage in ("none", "zero3")
        for rank in range(n)
    ]
    predicted = {(s.world_size, s.stage): s.peak + MiB for s in steps}
    fig = plots.plot_sharding(steps, predicted, title="test")
    ax = fig.axes[0]
    heights = [0.0] * 4
    for container in ax.containers:
        for i, bar in enumerate(container):
            heights[i] += bar.get_height()
    assert heights == pytest.approx([6, 6, 7, 7])  # rank 0 of (1, none), (1, zero3), (2, none), (2, zero3)
    assert "(MiB)" in ax.get_ylabel() and max(ax.lines[0].get_ydata()) < ax.get_ylim()[1]  # markers inside
    fig.canvas.draw()
    legend, axes = ax.get_legend().get_window_extent(), ax.get_window_extent()
    assert legend.y1 <= axes.y0, "the legend hides bars and markers when it is drawn inside the axes"


def test_recipe_phases_stack_each_phase_to_what_is_live_then_and_outline_the_peak():
    from course_lib.planner import plan

    plans = {
        "one micro-batch": plan("gpt2", precision="fp32", batch=1, seq=64, suggest=False),
        "accumulating": plan("gpt2", precision="fp32", batch=1, seq=64, accum=2, suggest=False),
    }
    fig = plots.plot_recipe_phases(plans, title="test")
    ax = fig.axes[0]
    assert "(GiB)" in ax.get_ylabel()
    stacked: dict[float, float] = {}
    for patch in ax.patches:
        if patch.get_fill():
            x = round(patch.get_x(), 6)
            stacked[x] = stacked.get(x, 0.0) + patch.get_height()
    expected = [sum(live.values()) / 2**30 for p in plans.values() for live in p.by_phase().values()]
    assert [stacked[x] for x in sorted(stacked)] == pytest.approx(expected)
    outlined = [patch.get_height() for patch in ax.patches if not patch.get_fill()]
    assert outlined == pytest.approx([p.total / 2**30 for p in plans.values()])
    # no gradient exists at the end of the first micro-batch's forward; under accumulation all of them do
    single, accumulating = (p.by_phase()["end of forward"]["gradients"] for p in plans.values())
    assert single == 0 and accumulating == plans["accumulating"].detail["all_gradients"] > 0
