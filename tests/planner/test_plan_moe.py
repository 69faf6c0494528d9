"""Mixture-of-experts models in transformers 5 (course_lib.planner.trace.moe): QLoRA of Mixtral and Qwen3-MoE, whose
experts are 3-D parameters that bitsandbytes leaves unquantized, planned or refused in one line."""

import pytest

from course_lib import cli
from course_lib.measure import format_bytes
from course_lib.models import model_spec
from course_lib.planner import PlanError, plan
from course_lib.planner.states.model_states import nf4_bytes

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def _experts(spec) -> int:
    return sum(info.numel for info in spec.params if len(info.shape) == 3)


@pytest.mark.parametrize("name", ["mixtral-8x7b", "qwen3-30b-a3b"])
def test_lora_on_the_experts_is_refused_in_one_true_line(name):
    spec = model_spec(name)
    with pytest.raises(PlanError) as error:
        plan(spec, precision="bf16", lora_rank=16, quant="nf4-dq", seq=64)
    message = str(error.value)
    assert "\n" not in message and "experts is not modelled" in message and "target_parameters" in message
    assert f"{_experts(spec) / spec.n_params:.0%} of the parameters" in message  # most of the model
    assert f"{_experts(spec) * 2 / 2**30:.1f} GiB in bfloat16" in message


def test_the_cli_refuses_a_mixtral_qlora_in_one_line(capsys):
    code = cli.main(["plan", "mixtral-8x7b", "--lora-rank", "16", "--quant", "nf4-dq", "--seq", "64"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "3-D parameters" in err


def test_a_mixtral_qlora_on_the_attention_keeps_the_experts_16_bit_and_fp32_after_prepare_kbit():
    """bitsandbytes quantizes nn.Linear only: the attention projections are packed, the experts (and the
    router) stay in the base dtype, and prepare_model_for_kbit_training upcasts them to fp32."""
    spec = model_spec("mixtral-8x7b")
    experts = _experts(spec)
    options = dict(precision="bf16", lora_rank=16, lora_targets=ATTENTION, quant="nf4-dq", seq=64)
    plain, prepared = plan(spec, **options), plan(spec, prepare_kbit=True, **options)
    linears = [info for info in spec.params if info.module == "linear" and not info.is_lm_head]
    assert linears and all(info.name.rsplit(".", 2)[-2] in ATTENTION for info in linears)
    assert plain.bytes["quantization"] == sum(nf4_bytes(info.numel, True)[1] for info in linears)
    assert 2 * experts < plain.bytes["weights"] < 2 * spec.n_params
    assert prepared.bytes["weights"] - plain.bytes["weights"] >= 2 * experts  # the experts upcast to fp32
    assert prepared.bytes["activations"] > 0 and prepared.total > plain.total


def test_a_4bit_plan_of_fused_experts_warns_how_much_stays_unquantized_and_why():
    spec = model_spec("mixtral-8x7b")
    experts = _experts(spec)
    options = dict(precision="bf16", lora_rank=16, lora_targets=ATTENTION, seq=64)
    for prepare, size in ((False, 2), (True, 4)):
        result = plan(spec, quant="nf4", prepare_kbit=prepare, **options)
        warning = result.notes[0]
        assert warning.startswith("warning: --quant nf4 leaves ") and "bitsandbytes/issues/1849" in warning
        assert format_bytes(experts * size) in warning
        assert str(result).count(warning.split(":")[0] + ":") == 1  # printed as a warning, not a note
    assert not any("1849" in note for note in plan(spec, **options).notes)  # no 4-bit base: nothing to warn
    dense = plan("llama-3.2-1b", precision="bf16", lora_rank=16, quant="nf4-dq", seq=64)
    assert not any("1849" in note for note in dense.notes)  # no fused experts: every linear layer packed
