"""What practitioners type into `course-lib plan` and `plan()` (lesson 1): each case a one-line error
naming what to change, or a correct plan."""

import json

import pytest

from course_lib import cli, model_config
from course_lib.models import CONFIG_DIR, PUBLISHED_PARAMETERS
from course_lib.planner import PlanError, plan


def run(capsys, *argv):
    code = cli.main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def refused(capsys, *argv) -> str:
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == "" and err.count("\n") == 1 and err.startswith("course-lib: error:"), err
    return err


def config_file(tmp_path, **fields):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(fields))
    return str(path)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["llama-2-7b", "--seq", "1000000", "--json"], "beyond llama-2-7b's 4096 positions"),
    ],
)
def test_a_sequence_beyond_the_positions_is_a_clear_warning(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    assert message in out and "WARNING" in out


def test_the_last_position_is_planned_without_a_warning(capsys):
    code, out, err = run(capsys, "gpt2", "--seq", "1024", "--json")
    assert code == 0, err
    assert not any("WARNING" in note for note in json.loads(out)["notes"])


def test_sizes_are_parsed_exactly(capsys):
    code, out, _ = run(capsys, "--params", "1e15", "--precision", "fp32", "--json")
    data = json.loads(out)
    assert code == 0 and data["n_params"] == 10**15 and data["bytes"]["weights"] == 4 * 10**15
    code, out, _ = run(capsys, "--params", "1.5b", "--json")
    assert json.loads(out)["n_params"] == 1_500_000_000


def test_a_model_type_alone_is_not_llama_2_7b(capsys, tmp_path):
    err = refused(capsys, config_file(tmp_path, model_type="llama"))
    assert "no hidden_size, num_hidden_layers, num_attention_heads, vocab_size" in err and "LlamaConfig" in err


@pytest.mark.parametrize(
    "fields, message",
    [
        (
            dict(hidden_size=1000, num_attention_heads=3),
            '"hidden_size" 1000 is not a multiple of "num_attention_heads" 3',
        ),
        (dict(hidden_size="4096"), '"hidden_size" must be a positive whole number'),
        (dict(num_hidden_layers="two"), '"num_hidden_layers" must be a positive whole number'),
    ],
)
def test_config_problems_name_the_field(capsys, tmp_path, fields, message):
    base = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=100)
    assert message in refused(capsys, config_file(tmp_path, **{**base, **fields}))


@pytest.mark.parametrize(
    "fields, kind",
    [
        (
            dict(model_type="bert", hidden_size=64, num_hidden_layers=2, num_attention_heads=2, vocab_size=100),
            "an encoder",
        ),
        (dict(model_type="t5", d_model=64, num_layers=2, num_heads=2, vocab_size=100), "an encoder-decoder"),
        (dict(model_type="vit", hidden_size=64, num_hidden_layers=2, num_attention_heads=2), "not a causal"),
    ],
)
def test_other_architectures_get_one_line(capsys, tmp_path, fields, kind):
    err = refused(capsys, config_file(tmp_path, **fields))
    assert kind in err and "decoder-only causal language models" in err and "--params" in err


def test_a_hub_id_is_loaded_from_the_hub(capsys, tmp_path, monkeypatch):
    """A local folder stands in for the Hub: AutoConfig.from_pretrained reads it for the id."""
    from transformers import AutoConfig

    (tmp_path / "config.json").write_text((CONFIG_DIR / "gpt2.json").read_text())
    real = AutoConfig.from_pretrained.__func__
    asked = []

    def from_hub(cls, name, **kwargs):
        asked.append((name, kwargs))
        return real(cls, str(tmp_path))

    monkeypatch.setattr(model_config, "_hub_reachable", lambda endpoint: True)
    monkeypatch.setattr(AutoConfig, "from_pretrained", classmethod(from_hub))
    code, out, err = run(capsys, "someone/their-gpt2", "--seq", "64", "--json")
    assert code == 0, err
    assert json.loads(out)["n_params"] == PUBLISHED_PARAMETERS["gpt2"]
    assert asked == [("someone/their-gpt2", {"local_files_only": False})]


def test_offline_a_hub_id_says_how_to_pass_a_saved_config(capsys, monkeypatch):
    monkeypatch.setattr(model_config, "_hub_reachable", lambda endpoint: False)
    err = refused(capsys, "meta-llama/Llama-3.1-70B")
    assert "cannot be reached" in err and "save its config.json" in err
    assert "https://huggingface.co/meta-llama/Llama-3.1-70B/blob/main/config.json" in err


def test_the_python_api_picks_the_gpus_precision_like_the_cli():
    """On a GPU target the Trainer's mixed precision (fp16=True on a T4, bf16=True on an A100); without a
    GPU, or with --gpus, the master-copy recipe; a 4-bit base in its compute dtype."""
    assert plan("gpt2", gpu="t4", seq=64).setup.precision == "amp-fp16"
    assert plan("gpt2", gpu="a100-80gb", seq=64).setup.precision == "amp-bf16"
    assert plan("gpt2", seq=64).setup.precision == "mixed-bf16"
    assert plan("gpt2", gpu="a100-80gb", gpus=2, seq=64).setup.precision == "mixed-bf16"
    assert plan("gpt2", lora_rank=4, quant="nf4", seq=64).setup.precision == "bf16"


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(lora_targets=("q_proj",)), "without a LoRA rank"),
        (dict(lora_dropout=0.05), "without a LoRA rank"),
        (dict(optimizer="sgd", adam_state="fp32"), "adam_state applies to"),
        (dict(optimizer="adamw8bit", adam_state="fp32"), "adam_state applies to"),
    ],
)
def test_contradictory_options_are_refused(options, message):
    with pytest.raises(PlanError, match=message):
        plan("gpt2", seq=64, **options)
