"""Lesson 4's sums and bounds pinned at the edge: every term of a phase's and an offloaded step's time,
a sweep over a whole block (every page missing), the simulator's zero-cost compute."""

from __future__ import annotations

import pytest

from course_lib import paging as pg


def test_a_phases_time_is_compute_plus_both_copies_plus_the_faults():
    # powers of ten, so a missing term shows in its own digit
    stats = pg.PhaseStats(compute=1.0, h2d_time=10.0, d2h_time=100.0, fault_time=1000.0)
    assert stats.total == 1111.0


def test_an_offloaded_step_is_compute_plus_both_exposed_copies_plus_the_cpu_step():
    result = pg.OffloadResult(
        compute=1.0, grad_copy_exposed=10.0, cpu_step=100.0, param_copy_exposed=1000.0, device_peak=0, fits=True
    )
    assert result.total == 1111.0
    assert result.slowdown == 1111.0


@pytest.mark.parametrize(("leaves", "faults"), [(32, 6), (512, 17)])
def test_a_sweep_with_every_page_missing_takes_the_documented_faults(leaves, faults):
    # the docstring's numbers: a whole 2 MB block of 64 KB pages (32 of them) in 6 faults, of 4 KB pages (512) in 17
    assert pg.sweep_faults(leaves, leaves) == faults
    assert pg.sweep_faults(leaves, 0) == 0
    with pytest.raises(pg.PagingError):
        pg.sweep_faults(leaves, leaves + 1)


@pytest.mark.parametrize("steps", [3, 4])
def test_each_regime_runs_the_steps_asked_for_and_the_spike_is_one_of_them(steps):
    tokens = 2048
    runs = pg.regimes(steps=steps, tokens=tokens)
    for run in runs.values():
        assert len(run.tokens_per_step) == steps, run.name
        assert len(run.paged.steps) == steps, run.name
    spike = list(runs["spike"].tokens_per_step)
    assert spike.count(6 * tokens) == 1 and spike.index(6 * tokens) == steps // 2
    assert spike.count(tokens) == steps - 1


def test_bitsandbytes_pages_a_state_tensor_from_exactly_its_minimum_numel():
    # bitsandbytes pages state tensors with numel >= 1e5 (BNB_PAGED_MIN_NUMEL); smaller ones stay on the device
    at = pg.optimizer_state(pg.ParamSpec("w", pg.BNB_PAGED_MIN_NUMEL), "paged_adamw_32bit")
    below = pg.optimizer_state(pg.ParamSpec("w", pg.BNB_PAGED_MIN_NUMEL - 1), "paged_adamw_32bit")
    assert at and all(state.managed for state in at)
    assert below and not any(state.managed for state in below)


def test_the_final_norm_belongs_to_the_last_layer():
    params = pg.transformer_params(3, 16, 32)
    assert max(p.layer for p in params) == 2
    assert {p.layer for p in params if p.name.startswith("ln_f.")} == {2}
    assert pg.TrainingSetup(tuple(params), "adamw").n_layers == 3


def test_a_step_of_zero_tokens_is_a_step():
    setup = pg.TrainingSetup(tuple(pg.transformer_params(1, 16, 32)), "adamw")
    events = pg.training_trace(setup, [0, 1])
    assert {event.step for event in events} == {0, 1}
    with pytest.raises(pg.PagingError):
        pg.training_trace(setup, [-1])
