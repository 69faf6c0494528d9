"""Lesson 3's plans at their edges: the k around sqrt(n) in the default trade-off, a one-layer unit named
as one layer, the smallest stack a plan can cover."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from course_lib.checkpointing import (
    assert_gradients_flow,
    default_plans,
    measure_recompute,
    named_plan,
    plan_cost,
    profile_stack,
    segments_plan,
    validate_plan,
)
from course_lib.checkpointing.demo_models import mlp_stack, tiny_decoder
from course_lib.checkpointing.profile import StackProfile
from course_lib.errors import UserError


def _profile(n: int) -> StackProfile:
    return StackProfile(
        saved_bytes=[10] * n,
        input_bytes=[1] * n,
        output_bytes=1,
        grad_bytes=[0] * n,
        transient_bytes=[0] * n,
        head_bytes=0,
        head_grad_bytes=0,
        compute=[1.0] * n,
        output_saved=[False] * n,
    )


def test_the_default_trade_off_tries_the_segment_counts_either_side_of_sqrt_n():
    # 25 layers: sqrt is 5, so 4 and 6 segments are tried beside it (4 is not among 1, 2, 3 and 6 not 2 sqrt)
    segments = {name for name in default_plans(_profile(25)) if name.endswith(" segments")}
    assert segments == {f"{k} segments" for k in (1, 2, 3, 4, 5, 6, 10, 12, 25)}


def test_the_default_trade_off_of_one_layer_is_one_segment():
    assert {name for name in default_plans(_profile(1)) if name.endswith(" segments")} == {"1 segments"}


def test_a_peak_in_one_unchecked_layer_is_named_as_that_layer_and_a_segments_as_its_range():
    one = plan_cost([10] * 4, [1] * 4, [], transient_bytes=[0, 0, 0, 5])
    assert one.peak_where == "in the backward of layer 3" and one.peak_layer == 3
    two = plan_cost([10] * 4, [1] * 4, [(1, 3)], transient_bytes=[0, 0, 50, 0])
    assert two.peak_where == "in the backward of layers 1..2 (recomputed)" and two.peak_layer == 2


def test_a_one_layer_stack_takes_a_segment_over_its_only_layer():
    assert validate_plan([(0, 1)], 1) == [(0, 1)]
    assert plan_cost([4], [1], [(0, 1)]).recompute_fraction == 1.0
    with pytest.raises(UserError):
        validate_plan([(0, 2)], 1)
    assert named_plan(1, "every-layer") == [(0, 1)] and segments_plan(1, 1, checkpoint_last=True) == [(0, 1)]
    with pytest.raises(UserError):
        named_plan(0, "every-layer")


@pytest.mark.parametrize("n_layers", [1, 3])
def test_the_heads_climb_ends_where_the_last_layers_backward_starts(n_layers):
    # the same head and loss after one layer or three: no layer's backward (its gradients) in the head's bytes
    torch.manual_seed(0)
    one, x = mlp_stack(1, 16), torch.randn(8, 16)
    head = profile_stack(one, lambda: one(x).pow(2).mean(), [x]).head_bytes
    torch.manual_seed(0)
    deep = mlp_stack(n_layers, 16)
    profile = profile_stack(deep, lambda: deep(x).pow(2).mean(), [x])
    assert profile.head_bytes == head
    assert profile.head_bytes < sum(profile.grad_bytes) + 16 * 16 * 4  # below even one layer's weight gradient


def test_measure_recompute_measures_the_stack_it_is_given():
    torch.manual_seed(0)
    model, x = mlp_stack(4, 16), torch.randn(8, 16)
    loss_fn = lambda: model(x).pow(2).mean()  # noqa: E731
    # equal layers: recomputing layer 0 of a 2-layer stack is half of its forward, of the 4-layer stack a quarter
    assert measure_recompute(model, loss_fn, [(0, 1)], stack=model[:2]) == pytest.approx(0.5)
    assert measure_recompute(model, loss_fn, [(0, 1)]) == pytest.approx(0.25)


class _Argmax(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x):
        return self.linear(x).argmax(-1)  # integers: cut from the graph


def test_an_output_cut_from_the_graph_is_every_parameter_without_a_gradient():
    with pytest.raises(AssertionError, match="2 of 2 trainable parameters got no gradient"):
        assert_gradients_flow(_Argmax(), torch.randn(2, 4))


def test_phi3s_special_tokens_are_in_its_vocabulary():
    vocab = 64
    config = tiny_decoder("phi3", n_layers=1, hidden=32, heads=2, vocab=vocab).config
    assert config.bos_token_id == config.eos_token_id == vocab - 1  # the last id, inside the vocabulary
