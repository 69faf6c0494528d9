"""The trace stage's one value (lesson 1, "the planner"): a request's traced step, built once and handed to
the stages after it (the phases, the reserve, the FSDP wrap, the OOM line), which read its trace, replay its
allocation stream and keep their answers under its key."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from course_lib.cache import cached_answer, memo
from course_lib.caching_allocator import stream_slack
from course_lib.models import ModelSpec
from course_lib.planner.config.setup import Setup
from course_lib.planner.trace.checkpointed import checkpointed_stream
from course_lib.planner.trace.model import trace_key
from course_lib.planner.trace.step import Trace, step_stream, trace_step


@dataclass(frozen=True)
class StepTrace:
    """One training step of `spec` in `setup` traced on the meta device for `target` ("cuda" or "cpu"):
    `trace` its peaks and what each layer saves; `key` what it depends on (`model.trace_key`)."""

    spec: ModelSpec
    setup: Setup
    target: str
    trace: Trace
    key: tuple

    def stream(self) -> list[int]:
        """The step's allocation stream as planned: the checkpointed step's under a checkpointing plan
        (`checkpointed.checkpointed_stream`), else the plain step's (`step.step_stream`)."""
        if self.setup.checkpointing != "none":
            return checkpointed_stream(self.spec, self.setup, self.target)[0]
        return memo("step-stream", self.key, lambda: step_stream(self.spec, self.setup, self.target))

    def checkpointed_slack(self) -> int | None:
        """What the caching allocator reserves beyond the peak for the step checkpointed as the setup plans
        it (lesson 3's plan applied by `course_lib.checkpointing.apply_plan`), replayed twice as the plain
        step's is (`Trace.allocator_slack`), the cache emptied in between under `empty_cache_each_step`;
        None without a plan. Predicted: a CPU has no caching allocator."""
        if self.setup.checkpointing == "none":
            return None
        empty = self.setup.empty_cache_each_step
        return self.answer(
            "slack",
            ("checkpointed", self.setup.checkpointing, empty),
            lambda: stream_slack(*checkpointed_stream(self.spec, self.setup, self.target), empty),
        )

    def answer(self, kind: str, extra: tuple, make: Callable):
        """A plain JSON value of a later stage that depends on this trace and on `extra` (the setup's fields
        it reads besides the trace's): from the disk cache (`course_lib.cache`), or `make()` kept there."""
        return cached_answer(kind, repr((*self.key, *extra)), make)


def trace_request(spec: ModelSpec, setup: Setup, target: str) -> StepTrace:
    """The request's step traced once (`step.trace_step`): PlanError, one line, where it cannot be."""
    return StepTrace(spec, setup, target, trace_step(spec, setup, target), trace_key(spec, setup, target))
