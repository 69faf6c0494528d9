"""A deep model's allocation stream built from its shallow copies' (course_lib.planner.trace.deep_stream), and the
composed trace's allocator slack replayed from it: the same stream, entry for entry, and the same slack as
tracing every layer."""

from __future__ import annotations

from dataclasses import replace

import pytest

from course_lib import planner
from course_lib.models import model_spec
from course_lib.planner.trace.compose import composed_trace, shallow_spec
from course_lib.planner.trace.deep_stream import deep_stream, live_peak
from course_lib.planner.trace.step import trace_in_full

CASES = [
    ("qwen2.5-0.5b", dict(precision="bf16", lora_rank=8, seq=128), 1),
    ("gemma-2-2b", dict(precision="amp-bf16", lora_rank=8, seq=128), 2),  # sliding and global layers: period 2
    ("llama-3.2-1b", dict(precision="bf16", quant="nf4", lora_rank=8, loop="keep-outputs", seq=128), 1),
]


@pytest.mark.parametrize("name, options, period", CASES)
def test_the_deep_stream_is_the_full_traces_entry_for_entry(name, options, period):
    spec, setup = model_spec(name), planner.Setup(**options).validate()
    small, large = (trace_in_full(shallow_spec(spec, k * period), setup, "cuda") for k in (3, 4))
    full = trace_in_full(spec, setup, "cuda")
    stream = deep_stream(small, large, spec.n_layers, period)
    assert stream == list(full.stream) and len(stream) > len(large.stream)
    peak = max(full.forward_peak, full.head_backward_peak, full.layer_backward_peak, full.tail_backward_peak)
    assert live_peak(stream) == peak


def test_layers_that_do_not_repeat_give_no_deep_stream():
    spec, setup = model_spec("qwen2.5-0.5b"), planner.Setup(precision="bf16", seq=128).validate()
    small, large = (trace_in_full(shallow_spec(spec, k), setup, "cuda") for k in (3, 4))
    assert deep_stream(small, large, spec.n_layers, 1) is not None
    changed = replace(large, stream=large.stream[:-1] + (large.stream[-1] + 512,))  # one entry of the copy differs
    assert deep_stream(small, changed, spec.n_layers, 1) is None
    assert deep_stream(replace(small, stream_marks=()), large, spec.n_layers, 1) is None


@pytest.mark.parametrize(
    "name, options",
    [
        ("qwen2.5-0.5b", dict(precision="bf16", lora_rank=8, seq=128)),
        # the larger of the copies' slacks was 0.83 GiB here, the full trace's 0.23 (with the cache emptied)
        ("llama-3.2-3b", dict(precision="bf16", batch=4, seq=768, loop="keep-outputs")),
    ],
)
def test_a_composed_traces_slack_is_its_full_traces(name, options):
    spec, setup = model_spec(name), planner.Setup(**options).validate()
    full, composed = trace_in_full(spec, setup, "cuda"), composed_trace(spec, setup, "cuda", trace_in_full)
    assert composed is not None and composed.allocator_slack_emptied > 0
    assert (composed.allocator_slack, composed.allocator_slack_emptied) == (
        full.allocator_slack,
        full.allocator_slack_emptied,
    )


@pytest.mark.parametrize(
    "name, options",
    [
        ("qwen2.5-0.5b", dict(precision="bf16", lora_rank=8, seq=128)),
        (
            "llama-3.2-1b",
            dict(
                precision="bf16",
                quant="nf4",
                lora_rank=8,
                loop="outputs-until-step",
                seq=128,
                legacy_causal_lm_loss=True,
            ),
        ),
    ],
)
def test_the_checkpointed_deep_stream_is_the_full_checkpointed_traces(name, options):
    """Every layer checkpointed, the deep model's stream built from the 3- and 4-layer copies is the stream of
    the checkpointed step traced on every layer, entry for entry; another plan is traced on the 3-layer copy."""
    from course_lib.planner.trace.checkpointed import checkpointed_stream, checkpointed_tracer

    spec = model_spec(name)
    setup = planner.Setup(checkpointing="every-layer", **options).validate()
    full = checkpointed_tracer(spec, spec, spec.n_layers, setup, "cuda")
    stream, peak = checkpointed_stream(spec, setup)
    small = checkpointed_tracer(spec, shallow_spec(spec, 3), 3, setup, "cuda")
    assert stream == list(full.stream) and len(stream) > len(small.stream) and peak == full.peak
    other = replace(setup, checkpointing="every-2")
    assert checkpointed_stream(spec, other)[0] == list(
        checkpointed_tracer(spec, shallow_spec(spec, 3), 3, other, "cuda").stream
    )
