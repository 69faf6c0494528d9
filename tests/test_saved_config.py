"""A config kept on disk (models.SavedConfig) reads as the transformers config it was made from, and a
second `course-lib plan` of a model imports neither transformers nor peft (issue 15, lesson 1)."""

import json
import os
import subprocess
import sys

import pytest

from course_lib import cache, cli, models
from course_lib.model_config import SavedConfig, bundled_models, config_class_name, load_config, transformers_config

READ_BY_THE_PLANNER = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
    "max_position_embeddings",
    "tie_word_embeddings",
    "layer_types",
    "n_embd",
    "n_head",
    "n_layer",
    "n_positions",
    "is_encoder_decoder",
    "model_type",
)


@pytest.mark.parametrize("name", bundled_models())
def test_a_saved_config_reads_as_the_config_without_transformers(name):
    config = load_config(name)
    saved = SavedConfig(json.loads(json.dumps(SavedConfig.record_of(config))))  # as read from disk
    names = [
        n
        for n in {*READ_BY_THE_PLANNER, *config.to_dict(), *type(config).attribute_map}
        if not n.startswith("_")
        and hasattr(config, n)
        and saved._record["aliases"].get(n, n) in saved._record["fields"]
    ]
    assert {"hidden_size", "num_hidden_layers", "vocab_size", "max_position_embeddings"} <= set(names)
    for field in names:
        assert getattr(saved, field) == getattr(config, field), field
    assert saved.to_json_string(use_diff=False) == config.to_json_string(use_diff=False)
    assert config_class_name(saved) == type(config).__name__
    assert saved._config is None  # none of it needed the config itself


def test_a_saved_config_is_read_only_and_builds_the_config_for_the_rest():
    saved = SavedConfig(SavedConfig.record_of(load_config("gpt2")))
    with pytest.raises(AttributeError, match="read-only"):
        saved.num_hidden_layers = 2
    assert saved.use_return_dict is True  # a property, not a field: answered by the config itself
    real = transformers_config(saved)
    assert type(real).__name__ == "GPT2Config" and transformers_config(saved) is real
    assert real.to_json_string(use_diff=False) == saved.to_json_string(use_diff=False)
    assert saved.to_dict() == real.to_dict() and saved.to_json_string() == real.to_json_string()


def test_an_edited_config_json_is_read_again(monkeypatch, tmp_path):
    monkeypatch.setenv("COURSE_LIB_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "config.json"
    data = json.loads((models.CONFIG_DIR / "gpt2.json").read_text())
    counts, specs = [], []
    for layers in (2, 3):  # in one process and on disk
        path.write_text(json.dumps({**data, "n_layer": layers}))
        os.utime(path, ns=(layers * 10**9, layers * 10**9))  # edited: another time stamp
        specs.append(models.model_spec(path))
        counts.append(specs[-1].n_params)
        assert specs[-1].n_layers == layers
    assert transformers_config(specs[0].config).n_layer == 2  # the config it was read as, not the edited file
    per_layer = counts[1] - counts[0]
    assert per_layer == 12 * 768 * 768 + 13 * 768  # one GPT-2 block: attention, MLP, two norms


def test_a_second_plan_imports_neither_transformers_nor_peft(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("COURSE_LIB_CACHE_DIR", str(tmp_path))
    argv = ["plan", "gpt2", "--gpu", "t4", "--lora-rank", "8", "--seq", "256"]
    cache.clear_memo()
    assert cli.main(argv) == 0  # the first plan: read, built and traced here, kept in tmp_path
    first = capsys.readouterr().out
    cache.clear_memo()
    code = (
        "import sys; from course_lib import cli; code = cli.main(sys.argv[1:]); "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'transformers', 'peft', 'bitsandbytes'}))"
    )
    second = subprocess.run(
        [sys.executable, "-c", code, *argv],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "COURSE_LIB_CACHE_DIR": str(tmp_path)},
    )
    assert second.stdout.splitlines()[-1] == "[]", second.stdout[-500:]
    assert second.stdout.splitlines()[:-1] == first.splitlines()
