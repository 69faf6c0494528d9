"""Gradient checkpointing: plans, their cost model, applying them, and the optimal plan (lesson 3).

A stack of `n` layers (0 .. n-1) is checkpointed by a *plan*: a sorted list of **boundaries**, layer
indices in 0 .. n (n means "the end of the stack"). Two consecutive boundaries `a < b` delimit one
checkpointed segment, layers a .. b-1, run under a single `torch.utils.checkpoint.checkpoint` call:
its forward keeps only its input; its backward runs the segment's forward again (the recompute), then
its backward. Layers before the first boundary and from the last boundary on run normally.

    []                      no checkpointing
    [0, 1, 2, ..., n]       every layer its own segment (what Hugging Face's one-liner does)
    [0, 4, 8, 12, 16]       n = 16, four segments of four layers, all checkpointed ("every-4")
    [0, 4, 8, 12]           n = 16, three checkpointed segments, layers 12 .. 15 run normally
                            (the "sqrt" plan; `checkpoint_sequential(layers, 4, x)` does the same)

A single boundary delimits no segment and is refused (write [] for no checkpointing).
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from course_lib.measure import format_bytes, LiveStorageTracker, measure_step, MiB, storage_bytes, unique_storages

PLAN_NAMES = ("none", "every-layer", "sqrt", "every-K")


def plan_boundaries(n_layers: int, plan: str) -> list[int]:
    """The boundaries of a named plan for a stack of `n_layers` layers (lesson 3, "plans").

    - "none": [] (nothing checkpointed).
    - "every-layer": [0, 1, ..., n]: each layer its own checkpointed segment (Hugging Face's
      `gradient_checkpointing_enable()`).
    - "every-K" (e.g. "every-2"): segments of K layers from layer 0, all checkpointed; the last one
      is shorter when K does not divide n.
    - "sqrt" (Chen et al. 2016): k = round(sqrt(n)) segments of as equal a size as possible (sizes
      differ by at most one); the first k-1 are checkpointed and the last runs normally, because its
      backward comes right after the forward: checkpointing it would recompute it for no memory
      saved. Recompute cost (k-1)/k of one forward for equal layers.
    """
    if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers < 1:
        raise ValueError(f"n_layers must be a positive integer, got {n_layers!r}")
    if not isinstance(plan, str):
        raise ValueError(f"plan must be a string, one of {', '.join(PLAN_NAMES)}; got {plan!r}")
    name = plan.strip().lower()
    if name == "none":
        return []
    if name == "every-layer":
        return list(range(n_layers + 1))
    if name == "sqrt":
        k = max(1, round(math.sqrt(n_layers)))
        if k == 1:
            return []  # one segment that would be the last one: nothing worth checkpointing
        return _even_starts(n_layers, k)
    match = re.fullmatch(r"every-(\d+)", name)
    if match:
        size = int(match.group(1))
        if size < 1:
            raise ValueError(f"plan {plan!r}: K in every-K must be at least 1")
        return sorted(set(range(0, n_layers, size)) | {n_layers})
    raise ValueError(f"unknown checkpointing plan {plan!r}: use one of none, every-layer, sqrt, every-K "
                     f"(K a positive integer, e.g. every-2)")


def _even_starts(n_layers: int, k: int) -> list[int]:
    """Starts of k segments of n_layers layers, sizes differing by at most one (larger ones first)."""
    size, extra = divmod(n_layers, k)
    starts, at = [], 0
    for j in range(k):
        starts.append(at)
        at += size + (1 if j < extra else 0)
    return starts


def validate_boundaries(boundaries: Sequence[int], n_layers: int) -> list[int]:
    """`boundaries` as a list, or ValueError saying what is wrong with it (lesson 3, "plans")."""
    try:
        values = [int(b) for b in boundaries]
    except (TypeError, ValueError):
        raise ValueError(f"boundaries must be a sequence of layer indices, got {boundaries!r}") from None
    if any(isinstance(b, bool) or int(b) != b for b in boundaries):
        raise ValueError(f"boundaries must be integers, got {list(boundaries)!r}")
    bad = [b for b in values if not 0 <= b <= n_layers]
    if bad:
        raise ValueError(f"boundaries {bad} out of range: a stack of {n_layers} layers takes boundaries "
                         f"0 .. {n_layers} (got {values})")
    if any(b >= c for b, c in zip(values, values[1:])):
        raise ValueError(f"boundaries must be strictly increasing (sorted, no repeats), got {values}")
    if len(values) == 1:
        raise ValueError(f"one boundary {values} delimits no segment: a checkpointed segment runs from one "
                         f"boundary to the next; write [] for no checkpointing")
    return values


def segments_of(boundaries: Sequence[int]) -> list[tuple[int, int]]:
    """The checkpointed segments (start, end) delimited by consecutive boundaries; end is exclusive
    (lesson 3, "plans")."""
    values = list(boundaries)
    return list(zip(values, values[1:]))


@dataclass(frozen=True)
class PlanCost:
    """What a checkpoint plan costs, predicted by the cost model (lesson 3, "the cost model").

    `peak_bytes`: the most activation bytes live at once over forward and backward (parameters and
    optimizer state come on top; parameter gradients are included only when `grad_bytes` was given).
    `forward_bytes`: what the stack holds at the end of the forward pass (its output included).
    `recompute_fraction`: extra forward compute, as a fraction of one forward of the stack (0 for no
    checkpointing, 1.0 when every layer is checkpointed). `peak_where`: the moment of the peak.
    """

    peak_bytes: int
    recompute_fraction: float
    forward_bytes: int
    peak_where: str = ""
    boundaries: tuple[int, ...] = ()
    segments: tuple[tuple[int, int], ...] = field(default=())


def _as_sizes(values: Sequence[int] | None, name: str, n: int, default: int = 0) -> list[int]:
    if values is None:
        return [default] * n
    sizes = [int(v) for v in values]
    if len(sizes) != n:
        raise ValueError(f"{name} must have one entry per layer ({n}), got {len(sizes)}")
    if any(v < 0 for v in sizes):
        raise ValueError(f"{name} must be non-negative byte counts, got {sizes}")
    return sizes


class _StackModel:
    """The cost model's numbers for one stack, checked once (see `plan_cost`)."""

    def __init__(self, saved_bytes, input_bytes, *, output_bytes=None, compute=None, grad_bytes=None,
                 transient_bytes=None, head_bytes=None, head_grad_bytes=0, output_saved=None) -> None:
        saved = [int(v) for v in saved_bytes]
        n = len(saved)
        if n == 0:
            raise ValueError("saved_bytes must have one entry per layer (got an empty list)")
        self.n = n
        self.saved = _as_sizes(saved, "saved_bytes", n)
        self.inputs = _as_sizes(input_bytes, "input_bytes", n)
        self.grads = _as_sizes(grad_bytes, "grad_bytes", n)
        self.transient = _as_sizes(transient_bytes, "transient_bytes", n)
        flags = [False] * n if output_saved is None else [bool(f) for f in output_saved]
        if len(flags) != n:
            raise ValueError(f"output_saved must have one entry per layer ({n}), got {len(flags)}")
        self.out = self.inputs[-1] if output_bytes is None else int(output_bytes)
        head = self.out if head_bytes is None else int(head_bytes)
        self.head_grads = int(head_grad_bytes)
        if min(self.out, head, self.head_grads) < 0:
            raise ValueError("output_bytes, head_bytes and head_grad_bytes must be non-negative")
        self.turn = self.out + head  # the output and the head's peak beside everything the stack holds
        costs = [1.0] * n if compute is None else [float(c) for c in compute]
        if len(costs) != n or any(not c >= 0 for c in costs):
            raise ValueError(f"compute must have one non-negative entry per layer (got {list(costs)})")
        self.costs = costs
        self.total_cost = sum(costs)
        # grad_of_output[i]: the gradient arriving at layer i (its output's size)
        self.grad_of_output = self.inputs[1:] + [self.out]
        # a layer that saves its own output (ReLU, tanh) holds it during its backward
        self.own_output = [size if flag else 0 for size, flag in zip(self.grad_of_output, flags)]
        self.grads_after = [0] * (n + 1)  # parameter gradients already made when layer i's backward starts
        for i in range(n - 1, -1, -1):
            self.grads_after[i] = self.grads_after[i + 1] + self.grads[i]

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
            moment = (held + self.own_output[i] + self.grad_of_output[i] + self.transient[i]
                      + self.grads_after[i + 1] + self.head_grads)
            peak = moment if peak is None else max(peak, moment)
            yield i + 1, peak

    def recompute(self, a: int, b: int) -> float:
        return sum(self.costs[a:b])


def plan_cost(saved_bytes: Sequence[int], input_bytes: Sequence[int], boundaries: Sequence[int], *,
              output_bytes: int | None = None, compute: Sequence[float] | None = None,
              grad_bytes: Sequence[int] | None = None, transient_bytes: Sequence[int] | None = None,
              head_bytes: int | None = None, head_grad_bytes: int = 0,
              output_saved: Sequence[bool] | None = None) -> PlanCost:
    """Predicted activation peak and recompute cost of a plan (lesson 3, "the cost model").

    `saved_bytes[i]`: what layer i keeps for backward when it runs normally, counting its input (which
    it saves: a Linear or a norm comes first) but not its output (the next layer's input, counted
    there). `input_bytes[i]`: the size of layer i's input, what a checkpoint starting at layer i
    keeps. These two are enough; the optional rest refines the peak (`profile_stack` measures them):
    `output_bytes`: the stack's output (default input_bytes[-1]); `compute[i]`: layer i's forward
    cost in any unit (default: equal layers); `grad_bytes[i]`: layer i's parameter gradients, made
    during its backward and kept; `transient_bytes[i]`: how far layer i's own backward climbs above
    its start (gradients of its intermediates; default 0); `head_bytes`: how far the head and loss
    climb above the stack's output at the turn from forward to backward (default output_bytes: the
    loss gradient); `head_grad_bytes`: the head's parameter gradients, kept through the backward;
    `output_saved[i]`: layer i saves its own output (a ReLU last), which its backward then holds.

    The model: going forward, an unchecked layer keeps saved_bytes[i] and a checkpointed segment
    keeps its input. At the turn, everything kept plus the output and the head is live. Going
    backward, unit by unit from the last, a checkpointed segment's recompute brings back the saved
    bytes of all its layers at once, on top of what the earlier units still keep, beside the gradient
    arriving from above. The peak is the largest of these moments.
    """
    model = _StackModel(saved_bytes, input_bytes, output_bytes=output_bytes, compute=compute,
                        grad_bytes=grad_bytes, transient_bytes=transient_bytes, head_bytes=head_bytes,
                        head_grad_bytes=head_grad_bytes, output_saved=output_saved)
    cuts = validate_boundaries(boundaries, model.n)
    units = _units(model.n, cuts)
    holds = [model.hold(a, checked) for a, _, checked in units]
    forward = sum(holds) + model.out
    peak, where = sum(holds) + model.turn, "at the turn from forward to backward (the head and loss)"
    before = sum(holds)
    for (a, b, checked), hold in reversed(list(zip(units, holds))):
        before -= hold
        unit_peak = dict(model.backward_peaks(a, checked))[b]
        if before + unit_peak > peak:
            what = f"layers {a}..{b - 1}" if b - a > 1 else f"layer {a}"
            peak, where = before + unit_peak, (f"in the backward of {what}"
                                               + (" (recomputed)" if checked else ""))
    recompute = sum(model.recompute(a, b) for a, b in segments_of(cuts))
    return PlanCost(peak_bytes=int(peak),
                    recompute_fraction=recompute / model.total_cost if model.total_cost else 0.0,
                    forward_bytes=int(forward), peak_where=where, boundaries=tuple(cuts),
                    segments=tuple(segments_of(cuts)))


def _units(n: int, cuts: list[int]) -> list[tuple[int, int, bool]]:
    """The stack as (start, end, checkpointed) units in order: unchecked layers one by one, segments whole."""
    if not cuts:
        return [(i, i + 1, False) for i in range(n)]
    units = [(i, i + 1, False) for i in range(cuts[0])]
    units += [(a, b, True) for a, b in segments_of(cuts)]
    units += [(i, i + 1, False) for i in range(cuts[-1], n)]
    return units


# ---------------------------------------------------------------------------------------------------
# More plans: k segments, every plan, and the optimal plan under a memory budget
# ---------------------------------------------------------------------------------------------------

def segments_plan(n_layers: int, k: int, *, checkpoint_last: bool = False) -> list[int]:
    """k segments of near-equal size (lesson 3, "the U-shaped curve").

    With `checkpoint_last=False` (the default, like `checkpoint_sequential`) the last segment runs
    normally; k = 1 is then no checkpointing and k = n checkpoints every layer but the last.
    """
    if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers < 1:
        raise ValueError(f"n_layers must be a positive integer, got {n_layers!r}")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n_layers:
        raise ValueError(f"k must be an integer from 1 to n_layers={n_layers}, got {k!r}")
    starts = _even_starts(n_layers, k)
    cuts = starts + [n_layers] if checkpoint_last else starts
    return cuts if len(cuts) >= 2 else []


def all_plans(n_layers: int):
    """Every distinct plan for n_layers layers: [] and every set of at least two boundaries in 0 .. n.

    2^(n+1) - n - 1 plans: for brute force on small stacks only (lesson 3, "the optimal plan").
    """
    from itertools import combinations

    yield []
    for size in range(2, n_layers + 2):
        for cuts in combinations(range(n_layers + 1), size):
            yield list(cuts)


@dataclass(frozen=True)
class _Point:
    need: int
    recompute: float
    plan: tuple[int, ...]  # this suffix's boundaries


def _pareto(points: list[_Point]) -> list[_Point]:
    """The points no other point beats on both need and recompute (ties: fewest boundaries, then first)."""
    best: list[_Point] = []
    for p in sorted(points, key=lambda p: (p.need, p.recompute, len(p.plan), p.plan)):
        if not best or p.recompute < best[-1].recompute - 1e-9 * max(1.0, abs(best[-1].recompute)):
            best.append(p)
    return best


def plan_frontier(saved_bytes: Sequence[int], input_bytes: Sequence[int],
                  **model_kwargs) -> list[tuple[int, float, list[int]]]:
    """Every best trade-off: (peak_bytes, recompute_fraction, boundaries), peak ascending, recompute
    descending; no plan has both a lower peak and less recompute (lesson 3, "the optimal plan").

    Same inputs as `plan_cost` (keyword arguments passed on). Dynamic programming over the stack from
    its end: a plan is an unchecked prefix, consecutive checkpointed segments, an unchecked suffix.
    What a suffix needs on top of what the units before it keep is
    need(unit + rest) = max(backward peak of the unit, hold of the unit + need(rest)), and
    need(nothing) = output + head; each position keeps only its Pareto-best (need, recompute) pairs,
    so the frontier is exact (a test compares it with brute force over all plans).
    """
    model = _StackModel(saved_bytes, input_bytes, **model_kwargs)
    n = model.n
    total = model.total_cost or 1.0

    def extend(unit_peak: int, hold: int, rest: _Point, recompute: float, plan) -> _Point:
        return _Point(max(unit_peak, hold + rest.need), rest.recompute + recompute, plan)

    # suffix[i]: layers i .. n-1 all run normally.
    suffix = [0] * (n + 1)
    suffix[n] = model.turn
    for i in range(n - 1, -1, -1):
        unit_peak = dict(model.backward_peaks(i, False))[i + 1]
        suffix[i] = max(unit_peak, model.hold(i, False) + suffix[i + 1])

    # after[i]: best suffixes when a boundary sits at i (segments from i on, then an unchecked rest).
    after: list[list[_Point]] = [[] for _ in range(n + 1)]
    after[n] = [_Point(suffix[n], 0.0, (n,))]
    for i in range(n - 1, -1, -1):
        points = [_Point(suffix[i], 0.0, (i,))]
        recompute = 0.0
        for j, unit_peak in model.backward_peaks(i, True):
            recompute += model.costs[j - 1]
            points += [extend(unit_peak, model.hold(i, True), rest, recompute, (i,) + rest.plan)
                       for rest in after[j]]
        after[i] = _pareto(points)

    # before[i]: best plans for layers i .. n-1 whose first boundary is at i or later.
    before: list[list[_Point]] = [[] for _ in range(n + 1)]
    before[n] = [_Point(suffix[n], 0.0, ())]
    for i in range(n - 1, -1, -1):
        unit_peak = dict(model.backward_peaks(i, False))[i + 1]
        points = [extend(unit_peak, model.hold(i, False), rest, 0.0, rest.plan) for rest in before[i + 1]]
        points += [p for p in after[i] if len(p.plan) >= 2]
        before[i] = _pareto(points)
    return [(p.need, p.recompute / total, list(p.plan)) for p in before[0]]


def min_feasible_peak(saved_bytes: Sequence[int], input_bytes: Sequence[int], **model_kwargs) -> int:
    """The smallest activation peak any plan reaches under the cost model (lesson 3)."""
    return plan_frontier(saved_bytes, input_bytes, **model_kwargs)[0][0]


def optimal_plan(saved_bytes: Sequence[int], input_bytes: Sequence[int], budget_bytes: int,
                 **model_kwargs) -> list[int]:
    """The plan with the least recompute whose predicted activation peak fits in `budget_bytes`
    (lesson 3, "the optimal plan"); among equal recompute, the lowest peak.

    Same inputs as `plan_cost` (keyword arguments passed on). Raises ValueError naming the minimum
    feasible memory when no plan fits.
    """
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, (int, float)) or not budget_bytes >= 0:
        raise ValueError(f"budget_bytes must be a non-negative number of bytes, got {budget_bytes!r}")
    frontier = plan_frontier(saved_bytes, input_bytes, **model_kwargs)
    fitting = [plan for peak, _, plan in frontier if peak <= budget_bytes]
    if not fitting:
        minimum, _, plan = frontier[0]
        raise ValueError(f"budget of {int(budget_bytes)} bytes ({format_bytes(budget_bytes)}) is below the minimum "
                         f"feasible activation memory of {minimum} bytes ({format_bytes(minimum)}) for these layers, "
                         f"reached by the plan {plan}")
    return fitting[-1]  # the frontier's peaks ascend and recomputes descend: the last that fits


# ---------------------------------------------------------------------------------------------------
# Applying a plan to a layer stack (nn.Sequential, nn.ModuleList, a Hugging Face decoder)
# ---------------------------------------------------------------------------------------------------

# What the selective policy keeps: the outputs of matrix multiplications and attention kernels, the
# expensive ops. Everything else (pointwise ops, norms, activations) is recomputed.
MATMUL_OPS = tuple(getattr(torch.ops.aten, name) for name in (
    "mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_cudnn_attention") if hasattr(torch.ops.aten, name))

_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")


def save_matmuls_policy(ctx, op, *args, **kwargs):
    """Selective checkpointing policy: save matmul and attention outputs, recompute the rest (lesson 3,
    "selective checkpointing"). For `torch.utils.checkpoint.create_selective_checkpoint_contexts`."""
    from torch.utils.checkpoint import CheckpointPolicy

    packet = getattr(op, "overloadpacket", op)
    return CheckpointPolicy.MUST_SAVE if packet in MATMUL_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _context_fn(policy) -> Callable | None:
    """The `context_fn` for torch's checkpoint: None for full checkpointing."""
    if policy is None or policy == "full":
        return None
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    if policy == "selective":
        policy = save_matmuls_policy
    elif isinstance(policy, str):
        raise ValueError(f"unknown policy {policy!r}: use 'full', 'selective', a policy function "
                         f"(ctx, op, *args, **kwargs) -> CheckpointPolicy, or a list of ops to save")
    return functools.partial(create_selective_checkpoint_contexts, policy)


def find_layer_stack(model: nn.Module) -> nn.ModuleList | nn.Sequential:
    """The repeated layers of a model: the model itself when it is an nn.Sequential or nn.ModuleList,
    else the longest nn.ModuleList of same-class modules inside it (a Hugging Face decoder's
    `model.layers`, GPT-2's `transformer.h`) (lesson 3, "applying a plan")."""
    if isinstance(model, (nn.Sequential, nn.ModuleList)):
        return model
    best, best_len = None, 0
    for _, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > best_len:
            classes = {type(layer) for layer in module}
            if len(classes) == 1:
                best, best_len = module, len(module)
    if best is None:
        raise ValueError(f"no layer stack found in {type(model).__name__}: pass an nn.Sequential, an "
                         f"nn.ModuleList, or a model holding an nn.ModuleList of identical layers")
    return best


class _Segment:
    """Runs layers start .. end-1 under one non-reentrant checkpoint (called from layer `start`)."""

    def __init__(self, layers: list[nn.Module], forwards: list[Callable], context_fn) -> None:
        self.layers = layers
        self.forwards = forwards
        self.context_fn = context_fn
        self.tuple_tail: tuple | None = None

    def run(self, hidden, *args, **kwargs):
        out = None
        for forward in self.forwards:
            out = forward(hidden, *args, **kwargs)
            hidden = out[0] if isinstance(out, tuple) else out
        return out

    def __call__(self, hidden, *args, **kwargs):
        from torch.utils.checkpoint import checkpoint

        layer = self.layers[0]
        if not (torch.is_grad_enabled() and layer.training):
            out = self.run(hidden, *args, **kwargs)
        else:
            for name in _CACHE_KWARGS:  # a recompute must not write a KV cache a second time
                if kwargs.get(name) is not None:
                    kwargs[name] = None
            if kwargs.get("use_cache"):
                kwargs["use_cache"] = False
            extra = {} if self.context_fn is None else {"context_fn": self.context_fn}
            out = checkpoint(self.run, hidden, *args, use_reentrant=False, **extra, **kwargs)
        self.tuple_tail = tuple(out[1:]) if isinstance(out, tuple) else None
        return out

    def passthrough(self, hidden, *args, **kwargs):
        """The forward of the segment's other layers: already run, hand the hidden state on."""
        if self.tuple_tail is not None:
            return (hidden,) + self.tuple_tail
        return hidden


class AppliedPlan:
    """A checkpoint plan applied to a layer stack; `remove()` (or leaving the `with` block) restores it
    (lesson 3, "applying a plan").

    The layers' `forward` is replaced on the instances: the first layer of each segment runs the
    whole segment under `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)` and the other
    layers of the segment hand their input on. Parameters, state_dict and module names are unchanged.
    Module hooks of the segment's layers run outside the checkpoint, on the segment's input/output.
    """

    def __init__(self, stack, boundaries: Sequence[int], policy) -> None:
        self.stack = stack
        layers = list(stack)
        self.boundaries = validate_boundaries(boundaries, len(layers))
        self.segments = segments_of(self.boundaries)
        self.policy = policy
        context_fn = _context_fn(policy)
        self._patched: list[nn.Module] = []
        for layer in layers:
            if getattr(layer, "gradient_checkpointing", False):
                raise ValueError("the model's own gradient checkpointing is on: call "
                                 "course_lib.checkpointing.hf_checkpointing(model, False) (or "
                                 "model.gradient_checkpointing_disable()) before applying a plan, or each "
                                 "layer would be checkpointed twice")
            if "forward" in vars(layer):
                raise ValueError(f"layer {type(layer).__name__} already has a replaced forward (a plan "
                                 f"applied twice?): remove the other plan first")
        for start, end in self.segments:
            members = layers[start:end]
            segment = _Segment(members, [layer.forward for layer in members], context_fn)
            members[0].forward = segment
            for layer in members[1:]:
                layer.forward = segment.passthrough
            self._patched += members

    def remove(self) -> None:
        for layer in self._patched:
            vars(layer).pop("forward", None)
        self._patched = []

    def __enter__(self) -> AppliedPlan:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"AppliedPlan(boundaries={self.boundaries}, policy={self.policy!r})"


def apply_plan(model: nn.Module, boundaries: Sequence[int] | str, *, policy="full",
               stack: nn.Module | None = None) -> AppliedPlan:
    """Checkpoint `model`'s layer stack by a plan, non-reentrant (lesson 3, "applying a plan").

    `boundaries`: a plan (see the module docstring) or a plan name ("sqrt", "every-2", ...). `model`:
    an nn.Sequential, an nn.ModuleList, or a model holding one (a Hugging Face decoder: its
    `model.layers`); `stack` names the stack explicitly. `policy`: "full" (keep only segment inputs),
    "selective" (`save_matmuls_policy`: keep matmul outputs, recompute pointwise ops), or any policy
    function or op list for `torch.utils.checkpoint.create_selective_checkpoint_contexts`.

    Returns an `AppliedPlan`; use it as a context manager or call `.remove()` to undo.
    """
    layers = stack if stack is not None else find_layer_stack(model)
    if isinstance(boundaries, str):
        boundaries = plan_boundaries(len(layers), boundaries)
    return AppliedPlan(layers, boundaries, policy)


def hf_checkpointing(model: nn.Module, enable: bool = True, *, use_reentrant: bool = False) -> None:
    """Hugging Face's one-liner, on any transformers version (lesson 3, "the one-liner").

    Every decoder layer becomes its own checkpointed segment (the plan "every-layer"); transformers
    >= 5.23 calls it `activation_checkpointing_enable` (the old `gradient_checkpointing_enable` warns).
    It also turns on `enable_input_require_grads()`, which keeps reentrant checkpointing from
    cutting the graph under frozen embeddings (LoRA).
    """
    new = "activation_checkpointing_enable" if enable else "activation_checkpointing_disable"
    old = "gradient_checkpointing_enable" if enable else "gradient_checkpointing_disable"
    method = getattr(model, new, None) or getattr(model, old)
    if enable:
        kwargs = {"use_reentrant": use_reentrant}
        try:
            method(activation_checkpointing_kwargs=kwargs) if method.__name__ == new else method(
                gradient_checkpointing_kwargs=kwargs)
        except TypeError:  # a version whose new name still takes the old keyword
            method(gradient_checkpointing_kwargs=kwargs)
    else:
        method()


def checkpointed_forward(layers: Sequence[nn.Module], x: torch.Tensor, boundaries: Sequence[int], *,
                         policy="full") -> torch.Tensor:
    """Run `layers` one after the other on `x` under a plan, without touching the modules (lesson 3)."""
    from torch.utils.checkpoint import checkpoint

    layers = list(layers)
    cuts = validate_boundaries(boundaries, len(layers))
    starts = dict(segments_of(cuts))
    extra = {} if _context_fn(policy) is None else {"context_fn": _context_fn(policy)}

    def run(h, a, b):
        for layer in layers[a:b]:
            h = layer(h)
        return h

    i = 0
    while i < len(layers):
        if i in starts:
            x = checkpoint(run, x, i, starts[i], use_reentrant=False, **extra)
            i = starts[i]
        else:
            x = layers[i](x)
            i += 1
    return x


# ---------------------------------------------------------------------------------------------------
# Gradients flow: the LoRA + reentrant checkpointing trap
# ---------------------------------------------------------------------------------------------------

def _loss_of(output) -> torch.Tensor:
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if loss is None:
        tensor = output if isinstance(output, torch.Tensor) else (
            getattr(output, "logits", None) if not isinstance(output, (tuple, list)) else output[0])
        if tensor is None:
            raise ValueError("cannot find a loss in the model's output: pass loss_fn(output) -> scalar")
        loss = tensor.float().pow(2).mean()
    return loss


def assert_gradients_flow(model: nn.Module, batch, loss_fn: Callable | None = None) -> None:
    """Run one forward and backward on `batch` and fail loudly if a trainable parameter gets no
    gradient (lesson 3, "the LoRA + reentrant trap").

    `batch`: a dict of keyword arguments (a Hugging Face batch), a tuple of positional arguments, or
    one tensor. The loss is `loss_fn(output)`, else `output.loss`, else the mean square of the output
    (any loss that reaches every parameter will do). Gradients are cleared before and after.
    """
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if not trainable:
        raise AssertionError("the model has no trainable parameter (every requires_grad is False): "
                             "nothing to train")
    model.zero_grad(set_to_none=True)
    was_training = model.training
    model.train()
    try:
        if isinstance(batch, dict):
            output = model(**batch)
        elif isinstance(batch, (tuple, list)):
            output = model(*batch)
        else:
            output = model(batch)
        loss = loss_fn(output) if loss_fn is not None else _loss_of(output)
        if not loss.requires_grad:
            missing = [name for name, _ in trainable]
        else:
            loss.backward()
            missing = [name for name, p in trainable if p.grad is None]
    finally:
        model.train(was_training)
    model.zero_grad(set_to_none=True)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise AssertionError(
            f"{len(missing)} of {len(trainable)} trainable parameters got no gradient: {shown}. "
            "The usual cause is reentrant checkpointing (use_reentrant=True) with frozen inputs: the "
            "embeddings are frozen (LoRA), so no input of a checkpointed segment requires grad and its "
            "output is cut from the graph. Fix: checkpoint with use_reentrant=False "
            "(model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False}) "
            "or course_lib.checkpointing.apply_plan), or call model.enable_input_require_grads() "
            "before training.")


# ---------------------------------------------------------------------------------------------------
# Measuring what each layer saves, and a plan's real peak
# ---------------------------------------------------------------------------------------------------

def _storage_keys(obj) -> set:
    from torch.utils._pytree import tree_flatten


    tensors = [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)]
    return set(unique_storages(tensors))


@dataclass
class StackProfile:
    """What each layer of a stack stores and costs, measured on one unchecked training step: the
    inputs of `plan_cost` (lesson 3, "what a layer stores").

    `saved_bytes`, `input_bytes`: the two the cost model needs (see `plan_cost`). The rest refines
    it: `output_bytes`, `grad_bytes` (parameter gradients per layer), `transient_bytes` (how far each
    layer's backward climbed above its start), `head_bytes` and `head_grad_bytes` (the head and loss
    after the stack), `compute` (forward FLOPs per layer), `output_saved` (layers that save their
    own output). `baseline_input_bytes`: the stack's input
    when it was live before the step (a batch fed straight into the stack), subtracted from
    predictions compared with `measure_step` (whose peak is relative to what was live before).
    """

    saved_bytes: list[int]
    input_bytes: list[int]
    output_bytes: int
    grad_bytes: list[int]
    transient_bytes: list[int]
    head_bytes: int
    head_grad_bytes: int
    compute: list[float]
    output_saved: list[bool] = field(default_factory=list)
    baseline_input_bytes: int = 0

    @property
    def n_layers(self) -> int:
        return len(self.saved_bytes)

    def model_kwargs(self, refined: bool = True) -> dict:
        """Keyword arguments for plan_cost / plan_frontier / optimal_plan after the two size lists.
        `refined=False`: only the layers' compute (the simple model: saved and input sizes alone)."""
        kwargs = {"compute": self.compute}
        if refined:
            kwargs.update(output_bytes=self.output_bytes, grad_bytes=self.grad_bytes,
                          transient_bytes=self.transient_bytes, head_bytes=self.head_bytes,
                          head_grad_bytes=self.head_grad_bytes, output_saved=self.output_saved)
        return kwargs

    def cost(self, boundaries: Sequence[int] | str, refined: bool = True) -> PlanCost:
        """plan_cost of a plan (or plan name) for this stack."""
        if isinstance(boundaries, str):
            boundaries = plan_boundaries(self.n_layers, boundaries)
        return plan_cost(self.saved_bytes, self.input_bytes, boundaries, **self.model_kwargs(refined))

    def predicted_step_peak(self, boundaries: Sequence[int] | str, refined: bool = True) -> int:
        """Predicted peak of a training step above what was live before it (measure_step's
        peak - baseline, optimizer step excluded). The simple model gets all gradients added."""
        peak = self.cost(boundaries, refined).peak_bytes - self.baseline_input_bytes
        if not refined:
            peak += sum(self.grad_bytes) + self.head_grad_bytes
        return peak

    def frontier(self) -> list[tuple[int, float, list[int]]]:
        return plan_frontier(self.saved_bytes, self.input_bytes, **self.model_kwargs())

    def optimal_plan(self, budget_bytes: int) -> list[int]:
        return optimal_plan(self.saved_bytes, self.input_bytes, budget_bytes, **self.model_kwargs())


def profile_stack(model: nn.Module, loss_fn: Callable[[], torch.Tensor], inputs: Iterable[torch.Tensor] = (),
                  *, stack: nn.Module | None = None) -> StackProfile:
    """Measure a stack's `StackProfile` on one unchecked forward and backward (lesson 3).

    `loss_fn()` runs the forward and returns the loss; `inputs` are the batch tensors it reads. The
    live-storage tracker of course_lib.measure follows every allocation (CPU or CUDA tensors alike);
    saved-tensor hooks attribute what autograd saves to the layer running; forward hooks and gradient
    hooks on each layer's output mark where each layer's backward starts. A second, gradient-free
    forward counts each layer's FLOPs. saved_bytes[i] excludes parameters, layer i's output and the
    arguments all layers share (masks, rotary tables).
    """
    from torch.utils.flop_counter import FlopCounterMode


    layers = list(stack if stack is not None else find_layer_stack(model))
    n = len(layers)
    if any("forward" in vars(layer) for layer in layers):
        raise ValueError("a checkpoint plan is applied to this stack: profile it without (remove the plan)")
    model_tensors = list(model.parameters()) + list(model.buffers())
    params = set(unique_storages(model_tensors))
    inputs = [t for t in inputs if isinstance(t, torch.Tensor)]
    baseline_keys = params | set(unique_storages(inputs))
    saved: list[dict] = [dict() for _ in layers]
    in_bytes, in_keys = [0] * n, [None] * n
    outputs: list[set] = [set() for _ in layers]
    shared: list[set] = [set() for _ in layers]
    marks: dict = {}
    active = [None]
    tracker = LiveStorageTracker()

    def mark(name):
        marks[name] = (len(tracker.timeline), tracker.current)

    def pre(index):
        def hook(module, args, kwargs):
            active[0] = index
            hidden = args[0] if args else next(iter(kwargs.values()))
            in_bytes[index] = hidden.untyped_storage().nbytes()
            in_keys[index] = next(iter(_storage_keys(hidden)), None)
            shared[index] = _storage_keys((args[1:], kwargs)) - _storage_keys(hidden)
            if index == 0 and hidden.requires_grad:
                hidden.register_hook(lambda grad: mark(("bwd", -1)))
        return hook

    def post(index):
        def hook(module, args, kwargs, output):
            hidden = output[0] if isinstance(output, tuple) else output
            outputs[index] = _storage_keys(hidden)
            active[0] = None
            if hidden.requires_grad:
                hidden.register_hook(lambda grad: mark(("bwd", index)))
            if index == n - 1:
                marks["out_bytes"] = hidden.untyped_storage().nbytes()
                mark("forward_end")
        return hook

    def pack(tensor):
        if active[0] is not None:
            for key, nbytes in unique_storages([tensor]).items():
                if key not in params:
                    saved[active[0]][key] = nbytes
        return tensor

    handles = []
    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(pre(i), with_kwargs=True))
        handles.append(layer.register_forward_hook(post(i), with_kwargs=True))
    model.zero_grad(set_to_none=True)
    try:
        for tensor in model_tensors + inputs:
            tracker.watch(tensor)
        with tracker:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = loss_fn()
            loss.backward()
            del loss
        mark("end")
    finally:
        for handle in handles:
            handle.remove()
    grad_bytes = [storage_bytes(p.grad for p in layer.parameters() if p.grad is not None) for layer in layers]
    model.zero_grad(set_to_none=True)
    if "forward_end" not in marks or ("bwd", n - 1) not in marks:
        raise ValueError("the stack's output got no gradient: is the loss computed from the stack?")

    timeline = [current for _, current in tracker.timeline]

    def climb(begin, end) -> int:
        index, level = marks[begin]
        stop = marks[end][0] if end in marks else len(timeline)
        return max([level] + timeline[index:stop]) - level

    transient = [climb(("bwd", i), ("bwd", i - 1) if i > 0 else "end") for i in range(n)]
    out = marks["out_bytes"]
    head = climb("forward_end", ("bwd", n - 1))
    head_grads = max(0, marks[("bwd", n - 1)][1] - marks["forward_end"][1] - out)
    sizes = [sum(v for k, v in s.items() if k not in outputs[i] and k not in shared[i])
             for i, s in enumerate(saved)]

    # FLOPs of each layer's forward, on a second, gradient-free pass.
    flops = [0.0] * n
    counter = FlopCounterMode(display=False)
    at = [0]

    def flop_pre(index):
        def hook(module, args):
            at[0] = counter.get_total_flops()
        return hook

    def flop_post(index):
        def hook(module, args, output):
            flops[index] = float(counter.get_total_flops() - at[0])
        return hook

    handles = [h for i, layer in enumerate(layers)
               for h in (layer.register_forward_pre_hook(flop_pre(i)), layer.register_forward_hook(flop_post(i)))]
    try:
        with torch.no_grad(), counter:
            loss_fn()
    finally:
        for handle in handles:
            handle.remove()
    if not any(flops):
        flops = [1.0] * n
    return StackProfile(saved_bytes=sizes, input_bytes=in_bytes, output_bytes=out, grad_bytes=grad_bytes,
                        transient_bytes=transient, head_bytes=head, head_grad_bytes=head_grads,
                        compute=flops, output_saved=[bool(outputs[i] & set(s)) for i, s in enumerate(saved)],
                        baseline_input_bytes=in_bytes[0] if in_keys[0] in baseline_keys else 0)


@dataclass
class PlanMeasurement:
    """One plan, measured and predicted (lesson 3, "the measured trade-off").

    Peaks are above what was live before the step (measure_step's peak - baseline). The predictions
    are None for a selective policy (the cost model describes full checkpointing).
    """

    plan: str
    boundaries: list[int]
    measured_peak: int
    predicted_peak: int | None         # the refined cost model (StackProfile.predicted_step_peak)
    simple_predicted_peak: int | None  # saved and input sizes alone, all gradients added
    recompute_fraction: float          # predicted, by FLOPs (full checkpointing)
    step_seconds: float = float("nan")  # fastest timed forward + backward (nan: not timed)
    policy: str = "full"

    @property
    def error(self) -> float | None:
        """(predicted - measured) / measured, refined model."""
        if self.predicted_peak is None:
            return None
        return (self.predicted_peak - self.measured_peak) / self.measured_peak

    @property
    def simple_error(self) -> float | None:
        if self.simple_predicted_peak is None:
            return None
        return (self.simple_predicted_peak - self.measured_peak) / self.measured_peak


def _timed_step(model: nn.Module, loss_fn: Callable[[], torch.Tensor], device: torch.device) -> float:
    import time

    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    loss_fn().backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return seconds


def time_plans(model: nn.Module, loss_fn: Callable[[], torch.Tensor],
               plans: Sequence[tuple[Sequence[int] | str, object]], *, repeats: int = 3,
               stack: nn.Module | None = None) -> list[float]:
    """Fastest forward + backward time of each (plan, policy), in seconds (lesson 3).

    The plans take turns, `repeats` rounds after one warm-up round, so that a machine whose load
    changes slows them all alike; the fastest run of each counts.
    """
    layers = stack if stack is not None else find_layer_stack(model)
    device = next(model.parameters()).device
    best = [float("inf")] * len(plans)
    for round_ in range(repeats + 1):
        for index, (plan, policy) in enumerate(plans):
            with apply_plan(model, plan, policy=policy, stack=layers):
                seconds = _timed_step(model, loss_fn, device)
            if round_:
                best[index] = min(best[index], seconds)
    return best if repeats > 0 else [float("nan")] * len(plans)


def measure_plan(model: nn.Module, loss_fn: Callable[[], torch.Tensor], inputs: Iterable[torch.Tensor],
                 boundaries: Sequence[int] | str, *, profile: StackProfile | None = None,
                 policy="full", stack: nn.Module | None = None, repeats: int = 0,
                 label: str | None = None) -> PlanMeasurement:
    """Apply a plan, measure one training step's peak with course_lib.measure.measure_step (the live-
    storage tracker on CPU, the allocator on CUDA), put the cost model's prediction beside it, and
    with `repeats` > 0 time that many steps (the fastest counts) (lesson 3, "the measured trade-off").

    `profile` defaults to `profile_stack(model, loss_fn, inputs)`. To compare times between plans,
    prefer `measure_tradeoff` or `time_plans`, which interleave the plans' runs.
    """

    layers = stack if stack is not None else find_layer_stack(model)
    inputs = list(inputs)
    name = label or (boundaries if isinstance(boundaries, str) else str(list(boundaries)))
    cuts = plan_boundaries(len(layers), boundaries) if isinstance(boundaries, str) else list(boundaries)
    if profile is None:
        profile = profile_stack(model, loss_fn, inputs, stack=layers)
    cost = profile.cost(cuts)
    full = policy in (None, "full")
    with apply_plan(model, cuts, policy=policy, stack=layers):
        memory = measure_step(model, None, loss_fn, inputs)
    model.zero_grad(set_to_none=True)
    seconds = time_plans(model, loss_fn, [(cuts, policy)], repeats=repeats, stack=layers)[0] if repeats else float("nan")
    return PlanMeasurement(plan=name, boundaries=cuts, measured_peak=memory.peak - memory.baseline,
                           predicted_peak=profile.predicted_step_peak(cuts) if full else None,
                           simple_predicted_peak=profile.predicted_step_peak(cuts, refined=False) if full else None,
                           recompute_fraction=cost.recompute_fraction, step_seconds=seconds,
                           policy=(policy or "full") if isinstance(policy, str) or policy is None else "custom")


def measure_tradeoff(model: nn.Module, loss_fn: Callable[[], torch.Tensor], inputs: Iterable[torch.Tensor],
                     plans: dict[str, Sequence[int] | str] | None = None, *, repeats: int = 3,
                     policies: Sequence[str] = ("full",), profile: StackProfile | None = None,
                     ) -> list[PlanMeasurement]:
    """Measure many plans on one model: the trade-off curve (lesson 3, "the measured trade-off").

    `plans` maps a label to boundaries or a plan name; the default is `default_plans(profile)`. Each
    plan runs once per policy in `policies` ("full", "selective"): one measured step for the peak,
    then `repeats` timed rounds in which the plans take turns (`time_plans`).
    """
    inputs = list(inputs)
    layers = find_layer_stack(model)
    if profile is None:
        profile = profile_stack(model, loss_fn, inputs, stack=layers)
    if plans is None:
        plans = default_plans(profile)
    rows = [measure_plan(model, loss_fn, inputs, plan, profile=profile, policy=policy, stack=layers,
                         repeats=0, label=label)
            for label, plan in plans.items() for policy in policies]
    if repeats > 0:
        times = time_plans(model, loss_fn, [(row.boundaries, row.policy) for row in rows], repeats=repeats,
                           stack=layers)
        for row, seconds in zip(rows, times):
            row.step_seconds = seconds
    return rows


def default_plans(profile: StackProfile) -> dict[str, list[int]]:
    """k segments for a few k from 1 to n (the last segment unchecked), every layer, sqrt, and the
    optimal plan within the sqrt plan's predicted peak (lesson 3)."""
    n = profile.n_layers
    root = round(math.sqrt(n))
    ks = sorted({1, 2, 3, root - 1, root, root + 1, 2 * root, n // 2, n} & set(range(1, n + 1)))
    plans = {f"{k} segments": segments_plan(n, k) for k in ks}
    plans["every-layer"] = plan_boundaries(n, "every-layer")
    plans["sqrt"] = plan_boundaries(n, "sqrt")
    plans["optimal @ sqrt peak"] = profile.optimal_plan(profile.cost("sqrt").peak_bytes)
    return plans


def format_tradeoff(rows: Sequence[PlanMeasurement], title: str = "") -> str:
    """The trade-off as a text table: peaks in MiB, errors in %, time relative to the first row
    (lesson 3, "the measured trade-off")."""

    base = rows[0].step_seconds if rows and rows[0].step_seconds == rows[0].step_seconds else None
    lines = [title] if title else []
    header = (f"{'plan':<22} {'policy':<9} {'measured':>9} {'model':>9} {'err':>6} {'simple':>7} "
              f"{'recompute':>9} {'step ms':>8} {'time':>6}")
    lines += [header, "-" * len(header)]
    for r in rows:
        timed = r.step_seconds == r.step_seconds
        model = f"{r.predicted_peak / MiB:8.2f}M" if r.predicted_peak is not None else f"{'n/a':>9}"
        err = f"{100 * r.error:+5.1f}%" if r.error is not None else f"{'':>6}"
        simple = f"{100 * r.simple_error:+6.1f}%" if r.simple_error is not None else f"{'':>7}"
        ms = f"{r.step_seconds * 1e3:8.1f}" if timed else f"{'':>8}"
        ratio = f"{r.step_seconds / base:5.2f}x" if base and timed else ""
        lines.append(f"{r.plan[:22]:<22} {r.policy:<9} {r.measured_peak / MiB:8.2f}M {model} {err} {simple} "
                     f"{r.recompute_fraction:9.2f} {ms} {ratio:>6}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------
# Models to measure: an MLP stack and a Hugging Face decoder from a config
# ---------------------------------------------------------------------------------------------------

def mlp_stack(n_layers: int, width: int, activation: str = "relu") -> nn.Sequential:
    """n_layers layers of Linear(width, width) + activation (lesson 3, "the MLP").

    With ReLU a layer saves only its input (ReLU's saved output is the next layer's input): checkpointing
    every layer saves nothing. With GELU a layer saves its input and the Linear's output: twice its input.
    """
    acts = {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh}
    if activation not in acts:
        raise ValueError(f"activation must be one of {', '.join(acts)}, got {activation!r}")
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), acts[activation]())
                           for _ in range(n_layers)])


class ResidualMLP(nn.Module):
    """x + W2 gelu(W1 norm(x)), hidden `mult` x width: stores about (2 + 2 mult) times its input,
    costs about mult times the FLOPs of a width x width matmul, twice (lesson 3, "uneven layers")."""

    def __init__(self, width: int, mult: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, mult * width)
        self.act = nn.GELU()
        self.down = nn.Linear(mult * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.act(self.up(self.norm(x))))


class PointwiseBlock(nn.Module):
    """A cheap layer that stores a lot: one width x width matmul, then a chain of pointwise ops, each
    saving a tensor the size of its input (lesson 3, "uneven layers")."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.mix = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mix(x))
        gate = torch.sigmoid(h * 2.0)
        return x + torch.sin(h * gate) * torch.exp(-h * h)


def uneven_stack(spec: str, width: int) -> nn.Sequential:
    """A stack of uneven layers from a spec such as "mlp1 mlp8 pw mlp2": mlpK is a ResidualMLP with
    hidden K x width (memory and compute grow with K), pw a PointwiseBlock (lesson 3)."""
    layers = []
    for token in spec.split():
        if token == "pw":
            layers.append(PointwiseBlock(width))
        elif re.fullmatch(r"mlp\d+", token) and int(token[3:]) >= 1:
            layers.append(ResidualMLP(width, int(token[3:])))
        else:
            raise ValueError(f"unknown layer {token!r} in {spec!r}: use mlpK (K >= 1) or pw")
    if not layers:
        raise ValueError("the spec names no layer")
    return nn.Sequential(*layers)


def tiny_decoder(arch: str = "llama", *, n_layers: int = 8, hidden: int = 128, heads: int = 4,
                 intermediate: int | None = None, vocab: int = 512, attn_implementation: str = "sdpa",
                 seed: int = 0) -> nn.Module:
    """A Hugging Face causal LM built from a config with random weights, no download (lesson 3).

    `arch`: "llama" (LlamaForCausalLM: RMSNorm, rotary, SwiGLU) or "gpt2" (GPT2LMHeadModel: LayerNorm,
    gelu_new MLP). `attn_implementation`: "sdpa" or "eager" (eager stores the s x s attention matrix).
    """
    import transformers

    torch.manual_seed(seed)
    if arch == "llama":
        config = transformers.LlamaConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate or 4 * hidden,
            num_hidden_layers=n_layers, num_attention_heads=heads, num_key_value_heads=heads,
            max_position_embeddings=4096, use_cache=False, tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM._from_config(config, attn_implementation=attn_implementation)
    elif arch == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=vocab, n_embd=hidden, n_layer=n_layers, n_head=heads, n_inner=intermediate,
            n_positions=4096, use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            bos_token_id=vocab - 1, eos_token_id=vocab - 1)
        model = transformers.GPT2LMHeadModel._from_config(config, attn_implementation=attn_implementation)
        model.loss_type = "ForCausalLM"  # GPT-2 names none; transformers warns, then uses this one
    else:
        raise ValueError(f"arch must be 'llama' or 'gpt2', got {arch!r}")
    return model.train()
