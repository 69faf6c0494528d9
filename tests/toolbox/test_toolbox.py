"""Tests of course_lib.toolbox (lesson 7): each trick against the plain version, and its measured peak."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from course_lib import planner
from course_lib.measure import LiveStorageTracker, optimizer_state_tensors, peak_bytes, storage_bytes
from course_lib.qlora import tiny_llama_config
from course_lib.toolbox import (
    LEAN_OPTIMIZERS,
    HostOffload,
    OptimizerInBackward,
    accumulation_breaks,
    bytes_per_parameter,
    chunked_causal_lm_loss,
    chunked_cross_entropy,
    clipping_breaks,
    state_tensors,
    stepped_optimizer,
    transfer_seconds,
)

CPU = torch.device("cpu")


def mlp(width: int = 128, depth: int = 6) -> torch.nn.Module:
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)])


def square_loss(model, x):
    return model(x).pow(2).mean()


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, foreach=False)


def tiny_llama(vocab: int = 4096, layers: int = 2):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(
        tiny_llama_config(hidden=64, layers=layers, heads=4, kv_heads=2, intermediate=128, vocab=vocab)
    )


def _grads(model):
    return {name: p.grad.clone() for name, p in model.named_parameters()}


# ---------------------------------------------------------------------------------------------------
# Optimizer step in backward
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("make_optimizer", [adamw, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)])
def test_optimizer_in_backward_gives_the_same_weights(make_optimizer):
    torch.manual_seed(0)
    plain, fused = mlp(), mlp()
    fused.load_state_dict(plain.state_dict())
    optimizer = make_optimizer(list(plain.parameters()))
    in_backward = OptimizerInBackward(fused.parameters(), make_optimizer)
    for _ in range(4):
        x = torch.randn(8, 128)
        optimizer.zero_grad(set_to_none=True)
        square_loss(plain, x).backward()
        optimizer.step()
        square_loss(fused, x).backward()
        assert all(p.grad is None for p in fused.parameters())
    for p, q in zip(plain.parameters(), fused.parameters()):
        assert torch.equal(p, q)
    assert set(in_backward.steps.values()) == {4}
    in_backward.step()  # nothing to do: loops that call it keep working
    assert set(in_backward.state) == set(fused.parameters()) and all(
        torch.equal(p, q) for p, q in zip(plain.parameters(), fused.parameters())
    )
    in_backward.remove()
    square_loss(fused, x).backward()  # hooks removed: gradients stay
    assert all(p.grad is not None for p in fused.parameters())


def test_optimizer_in_backward_lowers_the_measured_peak():
    torch.manual_seed(0)
    plain, fused = mlp(512, 8), mlp(512, 8)
    x = torch.randn(4, 512)
    optimizer = adamw(list(plain.parameters()))
    in_backward = OptimizerInBackward(fused.parameters(), adamw)
    square_loss(plain, x).backward(), optimizer.step(), optimizer.zero_grad(set_to_none=True)
    square_loss(fused, x).backward()  # both optimizers have their state now
    state = [v for s in optimizer.state.values() for v in s.values()]
    normal = peak_bytes(
        lambda: (square_loss(plain, x).backward(), optimizer.step()), [*plain.parameters(), *state, x], CPU
    )
    optimizer.zero_grad(set_to_none=True)
    fused_peak = peak_bytes(
        lambda: square_loss(fused, x).backward(), [*fused.parameters(), *optimizer_state_tensors(in_backward), x], CPU
    )
    gradients = storage_bytes(plain.parameters())  # all gradients, fp32 like the weights
    largest = max(p.numel() * 4 for p in plain.parameters())
    assert normal - fused_peak >= gradients - 2 * largest


def test_accumulation_and_clipping_break_with_the_step_in_backward():
    batches = [torch.randn(4, 128) for _ in range(4)]
    accum = accumulation_breaks(mlp, batches, adamw, square_loss)
    assert accum["steps_normal"] == 1 and accum["steps_in_backward"] == 4
    assert accum["largest_weight_difference"] > 1e-4
    torch.manual_seed(1)
    x = torch.randn(8, 128)
    clip = clipping_breaks(mlp, x, lambda ps: torch.optim.SGD(ps, lr=1.0), square_loss, max_norm=1e-4)
    assert clip["global_norm"] > clip["max_norm"]
    assert clip["gradients_left_after_backward"] == 0
    assert clip["largest_weight_difference"] > 1e-4


def test_optimizer_in_backward_needs_trainable_parameters():
    model = mlp()
    model.requires_grad_(False)
    with pytest.raises(ValueError, match="no parameters"):
        OptimizerInBackward(model.parameters(), adamw)


# ---------------------------------------------------------------------------------------------------
# Chunked cross-entropy
# ---------------------------------------------------------------------------------------------------


def hf_loss(logits, labels, ignore_index=-100, num_items_in_batch=None):
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss(
        logits, labels, logits.shape[-1], num_items_in_batch=num_items_in_batch, ignore_index=ignore_index
    )


@settings(max_examples=20, deadline=None)
@given(
    batch=st.integers(1, 3),
    seq=st.integers(1, 24),
    hidden=st.integers(1, 12),
    vocab=st.integers(2, 40),
    chunk=st.integers(1, 30),
    ignore_index=st.sampled_from([-100, 0, -1]),
    padded=st.integers(0, 24),
    bias=st.booleans(),
    items=st.booleans(),
    recompute=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_chunked_loss_equals_the_plain_loss_and_every_gradient(
    batch, seq, hidden, vocab, chunk, ignore_index, padded, bias, items, recompute, seed
):
    generator = torch.Generator().manual_seed(seed)
    h = torch.randn(batch, seq, hidden, generator=generator, dtype=torch.float64, requires_grad=True)
    w = torch.randn(vocab, hidden, generator=generator, dtype=torch.float64, requires_grad=True)
    b = torch.randn(vocab, generator=generator, dtype=torch.float64, requires_grad=True) if bias else None
    labels = torch.randint(1, vocab, (batch, seq), generator=generator)
    labels[:, seq - min(padded, seq) :] = ignore_index  # right padding
    count = int((F.pad(labels, (0, 1), value=ignore_index)[..., 1:] != ignore_index).sum())
    num_items = count + 3 if items else None
    plain = hf_loss(F.linear(h, w, b), labels, ignore_index, num_items)
    plain_grads = torch.autograd.grad(plain, [h, w] + ([b] if bias else []), allow_unused=True)
    chunked = chunked_cross_entropy(
        h, w, labels, chunk, bias=b, ignore_index=ignore_index, num_items_in_batch=num_items, recompute=recompute
    )
    if count == 0 and not items:  # nothing to score: HF's mean is 0/0; ours is 0, never a silent NaN
        assert torch.isnan(plain) and chunked.item() == 0
        return
    chunked_grads = torch.autograd.grad(chunked, [h, w] + ([b] if bias else []), allow_unused=True)
    torch.testing.assert_close(chunked, plain)
    for got, expected in zip(chunked_grads, plain_grads):
        torch.testing.assert_close(got, expected)


def test_chunked_loss_of_a_hugging_face_model_and_its_peak():
    model = tiny_llama(vocab=4096)
    ids = torch.randint(0, 4096, (2, 128))
    labels = ids.clone()
    labels[1, 100:] = -100
    plain = model(input_ids=ids, labels=labels).loss
    plain.backward()
    plain_grads = _grads(model)
    model.zero_grad(set_to_none=True)
    chunked = chunked_causal_lm_loss(model, ids, labels, 32)
    chunked.backward()
    torch.testing.assert_close(chunked, plain)
    for name, grad in _grads(model).items():
        torch.testing.assert_close(grad, plain_grads[name], rtol=1e-4, atol=1e-6)
    model.zero_grad(set_to_none=True)
    live = [*model.parameters(), ids, labels]
    plain_peak = peak_bytes(lambda: model(input_ids=ids, labels=labels).loss.backward(), live, CPU)
    model.zero_grad(set_to_none=True)
    chunked_peak = peak_bytes(lambda: chunked_causal_lm_loss(model, ids, labels, 32).backward(), live, CPU)
    logits = 2 * 128 * 4096 * 4
    assert plain_peak - chunked_peak > 2 * logits  # at least the logits and their gradient


def test_chunks_without_recompute_keep_every_chunks_log_softmax_and_recomputed_ones_none():
    torch.manual_seed(0)
    h = torch.randn(2, 256, 32, requires_grad=True)
    w = torch.randn(4096, 32, requires_grad=True)
    labels = torch.randint(0, 4096, (2, 256))
    kept = {}
    for recompute in (False, True):
        tracker = LiveStorageTracker()  # h and w are not watched: what forward adds and keeps
        with tracker:
            loss = chunked_cross_entropy(h, w, labels, 64, recompute=recompute)
            kept[recompute] = tracker.current
        loss.backward()
    assert kept[False] >= 2 * 256 * 4096 * 4  # the fp32 log-softmax of every token, saved for backward
    assert kept[True] < 64 * 4096 * 4  # less than one chunk's


@pytest.mark.parametrize("chunk", [0, -1, 2.5, True])
def test_chunked_loss_refuses_a_bad_chunk_size(chunk):
    with pytest.raises(ValueError, match="chunk_size must be a whole number >= 1"):
        chunked_cross_entropy(torch.zeros(1, 2, 3), torch.zeros(4, 3), torch.zeros(1, 2, dtype=torch.long), chunk)


def test_chunked_loss_refuses_labels_of_another_shape():
    with pytest.raises(ValueError, match="labels"):
        chunked_cross_entropy(torch.zeros(1, 2, 3), torch.zeros(4, 3), torch.zeros(1, 3, dtype=torch.long), 2)


# ---------------------------------------------------------------------------------------------------
# Activation offloading
# ---------------------------------------------------------------------------------------------------


def _offload_step(model, ids, context):
    model.zero_grad(set_to_none=True)

    def step():
        with context:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()

    return peak_bytes(step, [*model.parameters(), ids], CPU)


def test_host_offload_keeps_the_gradients_and_lowers_the_device_peak():
    model = tiny_llama(vocab=256, layers=3)
    ids = torch.randint(0, 256, (2, 128))
    plain_peak = _offload_step(model, ids, contextlib.nullcontext())
    plain_grads = _grads(model)
    offload = HostOffload(model.parameters())
    offload_peak = _offload_step(model, ids, offload)
    for name, grad in _grads(model).items():
        assert torch.equal(grad, plain_grads[name])
    assert offload.to_host == offload.to_device > 0
    assert 0 < offload.weights_to_host < offload.to_host  # save_on_cpu copies the saved weights too
    assert offload_peak < plain_peak


def test_transfer_seconds_at_the_t4_link():
    assert transfer_seconds(15_750_000_000, 0) == pytest.approx(1.0)
    assert transfer_seconds(10, 10, bandwidth=10) == 2
    with pytest.raises(ValueError, match="to_host"):
        transfer_seconds(-1, 0)


# ---------------------------------------------------------------------------------------------------
# Lean optimizers: measured state against the planner's
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(LEAN_OPTIMIZERS))
def test_measured_state_equals_the_planners(name):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(300, 200), torch.nn.Linear(200, 7), torch.nn.LayerNorm(7))
    measured, per_param = bytes_per_parameter(model, name)
    shapes = [tuple(p.shape) for p in model.parameters()]
    predicted = planner.optimizer_state_bytes(name, [p.numel() for p in model.parameters()], 4, shapes)
    assert measured == predicted
    rows = state_tensors(stepped_optimizer(model, name), {p: n for n, p in model.named_parameters()})
    assert sum(row.bytes for row in rows) == measured


def test_lean_optimizers_keep_less_than_adamw():
    model = torch.nn.Linear(1024, 1024)
    per_param = {name: bytes_per_parameter(model, name)[1] for name in LEAN_OPTIMIZERS}
    assert per_param["sgd"] == 0
    assert per_param["adafactor"] < 0.02 < per_param["adamw8bit"] < per_param["momentum"] < per_param["adamw"]


# The exercise checks of lesson 7 reject wrong answers, each at the property it breaks.


def _hooks(free: bool, free_first: bool = False, steps: int = 1, shared: bool = False):
    def attach(model, make_optimizer):
        one = make_optimizer(list(model.parameters())) if shared else None  # wrong: one optimizer for all
        optimizers = {p: one or make_optimizer([p]) for p in model.parameters()}

        def hook(param):
            if free_first:  # wrong: the gradient is gone before the step sees it
                optimizers[param].zero_grad(set_to_none=True)
            for _ in range(steps):  # wrong when 2: the parameter moves twice a backward
                optimizers[param].step()
            if free:
                optimizers[param].zero_grad(set_to_none=True)

        for p in optimizers:
            p.register_post_accumulate_grad_hook(hook)
        return optimizers

    return attach


def _chunked(
    shift: bool = True, by_chunks: bool = False, recompute: bool = True, upcast: bool = True, whole: bool = False
):
    def loss(hidden, weight, labels, chunk_size):
        targets = (F.pad(labels, (0, 1), value=-100)[..., 1:] if shift else labels).reshape(-1)
        flat = hidden.reshape(-1, hidden.shape[-1])
        size = len(targets) if whole else chunk_size  # wrong when whole: chunk_size ignored

        def part(h, y):
            logits = F.linear(h, weight)
            return F.cross_entropy(logits.float() if upcast else logits, y, ignore_index=-100, reduction="sum")

        parts = [
            torch.utils.checkpoint.checkpoint(part, h, y, use_reentrant=False) if recompute else part(h, y)
            for h, y in zip(flat.split(size), targets.split(size))
        ]
        return sum(parts) / (len(parts) if by_chunks else (targets != -100).sum())

    return loss


def test_exercise_checks_accept_a_right_answer_and_reject_wrong_ones(capsys):
    from course_lib import checks

    checks.check_optimizer_in_backward(_hooks(free=True))
    checks.check_chunked_loss(_chunked())
    assert capsys.readouterr().out.count("Correct") == 2
    for wrong, message in (
        (_hooks(free=False), "still has a gradient"),
        (_hooks(free=True, free_first=True), "never updated"),
        (_hooks(free=True, steps=2), "once per backward"),
        (_hooks(free=True, shared=True), "distinct optimizer objects"),
    ):
        with pytest.raises(AssertionError, match=message):
            checks.check_optimizer_in_backward(wrong)
    for wrong, message in (
        (_chunked(shift=False), "shift the labels"),
        (_chunked(by_chunks=True), "number of scored tokens"),
        (_chunked(recompute=False), "not below one set"),
        (_chunked(upcast=False), "upcast each chunk's logits"),
        (_chunked(whole=True), "at most chunk_size"),
    ):
        with pytest.raises(AssertionError, match=message):
            checks.check_chunked_loss(wrong)
