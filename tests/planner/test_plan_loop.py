"""The training loop as a planner option (lesson 1): `loop="trainer"` keeps only the loss, the
tutorials' `outputs = model(**batch); outputs.loss.backward()` keeps the logits too ("keep-outputs",
into the next forward; "outputs-until-step" releases them after the step), and transformers' loss before
4.46 (`legacy_causal_lm_loss`: fp32 logits returned, the shifted logits copied). Each prediction is
checked against a real training step on the CPU, measured by course_lib.measure."""

import pytest
import torch
from transformers import AutoConfig

from course_lib.measure import measure_step
from course_lib.models import build_model, legacy_causal_lm_loss, spec_from_model
from course_lib.planner import Setup, plan

VOCAB = 8192  # a large vocabulary next to the width: the logits matter, as Llama-3's 128k do


def _measured_peak(config, loop: str, precision: str, legacy: bool = False) -> int:
    setup = Setup(precision=precision, batch=2, seq=96)
    torch.manual_seed(0)
    model = build_model(config, "cpu", dtype=setup.weight_dtype)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters())
    ids = torch.randint(0, VOCAB, (2, 96))
    kept = {}

    def loss_fn():
        if loop == "outputs-until-step":
            kept.clear()  # `output = None` after the step: gone before this forward
        if legacy:
            loss, outputs = legacy_causal_lm_loss(model, ids, ids)
        else:
            outputs = model(input_ids=ids, labels=ids, use_cache=False)
            loss = outputs.loss
        if loop != "trainer":
            kept["outputs"] = outputs  # bound until the next forward returns, as in a tutorial loop
        return loss

    measure_step(model, optimizer, loss_fn, [ids])
    # The previous step's outputs, alive in this forward until rebound, were made before the tracker
    # began: it cannot see them (the planner counts them); here the backward pass is the peak.
    measured = measure_step(model, optimizer, loss_fn, [ids])
    if loop == "keep-outputs":
        assert measured.peak == measured.phase_peaks["backward"]
    return measured.peak


def _tiny_llama():
    config = AutoConfig.for_model(
        "llama",
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
    )
    return config, spec_from_model(build_model(config), "tiny-llama", config)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("loop", ["trainer", "keep-outputs", "outputs-until-step"])
def test_each_loop_matches_a_measured_step_within_2_percent(loop, precision):
    config, spec = _tiny_llama()
    measured = _measured_peak(config, loop, precision)
    predicted = plan(spec, Setup(precision=precision, batch=2, seq=96, loop=loop))
    assert abs(predicted.total - measured) <= 0.02 * measured
    other = plan(
        spec, Setup(precision=precision, batch=2, seq=96, loop="trainer" if loop != "trainer" else "keep-outputs")
    )
    assert abs(other.total - measured) > 0.02 * measured  # the loop matters at this vocabulary
    assert any(note.startswith(f"loop {loop}") for note in predicted.notes)


def test_only_the_tutorials_loop_keeps_the_previous_outputs_into_the_next_forward():
    _, spec = _tiny_llama()
    forward = {
        loop: plan(spec, Setup(precision="bf16", batch=2, seq=96, loop=loop)).detail["phases"]["forward"]
        for loop in ("keep-outputs", "outputs-until-step")
    }
    logits = 2 * 96 * VOCAB * 2  # bf16
    assert sum(forward["keep-outputs"].values()) - sum(forward["outputs-until-step"].values()) == logits


@pytest.mark.parametrize("loop", ["trainer", "keep-outputs"])
def test_transformers_loss_before_4_46_matches_a_measured_step_within_2_percent(loop):
    config, spec = _tiny_llama()
    measured = _measured_peak(config, loop, "bf16", legacy=True)
    predicted = plan(spec, Setup(precision="bf16", batch=2, seq=96, loop=loop, legacy_causal_lm_loss=True))
    assert abs(predicted.total - measured) <= 0.02 * measured
    if loop == "keep-outputs":  # the kept logits are fp32, not bf16
        today = plan(spec, Setup(precision="bf16", batch=2, seq=96, loop=loop))
        assert predicted.total - today.total > 0.02 * measured
    assert any(note.startswith("legacy causal-LM loss") for note in predicted.notes)


def test_the_cli_takes_the_loop(capsys):
    from course_lib import cli

    assert cli.main(["plan", "gpt2", "--seq", "256", "--loop", "keep-outputs"]) == 0
    assert "loop keep-outputs" in capsys.readouterr().out
    assert cli.main(["plan", "--params", "7e9", "--loop", "keep-outputs"]) == 2
    assert cli.main(["plan", "gpt2", "--seq", "256", "--legacy-causal-lm-loss", "--loop", "outputs-until-step"]) == 0
    out = capsys.readouterr().out
    assert "legacy causal-LM loss" in out and "loop outputs-until-step" in out
    assert cli.main(["plan", "gpt2", "--legacy-causal-lm-loss", "--chunked-loss", "64"]) == 2
    assert "choose one" in capsys.readouterr().err
