"""Tests of course_lib.paging (lesson 4): the unified-memory simulator and the real-GPU side."""

from __future__ import annotations

import os
import warnings
from collections import OrderedDict
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from course_lib import isolate
from course_lib import paging as pg
from course_lib.paging import KiB, MiB

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---- an independent reference for chunk traces --------------------------------------------------


def reference_migrations(accesses, capacity, policy):
    """Bytes in and out of 2 MiB chunks, written the simple way: the oracle for the simulator."""
    resident: OrderedDict[int, None] = OrderedDict()  # head = next victim for allocation / LRU
    seen, bytes_in, bytes_out = set(), 0, 0
    for chunk in accesses:
        if chunk in resident:
            if policy in ("lru", "mru"):
                resident.move_to_end(chunk)
            continue
        if len(resident) == capacity:
            resident.popitem(last=(policy == "mru"))
            bytes_out += 2 * MiB
        if chunk in seen:
            bytes_in += 2 * MiB
        seen.add(chunk)
        resident[chunk] = None
    return bytes_in, bytes_out


accesses_st = st.lists(st.integers(0, 11), min_size=1, max_size=60)


@FAST
@given(accesses=accesses_st, capacity=st.integers(1, 8), policy=st.sampled_from(pg.EVICTION_POLICIES))
def test_chunk_traces_match_the_reference(accesses, capacity, policy):
    assert pg.chunk_migrations(accesses, capacity, policy) == reference_migrations(accesses, capacity, policy)


def test_cyclic_access_moves_everything_under_allocation_order_and_lru_but_not_mru():
    cycle = list(range(10)) * 5
    moved = {policy: pg.chunk_migrations(cycle, 8, policy)[0] for policy in pg.EVICTION_POLICIES}
    assert moved["allocation"] == moved["lru"] == 40 * 2 * MiB  # every re-access misses
    assert moved["mru"] < moved["lru"] / 3


def test_allocation_order_and_lru_differ_when_a_chunk_is_reused():
    # 0 is reused before 2 arrives: LRU keeps it, allocation order evicts it (it came first).
    trace = [0, 1, 0, 2, 0]
    assert pg.chunk_migrations(trace, 2, "lru") == (0, 2 * MiB)
    assert pg.chunk_migrations(trace, 2, "allocation") == (2 * MiB, 4 * MiB)


# ---- conservation ------------------------------------------------------------------------------


def small_setup(layers: int, hidden: int, optimizer: str = "paged_adamw_32bit", act: int = 0) -> pg.TrainingSetup:
    return pg.TrainingSetup(
        tuple(pg.transformer_params(layers, hidden, 1000)), optimizer, activation_bytes_per_token=act
    )


setups_st = st.builds(
    small_setup,
    layers=st.integers(1, 4),
    hidden=st.sampled_from([128, 192, 256]),
    optimizer=st.sampled_from(["paged_adamw_32bit", "paged_adamw_8bit"]),
    act=st.sampled_from([0, 4 * KiB, 64 * KiB]),
)
tokens_st = st.lists(st.sampled_from([16, 64, 256]), min_size=1, max_size=4)
policy_st = st.builds(
    pg.Policy,
    granularity=st.sampled_from(pg.GRANULARITIES),
    eviction_unit=st.sampled_from([64 * KiB, 2 * MiB]),
    eviction=st.sampled_from(pg.EVICTION_POLICIES),
    density_prefetch=st.booleans(),
)


def fitting_fraction(setup: pg.TrainingSetup, tokens: list[int], fraction: float) -> int:
    """A device with room for every ordinary allocation (as the caching allocator rounds and reserves
    them: the simulator's own peak on a huge device), 8 MiB, and `fraction` of the paged state."""
    huge = pg.simulate(pg.training_trace(setup, tokens), pg.Hardware.t4().with_memory(1 << 40), record_timeline=False)
    return int(huge.peak_reserved + 8 * MiB + fraction * setup.bytes_by_category()["optimizer state (paged)"])


@FAST
@given(
    setup=setups_st,
    tokens=tokens_st,
    policy=policy_st,
    fraction=st.floats(0.0, 1.2),
    prefetching=st.booleans(),
    caching=st.booleans(),
)
def test_conservation(setup, tokens, policy, fraction, prefetching, caching):
    hw = pg.Hardware.t4().with_memory(fitting_fraction(setup, tokens, fraction))
    result = pg.simulate(
        pg.training_trace(setup, tokens, use_prefetch=prefetching),
        hw,
        policy,
        caching_allocator=caching,
        record_timeline=False,
    )
    assert result.conservation_error() == 0
    assert result.bytes_in + result.bytes_populated == result.bytes_out + result.resident_bytes
    assert result.peak_used <= hw.memory


def test_conservation_with_managed_memory_freed_while_resident():
    trace = [
        pg.alloc("a", 3 * MiB, managed=True),
        pg.touch("a"),
        pg.alloc("b", 3 * MiB, managed=True),
        pg.touch("b"),
        pg.touch("a"),
        pg.free("a"),
    ]
    result = pg.simulate(trace, pg.Hardware.t4().with_memory(4 * MiB))
    assert result.freed_resident_bytes > 0
    assert result.conservation_error() == 0


# ---- monotonicity -------------------------------------------------------------------------------


def total_time(result: pg.SimulationResult) -> float:
    return sum(result.step_time(step) for step in result.steps)


@FAST
@given(
    setup=setups_st,
    tokens=tokens_st,
    policy=policy_st,
    fractions=st.tuples(st.floats(0, 1.2), st.floats(0, 1.2)),
    prefetching=st.booleans(),
    caching=st.booleans(),
)
def test_less_device_memory_never_makes_training_faster(setup, tokens, policy, fractions, prefetching, caching):
    # The run's total time, not each step's: under allocation order and LRU, a device near the edge
    # can alternate between cheap and expensive steps, and the alternation's phase depends on the
    # memory (see test_allocation_order_is_gentler_than_lru_near_the_edge).
    small, big = sorted(fitting_fraction(setup, tokens, f) for f in fractions)
    trace = pg.training_trace(setup, tokens, use_prefetch=prefetching)
    hw = pg.Hardware.t4()
    r_small = pg.simulate(trace, hw.with_memory(small), policy, caching_allocator=caching, record_timeline=False)
    r_big = pg.simulate(trace, hw.with_memory(big), policy, caching_allocator=caching, record_timeline=False)
    assume(r_small.oom is None)
    assert r_big.oom is None
    assert total_time(r_small) >= total_time(r_big) - 1e-12
    assert r_small.bytes_out >= r_big.bytes_out


def test_less_device_memory_never_makes_the_lesson_model_faster(regimes):
    setup = regimes["thrashing"].setup
    trace = pg.training_trace(setup, [2048] * 4)
    for policy in pg.EVICTION_POLICIES:
        times = []
        for gib in (12.5, 14, 15.5, 16, 16.2, 16.4, 16.5, 16.6, 16.7, 17):
            r = pg.simulate(
                trace, pg.Hardware.t4().with_memory(int(gib * 2**30)), pg.Policy(eviction=policy), record_timeline=False
            )
            times.append(total_time(r))
        assert times == sorted(times, reverse=True), (policy, times)


def test_allocation_order_is_gentler_than_lru_near_the_edge(regimes):
    setup = regimes["thrashing"].setup
    trace = pg.training_trace(setup, [2048] * 4)
    state = setup.bytes_by_category()["optimizer state (paged)"]
    edge = int(16.71 * 2**30) - 100 * MiB  # about 100 MiB too little for the state to fit
    moved = {}
    for policy in pg.EVICTION_POLICIES:
        r = pg.simulate(trace, pg.Hardware.t4().with_memory(edge), pg.Policy(eviction=policy), record_timeline=False)
        moved[policy] = r.step_stats(3).h2d_bytes
    assert moved["mru"] <= moved["allocation"] < 0.1 * state < 0.5 * state < moved["lru"]


@FAST
@given(
    setup=setups_st,
    tokens=tokens_st,
    fraction=st.floats(0, 1.0),
    factor=st.floats(0.1, 1.0),
    which=st.sampled_from(["link", "h2d_bandwidth", "d2h_bandwidth", "device_bandwidth", "device_flops"]),
)
def test_less_bandwidth_never_makes_a_step_faster(setup, tokens, fraction, factor, which):
    hw = pg.Hardware.t4().with_memory(fitting_fraction(setup, tokens, fraction))
    slow = hw.scaled_link(factor) if which == "link" else replace(hw, **{which: getattr(hw, which) * factor})
    trace = pg.training_trace(setup, tokens)
    fast_result = pg.simulate(trace, hw, record_timeline=False)
    slow_result = pg.simulate(trace, slow, record_timeline=False)
    assume(fast_result.oom is None)
    for step in fast_result.steps:
        assert slow_result.step_time(step) >= fast_result.step_time(step) - 1e-12


def test_the_cliff_state_a_little_short_moves_all_of_it():
    setup = small_setup(4, 256)
    tokens = [64] * 4
    state = setup.bytes_by_category()["optimizer state (paged)"]
    moved = []
    for fraction in (1.05, 0.95, 0.5, 0.1):
        r = pg.simulate(
            pg.training_trace(setup, tokens),
            pg.Hardware.t4().with_memory(fitting_fraction(setup, tokens, fraction) - 8 * MiB),
            record_timeline=False,
        )
        moved.append(r.step_stats(3).h2d_bytes)
    assert moved[0] == 0
    assert all(m >= 0.9 * state for m in moved[1:])


# ---- the three regimes and the documented figure ----------------------------------------------


@pytest.fixture(scope="module")
def regimes():
    return pg.regimes()


def test_regime_state_fits(regimes):
    r = regimes["fits"]
    assert r.paged.oom is None and r.unpaged.oom is None
    assert all(r.paged.slowdown(s) == pytest.approx(1.0) for s in r.paged.steps)
    assert r.paged.bytes_in == r.paged.bytes_out == 0


def test_regime_transient_spike(regimes):
    r = regimes["spike"]
    spike = max(range(len(r.tokens_per_step)), key=lambda i: r.tokens_per_step[i])
    assert r.unpaged.oom is not None and r.unpaged.oom.step == spike
    assert r.paged.oom is None and r.paged.steps_completed == len(r.tokens_per_step)
    assert r.paged.step_stats(spike).d2h_bytes > 0
    assert r.paged.slowdown(spike) > 1.2
    assert r.paged.step_stats(spike - 1).h2d_bytes == 0
    last = r.paged.steps[-1]
    assert r.paged.step_stats(last).d2h_bytes == 0  # after empty_cache the state settles back
    assert r.paged.slowdown(last) < r.paged.slowdown(spike)


def test_without_empty_cache_the_spike_keeps_costing(regimes):
    r = regimes["spike"]
    trace = pg.training_trace(r.setup, list(r.tokens_per_step))  # no empty_cache
    kept = pg.simulate(trace, record_timeline=False)
    released = pg.simulate(trace, caching_allocator=False, record_timeline=False)
    last = kept.steps[-1]
    assert kept.slowdown(last) > 1.5
    assert released.slowdown(last) < kept.slowdown(last)


def test_regime_thrashing(regimes):
    r = regimes["thrashing"]
    assert r.unpaged.oom is not None
    assert r.paged.oom is None
    state = r.setup.bytes_by_category()["optimizer state (paged)"]
    last = r.paged.step_stats(r.paged.steps[-1])
    assert last.h2d_bytes >= 0.95 * state
    # the whole state out and back at the link's rate, on top of the compute
    hw = r.paged.hardware
    expected = 1 + (last.h2d_bytes / hw.h2d_bandwidth + last.d2h_bytes / hw.d2h_bandwidth) / last.compute
    assert r.steady_slowdown == pytest.approx(expected, rel=1e-6) and r.steady_slowdown > 2


@pytest.mark.parametrize("hardware", [pg.Hardware.pcie3_x16(), pg.Hardware.t4()], ids=["bnb-16GB/s", "T4"])
def test_125_ms_per_gb_evicted(hardware):
    cost = pg.evicted_per_step_cost(1.0, hardware)
    assert cost["evicted_gb"] == pytest.approx(1.0, rel=0.05)
    assert cost["ms_per_gb_in"] == pytest.approx(125, rel=0.2)  # what bitsandbytes' estimate counts
    assert 125 * 0.8 <= cost["ms_per_gb_total"] <= 2 * 125 * 1.2  # the way out is on top
    assert pg.bnb_estimate_ms(1.0) == pytest.approx(125)


def test_8bit_paging_and_lora_make_the_thrash_go_away(regimes):
    setup = regimes["thrashing"].setup
    eight = pg.simulate(pg.training_trace(setup.with_optimizer("paged_adamw_8bit"), [2048] * 3), record_timeline=False)
    assert eight.oom is None and eight.slowdown(2) == pytest.approx(1.0)


def test_paging_is_free_when_it_fits_but_offload_always_costs():
    rows = pg.compare_strategies((8, 24), steps=2)
    fits, big = rows
    assert fits.unpaged_fits and fits.slowdown["paged 32-bit"] == pytest.approx(1.0)
    assert fits.slowdown["CPU offload"] > 1.2
    assert not big.unpaged_fits and big.slowdown["paged 32-bit"] > 2
    assert big.slowdown["paged 8-bit"] == pytest.approx(1.0)
    assert big.slowdown["LoRA"] == pytest.approx(1.0)


# ---- driver details ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "granularity,density,faults",
    [(4 * KiB, False, 512), (64 * KiB, False, 32), (64 * KiB, True, 6), (2 * MiB, True, 1), (4 * KiB, True, 17)],
)
def test_fault_counts_per_2mb_block(granularity, density, faults):
    trace = [
        pg.alloc("s", 2 * MiB, managed=True),
        pg.touch("s"),
        pg.alloc("t", 2 * MiB, managed=True),
        pg.touch("t"),
        pg.touch("s"),
    ]
    policy = pg.Policy(granularity=granularity, density_prefetch=density)
    result = pg.simulate(trace, pg.Hardware.t4().with_memory(2 * MiB), policy)
    assert result.phases[(0, "")].faults == faults


def test_prefetch_migrates_without_faults_and_first_touch_populates():
    trace = [
        pg.alloc("s", 8 * MiB, managed=True),
        pg.touch("s"),
        pg.alloc("t", 8 * MiB, managed=True),
        pg.prefetch("t"),
        pg.prefetch("s"),
    ]
    result = pg.simulate(trace, pg.Hardware.t4().with_memory(8 * MiB))
    stats = result.phases[(0, "")]
    assert stats.faults == 0
    assert result.bytes_populated == 16 * MiB and result.bytes_in == 8 * MiB and result.bytes_out == 16 * MiB


def test_ordinary_allocations_evict_paged_state_and_oom_past_it():
    trace = [pg.alloc("state", 24 * MiB, managed=True), pg.touch("state"), pg.alloc("act", 24 * MiB)]
    result = pg.simulate(trace, pg.Hardware.t4().with_memory(32 * MiB))
    assert result.oom is None and result.bytes_out == 16 * MiB
    result = pg.simulate(trace + [pg.alloc("more", 16 * MiB)], pg.Hardware.t4().with_memory(32 * MiB))
    assert isinstance(result.oom, pg.OutOfDeviceMemory) and result.oom.name == "more"
    assert "never paged" in str(result.oom)


def test_caching_allocator_keeps_freed_blocks_until_empty_cache():
    start = [
        pg.alloc("a", 8 * MiB, managed=True),
        pg.alloc("b", 8 * MiB, managed=True),
        pg.touch("a"),
        pg.touch("b"),
        pg.alloc("act", 24 * MiB),
        pg.free("act"),
    ]
    again = [pg.touch("a"), pg.touch("b")]
    hw = pg.Hardware.t4().with_memory(32 * MiB)
    kept = pg.simulate(start + again, hw)
    assert (kept.bytes_in, kept.bytes_out) == (16 * MiB, 24 * MiB)  # a and b share one free 8 MiB
    flushed = pg.simulate(start + [pg.empty_cache()] + again, hw)
    assert (flushed.bytes_in, flushed.bytes_out) == (8 * MiB, 8 * MiB)
    released = pg.simulate(start + again, hw, caching_allocator=False)
    assert (released.bytes_in, released.bytes_out) == (8 * MiB, 8 * MiB)


@pytest.mark.parametrize(
    "nbytes,block,segment",
    [
        (1, 512, 2 * MiB),
        (513, 1024, 2 * MiB),
        (MiB, MiB, 2 * MiB),
        (MiB + 1, MiB + 512, 20 * MiB),
        (10 * MiB, 10 * MiB, 10 * MiB),
        (10 * MiB + 1, 10 * MiB + 512, 12 * MiB),
    ],
)
def test_caching_allocator_rounds_blocks_and_segments(nbytes, block, segment):
    # torch 2.13 c10/cuda/CUDACachingAllocator.cpp: round_size and get_allocation_size
    assert pg.block_bytes(nbytes) == block
    assert pg.segment_bytes(pg.block_bytes(nbytes)) == segment


def test_a_small_request_on_a_small_device_fails_for_its_segment():
    # a 4 MiB request asks cudaMalloc for a 20 MiB segment: it cannot fit 8 MiB, as on a real GPU
    result = pg.simulate([pg.alloc("act", 4 * MiB)], pg.Hardware.t4().with_memory(8 * MiB))
    assert result.oom is not None


def test_foreach_adamw_allocates_one_state_sized_temporary_per_step():
    setup = small_setup(2, 256, "adamw")
    state = setup.bytes_by_category()["optimizer state (ordinary)"]
    assert setup.bytes_by_category()["optimizer temporaries"] == state // 2  # sqrt(exp_avg_sq)
    assert setup.with_optimizer("paged_adamw_32bit").bytes_by_category()["optimizer temporaries"] == 0
    with_tmp = pg.simulate(pg.training_trace(setup, [64] * 2), pg.Hardware.t4().with_memory(1 << 40))
    paged = pg.simulate(
        pg.training_trace(setup.with_optimizer("paged_adamw_32bit"), [64] * 2), pg.Hardware.t4().with_memory(1 << 40)
    )
    assert with_tmp.peak_reserved >= paged.peak_reserved + state // 2 + state


def test_state_of_one_parameter_larger_than_the_device_stops_the_run():
    trace = [pg.alloc("s", 16 * MiB, managed=True), pg.touch("s")]
    result = pg.simulate(trace, pg.Hardware.t4().with_memory(8 * MiB))
    assert result.oom is not None and "thrash inside one kernel" in str(result.oom)


def test_timeline_is_sequential_and_adds_up(regimes):
    r = regimes["spike"].paged
    segments = r.timeline
    assert all(a.end <= b.start + 1e-12 for a, b in zip(segments, segments[1:]))
    total = sum(s.end - s.start for s in segments)
    assert total == pytest.approx(sum(r.step_time(s) for s in r.steps))
    assert {s.lane for s in segments} >= {"compute", "H2D", "D2H"}


def test_measured_step_touches_optimizer_state_only_in_the_step():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), foreach=False)
    x = torch.randn(4, 8)
    model(x).sum().backward()
    optimizer.step()
    summary = pg.touch_summary(pg.measure_touches(model, optimizer, lambda: model(x).pow(2).mean()))
    assert summary["forward"]["optimizer state"] == summary["backward"]["optimizer state"] == 0
    assert summary["optimizer"]["optimizer state"] > 0
    assert summary["forward"]["weights"] > 0 and summary["forward"]["gradients"] == 0
    assert summary["backward"]["gradients"] > 0


# ---- state sizes -------------------------------------------------------------------------------


def test_optimizer_state_bytes_follow_bitsandbytes():
    big, small, tiny = pg.ParamSpec("big", 1_000_000), pg.ParamSpec("small", 50_000), pg.ParamSpec("tiny", 1000)
    eight = pg.optimizer_state(big, "paged_adamw_8bit")
    assert sum(s.nbytes for s in eight) / big.numel == pytest.approx(2.03125, rel=1e-4)
    assert [s.managed for s in eight] == [True, True, False, False]
    assert not any(s.managed for s in pg.optimizer_state(small, "paged_adamw_32bit"))  # numel < 1e5
    assert sum(s.nbytes for s in pg.optimizer_state(tiny, "paged_adamw_8bit")) == 8 * 1000  # < 4096: 32-bit
    assert sum(s.nbytes for s in pg.optimizer_state(big, "adamw")) == 8 * big.numel


def test_transformer_params_match_gpt2_small_and_a_module():
    specs = pg.transformer_params(12, 768, 50257)
    assert sum(s.numel for s in specs) == 124_439_808
    lora = pg.transformer_params(2, 64, 100, lora_rank=4)
    assert {s.name for s in lora if s.trainable} == {f"h.{i}.attn.c_attn.lora_{x}" for i in range(2) for x in "AB"}
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    got = pg.params_from_module(module)
    assert [(s.name, s.numel, s.layer) for s in got] == [
        ("0.weight", 16, 0),
        ("0.bias", 4, 0),
        ("2.weight", 8, 2),
        ("2.bias", 2, 2),
    ]


# ---- bad input ---------------------------------------------------------------------------------


def test_capacity_smaller_than_one_page_is_a_clear_error():
    trace = [pg.alloc("s", 4 * MiB, managed=True), pg.touch("s")]
    with pytest.raises(pg.PagingError, match="smaller than one page"):
        pg.simulate(trace, pg.Hardware.t4().with_memory(1 * MiB))
    with pytest.raises(pg.PagingError, match="memory must be a positive"):
        pg.Hardware.t4().with_memory(0)
    with pytest.raises(pg.PagingError, match="at least one chunk"):
        pg.chunk_migrations([0, 1], 0)


@pytest.mark.parametrize(
    "field", ["h2d_bandwidth", "d2h_bandwidth", "device_bandwidth", "device_flops", "pinned_bandwidth", "cpu_adam_rate"]
)
@pytest.mark.parametrize("value", [-1.0, 0.0, float("nan"), float("inf")])
def test_negative_or_zero_bandwidth_is_a_clear_error(field, value):
    with pytest.raises(pg.PagingError, match=field):
        replace(pg.Hardware.t4(), **{field: value})
    with pytest.raises(pg.PagingError):
        pg.Hardware.t4(prefetch_efficiency=-0.5)
    with pytest.raises(pg.PagingError):
        pg.bnb_estimate_ms(1.0, link_gb_per_s=-16)


def test_a_trace_that_touches_unallocated_memory_is_a_clear_error():
    with pytest.raises(pg.PagingError, match=r"'ghost', which is not allocated"):
        pg.simulate([pg.alloc("s", 2 * MiB, managed=True), pg.touch("s", "ghost")])
    with pytest.raises(pg.PagingError, match="nothing is allocated"):
        pg.simulate([pg.prefetch("ghost")])
    with pytest.raises(pg.PagingError, match="not allocated"):
        pg.simulate([pg.alloc("a", MiB), pg.free("a"), pg.free("a")])
    with pytest.raises(pg.PagingError, match="managed memory"):
        pg.simulate([pg.alloc("a", MiB), pg.prefetch("a")])
    with pytest.raises(pg.PagingError, match="allocated twice"):
        pg.simulate([pg.alloc("a", MiB), pg.alloc("a", MiB)])
    with pytest.raises(pg.PagingError, match="positive byte count"):
        pg.simulate([pg.alloc("a", 0)])
    with pytest.raises(pg.PagingError, match=r"nbytes must be a whole number >= 0, got -5"):
        pg.alloc("a", -5)
    with pytest.raises(pg.PagingError, match=r"nbytes must be a whole number >= 0, got 2.5 \(it has a fraction\)"):
        pg.alloc("a", 2.5)  # never rounded down to 2 bytes
    with pytest.raises(pg.PagingError, match="unknown op"):
        pg.simulate([pg.Event("swap", ("a",))])


def test_bad_policy_and_setup_values_are_clear_errors():
    with pytest.raises(pg.PagingError, match="granularity"):
        pg.Policy(granularity=8 * KiB)
    with pytest.raises(pg.PagingError, match="eviction must be"):
        pg.Policy(eviction="random")
    with pytest.raises(pg.PagingError, match="optimizer must be"):
        pg.TrainingSetup((pg.ParamSpec("w", 10),), "sgd")
    with pytest.raises(pg.PagingError, match="at least one step"):
        pg.training_trace(small_setup(1, 64), [])
    with pytest.raises(pg.PagingError, match="non-negative integers"):
        pg.training_trace(small_setup(1, 64), [-3])


# ---- manual offload ------------------------------------------------------------------------------


def test_simulated_offload_saves_the_state_and_costs_every_step():
    setup = small_setup(4, 256)
    result = pg.simulate_offload(setup, 256)
    cat = setup.bytes_by_category(256)
    assert result.device_peak < cat["weights"] + cat["gradients"] + cat["activations"] + 1
    assert result.total > result.compute
    fast_cpu = pg.simulate_offload(setup, 256, replace(pg.Hardware.t4(), cpu_adam_rate=1e11))
    assert fast_cpu.total < result.total


@pytest.mark.parametrize("offload_gradients", [True, False])
def test_cpu_offload_adamw_matches_torch_adamw(offload_gradients):
    torch.manual_seed(0)
    a, b = pg.mlp(12, 3), pg.mlp(12, 3)
    b.load_state_dict(a.state_dict())
    ref = torch.optim.AdamW(a.parameters(), lr=1e-2, weight_decay=0.1)
    off = pg.CPUOffloadAdamW(b.parameters(), lr=1e-2, weight_decay=0.1, offload_gradients=offload_gradients)
    for _ in range(4):
        for _micro in range(2):  # gradient accumulation: two backward passes per step
            x = torch.randn(5, 12)
            a(x).pow(2).mean().backward()
            b(x).pow(2).mean().backward()
        ref.step()
        ref.zero_grad()
        off.step()
        off.zero_grad()
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)
    assert off.state_bytes() >= 8 * sum(p.numel() for p in b.parameters())
    if offload_gradients:
        assert all(p.grad is None for p in b.parameters())


def test_cpu_offload_adamw_rejects_bad_input():
    with pytest.raises(ValueError, match="no parameters"):
        pg.CPUOffloadAdamW([torch.nn.Parameter(torch.ones(2), requires_grad=False)])
    with pytest.raises(ValueError, match="lr"):
        pg.CPUOffloadAdamW([torch.nn.Parameter(torch.ones(2))], lr=-1)


def test_the_demo_mlp_puts_each_linear_on_its_own_layer():
    setup = pg.mlp_setup({"hidden": 16, "layers": 3, "tokens": 4})
    assert setup.n_layers == 3
    assert [p.layer for p in setup.params] == [0, 0, 1, 1, 2, 2]


def test_prefetch_timeline_records_each_parameter_on_cpu():
    bnb = pytest.importorskip("bitsandbytes")
    model = pg.mlp(32, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = bnb.optim.PagedAdamW32bit(model.parameters(), lr=1e-3)
        timeline = pg.PrefetchTimeline(opt)
        model(torch.randn(4, 32)).sum().backward()
        timeline.start_step()
        opt.step()
    kinds = [e.kind for e in timeline.entries]
    assert kinds == ["prefetch", "update"] * 4
    assert all(e.end >= e.start for e in timeline.entries)
    with pytest.raises(TypeError):
        pg.PrefetchTimeline(torch.optim.SGD(model.parameters(), lr=0.1))


def test_demo_runs_on_cpu_and_the_cuda_parts_say_they_need_cuda():
    run = pg.run_training("paged_adamw_8bit", {"hidden": 64, "layers": 2, "tokens": 8}, 2)
    assert run.status == "ok" and len(run.steps) == 2
    if not torch.cuda.is_available():
        for fn in (pg.paging_demo, pg.measure_bandwidths):
            with pytest.raises(RuntimeError, match="CUDA"):
                fn()
        with pytest.raises(RuntimeError, match="CUDA"):
            pg.VirtualGPU(2**30)


@pytest.mark.parametrize("gib", [2, 3, 4, 8, 15])
def test_every_demo_outcome_is_clear_of_the_capacity_by_the_margin(gib):
    margins = pg.demo_margins(gib * 2**30)
    claims = pg.demo_claims(margins)
    assert claims and all(claims.values()), {k: v for k, v in claims.items() if not v}
    # and the claims can fail: a device 30% larger fits plain AdamW's state far better
    assert not all(pg.demo_claims(pg.demo_margins(int(1.3 * gib * 2**30), pg.demo_shape(gib * 2**30))).values())


@pytest.mark.parametrize("gib", [2, 4, 8])
def test_the_spike_experiment_is_clear_of_the_capacity_by_the_margin(gib):
    plan = pg.spike_plan(gib * 2**30)
    assert all(plan["claims"].values()), plan["claims"]
    assert max(plan["tokens"]) == plan["tokens"][plan["spike_step"]] > 10 * min(plan["tokens"])


def test_no_call_that_ends_the_process():
    # prefetch_tensor(..., to_cpu=True) ends the process on CUDA (csrc/pythonInterface.cpp): never called
    root = Path(__file__).resolve().parents[2]
    for folder in ("course_lib", "benchmarks"):
        for path in (root / folder).rglob("*.py"):
            assert "to_cpu=True" not in path.read_text(), path


def test_every_demo_row_runs_in_a_process_of_its_own():
    shape = {"hidden": 32, "layers": 2, "tokens": 8}
    rows = pg.isolated_runs(
        [
            {"optimizer": "adamw", "shape": shape, "steps": 2},
            {"optimizer": "paged_adamw_8bit", "shape": shape, "steps": 2},
        ]
    )
    assert [r["status"] for r in rows] == ["ok", "ok"] and all(len(r["steps"]) == 2 for r in rows)
    pids = [r["pid"] for r in rows]
    assert os.getpid() not in pids and len(set(pids)) == 2


def test_the_gpu_demo_sends_each_optimizer_to_its_own_process(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        isolate,
        "run",
        lambda target, timeout=None, **kw: calls.append((target, kw)) or {"status": "ok", "pid": len(calls)},
    )
    demo = pg.paging_demo(2**30, steps=2)
    assert [kw["optimizer"] for _, kw in calls] == list(pg.DEMO_OPTIMIZERS)
    assert {target for target, _ in calls} == {"course_lib.paging.demo:demo_row"}
    assert len({run["pid"] for run in demo["runs"].values()}) == len(pg.DEMO_OPTIMIZERS)


def test_a_child_that_dies_is_a_row_status_not_a_dead_caller():
    result = isolate.run("os:_exit", status=3)
    assert result["status"] == "crashed" and result["returncode"] == 3
    with pytest.raises(ValueError, match="module:function"):
        isolate.run("os.getpid")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_plain_adamw_ooms_and_paged_completes():
    result = pg.paging_demo(2 * 2**30, steps=3, optimizers=("adamw", "paged_adamw_32bit", "paged_adamw_8bit"))
    runs = result["runs"]
    assert runs["adamw"]["status"] == "out of memory"
    assert runs["paged_adamw_32bit"]["status"] == "ok"
    assert runs["paged_adamw_8bit"]["status"] == "ok"
    assert len({run["pid"] for run in runs.values()}) == 3
