"""The fit search skips a trick known to save nothing (planner.search.fit's `_cannot_save`): each one it
skips, planned anyway, saves nothing worth saying, and the search still skips some."""

from __future__ import annotations

from dataclasses import replace

import pytest

from course_lib.models import model_spec
from course_lib.planner import PlanError, Setup
from course_lib.planner.config.gpus import get_gpu
from course_lib.planner.predict import predict
from course_lib.planner.search.fit import _candidate_tricks, _cannot_save, _saves_enough, _with

CASES = [  # (model, setup): peaks in the optimizer step, in backward, and in between
    ("gpt2", Setup(precision="mixed-fp16", batch=4, seq=256)),
    ("gpt2", Setup(precision="mixed-fp16", optimizer="adamw_fused", batch=4, seq=256)),
    ("qwen2.5-0.5b", Setup(precision="fp16", lora_rank=16, batch=2, seq=512)),
    ("llama-3.2-1b", Setup(precision="amp-fp16", optimizer="adamw_fused", seq=512)),
    ("llama-3.2-1b", Setup(precision="amp-fp16", optimizer="adamw8bit", seq=512, batch=2)),
    ("llama-3.1-8b", Setup(precision="amp-fp16", optimizer="adamw_fused", seq=512)),
    ("gpt2-medium", Setup(precision="mixed-fp16", batch=2, seq=128)),
    ("qwen2.5-1.5b", Setup(precision="amp-fp16", seq=256)),
]


@pytest.mark.slow
def test_every_trick_the_search_skips_saves_nothing():
    card, skipped, planned = get_gpu("t4"), 0, 0
    for name, setup in CASES:
        spec = model_spec(name)
        current = predict(spec, setup.validate(), card)
        for _, nxt, _ in _candidate_tricks(setup, card):
            change = {key: value for key, value in vars(nxt).items() if getattr(setup, key) != value}
            try:
                after = predict(spec, _with(setup, [change]), card)
            except PlanError:  # a combination the planner refuses: the search passes it by too
                continue
            planned += 1
            if _cannot_save(current, change):
                skipped += 1
                assert not _saves_enough(current, after), (name, change)
    assert skipped >= 6 and planned > skipped


def test_a_trick_beyond_activations_is_never_skipped():
    card = get_gpu("t4")
    setup = Setup(precision="mixed-fp16", seq=256)
    current = predict(model_spec("gpt2"), setup, card)
    assert _cannot_save(current, {"checkpointing": "every-layer"})  # the optimizer step holds the peak
    assert not _cannot_save(current, {"checkpointing": "every-layer", "optimizer": "adamw_fused"})
    assert not _cannot_save(current, {"optimizer_in_backward": True})
    lower = predict(model_spec("gpt2"), replace(setup, optimizer="adamw_fused", batch=16, seq=1024), card)
    assert lower.detail["peak_phase"] != "optimizer step"
    assert not _cannot_save(lower, {"checkpointing": "every-layer"})  # activations hold the peak
