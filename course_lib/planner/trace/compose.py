"""A deep model's meta-device trace composed, exactly, from the traces of two shallow copies of it
(lesson 1, "the planner"; what makes `course-lib plan` interactive).

Tracing every layer of a 70B model takes seconds; its layers repeat. A copy of the model with 3p and
one with 4p layers (p: the period of the layer types, 2 for Gemma-2's alternating sliding and global
attention, else 1) hold every kind of position a deep model has: the first period, the first and last
periods of the middle, the last period, and what runs before and after the layers. Every quantity of
the trace (each peak at each position, the gradients live at it) grows by the same amount from one period more:
the deep model's value is the shallow one's plus that step times the periods added. The middle
periods in between lie on the same line, so a peak over them is at one of its two ends.
`tests/planner/test_trace_compose.py` checks the result against a full trace, byte for byte, for every
bundled model in several setups; any sign that the layers do not repeat falls back to the full trace.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

from course_lib.caching_allocator import stream_slacks
from course_lib.models import ModelSpec, transformers_config
from course_lib.planner.trace.deep_stream import deep_stream, live_peak

MIN_PERIODS = 6  # shallower models are traced in full: composing would not be faster
# the trace's per-layer tuples (periodic) and the quantities that do not depend on the depth
PER_LAYER = (
    "saved",
    "inputs",
    "backward_climbs",
    "backward_climbs_with_grads",
    "layer_grads",
    "autocast_cached",
    "layer_peak_grads",
)
CONSTANT = ("output", "saved_outside", "dequant_transient", "kept_outputs", "head_grads", "autocast_cached_outside")
LINEAR = ("gradients", "offloaded")  # totals that grow by the same step with every period
# what the caching allocator reserves beyond the peak (planner.allocator.reserved) does not grow linearly with the
# depth: it is replayed from the deep model's allocation stream (planner.trace.deep_stream); where that cannot be
# built, the larger of the two copies' is taken (an approximation: 0.83 against 0.23 GiB for llama-3.2-3b's
# full bf16 step at 4 x 768 with the cache emptied between steps)
APPROXIMATE = ("allocator_slack", "allocator_slack_emptied")


def layer_period(config) -> int | None:
    """The period of the config's `layer_types` (1 without them); None if they do not repeat."""
    types = list(getattr(config, "layer_types", None) or [])
    if not types:
        return 1
    for period in range(1, len(types) // MIN_PERIODS + 1):
        if all(kind == types[i % period] for i, kind in enumerate(types)):
            return period
    return None


def shallow_depth(spec: ModelSpec) -> int | None:
    """The layers of a shallow copy that holds every kind of position of the model (three periods of its
    layer types), None when the model is traced in full: shallow, of layers that do not repeat, or with
    a per-layer list besides layer_types (`step_trace.StepTrace.checkpointed_slack`'s copy)."""
    n, period = spec.n_layers, layer_period(spec.config)
    if n is None or period is None or _per_layer_lists(spec.config, n) or n % period or n < MIN_PERIODS * period:
        return None
    return 3 * period


def shallow_spec(spec: ModelSpec, n_layers: int) -> ModelSpec:
    """The same model with its first `n_layers` decoder layers (same parameter list: the trace uses
    it only for the frozen weights' shapes)."""
    config = copy.deepcopy(transformers_config(spec.config))
    config.num_hidden_layers = n_layers  # GPT-2's config maps it to n_layer
    if getattr(config, "layer_types", None):
        config.layer_types = list(config.layer_types)[:n_layers]
    return ModelSpec(spec.name, config, spec.params)


def _per_layer_lists(config, n_layers: int) -> bool:
    """Whether the config has a per-layer list besides layer_types (then layers may differ)."""
    return any(
        isinstance(value, (list, tuple)) and len(value) == n_layers and key != "layer_types"
        for key, value in config.to_dict().items()
    )


def _classes(index, n_layers: int, period: int) -> list[tuple[str, int | str]]:
    """The position classes of a layer index (or "pre"/"post") in a model of n_layers."""
    if isinstance(index, str):
        return [(index, 0)]
    found = []
    for name, start in (
        ("first", 0),
        ("middle-first", period),
        ("middle-last", n_layers - 2 * period),
        ("last", n_layers - period),
    ):
        if start <= index < start + period:
            found.append((name, index - start))
    return found


def _by_class(trace, n_layers: int, period: int) -> dict[tuple, tuple[int, int, int]]:
    values: dict[tuple, tuple[int, int, int]] = {}
    for (phase, index), peaks in trace.by_position.items():
        for cls in _classes(index, n_layers, period):
            values[(phase, *cls)] = peaks
    return values


def _periodic(a: tuple, b: tuple, period: int, n_layers: int) -> tuple | None:
    """The per-layer tuple of the deep model from those of the 3p- and 4p-layer copies, or None."""
    first, middle, last = b[:period], b[period : 2 * period], b[3 * period :]
    if a != first + middle + last or b[2 * period : 3 * period] != middle:
        return None
    return first + middle * (n_layers // period - 2) + last


def composed_trace(spec: ModelSpec, setup, target: str, trace: Callable):
    """The trace of `spec` composed from `trace` (`trace._trace`) of two shallow copies, or None when
    the model is shallow or its layers do not visibly repeat (then trace it in full).

    Layers of two alternating types (Gemma-2's sliding and global attention) that keep the same bytes
    repeat with period 1: the 3- and 4-layer copies, half as many layers as period 2 asks, are tried
    first; the 4-layer copy's two middle layers, one of each type, show whether they differ. Where
    those two layers do not hold every type (Gemma-3's five sliding to one global), the types'
    period is used."""
    n, period = spec.n_layers, layer_period(spec.config)
    if n is None or period is None or _per_layer_lists(spec.config, n):
        return None
    if setup.offload_activations:  # what is saved lives on the host: each layer's backward climb above what
        return None  # the cost model counts on the GPU falls with its depth, so the copies never compose
    types = list(getattr(spec.config, "layer_types", None) or [])
    first_try = 1 if set(types[1:3]) == set(types) else period
    for candidate in sorted({first_try, period}):
        if n % candidate == 0 and n >= MIN_PERIODS * candidate:
            composed = _composed(spec, setup, target, trace, n, candidate)
            if composed is not None:
                return composed
    return None


def _composed(spec: ModelSpec, setup, target: str, trace: Callable, n: int, period: int):
    small, large = 3 * period, 4 * period
    a, b = trace(shallow_spec(spec, small), setup, target), trace(shallow_spec(spec, large), setup, target)
    per_layer = {name: _periodic(getattr(a, name), getattr(b, name), period, n) for name in PER_LAYER}
    if None in per_layer.values() or [getattr(a, name) for name in CONSTANT] != [getattr(b, name) for name in CONSTANT]:
        return None
    steps = (n - small) // period
    class_a, class_b = _by_class(a, small, period), _by_class(b, large, period)
    if set(class_a) != set(class_b):
        return None
    peaks: dict[str, list[int]] = {}  # phase -> [peak, peak without gradients, gradients at the peak]
    for key, values_a in class_a.items():
        with_, without, grads = (a + (b - a) * steps for a, b in zip(values_a, class_b[key]))
        best = peaks.setdefault(key[0], [0, 0, 0])
        if with_ > best[0]:
            best[0], best[2] = with_, grads
        best[1] = max(best[1], without)

    def peak(phase: str, which: int) -> int:
        return peaks.get(phase, [0, 0, 0])[which]

    return type(a)(  # a Trace (planner.trace.step), as `trace` makes them
        forward_peak=peak("forward", 0),
        head_backward_peak=peak("head_backward", 0),
        layer_backward_peak=peak("layer_backward", 0),
        tail_backward_peak=peak("tail_backward", 0),
        forward_peak_without_grads=peak("forward", 1),
        head_backward_peak_without_grads=peak("head_backward", 1),
        layer_backward_peak_without_grads=peak("layer_backward", 1),
        tail_backward_peak_without_grads=peak("tail_backward", 1),
        forward_peak_grads=peak("forward", 2),
        head_backward_peak_grads=peak("head_backward", 2),
        layer_backward_peak_grads=peak("layer_backward", 2),
        tail_backward_peak_grads=peak("tail_backward", 2),
        **per_layer,
        **{name: getattr(a, name) + (getattr(b, name) - getattr(a, name)) * steps for name in LINEAR},
        **_slacks(a, b, n, period),
        **{name: getattr(a, name) for name in CONSTANT},
    )


def _slacks(a, b, n: int, period: int) -> dict[str, int]:
    """The allocator's slack of the deep model, from its stream where it can be built (planner.trace.deep_stream),
    and that stream (`Trace.stream`, in memory only)."""
    stream = deep_stream(a, b, n, period)
    if stream is None:  # the copies' own, replayed from their streams (their traces leave them out)
        replayed = [stream_slacks(copied.stream, live_peak(copied.stream)) for copied in (a, b)]
        return {name: max(each[name] for each in replayed) for name in APPROXIMATE}
    return {**stream_slacks(stream, live_peak(stream)), "stream": tuple(stream)}
