"""The planner's reserved memory and OOM line (course_lib.planner.allocator.reserved): the traced step's allocation
stream, the reserve beyond the allocated bytes, the cuBLAS workspaces, the verdict against what CUDA
reports as the card's memory, and what `course-lib plan` prints and `--json` carries."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from course_lib import cli, planner
from course_lib.caching_allocator import MiB, replay, stream_slack
from course_lib.measure import GiB, LiveStorageTracker
from course_lib.models import model_spec
from course_lib.planner.allocator.reserved import CUBLAS_WORKSPACE, CUBLAS_WORKSPACE_SM90, cublas_workspaces
from course_lib.planner.trace.deep_stream import live_peak
from course_lib.planner.trace.step import trace_in_full
from course_lib.planner.trace.tracer import AllocationStream


class _Recorder(AllocationStream, LiveStorageTracker):
    pass


def test_the_stream_records_every_allocation_and_its_free():
    with _Recorder() as tracer:
        a = torch.empty(3 * MiB, dtype=torch.uint8)
        b = torch.empty(5 * MiB, dtype=torch.uint8)
        del a
        c = torch.empty(1000, dtype=torch.uint8)
        del b
    assert tracer.stream == [3 * MiB, 5 * MiB, ~0, 1000, ~1]
    del c


def test_a_stream_replayed_peaks_at_the_trackers_peak_rounded():
    spec = model_spec("gpt2")
    setup = planner.Setup(precision="amp-fp16", seq=128).validate()
    trace = trace_in_full(spec, setup, "cuda")
    stream, peak = list(trace.stream), live_peak(list(trace.stream))
    stats = replay(stream)
    frees = sum(1 for entry in stream if entry < 0)
    assert frees > 100  # the step frees what it made: a stream without frees would climb far above the peak
    assert peak == max(
        trace.forward_peak, trace.head_backward_peak, trace.layer_backward_peak, trace.tail_backward_peak
    )
    assert peak <= stats.peak_allocated <= peak * 1.02 + MiB
    assert trace.allocator_slack == stream_slack(stream, peak) >= 0
    assert trace.allocator_slack_emptied == stream_slack(stream, peak, empty_cache=True) >= 0


def test_the_workspaces_are_larger_on_compute_capability_9_0():
    assert CUBLAS_WORKSPACE == 8 * MiB + 128 * 1024 and CUBLAS_WORKSPACE_SM90 == 32 * MiB
    t4, h100 = planner.get_gpu("t4"), planner.get_gpu("h100")
    assert sum(cublas_workspaces(h100)) > sum(cublas_workspaces(t4)) > 2 * CUBLAS_WORKSPACE


@pytest.mark.parametrize(
    "name, options",
    [
        ("gpt2", dict(precision="amp-fp16")),
        ("llama-3.2-1b", dict(precision="bf16", lora_rank=16, checkpointing="every-layer")),
        ("llama-3.2-1b", dict(precision="mixed-bf16", optimizer="paged_adamw8bit", batch=2, seq=256)),
    ],
)
def test_reserved_covers_allocated_and_the_workspaces(name, options):
    plan = planner.plan(name, planner.Setup(**options), gpu="h100", suggest=False)
    line = plan.oom_line
    allocated = plan.total - plan.bytes["overhead"]
    assert line.allocated == allocated
    managed = plan.bytes["optimizer_state"] if options.get("optimizer", "").startswith("paged") else 0
    assert plan.reserved >= allocated - managed + line.workspaces
    assert line.nvidia_smi == plan.reserved + plan.bytes["overhead"] + managed
    assert plan.to_dict()["reserved"]["reserved_bytes"] == plan.reserved


def test_without_a_gpu_there_is_no_reserved_prediction():
    plan = planner.plan("gpt2", planner.Setup(), suggest=False)
    assert plan.reserved is None and plan.to_dict()["reserved"] is None and "reserved" not in str(plan)


def test_the_verdict_is_against_cudas_capacity_not_nvidia_smis():
    t4 = planner.get_gpu("t4")
    assert t4.cuda_memory_bytes < t4.memory_bytes
    plan = planner.plan("gpt2", planner.Setup(precision="amp-fp16"), gpu="t4", suggest=False)
    used, held = plan.oom_line.nvidia_smi, plan.oom_line.held + plan.oom_line.context
    # nvidia-smi's total would hold the step; CUDA's does not hold even its allocations
    between = replace(t4, name="between", memory_bytes=used + 64 * MiB, cuda_memory_bytes=held - MiB)
    tight = planner.plan("gpt2", planner.Setup(precision="amp-fp16"), gpu=between, suggest=False)
    assert not tight.fits and not tight.oom_line.retries
    roomy = replace(between, cuda_memory_bytes=used + 32 * MiB)
    line = planner.plan("gpt2", planner.Setup(precision="amp-fp16"), gpu=roomy, suggest=False).oom_line
    assert line.fits and not line.retries
    assert "(CUDA's 14.74 GiB)" in plan.verdict()
    unsourced = planner.plan("gpt2", planner.Setup(precision="amp-fp16"), gpu="a6000", suggest=False)
    assert "(nvidia-smi's 47.99 GiB)" in unsourced.verdict()
    a100 = planner.plan("gpt2", planner.Setup(precision="amp-fp16"), gpu="a100-80gb", suggest=False)
    assert "(CUDA's 79.25 GiB)" in a100.verdict()  # about 1% below nvidia-smi's 80.00 GiB


def test_a_step_after_empty_cache_finds_only_what_lives_on():
    # the first step leaves nothing alive: after empty_cache the second starts from an empty cache, as the first
    step = [40 * MiB, ~0, 20 * MiB, 20 * MiB, 30 * MiB, ~3, ~1, ~2]
    alone = replay(step).peak_reserved - live_peak(step)
    assert stream_slack(step, live_peak(step), empty_cache=True) == alone
    # kept, the second step cuts its first 20 MiB from the 30 MiB segment, and its 30 MiB needs a new one
    assert stream_slack(step, live_peak(step)) == alone + 30 * MiB


@pytest.mark.parametrize("checkpointing", ["none", "every-layer"])
def test_emptying_the_cache_each_step_changes_the_reserve_only(checkpointing):
    # peft's MetaMathQA run.py: torch.cuda.empty_cache() after every step (Llama-3.2-3B, LoRA r32 on q and v)
    setup = planner.Setup(
        precision="bf16",
        lora_rank=32,
        lora_targets=("q_proj", "v_proj"),
        batch=4,
        seq=768,
        loop="keep-outputs",
        checkpointing=checkpointing,
    )
    kept, emptied = (
        planner.plan("llama-3.2-3b", replace(setup, empty_cache_each_step=flag), gpu="l40s", suggest=False)
        for flag in (False, True)
    )
    # only the reserve changes, and never up: the kept cache can hold the second step (every layer checkpointed:
    # the deep model's first step leaves blocks the second fits in)
    assert kept.bytes == emptied.bytes and emptied.reserved <= kept.reserved
    assert emptied.reserved >= emptied.oom_line.allocated + emptied.oom_line.workspaces
    if checkpointing == "none":  # kept, the second step's blocks fragment the first's cache: 1.6 GiB more
        assert kept.reserved - emptied.reserved > GiB


def test_the_cli_prints_allocated_and_reserved_with_a_gpu_and_json_carries_both(capsys):
    assert cli.main(["plan", "gpt2", "--gpu", "t4", "--precision", "amp-fp16"]) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if "reserved" in line)
    assert "allocated" in line and "nvidia-smi" in line and len(line) <= 110
    assert cli.main(["plan", "gpt2", "--gpu", "t4", "--precision", "amp-fp16", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["reserved"]["reserved_bytes"] >= data["reserved"]["allocated_bytes"] > 0
    assert data["reserved"]["cuda_capacity_bytes"] == planner.get_gpu("t4").cuda_memory_bytes
    assert cli.main(["plan", "gpt2", "--precision", "amp-fp16"]) == 0
    assert "reserved" not in capsys.readouterr().out


def _measured_slack(spec, setup, plan=None) -> int:
    """The slack (`stream_slack`) of one real CPU step of the model, its allocations recorded tensor by
    tensor as the planner's trace records them (parameters and the batch left out), under a checkpoint
    `plan` applied by lesson 3's apply_plan, as the planner applies it."""
    from course_lib.checkpointing import apply_plan
    from course_lib.models import build_model, transformers_config
    from course_lib.planner.trace.tracer import MetaTracer

    torch.manual_seed(0)
    model = build_model(transformers_config(spec.config), "cpu", dtype=torch.float32)
    model.train()
    if plan is not None:
        apply_plan(model, plan)
    ids = torch.randint(0, spec.config.vocab_size, (setup.batch, setup.seq))
    tracer = MetaTracer()
    for tensor in [ids, *model.parameters(), *model.buffers()]:
        tracer.exclude(tensor)
    with tracer:
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        del loss
    return stream_slack(tracer.stream, tracer.peak)


def _checkpointed_slack(spec, setup, target: str) -> int:
    """The checkpointed step's slack from its stream, past the disk cache of slacks."""
    from course_lib.planner.trace.checkpointed import checkpointed_stream

    return stream_slack(*checkpointed_stream(spec, setup, target))


def test_the_checkpointed_steps_slack_is_the_real_checkpointed_steps(tmp_path):
    """`StepTrace.checkpointed_slack` replays the checkpointed step's own allocations: the meta-device trace gives the
    slack the same step's stream gives on this CPU, byte for byte, and it is not the plain step's (a Llama
    256 wide: its MLP and logits blocks come from the allocator's large pool)."""
    from course_lib.qlora import tiny_llama_config

    tiny_llama_config(vocab=1024).to_json_file(tmp_path / "config.json")
    spec = model_spec(str(tmp_path / "config.json"))
    setup = planner.Setup(precision="fp32", batch=4, seq=256, checkpointing="every-layer").validate()
    checkpointed = _measured_slack(spec, setup, "every-layer")
    assert _checkpointed_slack(spec, setup, "cpu") == checkpointed
    assert abs(_measured_slack(spec, setup) - checkpointed) > MiB  # the plan changes the stream


def test_under_checkpointing_the_reserve_is_the_checkpointed_steps():
    """On a GPU a checkpointing plan's reserve holds the checkpointed step's slack, not the plain step's scaled
    down with the activations: the deep model's checkpointed stream (Llama-2-7B QLoRA at 4 x 2048, every layer
    checkpointed) replayed twice, which the plan's reserve holds beyond its allocations."""
    from course_lib.planner.trace.checkpointed import checkpointed_stream
    from course_lib.planner.trace.step_trace import trace_request

    spec = model_spec("llama-2-7b")
    setup = planner.Setup(
        precision="bf16", lora_rank=64, quant="nf4", batch=4, seq=2048, checkpointing="every-layer"
    ).validate()
    stream, peak = checkpointed_stream(spec, setup)
    slack = trace_request(spec, setup, "cuda").checkpointed_slack()
    assert slack == stream_slack(stream, peak) > 256 * MiB and peak == live_peak(stream)
    on_gpu = planner.plan(spec, setup, gpu="rtx3090", suggest=False).oom_line
    assert on_gpu.reserved - on_gpu.allocated >= slack  # the plain step's scaled down with the activations: 0.12 GiB
