"""What FSDP1's wrap of a model on the CPU leaves cached before the first step (course_lib.planner.parallel.fsdp_wrap),
what that does to the planned reserve, and the OOM line at the card's limit (course_lib.planner.allocator.limit)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from course_lib import cli, planner
from course_lib.caching_allocator import EMPTY_CACHE, MiB, concatenated, replay
from course_lib.measure import GiB
from course_lib.models import model_spec
from course_lib.planner.config.errors import PlanError
from course_lib.planner.parallel import fsdp_wrap
from course_lib.planner.states.model_states import nf4_bytes

TARGETS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "down_proj")
# Answer.AI's fsdp_qlora template (benchmarks_03_2024.md), 2 GPUs, FSDP1 full shard
ANSWER_AI = planner.Setup(
    precision="bf16",
    lora_rank=64,
    lora_targets=TARGETS,
    lora_dropout=0.1,
    quant="nf4-dq",
    autocast_adapter_dtype=False,
    batch=1,
    seq=512,
    checkpointing="every-layer",
    loop="outputs-until-step",
    legacy_causal_lm_loss=True,
    gpus=2,
    shard="zero3",
    fsdp_version=1,
    fsdp_backward_prefetch=True,
    fsdp_wrap_from="cpu-broadcast",
)


def test_the_units_are_the_adapters_then_each_layer_then_the_root():
    spec, setup = model_spec("llama-2-7b"), ANSWER_AI.validate()
    units = fsdp_wrap.wrap_units(spec, setup)
    per_layer = 2 * len(TARGETS) + 1
    assert len(units) == spec.n_layers * per_layer + 1
    # q_proj's adapters in the base's bf16 (peft before 0.11), A (r x in) then B (out x r)
    assert units[0] == [64 * 4096 * 2] and units[1] == [4096 * 64 * 2]
    layer = [info for info in spec.params if info.layer == 0]
    assert units[per_layer - 1] == [nf4_bytes(i.numel, True)[0] if i.module == "linear" else 2 * i.numel for i in layer]
    assert units[-1] == [2 * i.numel for i in spec.params if i.layer is None]  # embeddings, norm, lm_head in bf16


def test_the_quant_state_tensors_are_nf4s_metadata():
    spec, setup = model_spec("llama-2-7b"), ANSWER_AI.validate()
    quantized = [i for i in spec.params if i.module == "linear" and not i.is_lm_head and i.name.endswith(".weight")]
    assert sum(fsdp_wrap.quant_state_sizes(spec, setup)) == sum(nf4_bytes(i.numel, True)[1] for i in quantized)
    assert fsdp_wrap.quant_state_sizes(spec, replace(setup, quant="none", lora_rank=64)) == []


def test_buckets_close_once_they_hold_250_mib():
    assert fsdp_wrap._buckets([100 * MiB, 100 * MiB, 100 * MiB, 10 * MiB]) == [[0, 1, 2], [3]]
    assert fsdp_wrap._buckets([250 * MiB, MiB, 250 * MiB]) == [[0], [1, 2]]


@pytest.mark.parametrize("wrap_from, shard", [("cpu", "zero3"), ("cpu-broadcast", "zero3"), ("cpu-broadcast", "none")])
def test_the_wrap_keeps_the_shards_and_caches_the_rest(wrap_from, shard):
    """Replayed, the wrap's stream leaves allocated exactly what it keeps: rank 0's chunk of every flat
    parameter (the whole flat parameter under NO_SHARD) and the quant_state; the rest stays reserved."""
    spec = model_spec("llama-2-7b")
    setup = replace(
        ANSWER_AI,
        fsdp_wrap_from=wrap_from,
        shard=shard,
        fsdp_version=1 if shard != "none" else 2,
        fsdp_backward_prefetch=shard != "none",
    ).validate()
    stream, kept = fsdp_wrap.wrap_stream(spec, setup)
    made = [entry for entry in stream if entry >= 0]
    freed = {~entry for entry in stream if entry < 0}
    assert sorted(made[i] for i in range(len(made)) if i not in freed) == sorted(kept)
    stats = replay(stream)
    assert stats.allocated >= sum(kept)  # a block's unsplit remainder (1 MiB or less) counts as allocated
    units = fsdp_wrap.wrap_units(spec, setup)
    quant = sum(fsdp_wrap.quant_state_sizes(spec, setup))
    whole = sum(map(sum, units))
    if shard == "none":
        assert sum(kept) - quant == whole
    else:
        assert sum(kept) - quant == sum(-(-sum(unit) // 4) * 2 for unit in units)  # ceil(numel / 2) bf16 elements
    assert stats.reserved - stats.allocated > 256 * MiB  # the root's 250 MiB embeddings and lm_head, cached


def test_the_broadcast_caches_more_than_the_move_alone():
    spec = model_spec("llama-2-7b")
    moved, broadcast = (
        replay(fsdp_wrap.wrap_stream(spec, replace(ANSWER_AI, fsdp_wrap_from=how).validate())[0])
        for how in ("cpu", "cpu-broadcast")
    )
    assert moved.allocated == broadcast.allocated and broadcast.reserved > moved.reserved


def test_the_residue_counts_only_what_the_steps_do_not_reuse():
    wrap = [100 * MiB, ~0]  # the wrap leaves one 100 MiB block cached
    assert fsdp_wrap.residue_extra(wrap, [], [40 * MiB, ~0], []) == 100 * MiB - 40 * MiB  # cut from it
    assert fsdp_wrap.residue_extra(wrap, [], [150 * MiB, ~0], []) == 100 * MiB  # too small: kept beside
    assert fsdp_wrap.residue_extra([], [], [150 * MiB, ~0], []) == 0  # no wrap, nothing added


def test_concatenated_streams_free_their_own_allocations():
    assert concatenated([5, ~0], [7, 8, ~1, ~0]) == [5, ~0, 7, 8, ~2, ~1]
    assert concatenated([5, EMPTY_CACHE], [7, ~0]) == [5, EMPTY_CACHE, 7, ~1]


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(gpus=None, shard="none", fsdp_version=2, fsdp_backward_prefetch=False), "--gpus N"),
        (dict(fsdp_version=2, fsdp_backward_prefetch=False), "FSDP1"),
        (dict(fsdp_wrap_from="gpu"), "fsdp_wrap_from"),
    ],
)
def test_a_wrap_fsdp1_does_not_make_is_one_line(changes, message):
    with pytest.raises(PlanError, match=message) as error:
        replace(ANSWER_AI, **changes).validate()
    assert "\n" not in str(error.value)


def test_the_wrap_changes_the_reserved_memory_only():
    spec = model_spec("llama-2-7b")
    with_wrap = planner.plan(spec, ANSWER_AI, gpu="rtx3090", suggest=False)
    empty = planner.plan(spec, replace(ANSWER_AI, fsdp_wrap_from=None), gpu="rtx3090", suggest=False)
    assert with_wrap.bytes == empty.bytes
    # at 512 tokens the step's blocks are small: most of the wrap's cache stays beside them
    assert with_wrap.oom_line.reserved - empty.oom_line.reserved > GiB / 2
    assert any("FSDP1's wrap" in note for note in with_wrap.notes)


def test_the_cli_takes_the_wrap(capsys):
    flags = (
        "llama-2-7b",
        "--precision",
        "bf16",
        "--lora-rank",
        "64",
        "--quant",
        "nf4-dq",
        "--gpus",
        "2",
        "--shard",
        "zero3",
        "--fsdp-version",
        "1",
        "--gpu",
        "rtx3090",
        "--json",
    )
    assert cli.main(["plan", *flags, "--fsdp-wrap-from", "cpu-broadcast"]) == 0
    wrapped = json.loads(capsys.readouterr().out)
    assert cli.main(["plan", *flags]) == 0
    empty = json.loads(capsys.readouterr().out)
    assert wrapped["bytes"] == empty["bytes"]
    # here the plain step's blocks fit in the wrap's cache: it reserves less than the two apart
    assert wrapped["reserved"]["reserved_bytes"] != empty["reserved"]["reserved_bytes"]
    assert any("FSDP1's wrap" in note for note in wrapped["notes"])
    assert not any("FSDP1's wrap" in note for note in empty["notes"])
    assert cli.main(["plan", "llama-2-7b", "--lora-rank", "64", "--fsdp-wrap-from", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "--gpus N" in err and len(err.strip().splitlines()) == 1


def test_past_the_card_the_allocator_frees_its_cache_and_retries():
    """Answer.AI's QLoRA at 10 x 2048 tokens: the reserve the replay makes passes a 3090 (it fits a 48 GB
    A6000), its allocations do not: the allocator releases its cache and retries, so the step fits, its
    reserve stops at the card; at 16 x 2048 the allocations themselves pass the card."""
    spec = model_spec("llama-2-7b")
    setup = replace(ANSWER_AI, batch=10, seq=2048)
    line = planner.plan(spec, setup, gpu="rtx3090", suggest=False).oom_line
    roomy = planner.plan(spec, setup, gpu="a6000", suggest=False).oom_line
    assert not roomy.retries and roomy.reserved + roomy.context > line.capacity
    assert line.retries and line.fits and line.nvidia_smi == line.capacity and line.held == roomy.held
    assert "at its limit" in planner.plan(spec, setup, gpu="rtx3090", suggest=False).verdict()
    over = planner.plan(spec, replace(setup, batch=16), gpu="rtx3090", suggest=False).oom_line
    assert not over.fits and not over.retries
