"""Lesson 6: ZeRO's stages on real engines, measured per rank in 2 gloo processes, against the planner
and the paper (one spawn measures all four stages)."""

import functools
import socket

import pytest
from hypothesis import given
from hypothesis import strategies as st

from course_lib import cli
from course_lib.checkpointing.demo_models import tiny_decoder
from course_lib.memory import PlanError, offload_prediction, plan
from course_lib.memory.sharded import fsdp_fraction, zero1_shares
from course_lib.models import spec_from_model
from course_lib.sharding import STAGES, measure_sharding, run_ranks
from course_lib.sharding.engines import wrap

BUILD = functools.partial(tiny_decoder, "llama", n_layers=3, hidden=64, vocab=256)
BATCH, SEQ, N = 1, 16, 2


@pytest.fixture(scope="module")
def steps():
    return {(s.stage, s.rank): s for s in measure_sharding(BUILD, N, STAGES, batch=BATCH, seq=SEQ, timeout_s=240)}


@pytest.fixture(scope="module")
def spec():
    model = BUILD()
    return spec_from_model(model, "tiny-llama", model.config)


def test_each_stage_lowers_every_ranks_peak(steps):
    for rank in range(N):
        peaks = [steps[stage, rank].peak for stage in STAGES]
        assert peaks == sorted(peaks, reverse=True) and len(set(peaks)) == len(peaks), peaks


def test_model_states_are_partitioned_as_the_paper_says(steps, spec):
    params = spec.n_params * 4
    for rank in range(N):
        none, zero1, zero3 = steps["none", rank], steps["zero1", rank], steps["zero3", rank]
        assert none.parameters == none.gradients == params
        assert zero1.parameters == zero1.gradients == params and zero1.optimizer_state < 0.6 * none.optimizer_state
        assert zero3.parameters == zero3.gradients == params // N
        assert sum(steps["zero1", r].optimizer_state for r in range(N)) == none.optimizer_state


def test_bytes_sent_are_the_papers_2x_and_3x(steps, spec):
    psi = spec.n_params * 4 * (N - 1) / N          # one pass of the parameters through a ring
    for rank in range(N):
        assert steps["none", rank].sent_by_collective == {"all_reduce": 2 * psi}  # DDP: 2 x parameters
        assert steps["zero2", rank].bytes_sent == pytest.approx(2 * psi, rel=0.01)
        assert steps["zero3", rank].bytes_sent == pytest.approx(3 * psi, rel=0.01)  # 1.5 x DDP
        calls = steps["zero3", rank].calls
        assert calls["all_gather_single"] == 2 * calls["reduce_scatter_single"]  # forward and backward


def test_the_planner_predicts_each_ranks_peak_within_10_percent(steps, spec):
    for stage in STAGES:
        predicted = plan(spec, precision="fp32", optimizer="adamw", batch=BATCH, seq=SEQ, gpus=N, shard=stage)
        for rank in range(N):
            assert predicted.total == pytest.approx(steps[stage, rank].peak, rel=0.10), (stage, rank)


@pytest.mark.parametrize("stage, paper_gb", [("none", 120), ("zero1", 31.4), ("zero2", 16.6), ("zero3", 1.9)])
def test_the_papers_four_numbers(stage, paper_gb):
    p = plan(int(7.5e9), precision="mixed-bf16", optimizer="adamw", gpus=64, shard=stage)
    states = sum(p.bytes[c] for c in ("weights", "gradients", "optimizer_state", "master_weights"))
    psi, k, n = 7.5e9, 12, 64
    formula = {"none": (4 + k) * psi, "zero1": 4 * psi + k * psi / n, "zero2": 2 * psi + (2 + k) * psi / n,
               "zero3": (4 + k) * psi / n}[stage]
    assert states == pytest.approx(formula, abs=64)
    assert round(states / 1e9, 1) == pytest.approx(paper_gb, abs=0.05)  # the paper rounds 1.875 GB to 1.9


def test_what_makes_it_fit_offers_sharding_with_more_than_one_gpu():
    sharded = plan(int(7.5e9), precision="mixed-bf16", gpu="a100-80gb", gpus=8)
    assert [t.name for t in sharded.tricks] == ["shard across the 8 GPUs: zero1"] and sharded.tricks[0].fits_after
    single = plan(int(7.5e9), precision="mixed-bf16", gpu="a100-80gb")
    assert not any("shard" in t.name for t in single.tricks)


def test_what_makes_it_fit_offers_no_trick_the_planner_refuses_with_gpus():
    sharded = plan("llama-3.2-3b", precision="fp16", batch=1, seq=16384, gpus=2, shard="zero3", gpu="t4")
    assert sharded.tricks and not any(name in t.name for t in sharded.tricks
                                      for name in ("chunked loss", "in backward", "offloading", "QLoRA"))
    with pytest.raises(PlanError, match="chunked_loss with --gpus 2"):
        plan("llama-3.2-3b", precision="fp16", batch=1, seq=16384, gpus=2, shard="zero3", chunked_loss=1024)


@pytest.mark.parametrize("argv, message", [
    (["--gpus", "0"], "gpus must be a positive integer"),
    (["--gpus", "2", "--shard", "zero4"], "unknown shard stage 'zero4'"),
    (["--shard", "zero3"], "--shard zero3 needs --gpus N"),
])
def test_bad_sharding_input_is_one_line(capsys, argv, message):
    code = cli.main(["plan", "--params", "7e9", *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err


def test_plan_refuses_a_stage_without_gpus():
    with pytest.raises(PlanError, match="needs --gpus"):
        plan(7e9, shard="zero2")


def test_an_unknown_engine_is_refused_before_spawning():
    with pytest.raises(ValueError, match="unknown stage"):
        measure_sharding(BUILD, 2, ["zero9"])
    with pytest.raises(ValueError, match="unknown stage"):
        wrap(BUILD(), "zero9", 1)


def _slow(rank, world_size):
    import time
    time.sleep(60)


def test_ranks_that_overrun_are_killed():
    with pytest.raises(TimeoutError, match="did not finish"):
        run_ranks(_slow, 1, timeout_s=1)


def _rank_and_size(rank, world_size):
    return rank, world_size


def test_a_port_taken_before_the_ranks_start_is_retried_on_a_new_one(monkeypatch):
    from course_lib.sharding import launch

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    real, handed = launch.free_port, []

    def next_port():  # the taken port first, then free ones
        handed.append(real() if handed else taken.getsockname()[1])
        return handed[-1]

    monkeypatch.setattr(launch, "free_port", next_port)
    try:
        assert run_ranks(_rank_and_size, 2, timeout_s=60) == [(0, 2), (1, 2)]
    finally:
        taken.close()
    assert len(handed) == 2  # the taken port failed, and the ranks started again on a free one


def test_offload_moves_the_shards_and_nothing_else():
    p = plan(int(7.5e9), precision="mixed-bf16", gpus=64, shard="zero3")
    off = offload_prediction(p)
    assert off["gpu"] + off["cpu"] == p.total and off["cpu"] == pytest.approx(16 * 7.5e9 / 64, abs=64)
    assert off["pcie_per_step"] == pytest.approx(3 * 4 * 7.5e9 / 64, abs=64)  # two fp32 weight copies in, one out
    with pytest.raises(PlanError, match="zero3"):
        offload_prediction(plan(int(7.5e9), precision="mixed-bf16", gpus=64, shard="zero2"))


@given(st.lists(st.integers(1, 10**6), min_size=1, max_size=40), st.integers(1, 8))
def test_zero1_shares_are_torchs_sorted_greedy_partition(numels, n):
    shares = zero1_shares(numels, n)
    assert sum(shares) == sum(numels) and len(shares) == n
    assert max(shares) - min(shares) <= max(numels)  # greedy: no rank more than one tensor ahead


def test_fsdp_shards_are_padded_chunks_of_dim_0(spec):
    assert fsdp_fraction(spec, 1) == 1
    assert fsdp_fraction(spec, 2) == 0.5  # every dim 0 of the test model is even
    assert fsdp_fraction(spec, 3) > 1 / 3  # 64 rows in chunks of 22: rank 0 holds a padded chunk


CATEGORIES = ("weights", "gradients", "optimizer_state", "master_weights", "quantization", "activations",
              "sharding_buffers", "optimizer_temporaries", "overhead")


@pytest.mark.parametrize("stage", STAGES)
def test_categories_add_up_and_activations_do_not_depend_on_n(spec, stage):
    by_phase = []
    for n in (1, 2, 4, 8):
        p = plan(spec, precision="fp32", optimizer="adamw", batch=BATCH, seq=SEQ, gpus=n, shard=stage)
        assert sum(p.bytes[c] for c in CATEGORIES) == p.total, (stage, n)
        if stage in ("zero2", "zero3"):
            phases = dict(p.detail["activations_by_phase"])
            assert p.bytes["activations"] == phases[p.detail["peak_phase"]]
            phases.pop("layers backward")  # which layer peaks (the last or the first) may change with N
            by_phase.append(phases)
            assert p.bytes["gradients"] <= p.detail["gradient_shards"]
    assert all(phases == by_phase[0] for phases in by_phase)


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_an_8b_plan_names_its_peak_phase_and_its_categories_add_up(stage):
    options = dict(precision="mixed-bf16", batch=1, seq=1024, checkpointing="every-layer", gpu="a100-40gb",
                   suggest=False, shard=stage)
    p4, p8 = plan("llama-3.1-8b", gpus=4, **options), plan("llama-3.1-8b", gpus=8, **options)
    for p in (p4, p8):
        assert sum(p.bytes[c] for c in CATEGORIES) == p.total
        peaks = {"forward": p.detail["forward_peak"], "backward": p.detail["backward_peak"],
                 "optimizer step": p.detail["optimizer_step_peak"]}
        assert p.total == max(peaks.values()) + p.bytes["overhead"]
        if p.detail["peak_phase"] == "optimizer step":
            assert p.bytes["optimizer_temporaries"] > 0 and p.bytes["gradients"] == p.detail["gradient_shards"]
        else:
            assert p.bytes["optimizer_temporaries"] == 0
    if stage == "zero3":  # the step runs on the CPU under offload: the GPU keeps what N does not divide
        assert offload_prediction(p4)["gpu"] == offload_prediction(p8)["gpu"] < p8.total - p8.bytes["weights"]


def test_the_roots_unsharded_gradients_are_held_through_backward():
    small, large = (spec_from_model(m, "v", m.config) for m in
                    (tiny_decoder("llama", n_layers=2, hidden=64, vocab=v) for v in (256, 32000)))
    grows = []
    for s in (small, large):
        p = plan(s, precision="fp32", optimizer="adamw", batch=BATCH, seq=SEQ, gpus=4, shard="zero3")
        grows.append(p.bytes["sharding_buffers"])
    root_grads = 2 * (32000 - 256) * 64 * 4  # embeddings and output layer, fp32
    assert grows[1] - grows[0] >= root_grads  # gathered root weights and their unsharded gradients


def test_a_function_the_ranks_cannot_import_is_refused_in_one_line():
    with pytest.raises(ValueError, match="cannot send") as error:
        run_ranks(lambda rank, world_size: rank, 1)
    assert "\n" not in str(error.value)


def _fewest_from(start, model, setup, gpu, most=64, honour_most=True):
    from dataclasses import replace
    for n in range(start, (most if honour_most else 64) + 1):
        if plan(model, replace(setup, gpus=n), gpu=gpu, suggest=False).fits:
            return n
    return None


@pytest.mark.parametrize("answer, message", [
    (functools.partial(_fewest_from, 2), "start counting at 1"),
    (functools.partial(_fewest_from, 1, honour_most=False), "up to 2 makes it fit"),
])
def test_the_fewest_gpus_check_catches_a_loop_from_2_and_one_past_most(answer, message):
    from course_lib.checks import check_fewest_gpus
    check_fewest_gpus(functools.partial(_fewest_from, 1))
    with pytest.raises(AssertionError, match=message):
        check_fewest_gpus(answer)
