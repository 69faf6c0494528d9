"""What accumulation costs: time, peak memory and counted FLOPs vs micro-batch size (lesson 2, section 6)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from course_lib import validate
from course_lib.errors import UserError
from course_lib.measure import SavedTensorRecorder, format_bytes, optimizer_state_tensors, peak_bytes, storage_bytes
from course_lib.validate import Count, Device, checked


@checked
@dataclass
class CostRow:
    """One micro-batch size at a fixed effective batch (lesson 2, "what accumulation costs")."""

    micro_batch: int
    k: int
    flops: int  # forward + backward FLOPs of one optimizer step (all K micro-batches)
    ms_per_step: float  # best time of one optimizer step (K forward/backward + step) over the repeats
    peak_bytes: int  # peak live bytes during one optimizer step (absolute)
    parameters: int
    gradients: int
    optimizer_state: int
    saved_per_micro_batch: int  # bytes autograd saves for backward in one micro-batch's forward
    inputs: int = 0  # bytes of the window's data (all K micro-batches, inputs and targets)

    @property
    def fixed_bytes(self) -> int:
        """Parameters, gradients and optimizer state: the part accumulation cannot shrink."""
        return self.parameters + self.gradients + self.optimizer_state

    @property
    def grad_add_bytes(self) -> int:
        """Memory traffic of the work accumulation adds: after the first micro-batch, each backward adds
        its gradient into `.grad` (read both, write one), K-1 times per window. The FLOP counter does not
        see these elementwise additions: they are memory-bound, not arithmetic."""
        return 3 * (self.k - 1) * self.gradients


@checked
def cost_model(width: Count = 512, depth: Count = 4, seed: int = 0) -> nn.Sequential:
    """The MLP the cost measurement trains: `depth` Linear(width, width) + LayerNorm + GELU blocks."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.LayerNorm(width), nn.GELU()]
    layers.append(nn.Linear(width, width))
    return nn.Sequential(*layers)


@checked
def measure_accumulation_cost(
    effective_batch: Count = 64,
    micro_batches: Sequence[int] = (64, 16, 4, 1),
    width: Count = 256,
    depth: Count = 4,
    seq_len: Count = 32,
    repeats: Count = 3,
    device: Device | None = None,
    seed: int = 0,
) -> list[CostRow]:
    """Time, peak memory and FLOPs of one optimizer step vs micro-batch size (lesson 2).

    The effective batch is fixed; each micro-batch size b runs K = effective_batch / b forward and
    backward passes and one AdamW step on `cost_model(width, depth)`, each sample a sequence of
    `seq_len` positions (so that activations weigh as they do in a language model). FLOPs are counted
    by `torch.utils.flop_counter` (equal for every b). Time: after one warm-up step each, the sizes
    are timed in turn, `repeats` rounds, and each keeps its best step (a burst of load from other
    processes then hits every size alike, and the minimum is the least disturbed). The peak is
    measured in a separate step, by `course_lib.measure.LiveStorageTracker` on CPU and by the CUDA
    allocator's peak statistics on a GPU.
    """

    device = torch.device(device) if device is not None else torch.device("cpu")
    for b in micro_batches:
        if b < 1 or effective_batch % b:
            raise UserError(f"micro-batch {b} does not divide the effective batch {effective_batch}")
    gen = torch.Generator().manual_seed(seed)
    x_all = torch.randn(effective_batch, seq_len, width, generator=gen).to(device)
    y_all = torch.randn(effective_batch, seq_len, width, generator=gen).to(device)
    denominator = effective_batch * seq_len * width

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    setups = []
    for b in micro_batches:
        model = cost_model(width, depth, seed).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        micro = [(x_all[i : i + b].clone(), y_all[i : i + b].clone()) for i in range(0, effective_batch, b)]

        def forward_backward(model=model, micro=micro) -> None:
            for x, y in micro:
                (F.mse_loss(model(x), y, reduction="sum") / denominator).backward()

        def step(forward_backward=forward_backward, opt=opt) -> None:
            forward_backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        step()  # warm-up; allocates the optimizer state
        setups.append((b, model, opt, micro, forward_backward, step))
    times: dict[int, list[float]] = {b: [] for b in micro_batches}
    for _ in range(repeats):
        for b, *_, step in setups:
            sync()
            start = time.perf_counter()
            step()
            sync()
            times[b].append((time.perf_counter() - start) * 1e3)
    rows = []
    for b, model, opt, micro, forward_backward, step in setups:
        with FlopCounterMode(display=False) as counter:
            forward_backward()
        opt.zero_grad(set_to_none=True)
        params = list(model.parameters())
        data = [t for pair in micro for t in pair]
        peak = peak_bytes(step, params + optimizer_state_tensors(opt) + data, device)
        with SavedTensorRecorder(params) as saved_by_one_micro_batch:
            F.mse_loss(model(micro[0][0]), micro[0][1])
        rows.append(
            CostRow(
                micro_batch=b,
                k=len(micro),
                flops=int(counter.get_total_flops()),
                ms_per_step=min(times[b]),
                peak_bytes=int(peak),
                parameters=storage_bytes(params),
                gradients=storage_bytes(params),  # one gradient per parameter, same shape and dtype
                optimizer_state=storage_bytes(optimizer_state_tensors(opt)),
                saved_per_micro_batch=saved_by_one_micro_batch.bytes,
                inputs=storage_bytes(data),
            )
        )
    return rows


@checked
def format_cost_table(rows: Sequence[CostRow]) -> str:
    """The cost rows as a text table, with time and peak memory relative to the largest micro-batch.

    "GFLOP/step" is what `torch.utils.flop_counter` counts (matrix products only); ".grad adds" is the
    memory traffic of the K-1 gradient additions it does not count (`CostRow.grad_add_bytes`)."""

    rows = validate.non_empty("rows", rows, "rows of measure_accumulation_cost")
    base = max(rows, key=lambda r: r.micro_batch)
    lines = [
        f"{'micro':>5} {'K':>4} {'GFLOP/step':>10} {'.grad adds':>11} {'ms/step':>9} {'x time':>7} {'peak':>11} "
        f"{'x peak':>7} {'saved/micro':>11} {'params+grads+Adam':>18}"
    ]
    for r in rows:
        lines.append(
            f"{r.micro_batch:>5} {r.k:>4} {r.flops / 1e9:>10.3f} {format_bytes(r.grad_add_bytes):>11} "
            f"{r.ms_per_step:>9.1f} {r.ms_per_step / base.ms_per_step:>7.2f} "
            f"{format_bytes(r.peak_bytes):>11} {r.peak_bytes / base.peak_bytes:>7.2f} "
            f"{format_bytes(r.saved_per_micro_batch):>11} {format_bytes(r.fixed_bytes):>18}"
        )
    return "\n".join(lines)
