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
from course_lib.models import spec_from_model
from course_lib.planner import PlanError, Setup, plan
from course_lib.toolbox import (
    LEAN_OPTIMIZERS,
    HostOffload,
    OptimizerInBackward,
    chunked_causal_lm_loss,
    embeddings_in_32_bits,
)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(chunked_loss=0), r"chunked_loss \(tokens per chunk.*must be a whole number >= 1, got 0"),
        (dict(chunked_loss=2.5), r"chunked_loss \(tokens per chunk.*got 2.5 \(it has a fraction\)"),
        (dict(optimizer_in_backward="yes"), "optimizer_in_backward must be True or False"),
        (dict(offload_activations=1), "offload_activations must be True or False"),
        (dict(optimizer_in_backward=True, accum=8), "nothing to accumulate into"),
        (dict(offload_activations=True, checkpointing="every-layer"), "one of them at a time"),
        (dict(chunked_loss=64, gpus=2), "does not model lesson 7's tricks under data parallelism"),
    ],
)
def test_bad_values_are_one_line_plan_errors(options, message):
    with pytest.raises(PlanError, match=message) as error:
        plan("gpt2", Setup(**options))
    assert "\n" not in str(error.value)


def test_the_cli_flags_reach_the_planner_and_bad_ones_are_one_line(capsys):
    assert cli.main(["plan", "--params", "1e6", "--precision", "fp32", "--optimizer-in-backward", "--json"]) == 0
    out, _ = capsys.readouterr()
    assert '"optimizer_in_backward": true' in out and '"gradients": 0' in out
    for argv in (
        ["gpt2", "--chunked-loss", "-3"],
        ["--params", "7e9", "--offload-activations"],
        ["gpt2", "--optimizer-in-backward", "--accum", "2"],
    ):
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

    with embeddings_in_32_bits(model) if setup.optimizer == "adamw8bit" else contextlib.nullcontext():
        loss_fn().backward()
        opt.step()  # the state is made here: as the Trainer does it, 32-bit for the embeddings
    measured = measure_step(model, opt, loss_fn, [ids])
    predicted = plan(spec_from_model(model, "tiny", model.config), setup)
    return measured, predicted, storage_bytes(optimizer_state_tensors(opt))


@pytest.mark.parametrize(
    "fields",
    [
        dict(precision="bf16", optimizer="adafactor"),
        dict(optimizer_in_backward=True, optimizer="adamw8bit"),
        dict(chunked_loss=32),
        dict(offload_activations=True),
    ],
    ids=str,
)
def test_predictions_match_a_measured_cpu_step(fields):
    setup = Setup(**{"precision": "fp32", "batch": 2, "seq": 128, **fields})
    measured, predicted, state = _measured_and_predicted(setup)
    assert predicted.bytes["optimizer_state"] == state
    assert predicted.detail["all_gradients"] == measured.gradients
    assert abs(predicted.total - measured.peak) <= 0.001 * measured.peak, (predicted.total, measured.peak)


@pytest.mark.parametrize("precision", ["fp16", "mixed-fp16"])
def test_the_step_in_backward_is_refused_under_fp16_in_one_line(precision):
    """GradScaler's skip-on-overflow becomes a partial update when each parameter steps inside backward."""
    with pytest.raises(PlanError, match="GradScaler") as error:
        plan("llama-3.2-1b", Setup(precision=precision, optimizer_in_backward=True))
    assert "\n" not in str(error.value)
    assert plan("llama-3.2-1b", Setup(precision="mixed-bf16", optimizer_in_backward=True)).detail["all_gradients"] == 0


def test_the_step_in_backward_under_ddp_names_the_unaveraged_gradient():
    with pytest.raises(PlanError, match="unaveraged gradient"):
        plan("gpt2", Setup(optimizer_in_backward=True, gpus=2))


def test_what_makes_it_fit_never_offers_the_step_in_backward_under_fp16():
    fp16 = plan("llama-3.1-8b", Setup(precision="mixed-fp16", batch=2, seq=1024), gpu="t4")
    assert fp16.tricks and not any("in backward" in t.name for t in fp16.tricks)


def test_the_step_in_backward_says_the_clip_is_lost():
    notes = plan("gpt2", Setup(optimizer_in_backward=True)).notes
    assert any("max_grad_norm=1.0" in note and "lost" in note for note in notes)


def test_the_offload_notes_link_rate_is_the_target_gpus():
    setup = Setup(precision="fp16", batch=1, seq=256, offload_activations=True)  # fp16: the T4 has no bf16
    t4, a100, h200 = (plan("gpt2", setup, gpu=g, suggest=False) for g in ("t4", "a100-80gb", "h200"))
    seconds = [p.detail["offload_seconds_predicted"] for p in (t4, a100, h200)]
    assert seconds[0] == pytest.approx(2 * seconds[1]) and seconds[1] == pytest.approx(2 * seconds[2])
    assert any("31.50 GB/s" in n and "PCIe 4.0 x16" in n for n in a100.notes)
    assert any("15.75 GB/s" in n for n in t4.notes) and any("63.00 GB/s" in n for n in h200.notes)


@pytest.mark.parametrize("optim, optimizer", [("adamw_bnb_8bit", "adamw8bit"), ("paged_adamw_8bit", "paged_adamw8bit")])
def test_8bit_state_is_the_trainers_with_its_32bit_embeddings(tmp_path, optim, optimizer):
    """The Trainer registers optim_bits=32 for every nn.Embedding when its optimizer is 8-bit
    (transformers trainer.py, register_module_override): the planner counts what the real Trainer's
    optimizer allocates."""
    pytest.importorskip("bitsandbytes")
    import warnings

    from transformers import Trainer, TrainingArguments

    model = tiny_decoder("llama", n_layers=2, hidden=64, vocab=2048)  # embedding and output layer: 131,072 values
    args = TrainingArguments(output_dir=str(tmp_path), optim=optim, use_cpu=True, report_to=[], save_strategy="no")
    import bitsandbytes as bnb

    manager = bnb.optim.GlobalOptimManager.get_instance()
    try:  # the Trainer's override stays in bitsandbytes' global manager, by position: cleared after
        optimizer_object = Trainer(model=model, args=args).create_optimizer()
        ids = torch.randint(0, 2048, (1, 16))
        model(input_ids=ids, labels=ids).loss.backward()
        with warnings.catch_warnings():  # paged optimizers on a CPU warn and run unpaged
            warnings.simplefilter("ignore")
            optimizer_object.step()
    finally:
        manager.initialize()
    real = storage_bytes(optimizer_state_tensors(optimizer_object))
    embedding = model.get_input_embeddings().weight
    assert optimizer_object.state[embedding]["state1"].dtype == torch.float32  # the override is real
    predicted = plan(spec_from_model(model, "tiny llama", model.config), Setup(precision="fp32", optimizer=optimizer))
    assert predicted.bytes["optimizer_state"] == real
