"""The fast path of the planner (lesson 1): a deep model's trace composed from two shallow copies equals
the full meta-device trace, byte for byte, for every bundled model in several setups.

The deep model here is a 6-period copy of each bundled config (real widths, vocabulary and layer
types; fewer layers) so that the full trace it is checked against stays quick."""

from dataclasses import replace

import pytest

from course_lib import cache, planner
from course_lib.models import bundled_models, model_spec
from course_lib.planner.trace import step as memory_trace
from course_lib.planner.trace.compose import composed_trace, layer_period, shallow_spec

SETUPS = [  # (setup, target): full fine-tune; LoRA, eager attention, outputs kept; QLoRA, prepared base; amp
    (planner.Setup(precision="mixed-bf16", batch=2, seq=64), "cpu"),
    (planner.Setup(precision="fp16", lora_rank=8, batch=1, seq=48, attention="eager", loop="keep-outputs"), "cuda"),
    (planner.Setup(precision="bf16", lora_rank=4, quant="nf4", prepare_kbit=True, batch=3, seq=32), "cuda"),
    (planner.Setup(precision="amp-bf16", batch=2, seq=32), "cuda"),  # the Trainer's autocast, CUDA's op lists
]


@pytest.mark.parametrize("name", bundled_models())
def test_the_composed_trace_is_the_full_trace(name):
    spec = model_spec(name)
    period = layer_period(spec.config)
    deep = shallow_spec(spec, 6 * period)
    for setup, target in SETUPS:
        if name.startswith("gemma-2"):  # its implementation refuses SDPA
            setup = replace(setup, attention="eager")
        if setup.lora_rank and any(len(info.shape) == 3 for info in spec.params):  # MoE: LoRA on its experts is refused
            setup = replace(setup, lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"))
        composed = composed_trace(deep, setup, target, memory_trace.trace_in_full)
        assert composed is not None
        assert composed == memory_trace.trace_in_full(deep, setup, target), (name, setup)


def test_gemma_2_alternates_two_layer_types_and_shallow_models_are_traced_in_full():
    assert layer_period(model_spec("gemma-2-2b").config) == 2
    assert layer_period(model_spec("llama-3.2-1b").config) == 1
    spec = model_spec("gpt2")
    assert composed_trace(shallow_spec(spec, 5), planner.Setup(seq=16), "cpu", memory_trace.trace_in_full) is None


def test_five_sliding_layers_to_one_global_are_composed_with_their_period():
    """Gemma-3's global layer keeps other bytes than its sliding ones, and the 3- and 4-layer copies
    would hold none: its period, 6, is composed from 18 and 24 layers."""
    from transformers import AutoConfig

    from course_lib.models import build_model, spec_from_model

    config = AutoConfig.for_model(
        "gemma3_text",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=36,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=256,
        sliding_window=8,
    )
    spec, setup, depths = spec_from_model(build_model(config), "tiny-gemma-3", config), planner.Setup(seq=32), []

    def counted(spec, setup, target):
        depths.append(spec.n_layers)
        return memory_trace.trace_in_full(spec, setup, target)

    assert composed_trace(spec, setup, "cuda", counted) == memory_trace.trace_in_full(spec, setup, "cuda")
    assert layer_period(config) == 6 and depths == [18, 24]


def test_layers_that_do_not_repeat_are_traced_in_full():
    spec = shallow_spec(model_spec("llama-3.2-1b"), 6)
    spec.config.layer_types = ["full_attention"] * 5 + ["sliding_attention"]
    assert layer_period(spec.config) is None
    assert composed_trace(spec, planner.Setup(seq=16), "cpu", memory_trace.trace_in_full) is None


@pytest.fixture
def traced(monkeypatch) -> list:
    """Each `_trace` call's (spec, setup), the traces kept neither in memory nor on disk."""
    calls = []
    real = memory_trace.trace_in_full

    def spy(spec, setup, target, **options):
        calls.append((spec, setup))
        return real(spec, setup, target, **options)

    monkeypatch.setattr(memory_trace, "trace_in_full", spy)
    cache.clear_memo()
    monkeypatch.setenv("COURSE_LIB_CACHE_DIR", "")
    return calls


def test_the_planner_uses_the_fast_path_for_a_deep_model(traced):
    planner.plan("llama-2-70b", seq=32)
    assert [spec.n_layers for spec, _ in traced] == [3, 4]  # never the 80 layers
    traced.clear()
    planner.plan("gemma-2-2b", seq=32, attention="eager")
    # its sliding and global layers keep the same bytes: not the 6 and 8 of period 2
    assert [spec.n_layers for spec, _ in traced] == [3, 4]


def test_a_trace_kept_on_disk_is_the_trace(monkeypatch, tmp_path):
    monkeypatch.setenv("COURSE_LIB_CACHE_DIR", str(tmp_path))
    cache.clear_memo()
    setup = planner.Setup(lora_rank=4, seq=32)
    first = planner.plan("llama-3.2-1b", setup)
    assert len(list(tmp_path.glob("trace-*.json"))) == 1
    cache.clear_memo()
    monkeypatch.setattr(memory_trace, "trace_in_full", lambda *args, **options: pytest.fail("traced again"))
    assert planner.plan("llama-3.2-1b", setup).bytes == first.bytes


def test_a_refusal_kept_on_disk_is_not_traced_again(monkeypatch, tmp_path):
    """A setup the trace refuses (LoRA on Mixtral's 3-D experts) is refused again from the disk cache, the
    same line, without building the model: "what makes it fit" tries it for every plan of the model."""
    monkeypatch.setenv("COURSE_LIB_CACHE_DIR", str(tmp_path))
    cache.clear_memo()
    setup = planner.Setup(precision="bf16", lora_rank=16, seq=64)
    with pytest.raises(planner.PlanError) as first:
        planner.plan("mixtral-8x7b", setup)
    cache.clear_memo()
    monkeypatch.setattr(memory_trace, "build_traced_model", lambda *args: pytest.fail("built again"))
    with pytest.raises(planner.PlanError) as again:
        planner.plan("mixtral-8x7b", setup)
    assert str(again.value) == str(first.value) and "experts is not modelled" in str(first.value)


def test_a_parameter_list_kept_on_disk_is_the_parameter_list(monkeypatch, tmp_path):
    from course_lib import models

    monkeypatch.setenv("COURSE_LIB_CACHE_DIR", str(tmp_path))
    cache.clear_memo()
    first = models.model_spec("qwen2.5-0.5b")
    cache.clear_memo()
    monkeypatch.setattr(models, "build_model", lambda *args, **kwargs: pytest.fail("built again"))
    again = models.model_spec("qwen2.5-0.5b")
    cache.clear_memo()
    assert again.params == first.params and again.n_params == models.PUBLISHED_PARAMETERS["qwen2.5-0.5b"]


def test_precisions_of_the_same_dtypes_share_one_trace(traced):
    """bf16, mixed-bf16 and mixed-bf16-fp32grads run the same 16-bit step: traced once; amp-bf16 (fp32 weights
    under autocast) is another step, and so is the step in backward, whose temporaries follow the recipe."""
    for precision in ("bf16", "mixed-bf16", "mixed-bf16-fp32grads", "amp-bf16"):
        planner.plan("gpt2", precision=precision, seq=32)
    planner.plan("gpt2", precision="bf16", seq=32, optimizer_in_backward=True)
    planner.plan("gpt2", precision="mixed-bf16", seq=32, optimizer_in_backward=True)
    # gpt2's 12 layers composed from 3 and 4
    assert [setup.precision for _, setup in traced] == ["bf16"] * 2 + ["amp-bf16"] * 2 + ["bf16"] * 2 + [
        "mixed-bf16"
    ] * 2
