"""Lesson 6, "FSDP + QLoRA": a 4-bit base stored in bf16 elements (bnb_4bit_quant_storage) sharded by FSDP2,
measured per rank in 2 gloo processes against the planner, and the plan's sharding arithmetic."""

import functools

import pytest
import torch

from course_lib.checkpointing.demo_models import tiny_decoder
from course_lib.measure import storage_bytes
from course_lib.models import model_spec, spec_from_model
from course_lib.planner import PlanError, plan
from course_lib.planner.states.model_states import nf4_bytes
from course_lib.sharding import run_ranks
from course_lib.sharding.engines import wrap
from course_lib.sharding.tracking import RankTracker

pytestmark = pytest.mark.slow  # gloo ranks in processes of their own

BUILD = functools.partial(tiny_decoder, "llama", n_layers=3, hidden=128, vocab=256)
BATCH, SEQ, N, RANK = 2, 32, 2, 8
QLORA = dict(precision="bf16", optimizer="adamw", lora_rank=RANK, quant="nf4-dq", batch=BATCH, seq=SEQ)


def _quant_state_tensors(model) -> list[torch.Tensor]:
    """Every 4-bit layer's quant_state tensors (absmax, code; with double quantization the offset and the
    nested absmax and code): module state, no parameters."""
    tensors = []
    for module in model.modules():
        state = getattr(module, "quant_state", None)
        if state is not None:
            tensors += [state.absmax, state.code]
            if state.nested:
                tensors += [state.offset, state.state2.absmax, state.state2.code]
    return tensors


def _load_qlora(folder: str):
    """The tiny model as FSDP + QLoRA recipes load it: NF4 with double quantization, the packed weights in
    bf16 elements (bnb_4bit_quant_storage) so that FSDP can shard them, bf16 elsewhere, peft's fp32 adapters."""
    from peft import LoraConfig, get_peft_model  # heavy: peft and transformers
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    config = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
        bnb_4bit_quant_storage=torch.bfloat16,
    )
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.bfloat16, device_map="cpu", quantization_config=config
    )
    model.config.use_cache = False
    return get_peft_model(
        model,
        LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules="all-linear", lora_dropout=0.0, task_type="CAUSAL_LM"),
    ).train()


def _qlora_rank(rank: int, world_size: int, folder: str, stage: str) -> dict:
    """One rank's peak over the second step (the first makes the optimizer state), its shards and quant_state."""
    torch.manual_seed(0)
    model = _load_qlora(folder)
    ids = torch.randint(0, model.config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(rank))
    quant_state = _quant_state_tensors(model)
    tracker = RankTracker()
    for tensor in [*model.parameters(), *model.buffers(), *quant_state, ids]:
        tracker.watch(tensor)
    with tracker:
        engine, optimizer = wrap(model, stage, world_size)
        del model
        peaks = []
        for _ in range(2):
            tracker.set_phase(f"step {len(peaks)}")
            engine(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            peaks.append(tracker.phase_peaks[f"step {len(peaks)}"])
    local = [p.to_local() if hasattr(p, "to_local") else p for p in engine.parameters()]
    return {
        "peak": peaks[-1],
        "parameters": storage_bytes(local),
        "quant_state": storage_bytes(quant_state),
        "dtypes": sorted({str(p.dtype) for p in local}),
    }


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-qlora")
    model = BUILD()
    model.save_pretrained(folder)
    return str(folder), spec_from_model(model, "tiny-llama", model.config)


@pytest.fixture(scope="module")
def measured(tiny):
    folder, _ = tiny
    return {
        stage: run_ranks(_qlora_rank, N, folder, stage, timeout_s=240, what="FSDP + QLoRA processes")
        for stage in ("zero3",)
    }


def test_fsdp2_shards_the_packed_4bit_weights_and_keeps_the_quant_state_whole(tiny, measured):
    _, spec = tiny
    single = plan(spec, **QLORA)
    for rank in measured["zero3"]:
        assert rank["dtypes"] == ["torch.bfloat16", "torch.float32"]  # packed weights in bf16 elements, adapters fp32
        assert rank["quant_state"] == single.bytes["quantization"]  # no parameter: every rank keeps all of it
        assert rank["parameters"] == pytest.approx(single.bytes["weights"] / N, rel=0.02)


def test_each_ranks_fsdp_qlora_peak_is_planned_within_10_percent(tiny, measured):
    _, spec = tiny
    predicted = plan(spec, gpus=N, shard="zero3", **QLORA)
    for rank in measured["zero3"]:
        assert predicted.total == pytest.approx(rank["peak"], rel=0.10), (predicted.total, rank["peak"])


def _layer_bytes(spec, layer: int | None) -> tuple[int, int]:
    """(bytes FSDP gathers, bytes of unsharded gradients) of one decoder layer (None: outside the layers)
    under QLoRA with bf16 storage: each linear's packed 4-bit weight (two values a byte) and its two fp32
    adapters r x in and out x r, every other parameter in bf16."""
    gathered = grads = 0
    for info in spec.params:
        if info.layer != layer:
            continue
        if info.module == "linear" and not info.is_lm_head:
            adapters = RANK * (info.shape[0] + info.shape[1])
            gathered += nf4_bytes(info.numel, True)[0] + 4 * adapters
            grads += 4 * adapters
        else:
            gathered += 2 * info.numel
    return gathered, grads


def test_a_70b_fsdp_qlora_plan_shards_the_packed_weights_and_gathers_one_4bit_layer_at_a_time():
    spec = model_spec("llama-2-70b")
    options = dict(QLORA, seq=512, batch=1)
    single = plan(spec, **options)
    for n in (2, 4):
        sharded = plan(spec, gpus=n, shard="zero3", **options)
        assert sharded.bytes["weights"] == pytest.approx(single.bytes["weights"] / n, rel=1e-3)
        assert sharded.bytes["quantization"] == single.bytes["quantization"] > 0  # the quant_state: on every rank
        layer, layer_grads = _layer_bytes(spec, 0)
        root, _ = _layer_bytes(spec, None)
        buffers = sharded.detail["buffers_by_phase"]
        # in the layers' backward: the root gathered throughout, the running layer and the next one
        # prefetched, the running layer's adapter gradients unsharded
        assert buffers["layers backward"] == round(root + 2 * layer + layer_grads)
        # at backward start: the root and its regathered flat buffer, the last layer prefetched beside them
        assert buffers["backward start"] == round(2 * root + layer)
        assert sharded.detail["peak_phase"] in ("layers backward", "backward start")
        assert sharded.bytes["sharding_buffers"] == buffers[sharded.detail["peak_phase"]]
        # accelerate's FSDP1 prefetches nothing in backward and keeps the root gathered: one 4-bit layer
        # gathered at a time, no regather
        fsdp1 = plan(spec, gpus=n, shard="zero3", fsdp_version=1, **options)
        assert fsdp1.detail["peak_phase"] == "layers backward"
        assert fsdp1.bytes["sharding_buffers"] == round(root + layer + layer_grads)
        assert layer < 0.3 * 2 * sum(info.numel for info in spec.params if info.layer == 0)  # a 4-bit layer
    assert plan(spec, gpus=2, shard="zero3", **options).total < single.total


def test_fsdp_qlora_is_refused_with_a_master_copy_precision_in_one_line():
    with pytest.raises(PlanError, match="no fp32 master weights") as error:
        plan("llama-3.2-1b", precision="mixed-bf16", lora_rank=8, quant="nf4", gpus=2, shard="zero3")
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(fsdp_version=1, fsdp_wrapping="torchtitan"), "configure FSDP2"),
        (dict(fsdp_version=1, precision="mixed-bf16", lora_rank=0, quant="none"), "MixedPrecision"),
        (dict(fsdp_version=3), "fsdp_version must be 1"),
        (dict(fsdp_version=1, prepare_kbit=True), "one parameter of one dtype"),
        (dict(fsdp_version=1, shard="zero1"), "need --shard zero2 or zero3"),
    ],
)
def test_fsdp1s_options_are_checked_in_one_line(options, message):
    with pytest.raises(PlanError, match=message) as error:
        plan("llama-3.2-1b", **{**dict(QLORA, gpus=2, shard="zero3"), **options})
    assert "\n" not in str(error.value)
