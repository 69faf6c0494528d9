"""Lesson 6: ZeRO's stages on real engines, measured per rank in 2 gloo processes, against the planner
and the paper (one spawn measures all four stages)."""

import functools
import re
import socket

import pytest
import torch

from course_lib import cli
from course_lib.checkpointing.demo_models import tiny_decoder
from course_lib.models import spec_from_model
from course_lib.planner import PlanError, offload_prediction, plan
from course_lib.planner.parallel.fsdp import fsdp_fraction
from course_lib.planner.parallel.sharded import zero1_partition
from course_lib.sharding import STAGES, FSDPOptions, measure_sharding, run_ranks
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


def bounds(predicted: int, step) -> bool:
    """The plan is an upper bound of what FSDP2's schedule lets be alive (lesson 6, "the spread"): not below
    the lower of the step's two measured repeats by more than 2%. Each caller compares the higher one within
    10% (`pytest.approx(step.peak, rel=0.10)`):
    on a machine loaded by the suite's other workers a repeat can run higher, as when gloo's delayed worker
    thread holds the root's flat all-gather buffer into the output layer's backward (the thread's timing,
    not FSDP2's schedule); once in CI the 32000-vocabulary Llama's higher repeat was 6.7% above the plan."""
    return predicted >= 0.98 * min(step.repeat_peaks)


def test_model_states_are_partitioned_as_the_paper_says(steps, spec):
    params = spec.n_params * 4
    for rank in range(N):
        none, zero1, zero3 = steps["none", rank], steps["zero1", rank], steps["zero3", rank]
        assert none.parameters == none.gradients == params
        assert zero1.parameters == zero1.gradients == params and zero1.optimizer_state < 0.6 * none.optimizer_state
        assert zero3.parameters == zero3.gradients == params // N
        assert sum(steps["zero1", r].optimizer_state for r in range(N)) == none.optimizer_state


def test_gradient_shards_held_across_accumulation_are_planned(spec):
    """With 4 micro-batches each reduce-scattered, every gradient shard lives from the first
    micro-batch's backward to the step (measured on gloo, 2 ranks)."""
    measured = measure_sharding(BUILD, N, ("zero2", "zero3"), batch=BATCH, seq=SEQ, micro_batches=4, timeout_s=240)
    for step in measured:
        predicted = plan(
            spec, precision="fp32", optimizer="adamw", batch=BATCH, seq=SEQ, gpus=N, shard=step.stage, accum=4
        )
        assert predicted.total == pytest.approx(step.peak, rel=0.10), (step.stage, step.rank)
        assert bounds(predicted.total, step), (step.stage, step.rank)
        single = plan(spec, precision="fp32", optimizer="adamw", batch=BATCH, seq=SEQ, gpus=N, shard=step.stage)
        assert predicted.total > single.total


def test_bytes_sent_are_the_papers_2x_and_3x(steps, spec):
    psi = spec.n_params * 4 * (N - 1) / N  # one pass of the parameters through a ring
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
    formula = {
        "none": (4 + k) * psi,
        "zero1": 4 * psi + k * psi / n,
        "zero2": 2 * psi + (2 + k) * psi / n,
        "zero3": (4 + k) * psi / n,
    }[stage]
    assert states == pytest.approx(formula, abs=64)
    assert round(states / 1e9, 1) == pytest.approx(paper_gb, abs=0.05)  # the paper rounds 1.875 GB to 1.9


def test_what_makes_it_fit_offers_sharding_with_more_than_one_gpu():
    sharded = plan(int(7.5e9), precision="mixed-bf16", gpu="a100-80gb", gpus=8)
    assert [t.name for t in sharded.tricks] == ["shard across the 8 GPUs: zero1"] and sharded.tricks[0].fits_after
    single = plan(int(7.5e9), precision="mixed-bf16", gpu="a100-80gb")
    assert not any("shard" in t.name for t in single.tricks)


def test_what_makes_it_fit_offers_no_trick_the_planner_refuses_with_gpus():
    sharded = plan("llama-3.2-3b", precision="fp16", batch=1, seq=16384, gpus=2, shard="zero3", gpu="t4")
    assert sharded.tricks and not any(
        name in t.name for t in sharded.tricks for name in ("chunked loss", "in backward", "offloading", "QLoRA")
    )
    with pytest.raises(PlanError, match="chunked_loss with --gpus 2"):
        plan("llama-3.2-3b", precision="fp16", batch=1, seq=16384, gpus=2, shard="zero3", chunked_loss=1024)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--gpus", "0"], "--gpus: must be a whole number >= 1, got 0"),
        (
            ["--gpus", "2", "--shard", "zero4"],
            "--shard: invalid choice 'zero4' (choose from none, zero1, zero2, zero3)",
        ),
        (["--shard", "zero3"], "--shard zero3 needs --gpus N"),
    ],
)
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


def _offload_traffic(rank, world_size, fsdp):
    """One FSDP2 zero3 step under CPUOffloadPolicy (gloo, CPU), as the real engine copies its shards: the
    bytes of the fp32 weight shard each time FSDPParam.all_gather_inputs copies it to the device, of each
    gradient shard foreach_reduce copies back to the host, and what stays in host memory after the step."""
    import math

    from torch.distributed.fsdp import CPUOffloadPolicy
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

    from course_lib.measure import optimizer_state_tensors, storage_bytes

    moved = {"to_device": 0, "to_host": 0}
    gather_inputs, reduce = _fsdp_param.FSDPParam.all_gather_inputs.fget, _fsdp_param_group.foreach_reduce

    def counted_gather_inputs(param):  # on a GPU: sharded_param_data.to(device) when offload_to_cpu
        if param.offload_to_cpu and param.sharded_state == _fsdp_param.ShardedState.SHARDED:
            moved["to_device"] += param._sharded_param_data.untyped_storage().nbytes()
        return gather_inputs(param)

    def counted_reduce(fsdp_params, unsharded_grads, *args, **kwargs):  # on a GPU: new_sharded_grad.to("cpu")
        moved["to_host"] += sum(
            math.prod(p.sharded_size) * g.element_size()
            for p, g in zip(fsdp_params, unsharded_grads)
            if p.offload_to_cpu
        )
        return reduce(fsdp_params, unsharded_grads, *args, **kwargs)

    _fsdp_param.FSDPParam.all_gather_inputs = property(counted_gather_inputs)  # this rank's process only
    _fsdp_param_group.foreach_reduce = counted_reduce
    torch.manual_seed(0)
    model, optimizer = wrap(BUILD(), "zero3", world_size, offload_policy=CPUOffloadPolicy(pin_memory=False), fsdp=fsdp)
    ids = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(rank))
    for _step in range(2):  # the second step is measured: the first one also initialises the engine
        moved.update(to_device=0, to_host=0)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
    held = [*model.parameters(), *(p.grad for p in model.parameters()), *optimizer_state_tensors(optimizer)]
    return {**moved, "host": storage_bytes(getattr(t, "to_local", lambda: t)() for t in held)}  # DTensors: the shards


@pytest.mark.parametrize(
    "fsdp, options",
    [(FSDPOptions(), {}), (FSDPOptions(reshard_root=False), dict(fsdp_reshard_root=False))],
    ids=["default", "root kept gathered"],
)
def test_offload_moves_what_fsdp2s_cpu_offload_copies(spec, fsdp, options):
    p = plan(spec, precision="fp32", optimizer="adamw", batch=BATCH, seq=SEQ, gpus=N, shard="zero3", **options)
    off = offload_prediction(p)
    assert off["gpu"] < p.total
    for rank, engine in enumerate(run_ranks(_offload_traffic, N, fsdp, timeout_s=240)):
        assert off["cpu"] == pytest.approx(engine["host"], rel=0.02), rank
        assert off["pcie_per_step"] == pytest.approx(engine["to_device"] + engine["to_host"], rel=0.02), (rank, engine)
    with pytest.raises(PlanError, match="zero3"):
        offload_prediction(plan(int(7.5e9), precision="mixed-bf16", gpus=64, shard="zero2"))


def _torchs_zero1_partition(rank, world_size):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = BUILD()
    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW)
    return [
        sorted(tuple(p.shape) for group in groups for p in group["params"])
        for groups in optimizer._partition_parameters()
    ]


def test_zero1_partition_is_the_one_torchs_zero_redundancy_optimizer_makes(spec):
    for n in (2, 3):
        torchs = run_ranks(_torchs_zero1_partition, n, timeout_s=120)[0]
        ours = [sorted(part) for part in zero1_partition([info.shape for info in spec.params], n)]
        assert ours == torchs, n


def test_zero1_steps_a_local_adamw_so_its_temporaries_are_the_partitions():
    """ZeroRedundancyOptimizer's local foreach AdamW makes sqrt(v) for its partition only: the 8B zero1
    plan on 8 x A100-80GB fits, and "what makes it fit" needs only zero1 there."""
    options = dict(precision="mixed-bf16", batch=1, seq=1024, checkpointing="every-layer", gpus=8)
    zero1 = plan("llama-3.1-8b", gpu="a100-80gb", shard="zero1", suggest=False, **options)
    largest = 128256 * 4096 * 4  # the mixed step's fp32 copy of the largest gradient, the embedding's
    assert zero1.detail["zero1_step_temporaries"] <= zero1.bytes["optimizer_state"] / 2 + largest
    assert zero1.bytes["optimizer_temporaries"] <= zero1.detail["zero1_step_temporaries"]
    assert zero1.fits
    ddp = plan("llama-3.1-8b", gpu="a100-80gb", **options)
    assert [t.name for t in ddp.tricks] == ["shard across the 8 GPUs: zero1"]


def _fsdp_local_numel(rank, world_size):
    from course_lib.sharding.engines import wrap

    model, _ = wrap(BUILD(), "zero3", world_size)
    return sum(p.to_local().untyped_storage().nbytes() // 4 for p in model.parameters())


def test_fsdp_shards_are_the_padded_chunks_fully_shard_allocates(spec):
    assert fsdp_fraction(spec, 1) == 1
    for n in (2, 3):  # 3: 64 rows in chunks of 22, rank 0 holds a padded chunk
        assert fsdp_fraction(spec, n) * spec.n_params == run_ranks(_fsdp_local_numel, n, timeout_s=120)[0], n


CATEGORIES = (
    "weights",
    "gradients",
    "optimizer_state",
    "master_weights",
    "quantization",
    "activations",
    "sharding_buffers",
    "optimizer_temporaries",
    "overhead",
)


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
    options = dict(
        precision="mixed-bf16",
        batch=1,
        seq=1024,
        checkpointing="every-layer",
        gpu="a100-40gb",
        suggest=False,
        shard=stage,
    )
    p4, p8 = plan("llama-3.1-8b", gpus=4, **options), plan("llama-3.1-8b", gpus=8, **options)
    for p in (p4, p8):
        assert sum(p.bytes[c] for c in CATEGORIES) == p.total
        peaks = {
            "forward": p.detail["forward_peak"],
            "backward": p.detail["backward_peak"],
            "optimizer step": p.detail["optimizer_step_peak"],
        }
        assert p.total == max(peaks.values()) + p.bytes["overhead"]
        if p.detail["peak_phase"] == "optimizer step":
            assert p.bytes["optimizer_temporaries"] > 0 and p.bytes["gradients"] == p.detail["gradient_shards"]
        else:
            assert p.bytes["optimizer_temporaries"] == 0
    if stage == "zero3":  # the step runs on the CPU under offload: the GPU keeps what N does not divide
        assert offload_prediction(p4)["gpu"] == offload_prediction(p8)["gpu"] < p8.total - p8.bytes["weights"]


LARGE_VOCAB = functools.partial(tiny_decoder, "llama", n_layers=2, hidden=64, vocab=32000)
CONFIGURATIONS = {  # FSDP2 as people configure it: (wrapping, param_dtype, reduce_dtype, reshard_root), planner options
    "blocks": (FSDPOptions(), dict(precision="fp32")),
    "torchtitan": (FSDPOptions(wrapping="torchtitan"), dict(precision="fp32", fsdp_wrapping="torchtitan")),
    "bf16": (FSDPOptions(param_dtype=torch.bfloat16), dict(precision="mixed-bf16")),
    "bf16, fp32 reduce": (
        FSDPOptions(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        dict(precision="mixed-bf16", fsdp_reduce_dtype="fp32"),
    ),
    "root kept gathered": (FSDPOptions(reshard_root=False), dict(precision="fp32", fsdp_reshard_root=False)),
}


@pytest.fixture(scope="module")
def configured():
    model = LARGE_VOCAB()
    spec = spec_from_model(model, "tiny llama, 32k vocabulary", model.config)
    return spec, {
        name: {
            s.rank: s
            for s in measure_sharding(LARGE_VOCAB, N, ("zero3",), batch=BATCH, seq=SEQ, fsdp=fsdp, timeout_s=240)
        }
        for name, (fsdp, _) in CONFIGURATIONS.items()
    }


@pytest.mark.parametrize("name", CONFIGURATIONS)
def test_each_fsdp2_configuration_is_planned_within_10_percent_of_its_highest_peak(configured, name):
    spec, measured = configured
    predicted = plan(spec, optimizer="adamw", batch=BATCH, seq=SEQ, gpus=N, shard="zero3", **CONFIGURATIONS[name][1])
    for rank, step in measured[name].items():
        assert predicted.total == pytest.approx(step.peak, rel=0.10), (name, rank)
        assert bounds(predicted.total, step), (name, rank)


def test_torchtitans_wrapping_lowers_the_peak_and_sends_no_more(configured):
    spec, measured = configured
    for rank in range(N):
        blocks, titan = measured["blocks"][rank], measured["torchtitan"][rank]
        assert titan.peak < 0.9 * blocks.peak and titan.bytes_sent <= blocks.bytes_sent
    planned = [
        plan(spec, precision="fp32", batch=BATCH, seq=SEQ, gpus=N, shard="zero3", fsdp_wrapping=w).total
        for w in ("blocks", "torchtitan")
    ]
    assert planned[1] < 0.9 * planned[0]


def test_a_root_kept_gathered_sends_less_than_3p(configured):
    spec, measured = configured
    psi = spec.n_params * 4 * (N - 1) / N
    for rank in range(N):
        assert measured["blocks"][rank].bytes_sent == pytest.approx(3 * psi, rel=0.01)
        assert measured["root kept gathered"][rank].bytes_sent < 2.9 * psi  # the root is gathered once


def test_mixed_precision_keeps_fp32_shards_and_no_16bit_copy(configured):
    spec, measured = configured
    for rank in range(N):
        step = measured["bf16"][rank]
        assert step.parameters == measured["blocks"][rank].parameters == spec.n_params * 4 // N
    p = plan(spec, precision="mixed-bf16", batch=BATCH, seq=SEQ, gpus=N, shard="zero3")
    assert p.bytes["master_weights"] == 0 and p.bytes["weights"] == spec.n_params * 4 // N


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


@pytest.mark.parametrize(
    "answer, message",
    [
        (functools.partial(_fewest_from, 2), "start counting at 1"),
        (functools.partial(_fewest_from, 1, honour_most=False), "up to 2 makes it fit"),
    ],
)
def test_the_fewest_gpus_check_catches_a_loop_from_2_and_one_past_most(answer, message):
    from course_lib.checks import check_fewest_gpus

    check_fewest_gpus(functools.partial(_fewest_from, 1))
    with pytest.raises(AssertionError, match=message):
        check_fewest_gpus(answer)


def _states_by_kind(divide_weights_in_zero2=False, zero1_k=12, whole_weights_in_zero3=False):
    def answer(n_params, gpus, stage):
        divided = {
            "none": (),
            "zero1": ("optimizer_states",),
            "zero2": ("optimizer_states", "gradients"),
            "zero3": ("optimizer_states", "gradients", "weights"),
        }[stage]
        if divide_weights_in_zero2 and stage == "zero2":  # wrong: the weights' partition, same total
            divided = ("optimizer_states", "weights")
        if whole_weights_in_zero3 and stage == "zero3":  # wrong: zero3 as zero2, only the weights differ
            divided = ("optimizer_states", "gradients")
        k = zero1_k if stage == "zero1" else 12
        per_param = {"weights": 2, "gradients": 2, "optimizer_states": k}
        out = {kind: b * n_params / (gpus if kind in divided else 1) for kind, b in per_param.items()}
        if k != 12:  # wrong: the master weights left whole
            out["optimizer_states"] += (12 - k) * n_params
        return out

    return answer


def _never(context=True, zero1_whole=4):
    def answer(n_params, stage, gpu):
        from course_lib.planner import CUDA_CONTEXT_BYTES, get_gpu

        undivided = {"none": 16, "zero1": zero1_whole, "zero2": 2, "zero3": 0}[stage] * n_params
        return undivided + CUDA_CONTEXT_BYTES * context > get_gpu(gpu).memory_bytes

    return answer


def _sent(zero1_passes=3, ring=True):
    def answer(param_bytes, world_size, stage):
        p = param_bytes * ((world_size - 1) / world_size if ring else 1)
        return {"none": 2, "zero1": zero1_passes, "zero2": 2, "zero3": 3}[stage] * p

    return answer


@pytest.mark.parametrize(
    "check, right, wrongs",
    [
        (
            "check_model_states_per_gpu",
            _states_by_kind(),
            [
                (_states_by_kind(divide_weights_in_zero2=True), "partitions the gradients, not the weights"),
                (_states_by_kind(zero1_k=8), "include the fp32 master"),
                (_states_by_kind(whole_weights_in_zero3=True), "weights expected"),
            ],
        ),
        ("check_never_fits", _never(), [(_never(context=False), "CUDA context"), (_never(zero1_whole=2), "zero1")]),
        ("check_bytes_sent", _sent(), [(_sent(zero1_passes=2), "not the paper's 2"), (_sent(ring=False), "(N-1)/N")]),
    ],
)
def test_lesson_6_checks_pass_the_answer_and_fail_plausible_wrong_ones(check, right, wrongs):
    from course_lib import checks

    getattr(checks, check)(right)
    for wrong, message in wrongs:
        with pytest.raises(AssertionError, match=re.escape(message)):
            getattr(checks, check)(wrong)


# GPT-2 as benchmarks/sharding_accuracy.py builds it: tied embeddings (the root's), position embeddings
# (4096 x 96) outside the layers; its batch
GPT2 = functools.partial(tiny_decoder, "gpt2", n_layers=6, hidden=96, vocab=1024)
GPT2_BATCH, GPT2_SEQ = 2, 64


@pytest.fixture(scope="module")
def gpt2_steps():
    model = GPT2()
    spec = spec_from_model(model, "tiny gpt2", model.config)
    layer_bytes = sum(p.numel() * p.element_size() for p in model.transformer.h[0].parameters())
    wrappings = {"blocks": FSDPOptions(), "torchtitan": FSDPOptions(wrapping="torchtitan")}
    return (
        spec,
        layer_bytes,
        {
            w: measure_sharding(GPT2, N, ("zero2", "zero3"), batch=GPT2_BATCH, seq=GPT2_SEQ, fsdp=fsdp, timeout_s=240)
            for w, fsdp in wrappings.items()
        },
    )


def test_zero3_plans_the_prefetched_layer_beside_the_roots_all_gather(gpt2_steps):
    """The root's pre_backward prefetches the last layer while gloo can still hold the root's flat
    all-gather buffer: the high runs hold one layer's all-gather more than the low ones (lesson 6)."""
    spec, layer_bytes, measured = gpt2_steps
    predicted = plan(spec, precision="fp32", optimizer="adamw", batch=GPT2_BATCH, seq=GPT2_SEQ, gpus=N, shard="zero3")
    for step in measured["blocks"]:
        if step.stage == "zero3":
            assert predicted.total >= min(step.repeat_peaks) + layer_bytes, step.rank


def test_torchtitans_head_group_plans_no_gradient_of_the_position_embeddings_at_the_head(gpt2_steps):
    """GPT-2's position embeddings sit in torchtitan's [norm, output] group, but their gradient comes at
    the tail: the head's backward does not hold it (measured on gloo)."""
    spec, _, measured = gpt2_steps
    for step in measured["torchtitan"]:
        predicted = plan(
            spec,
            precision="fp32",
            optimizer="adamw",
            batch=GPT2_BATCH,
            seq=GPT2_SEQ,
            gpus=N,
            shard=step.stage,
            fsdp_wrapping="torchtitan",
        )
        assert bounds(predicted.total, step) and predicted.total <= 1.06 * step.peak, (step.stage, step.rank)
