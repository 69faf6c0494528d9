"""Checkpoint plans and their cost model (lesson 3, "plans" and "the cost model").

A stack of `n` layers (0 .. n-1) is checkpointed by a *plan*: a list of half-open segments
`(start, end)`, sorted and disjoint. Each segment, layers start .. end-1, runs under one
`torch.utils.checkpoint.checkpoint`: its forward keeps only its input; its backward runs the segment's
forward again (the recompute), then its backward. Layers outside every segment run normally, so a
plan may leave layers unchecked before, between and after its segments.

    []                              no checkpointing
    [(0, 1), (1, 2), ..., (n-1, n)] every layer its own segment (Hugging Face's one-liner)
    [(0, 4), (4, 8), (8, 12), (12, 16)]  n = 16, "every-4": four segments, all checkpointed
    [(0, 4), (4, 8), (8, 12)]       n = 16, "sqrt": layers 12 .. 15 run normally
                                    (`checkpoint_sequential(layers, 4, x)` does the same)
    [(0, 1), (2, 3), (4, 5)]        n = 6, "hf-every-2": Hugging Face's every_n_layers=2, layers 0, 2
                                    and 4 checkpointed alone, 1, 3 and 5 unchecked
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from course_lib import validate
from course_lib.errors import UserError
from course_lib.validate import checked

Plan = list[tuple[int, int]]
PLAN_NAMES = ("none", "every-layer", "sqrt", "every-K", "hf-every-K")


def check_layer_count(n_layers) -> None:
    if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers < 1:
        raise UserError(f"n_layers must be a positive integer, got {n_layers!r}")


def named_plan(n_layers: int, name: str) -> Plan:
    """The segments of a named plan for a stack of `n_layers` layers (lesson 3, "plans").

    - "none": [] (nothing checkpointed).
    - "every-layer": each layer its own segment (Hugging Face's `gradient_checkpointing_enable()`).
    - "every-K" (e.g. "every-2"): segments of K layers from layer 0, all checkpointed; the last one is
      shorter when K does not divide n.
    - "sqrt" (Chen et al. 2016): k = round(sqrt(n)) segments of as equal a size as possible, the last
      one unchecked (its backward comes right after the forward: checkpointing it would recompute it
      for no memory saved). Recompute cost (k-1)/k of one forward for equal layers.
    - "hf-every-K": Hugging Face's `every_n_layers=K`: layers 0, K, 2K, ... each checkpointed alone,
      the others unchecked.
    """
    check_layer_count(n_layers)
    if not isinstance(name, str):
        raise UserError(f"plan must be a string, one of {', '.join(PLAN_NAMES)}; got {name!r}")
    key = name.strip().lower()
    if key == "none":
        return []
    if key == "every-layer":
        return [(i, i + 1) for i in range(n_layers)]
    if key == "sqrt":
        return segments_plan(n_layers, max(1, round(math.sqrt(n_layers))))
    match = re.fullmatch(r"(hf-)?every-(\d+)", key)
    if match:
        size = int(match.group(2))
        if size < 1:
            raise UserError(f"plan {name!r}: K in every-K must be at least 1")
        if match.group(1):
            return [(i, i + 1) for i in range(0, n_layers, size)]
        return [(i, min(i + size, n_layers)) for i in range(0, n_layers, size)]
    raise UserError(
        f"unknown checkpointing plan {name!r}: use one of none, every-layer, sqrt, every-K, "
        f"hf-every-K (K a positive integer, e.g. every-2)"
    )


@checked
def segments_plan(n_layers: int, k: int, *, checkpoint_last: bool = False) -> Plan:
    """k contiguous segments of near-equal size covering the stack, larger ones first (lesson 3, "the
    U-shaped curve").

    With `checkpoint_last=False` (the default, like `checkpoint_sequential`) the last segment runs
    normally: k = 1 is then no checkpointing.
    """
    check_layer_count(n_layers)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n_layers:
        raise UserError(f"k must be an integer from 1 to n_layers={n_layers}, got {k!r}")
    size, extra = divmod(n_layers, k)
    segments, at = [], 0
    for j in range(k):
        end = at + size + (1 if j < extra else 0)
        segments.append((at, end))
        at = end
    return segments if checkpoint_last else segments[:-1]


@checked
def validate_plan(plan, n_layers: int) -> Plan:
    """`plan` as a list of (start, end) tuples, or ValueError saying what is wrong with it (lesson 3)."""
    if isinstance(plan, str):
        return named_plan(n_layers, plan)
    try:
        pairs = [tuple(segment) for segment in plan]
    except TypeError:
        raise UserError(f"a plan is a list of (start, end) segments or a plan name, got {plan!r}") from None
    for pair in pairs:
        if len(pair) != 2 or any(isinstance(v, bool) or not isinstance(v, int) for v in pair):
            raise UserError(f"each segment is a pair of integers (start, end), got {pair!r} in {plan!r}")
    segments = [(int(a), int(b)) for a, b in pairs]
    for a, b in segments:
        if not 0 <= a < b <= n_layers:
            raise UserError(
                f"segment ({a}, {b}) out of range: a stack of {n_layers} layers takes segments "
                f"(start, end) with 0 <= start < end <= {n_layers} (end exclusive)"
            )
    for (a, b), (c, d) in zip(segments, segments[1:]):
        if c < b:
            raise UserError(
                f"segments ({a}, {b}) and ({c}, {d}) are not sorted and disjoint: each segment "
                "starts at or after the end of the one before"
            )
    return segments


@checked
@dataclass(frozen=True)
class PlanCost:
    """What a checkpoint plan costs, predicted by the cost model (lesson 3, "the cost model").

    `peak_bytes`: the most activation bytes live at once over forward and backward (parameters and
    optimizer state come on top; parameter gradients are included only when `grad_bytes` was given).
    `forward_bytes`: what the stack holds at the end of the forward pass (its output included).
    `recompute_fraction`: extra forward compute, as a fraction of one forward of the stack (0 for no
    checkpointing, 1.0 when every layer is in a segment). `peak_where`: the moment of the peak;
    `peak_layer`: the layer whose backward holds it (None: the turn from forward to backward).
    """

    peak_bytes: int
    recompute_fraction: float
    forward_bytes: int
    peak_where: str = ""
    plan: tuple[tuple[int, int], ...] = ()
    peak_layer: int | None = None


def _as_sizes(values: Sequence[int] | None, name: str, n: int, default: int = 0) -> list[int]:
    if values is None:
        return [default] * n
    return validate.whole_numbers(name, values, length=n, what="byte counts (one per layer)")


class StackModel:
    """The cost model's numbers for one stack, checked once (see `plan_cost`; lesson 3)."""

    def __init__(
        self,
        saved_bytes,
        input_bytes,
        *,
        output_bytes=None,
        compute=None,
        grad_bytes=None,
        transient_bytes=None,
        head_bytes=None,
        head_grad_bytes=0,
        output_saved=None,
    ) -> None:
        saved = validate.whole_numbers("saved_bytes", saved_bytes)
        n = len(saved)
        if n == 0:
            raise UserError("saved_bytes must have one entry per layer (got an empty list)")
        self.n = n
        self.saved = _as_sizes(saved, "saved_bytes", n)
        self.inputs = _as_sizes(input_bytes, "input_bytes", n)
        grads = _as_sizes(grad_bytes, "grad_bytes", n)
        self.transient = _as_sizes(transient_bytes, "transient_bytes", n)
        flags = [False] * n if output_saved is None else validate.non_empty("output_saved", output_saved, "flags")
        if len(flags) != n:
            raise UserError(f"output_saved must have one entry per layer ({n}), got {len(flags)}")
        flags = [validate.strict_bool(f"output_saved[{i}]", flag) for i, flag in enumerate(flags)]
        self.out = self.inputs[-1] if output_bytes is None else validate.non_negative_int("output_bytes", output_bytes)
        head = self.out if head_bytes is None else validate.non_negative_int("head_bytes", head_bytes)
        self.head_grads = validate.non_negative_int("head_grad_bytes", head_grad_bytes)
        self.turn = self.out + head  # the output and the head's peak beside everything the stack holds
        costs = [1.0] * n if compute is None else validate.non_empty("compute", compute, "costs")
        if len(costs) != n:
            raise UserError(f"compute must have one cost per layer ({n}), got {len(costs)}")
        costs = [validate.finite(f"compute[{i}]", cost, at_least=0) for i, cost in enumerate(costs)]
        self.costs = costs
        self.total_cost = sum(costs)
        # grad_of_output[i]: the gradient arriving at layer i (its output's size)
        self.grad_of_output = self.inputs[1:] + [self.out]
        # a layer that saves its own output (ReLU, tanh) holds it during its backward
        self.own_output = [size if flag else 0 for size, flag in zip(self.grad_of_output, flags)]
        self.grads_after = [0] * (n + 1)  # parameter gradients already made when layer i's backward starts
        for i in range(n - 1, -1, -1):
            self.grads_after[i] = self.grads_after[i + 1] + grads[i]

    def hold(self, a: int, checked: bool) -> int:
        """What a unit starting at layer a keeps from its forward until its backward."""
        return self.inputs[a] if checked else self.saved[a]

    def backward_peaks(self, a: int, checked: bool):
        """Yield (b, peak) for the units a .. b-1, b = a+1, a+2, ...: the most a unit's backward adds
        on top of what the units before it hold. Unchecked units have b = a+1 only."""
        held = self.inputs[a] - min(self.inputs[a], self.saved[a]) if checked else 0
        peak = None
        for i in range(a, self.n if checked else a + 1):
            held += self.saved[i]  # after the recompute, layers a .. i hold their saved bytes
            moment = (
                held
                + self.own_output[i]
                + self.grad_of_output[i]
                + self.transient[i]
                + self.grads_after[i + 1]
                + self.head_grads
            )
            peak = moment if peak is None else max(peak, moment)
            yield i + 1, peak

    def unit_peak(self, a: int, b: int, checked: bool) -> int:
        for end, peak in self.backward_peaks(a, checked):
            if end == b:
                return peak
        raise UserError(f"no unit ({a}, {b})")

    def units(self, plan: Plan) -> list[tuple[int, int, bool]]:
        """The stack as (start, end, checkpointed) units in order: unchecked layers one by one,
        segments whole."""
        starts = dict(plan)
        units, i = [], 0
        while i < self.n:
            if i in starts:
                units.append((i, starts[i], True))
                i = starts[i]
            else:
                units.append((i, i + 1, False))
                i += 1
        return units


def plan_cost(
    saved_bytes: Sequence[int],
    input_bytes: Sequence[int],
    plan,
    *,
    output_bytes: int | None = None,
    compute: Sequence[float] | None = None,
    grad_bytes: Sequence[int] | None = None,
    transient_bytes: Sequence[int] | None = None,
    head_bytes: int | None = None,
    head_grad_bytes: int = 0,
    output_saved: Sequence[bool] | None = None,
) -> PlanCost:
    """Predicted activation peak and recompute cost of a plan (lesson 3, "the cost model").

    `plan`: a list of (start, end) segments or a plan name (see `named_plan`).
    `saved_bytes[i]`: what layer i keeps for backward when it runs normally, counting its input (which
    it saves: a Linear or a norm comes first) but not its output (the next layer's input, counted
    there). `input_bytes[i]`: the size of layer i's input, what a segment starting at layer i keeps.
    These two are enough; the optional rest refines the peak (`profile_stack` measures them):
    `output_bytes`: the stack's output (default input_bytes[-1]); `compute[i]`: layer i's forward
    cost in any unit (default: equal layers); `grad_bytes[i]`: layer i's parameter gradients, made
    during its backward and kept; `transient_bytes[i]`: how far layer i's own backward climbs above
    its start (gradients of its intermediates; default 0); `head_bytes`: how far the head and loss
    climb above the stack's output at the turn from forward to backward (default output_bytes: the
    loss gradient); `head_grad_bytes`: the head's parameter gradients, kept through the backward;
    `output_saved[i]`: layer i saves its own output (a ReLU last), which its backward then holds.

    The model: going forward, an unchecked layer keeps saved_bytes[i] and a segment keeps its input.
    At the turn, everything kept plus the output and the head is live. Going backward, unit by unit
    from the last, a segment's recompute brings back the saved bytes of all its layers at once, on top
    of what the earlier units still keep, beside the gradient arriving from above. The peak is the
    largest of these moments.
    """
    model = StackModel(
        saved_bytes,
        input_bytes,
        output_bytes=output_bytes,
        compute=compute,
        grad_bytes=grad_bytes,
        transient_bytes=transient_bytes,
        head_bytes=head_bytes,
        head_grad_bytes=head_grad_bytes,
        output_saved=output_saved,
    )
    segments = validate_plan(plan, model.n)
    units = model.units(segments)
    holds = [model.hold(a, recomputed) for a, _, recomputed in units]
    forward = sum(holds) + model.out
    peak, where = sum(holds) + model.turn, "at the turn from forward to backward (the head and loss)"
    before, layer = sum(holds), None
    for (a, b, recomputed), hold in reversed(list(zip(units, holds))):
        before -= hold
        moment = before + model.unit_peak(a, b, recomputed)
        if moment > peak:
            what = f"layers {a}..{b - 1}" if b - a > 1 else f"layer {a}"
            peak, where = moment, f"in the backward of {what}" + (" (recomputed)" if recomputed else "")
            # the unit's first layer whose backward reaches the unit's peak
            layer = next(end - 1 for end, top in model.backward_peaks(a, recomputed) if before + top == moment)
    recompute = sum(sum(model.costs[a:b]) for a, b in segments)
    return PlanCost(
        peak_bytes=int(peak),
        recompute_fraction=recompute / model.total_cost if model.total_cost else 0.0,
        forward_bytes=int(forward),
        peak_where=where,
        plan=tuple(segments),
        peak_layer=layer,
    )
