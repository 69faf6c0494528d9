"""The reserve of a checkpointed step: the step traced with lesson 3's plan applied, its allocations and
frees replayed through the caching allocator's rules (lesson 1, "the planner"; lesson 3). Predicted: a CPU
has no caching allocator; `tests/test_reserved.py` checks that the meta-device trace gives the slack a real
CPU step's stream gives."""

from __future__ import annotations

import contextlib
import warnings

import torch

from course_lib.cache import cached_answer
from course_lib.checkpointing import apply_plan, named_plan
from course_lib.models import ModelSpec
from course_lib.planner.allocator.reserved import stream_slack
from course_lib.planner.config.setup import PlanError, Setup
from course_lib.planner.trace.autocast import MetaAutocast
from course_lib.planner.trace.compose import shallow_depth, shallow_spec
from course_lib.planner.trace.deep_stream import deep_stream, live_peak, mark_positions
from course_lib.planner.trace.kernels import kernels_as_on
from course_lib.planner.trace.step import _build_traced_model, _decoder_layers, _MetaTracer, _trace_key, step_stream
from course_lib.planner.trace.toolbox import step_in_backward_hook, traced_loss

_SLACKS: dict[tuple, int] = {}  # checkpointed_slack's, by trace key and plan
_STREAMS: dict[tuple, tuple[list[int], int]] = {}  # checkpointed_stream's, by trace key and plan


def checkpointed_slack(spec: ModelSpec, setup: Setup, target: str = "cuda") -> int:
    """What the caching allocator reserves beyond the peak for the step checkpointed as `setup.checkpointing`
    plans it (lesson 3's plan applied by `course_lib.checkpointing.apply_plan`), its allocations and frees
    replayed twice as `stream_slack` replays the plain step's (`Trace.allocator_slack`; lesson 1, "the
    planner"), the cache emptied in between under `setup.empty_cache_each_step`, from `checkpointed_stream`.
    PlanError, one line, for a model the plan cannot be applied to.
    Predicted: CPU has no caching allocator."""
    key = (*_trace_key(spec, setup, target), "checkpointed", setup.checkpointing, setup.empty_cache_each_step)
    if key not in _SLACKS:
        _SLACKS[key] = cached_answer(
            "slack",
            repr(key),
            lambda: stream_slack(*checkpointed_stream(spec, setup, target), setup.empty_cache_each_step),
        )
    return _SLACKS[key]


def planned_stream(spec: ModelSpec, setup: Setup, target: str = "cuda") -> list[int]:
    """The allocation stream of the step as planned: the checkpointed step's under a checkpointing plan, else
    the plain step's (`trace.step_stream`)."""
    if setup.checkpointing != "none":
        return checkpointed_stream(spec, setup, target)[0]
    return step_stream(spec, setup, target)


def checkpointed_stream(spec: ModelSpec, setup: Setup, target: str = "cuda") -> tuple[list[int], int]:
    """The allocation stream of the checkpointed step and its most live bytes (the gradients need no count).
    Every layer checkpointed, the deep model's is built (`planner.trace.deep_stream`) from copies of three and four
    periods of layers (`compose.shallow_depth`); other plans are traced on the three-period copy (their
    segments depend on the depth), as is a model whose copies' streams do not expand; a shallow model, or one
    whose layers do not repeat, in full. Kept for the process: the slack, the wrap and the limit replay it."""
    key = (*_trace_key(spec, setup, target), setup.checkpointing)
    if key not in _STREAMS:
        _STREAMS[key] = _checkpointed_stream(spec, setup, target)
    return _STREAMS[key]


def _checkpointed_stream(spec: ModelSpec, setup: Setup, target: str) -> tuple[list[int], int]:
    depth = shallow_depth(spec)
    if depth is None:
        traced = _traced(spec, spec, spec.n_layers, setup, target)
        return traced.stream, traced.peak
    small = _traced(spec, shallow_spec(spec, depth), depth, setup, target)
    if setup.checkpointing == "every-layer":
        period = depth // 3
        deep = deep_stream(
            small, _traced(spec, shallow_spec(spec, 4 * period), 4 * period, setup, target), spec.n_layers, period
        )
        if deep is not None:
            return deep, live_peak(deep)
    return small.stream, small.peak


def _traced(spec: ModelSpec, copy_spec: ModelSpec, depth: int, setup: Setup, target: str) -> _MetaTracer:
    """The tracer after the checkpointed step of `copy_spec` (`depth` layers of `spec`)."""
    model = _build_traced_model(copy_spec, setup)
    tracer = _MetaTracer()
    # the replay in backward runs under autocast too, as torch's checkpoint restores torch.autocast for it
    autocast = None if setup.autocast_dtype is None else MetaAutocast(setup.autocast_dtype, target)
    ids = torch.zeros(setup.batch, setup.seq, dtype=torch.long, device="meta")
    for tensor in [ids, *model.parameters(), *model.buffers()]:
        tracer.exclude(tensor)
    if setup.optimizer_in_backward:  # lesson 7: each tensor's step temporaries, then its gradient freed
        hook = step_in_backward_hook(tracer, model, copy_spec, setup, target == "cuda")
        for param in (p for p in model.parameters() if p.requires_grad):
            param.register_post_accumulate_grad_hook(hook)
    handles = mark_positions(tracer, _decoder_layers(model, depth))
    try:
        apply_plan(model, named_plan(depth, setup.checkpointing), recompute_context=autocast and (lambda: autocast))
        with warnings.catch_warnings(), kernels_as_on(target, autocast), tracer:
            warnings.simplefilter("ignore")
            with autocast or contextlib.nullcontext():
                loss, outputs = traced_loss(model, ids, setup, autocast)
            if setup.loop == "trainer":
                del outputs
            tracer.set_phase("head_backward")
            loss.backward()
            del loss
    except Exception as error:  # an architecture the plan cannot be applied to on the meta device: say which
        reason = " ".join(str(error).split())[:300]
        raise PlanError(
            f"cannot trace {spec.name}'s step checkpointed as {setup.checkpointing!r} on the meta device "
            f"({type(error).__name__}: {reason}); plan without --gpu for the allocated bytes"
        ) from None
    finally:
        for handle in handles:
            handle.remove()
    return tracer
