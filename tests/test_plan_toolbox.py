"""The planner's lesson 7 options: one-line errors for bad values, the CLI flags, and each prediction
against a measured CPU step of a tiny model (benchmarks/planner_accuracy.py --toolbox runs the full
matrix; lesson 7's notebook checks the stacked recipe and "what makes it fit")."""

from __future__ import annotations

import contextlib

import pytest
import torch

from course_lib import cli
from course_lib.checkpointing import tiny_decoder
from course_lib.measure import measure_step, optimizer_state_tensors, storage_bytes
from course_lib.memory import PlanError, Setup, plan
from course_lib.models import spec_from_model
from course_lib.toolbox import LEAN_OPTIMIZERS, HostOffload, OptimizerInBackward, chunked_causal_lm_loss


@pytest.mark.parametrize("options, message", [
    (dict(chunked_loss=0), "chunked_loss must be a positive number"),
    (dict(chunked_loss=2.5), "chunked_loss must be a positive number"),
    (dict(optimizer_in_backward="yes"), "optimizer_in_backward must be True or False"),
    (dict(offload_activations=1), "offload_activations must be True or False"),
    (dict(optimizer_in_backward=True, accum=8), "nothing to accumulate into"),
    (dict(offload_activations=True, checkpointing="every-layer"), "one of them at a time"),
    (dict(chunked_loss=64, gpus=2), "does not model lesson 7's tricks under data parallelism"),
])
def test_bad_values_are_one_line_plan_errors(options, message):
    with pytest.raises(PlanError, match=message) as error:
        plan("gpt2", Setup(**options))
    assert "\n" not in str(error.value)


def test_the_cli_flags_reach_the_planner_and_bad_ones_are_one_line(capsys):
    assert cli.main(["plan", "--params", "1e6", "--precision", "fp32", "--optimizer-in-backward", "--json"]) == 0
    out, _ = capsys.readouterr()
    assert '"optimizer_in_backward": true' in out and '"gradients": 0' in out
    for argv in (["gpt2", "--chunked-loss", "-3"], ["--params", "7e9", "--offload-activations"],
                 ["gpt2", "--optimizer-in-backward", "--accum", "2"]):
        assert cli.main(["plan", *argv]) == 2
        _, err = capsys.readouterr()
        assert len(err.strip().splitlines()) == 1, err


def _measured_and_predicted(setup: Setup):
    model = tiny_decoder("llama", n_layers=2, hidden=64, heads=4, vocab=2048).to(setup.weight_dtype)
    make = LEAN_OPTIMIZERS[setup.optimizer][1]
    params = list(model.parameters())
    opt = OptimizerInBackward(params, make) if setup.optimizer_in_backward else make(params)
    ids = torch.randint(0, 2048, (setup.batch, setup.seq))

    def loss_fn():
        with HostOffload() if setup.offload_activations else contextlib.nullcontext():
            if setup.chunked_loss:
                return chunked_causal_lm_loss(model, ids, ids, setup.chunked_loss)
            return model(input_ids=ids, labels=ids).loss

    loss_fn().backward()
    opt.step()
    measured = measure_step(model, opt, loss_fn, [ids])
    predicted = plan(spec_from_model(model, "tiny", model.config), setup)
    return measured, predicted, storage_bytes(optimizer_state_tensors(opt))


@pytest.mark.parametrize("fields", [dict(precision="bf16", optimizer="adafactor"),
                                    dict(optimizer_in_backward=True, optimizer="adamw8bit"),
                                    dict(chunked_loss=32), dict(offload_activations=True)], ids=str)
def test_predictions_match_a_measured_cpu_step(fields):
    setup = Setup(**{"precision": "fp32", "batch": 2, "seq": 128, **fields})
    measured, predicted, state = _measured_and_predicted(setup)
    assert predicted.bytes["optimizer_state"] == state
    assert predicted.bytes["gradients"] == measured.gradients
    assert abs(predicted.total - measured.peak) <= 0.001 * measured.peak, (predicted.total, measured.peak)
