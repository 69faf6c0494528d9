"""What a simulation returns: time and bytes moved by phase, the timeline's segments, the peaks and
the OOM (lesson 4, "the simulator"). Every number in it is *simulated*."""

from __future__ import annotations

from dataclasses import dataclass

from course_lib.measure import format_bytes
from course_lib.paging.policies import Hardware, OutOfDeviceMemory, PagingError, Policy
from course_lib.validate import checked


@checked(error=PagingError)
@dataclass
class PhaseStats:
    """Time (seconds) and traffic (bytes) of one phase of one step (lesson 4)."""

    compute: float = 0.0
    h2d_time: float = 0.0
    d2h_time: float = 0.0
    fault_time: float = 0.0
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    populated_bytes: int = 0
    faults: int = 0

    @property
    def total(self) -> float:
        return self.compute + self.h2d_time + self.d2h_time + self.fault_time

    def add(self, other: PhaseStats) -> None:
        for name in (
            "compute",
            "h2d_time",
            "d2h_time",
            "fault_time",
            "h2d_bytes",
            "d2h_bytes",
            "populated_bytes",
            "faults",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))


@checked(error=PagingError)
@dataclass(frozen=True)
class Segment:
    """One bar of the timeline (lesson 4): [start, end) seconds in `lane` (compute, H2D, D2H, faults)."""

    start: float
    end: float
    lane: str
    step: int
    phase: str
    label: str
    nbytes: int = 0


@checked(error=PagingError)
@dataclass
class SimulationResult:
    """What `simulate` measured (lesson 4). Times in seconds, traffic in bytes."""

    hardware: Hardware
    policy: Policy
    phases: dict[tuple[int, str], PhaseStats]
    timeline: list[Segment]
    oom: OutOfDeviceMemory | None
    bytes_in: int  # migrated host to device
    bytes_populated: int  # first-touched on the device (no transfer)
    bytes_out: int  # evicted device to host
    resident_bytes: int  # managed bytes on the device at the end
    freed_resident_bytes: int  # managed bytes freed while on the device
    peak_used: int  # most device memory in use (reserved + resident managed)
    peak_reserved: int
    steps_completed: int

    @property
    def steps(self) -> list[int]:
        return sorted({step for step, _ in self.phases})

    def step_stats(self, step: int) -> PhaseStats:
        total = PhaseStats()
        for (s, _), stats in self.phases.items():
            if s == step:
                total.add(stats)
        return total

    def step_time(self, step: int) -> float:
        return self.step_stats(step).total

    def slowdown(self, step: int) -> float:
        """Step time over its compute time: 1.0 when paging costs nothing."""
        stats = self.step_stats(step)
        return stats.total / stats.compute if stats.compute else 1.0

    def conservation_error(self) -> int:
        """bytes in (migrated + populated) - (bytes out + resident + freed while resident): 0."""
        return self.bytes_in + self.bytes_populated - self.bytes_out - self.resident_bytes - self.freed_resident_bytes

    def table(self) -> str:
        """One line per step: time, compute, paging traffic and slowdown, all simulated."""
        lines = [
            f"simulated on {self.hardware.name}",
            f"{'step':>4} {'time ms':>9} {'compute ms':>10} {'in (H2D)':>11} {'out (D2H)':>11} "
            f"{'faults':>7} {'slowdown':>8}",
        ]
        for step in self.steps:
            st = self.step_stats(step)
            lines.append(
                f"{step:>4} {1e3 * st.total:>9.1f} {1e3 * st.compute:>10.1f} "
                f"{format_bytes(st.h2d_bytes):>11} {format_bytes(st.d2h_bytes):>11} "
                f"{st.faults:>7} {self.slowdown(step):>7.2f}x"
            )
        if self.oom is not None:
            lines.append(f"OUT OF MEMORY in step {self.oom.step} ({self.oom.phase}): {self.oom}")
        return "\n".join(lines)
