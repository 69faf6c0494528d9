"""Tests of course_lib.models: bundled configs, exact parameter counts, config errors (lesson 1)."""

import json
import re
from types import SimpleNamespace

import pytest
import torch

from course_lib import models
from course_lib.models import PUBLISHED_PARAMETERS, ModelNotFound, bundled_models, count_parameters, model_spec

REQUIRED = [
    "gpt2",
    "gpt2-medium",
    "llama-3.2-1b",
    "llama-3.2-3b",
    "llama-2-7b",
    "llama-3.1-8b",
    "mistral-7b",
    "qwen2.5-0.5b",
    "qwen2.5-1.5b",
    "qwen2.5-7b",
    "phi-3-mini",
    "gemma-2-2b",
]


def test_every_required_model_is_bundled_with_a_published_count_and_hub_id():
    for name in REQUIRED:
        assert name in bundled_models()
    assert set(bundled_models()) == set(PUBLISHED_PARAMETERS) == set(models.HUB_IDS)


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMETERS))
def test_meta_device_count_equals_the_published_count(name):
    assert count_parameters(name) == PUBLISHED_PARAMETERS[name]


def test_the_two_counts_the_brief_quotes():
    assert count_parameters("llama-2-7b") == 6_738_415_616
    assert count_parameters("gpt2") == 124_439_808


def test_tied_embeddings_are_counted_once_and_untied_twice():
    gpt2 = model_spec("gpt2")
    assert not any(p.is_lm_head for p in gpt2.params)  # lm_head *is* wte: one tensor
    llama2 = model_spec("llama-2-7b")
    heads = [p for p in llama2.params if p.is_lm_head]
    assert len(heads) == 1 and heads[0].shape == (32000, 4096)


def test_a_hub_id_and_any_case_name_the_same_model():
    assert count_parameters("meta-llama/Llama-2-7b-hf") == count_parameters("LLAMA-2-7B")


def test_spec_knows_layers_and_module_kinds():
    spec = model_spec("llama-3.2-1b")
    assert spec.n_layers == 16
    kinds = {p.module for p in spec.params}
    assert {"linear", "embedding", "norm"} <= kinds
    assert spec.n_params == sum(p.numel for p in spec.params)


def test_unknown_name_suggests_close_names():
    with pytest.raises(ModelNotFound, match="did you mean llama-2-7b"):
        models.load_config("lama-2-7b")


def test_local_config_file_and_folder(tmp_path):
    data = json.loads((models.CONFIG_DIR / "gpt2.json").read_text())
    data.update(n_layer=2, n_embd=64, n_head=2)
    (tmp_path / "config.json").write_text(json.dumps(data))
    expected = 50257 * 64 + 1024 * 64 + 2 * (12 * 64 * 64 + 13 * 64) + 2 * 64
    assert count_parameters(tmp_path / "config.json") == expected
    assert count_parameters(tmp_path) == expected


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must hold a JSON object"),
        ('{"hidden_size": 8}', 'no "model_type"'),
        ('{"model_type": "no-such-architecture"}', "unknown \"model_type\" 'no-such-architecture'"),
    ],
)
def test_malformed_config_says_what_is_wrong(tmp_path, content, message):
    path = tmp_path / "config.json"
    path.write_text(content)
    with pytest.raises(ModelNotFound, match=message):
        models.load_config(path)


def test_missing_config_file(tmp_path):
    with pytest.raises(ModelNotFound, match="no config file"):
        models.load_config(tmp_path / "nothing" / "config.json")


@pytest.mark.parametrize(
    "fields, suggestion",
    [
        (dict(hidden_size=7, num_attention_heads=8), "heads that divides it (e.g. 7)"),  # the width itself
        (dict(hidden_size=6, num_attention_heads=3, num_key_value_heads=4), "heads that divide it (e.g. 3)"),
    ],
)
def test_the_suggested_divisor_may_be_the_number_itself(tmp_path, fields, suggestion):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(model_type="llama", num_hidden_layers=1, vocab_size=10, **fields)))
    with pytest.raises(ModelNotFound, match=re.escape(suggestion)):
        models.load_config(path)


def test_sdpa_falls_back_to_eager_only_where_the_model_refuses_it_and_other_choices_stay():
    gemma, llama = models.load_config("gemma-2-2b"), models.load_config("llama-3.2-1b")
    assert models.supported_attention(gemma, "sdpa") == "eager"  # Gemma-2's attention caps its logits
    assert models.supported_attention(llama, "sdpa") == "sdpa"
    for requested in ("eager", None):
        assert models.supported_attention(gemma, requested) == requested


def test_the_legacy_loss_upcasts_the_logits_to_fp32_and_returns_them():
    logits = torch.randn(2, 5, 11).bfloat16()

    class Model(torch.nn.Module):
        def forward(self, input_ids, use_cache):
            return SimpleNamespace(logits=logits)

    ids = torch.randint(0, 11, (2, 5))
    loss, outputs = models.legacy_causal_lm_loss(Model(), ids, ids)
    assert outputs.logits.dtype == torch.float32 and loss.dtype == torch.float32
    expected = torch.nn.functional.cross_entropy(logits.float()[:, :-1].reshape(-1, 11), ids[:, 1:].reshape(-1))
    assert torch.equal(loss, expected)
