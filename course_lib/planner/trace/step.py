"""Activations: one real training step of the Hugging Face implementation traced on the meta device
(lesson 1, "the planner"): shapes only, no memory; every tensor it creates and frees is recorded."""

from __future__ import annotations

import contextlib
import warnings
import weakref
from dataclasses import dataclass, field, fields

import torch

from course_lib.cache import cached
from course_lib.caching_allocator import stream_slacks
from course_lib.models import ModelSpec
from course_lib.planner.config.errors import PlanError
from course_lib.planner.config.setup import Setup, itemsize
from course_lib.planner.trace.autocast import MetaAutocast
from course_lib.planner.trace.compose import composed_trace
from course_lib.planner.trace.deep_stream import mark_positions
from course_lib.planner.trace.kernels import kernels_as_on
from course_lib.planner.trace.model import build_traced_model, decoder_layers, trace_key
from course_lib.planner.trace.toolbox import step_in_backward_hook, traced_loss
from course_lib.planner.trace.tracer import MetaTracer
from course_lib.toolbox.activation_offload import HostOffload
from course_lib.validate import checked


@checked(error=PlanError)
@dataclass(frozen=True)
class Trace:
    """What one meta-device training step of the real implementation allocated (lesson 1).

    Bytes beyond the parameters: `forward_peak`, `head_backward_peak` (loss, logits and output
    layer's backward, before the last decoder layer's), `layer_backward_peak` (the rest), each with
    the gradients produced so far, and the same without them (`*_without_grads`). `saved` and
    `inputs`: per decoder layer, what it saves for backward and the size of its input (lesson 3's
    cost model takes these), `output`: the last layer's output. `saved_outside`: saved outside the
    layers (embeddings, final norm, output layer, loss).
    """

    forward_peak: int
    head_backward_peak: int
    layer_backward_peak: int
    tail_backward_peak: int
    forward_peak_without_grads: int
    head_backward_peak_without_grads: int
    layer_backward_peak_without_grads: int
    tail_backward_peak_without_grads: int
    gradients: int
    saved: tuple[int, ...]
    inputs: tuple[int, ...]
    output: int
    saved_outside: int
    dequant_transient: int = 0
    kept_outputs: int = 0  # a loop that keeps the outputs: their bytes, alive through backward and the step
    # per decoder layer, how far its backward climbs above what the cost model counts (its own and the
    # earlier layers' saved bytes, the gradient arriving at it): its temporaries and what stays alive
    # outside the layers, without and with the parameter gradients (then those made so far are not
    # in it: `layer_grads`, made during each layer's backward, and `head_grads`, before the layers')
    backward_climbs: tuple[int, ...] = ()
    backward_climbs_with_grads: tuple[int, ...] = ()
    layer_grads: tuple[int, ...] = ()
    head_grads: int = 0
    offloaded: int = 0  # offload_activations: bytes copied to host memory in forward (and back in backward)
    # amp precisions: the weight copies autocast's cache keeps through the forward, made in each decoder
    # layer (what checkpointing that layer does not free before backward) and outside them
    autocast_cached: tuple[int, ...] = ()
    autocast_cached_outside: int = 0
    # what PyTorch's caching allocator reserves beyond the step's peak bytes, the traced step's
    # allocations and frees run twice through course_lib.caching_allocator (planner.allocator.reserved), the cache
    # kept and emptied in between; a composed trace replays the deep stream planner.trace.deep_stream builds, or
    # takes the larger of its shallow copies' where it cannot (planner.trace.compose; compare=False)
    allocator_slack: int = field(default=0, compare=False)
    allocator_slack_emptied: int = field(default=0, compare=False)
    # the gradients live at each phase's peak, and per decoder layer those its own backward made before its peak
    forward_peak_grads: int = 0
    head_backward_peak_grads: int = 0
    layer_backward_peak_grads: int = 0
    tail_backward_peak_grads: int = 0
    layer_peak_grads: tuple[int, ...] = ()
    # (phase, layer index or "pre"/"post") -> (peak, peak without gradients, gradients at the peak): what
    # course_lib.planner.trace.compose needs to compose a deep model's trace from shallow ones
    by_position: dict = field(default_factory=dict, compare=False, repr=False)
    # the allocations and frees themselves, cut by phase and position (AllocationStream, MetaTracer): what
    # planner.trace.deep_stream builds a deep model's from; not kept on disk
    stream: tuple[int, ...] = field(default=(), compare=False, repr=False)
    stream_marks: tuple[tuple[int, str, int | str], ...] = field(default=(), compare=False, repr=False)


@checked(error=PlanError)
def trace_step(spec: ModelSpec, setup: Setup, target: str = "cpu") -> Trace:
    """Trace one forward + backward of the model on the meta device at the setup's size (lesson 1).

    The model is the Hugging Face implementation itself, built from the config; LoRA adapters come
    from peft; `use_cache=False` as in training. Frozen 4-bit layers are traced as frozen 16-bit
    layers (bitsandbytes saves nothing extra for them) plus one dequantized weight alive at a time.
    """
    trace = cached_trace(
        trace_key(spec, setup, target),
        lambda: _or_refusal(
            lambda: composed_trace(spec, setup, target, _shallow) or trace_in_full(spec, setup, target)
        ),
    )
    if isinstance(trace, str):  # the setup's refusal, kept like a trace: the model is not built again
        raise PlanError(trace)
    return trace


def step_stream(spec: ModelSpec, setup: Setup, target: str = "cuda") -> list[int]:
    """The plain step's allocation stream of the whole model: the trace's (a composed trace's is the deep
    stream `planner.trace.deep_stream` built), traced again where the trace came from the disk cache, which keeps no
    stream; a composed trace whose stream could not be built is traced in full."""
    stream = trace_step(spec, setup, target).stream
    if not stream:
        composed = composed_trace(spec, setup, target, _shallow)
        stream = (composed if composed is not None and composed.stream else trace_in_full(spec, setup, target)).stream
    return list(stream)


def _or_refusal(make) -> Trace | str:
    try:
        return make()
    except PlanError as error:
        return str(error)


def cached_trace(key: tuple, make) -> Trace | str:
    """The trace for `key` from the disk cache (course_lib.cache), or `make()` kept there; a refusal (the
    PlanError's line, a str) is kept the same way."""
    names = [f.name for f in fields(Trace) if f.name not in ("by_position", "stream", "stream_marks")]
    return cached(
        "trace",
        repr(key),
        make,
        lambda trace: {"refused": trace} if isinstance(trace, str) else {n: getattr(trace, n) for n in names},
        lambda data: (
            data["refused"]
            if "refused" in data
            else Trace(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})
        ),
    )


def _shallow(spec: ModelSpec, setup: Setup, target: str) -> Trace:
    """A shallow copy's trace for `compose.composed_trace`: its slacks are never read (the deep model's are
    replayed from the deep stream, or from the copies' streams where that cannot be built)."""
    return trace_in_full(spec, setup, target, slacks=False)


def trace_in_full(spec: ModelSpec, setup: Setup, target: str, slacks: bool = True) -> Trace:
    """The step of the whole model traced layer by layer (`slacks`: with the allocator's replay of its
    stream, `Trace.allocator_slack`; without, 0)."""
    model = build_traced_model(spec, setup)
    layers = decoder_layers(model, spec.n_layers)
    tracer = MetaTracer()
    param_keys = {p.untyped_storage()._cdata for p in model.parameters()}
    # (layer, bytes) of each storage saved for backward, counted once while it lives: a storage that
    # activation offloading let go is freed, and a new one may take its key (its address)
    saved_by: list[tuple[object, int]] = []
    saved_live: set[int] = set()
    current = {"layer": None}
    inputs = [0] * len(layers)
    output = {"bytes": 0}
    grads_at = [None] * (len(layers) + 1)  # parameter gradients made when layer i's backward starts; [n]: the tail's

    offload = HostOffload() if setup.offload_activations else None
    cached = [0] * (len(layers) + 1)  # [n]: outside the layers

    def on_cache(nbytes: int) -> None:
        cached[len(layers) if current["layer"] is None else current["layer"]] += nbytes

    autocast = None if setup.autocast_dtype is None else MetaAutocast(setup.autocast_dtype, target, on_cache)

    def pack(tensor):
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key not in param_keys and key not in saved_live and storage.nbytes():
            saved_live.add(key)
            weakref.finalize(storage, saved_live.discard, key)
            saved_by.append((current["layer"], storage.nbytes()))
        return tensor if offload is None else offload.pack_hook(tensor)

    def pre_hook(index):
        def hook(module, args, kwargs):
            current["layer"] = index
            hidden = args[0] if args else kwargs.get("hidden_states")
            inputs[index] = hidden.untyped_storage().nbytes()

        return hook

    def post_hook(index):
        def hook(module, args, result):
            current["layer"] = None
            if index == len(layers) - 1:
                output["bytes"] = (
                    (result[0] if isinstance(result, (tuple, list)) else result).untyped_storage().nbytes()
                )

        return hook

    # parameter gradients made when layer i's backward starts ([n]: the tail's)
    handles = mark_positions(tracer, layers, lambda index: grads_at.__setitem__(index, tracer.grad_bytes))
    for index, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(pre_hook(index), with_kwargs=True))
        handles.append(layer.register_forward_hook(post_hook(index)))

    def grad_hook(param):
        tracer.grad_bytes += param.grad.untyped_storage().nbytes()
        tracer.set_phase(tracer.phase)

    # lesson 7: the step's temporaries of one tensor, then its gradient freed
    in_backward = (
        step_in_backward_hook(tracer, model, spec, setup, target == "cuda") if setup.optimizer_in_backward else None
    )
    for param in model.parameters():
        if param.requires_grad:
            handles.append(param.register_post_accumulate_grad_hook(grad_hook))
            if in_backward is not None:
                handles.append(param.register_post_accumulate_grad_hook(in_backward))
    ids = torch.zeros(setup.batch, setup.seq, dtype=torch.long, device="meta")
    from transformers.utils import logging as hf_logging  # off the import path: transformers takes seconds to import

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the trace is ours: keep transformers' advice off the user's screen
    for tensor in [ids, *model.parameters(), *model.buffers()]:
        tracer.exclude(tensor)
    try:
        with warnings.catch_warnings(), kernels_as_on(target, autocast):
            warnings.simplefilter("ignore")
            unpack = (lambda t: t) if offload is None else offload.unpack_hook
            with tracer, torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                with autocast or contextlib.nullcontext():  # the Trainer's autocast: the forward and the loss
                    loss, outputs = traced_loss(model, ids, setup, autocast)
                kept = (
                    outputs.logits.untyped_storage().nbytes() if setup.loop != "trainer" and outputs is not None else 0
                )
                if setup.loop == "trainer":
                    del outputs
                tracer.set_phase("head_backward")
                loss.backward()
                del loss
    except Exception as error:  # an architecture the meta device cannot run: say which
        reason = " ".join(str(error).split())[:300]
        raise PlanError(
            f"cannot trace a training step of {spec.name} on the meta device "
            f"({type(error).__name__}: {reason}); plan with --params N instead"
        ) from None
    finally:
        hf_logging.set_verbosity(verbosity)
        for handle in handles:
            handle.remove()
    saved = [0] * len(layers)
    outside = 0
    for layer, nbytes in saved_by:
        if layer is None:
            outside += nbytes
        else:
            saved[layer] += nbytes
    dequant = 0
    if setup.quant != "none":  # bitsandbytes dequantizes one frozen weight at a time, forward and backward
        dequant = max(p.numel for p in spec.params if p.module == "linear" and not p.is_lm_head) * itemsize(
            setup.weight_dtype
        )
    peaks, rest = tracer.phase_peaks, tracer.peaks_without_grads
    climbs, climbs_with_grads, layer_grads, head_grads, own = _backward_climbs(
        tracer, saved, inputs, output["bytes"], grads_at
    )
    at_peak = tracer.peak_grads
    return Trace(
        forward_peak=peaks.get("forward", 0),
        head_backward_peak=peaks.get("head_backward", 0),
        layer_backward_peak=peaks.get("layer_backward", 0),
        tail_backward_peak=peaks.get("tail_backward", 0),
        forward_peak_without_grads=rest.get("forward", 0),
        head_backward_peak_without_grads=rest.get("head_backward", 0),
        layer_backward_peak_without_grads=rest.get("layer_backward", 0),
        tail_backward_peak_without_grads=rest.get("tail_backward", 0),
        gradients=tracer.grad_bytes,
        saved=tuple(saved),
        inputs=tuple(inputs),
        output=output["bytes"],
        saved_outside=outside,
        dequant_transient=dequant,
        kept_outputs=kept,
        backward_climbs=climbs,
        backward_climbs_with_grads=climbs_with_grads,
        layer_grads=layer_grads,
        head_grads=head_grads,
        offloaded=0 if offload is None else offload.to_host,
        autocast_cached=tuple(cached[:-1]),
        autocast_cached_outside=cached[-1],
        forward_peak_grads=at_peak.get("forward", 0),
        head_backward_peak_grads=at_peak.get("head_backward", 0),
        layer_backward_peak_grads=at_peak.get("layer_backward", 0),
        tail_backward_peak_grads=at_peak.get("tail_backward", 0),
        layer_peak_grads=own,
        **(stream_slacks(tracer.stream, tracer.peak) if slacks else {}),
        by_position=dict(tracer.position_peaks),
        stream=tuple(tracer.stream),
        stream_marks=tuple(tracer.stream_marks),
    )


def _backward_climbs(tracer: MetaTracer, saved: list[int], inputs: list[int], output: int, grads_at: list):
    """Each layer's backward peak as lesson 3's cost model takes it (`transient_bytes`, `grad_bytes`,
    `head_grad_bytes` of `checkpointing.plan_cost`): what the peak at that layer holds beyond the
    saved bytes of layers 0 .. i and the gradient arriving at layer i (and, with gradients, beyond
    the parameter gradients made before its backward). Fed back into the cost model, they give the
    traced peak for no checkpointing; for a checkpointing plan, a recomputed layer's backward climbs
    as high above what it holds as without checkpointing. Last: the parameter gradients each layer's
    backward made before its peak (in its climb with gradients)."""
    n = len(saved)
    if grads_at[n] is None:  # no gradient reaches the embeddings (a frozen base): layer 0's backward ends last
        grads_at[n] = tracer.grad_bytes
    arriving = list(inputs[1:]) + [output]
    climbs, with_grads, own = [], [], []
    for i in range(n):
        peak, peak_without, grads = tracer.position_peaks.get(("layer_backward", i), (0, 0, 0))
        counted = sum(saved[: i + 1]) + arriving[i]
        climbs.append(peak_without - counted)
        with_grads.append(peak - counted - (grads_at[i] or 0))
        own.append(max(grads - (grads_at[i] or 0), 0))
    made = [(grads_at[i - 1] if i else grads_at[n]) - (grads_at[i] or 0) for i in range(n)]
    return tuple(climbs), tuple(with_grads), tuple(made), grads_at[n - 1] or 0, tuple(own)
