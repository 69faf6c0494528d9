"""Tests of course_lib.checkpointing's apply_plan (exact or refused), selective policies and the
measurements against the cost model (lesson 3)."""

from __future__ import annotations

import warnings

import pytest
import torch

from course_lib.checkpointing import (
    ARCHITECTURES,
    apply_plan,
    assert_gradients_flow,
    checkpointed_forward,
    find_layer_stack,
    hf_checkpointing,
    hf_has_every_n_layers,
    measure_plan,
    measure_recompute,
    mlp_stack,
    named_plan,
    profile_stack,
    tiny_decoder,
)
from course_lib.errors import UserError

warnings.filterwarnings("ignore", message=".*use_reentrant.*")


def _loss_and_grads(model, loss_fn):
    model.zero_grad(set_to_none=True)
    loss = loss_fn()
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _assert_same(expected, got):
    torch.testing.assert_close(got[0], expected[0], rtol=1e-6, atol=1e-7)
    assert expected[1].keys() == got[1].keys()
    for name in expected[1]:
        torch.testing.assert_close(got[1][name], expected[1][name], rtol=1e-5, atol=1e-6, msg=name)


# ---------------------------------------------------------------------------------------------------
# Exact: every bundled architecture, multi-layer segments and gaps
# ---------------------------------------------------------------------------------------------------

PLANS = [[(0, 2), (2, 4)], [(0, 3)], [(1, 3)], [(0, 2), (3, 4)], [(0, 1), (2, 4)], "every-layer", "hf-every-2"]


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_plans_give_the_unchecked_loss_and_every_gradient(arch):
    model = tiny_decoder(arch, n_layers=4, hidden=32, heads=2, vocab=64, sliding_window=4)
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(0))
    loss_fn = lambda: model(input_ids=ids, labels=ids).loss  # noqa: E731
    expected = _loss_and_grads(model, loss_fn)
    for plan in PLANS:
        with apply_plan(model, plan):
            _assert_same(expected, _loss_and_grads(model, loss_fn))
    _assert_same(expected, _loss_and_grads(model, loss_fn))  # removed on exit
    with torch.no_grad(), apply_plan(model, [(0, 2)]):  # no grad: the layers simply run
        assert torch.isfinite(model(input_ids=ids).logits).all()


def test_gemma2_layers_get_their_own_masks_inside_a_segment():
    """The old apply_plan gave layer 1 layer 0's sliding mask: a different model, silently."""
    model = tiny_decoder("gemma2", n_layers=2, hidden=32, heads=2, vocab=64, sliding_window=4)
    assert model.config.layer_types[:2] == ["sliding_attention", "full_attention"]
    seen = []
    handle = model.model.layers[1].register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["attention_mask"]), with_kwargs=True
    )
    ids = torch.randint(0, 64, (1, 24), generator=torch.Generator().manual_seed(0))
    try:
        with apply_plan(model, [(0, 2)]):
            model(input_ids=ids, labels=ids).loss.backward()
    finally:
        handle.remove()
    full = seen[0]  # layer 1's own (global) mask, forward and replay alike
    assert all(mask is full for mask in seen) and len(seen) == 2


def test_dropout_draws_the_same_masks_in_the_recompute():
    torch.manual_seed(0)
    layers = torch.nn.Sequential(
        *[torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Dropout(0.5)) for _ in range(4)]
    )
    x = torch.randn(8, 16)

    def run(plan):
        torch.manual_seed(123)
        with apply_plan(layers, plan):
            return _loss_and_grads(layers, lambda: layers(x).pow(2).mean())

    expected = run([])
    for plan in ([(0, 4)], [(0, 2), (3, 4)], "every-layer"):
        _assert_same(expected, run(plan))


@pytest.mark.parametrize("policy", ["full", "korthikanti", "save-matmuls", "save-all"])
def test_policies_keep_the_gradients(policy):
    model = tiny_decoder("llama", n_layers=3, hidden=32, heads=2, vocab=64, attn_implementation="eager")
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    loss_fn = lambda: model(input_ids=ids, labels=ids).loss  # noqa: E731
    expected = _loss_and_grads(model, loss_fn)
    with apply_plan(model, [(0, 2)], policy=policy):
        _assert_same(expected, _loss_and_grads(model, loss_fn))


def test_the_replay_runs_under_the_recompute_context_and_only_the_replay():
    """`recompute_context` (what the planner's meta-device autocast needs): entered once per segment's replay
    in backward, never in the forward; the loss and every gradient are the unchecked ones."""
    model = tiny_decoder("llama", n_layers=3, hidden=32, heads=2, vocab=64)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    loss_fn = lambda: model(input_ids=ids, labels=ids).loss  # noqa: E731
    expected = _loss_and_grads(model, loss_fn)
    entered = []

    class Recompute:
        def __enter__(self):
            entered.append(torch.is_grad_enabled())

        def __exit__(self, *exc):
            return False

    with apply_plan(model, [(0, 2), (2, 3)], recompute_context=Recompute):
        got = _loss_and_grads(model, lambda: (entered.append("forward"), loss_fn())[1])
    _assert_same(expected, got)
    assert entered == ["forward", True, True]  # two segments replayed, with autograd on
    with pytest.raises(UserError, match="recompute_context applies to full checkpointing"):
        apply_plan(model, "every-layer", policy="save-matmuls", recompute_context=Recompute)


def test_checkpointed_forward_matches_the_plain_forward():
    torch.manual_seed(0)
    model, x = mlp_stack(6, 32, "gelu"), torch.randn(64, 32)
    expected = _loss_and_grads(model, lambda: model(x).pow(2).mean())
    got = _loss_and_grads(model, lambda: checkpointed_forward(model, x, [(0, 3), (4, 6)]).pow(2).mean())
    _assert_same(expected, got)


def test_a_plan_really_recomputes_and_gaps_do_not():
    torch.manual_seed(0)
    model, x = mlp_stack(4, 16, "gelu"), torch.randn(8, 16)
    runs = [0] * 4
    hooks = [
        layer[0].register_forward_hook(lambda *a, i=i: runs.__setitem__(i, runs[i] + 1))
        for i, layer in enumerate(model)
    ]
    try:
        with apply_plan(model, [(0, 2), (3, 4)]):
            model(x).pow(2).mean().backward()
    finally:
        for hook in hooks:
            hook.remove()
    assert runs == [2, 2, 1, 2]


# ---------------------------------------------------------------------------------------------------
# Refused: what cannot be applied exactly
# ---------------------------------------------------------------------------------------------------


class _Changing(torch.nn.Module):
    """Doubles the hidden state between two layers: a replay from layer 0's input cannot know it."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(3)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x) * 2
        return x


def test_a_hidden_state_changed_between_layers_is_refused():
    model = _Changing()
    with apply_plan(model, [(0, 2)]), pytest.raises(ValueError, match="changes it between layers"):
        model(torch.randn(2, 4, requires_grad=True))
    with apply_plan(model, "every-layer"):  # one layer per segment: nothing to replay across
        model(torch.randn(2, 4)).sum().backward()


class _Partial(torch.nn.Module):
    """Runs only its first layer, or its layers in reverse: neither can be replayed as a segment."""

    def __init__(self, reverse=False):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(3)])
        self.reverse = reverse

    def forward(self, x):
        for layer in reversed(self.layers) if self.reverse else self.layers[:1]:
            x = layer(x)
        return x


@pytest.mark.parametrize("reverse, words", [(False, "ended inside the segment 0..1"), (True, "called before layer 0")])
def test_a_segment_the_model_does_not_run_in_order_is_refused(reverse, words):
    model = _Partial(reverse)
    with apply_plan(model, [(0, 2)]), pytest.raises(ValueError, match=words):
        model(torch.randn(2, 4))
    model(torch.randn(2, 4)).sum().backward()  # the plan is gone and no frame was left open


def test_random_numbers_drawn_between_layers_are_refused():
    class Noisy(_Changing):
        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
                torch.rand(1)  # between layers: a replay could not draw it again
            return x

    model = Noisy()
    with apply_plan(model, [(0, 2)]), pytest.raises(ValueError, match="random numbers between layers 0 and 1"):
        model(torch.randn(2, 4))


def test_a_kv_cache_is_refused():
    model = tiny_decoder("llama", n_layers=2, hidden=32, heads=2, vocab=64)
    ids = torch.randint(0, 64, (1, 8))
    with apply_plan(model, [(0, 2)]), pytest.raises(ValueError, match="use_cache=False"):
        model(input_ids=ids, use_cache=True)


@pytest.mark.parametrize("plan, words", [([(0, 7)], "out of range"), ([(3, 4), (1, 2)], "sorted and disjoint")])
def test_apply_plan_refuses_bad_plans(plan, words):
    model = mlp_stack(6, 8)
    with pytest.raises(ValueError, match=words):
        apply_plan(model, plan)
    with apply_plan(model, "every-2"):
        pass


def test_apply_plan_twice_is_refused():
    model = mlp_stack(4, 8)
    with apply_plan(model, [(0, 2)]):
        with pytest.raises(ValueError, match="applied twice"):
            apply_plan(model, [(2, 4)])


def test_find_layer_stack():
    model = tiny_decoder("llama", n_layers=3, hidden=32, heads=2)
    assert find_layer_stack(model) is model.model.layers
    with pytest.raises(ValueError, match="no layer stack"):
        find_layer_stack(torch.nn.Linear(2, 2))


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
    with apply_plan(model, [(0, 2)]):
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
    model.add_module("unused", torch.nn.Linear(4, 4))
    model.forward = lambda x: model[1](model[0](x))
    with pytest.raises(AssertionError, match="unused.weight"):
        assert_gradients_flow(model, torch.randn(3, 4))


# ---------------------------------------------------------------------------------------------------
# Measured (CPU, course_lib.measure's live-storage tracker) against the cost model
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


@pytest.mark.parametrize("plan", ["sqrt", [(0, 3), (4, 8), (9, 12)], "hf-every-2"])
def test_plans_measured_within_5_percent_of_the_cost_model(gelu_mlp, plan):
    model, x, loss_fn, profile = gelu_mlp
    row = measure_plan(model, loss_fn, [x], plan, profile=profile, recompute=True)
    assert abs(row.error) <= 0.05, row  # refined with the measured transients and head
    assert abs(row.simple_error) <= 0.15, row  # saved and input sizes alone (what the planner uses)
    assert row.measured_recompute == pytest.approx(row.recompute_fraction, abs=0.01)  # FLOPs, measured


def test_every_layer_saves_nothing_when_a_layer_stores_only_its_input():
    torch.manual_seed(0)
    model, x = mlp_stack(16, 64, "relu"), torch.randn(1024, 64)
    loss_fn = lambda: model(x).pow(2).mean()  # noqa: E731
    profile = profile_stack(model, loss_fn, [x])
    assert profile.saved_bytes == profile.input_bytes and all(profile.output_saved)
    none, every, sqrt = (
        measure_plan(model, loss_fn, [x], plan, profile=profile) for plan in ("none", "every-layer", "sqrt")
    )
    # nothing saved but what apply_plan keeps to replay dropout exactly: one CPU RNG state per segment
    assert every.measured_peak - none.measured_peak == 16 * torch.get_rng_state().untyped_storage().nbytes()
    assert sqrt.measured_peak < 0.7 * none.measured_peak
    for row in (none, every, sqrt):
        assert abs(row.error) <= 0.05, row


def test_hugging_face_every_n_layers_is_the_hf_every_plan():
    torch.manual_seed(0)
    model = tiny_decoder("llama", n_layers=4, hidden=64, heads=2, vocab=128)
    if not hf_has_every_n_layers(model):  # the floors' run (make test-floors): transformers < 5.23
        with pytest.raises(ValueError, match="every_n_layers needs transformers >= 5.23"):
            hf_checkpointing(model, every_n_layers=2)
        return
    ids = torch.randint(0, 128, (2, 64))
    loss_fn = lambda: model(input_ids=ids, labels=ids).loss  # noqa: E731
    from course_lib.measure import measure_step

    hf_checkpointing(model, every_n_layers=2)
    hf = measure_step(model, None, loss_fn, [ids])
    hf_checkpointing(model, False)
    ours = measure_plan(model, loss_fn, [ids], "hf-every-2")
    assert hf.peak - hf.baseline == ours.measured_peak
    assert ours.segments == named_plan(4, "hf-every-2") == [(0, 1), (2, 3)]


def test_selective_policies_under_eager_attention():
    torch.manual_seed(0)
    model = tiny_decoder("llama", n_layers=3, hidden=64, heads=2, vocab=128, attn_implementation="eager")
    ids = torch.randint(0, 128, (2, 256))
    loss_fn = lambda: model(input_ids=ids, labels=ids).loss  # noqa: E731
    profile = profile_stack(model, loss_fn, [ids])
    rows = {
        policy: measure_plan(model, loss_fn, [ids], "every-layer", profile=profile, policy=policy, recompute=True)
        for policy in ("full", "korthikanti", "save-matmuls", "save-all")
    }
    none = measure_plan(model, loss_fn, [ids], "none", profile=profile)
    # Korthikanti drops the s x s scores; "save matmuls" keeps them (bmm) and saves little
    assert rows["full"].measured_peak < rows["korthikanti"].measured_peak < rows["save-matmuls"].measured_peak
    assert rows["save-matmuls"].measured_peak < none.measured_peak
    assert rows["save-all"].measured_peak >= none.measured_peak  # keeps every op's output
    # torch stops a recompute once every saved tensor is back: a segment's last matmul is not rerun
    assert 0.7 < rows["full"].measured_recompute < rows["full"].recompute_fraction == 1.0
    assert rows["save-all"].measured_recompute == pytest.approx(0.0, abs=1e-9)
    assert rows["save-matmuls"].measured_recompute == pytest.approx(0.0, abs=1e-9)
    assert 0 < rows["korthikanti"].measured_recompute < 0.5  # the attention core's FLOPs only
    assert rows["korthikanti"].recompute_fraction is None and rows["korthikanti"].predicted_peak is None


def test_measure_recompute_of_no_plan_is_zero():
    torch.manual_seed(0)
    model, x = mlp_stack(4, 16), torch.randn(8, 16)
    assert measure_recompute(model, lambda: model(x).pow(2).mean(), []) == 0


def test_tradeoff_table_times_plans_in_turns_and_leaves_selective_unpredicted():
    from course_lib.checkpointing import default_plans, format_tradeoff, measure_tradeoff

    torch.manual_seed(0)
    model, x = mlp_stack(4, 16, "gelu"), torch.randn(32, 16)
    loss_fn = lambda: model(x).pow(2).mean()  # noqa: E731
    profile = profile_stack(model, loss_fn, [x])
    assert {"every-layer", "sqrt", "optimal @ sqrt peak", "1 segments"} <= default_plans(profile).keys()
    rows = measure_tradeoff(
        model,
        loss_fn,
        [x],
        {"none": [], "sqrt": "sqrt"},
        repeats=1,
        policies=("full", "korthikanti"),
        profile=profile,
        recompute=True,
    )
    assert [(r.plan, r.policy) for r in rows] == [
        ("none", "full"),
        ("none", "korthikanti"),
        ("sqrt", "full"),
        ("sqrt", "korthikanti"),
    ]
    assert all(r.step_seconds > 0 for r in rows)
    assert rows[1].predicted_peak is None and rows[1].error is None and rows[0].error is not None
    table = format_tradeoff(rows, "title")
    assert table.splitlines()[0] == "title" and "n/a" in table and "1.00x" in table


def test_the_uneven_layers_add_their_branch_to_their_input():
    from course_lib.checkpointing import uneven_stack

    mlp, pw = uneven_stack("mlp2 pw", 8)
    x = torch.randn(3, 8)
    torch.testing.assert_close(mlp(x) - x, mlp.down(mlp.act(mlp.up(mlp.norm(x)))))
    h = torch.tanh(pw.mix(x))
    torch.testing.assert_close(pw(x) - x, torch.sin(h * torch.sigmoid(2 * h)) * torch.exp(-h * h))


def test_uneven_stack_specs():
    from course_lib.checkpointing import uneven_stack

    stack = uneven_stack("mlp2 pw mlp1", 8)
    assert len(stack) == 3 and stack[0].up.out_features == 16
    for spec in ("mlp0", "conv", ""):
        with pytest.raises(ValueError):
            uneven_stack(spec, 8)
