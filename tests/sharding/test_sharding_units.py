"""Lesson 6's bookkeeping pinned term by term, without spawning ranks: a rank's model states, the ring's
(N-1)/N of bytes sent, and the units torchtitan's wrapping hands to `fully_shard`."""

import pytest
import torch
import torch.distributed as dist

from course_lib.checkpointing.demo_models import tiny_decoder
from course_lib.sharding.engines import fsdp_units
from course_lib.sharding.measuring import RankStep
from course_lib.sharding.tracking import CommCounter


def test_a_ranks_model_states_are_its_parameters_gradients_and_optimizer_state():
    # powers of ten, so a missing term shows in its own digit
    step = RankStep(
        stage="zero1",
        engine="ddp",
        world_size=2,
        rank=0,
        micro_batches=1,
        skip_sync=False,
        parameters=1,
        gradients=10,
        optimizer_state=100,
        peak=1000,
        phase_peaks={},
        repeat_peaks=[1000],
        bytes_sent=0,
        sent_by_collective={},
        calls={},
    )
    assert step.model_states == 111


def _fake_all_reduce(tensor, op=None, group=None, async_op=False):
    return None


def _fake_all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
    return None


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_ring_sends_n_minus_1_over_n_of_the_full_tensor(monkeypatch, world_size):
    # the ZeRO paper's section 7: an all-reduce of B bytes sends 2 (N-1)/N B per rank, an all-gather (N-1)/N B
    monkeypatch.setattr(dist, "all_reduce", _fake_all_reduce)
    monkeypatch.setattr(dist, "all_gather_into_tensor", _fake_all_gather_into_tensor)
    counter = CommCounter(world_size=world_size)
    full = torch.zeros(1000, dtype=torch.float32)  # 4000 bytes
    with counter.counting():
        dist.all_reduce(full)
        dist.all_gather_into_tensor(full, full[: 1000 // world_size])
    assert counter.sent["all_reduce"] == 2 * 4000 * (world_size - 1) // world_size
    assert counter.sent["all_gather_into_tensor"] == 4000 * (world_size - 1) // world_size
    assert counter.calls == {"all_reduce": 1, "all_gather_into_tensor": 1}


def test_torchtitans_units_are_the_embeddings_then_each_layer_then_the_rest():
    model = tiny_decoder("llama", n_layers=2, hidden=32, heads=2, vocab=64)  # untied output layer
    units = fsdp_units(model, "torchtitan")
    layers = list(model.model.layers)
    assert units[0] == [model.get_input_embeddings()]
    assert units[1:3] == [[layer] for layer in layers]
    assert units[3] == [model.model.norm, model.lm_head]  # the final norm and the output layer
    assert len(units) == 4
    assert fsdp_units(model, "blocks") == [[layer] for layer in layers]


def test_tied_embeddings_stay_with_the_root():
    model = tiny_decoder("gpt2", n_layers=2, hidden=32, heads=2, vocab=64)  # GPT-2 ties its output layer
    units = fsdp_units(model, "torchtitan")
    layers = list(model.transformer.h)
    assert units[:2] == [[layer] for layer in layers]
    assert units[2] == [model.transformer.wpe, model.transformer.ln_f]  # position embeddings, final norm
    assert len(units) == 3
