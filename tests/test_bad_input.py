"""Issue 29's examples: every bad input to the library or the CLI gets one clear line (a UserError:
the argument, the value, what to give instead), never a wrong result, a silent NaN or a raw exception
from a dependency (docs/planner.md, "Bad input")."""

import functools
import json
import math

import pytest
import torch

from course_lib import validate
from course_lib.accumulation import (
    TinyTokenLM,
    TokenLoss,
    ddp_accumulation_demo,
    demonstrate_mistakes,
    train_with_accumulation,
)
from course_lib.checkpointing import tiny_decoder
from course_lib.cli import main
from course_lib.errors import UserError
from course_lib.measure import measure_step
from course_lib.paging import Hardware, TrainingSetup, simulate, simulate_offload, transformer_params
from course_lib.planner import plan
from course_lib.qlora import Recipe
from course_lib.sharding import measure_sharding
from course_lib.toolbox import accumulation_breaks, chunked_cross_entropy


def one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert isinstance(error.value, UserError) and message and "\n" not in message, repr(error.value)
    return message


def cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


# ------------------------------------------------------------------ the validation layer itself


@pytest.mark.parametrize("value", [True, 2.5, math.nan, math.inf, -1, 0, "3", None, [1]])
def test_positive_int_refuses_with_a_line_naming_argument_and_value(value):
    with pytest.raises(UserError) as error:
        validate.positive_int("batch", value)
    assert one_line(error).startswith("batch must be a whole number >= 1, got ")


def test_positive_int_takes_whole_floats_as_ints():
    assert validate.positive_int("batch", 4.0) == 4 and type(validate.positive_int("batch", 4.0)) is int


@pytest.mark.parametrize("value", ["no", "off", 0, 1, None])
def test_strict_bool_refuses_what_is_not_a_bool(value):
    with pytest.raises(UserError, match="must be True or False"):
        validate.strict_bool("nf4", value)


def test_a_single_string_is_one_item_not_its_characters():
    assert validate.strings("stages", "zero3") == ("zero3",)
    with pytest.raises(UserError, match="non-empty strings"):
        validate.strings("stages", ["zero3", 3])


def test_choice_says_did_you_mean():
    with pytest.raises(UserError) as error:
        validate.choice("stage", "zero4", ("none", "zero1", "zero2", "zero3"))
    assert "did you mean zero1 or zero2 or zero3?" in one_line(error) or "did you mean zero" in one_line(error)


# ------------------------------------------------------------------ accepted and wrong, before


def test_measure_step_refuses_a_model_on_the_meta_device():
    model = torch.nn.Linear(4, 4, device="meta")
    with pytest.raises(UserError) as error:
        measure_step(model, None, lambda: model(torch.ones(2, 4, device="meta")).sum())
    assert "meta" in one_line(error)


def test_measure_step_refuses_an_optimizer_of_another_model():
    model, other = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(other.parameters())
    with pytest.raises(UserError) as error:
        measure_step(model, optimizer, lambda: model(torch.ones(2, 4)).sum())
    assert "optimizer" in one_line(error)


def test_train_with_accumulation_refuses_no_batches():
    model = TinyTokenLM(seed=0)
    with pytest.raises(UserError, match="batches is empty"):
        train_with_accumulation(model, torch.optim.SGD(model.parameters(), lr=0.1), [], TokenLoss(), 2, progress=False)


def test_paging_simulate_refuses_an_empty_trace():
    with pytest.raises(UserError, match="trace is empty"):
        simulate([])


@pytest.mark.parametrize("efficiency", [3, 1.01, 0, math.nan])
def test_prefetch_efficiency_is_a_share_of_the_link(efficiency):
    with pytest.raises(UserError, match="prefetch_efficiency"):
        Hardware.t4(prefetch_efficiency=efficiency)
    with pytest.raises(UserError, match="prefetch_efficiency"):
        Hardware.pcie3_x16(prefetch_efficiency=efficiency)


def _paging_setup():
    return TrainingSetup(transformer_params(2, 64, 100))


@pytest.mark.parametrize("tokens", [-1, 2.5, math.nan, "512"])
def test_simulate_offload_refuses_a_bad_token_count(tokens):
    with pytest.raises(UserError, match="tokens"):
        simulate_offload(_paging_setup(), tokens)


def test_simulate_offload_refuses_a_dict_for_a_setup():
    with pytest.raises(UserError, match="setup must be a paging.TrainingSetup"):
        simulate_offload({"params": []}, 512)


@pytest.mark.parametrize("field", ["nf4", "checkpointing", "prepare_kbit"])
def test_recipe_switches_are_strict_booleans(field):
    with pytest.raises(UserError, match=f"{field} must be True or False"):
        Recipe(**{field: "no"}).validate()


def test_plan_prepare_kbit_is_a_strict_boolean():
    with pytest.raises(UserError, match="prepare_kbit must be True or False"):
        plan("gpt2", lora_rank=8, prepare_kbit="no")


@pytest.mark.parametrize(
    "options", [dict(legacy_causal_lm_loss="no"), dict(gpus=2, shard="zero3", fsdp_version=1, fsdp_backward_prefetch=1)]
)
def test_plan_the_published_rows_switches_are_strict_booleans(options):
    name = next(key for key in options if key.startswith(("legacy", "fsdp_backward")))
    with pytest.raises(UserError, match=f"{name} must be True or False"):
        plan("gpt2", **options)


def test_plan_refuses_prepare_kbit_on_a_full_fine_tune():
    with pytest.raises(UserError, match="prepare_kbit"):
        plan("gpt2", prepare_kbit=True)


def test_plan_checkpointing_off_is_refused_with_a_suggestion():
    with pytest.raises(UserError) as error:
        plan("gpt2", checkpointing="off")
    assert "none" in one_line(error)


def test_plan_refuses_a_dict_for_a_setup():
    with pytest.raises(UserError, match="setup must be a (planner|course_lib.planner.config.setup.) ?Setup"):
        plan("gpt2", {"batch": 2})


@pytest.mark.parametrize("sizes", [dict(batch=10**30), dict(batch=1e30), dict(batch=10**12, seq=10**12)])
def test_plan_refuses_sizes_no_tensor_can_have(sizes):
    with pytest.raises(UserError, match="more than a tensor can hold") as error:
        plan("gpt2", **sizes)
    one_line(error)


def test_plan_takes_a_whole_number_of_any_type_as_its_int():
    import fractions

    import numpy as np

    for batch in (2.0, np.float32(2), np.int64(2), fractions.Fraction(4, 2)):
        result = plan("gpt2", batch=batch, seq=32)
        assert type(result.setup.batch) is int and result.bytes == plan("gpt2", batch=2, seq=32).bytes


def test_chunked_cross_entropy_refuses_a_negative_item_count():
    hidden, weight = torch.randn(1, 4, 8), torch.randn(10, 8)
    labels = torch.randint(0, 10, (1, 4))
    with pytest.raises(UserError, match="num_items_in_batch"):
        chunked_cross_entropy(hidden, weight, labels, 2, num_items_in_batch=-3)


def test_chunked_cross_entropy_of_all_ignored_labels_is_zero_not_nan():
    hidden, weight = torch.randn(1, 4, 8, requires_grad=True), torch.randn(10, 8)
    loss = chunked_cross_entropy(hidden, weight, torch.full((1, 4), -100), 2)
    assert loss.item() == 0.0  # no token is scored: it adds nothing, with or without the window's count
    loss.backward()
    assert torch.equal(hidden.grad, torch.zeros_like(hidden))
    assert chunked_cross_entropy(hidden, weight, torch.full((1, 4), -100), 2, num_items_in_batch=4).item() == 0.0


def test_accumulation_breaks_refuses_no_batches():
    with pytest.raises(UserError, match="batches is empty"):
        accumulation_breaks(
            lambda: torch.nn.Linear(2, 2), [], lambda p: torch.optim.SGD(p, lr=0.1), lambda m, b: m(b).sum()
        )


# ------------------------------------------------------------------ a string taken as its characters


def test_lora_targets_as_one_string_is_one_module():
    one = plan("gpt2", lora_rank=8, lora_targets="c_attn")
    listed = plan("gpt2", lora_rank=8, lora_targets=("c_attn",))
    assert one.trainable_params == listed.trainable_params > 0
    assert one.bytes == listed.bytes


def test_measure_sharding_refuses_a_string_for_the_stages_before_spawning():
    build = functools.partial(tiny_decoder, "llama", n_layers=2)
    with pytest.raises(UserError) as error:
        measure_sharding(build, 2, stages="zero4")
    assert "did you mean" in one_line(error)


@pytest.mark.parametrize("batch", [0, -1, 1.5])
def test_measure_sharding_refuses_a_bad_batch_before_spawning(batch):
    build = functools.partial(tiny_decoder, "llama", n_layers=2)
    with pytest.raises(UserError, match="batch"):
        measure_sharding(build, 2, batch=batch)


def test_ddp_demo_refuses_a_bad_size_before_spawning():
    with pytest.raises(UserError, match="rows_per_rank"):
        ddp_accumulation_demo(rows_per_rank=0)


def test_demonstrate_mistakes_takes_one_name_as_one_mistake():
    rows = demonstrate_mistakes("mean_per_micro_batch")
    assert [name for name, _ in rows] == ["none", "mean_per_micro_batch"]
    with pytest.raises(UserError, match="did you mean mean_per_micro_batch"):
        demonstrate_mistakes("mean_per_microbatch")


# ------------------------------------------------------------------ config errors name the field


@pytest.mark.parametrize(
    "change, says",
    [
        ({"num_attention_heads": 0}, "num_attention_heads"),
        ({"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 4}, "num_key_value_heads"),
        ({"num_hidden_layers": 0}, "num_hidden_layers"),
        ({"vocab_size": -5}, "vocab_size"),
        ({"model_type": "lama"}, "did you mean llama"),
    ],
)
def test_config_errors_name_the_field_and_the_fix(tmp_path, capsys, change, says):
    config = {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 100,
        "max_position_embeddings": 256,
        **change,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    code, out, err = cli(capsys, "plan", str(tmp_path / "config.json"), "--seq", "32")
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1 and says in lines[0] and len(lines[0]) < 400, err


# ------------------------------------------------------------------ impossible setups, Hub ids


def test_more_gpus_than_parameters_is_an_error():
    with pytest.raises(UserError, match="gpus"):
        plan(1000, gpus=2000, shard="zero3")


@pytest.mark.parametrize(
    "pasted",
    [
        "openai-community/gpt2/",
        "https://huggingface.co/openai-community/gpt2",
        "openai-community/gpt2/tree/main",
        "https://huggingface.co/openai-community/gpt2/",
    ],
)
def test_hub_ids_as_people_paste_them(pasted):
    assert plan(pasted).n_params == plan("gpt2").n_params


def test_grade_checks_an_unwritable_csv_before_grading(tmp_path, capsys):
    (tmp_path / "a.ipynb").write_text("{}")
    code, out, err = cli(capsys, "grade", str(tmp_path / "a.ipynb"), "--csv", str(tmp_path / "no" / "g.csv"))
    assert code == 2 and "no folder" in err and out == ""


# ------------------------------------------------------------------ possible but pointless: notes that say so


def test_a_chunk_as_large_as_the_micro_batch_is_noted(tiny_config):
    whole = plan(tiny_config, batch=2, seq=32, chunked_loss=64)
    assert any("so it is one chunk" in note and "64 tokens" in note for note in whole.notes), whole.notes
    smaller = plan(tiny_config, batch=2, seq=32, chunked_loss=16)
    assert not any("so it is one chunk" in note for note in smaller.notes)


def test_keep_outputs_with_a_chunked_loss_says_it_keeps_nothing_as_the_numbers_do(tiny_config):
    kept = plan(tiny_config, seq=32, chunked_loss=8, loop="keep-outputs")
    trainer = plan(tiny_config, seq=32, chunked_loss=8)
    assert kept.bytes == trainer.bytes
    assert any("keeps none" in note for note in kept.notes)
    assert not any("stay alive through backward" in note for note in kept.notes), kept.notes


def test_no_foreach_note_when_the_step_is_in_backward(tiny_config):
    in_backward = plan(tiny_config, seq=32, precision="bf16", optimizer_in_backward=True, gpu="a100-80gb")
    after = plan(tiny_config, seq=32, precision="bf16", gpu="a100-80gb")
    assert any("(foreach)" in note for note in after.notes)
    assert not any("(foreach)" in note for note in in_backward.notes), in_backward.notes
