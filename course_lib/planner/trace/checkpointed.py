"""The reserve of a checkpointed step: the step traced with lesson 3's plan applied, its allocations and
frees replayed through the caching allocator's rules (lesson 1, "the planner"; lesson 3). Predicted: a CPU
has no caching allocator; `tests/planner/test_reserved.py` checks that the meta-device trace gives the slack a real
CPU step's stream gives."""

from __future__ import annotations

import contextlib
import warnings

import torch

from course_lib.cache import memo
from course_lib.checkpointing import apply_plan, named_plan
from course_lib.models import ModelSpec
from course_lib.planner.config.errors import PlanError
from course_lib.planner.config.setup import Setup
from course_lib.planner.trace.autocast import MetaAutocast
from course_lib.planner.trace.compose import shallow_depth, shallow_spec
from course_lib.planner.trace.deep_stream import deep_stream, live_peak, mark_positions
from course_lib.planner.trace.kernels import kernels_as_on
from course_lib.planner.trace.model import build_traced_model, decoder_layers, trace_key
from course_lib.planner.trace.toolbox import step_in_backward_hook, traced_loss
from course_lib.planner.trace.tracer import MetaTracer


def checkpointed_stream(spec: ModelSpec, setup: Setup, target: str = "cuda") -> tuple[list[int], int]:
    """The allocation stream of the checkpointed step and its most live bytes (the gradients need no count).
    Every layer checkpointed, the deep model's is built (`planner.trace.deep_stream`) from copies of three and four
    periods of layers (`compose.shallow_depth`); other plans are traced on the three-period copy (their
    segments depend on the depth), as is a model whose copies' streams do not expand; a shallow model, or one
    whose layers do not repeat, in full. Kept for the process (`cache.memo`): the slack, the wrap and the
    limit replay it, and the fit search asks for it again."""
    key = (*trace_key(spec, setup, target), setup.checkpointing)
    return memo("checkpointed-stream", key, lambda: _checkpointed_stream(spec, setup, target))


def _checkpointed_stream(spec: ModelSpec, setup: Setup, target: str) -> tuple[list[int], int]:
    depth = shallow_depth(spec)
    if depth is None:
        traced = checkpointed_tracer(spec, spec, spec.n_layers, setup, target)
        return traced.stream, traced.peak
    small = checkpointed_tracer(spec, shallow_spec(spec, depth), depth, setup, target)
    if setup.checkpointing == "every-layer":
        period = depth // 3
        deep = deep_stream(
            small,
            checkpointed_tracer(spec, shallow_spec(spec, 4 * period), 4 * period, setup, target),
            spec.n_layers,
            period,
        )
        if deep is not None:
            return deep, live_peak(deep)
    return small.stream, small.peak


def checkpointed_tracer(spec: ModelSpec, copy_spec: ModelSpec, depth: int, setup: Setup, target: str) -> MetaTracer:
    """The tracer after the checkpointed step of `copy_spec` (`depth` layers of `spec`)."""
    model = build_traced_model(copy_spec, setup)
    tracer = MetaTracer()
    # the replay in backward runs under autocast too, as torch's checkpoint restores torch.autocast for it
    autocast = None if setup.autocast_dtype is None else MetaAutocast(setup.autocast_dtype, target)
    ids = torch.zeros(setup.batch, setup.seq, dtype=torch.long, device="meta")
    for tensor in [ids, *model.parameters(), *model.buffers()]:
        tracer.exclude(tensor)
    if setup.optimizer_in_backward:  # lesson 7: each tensor's step temporaries, then its gradient freed
        hook = step_in_backward_hook(tracer, model, copy_spec, setup, target == "cuda")
        for param in (p for p in model.parameters() if p.requires_grad):
            param.register_post_accumulate_grad_hook(hook)
    handles = mark_positions(tracer, decoder_layers(model, depth))
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
