"""The planner's fit rules exactly at their boundaries: a reserve that fills the card to the byte, a
step whose held bytes fill it, a trick that saves exactly 0.5%, compute capability 8.0, one GPU."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

from course_lib.caching_allocator import MiB
from course_lib.planner.allocator.limit import at_the_limit
from course_lib.planner.allocator.reserved import Reserved
from course_lib.planner.config.gpus import GPU, GPUS
from course_lib.planner.config.setup import Setup
from course_lib.planner.search.fit import _candidate_tricks, _cannot_save, _saves_enough

CAPACITY = 1000 * MiB


def _line(reserved: int, context: int = 100 * MiB, managed: int = 0, held: int = 0) -> Reserved:
    return Reserved(reserved, reserved, 0, context, managed, CAPACITY, True, held=held)


def test_a_reserve_that_fills_the_card_exactly_fits_with_nothing_to_spare():
    line = _line(CAPACITY - 100 * MiB)  # reserve + context == capacity
    assert line.nvidia_smi == line.capacity
    assert line.fits
    verdict = line.verdict(GPU("card", CAPACITY, (8, 0)))
    assert verdict.startswith("fits on") and "does not fit" not in verdict
    assert not replace(line, reserved=line.reserved + 1).fits


def _step(stream: list[int]) -> SimpleNamespace:
    """What `at_the_limit` reads of a traced step."""
    setup = SimpleNamespace(empty_cache_each_step=False, checkpointing="none")
    return SimpleNamespace(setup=setup, answer=lambda *key: key[-1](), stream=lambda: stream)


def test_a_step_whose_held_bytes_fill_the_card_exactly_is_still_replayed():
    held = CAPACITY - 100 * MiB  # held + context == capacity: no room beside it, but not past the card
    line = _line(CAPACITY, held=held)
    assert not line.fits
    limited = at_the_limit(line, _step([20 * MiB]))  # one 20 MiB segment: fits in its own live peak
    assert limited.retries and limited.reserved == held
    assert at_the_limit(replace(line, held=held + 1), _step([20 * MiB])) == replace(line, held=held + 1)


def _plan(total: int, phases: dict | None = None, peak: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(total=total, detail={"phases": phases or {}, "peak_phase": peak})


def test_a_trick_that_saves_exactly_half_a_percent_is_not_worth_saying():
    current = _plan(200_000)
    step = current.total // 200
    assert not _saves_enough(current, _plan(current.total - step))
    assert _saves_enough(current, _plan(current.total - step - 1))


def test_an_optimizer_step_exactly_half_a_percent_below_the_peak_cannot_be_beaten_by_activations():
    total = 200_000
    for below, cannot in ((total // 200, True), (total // 200 + 1, False)):
        phases = {"backward": {"activations": total}, "optimizer step": {"state": total - below}}
        current = _plan(total, phases, "backward")
        assert _cannot_save(current, {"checkpointing": "every-layer"}) is cannot


def test_compute_capability_8_0_has_bf16():
    assert GPU("a", 1, (8, 0)).bf16 and not GPU("b", 1, (7, 5)).bf16


def test_one_gpu_is_offered_no_sharding():
    names = lambda gpus: [n for n, _, _ in _candidate_tricks(Setup(gpus=gpus), GPUS["t4"])]  # noqa: E731
    assert not any(n.startswith("shard") for n in names(1))
    assert any(n.startswith("shard") for n in names(2))


def test_the_step_in_backward_is_offered_from_a_micro_batch_of_1_only():
    def in_backward(batch: int) -> bool:
        return any(nxt.optimizer_in_backward for _, nxt, _ in _candidate_tricks(Setup(batch=batch), GPUS["t4"]))

    assert in_backward(1) and not in_backward(2)  # it refuses accumulation
