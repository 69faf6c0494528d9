"""Tests for the weak spots the mutation benchmark showed (benchmarks/mutation_score.py): exact
assertions where the code is exact, every phase's starting state, thresholds on both sides, the
partition against torch's own engine, wrong answers fed to the exercise checks of lessons 3, 4 and 6,
and half-precision paths run without autocast (which would upcast by itself)."""

import math
from pathlib import Path
from types import SimpleNamespace

import nbformat
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.optim import ZeroRedundancyOptimizer

from course_lib import checks, paging
from course_lib.accumulation import TokenLoss
from course_lib.accumulation.loop import AccumulationLoop
from course_lib.checkpointing import named_plan, plan_cost, segments_plan
from course_lib.checks import CheckFailed
from course_lib.grading.restore import identify
from course_lib.measure import LiveStorageTracker, MiB
from course_lib.planner import GPUS, plan
from course_lib.planner.config.setup import Setup
from course_lib.planner.parallel.sharded import PARTITIONED, zero1_partition
from course_lib.planner.search.fit import _candidate_tricks
from course_lib.qlora.recipe import Recipe, RecipeError
from course_lib.toolbox.activation_offload import transfer_seconds
from course_lib.toolbox.chunked_loss import chunked_cross_entropy

# --- a state that starts wrong but ends right: every phase's peak starts from the bytes live then ---


def test_every_phase_s_peak_starts_from_the_bytes_live_when_it_begins():
    kept = torch.ones(1000)  # 4000 bytes, alive before the region
    with LiveStorageTracker() as tracker:
        tracker.watch(kept)
        tracker.set_phase("grows")
        extra = torch.ones(500)  # + 2000
        tracker.set_phase("frees")
        del extra  # nothing allocated in this phase: its peak is what was live when it began
        tracker.set_phase("views")
        kept.view(10, 100)  # no new storage
    assert tracker.phase_peaks == {"start": 4000, "grows": 6000, "frees": 6000, "views": 4000}


def test_the_allocator_events_start_each_phase_from_the_bytes_live_then():
    from course_lib.allocator_events import AllocatorEvents

    with AllocatorEvents() as events:
        events.mark("grows")
        extra = torch.ones(1 << 16)  # 256 KiB
        events.mark("frees")
        del extra
        events.mark("quiet")
    peaks = events.phase_peaks(baseline=10 * MiB)
    assert peaks["grows"] >= 10 * MiB + (1 << 18)
    assert peaks["frees"] == peaks["grows"]  # live when it began; it only frees
    assert peaks["quiet"] == pytest.approx(10 * MiB, abs=4096)


# --- thresholds tested on both sides ---


def test_the_density_prefetcher_grows_only_when_strictly_more_than_the_threshold_is_resident():
    # two 64 KB pages, both missing: after the first fault half the block is resident
    assert paging.sweep_faults(2, 2, threshold=0.5) == 2  # exactly half is not more than half
    assert paging.sweep_faults(2, 2, threshold=0.49) == 1  # more than 49%: the whole block comes in


def test_a_density_threshold_of_1_is_accepted_and_0_or_more_is_refused():
    assert paging.Policy(density_threshold=1.0).density_threshold == 1.0
    for bad in (0, 1.01):
        with pytest.raises(paging.PagingError, match="density_threshold"):
            paging.Policy(density_threshold=bad)


def test_segment_bytes_on_both_sides_of_each_allocator_boundary():
    assert paging.segment_bytes(1 * MiB) == 2 * MiB  # up to kSmallSize: a shared 2 MiB segment
    assert paging.segment_bytes(1 * MiB + 512) == 20 * MiB
    assert paging.segment_bytes(10 * MiB) == 10 * MiB  # a whole number of 2 MiB pages: no rounding
    assert paging.segment_bytes(10 * MiB + 512) == 12 * MiB


def test_a_clip_norm_of_0_is_refused_and_a_small_one_accepted():
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = TokenLoss()
    with pytest.raises(ValueError, match="max_grad_norm"):
        AccumulationLoop(model, optimizer, loss, 2, max_grad_norm=0)
    assert AccumulationLoop(model, optimizer, loss, 2, max_grad_norm=1e-6).max_grad_norm == 1e-6


def test_offload_transfers_of_0_bytes_take_0_seconds_and_negative_ones_are_refused():
    assert transfer_seconds(0, 0) == 0
    with pytest.raises(ValueError, match="to_host"):
        transfer_seconds(-1, 0)


def test_a_recipe_s_batch_must_be_at_least_1():
    assert Recipe(batch=1).validate().batch == 1
    with pytest.raises(RecipeError, match="batch must be a positive integer"):
        Recipe(batch=0).validate()


def test_the_accumulation_trick_is_offered_from_a_micro_batch_of_2():
    names = lambda batch: [name for name, _, _ in _candidate_tricks(Setup(batch=batch), GPUS["t4"])]  # noqa: E731
    assert "micro-batch 1 with gradient accumulation x2" in names(2)
    assert not any(name.startswith("micro-batch 1") for name in names(1))


def test_bf16_hardware_starts_at_compute_capability_8_0():
    assert GPUS["a100-40gb"].compute_capability == (8, 0) and GPUS["a100-40gb"].bf16
    assert not GPUS["t4"].bf16


def test_the_sqrt_plan_rounds_the_square_root_to_the_nearest_whole_number_of_segments():
    assert named_plan(7, "sqrt") == segments_plan(7, 3)  # sqrt(7) = 2.65
    assert named_plan(6, "sqrt") == segments_plan(6, 2)  # sqrt(6) = 2.45
    assert named_plan(16, "sqrt") == segments_plan(16, 4)


# --- engines compared with the real engine ---


def zero1_shares(numels: list[int], n: int) -> list[int]:
    """The elements each rank owns under the planner's zero1 partition."""
    return [sum(math.prod(shape) for shape in part) for part in zero1_partition([(k,) for k in numels], n)]


def _torchs_partition(numels: list[int], n: int) -> list[int]:
    """torch's own ZeroRedundancyOptimizer._partition_parameters, on a stand-in for the optimizer (it
    reads only world_size, param_groups and its cache): the elements each rank gets."""
    params = [torch.empty(numel) for numel in numels]
    engine = SimpleNamespace(world_size=n, param_groups=[{"params": params}], _partition_parameters_cache=[])
    engine._get_min_index = lambda values: ZeroRedundancyOptimizer._get_min_index(engine, values)
    engine._partition_param_group = lambda *a: ZeroRedundancyOptimizer._partition_param_group(engine, *a)
    groups = ZeroRedundancyOptimizer._partition_parameters(engine)
    return [sum(p.numel() for group in rank for p in group["params"]) for rank in groups]


@settings(max_examples=60, deadline=None)
@given(numels=st.lists(st.integers(1, 40), min_size=1, max_size=12), n=st.integers(1, 5))
def test_zero1_shares_are_torchs_own_partition_rank_by_rank(numels, n):
    assert zero1_shares(numels, n) == _torchs_partition(numels, n)


def test_zero1_shares_break_ties_as_torch_does():
    assert zero1_shares([5, 5, 5, 3], 2) == _torchs_partition([5, 5, 5, 3], 2) == [10, 8]


# --- exact assertions where the code is exact ---


@pytest.mark.parametrize("stage", ["zero1", "zero2", "zero3"])
def test_each_partitioned_category_is_the_single_gpu_bytes_divided_and_rounded_up(stage):
    n_params, gpus = 1_000_003, 3
    one = plan(n_params, precision="mixed-bf16", optimizer="adamw").bytes
    share = plan(n_params, precision="mixed-bf16", optimizer="adamw", gpus=gpus, shard=stage).bytes
    for category in ("weights", "gradients", "optimizer_state", "master_weights"):
        expected = math.ceil(one[category] / gpus) if category in PARTITIONED[stage] else one[category]
        assert share[category] == expected, category


def test_the_planner_counts_the_int64_input_ids_and_labels_to_the_byte():
    batch, seq = 1, 96
    ids = torch.zeros(batch, seq, dtype=torch.long)
    p = plan("gpt2", precision="fp32", batch=batch, seq=seq)
    assert p.detail["batch"] == 2 * ids.numel() * ids.element_size() == 1536  # input_ids and labels
    assert p.detail["forward_peak"] > p.detail["batch"] and p.detail["optimizer_step_peak"] > p.detail["batch"]


# --- a dtype path tested without the mechanism that would hide it (no autocast) ---


class _FixedLogits(torch.nn.Module):
    def __init__(self, logits):
        super().__init__()
        self.logits = logits

    def forward(self, input_ids, attention_mask=None):
        return self.logits


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_token_loss_upcasts_half_precision_logits_itself(dtype):
    torch.manual_seed(0)
    logits = (4 * torch.randn(2, 9, 50)).to(dtype)
    labels = torch.randint(0, 50, (2, 9))
    labels[1, 5:] = -100
    total = TokenLoss().sum(_FixedLogits(logits), {"input_ids": labels, "labels": labels})
    expected = F.cross_entropy(logits[:, :-1].float().reshape(-1, 50), labels[:, 1:].reshape(-1), reduction="sum")
    assert total.dtype == torch.float32
    torch.testing.assert_close(total, expected, rtol=1e-6, atol=0)


def test_the_chunked_loss_upcasts_bf16_logits_itself():
    torch.manual_seed(0)
    hidden, weight = torch.randn(2, 16, 32).bfloat16(), torch.randn(300, 32).bfloat16()
    labels = torch.randint(0, 300, (2, 16))
    got = chunked_cross_entropy(hidden, weight, labels, chunk_size=8)
    logits = F.linear(hidden, weight).float()[:, :-1].reshape(-1, 300)
    expected = F.cross_entropy(logits, labels[:, 1:].reshape(-1))
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=0)


# --- every exercise check fed plausible wrong answers ---


@pytest.mark.parametrize(
    "trace_for",
    [
        lambda capacity: list(range(capacity + 1)) * 3,  # a cycle one chunk too long: both thrash alike
        lambda capacity: list(range(capacity)) * 2,  # everything fits: both migrate nothing
    ],
    ids=["cycle", "fits"],
)
def test_exercise_4_3_refuses_a_trace_where_allocation_order_only_ties(trace_for):
    with pytest.raises(CheckFailed, match="allocation order migrates"):
        checks.check_allocation_order_wins(trace_for)


def _lru_and_allocation(accesses, capacity, policy):
    """A learner's exercise 4.1, right for allocation order and LRU; MRU treated as LRU."""
    resident, bytes_in, bytes_out, seen = [], 0, 0, set()
    for chunk in accesses:
        if chunk in resident:
            if policy != "allocation":
                resident.remove(chunk)
                resident.append(chunk)
            continue
        if len(resident) == capacity:
            resident.pop(0)
            bytes_out += 2 * MiB
        bytes_in += 2 * MiB if chunk in seen else 0
        seen.add(chunk)
        resident.append(chunk)
    return bytes_in, bytes_out


def test_exercise_4_1_accepts_the_right_policies_and_refuses_a_first_touch_counted_as_a_migration():
    checks.check_migrated_bytes(_lru_and_allocation)
    with pytest.raises(CheckFailed, match="first access of each chunk as a migration"):
        checks.check_migrated_bytes(
            lambda a, c, p: (_lru_and_allocation(a, c, p)[0] + 2 * MiB * len(set(a)), _lru_and_allocation(a, c, p)[1])
        )


def test_exercise_4_2_refuses_mru_answered_as_lru_or_evicting_the_chunk_brought_in():
    with pytest.raises(CheckFailed, match="evict the most recently used"):
        checks.check_mru(_lru_and_allocation)

    def evicts_the_newcomer(accesses, capacity, policy):  # "most recent" counted after the chunk arrives
        resident, bytes_in, bytes_out, seen = [], 0, 0, set()
        for chunk in accesses:
            if chunk not in resident:
                bytes_in += 2 * MiB if chunk in seen else 0
                seen.add(chunk)
                resident.append(chunk)
                if len(resident) > capacity:
                    resident.pop(-1)
                    bytes_out += 2 * MiB
        return bytes_in, bytes_out

    with pytest.raises(CheckFailed, match="accesses"):
        checks.check_mru(evicts_the_newcomer)


def test_exercise_4_4_refuses_a_wrong_value_in_either_key():
    with_cache, without = checks.paging._step3_in(True), checks.paging._step3_in(False)
    assert with_cache != without
    with pytest.raises(CheckFailed, match="without empty_cache: you predict"):
        checks.check_step3_prediction(lambda: {"with empty_cache": with_cache, "without empty_cache": 0})
    with pytest.raises(CheckFailed, match="with empty_cache: you predict"):
        checks.check_step3_prediction(lambda: {"with empty_cache": without, "without empty_cache": with_cache})


def _every_plan(n, start=0):
    """Every plan of n layers from `start` on: disjoint segments, gaps allowed."""
    if start >= n:
        yield []
        return
    yield from _every_plan(n, start + 1)
    for end in range(start + 1, n + 1):
        for rest in _every_plan(n, end):
            yield [(start, end), *rest]


def _lowest_peak(saved, inputs, budget):
    """A plausible wrong exercise 3.2: the fitting plan with the lowest peak (it recomputes too much)."""
    fitting = [p for p in _every_plan(len(saved)) if plan_cost(saved, inputs, p).peak_bytes <= budget]
    if not fitting:
        raise ValueError("no plan fits")
    return min(fitting, key=lambda p: plan_cost(saved, inputs, p).peak_bytes)


def _never_raises(saved, inputs, budget):
    """A plausible wrong exercise 3.2: brute force, right where a plan fits, but returning the lowest
    peak instead of raising where none does (and nothing for a stack too long to try every plan)."""
    if len(saved) > 8:
        return []
    plans = sorted(_every_plan(len(saved)), key=lambda p: plan_cost(saved, inputs, p).peak_bytes)
    fitting = [p for p in plans if plan_cost(saved, inputs, p).peak_bytes <= budget]
    return min(fitting, key=lambda p: sum(b - a for a, b in p)) if fitting else plans[0]


def test_exercise_3_2_refuses_an_answer_that_recomputes_too_much_or_never_raises():
    with pytest.raises(CheckFailed, match="recomputes"):
        checks.check_best_plan(_lowest_peak)
    with pytest.raises(CheckFailed, match="raise ValueError"):
        checks.check_best_plan(_never_raises)


def test_exercise_3_2_refuses_a_plan_that_recomputes_one_layer_more_than_the_best():
    saved, inputs = [6, 6, 6], [1, 1, 1]
    budget = plan_cost(saved, inputs, []).peak_bytes  # nothing checkpointed fits: 0 layers recomputed
    assert plan_cost(saved, inputs, [(0, 1)]).peak_bytes <= budget
    with pytest.raises(AssertionError, match="recomputes 1 layers"):
        checks.checkpointing._check_one(lambda *a: [(0, 1)], saved, inputs, budget, 0)


def _no_checkpoint(layers, x, plan):
    return layers(x)


def _reentrant(layers, x, plan):
    from torch.utils.checkpoint import checkpoint

    i, starts = 0, dict(plan)
    while i < len(layers):
        if i in starts:
            segment = torch.nn.Sequential(*layers[i : starts[i]])
            x, i = checkpoint(segment, x, use_reentrant=True), starts[i]
        else:
            x, i = layers[i](x), i + 1
    return x


@pytest.mark.parametrize(
    "answer, hint",
    [
        (_no_checkpoint, "Nothing was recomputed"),
        (_reentrant, "use_reentrant=False"),
    ],
)
def test_exercise_3_1_fails_plausible_wrong_answers_with_their_hint(answer, hint):
    with pytest.raises(CheckFailed, match=hint):
        checks.check_checkpointed_forward(answer)


# --- grading: a tie in shared cell ids identifies nothing ---


def test_a_submission_sharing_as_many_cell_ids_with_two_exercises_is_identified_as_neither():
    def notebook(*ids):
        nb = nbformat.v4.new_notebook()
        nb.cells = [nbformat.v4.new_code_cell("1", id=i) for i in ids]
        return nb

    references = {"00_a": notebook("x", "shared"), "01_b": notebook("y", "shared")}
    assert identify(notebook("shared", "mine"), Path("renamed.ipynb"), references) is None
    assert identify(notebook("shared", "x"), Path("renamed.ipynb"), references) == "00_a"


# --- the layer finder: of two outermost stacks, the longer ---


def test_the_longer_of_two_outermost_stacks_is_the_layer_stack():
    from course_lib.layers import find_layer_stack

    model = torch.nn.Module()
    model.adapters = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(2))
    model.blocks = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(5))
    model.tail = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(3))
    assert find_layer_stack(model) is model.blocks
