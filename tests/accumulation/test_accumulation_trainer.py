"""Lesson 2 cross-check: the reference loop against Hugging Face's Trainer (gradient_accumulation_steps).

A tiny Llama built from a config (random weights, nothing downloaded), generated variable-length
sequences padded per micro-batch, the same initial weights, optimizer, schedule and clipping for all
runs; 11 micro-batches with K=4, so the last window is short.
"""

import pytest

pytest.importorskip("transformers")

from course_lib.accumulation import trainer_cross_check  # noqa: E402


@pytest.fixture(scope="module")
def cross_check():
    return trainer_cross_check()


def test_reference_loop_ends_with_the_trainers_weights(cross_check):
    assert cross_check.optimizer_steps == 3 and cross_check.micro_batches == 11
    assert cross_check.reference_vs_initial > 1e-2, "training must move the weights for the comparison to mean anything"
    assert cross_check.reference_vs_trainer < 1e-5, "same final weights, within fp32 rounding"


def test_naive_per_micro_batch_mean_does_not(cross_check):
    assert cross_check.naive_vs_trainer > 1e-2
    assert cross_check.naive_vs_trainer > 1000 * max(cross_check.reference_vs_trainer, 1e-9)


def test_the_report_reads(cross_check):
    text = str(cross_check)
    assert "reference loop vs Trainer" in text and "naive" in text
