"""Whole-tensor CPU offload of AdamW (lesson 4, "manual offload"), in the manner of torchao's
`CPUOffloadOptimizer` (torchao prototype/low_bit_optim/cpu_offload.py). Runs on CPU too: there it is
plain AdamW on fp32 copies, which is how it is tested.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from course_lib.errors import UserError
from course_lib.measure import optimizer_state_tensors, storage_bytes
from course_lib.paging.policies import PagingError
from course_lib.validate import checked


@checked(error=PagingError)
class CPUOffloadAdamW:
    """AdamW whose state (and an fp32 master copy of each parameter) lives in host memory
    (lesson 4, "manual offload").

    Each parameter's gradient is copied to a pinned host buffer as soon as backward has
    accumulated it (a post-accumulate-grad hook, on a side stream, overlapping the rest of
    backward); with `offload_gradients=True` the device gradient is freed at once. `step()` waits
    for each copy, runs a fused AdamW step on the host, and copies the parameter back
    asynchronously. GPU memory: weights (and activations) only; cost: the copies and the host step,
    paid every step. Gradient accumulation works (later backward passes add on the host).
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        offload_gradients: bool = True,
    ) -> None:
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise UserError("CPUOffloadAdamW got no parameters that require grad")
        if lr <= 0:
            raise UserError(f"lr must be positive, got {lr}")
        self.offload_gradients = offload_gradients
        self.cuda = any(p.is_cuda for p in self.params)
        self.stream = torch.cuda.Stream() if self.cuda else None
        self.master: list[torch.nn.Parameter] = []
        self.optimizers: list[torch.optim.Optimizer] = []
        self.events: list[torch.cuda.Event | None] = [None] * len(self.params)
        self.ready = [False] * len(self.params)
        self.accumulated = [False] * len(self.params)
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._hooks = []
        for p in self.params:
            master = torch.nn.Parameter(torch.empty(p.shape, dtype=torch.float32, pin_memory=self.cuda))
            with torch.no_grad():
                master.copy_(p.detach())
            master.grad = torch.zeros(p.shape, dtype=torch.float32, pin_memory=self.cuda)
            self.master.append(master)
            self.optimizers.append(_host_adamw([master], lr, betas, eps, weight_decay))
            self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_ready))

    def _grad_ready(self, p: torch.Tensor) -> None:
        i = self._index[id(p)]
        self.ready[i] = True
        if not self.offload_gradients:
            return  # p.grad stays on the device and accumulates there; step() copies it
        grad, host = p.grad, self.master[i].grad
        if self.events[i] is not None:  # a later micro-batch: wait for the first copy, then add
            self.events[i].synchronize()
            self.events[i] = None
            host.add_(grad.detach().to("cpu", torch.float32))
        elif self.accumulated[i]:
            host.add_(grad.detach().to("cpu", torch.float32))
        elif self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                host.copy_(grad.detach(), non_blocking=True)
                grad.record_stream(self.stream)  # the block is not reused before the copy ends
                event = torch.cuda.Event()
                event.record(self.stream)
                self.events[i] = event
        else:
            host.copy_(grad.detach())
        self.accumulated[i] = True
        p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        for i, p in enumerate(self.params):
            if not self.ready[i]:
                continue
            if self.events[i] is not None:
                self.events[i].synchronize()
                self.events[i] = None
            if not self.offload_gradients:
                self.master[i].grad.copy_(p.grad.detach())
            self.optimizers[i].step()
            if self.stream is not None:
                with torch.cuda.stream(self.stream):
                    p.copy_(self.master[i], non_blocking=True)
            else:
                p.copy_(self.master[i])
            self.ready[i] = self.accumulated[i] = False
        if self.stream is not None:
            torch.cuda.current_stream().wait_stream(self.stream)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None if set_to_none else (p.grad.zero_() if p.grad is not None else None)

    def state_bytes(self) -> int:
        """Bytes of optimizer state on the host (exp_avg, exp_avg_sq, step counters)."""
        return storage_bytes(t for opt in self.optimizers for t in optimizer_state_tensors(opt))

    def remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()


def _host_adamw(params, lr, betas, eps, weight_decay) -> torch.optim.Optimizer:
    try:
        return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=True)
    except (RuntimeError, TypeError, ValueError):  # an older torch without fused CPU AdamW
        return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
