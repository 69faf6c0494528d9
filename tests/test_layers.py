"""The one decoder-layer finder (course_lib.layers), on every bundled architecture, a stack named
`blocks` and a mixture of experts, and its users: the planner's parameter list and the sharded plan."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from course_lib.layers import find_layer_stack, layer_of_each_module
from course_lib.models import build_model, bundled_models, load_config, spec_from_model
from course_lib.planner.parallel.fsdp import layer_and_root_numels


@pytest.mark.parametrize("name", bundled_models())
def test_every_bundled_architecture_has_its_decoder_layers_found(name):
    config = load_config(name)
    config.num_hidden_layers = 3  # the same classes, fewer of them
    model = build_model(config)
    stack = find_layer_stack(model)
    assert len(stack) == 3
    assert type(stack[0]).__name__.endswith(("DecoderLayer", "Block"))
    spec = spec_from_model(model, name, config)
    assert {info.layer for info in spec.params} == {None, 0, 1, 2}
    layers, root = layer_and_root_numels(spec)
    assert len(layers) == 3 and root == sum(p.numel() for p in model.parameters()) - sum(layers)
    assert all(info.layer is None for info in spec.params if info.module == "embedding" or info.is_lm_head)


class _Block(nn.Module):
    def __init__(self, width: int, experts: int = 0) -> None:
        super().__init__()
        self.attention = nn.Linear(width, width)
        self.experts = nn.ModuleList(nn.Linear(width, width) for _ in range(experts))


class _Model(nn.Module):
    def __init__(self, layers: int, experts: int = 0, name: str = "blocks") -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        setattr(self, name, nn.ModuleList(_Block(4, experts) for _ in range(layers)))
        self.head = nn.Linear(4, 10)


def test_a_stack_named_blocks_is_found():
    model = _Model(3)
    assert find_layer_stack(model) is model.blocks
    spec = spec_from_model(model, "blocks")
    assert [info.layer for info in spec.params] == [None, 0, 0, 1, 1, 2, 2, None, None]


def test_the_layers_of_a_mixture_of_experts_not_its_experts():
    model = _Model(2, experts=8, name="layers")  # 8 experts in each of 2 layers: the longest list is `experts`
    assert find_layer_stack(model) is model.layers
    layer_of = layer_of_each_module(model)
    assert layer_of[id(model.layers[1].experts[7])] == 1 and id(model.embed) not in layer_of


def test_mixtral_s_decoder_layers_are_found_not_its_experts():
    from transformers import MixtralConfig

    config = MixtralConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=8,
        num_experts_per_tok=2,
    )
    with torch.device("meta"):
        from transformers import MixtralForCausalLM

        model = MixtralForCausalLM(config)
    assert find_layer_stack(model) is model.model.layers
    spec = spec_from_model(model, "mixtral", config)
    layers, _ = layer_and_root_numels(spec)
    assert len(layers) == 2 and layers[0] == layers[1] > 8 * 16 * 32


def test_no_stack_is_a_clear_error():
    with pytest.raises(ValueError, match="no layer stack"):
        find_layer_stack(nn.Linear(2, 2))
    assert layer_of_each_module(nn.Linear(2, 2)) == {}
