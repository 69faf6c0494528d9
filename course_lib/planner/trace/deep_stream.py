"""A deep model's allocation stream built from a shallow copy's (lesson 1, "the planner"): what the caching
allocator's replay (`caching_allocator.stream_slack`) needs for a model whose trace is composed
(`planner.trace.compose`), without tracing every layer.

A copy of three periods of layers has one middle period; the stream's entries are cut into runs by the
(phase, position) the tracer was in when it recorded them (`MetaTracer.stream_marks`). The deep stream is
the copy's with the middle period's runs repeated once per middle period of the deep model (ascending in
forward, descending in backward); the runs before the layers ("pre") stay, those after them ("post") and
of the last period move to the deep model's end. A free names its allocation by the run that made it and
its place there: the same run, shifted as far as the freeing run is. The rule is checked before it is
used: the three-period copy's stream expanded to four periods must be the four-period copy's, entry for
entry; where it is not (layers that do not repeat), there is no deep stream and the caller approximates.
"""

from __future__ import annotations

from collections import Counter

import torch


def deep_stream(small, large, n_layers: int, period: int) -> list[int] | None:
    """The stream of `n_layers` layers from the traces of the 3p- and 4p-layer copies (`small`, `large`:
    each with `stream` and `stream_marks`), or None when expanding `small` does not give `large`'s."""
    if not small.stream_marks or not large.stream_marks:
        return None
    check = _expand(small.stream, small.stream_marks, 4, period)
    if check is None or check != list(large.stream):
        return None
    return _expand(small.stream, small.stream_marks, n_layers // period, period)


def live_peak(stream: list[int]) -> int:
    """The most bytes the stream holds at once."""
    sizes, live, peak = [], 0, 0
    for entry in stream:
        if entry >= 0:
            sizes.append(entry)
            live += entry
            peak = max(peak, live)
        else:
            live -= sizes[~entry]
    return peak


def _runs(stream, marks) -> list[tuple[str, int | str, list[int]]]:
    """The stream cut at its marks: (phase, position, entries) in order."""
    cuts = [(int(start), phase, position) for start, phase, position in marks] + [(len(stream), None, None)]
    return [
        (phase, position, list(stream[start:end]))
        for (start, phase, position), (end, _, _) in zip(cuts, cuts[1:])
        if end > start
    ]


def _expand(stream, marks, units: int, period: int) -> list[int] | None:
    """The stream of a copy with three periods of layers, expanded to `units` periods; None where a free
    names an allocation the expansion does not make."""
    runs = _runs(stream, marks)
    periods = [position // period if isinstance(position, int) else None for _, position, _ in runs]
    owner: list[tuple[int, int]] = []  # each allocation of the copy: (its run, its place in the run)
    for index, (_, _, entries) in enumerate(runs):
        owner += [(index, place) for place in range(sum(1 for entry in entries if entry >= 0))]
    roles, seen = [], Counter()  # a run's role: what it is within its period, the same in every period
    for (phase, position, _), unit in zip(runs, periods):
        where = (phase, position % period if unit is not None else position)
        seen[(*where, unit)] += 1
        roles.append((*where, seen[(*where, unit)]))
    order: list[tuple[int, int | None]] = []  # (run of the copy, its period in the deep model) in the deep order
    index = 0
    while index < len(runs):
        if periods[index] == 1:  # the middle period: its runs once per middle period, down in backward
            end = index
            while end < len(periods) and periods[end] == 1:
                end += 1
            deep = range(1, units - 1) if runs[index][0] == "forward" else range(units - 2, 0, -1)
            order += [(run, unit) for unit in deep for run in range(index, end)]
            index = end
        else:
            order.append((index, None if periods[index] is None else (0, None, units - 1)[periods[index]]))
            index += 1
    made_at: dict[tuple, list[int]] = {}  # (role, deep period or None) -> the deep stream's allocation indices
    out: list[int] = []
    made = 0
    for run, unit in order:
        mine = made_at.setdefault((roles[run], unit), [])
        for entry in runs[run][2]:
            if entry >= 0:
                mine.append(made)
                made += 1
                out.append(entry)
                continue
            source, place = owner[~entry]
            found = made_at.get((roles[source], _target(periods[source], periods[run], unit, runs[run][1], units)))
            if found is None or place >= len(found):
                return None
            out.append(~found[place])
    return out


def _target(source: int | None, freeing: int | None, unit: int | None, position, units: int) -> int | None:
    """The deep period of a freed allocation made in the copy's period `source`, freed by a run of the
    copy's period `freeing` placed at the deep period `unit` (or outside the layers, at `position`)."""
    if source is None:
        return None
    if freeing is not None:
        return unit + source - freeing  # as far from the freeing run as in the copy
    return (0, 1 if position == "pre" else units - 2, units - 1)[source]


def mark_positions(tracer, layers, on_backward=None) -> list:
    """Hooks on the decoder `layers` that mark the tracer's stream (`planner.trace.tracer.MetaTracer.set_phase`) by (phase,
    layer), as `deep_stream` cuts it: a layer's forward at its index, its backward from its output's gradient
    on (`on_backward(index)` called there first; the tail's index is len(layers)); a checkpointed layer's
    replay in backward stays in the backward's mark."""
    last = len(layers) - 1

    def starts(index: int, phase: str | None, position):
        def hook(grad):
            if on_backward is not None:
                on_backward(index)
            tracer.set_phase(phase or tracer.phase, position)

        return hook

    def pre_hook(index):
        def hook(module, args, kwargs):
            if torch._C._current_graph_task_id() != -1:  # the replay in backward
                return
            tracer.set_phase(tracer.phase, index)
            hidden = args[0] if args else kwargs.get("hidden_states")
            if index == 0 and hidden.requires_grad:  # its gradient: the layers' backward is over
                hidden.register_hook(starts(len(layers), "tail_backward", "pre"))

        return hook

    def post_hook(index):
        def hook(module, args, result):
            if torch._C._current_graph_task_id() != -1:
                return
            hidden = result[0] if isinstance(result, (tuple, list)) else result
            if index == last:
                tracer.set_phase(tracer.phase, "post")
            if hidden.requires_grad:  # its gradient: layer index's backward starts
                hidden.register_hook(starts(index, "layer_backward" if index == last else None, index))

        return hook

    return [
        handle
        for index, layer in enumerate(layers)
        for handle in (
            layer.register_forward_pre_hook(pre_hook(index), with_kwargs=True),
            layer.register_forward_hook(post_hook(index)),
        )
    ]
