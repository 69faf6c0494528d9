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
from course_lib.memory.autocast import MetaAutocast
from course_lib.memory.compose import shallow_depth, shallow_spec
from course_lib.memory.meta_kernels import kernels_as_on
from course_lib.memory.reserved import stream_slack
from course_lib.memory.setup import PlanError, Setup
from course_lib.memory.toolbox import step_in_backward_hook, traced_loss
from course_lib.memory.trace import _build_traced_model, _MetaTracer, _trace_key
from course_lib.models import ModelSpec

_SLACKS: dict[tuple, int] = {}  # checkpointed_slack's, by trace key and plan


def checkpointed_slack(spec: ModelSpec, setup: Setup, target: str = "cuda") -> int:
    """What the caching allocator reserves beyond the peak for the step checkpointed as `setup.checkpointing`
    plans it (lesson 3's plan applied by `course_lib.checkpointing.apply_plan`), its allocations and frees
    replayed twice as `stream_slack` replays the plain step's (`Trace.allocator_slack`; lesson 1, "the
    planner"), the cache emptied in between under `setup.empty_cache_each_step`. Traced on a copy of three
    periods of layers (`compose.shallow_depth`; the whole model when it is shallow or its layers do not
    repeat): the slack comes from the output layer and the loss, whose
    blocks checkpointing leaves as they are (the same within 5% for 3 and 4 layers of Llama-2-7B), not from
    the layers' activations that it frees. PlanError, one line, for a model the plan cannot be applied to.
    Predicted: CPU has no caching allocator."""
    key = (*_trace_key(spec, setup, target), "checkpointed", setup.checkpointing, setup.empty_cache_each_step)
    if key not in _SLACKS:
        _SLACKS[key] = cached_answer("slack", repr(key), lambda: _checkpointed_slack(spec, setup, target))
    return _SLACKS[key]


def _checkpointed_slack(spec: ModelSpec, setup: Setup, target: str) -> int:
    depth = shallow_depth(spec) or spec.n_layers
    copy_spec = spec if depth == spec.n_layers else shallow_spec(spec, depth)
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
    try:
        apply_plan(model, named_plan(depth, setup.checkpointing), recompute_context=autocast and (lambda: autocast))
        with warnings.catch_warnings(), kernels_as_on(target, autocast), tracer:
            warnings.simplefilter("ignore")
            with autocast or contextlib.nullcontext():
                loss, outputs = traced_loss(model, ids, setup, autocast)
            if setup.loop == "trainer":
                del outputs
            loss.backward()
            del loss
    except Exception as error:  # an architecture the plan cannot be applied to on the meta device: say which
        reason = " ".join(str(error).split())[:300]
        raise PlanError(f"cannot trace {spec.name}'s step checkpointed as {setup.checkpointing!r} on the meta device "
                        f"({type(error).__name__}: {reason}); plan without --gpu for the allocated bytes") from None
    # the stream and its peak: gradients need no count
    return stream_slack(tracer.stream, tracer.peak, setup.empty_cache_each_step)
