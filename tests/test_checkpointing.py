"""Tests of course_lib.checkpointing (lesson 3)."""

from __future__ import annotations

import math

import pytest

from course_lib.checkpointing import PlanCost, plan_boundaries, plan_cost

MiB = 2**20


# ---------------------------------------------------------------------------------------------------
# Named plans and the boundary convention
# ---------------------------------------------------------------------------------------------------

def test_named_plans_follow_the_documented_convention():
    assert plan_boundaries(4, "none") == []
    assert plan_boundaries(4, "every-layer") == [0, 1, 2, 3, 4]
    assert plan_boundaries(5, "every-2") == [0, 2, 4, 5]
    assert plan_boundaries(4, "every-1") == plan_boundaries(4, "every-layer")
    assert plan_boundaries(4, "every-9") == [0, 4]
    assert plan_boundaries(16, "sqrt") == [0, 4, 8, 12]  # checkpoint_sequential(layers, 4, x)
    assert plan_boundaries(10, "sqrt") == [0, 4, 7]  # 3 segments of 4, 3, 3: the last runs normally
    assert plan_boundaries(2, "sqrt") == []  # round(sqrt(2)) = 1 segment: nothing worth checkpointing
    assert plan_boundaries(3, " Every-Layer ") == [0, 1, 2, 3]


@pytest.mark.parametrize("n", range(1, 40))
def test_sqrt_plan_has_round_sqrt_n_segments_of_near_equal_size(n):
    cuts = plan_boundaries(n, "sqrt")
    k = round(math.sqrt(n))
    if k == 1:
        assert cuts == []
        return
    sizes = [b - a for a, b in zip(cuts, cuts[1:] + [n])]
    assert len(sizes) == k and sum(sizes) == n and max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("n, plan", [(0, "none"), (-3, "sqrt"), (4, "every-0"), (4, "every-"),
                                     (4, "most"), (4, "every-layer-2"), (4, None)])
def test_bad_named_plans_are_refused(n, plan):
    with pytest.raises(ValueError):
        plan_boundaries(n, plan)


# ---------------------------------------------------------------------------------------------------
# The cost model
# ---------------------------------------------------------------------------------------------------

def test_cost_of_no_checkpointing_is_everything_saved_and_no_recompute():
    cost = plan_cost([3, 3, 3, 3], [1, 1, 1, 1], [])
    assert isinstance(cost, PlanCost)
    assert cost.recompute_fraction == 0
    assert cost.forward_bytes == 12 + 1  # all saved bytes and the stack's output
    assert cost.peak_bytes == 12 + 1 + 1  # ... and the loss gradient beside them


def test_every_layer_saves_nothing_when_layers_store_only_their_input():
    saved = inputs = [4 * MiB] * 16
    none = plan_cost(saved, inputs, plan_boundaries(16, "none"))
    every = plan_cost(saved, inputs, plan_boundaries(16, "every-layer"))
    sqrt = plan_cost(saved, inputs, plan_boundaries(16, "sqrt"))
    assert every.peak_bytes == none.peak_bytes
    assert every.recompute_fraction == 1.0
    assert sqrt.peak_bytes < 0.6 * none.peak_bytes
    assert sqrt.recompute_fraction == pytest.approx(3 / 4)  # (k-1)/k with k = 4


def test_sqrt_beats_every_layer_when_layers_store_a_little_more_than_their_input():
    inputs = [MiB] * 16
    saved = [2 * MiB] * 16  # ratio 2 < sqrt(16)
    every = plan_cost(saved, inputs, plan_boundaries(16, "every-layer"))
    sqrt = plan_cost(saved, inputs, plan_boundaries(16, "sqrt"))
    assert sqrt.peak_bytes < every.peak_bytes


def test_recompute_fraction_weighs_layers_by_their_compute():
    cost = plan_cost([2, 2, 2], [1, 1, 1], [0, 1], compute=[3, 1, 1])
    assert cost.recompute_fraction == pytest.approx(3 / 5)


@pytest.mark.parametrize("boundaries, words", [
    ([0, 5], "out of range"), ([-1, 2], "out of range"), ([2, 1], "strictly increasing"),
    ([1, 1, 3], "strictly increasing"), ([2], "no segment"), ([0.5, 2], "integers"),
])
def test_bad_boundaries_are_refused_with_a_clear_message(boundaries, words):
    with pytest.raises(ValueError, match=words):
        plan_cost([2] * 4, [1] * 4, boundaries)


def test_mismatched_sizes_are_refused():
    with pytest.raises(ValueError, match="one entry per layer"):
        plan_cost([2, 2], [1], [])
    with pytest.raises(ValueError, match="non-negative"):
        plan_cost([2, -2], [1, 1], [])


def test_layers_that_save_their_output_hold_it_in_their_backward():
    plain = plan_cost([4, 4], [4, 4], [0, 2], output_bytes=4, head_bytes=0)
    relu = plan_cost([4, 4], [4, 4], [0, 2], output_bytes=4, head_bytes=0, output_saved=[False, True])
    assert relu.peak_bytes == plain.peak_bytes + 4


def test_peak_where_names_the_moment():
    assert "turn" in plan_cost([1] * 4, [1] * 4, []).peak_where
    assert "layers 0..3 (recomputed)" in plan_cost([9] * 4, [1] * 4, [0, 4]).peak_where


# ---------------------------------------------------------------------------------------------------
# The optimal plan: dynamic programming == brute force
# ---------------------------------------------------------------------------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from course_lib.checkpointing import (  # noqa: E402
    all_plans, min_feasible_peak, optimal_plan, plan_frontier, segments_plan)


@st.composite
def stacks(draw, max_layers=6):
    n = draw(st.integers(1, max_layers))
    sizes = st.lists(st.integers(0, 40), min_size=n, max_size=n)
    kwargs = {"compute": draw(st.lists(st.integers(0, 9), min_size=n, max_size=n))}
    if draw(st.booleans()):
        kwargs.update(output_bytes=draw(st.integers(0, 20)), grad_bytes=draw(sizes),
                      transient_bytes=draw(sizes), head_bytes=draw(st.integers(0, 30)),
                      head_grad_bytes=draw(st.integers(0, 10)),
                      output_saved=draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    return draw(sizes), draw(st.lists(st.integers(0, 20), min_size=n, max_size=n)), kwargs


@settings(max_examples=150, deadline=None)
@given(stacks(), st.integers(0, 200))
def test_optimal_plan_matches_brute_force(stack, slack):
    saved, inputs, kwargs = stack
    costs = [plan_cost(saved, inputs, plan, **kwargs) for plan in all_plans(len(saved))]
    minimum = min(c.peak_bytes for c in costs)
    assert min_feasible_peak(saved, inputs, **kwargs) == minimum
    budget = minimum + slack
    best = min(c.recompute_fraction for c in costs if c.peak_bytes <= budget)
    plan = optimal_plan(saved, inputs, budget, **kwargs)
    cost = plan_cost(saved, inputs, plan, **kwargs)
    assert cost.peak_bytes <= budget
    assert cost.recompute_fraction == pytest.approx(best, abs=1e-9)


@settings(max_examples=60, deadline=None)
@given(stacks())
def test_frontier_is_exactly_the_pareto_set_of_all_plans(stack):
    saved, inputs, kwargs = stack
    points = {(c.peak_bytes, round(c.recompute_fraction, 9))
              for c in (plan_cost(saved, inputs, p, **kwargs) for p in all_plans(len(saved)))}
    pareto = sorted((m, r) for m, r in points if not any(
        (m2 <= m and r2 <= r) and (m2, r2) != (m, r) for m2, r2 in points))
    frontier = plan_frontier(saved, inputs, **kwargs)
    assert [(m, round(r, 9)) for m, r, _ in frontier] == pareto
    for peak, recompute, plan in frontier:  # each point is what plan_cost says of its plan
        cost = plan_cost(saved, inputs, plan, **kwargs)
        assert (cost.peak_bytes, cost.recompute_fraction) == (peak, pytest.approx(recompute))


def test_optimal_plan_on_uneven_layers_checkpoints_the_cheap_ones():
    # layers 0, 1, 4, 5 store the same; 0 and 1 are cheap to recompute, 4 and 5 expensive
    saved, inputs, compute = [30, 30, 2, 2, 30, 30], [1] * 6, [1, 1, 1, 1, 9, 9]
    assert plan_cost(saved, inputs, [], compute=compute).peak_bytes > 100
    assert optimal_plan(saved, inputs, 70, compute=compute) == [0, 2]
    assert plan_cost(saved, inputs, [4, 6], compute=compute).peak_bytes > 70  # the other pair won't fit


def test_a_budget_below_the_minimum_is_refused_naming_the_minimum():
    saved, inputs = [8] * 9, [1] * 9
    minimum = min_feasible_peak(saved, inputs)
    assert optimal_plan(saved, inputs, minimum) is not None
    with pytest.raises(ValueError, match=f"minimum feasible activation memory of {minimum} bytes"):
        optimal_plan(saved, inputs, minimum - 1)
    with pytest.raises(ValueError, match="non-negative"):
        optimal_plan(saved, inputs, -5)


def test_a_generous_budget_needs_no_checkpointing():
    assert optimal_plan([8] * 9, [1] * 9, 10**9) == []


def test_segments_plan_and_all_plans():
    assert segments_plan(16, 4) == [0, 4, 8, 12]
    assert segments_plan(16, 4, checkpoint_last=True) == [0, 4, 8, 12, 16]
    assert segments_plan(5, 1) == []
    assert segments_plan(5, 1, checkpoint_last=True) == [0, 5]
    with pytest.raises(ValueError):
        segments_plan(5, 6)
    plans = list(all_plans(4))
    assert len(plans) == 2 ** 5 - 4 - 1 and len({tuple(p) for p in plans}) == len(plans)


# ---------------------------------------------------------------------------------------------------
# Applying plans: same gradients as the unchecked run
# ---------------------------------------------------------------------------------------------------

import warnings  # noqa: E402

import torch  # noqa: E402

from course_lib.checkpointing import (  # noqa: E402
    apply_plan, assert_gradients_flow, checkpointed_forward, find_layer_stack, hf_checkpointing,
    measure_plan, mlp_stack, profile_stack, tiny_decoder)

warnings.filterwarnings("ignore", message=".*use_reentrant.*")


def _grads(model, loss_fn):
    model.zero_grad(set_to_none=True)
    loss_fn().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _assert_same_grads(expected, got):
    assert expected.keys() == got.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def mlp():
    torch.manual_seed(0)
    model, x = mlp_stack(6, 32, "gelu"), torch.randn(64, 32)
    return model, x, (lambda: model(x).pow(2).mean())


@pytest.mark.parametrize("plan", ["none", "every-layer", "sqrt", "every-4", [1, 3], [0, 2, 5], [2, 6]])
@pytest.mark.parametrize("policy", ["full", "selective"])
def test_plans_on_a_sequential_model_give_the_unchecked_gradients(mlp, plan, policy):
    model, x, loss_fn = mlp
    expected = _grads(model, loss_fn)
    with apply_plan(model, plan, policy=policy) as applied:
        assert applied.boundaries == (plan if isinstance(plan, list) else applied.boundaries)
        _assert_same_grads(expected, _grads(model, loss_fn))
    assert not any("forward" in vars(layer) for layer in model)  # removed on exit
    _assert_same_grads(expected, _grads(model, loss_fn))


def test_checkpointed_forward_matches_the_plain_forward(mlp):
    model, x, _ = mlp
    expected = _grads(model, lambda: model(x).pow(2).mean())
    got = _grads(model, lambda: checkpointed_forward(model, x, [0, 3, 5]).pow(2).mean())
    _assert_same_grads(expected, got)


def test_a_plan_really_recomputes(mlp):
    model, x, loss_fn = mlp
    calls = []
    handle = model[1].register_forward_hook(lambda *args: calls.append(1))
    try:
        with apply_plan(model, [0, 2]):
            loss_fn().backward()
    finally:
        handle.remove()
        model.zero_grad(set_to_none=True)
    assert len(calls) == 1  # layer 1's hooks run once (outside the checkpoint) ...
    # ... while its forward ran twice: the recompute shows in a counter inside the layer
    counter = []
    original = model[1][0].forward
    model[1][0].forward = lambda inp: (counter.append(1), original(inp))[1]
    try:
        with apply_plan(model, [0, 2]):
            loss_fn().backward()
    finally:
        del model[1][0].forward
        model.zero_grad(set_to_none=True)
    assert len(counter) == 2


@pytest.mark.parametrize("boundaries, words", [([0, 7], "out of range"), ([3, 1], "strictly increasing")])
def test_apply_plan_refuses_bad_boundaries(mlp, boundaries, words):
    model = mlp[0]
    with pytest.raises(ValueError, match=words):
        apply_plan(model, boundaries)
    assert not any("forward" in vars(layer) for layer in model)


def test_apply_plan_twice_is_refused(mlp):
    model = mlp[0]
    with apply_plan(model, [0, 2]):
        with pytest.raises(ValueError, match="applied twice"):
            apply_plan(model, [2, 4])


def test_find_layer_stack():
    model = tiny_decoder("llama", n_layers=3, hidden=32, heads=2)
    assert find_layer_stack(model) is model.model.layers
    with pytest.raises(ValueError, match="no layer stack"):
        find_layer_stack(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("arch, attn", [("llama", "sdpa"), ("llama", "eager"), ("gpt2", "sdpa")])
def test_plans_on_a_hugging_face_decoder_give_the_unchecked_gradients(arch, attn):
    torch.manual_seed(0)
    model = tiny_decoder(arch, n_layers=4, hidden=32, heads=2, vocab=64, attn_implementation=attn)
    ids = torch.randint(0, 64, (2, 24))
    loss_fn = lambda: model(input_ids=ids, labels=ids).loss  # noqa: E731
    expected = _grads(model, loss_fn)
    for plan, policy in [("every-layer", "full"), ("sqrt", "full"), ([1, 4], "full"), ("every-2", "selective")]:
        with apply_plan(model, plan, policy=policy):
            _assert_same_grads(expected, _grads(model, loss_fn))
    with torch.no_grad(), apply_plan(model, "every-2"):  # no grad: the layers simply run
        assert torch.isfinite(model(input_ids=ids).logits).all()


def test_hugging_face_checkpointing_on_is_refused():
    model = tiny_decoder("llama", n_layers=2, hidden=32, heads=2, vocab=64)
    hf_checkpointing(model)
    with pytest.raises(ValueError, match="hf_checkpointing"):
        apply_plan(model, "every-layer")


# ---------------------------------------------------------------------------------------------------
# assert_gradients_flow: the LoRA + reentrant trap
# ---------------------------------------------------------------------------------------------------

def _lora_model():
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = tiny_decoder("llama", n_layers=2, hidden=32, heads=2, vocab=64)
    return peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))


def test_gradients_flow_through_lora_with_non_reentrant_checkpointing():
    model = _lora_model()
    ids = torch.randint(0, 64, (2, 12))
    assert_gradients_flow(model, {"input_ids": ids, "labels": ids})
    with apply_plan(model, "every-layer"):
        assert_gradients_flow(model, {"input_ids": ids, "labels": ids})


def test_the_reentrant_trap_fails_loudly_with_the_fix():
    model = _lora_model()
    ids = torch.randint(0, 64, (2, 12))
    base = model.base_model.model
    hf_checkpointing(base, use_reentrant=True)
    base.disable_input_require_grads()  # what older stacks did: the frozen embeddings cut the graph
    with pytest.raises(AssertionError, match="use_reentrant=False") as info:
        assert_gradients_flow(model, {"input_ids": ids, "labels": ids})
    assert "lora_A" in str(info.value) and "enable_input_require_grads" in str(info.value)
    base.enable_input_require_grads()  # the other fix
    assert_gradients_flow(model, {"input_ids": ids, "labels": ids})


def test_a_frozen_parameter_that_should_train_is_named():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    unused = torch.nn.Linear(4, 4)
    model.add_module("unused", unused)
    model.forward = lambda x: model[1](model[0](x))
    with pytest.raises(AssertionError, match="unused.weight"):
        assert_gradients_flow(model, torch.randn(3, 4))


# ---------------------------------------------------------------------------------------------------
# The cost model against measurement (CPU, course_lib.measure's live-storage tracker)
# ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gelu_mlp():
    """16 layers of Linear + GELU: each stores its input and the Linear's output, twice its input."""
    torch.manual_seed(0)
    model, x = mlp_stack(16, 128, "gelu"), torch.randn(1024, 128)
    loss_fn = lambda: model(x).pow(2).mean()  # noqa: E731
    return model, x, loss_fn, profile_stack(model, loss_fn, [x])


def test_profile_counts_what_each_layer_stores(gelu_mlp):
    _, x, _, profile = gelu_mlp
    activation = x.numel() * 4
    assert profile.input_bytes == [activation] * 16
    assert profile.saved_bytes == [2 * activation] * 16  # input + Linear output (GELU's input)
    assert profile.output_saved == [False] * 16
    assert profile.grad_bytes == [(128 * 128 + 128) * 4] * 16
    assert profile.baseline_input_bytes == activation  # the batch is the stack's input
    assert len(set(profile.compute)) == 1 and profile.compute[0] > 0


def test_sqrt_plan_measured_within_15_percent_of_the_cost_model_and_below_every_layer(gelu_mlp):
    model, x, loss_fn, profile = gelu_mlp
    sqrt = measure_plan(model, loss_fn, [x], "sqrt", profile=profile, repeats=0)
    every = measure_plan(model, loss_fn, [x], "every-layer", profile=profile, repeats=0)
    assert abs(sqrt.simple_error) <= 0.15, sqrt  # saved and input sizes alone (what the planner uses)
    assert abs(sqrt.error) <= 0.05, sqrt  # refined with the measured transients and head
    assert sqrt.measured_peak < every.measured_peak
    assert profile.cost("sqrt").peak_bytes < profile.cost("every-layer").peak_bytes


def test_every_layer_saves_nothing_when_a_layer_stores_only_its_input():
    torch.manual_seed(0)
    model, x = mlp_stack(16, 64, "relu"), torch.randn(1024, 64)
    loss_fn = lambda: model(x).pow(2).mean()  # noqa: E731
    profile = profile_stack(model, loss_fn, [x])
    assert profile.saved_bytes == profile.input_bytes and all(profile.output_saved)
    none, every, sqrt = (measure_plan(model, loss_fn, [x], plan, profile=profile, repeats=0)
                         for plan in ("none", "every-layer", "sqrt"))
    assert every.measured_peak == none.measured_peak
    assert sqrt.measured_peak < 0.7 * none.measured_peak
    for row in (none, every, sqrt):
        assert abs(row.error) <= 0.05, row


def profiled_decoder(n_layers):
    """A seeded tiny Llama decoder, its batch, its loss and its layer profile."""
    torch.manual_seed(0)
    model = tiny_decoder("llama", n_layers=n_layers, hidden=64, heads=2, vocab=128)
    ids = torch.randint(0, 128, (2, 128))
    loss_fn = lambda: model(input_ids=ids, labels=ids).loss  # noqa: E731
    return model, ids, loss_fn, profile_stack(model, loss_fn, [ids])


def test_cost_model_agrees_with_a_hugging_face_decoder():
    model, ids, loss_fn, profile = profiled_decoder(6)
    assert profile.saved_bytes[0] > 10 * profile.input_bytes[0]  # a decoder layer stores far more
    rows = [measure_plan(model, loss_fn, [ids], plan, profile=profile, repeats=0)
            for plan in ("none", "every-layer", "sqrt", [1, 3, 5])]
    for row in rows:
        assert abs(row.error) <= 0.10, row
        assert abs(row.simple_error) <= 0.15, row
    assert rows[1].measured_peak < rows[2].measured_peak < rows[0].measured_peak


def test_selective_checkpointing_keeps_more_than_full_and_less_than_none():
    model, ids, loss_fn, profile = profiled_decoder(4)
    full = measure_plan(model, loss_fn, [ids], "every-layer", profile=profile, repeats=0)
    selective = measure_plan(model, loss_fn, [ids], "every-layer", profile=profile, repeats=0,
                             policy="selective")
    none = measure_plan(model, loss_fn, [ids], "none", profile=profile, repeats=0)
    assert full.measured_peak < selective.measured_peak < none.measured_peak


def test_tradeoff_table_times_plans_in_turns_and_leaves_selective_unpredicted():
    from course_lib.checkpointing import default_plans, format_tradeoff, measure_tradeoff

    torch.manual_seed(0)
    model, x = mlp_stack(4, 16, "relu"), torch.randn(32, 16)
    loss_fn = lambda: model(x).pow(2).mean()  # noqa: E731
    profile = profile_stack(model, loss_fn, [x])
    plans = default_plans(profile)
    assert {"every-layer", "sqrt", "optimal @ sqrt peak", "1 segments"} <= plans.keys()
    rows = measure_tradeoff(model, loss_fn, [x], {"none": [], "sqrt": "sqrt"}, repeats=1,
                            policies=("full", "selective"), profile=profile)
    assert [(r.plan, r.policy) for r in rows] == [("none", "full"), ("none", "selective"),
                                                  ("sqrt", "full"), ("sqrt", "selective")]
    assert all(r.step_seconds > 0 for r in rows)
    assert rows[1].predicted_peak is None and rows[1].error is None and rows[0].error is not None
    table = format_tradeoff(rows, "title")
    assert table.splitlines()[0] == "title" and "n/a" in table and "1.00x" in table


def test_uneven_stack_specs():
    from course_lib.checkpointing import uneven_stack

    stack = uneven_stack("mlp2 pw mlp1", 8)
    assert len(stack) == 3 and stack[0].up.out_features == 16
    for spec in ("mlp0", "conv", ""):
        with pytest.raises(ValueError):
            uneven_stack(spec, 8)
