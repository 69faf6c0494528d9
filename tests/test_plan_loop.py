"""The training loop as a planner option (lesson 1): `loop="trainer"` keeps only the loss, the
tutorials' `outputs = model(**batch); outputs.loss.backward()` keeps the logits too. Each prediction
is checked against a real training step on the CPU, measured by course_lib.measure."""

import pytest
import torch
from transformers import AutoConfig

from course_lib.measure import measure_step
from course_lib.memory import Setup, plan
from course_lib.models import build_model, spec_from_model

VOCAB = 8192  # a large vocabulary next to the width: the logits matter, as Llama-3's 128k do


def _measured_peak(config, loop: str, precision: str) -> int:
    setup = Setup(precision=precision, batch=2, seq=96)
    torch.manual_seed(0)
    model = build_model(config, "cpu", dtype=setup.weight_dtype)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters())
    ids = torch.randint(0, VOCAB, (2, 96))
    kept = {}

    def loss_fn():
        outputs = model(input_ids=ids, labels=ids, use_cache=False)
        if loop == "keep-outputs":
            kept["outputs"] = outputs  # bound until the next forward returns, as in a tutorial loop
        return outputs.loss

    measure_step(model, optimizer, loss_fn, [ids])
    # The previous step's outputs, alive in this forward until rebound, were made before the tracker
    # began: it cannot see them (the planner counts them); here the backward pass is the peak.
    measured = measure_step(model, optimizer, loss_fn, [ids])
    assert measured.peak == measured.phase_peaks["backward"]
    return measured.peak


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("loop", ["trainer", "keep-outputs"])
def test_each_loop_matches_a_measured_step_within_2_percent(loop, precision):
    config = AutoConfig.for_model("llama", hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB)
    measured = _measured_peak(config, loop, precision)
    spec = spec_from_model(build_model(config), "tiny-llama", config)
    predicted = plan(spec, Setup(precision=precision, batch=2, seq=96, loop=loop))
    assert abs(predicted.total - measured) <= 0.02 * measured
    other = plan(spec, Setup(precision=precision, batch=2, seq=96,
                             loop="trainer" if loop == "keep-outputs" else "keep-outputs"))
    assert abs(other.total - measured) > 0.02 * measured  # the loop matters at this vocabulary
    assert any(note.startswith(f"loop {loop}") for note in predicted.notes)


def test_the_cli_takes_the_loop(capsys):
    from course_lib import cli

    assert cli.main(["plan", "gpt2", "--seq", "256", "--loop", "keep-outputs"]) == 0
    assert "loop keep-outputs" in capsys.readouterr().out
    assert cli.main(["plan", "--params", "7e9", "--loop", "keep-outputs"]) == 2
