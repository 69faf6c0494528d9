"""The decoder layers of a model: the one way the course finds a layer stack (lesson 3, "applying a
plan"), used by checkpointing, the planner, the sharding engines and the sharded plan alike."""

from __future__ import annotations

from torch import nn

from course_lib.errors import UserError
from course_lib.validate import checked


@checked
def find_layer_stack(model: nn.Module) -> nn.ModuleList | nn.Sequential:
    """The repeated layers of a model: the model itself when it is an nn.Sequential or nn.ModuleList,
    else the outermost nn.ModuleList of same-class modules inside it, the longest if several are
    (a Hugging Face decoder's `model.layers`, GPT-2's `transformer.h`, a stack named `blocks`). A list
    inside a layer (a mixture of experts' `experts`) is never the stack, however long (lesson 3)."""
    if isinstance(model, (nn.Sequential, nn.ModuleList)):
        return model
    stacks = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList) and len(module) and len({type(layer) for layer in module}) == 1
    ]
    outermost = [
        (name, module)
        for name, module in stacks
        if not any(name.startswith(f"{other}.") for other, _ in stacks if other != name)
    ]
    if not outermost:
        raise UserError(
            f"no layer stack found in {type(model).__name__}: pass an nn.Sequential, an "
            f"nn.ModuleList, or a model holding an nn.ModuleList of identical layers"
        )
    return max(outermost, key=lambda item: len(item[1]))[1]


def layer_of_each_module(model: nn.Module) -> dict[int, int]:
    """id(module) -> the index of the decoder layer holding it, for every module inside the stack
    that `find_layer_stack` finds; empty when the model has none (lesson 6, what FSDP2 wraps)."""
    try:
        stack = find_layer_stack(model)
    except ValueError:
        return {}
    if stack is model:
        return {}
    return {id(module): index for index, layer in enumerate(stack) for module in layer.modules()}
