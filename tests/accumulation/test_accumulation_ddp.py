"""Lesson 2 cross-check: DDP with no_sync, two CPU processes (gloo on 127.0.0.1, spawn, a free port).

One spawn runs the reference loop and each DDP mistake; a comm hook counts the gradient all-reduces of
every window. The processes are killed, and the test fails, if they do not finish within the timeout.
"""

import multiprocessing

import pytest

from course_lib.accumulation import ddp_accumulation_demo
from course_lib.checks import check_ddp_accumulation

pytestmark = pytest.mark.slow  # gloo ranks in processes of their own

VARIANTS = [(), ("sync_every_micro_batch",), ("never_sync",), ("count_per_rank",)]


@pytest.fixture(scope="module")
def reports():
    return {r.mistakes: r for r in ddp_accumulation_demo(VARIANTS, timeout_s=120)}


def test_reference_loop_syncs_once_per_window_and_matches_one_process(reports):
    report = reports[()]
    assert (report.world_size, report.micro_batches, report.windows) == (2, 6, 2)
    assert report.allreduces_per_window == [1, 1]
    assert report.max_diff_vs_single < 1e-5 and report.max_diff_between_ranks == 0.0
    check_ddp_accumulation(report)


@pytest.mark.parametrize(
    "mistake, hint",
    [
        ("sync_every_micro_batch", "expected 1 each"),
        ("never_sync", "no gradient all-reduce"),
        ("count_per_rank", "all-reduce it"),
    ],
)
def test_the_ddp_check_catches_each_ddp_mistake(reports, mistake, hint):
    with pytest.raises(AssertionError, match=hint):
        check_ddp_accumulation(reports[(mistake,)])


def test_what_each_mistake_does(reports):
    every = reports[("sync_every_micro_batch",)]
    assert every.allreduces_per_window == [4, 2], "one all-reduce per micro-batch: a window of 4, then of 2"
    assert every.max_diff_vs_single < 1e-5, "syncing every micro-batch is slow, not wrong"
    never = reports[("never_sync",)]
    assert never.allreduces_per_window == [0, 0] and never.max_diff_between_ranks > 1e-2
    local = reports[("count_per_rank",)]
    assert local.allreduces_per_window == [1, 1] and local.max_diff_vs_single > 1e-3


def test_processes_that_overrun_are_killed():
    with pytest.raises(TimeoutError, match="did not finish"):
        ddp_accumulation_demo([()], timeout_s=0.01)  # the ranks are forked in well under a second
    assert multiprocessing.active_children() == []


def test_unknown_variant_is_refused_before_spawning():
    with pytest.raises(ValueError, match="unknown mistake .typo."):
        ddp_accumulation_demo([("typo",)])
