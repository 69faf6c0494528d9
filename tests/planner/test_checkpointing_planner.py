"""The planner plans gemma-2-2b (eager attention, said in a note) without a transformers warning (lesson 3)."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.slow
def test_gemma2_plans_with_eager_attention_and_a_clean_output():
    result = subprocess.run(
        [sys.executable, "-m", "course_lib.cli", "plan", "gemma-2-2b", "--gpu", "t4", "--checkpointing", "every-layer"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    assert "attention: eager" in result.stdout and "does not support sdpa" in result.stdout
    assert "checkpointing every-layer: recomputes 100%" in result.stdout
    assert result.stderr == ""


def test_supported_attention_keeps_sdpa_where_it_runs():
    from course_lib.models import load_config, supported_attention

    assert supported_attention(load_config("llama-3.2-1b"), "sdpa") == "sdpa"
    assert supported_attention(load_config("gemma-2-2b"), "sdpa") == "eager"
    assert supported_attention(load_config("gemma-2-2b"), "eager") == "eager"
