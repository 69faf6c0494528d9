"""course_lib.measure: exact categories, a true peak, and agreement with the profiler (lesson 0)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from course_lib.measure import (
    AGREE_BYTES,
    LiveStorageTracker,
    MiB,
    StepMemory,
    format_bytes,
    measure_step,
    peak_bytes,
    profiler_peak,
    storage_bytes,
)


def mlp(d_in, hidden, d_out=3):
    return torch.nn.Sequential(torch.nn.Linear(d_in, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, d_out))


@settings(max_examples=15, deadline=None)
@given(batch=st.integers(1, 16), d_in=st.integers(1, 40), hidden=st.integers(1, 40), d_out=st.integers(1, 5))
def test_hand_countable_mlp_matches_to_the_byte(batch, d_in, hidden, d_out):
    model = mlp(d_in, hidden, d_out)
    x = torch.randn(batch, d_in)
    report = measure_step(model, torch.optim.AdamW(model.parameters()), lambda: model(x).sum(), inputs=[x])
    n_params = d_in * hidden + hidden + hidden * d_out + d_out
    assert report.parameters == 4 * n_params
    assert report.gradients == 4 * n_params
    assert report.optimizer_state == 8 * n_params + 4 * 4  # exp_avg, exp_avg_sq, one float32 step per tensor
    assert report.saved_for_backward == 4 * batch * (d_in + hidden)  # x, and ReLU's output shared with Linear 2


def mlp_at_step(step):
    """A seeded MLP, its AdamW and a batch, after `step - 1` training steps, gradients set to None."""
    torch.manual_seed(0)
    model = mlp(256, 512, 10)
    optimizer = torch.optim.AdamW(model.parameters())
    x = torch.randn(128, 256)
    for _ in range(step - 1):
        model(x).sum().backward()
        optimizer.step()
    model.zero_grad(set_to_none=True)
    return model, optimizer, x


@pytest.mark.parametrize("step", [1, 2])
def test_cpu_peak_agrees_with_the_profiler(step):
    model, optimizer, x = mlp_at_step(step)
    report = measure_step(model, optimizer, lambda: model(x).sum(), inputs=[x])

    model, optimizer, x = mlp_at_step(step)

    def one_step():
        model(x).sum().backward()
        optimizer.step()

    assert report.peak - report.baseline == pytest.approx(profiler_peak(one_step), rel=0.05)


def test_lazy_optimizer_state_appears_at_step_one():
    model = mlp(32, 64)
    optimizer = torch.optim.AdamW(model.parameters())
    x = torch.randn(8, 32)
    first = measure_step(model, optimizer, lambda: model(x).sum(), inputs=[x])
    second = measure_step(model, optimizer, lambda: model(x).sum(), inputs=[x])
    assert first.optimizer_state > 0
    assert second.baseline - first.baseline == first.optimizer_state
    assert first.phase_peaks["optimizer"] >= first.baseline + first.optimizer_state


def test_tracker_returns_to_what_stays_alive():
    """After the step only the gradients and the new optimizer state remain: every free was seen."""
    model = mlp(64, 128)
    x = torch.randn(16, 64)
    report = measure_step(model, torch.optim.AdamW(model.parameters()), lambda: model(x).sum(), inputs=[x])
    assert report.timeline[-1][1] == report.baseline + report.gradients + report.optimizer_state
    assert report.tracked_peak == max(live for _, live in report.timeline)
    assert abs(report.peak - report.tracked_peak) <= AGREE_BYTES and report.inside_operators == 0


def test_storages_are_counted_once():
    embed = torch.nn.Embedding(100, 8)
    head = torch.nn.Linear(8, 100, bias=False)
    head.weight = embed.weight
    assert storage_bytes([embed.weight, head.weight]) == 100 * 8 * 4
    big = torch.zeros(10, 10)
    assert storage_bytes([big[0], big[1:3]]) == 400  # views keep the whole storage
    assert storage_bytes([big[0].clone()]) == 40


def test_saved_excludes_parameters_and_sees_what_backward_needs():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.Tanh())
    x = torch.randn(4, 10)
    report = measure_step(model, None, lambda: model(x).sum(), inputs=[x])
    assert report.saved_for_backward == 4 * 4 * (10 + 20)  # Linear's input, tanh's output
    assert "optimizer" not in report.phase_peaks
    assert report.optimizer_state == 0


def test_bitsandbytes_8bit_adam_state_layout():
    """2 bytes of uint8 state + 8 bytes of float32 absmax per 256 values, plus two 256-entry qmaps."""
    bnb = pytest.importorskip("bitsandbytes")
    layer = torch.nn.Linear(1024, 1024, bias=False)
    x = torch.randn(4, 1024)
    report = measure_step(layer, bnb.optim.AdamW8bit(layer.parameters()), lambda: layer(x).sum(), inputs=[x])
    n = 1024 * 1024
    assert report.optimizer_state == 2 * n + 2 * 4 * (n // 256) + 2 * 256 * 4


def test_loss_must_be_a_scalar_that_requires_grad():
    model = mlp(4, 4)
    x = torch.randn(2, 4)
    with pytest.raises(ValueError, match="scalar tensor that requires grad"):
        measure_step(model, None, lambda: model(x), inputs=[x])


def test_report_forms():
    model = mlp(8, 8)
    x = torch.randn(2, 8)
    report = measure_step(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda: model(x).sum(), inputs=[x])
    assert isinstance(report, StepMemory)
    data = report.to_dict()
    assert {"parameters", "gradients", "optimizer_state", "saved_for_backward", "peak"} <= data.keys()
    assert "timeline" not in data
    html = report._repr_html_()
    assert html.count("<tr>") == len(report.rows()) + 1 and "optimizer state" in html
    assert "peak of the step" in str(report)


def test_format_bytes_units():
    assert format_bytes(512) == "512 B"
    assert format_bytes(3 * 2**20) == "3.00 MiB"
    assert format_bytes(1.5 * 2**30) == "1.50 GiB"
    assert format_bytes(None) == "n/a"


def test_an_allocation_inside_an_operator_is_in_the_peak_and_said_to_be_unseen_by_the_tracker():
    """bitsandbytes' CPU 8-bit AdamW step is one custom operator: both moments dequantized to fp32, the
    scaled gradient, sqrt(v) and its division (five fp32 temporaries) live inside it, never returned."""
    bnb = pytest.importorskip("bitsandbytes")
    layer = torch.nn.Linear(2048, 2048, bias=False)
    optimizer = bnb.optim.AdamW8bit(layer.parameters())
    x = torch.randn(4, 2048)
    measure_step(layer, optimizer, lambda: layer(x).sum(), inputs=[x])  # the state appears
    report = measure_step(layer, optimizer, lambda: layer(x).sum(), inputs=[x])
    n = 2048 * 2048
    assert report.phase_peaks["optimizer"] - report.tracked_phase_peaks["optimizer"] == pytest.approx(
        5 * 4 * n, rel=0.01
    )
    assert report.inside_operators == report.peak - report.tracked_peak > 79 * MiB
    assert "inside operators" in str(report)


def test_a_view_of_a_storage_alive_before_is_not_counted_as_new():
    held = torch.zeros(16 * MiB)  # 64 MiB, neither watched nor a parameter: an attribute of some object
    with LiveStorageTracker() as tracker:
        tracker.set_phase("work")
        head = held[:5000]
        doubled = head * 2
    assert tracker.peak == doubled.untyped_storage().nbytes() == 20000


def test_sort_s_scratch_copy_is_seen_by_the_allocator_not_by_the_tracker():
    x = torch.randn(8 * MiB)  # 32 MiB
    model = torch.nn.Linear(1, 1)

    def loss():
        values, indices = torch.sort(x)  # 32 MiB of values, 64 MiB of int64 indices, and scratch inside
        return model(values[:1, None]).sum()

    report = measure_step(model, None, loss, inputs=[x])
    assert report.tracked_phase_peaks["forward"] - report.baseline == pytest.approx(96 * MiB, abs=AGREE_BYTES)
    assert report.phase_peaks["forward"] - report.tracked_phase_peaks["forward"] >= 32 * MiB  # at least one copy
    assert report.inside_operators >= 32 * MiB


def test_resize_keeps_one_storage_and_counts_its_new_size():
    with LiveStorageTracker() as tracker:
        tracker.set_phase("work")
        grown = torch.empty(0)
        grown.resize_(1000)
        grown.resize_(4000)
        assert len(tracker.live) == 1 and tracker.current == 16000
        grown.resize_(10)
        assert tracker.current == 16000  # shrinking keeps the allocation (resize_ never gives memory back)
        del grown
        assert tracker.current == 0 and not tracker.live
    assert tracker.peak == 16000


def test_tracker_sees_allocations_and_frees():
    with LiveStorageTracker() as tracker:
        tracker.set_phase("work")
        a = torch.ones(1000)
        b = a * 2
        del a
        assert tracker.current == 4000
        del b
        assert tracker.current == 0
    assert tracker.phase_peaks["work"] == 8000


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the allocator statistics path")
def test_cuda_categories_equal_cpu_and_peak_bounds_them():
    torch.manual_seed(0)
    cpu_model = mlp(256, 512)
    x = torch.randn(64, 256)
    cpu = measure_step(cpu_model, torch.optim.AdamW(cpu_model.parameters()), lambda: cpu_model(x).sum(), inputs=[x])
    gpu_model, gx = cpu_model.cuda(), x.cuda()
    gpu = measure_step(gpu_model, torch.optim.AdamW(gpu_model.parameters()), lambda: gpu_model(gx).sum(), inputs=[gx])
    for name in ("parameters", "gradients", "optimizer_state", "saved_for_backward"):
        assert getattr(gpu, name) == getattr(cpu, name)
    assert gpu.peak >= gpu.parameters + gpu.gradients + gpu.optimizer_state
    assert gpu.reserved >= gpu.peak and gpu.outside_pytorch > 0


def test_peak_bytes_counts_the_live_tensors_and_what_the_step_creates():
    kept = torch.ones(100)

    def step():
        temporary = torch.ones(1000)
        del temporary
        torch.ones(10)

    assert peak_bytes(step, [kept], torch.device("cpu")) == 100 * 4 + 1000 * 4


def test_the_method_names_the_instrument_that_gave_the_peak():
    model = mlp(4, 8)
    x = torch.randn(2, 4)
    report = measure_step(model, None, lambda: model(x).sum(), inputs=[x])
    assert report.method == "allocator events, the live-storage tracker beside"
    assert report.peak == max(report.phase_peaks.values())
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):  # the allocator events are off
        report = measure_step(model, None, lambda: model(x).sum(), inputs=[x])
    assert report.method == "live-storage tracker (another profiler was running)"
    assert report.phase_peaks == report.tracked_phase_peaks


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the allocator statistics path")
def test_a_cuda_peak_is_the_allocators_plus_the_paged_tensors():
    device = torch.device("cuda")
    paged = torch.ones(1000)  # unified memory outside PyTorch's allocator, as a paged optimizer's state
    paged.is_paged = True
    kept = torch.ones(100, device=device)

    def step():
        temporary = torch.ones(2**20, device=device)
        del temporary

    peak = peak_bytes(step, [kept, paged], device)
    assert peak == torch.cuda.max_memory_allocated(device) + 1000 * 4
    assert peak >= 100 * 4 + 2**20 * 4 + 1000 * 4
