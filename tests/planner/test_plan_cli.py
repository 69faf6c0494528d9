"""Tests of `course-lib plan` (lesson 1): the 112 GB answers, JSON and human output, and bad input as
one line with exit status 2."""

import json
import subprocess
import sys

import pytest

from course_lib import cli


def run(capsys, *argv):
    code = cli.main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("precision", ["mixed-bf16", "fp32"])
def test_seven_billion_adamw_is_112e9_bytes(capsys, precision):
    code, out, err = run(capsys, "--params", "7e9", "--precision", precision, "--optimizer", "adamw", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["bytes"]["total"] == 112_000_000_000
    assert set(data["bytes"]) == {
        "weights",
        "gradients",
        "optimizer_state",
        "master_weights",
        "quantization",
        "activations",
        "optimizer_temporaries",
        "overhead",
        "total",
    }
    assert all(isinstance(v, int) for v in data["bytes"].values())
    assert data["bytes"]["overhead"] == 0 and data["activations_known"] is False


def test_params_alone_says_activations_are_unknown(capsys):
    code, out, _ = run(capsys, "--params", "7B")
    assert code == 0
    assert "activations" in out and "unknown" in out and "104.31 GiB" in out


def test_a_bundled_model_on_a_gpu_gives_a_table_a_verdict_and_tricks(capsys):
    code, out, err = run(capsys, "llama-3.2-1b", "--gpu", "t4", "--batch", "4", "--seq", "1024")
    assert code == 0, err
    assert "GiB" in out and "does not fit on T4" in out and "What makes it fit" in out
    assert "amp-fp16" in out  # the Trainer's fp16=True: the T4 has no bf16, the default precision follows the GPU


def test_empty_cache_each_step_changes_the_reserved_memory_only(capsys):
    flags = ("gpt2", "--precision", "amp-fp16", "--seq", "1024", "--gpu", "t4", "--json")
    kept = json.loads(run(capsys, *flags)[1])
    code, out, _ = run(capsys, *flags, "--empty-cache-each-step")
    emptied = json.loads(out)
    assert code == 0 and emptied["bytes"] == kept["bytes"]
    assert emptied["reserved"]["reserved_bytes"] != kept["reserved"]["reserved_bytes"]
    assert any("empty_cache()" in note for note in emptied["notes"])
    assert not any("empty_cache()" in note for note in kept["notes"])


def test_json_for_a_model_has_known_activations_and_the_fit(capsys):
    code, out, _ = run(
        capsys,
        "gpt2",
        "--precision",
        "fp32",
        "--seq",
        "256",
        "--checkpointing",
        "every-layer",
        "--gpu",
        "a100-80gb",
        "--json",
    )
    data = json.loads(out)
    assert code == 0 and data["activations_known"] and data["bytes"]["activations"] > 0
    assert data["fits"] is True and data["bytes"]["overhead"] > 0
    assert sum(v for k, v in data["bytes"].items() if k != "total") == data["bytes"]["total"]


def test_a_local_config_json(capsys, tmp_path):
    from course_lib.models import CONFIG_DIR

    config = tmp_path / "config.json"
    config.write_text((CONFIG_DIR / "gpt2.json").read_text())
    code, out, _ = run(capsys, str(config), "--json", "--seq", "64")
    assert code == 0 and json.loads(out)["n_params"] == 124_439_808


BAD = [
    (["lama-3-8b"], "did you mean llama-3.1-8b"),
    (["--params", "0"], "positive whole number"),
    (["--params=-7e9"], "positive whole number"),
    (["--params", "seven"], "number of parameters"),
    (["gpt2", "--batch", "0"], "--batch: must be a whole number >= 1, got 0"),
    (["gpt2", "--seq", "-1"], "--seq: must be a whole number >= 1, got -1"),
    (["gpt2", "--lora-rank", "-2"], "--lora-rank: must be a whole number >= 0"),
    (["gpt2", "--quant", "nf4"], "--lora-rank"),
    (["gpt2", "--checkpointing", "every-x"], "unknown checkpointing plan"),
    (["gpt2", "--gpu", "t5"], "unknown GPU"),
    (["gpt2", "--gpu", "t4", "--precision", "bf16"], "no bf16 hardware"),
    (["gpt2", "--params", "7e9"], "not both"),
    ([], "give a model"),
    (["--params", "7e9", "--lora-rank", "8"], "layer shapes"),
    (["gpt2", "--optimizer", "adam"], "invalid choice"),
    (["--params", "-7e9"], "positive whole number"),  # a value, not an option
    (["--params", "1e30"], "--params"),  # not printed as float noise
    (["gpt2", "--seq", "nan"], "--seq"),
    (["gpt2", "--lora-dropout", "inf"], "--lora-dropout"),
    (["gpt2", "--gpus", "1.5"], "--gpus"),
    (["gpt2", "--lora-rank", "100000000"], "lora rank 100000000 is above the rank of every layer"),
    (["gpt2", "--seq", "4096"], "beyond gpt2's 1024 learned positions (transformer.wpe.weight"),
    (["--params", "7e9", "--checkpointing", "every-layer"], "--checkpointing cannot change a plan from --params"),
    (["--params", "7e9", "--batch", "4", "--seq", "2048"], "--batch, --seq cannot change"),
    (["--params", "7e9", "--lora-rank", "8", "--lora-dropout", "0.1"], "--lora-dropout cannot change"),
    (["gpt2", "--lora-rank", "8", "--lora-dropout", "1"], "--lora-dropout: must be a probability"),
]


@pytest.mark.parametrize("argv, message", BAD)
def test_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("course-lib: error:") and message in err


def test_a_malformed_config_json_is_one_line(capsys, tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text('{"model_type": "llama", "hidden_size": ')
    code, out, err = run(capsys, str(bad))
    assert code == 2 and err.count("\n") == 1 and "not valid JSON" in err


def test_nf4_without_bitsandbytes_is_refused(capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a)
    )
    code, _, err = run(capsys, "gpt2", "--lora-rank", "8", "--quant", "nf4", "--precision", "bf16")
    assert code == 2 and "needs bitsandbytes" in err and err.count("\n") == 1


def test_the_console_command_exits_2_with_one_line():
    result = subprocess.run(
        [sys.executable, "-m", "course_lib.cli", "plan", "--params", "-1"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "positive whole number" in result.stderr


@pytest.mark.parametrize("name", ["full", "lora", "qlora", "qlora-t4", "fsdp-qlora"])
def test_each_recipe_plans_and_says_what_it_set(capsys, name):
    from course_lib.planner.config.recipes import RECIPES

    code, out, _ = run(capsys, "llama-3.2-1b", "--recipe", name, "--seq", "64", "--json")
    shown = json.loads(out)
    assert code == 0 and shown["recipe"]["name"] == name
    assert set(shown["recipe"]["set"]) == set(RECIPES[name])
    for field, value in RECIPES[name].items():
        assert shown["setup"][field] == (list(value) if isinstance(value, tuple) else value)
    assert name in " ".join(_plan_help().split())


def _plan_help() -> str:
    from course_lib.planner.config.command import help_text

    return help_text()


def test_the_help_names_every_recipe_and_groups_the_options():
    from course_lib.planner.config.recipes import RECIPES

    text = " ".join(_plan_help().split())
    assert all(name in text for name in RECIPES)
    assert "adapters and quantization" in text and "the step: batch, sequence, loop" in text


def test_an_option_beside_a_recipe_overrides_it_and_the_line_says_so(capsys):
    code, out, _ = run(capsys, "llama-3.2-1b", "--recipe", "qlora-t4", "--accum", "2", "--seq", "64")
    first = out.splitlines()[0]
    assert code == 0 and first.startswith("recipe qlora-t4 set ") and "accum" not in first
    assert "x accum 2" in out and "quant=nf4-dq" in first


def test_the_t4_recipe_is_lesson_5s():
    from course_lib.planner.config.recipes import RECIPES
    from course_lib.qlora import Recipe

    lesson = Recipe()
    t4 = RECIPES["qlora-t4"]
    assert (t4["lora_rank"], t4["accum"], t4["prepare_kbit"]) == (lesson.lora_rank, lesson.accum, lesson.prepare_kbit)
    assert t4["quant"] == "nf4-dq" and lesson.nf4 and t4["optimizer"] == "paged_adamw8bit"
    assert lesson.optim == "paged_adamw_8bit" and (t4["checkpointing"] == "every-layer") == lesson.checkpointing


def test_an_unknown_recipe_is_one_line(capsys):
    code, out, err = run(capsys, "gpt2", "--recipe", "qlora-a100")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "argument --recipe: invalid choice 'qlora-a100'" in err and "fsdp-qlora" in err


def test_the_fsdp_flags_read_positively_and_their_defaults_are_choices(capsys):
    base = ["llama-3.2-1b", "--gpus", "2", "--shard", "zero3", "--seq", "64", "--json"]
    plans = {}
    for extra in ([], ["--fsdp-reduce-dtype", "compute"], ["--fsdp-reshard-root"], ["--no-fsdp-reshard-root"]):
        code, out, _ = run(capsys, *base, *extra)
        assert code == 0
        plans[" ".join(extra)] = json.loads(out)
    buffers = {flags: plan["detail"]["buffers_by_phase"] for flags, plan in plans.items()}
    assert buffers[""] == buffers["--fsdp-reduce-dtype compute"] == buffers["--fsdp-reshard-root"]
    assert plans["--no-fsdp-reshard-root"]["setup"]["fsdp_reshard_root"] is False
    # the root kept gathered from forward to backward: backward starts without gathering it again
    assert buffers["--no-fsdp-reshard-root"]["backward start"] < buffers[""]["backward start"]
