"""The lesson's scenarios on the simulator: the three regimes, the cost per GB evicted, paging
against CPU offload, 8-bit state and LoRA (lesson 4). Every number they return is simulated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from course_lib import validate
from course_lib.measure import MiB, format_bytes
from course_lib.paging.policies import GB, Hardware, PagingError, Policy, require_positive
from course_lib.paging.simulator import SimulationResult, simulate
from course_lib.paging.trace import (
    ParamSpec,
    TrainingSetup,
    activation_bytes_per_token,
    training_trace,
    transformer_params,
)
from course_lib.validate import checked


@checked(error=PagingError)
@dataclass(frozen=True)
class OffloadResult:
    """One step with the optimizer on the CPU (lesson 4, "manual offload"). Seconds and bytes."""

    compute: float
    grad_copy_exposed: float
    cpu_step: float
    param_copy_exposed: float
    device_peak: int
    fits: bool

    @property
    def total(self) -> float:
        return self.compute + self.grad_copy_exposed + self.cpu_step + self.param_copy_exposed

    @property
    def slowdown(self) -> float:
        return self.total / self.compute if self.compute else 1.0


def simulate_offload(
    setup: TrainingSetup, tokens: int, hardware: Hardware | None = None, *, offload_gradients: bool = True
) -> OffloadResult:
    """A step of whole-tensor CPU offload of the optimizer (lesson 4), as torchao's `CPUOffloadOptimizer` does
    it: gradients copied to pinned host memory in post-accumulate-grad hooks (overlapping the rest
    of backward), the AdamW step on the CPU, parameters copied back (overlapping the next
    parameter's CPU step). The cost is paid every step, whether memory is short or not."""
    validate.instance("setup", setup, TrainingSetup, "a paging.TrainingSetup", error=PagingError)
    tokens = validate.non_negative_int("tokens", tokens, error=PagingError)
    hw = validate.instance("hardware", hardware or Hardware.t4(), Hardware, "a paging.Hardware", error=PagingError)
    cat = setup.bytes_by_category(tokens)
    trainable = [p for p in setup.params if p.trainable]
    flops_per_token = setup.flops_per_token if setup.flops_per_token is not None else 6.0 * setup.n_params
    forward = flops_per_token * tokens / 3 / hw.device_flops
    backward = 2 * forward
    grad_bytes = sum(p.numel * setup.grad_bytes for p in trainable)
    param_bytes = sum(p.numel * p.dtype_bytes for p in trainable)
    grad_copy = grad_bytes / hw.pinned_bandwidth
    exposed_grad = max(0.0, grad_copy - backward * (1 - 1 / max(1, setup.n_layers)))
    cpu_step = sum(p.numel for p in trainable) / hw.cpu_adam_rate
    largest = max((p.numel * p.dtype_bytes for p in trainable), default=0)
    exposed_param = max(0.0, param_bytes / hw.pinned_bandwidth - cpu_step) + largest / hw.pinned_bandwidth
    grads_on_device = 0 if offload_gradients else cat["gradients"]
    # With offloaded gradients, at most about one layer's gradients wait on the device for their copy.
    if offload_gradients:
        per_layer = [sum(p.numel for p in trainable if p.layer == layer) for layer in range(setup.n_layers)]
        grads_on_device = max(per_layer, default=0) * setup.grad_bytes
    peak = cat["weights"] + grads_on_device + cat["activations"]
    return OffloadResult(
        compute=forward + backward,
        grad_copy_exposed=exposed_grad,
        cpu_step=cpu_step,
        param_copy_exposed=exposed_param,
        device_peak=peak,
        fits=peak <= hw.memory,
    )


# --------------------------------------------------------------------------------------------
# The lesson's scenarios
# --------------------------------------------------------------------------------------------


@checked(error=PagingError)
@dataclass(frozen=True)
class RegimeResult:
    """One regime: the paged run, the unpaged run of the same steps, and what they say (lesson 4)."""

    name: str
    paged: SimulationResult
    unpaged: SimulationResult
    setup: TrainingSetup
    tokens_per_step: tuple[int, ...]

    @property
    def worst_slowdown(self) -> float:
        return max(self.paged.slowdown(s) for s in self.paged.steps)

    @property
    def steady_slowdown(self) -> float:
        return self.paged.slowdown(self.paged.steps[-1])

    def summary(self) -> str:
        unpaged = f"runs out of memory in step {self.unpaged.oom.step}" if self.unpaged.oom else "fits"
        paged = "runs out of memory" if self.paged.oom else "completes"
        traffic = sum(self.paged.step_stats(s).h2d_bytes + self.paged.step_stats(s).d2h_bytes for s in self.paged.steps)
        return (
            f"{self.name}: paged {paged}, worst step {self.worst_slowdown:.2f}x, last step "
            f"{self.steady_slowdown:.2f}x, paging traffic {format_bytes(traffic)}; unpaged {unpaged}"
        )


def lesson_model(n_layers: int, hidden: int = 2048, vocab: int = 50257, **kw) -> list[ParamSpec]:
    """The decoder the lesson scales: GPT-2 shapes, `hidden` wide, `n_layers` deep."""
    return transformer_params(n_layers, hidden, vocab, **kw)


@checked(error=PagingError)
def regimes(
    hardware: Hardware | None = None, policy: Policy | None = None, *, steps: int = 4, tokens: int = 2048
) -> dict[str, RegimeResult]:
    """The three regimes of lesson 4 on a T4-sized device (hardware defaults to `Hardware.t4()`):

    - "fits": a 0.6B-parameter model with paged 32-bit AdamW: nothing moves, slowdown 1.0;
    - "spike": the same model, one batch 6x longer: the paged run evicts state and survives, the
      unpaged run runs out of memory; the allocator keeps the spike's memory reserved, so the
      steps after it keep paging until `empty_cache` (run at the end of the spike step here);
    - "thrashing": a 1.1B-parameter model whose paged state does not fit: every step moves the
      whole state out and back, a several-fold slowdown.
    """
    hw = hardware or Hardware.t4()
    act = activation_bytes_per_token(2048, 1)  # per layer; scaled by depth below

    def setup(layers: int) -> TrainingSetup:
        return TrainingSetup(tuple(lesson_model(layers)), "paged_adamw_32bit", activation_bytes_per_token=act * layers)

    out = {}
    cases = [
        ("fits", 10, [tokens] * steps, ()),
        ("spike", 10, [tokens] * (steps // 2) + [6 * tokens] + [tokens] * (steps - steps // 2 - 1), (steps // 2,)),
        ("thrashing", 20, [tokens] * steps, ()),
    ]
    for name, layers, per_step, flush in cases:
        s = setup(layers)
        paged = simulate(training_trace(s, per_step, empty_cache_after=flush), hw, policy)
        unpaged = simulate(
            training_trace(s.with_optimizer("adamw"), per_step, empty_cache_after=flush),
            hw,
            policy,
            record_timeline=False,
        )
        out[name] = RegimeResult(name, paged, unpaged, s, tuple(per_step))
    return out


@checked(error=PagingError)
def evicted_per_step_cost(
    gigabytes: float = 1.0, hardware: Hardware | None = None, policy: Policy | None = None, steps: int = 3
) -> dict[str, float]:
    """Simulate a step that evicts `gigabytes` GB of paged state and brings it back (lesson 4,
    "125 ms per GB"): a model whose 32-bit paged state is `gigabytes` GB, on a device just too
    small for it, so every step moves it all. Returns the steady step's evicted GB and milliseconds
    per evicted GB of migrating it back (what bitsandbytes' estimate counts), of evicting it, and
    of both."""
    require_positive("gigabytes", gigabytes)
    hw = hardware or Hardware.pcie3_x16()
    n_params = int(gigabytes * GB / 8)
    per_tensor = 4 * 2**20
    count = max(1, n_params // per_tensor)
    params = [ParamSpec(f"w{i}", n_params // count + (1 if i < n_params % count else 0), i) for i in range(count)]
    setup = TrainingSetup(tuple(params), "paged_adamw_32bit", activation_bytes_per_token=0)
    cat = setup.bytes_by_category()
    memory = cat["weights"] + cat["gradients"] + cat["optimizer state (paged)"] - 64 * MiB
    result = simulate(training_trace(setup, [1] * steps), hw.with_memory(memory), policy, record_timeline=False)
    if result.oom is not None:
        raise result.oom
    last = result.step_stats(result.steps[-1])
    evicted = last.d2h_bytes / GB
    return {
        "evicted_gb": evicted,
        "ms_per_gb_in": 1e3 * last.h2d_time / evicted,
        "ms_per_gb_out": 1e3 * last.d2h_time / evicted,
        "ms_per_gb_total": 1e3 * (last.h2d_time + last.d2h_time + last.fault_time) / evicted,
        "bnb_estimate_ms_per_gb": 1e3 * GB / hw.h2d_bandwidth,
    }


@checked(error=PagingError)
@dataclass(frozen=True)
class StrategyRow:
    """One model size under each way of handling optimizer state (lesson 4, "paging vs ...")."""

    n_params: int
    unpaged_fits: bool
    slowdown: dict[str, float | None]  # None: runs out of memory


@checked(error=PagingError)
def compare_strategies(
    layer_counts: Sequence[int] = (8, 12, 16, 20, 24, 28),
    hardware: Hardware | None = None,
    tokens: int = 2048,
    steps: int = 3,
    lora_rank: int = 16,
) -> list[StrategyRow]:
    """Steady-step slowdown of paged 32-bit AdamW, paged 8-bit AdamW, manual CPU offload and LoRA
    (rank `lora_rank`, paged 32-bit state) for the lesson's decoder at several depths."""
    hw = hardware or Hardware.t4()
    act = activation_bytes_per_token(2048, 1)
    rows = []
    for layers in layer_counts:
        full = TrainingSetup(tuple(lesson_model(layers)), "paged_adamw_32bit", act * layers)
        lora = TrainingSetup(tuple(lesson_model(layers, lora_rank=lora_rank)), "paged_adamw_32bit", act * layers)
        slow: dict[str, float | None] = {}
        for label, setup in (
            ("paged 32-bit", full),
            ("paged 8-bit", full.with_optimizer("paged_adamw_8bit")),
            ("LoRA", lora),
        ):
            result = simulate(training_trace(setup, [tokens] * steps), hw, record_timeline=False)
            slow[label] = None if result.oom else result.slowdown(result.steps[-1])
        offload = simulate_offload(full, tokens, hw)
        slow["CPU offload"] = offload.slowdown if offload.fits else None
        unpaged = simulate(training_trace(full.with_optimizer("adamw"), [tokens] * 2), hw, record_timeline=False)
        rows.append(StrategyRow(full.n_params, unpaged.oom is None, slow))
    return rows


def bnb_estimate_ms(evicted_gb: float, link_gb_per_s: float = 16.0, efficiency: float = 0.5) -> float:
    """bitsandbytes' documented estimate (lesson 4): evicting `evicted_gb` GB per step costs
    evicted_gb / (link * efficiency) seconds (1 GB on PCIe 3.0 x16: 125 ms)."""
    require_positive("link_gb_per_s", link_gb_per_s)
    require_positive("efficiency", efficiency)
    validate.finite("evicted_gb", evicted_gb, at_least=0, error=PagingError)
    return 1e3 * evicted_gb / (link_gb_per_s * efficiency)
