"""Applying a checkpoint plan to a layer stack, exactly or not at all (lesson 3, "applying a plan").

Each segment runs under one non-reentrant checkpoint frame of torch (the machinery behind
`torch.utils.checkpoint.checkpoint(..., use_reentrant=False)` and `torch.distributed._composable.
checkpoint`): the frame opens when the model calls the segment's first layer and closes when its last
layer returns. In between, the model calls every layer itself, with that layer's own arguments (its own
mask, as Gemma-2's and Qwen2's sliding layers need), and each call is recorded. The backward replays
the recorded calls from the segment's saved input, under the RNG state of the forward (dropout draws
the same masks). Whatever cannot be replayed exactly is refused with a clear error: layers called out
of order, a hidden state changed between two layers, random numbers drawn between two layers, an
argument made inside the segment, a KV cache.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import _checkpoint_without_reentrant_generator, checkpoint, noop_context_fn

from course_lib.checkpointing.plans import validate_plan
from course_lib.checkpointing.selective import context_fn_for
from course_lib.errors import UserError
from course_lib.layers import find_layer_stack
from course_lib.validate import Count, checked

_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")


def _hidden_of(output):
    return output[0] if isinstance(output, (tuple, list)) else output


def _rng_state() -> list[torch.Tensor]:
    """The RNG states a layer's dropout draws from: the CPU's, and each CUDA device's once CUDA is up."""
    states = [torch.get_rng_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states += torch.cuda.get_rng_state_all()
    return states


def _tensors(obj) -> list[torch.Tensor]:
    return [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)]


def _positional(options: dict) -> list:
    """`options` in the order of torch's private `_checkpoint_without_reentrant_generator(fn, ..., *args)`
    (the frame torch.utils.checkpoint itself uses), whose extra positional arguments are the inputs:
    read from its signature, so that a torch whose private order differs fails with one clear line."""
    names = [
        p.name
        for p in inspect.signature(_checkpoint_without_reentrant_generator).parameters.values()
        if p.kind is p.POSITIONAL_OR_KEYWORD
    ][1:]
    if set(names) != set(options):
        raise RuntimeError(
            f"apply_plan needs torch.utils.checkpoint's non-reentrant frame with {sorted(options)}; "
            f"this torch {torch.__version__} has {names}: use torch.utils.checkpoint per layer instead"
        )
    return [options[name] for name in names]


class _OpenSegment:
    """One segment's frame while the forward runs through it, and the calls to replay."""

    def __init__(self, plan: AppliedPlan, start: int, end: int, hidden: torch.Tensor) -> None:
        self.start, self.end, self.next = start, end, start
        self.calls: list[tuple[tuple, dict, bool]] = []  # (args after the hidden, kwargs, hidden as kwarg)
        self.made: set[int] = set()  # ids of tensors the segment's layers returned
        self.last_hidden: torch.Tensor | None = None
        self.rng_after: list[torch.Tensor] = []  # the RNG state when the last layer returned
        layers = plan.layers

        def replay(hidden):
            plan.replaying += 1
            try:
                for index, (args, kwargs, as_kwarg) in enumerate(self.calls):
                    layer = layers[start + index]
                    out = layer(**kwargs, hidden_states=hidden) if as_kwarg else layer(hidden, *args, **kwargs)
                    hidden = _hidden_of(out)
            finally:
                plan.replaying -= 1
            return out

        options = {
            "preserve_rng_state": True,
            "context_fn": plan.context_fn or noop_context_fn,
            "determinism_check": "default",
            "debug": False,
            "early_stop": True,
        }
        self.frame = _checkpoint_without_reentrant_generator(replay, *_positional(options), hidden)
        next(self.frame)

    def close(self) -> None:
        self.last_hidden, self.made, self.rng_after = None, set(), []  # the replay keeps only the calls
        frame, self.frame = self.frame, None  # no cycle: the graph holds the frame, the frame the replay
        try:
            next(frame)
        except StopIteration:
            return
        raise RuntimeError("torch's checkpoint frame did not close")

    def abort(self) -> None:
        frame, self.frame = self.frame, None
        frame.close()


@checked
class AppliedPlan:
    """A checkpoint plan applied to a layer stack; `remove()` (or leaving the `with` block) restores it
    (lesson 3, "applying a plan").

    Forward hooks on the segments' layers open and close each segment's checkpoint frame; the layers,
    their parameters, state_dict and names are untouched. The model computes exactly what it computes
    without the plan (a test checks loss and every gradient on each bundled architecture), or raises.
    """

    def __init__(
        self, model: nn.Module, stack: Iterable[nn.Module], plan, policy, recompute_context: Callable | None = None
    ) -> None:
        self.layers = list(stack)
        if not self.layers or not all(isinstance(layer, nn.Module) for layer in self.layers):
            raise UserError("stack must be the model's layers, an nn.ModuleList or nn.Sequential of modules")
        self.plan = validate_plan(plan, len(self.layers))
        self.policy = policy
        self.context_fn = context_fn_for(policy)
        if recompute_context is not None:
            if self.context_fn is not None:
                raise UserError("recompute_context applies to full checkpointing: give policy='full'")
            self.context_fn = lambda: (contextlib.nullcontext(), recompute_context())
        self.replaying = 0
        self.open: _OpenSegment | None = None
        for layer in self.layers:
            if getattr(layer, "gradient_checkpointing", False):
                raise UserError(
                    "the model's own gradient checkpointing is on: call "
                    "course_lib.checkpointing.hf_checkpointing(model, False) (or "
                    "model.gradient_checkpointing_disable()) before applying a plan, or layers "
                    "would be checkpointed twice"
                )
            if getattr(layer, "_course_plan", None) is not None:
                raise UserError(
                    "a checkpoint plan is applied to this stack already (a plan applied twice?): "
                    "remove the other plan first"
                )
        self.segment_of = {i: (a, b) for a, b in self.plan for i in range(a, b)}
        self._handles = []
        for index, layer in enumerate(self.layers):
            layer._course_plan = self
            if index in self.segment_of:
                self._handles.append(layer.register_forward_pre_hook(self._pre(index), with_kwargs=True))
                self._handles.append(layer.register_forward_hook(self._post(index), with_kwargs=True, always_call=True))
        if not isinstance(model, nn.ModuleList):  # a forward that ends inside a segment is refused
            self._handles.append(model.register_forward_hook(self._model_done, always_call=True))

    def _fail(self, message: str):
        if self.open is not None:
            self.open.abort()
            self.open = None
        raise UserError(f"apply_plan cannot run this exactly: {message}")

    def _pre(self, index: int):
        def hook(module, args, kwargs):
            if self.replaying:
                return None
            start, end = self.segment_of[index]
            as_kwarg = not args
            hidden = kwargs.get("hidden_states") if as_kwarg else args[0]
            if not isinstance(hidden, torch.Tensor):
                self._fail(f"layer {index} was called without a hidden-state tensor first")
            rest_args = {k: v for k, v in kwargs.items() if k != "hidden_states"} if as_kwarg else kwargs
            for name in _CACHE_KWARGS:
                if rest_args.get(name) is not None:
                    self._fail(
                        f"layer {index} got a KV cache ({name}): the recompute would write it twice; "
                        "train with use_cache=False"
                    )
            if any("cache" in type(a).__name__.lower() for a in args[1:] if a is not None):
                self._fail(
                    f"layer {index} got a KV cache: the recompute would write it twice; train with use_cache=False"
                )
            segment = self.open
            if index == start:
                if segment is not None:
                    self._fail(
                        f"layer {index} starts a segment while layers {segment.start}..{segment.end - 1} "
                        "are still running"
                    )
                if not torch.is_grad_enabled():
                    return None  # no backward, nothing to checkpoint: the layers simply run
                self.open = segment = _OpenSegment(self, start, end, hidden)
            else:
                if segment is None:
                    if not torch.is_grad_enabled():
                        return None
                    self._fail(f"layer {index} was called before layer {start}, the first of its segment")
                if index != segment.next:
                    self._fail(f"layer {index} was called while layer {segment.next} was expected next")
                if hidden is not segment.last_hidden:
                    self._fail(
                        f"the hidden state reaching layer {index} is not what layer {index - 1} "
                        "returned: the model changes it between layers, which a replay cannot repeat"
                    )
                if any(not torch.equal(a, b) for a, b in zip(segment.rng_after, _rng_state())):
                    self._fail(
                        f"the model draws random numbers between layers {index - 1} and {index}: the "
                        "replay would give the later layers other dropout masks"
                    )
            made = segment.made
            if any(id(t) in made for t in _tensors((args[1:], rest_args))):
                self._fail(f"layer {index} got an argument made by an earlier layer of its segment")
            segment.calls.append((tuple(args[1:]), dict(rest_args), as_kwarg))
            return None

        return hook

    def _post(self, index: int):
        def hook(module, args, kwargs, output):
            segment = self.open
            if self.replaying or segment is None or index != segment.next:
                return None
            if output is None:  # the layer raised: close the frame, let the error through
                segment.abort()
                self.open = None
                return None
            segment.made |= {id(t) for t in _tensors(output)}
            segment.last_hidden = _hidden_of(output)
            segment.next = index + 1
            if segment.next < segment.end:
                segment.rng_after = _rng_state()
            if segment.next == segment.end:
                self.open = None
                segment.close()
            return None

        return hook

    def _model_done(self, module, args, output):
        if self.open is None or self.replaying:
            return
        segment = self.open
        if output is None:  # the forward raised: close the frame, let the error through
            segment.abort()
            self.open = None
            return
        self._fail(f"the forward ended inside the segment {segment.start}..{segment.end - 1}")

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for layer in self.layers:
            if getattr(layer, "_course_plan", None) is self:
                del layer._course_plan

    def __enter__(self) -> AppliedPlan:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"AppliedPlan(plan={self.plan}, policy={self.policy!r})"


@checked
def apply_plan(
    model: nn.Module, plan, *, policy="full", stack: nn.Module | None = None, recompute_context=None
) -> AppliedPlan:
    """Checkpoint `model`'s layer stack by a plan, non-reentrant (lesson 3, "applying a plan").

    `plan`: a list of (start, end) segments or a plan name ("sqrt", "every-2", "hf-every-2", ...).
    `model`: an nn.Sequential, an nn.ModuleList, or a model holding one (a Hugging Face decoder: its
    `model.layers`); `stack` names the stack explicitly. `policy`: "full" (keep only segment inputs),
    a policy name of `course_lib.checkpointing.POLICIES`, or any policy function for
    `torch.utils.checkpoint.create_selective_checkpoint_contexts`. `recompute_context`: a function
    returning a context manager the backward's replay runs under (the planner's meta-device autocast,
    which torch's checkpoint cannot restore as it restores torch.autocast), with full checkpointing.

    Returns an `AppliedPlan`; use it as a context manager or call `.remove()` to undo.
    """
    layers = stack if stack is not None else find_layer_stack(model)
    return AppliedPlan(model, layers, plan, policy, recompute_context)


@checked
def hf_has_every_n_layers(model: nn.Module) -> bool:
    """Whether this transformers version takes `every_n_layers` (lesson 3, "the one-liner"): it
    arrived with `activation_checkpointing_enable`, in transformers 5.23."""
    return hasattr(model, "activation_checkpointing_enable")


@checked
def hf_checkpointing(
    model: nn.Module, enable: bool = True, *, use_reentrant: bool = False, every_n_layers: Count = 1
) -> None:
    """Hugging Face's one-liner, on any transformers version (lesson 3, "the one-liner").

    Every decoder layer becomes its own checkpointed segment (the plan "every-layer"; with
    `every_n_layers=K`, transformers >= 5.23, the plan "hf-every-K"). transformers >= 5.23 calls it
    `activation_checkpointing_enable` (the old `gradient_checkpointing_enable` warns). It also turns on
    `enable_input_require_grads()`, which keeps reentrant checkpointing from cutting the graph under
    frozen embeddings (LoRA).
    """
    new = "activation_checkpointing_enable" if enable else "activation_checkpointing_disable"
    old = "gradient_checkpointing_enable" if enable else "gradient_checkpointing_disable"
    method = getattr(model, new, None) or getattr(model, old, None)
    if not callable(method):
        raise UserError(
            f"{type(model).__name__} is not a transformers model ({old} is transformers'): use apply_plan "
            "for a torch model"
        )
    if not enable:
        method()
        return
    kwargs = {"use_reentrant": use_reentrant}
    extra = {} if every_n_layers == 1 else {"every_n_layers": every_n_layers}
    if method.__name__ == new:
        method(activation_checkpointing_kwargs=kwargs, **extra)
    elif extra:
        raise UserError("every_n_layers needs transformers >= 5.23 (activation_checkpointing_enable)")
    else:
        method(gradient_checkpointing_kwargs=kwargs)


@checked
def checkpointed_forward(layers: Sequence[nn.Module], x: torch.Tensor, plan, *, policy="full") -> torch.Tensor:
    """Run `layers` one after the other on `x` under a plan with `torch.utils.checkpoint.checkpoint`,
    without touching the modules (lesson 3, "the raw API")."""
    layers = list(layers)
    starts = dict(validate_plan(plan, len(layers)))
    context_fn = context_fn_for(policy)
    extra = {} if context_fn is None else {"context_fn": context_fn}

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
