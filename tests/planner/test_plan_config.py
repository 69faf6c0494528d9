"""The planner's config tree (docs/planner.md, "Options and their defaults"): `Setup`'s fields in groups,
each declared once; `course-lib plan`'s flags, choices, help and defaults generated from them; one
defaults story for `Setup`, keywords and the command."""

import json
import typing
from dataclasses import fields
from pathlib import Path

import pytest

from course_lib import cli
from course_lib.planner import Setup, plan
from course_lib.planner.config import command
from course_lib.planner.config.fields import GROUPS

ROOT = Path(__file__).resolve().parents[2]


def _choices(annotation) -> tuple:
    """The choices a field's type allows (its Literal's), None excepted."""
    found = []
    for part in typing.get_args(annotation) or (annotation,):
        if typing.get_origin(part) is typing.Literal:
            found += typing.get_args(part)
        elif typing.get_origin(part) is not None:
            found += _choices(part)
    return tuple(found)


HINTS = {name: hint for group in GROUPS for name, hint in typing.get_type_hints(group, include_extras=True).items()}


def test_every_field_of_setup_is_in_exactly_one_group():
    grouped = [f.name for group in GROUPS for f in fields(group)]
    assert len(grouped) == len(set(grouped))
    assert set(grouped) == {f.name for f in fields(Setup)}


@pytest.mark.parametrize("name", sorted(HINTS))
def test_every_field_has_help_and_a_flag_that_reads_positively(name):
    docs = [meta for meta in HINTS[name].__metadata__ if type(meta).__name__ == "Doc"]
    assert docs and len(docs[0].documentation) > 10, f"{name} has no help"
    assert not name.startswith(("no_", "not_", "disable", "keep_")), f"{name} reads backwards"
    flag = f"--{name.replace('_', '-')}"
    assert flag in command.help_text()


@pytest.mark.parametrize("name", [name for name in sorted(HINTS) if _choices(HINTS[name])])
def test_every_choice_list_has_at_least_two_choices(name):
    choices = _choices(HINTS[name])
    optional = type(None) in typing.get_args(typing.get_args(HINTS[name])[0])
    assert len(choices) + optional >= 2, f"{name}: {choices}"


def test_the_help_is_grouped_as_the_setup_is():
    text = " ".join(command.help_text().split())
    for group in GROUPS:
        assert group.__doc__.strip() in text
    assert text.index("--lora-rank R") < text.index("--batch N") < text.index("--gpus N")


def test_docs_have_the_generated_table_of_options_and_defaults():
    assert command.options_table() in (ROOT / "docs" / "planner.md").read_text()


@pytest.mark.parametrize("gpu", ["t4", "a100-80gb", None])
def test_a_setup_and_keywords_plan_the_same_on_every_kind_of_target(gpu):
    by_setup = plan("gpt2", Setup(seq=64), gpu=gpu).to_dict()
    by_keywords = plan("gpt2", seq=64, gpu=gpu).to_dict()
    assert by_setup == by_keywords
    assert by_setup["setup"]["precision"] == {"t4": "amp-fp16", "a100-80gb": "amp-bf16", None: "mixed-bf16"}[gpu]


def test_the_command_plans_what_the_library_plans(capsys):
    code = cli.main(["plan", "gpt2", "--seq", "64", "--gpu", "t4", "--json"])
    shown = json.loads(capsys.readouterr().out)
    assert code == 0 and shown == plan("gpt2", Setup(seq=64), gpu="t4").to_dict()


def test_a_precision_given_is_kept_and_none_follows_the_quantization():
    assert Setup(precision="fp32").for_gpu(None).precision == "fp32"
    assert plan("gpt2", Setup(seq=64, lora_rank=8, quant="nf4"), gpu="t4").setup.precision == "fp16"


def test_every_setup_field_can_be_given_on_the_command_line(capsys):
    code = cli.main(["plan", "gpt2", "--seq", "64", "--lora-rank", "8", "--prepare-kbit", "--json"])
    prepared = json.loads(capsys.readouterr().out)
    code_plain = cli.main(["plan", "gpt2", "--seq", "64", "--lora-rank", "8", "--json"])
    plain = json.loads(capsys.readouterr().out)
    assert code == code_plain == 0 and prepared["setup"]["prepare_kbit"] and not plain["setup"]["prepare_kbit"]
    assert prepared["bytes"] == plan("gpt2", seq=64, lora_rank=8, prepare_kbit=True).to_dict()["bytes"]
    assert prepared["bytes"] != plain["bytes"]  # the upcast norms and embeddings are fp32 weights
    cli.main(["plan", "gpt2", "--seq", "64", "--adam-state", "fp32", "--precision", "bf16", "--json"])
    assert json.loads(capsys.readouterr().out)["setup"]["adam_state"] == "fp32"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["gpt2", "--attention", "flash"], "argument --attention: invalid choice 'flash' (choose from sdpa, eager)"),
        (["gpt2", "--accum", "two"], "argument --accum: must be a whole number >= 1, got 'two'"),
        (["gpt2", "--lora-dropout", "x"], "argument --lora-dropout: must be a probability"),
        (["gpt2", "--batch"], "argument --batch: expected a value"),
        (["gpt2", "--batchsize", "2"], "unrecognized arguments: --batchsize 2"),
        (["gpt2", "--lora-targets", ","], "argument --lora-targets: give module names separated by commas"),
        (["gpt2", "--fsdp-version", "3"], "argument --fsdp-version: invalid choice '3' (choose from 1, 2)"),
    ],
)
def test_a_parse_error_is_one_line_naming_the_flag(capsys, argv, message):
    code = cli.main(["plan", *argv])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1 and message in err
    assert err.rstrip().endswith("(see `course-lib plan --help`)")


def test_the_command_help_is_tyros_and_lists_plan(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["plan", "--help"])
    assert exit_.value.code == 0 and "--fsdp-reshard-root" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "plan" in capsys.readouterr().out
