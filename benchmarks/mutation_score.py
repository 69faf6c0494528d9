"""How many realistic one-line bugs does the test suite catch? Hand-written mutants of every package of
course_lib, each applied alone to a temporary copy of the repository, with only its relevant test files
run (pytest -x -q -n 0, a time limit each). Prints one row per mutant (killed / survived) and the score.

    .venv/bin/python benchmarks/mutation_score.py                 # every mutant (tens of minutes on 2 cores)
    .venv/bin/python benchmarks/mutation_score.py --only sharding  # the mutants whose id starts so
    .venv/bin/python benchmarks/mutation_score.py --list           # the mutants, nothing run

A mutant is (id, file, the exact original text, its replacement, the test files that should catch it):
the original must occur exactly once in the file. Before the mutants, the union of their test files runs
on the unmutated copy (skip with --no-baseline): a mutant counts only against tests that pass without it.
Goal (issue "tests that catch real bugs"): at least 95% killed. Exits 1 below it. A benchmark, not a test:
it takes longer than CI.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GOAL = 0.95
KILLS = "tests/test_mutation_kills.py"


@dataclass(frozen=True)
class Mutant:
    id: str  # where.what: the package (or floor-1 module) of course_lib it is in, first
    file: str
    original: str
    replacement: str
    tests: tuple[str, ...]


def m(id, file, original, replacement, *tests) -> Mutant:
    return Mutant(id, f"course_lib/{file}", original, replacement, tests)


MUTANTS = [
    # infrastructure (floor 1)
    m(
        "measure.phase_starts_at_0",
        "measure.py",
        "self.phase_peaks[phase] = self.current",
        "self.phase_peaks[phase] = 0",
        KILLS,
        "tests/test_measure.py",
    ),
    m(
        "measure.allocator_phase_starts_at_0",
        "allocator_events.py",
        "peaks[phase] = max(peaks.get(phase, 0), current)",
        "peaks[phase] = peaks.get(phase, 0)",
        KILLS,
        "tests/test_measure.py",
    ),
    m(
        "device.bf16_from_sm90",
        "device.py",
        "if capability >= (8, 0):",
        "if capability > (8, 0):",
        "tests/test_device.py",
    ),
    m(
        "layers.shortest_stack",
        "layers.py",
        "return max(outermost, key=lambda item: len(item[1]))[1]",
        "return min(outermost, key=lambda item: len(item[1]))[1]",
        KILLS,
        "tests/test_layers.py",
    ),
    # accumulation (lesson 2)
    m(
        "accumulation.bf16_not_upcast",
        "accumulation/losses.py",
        "if logits.dtype in (torch.float16, torch.bfloat16):",
        "if logits.dtype == torch.float16:",
        KILLS,
        "tests/accumulation/test_accumulation.py",
    ),
    m(
        "accumulation.count_unshifted",
        "accumulation/losses.py",
        'return int((batch["labels"][:, 1:] != self.ignore_index).sum())',
        'return int((batch["labels"] != self.ignore_index).sum())',
        "tests/accumulation/test_accumulation.py",
    ),
    m(
        "accumulation.zero_clip_accepted",
        "accumulation/loop.py",
        'validate.positive("max_grad_norm (or None: no clipping)", max_grad_norm)',
        'validate.finite("max_grad_norm (or None: no clipping)", max_grad_norm, at_least=0)',
        KILLS,
        "tests/accumulation/test_accumulation.py",
    ),
    # checkpointing (lesson 3)
    m(
        "checkpointing.first_fitting_plan",
        "checkpointing/optimal.py",
        "return fitting[-1]",
        "return fitting[0]",
        "tests/checkpointing/test_checkpointing.py",
    ),
    m(
        "checkpointing.budget_strict",
        "checkpointing/optimal.py",
        "if peak <= budget_bytes]",
        "if peak < budget_bytes]",
        "tests/checkpointing/test_checkpointing.py",
    ),
    m(
        "checkpointing.sqrt_floored",
        "checkpointing/plans.py",
        "max(1, round(math.sqrt(n_layers)))",
        "max(1, int(math.sqrt(n_layers)))",
        KILLS,
        "tests/checkpointing/test_checkpointing.py",
    ),
    # paging (lesson 4)
    m(
        "paging.density_at_threshold",
        "paging/policies.py",
        "if resident[start : start + span].sum() > threshold * span:",
        "if resident[start : start + span].sum() >= threshold * span:",
        KILLS,
        "tests/paging/test_paging.py",
    ),
    m(
        "paging.threshold_1_refused",
        "paging/policies.py",
        "if not 0 < self.density_threshold <= 1:",
        "if not 0 < self.density_threshold < 1:",
        KILLS,
        "tests/paging/test_paging.py",
    ),
    m(
        "paging.small_block_boundary",
        "caching_allocator.py",
        "if block <= SMALL_SIZE:",
        "if block < SMALL_SIZE:",
        KILLS,
        "tests/test_caching_allocator.py",
        "tests/paging/test_paging.py",
    ),
    m(
        "paging.segment_rounds_up_always",
        "caching_allocator.py",
        "return -(-block // ROUND_LARGE) * ROUND_LARGE",
        "return (block // ROUND_LARGE + 1) * ROUND_LARGE",
        KILLS,
        "tests/test_caching_allocator.py",
        "tests/paging/test_paging.py",
    ),
    # sharding (lesson 6)
    m(
        "sharding.ring_not_scaled",
        "sharding/tracking.py",
        "self.sent[name] += ring_factor * nbytes * (n - 1) // n",
        "self.sent[name] += ring_factor * nbytes",
        "tests/sharding/test_sharding.py",
    ),
    # toolbox (lesson 7)
    m(
        "toolbox.loss_not_upcast",
        "toolbox/chunked_loss.py",
        'return F.cross_entropy(logits.float(), labels, ignore_index=ignore_index, reduction="sum")',
        'return F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="sum")',
        KILLS,
        "tests/toolbox/test_toolbox.py",
    ),
    m(
        "toolbox.mean_over_all_positions",
        "toolbox/chunked_loss.py",
        "return total / (targets != ignore_index).sum().clamp(min=1)",
        "return total / max(targets.numel(), 1)",
        "tests/toolbox/test_toolbox.py",
    ),
    m(
        "toolbox.recompute_swapped",
        "toolbox/chunked_loss.py",
        "        if recompute:",
        "        if not recompute:",
        "tests/toolbox/test_toolbox.py",
    ),
    m(
        "toolbox.zero_bytes_refused",
        "toolbox/activation_offload.py",
        "validate.finite(name, value, at_least=0)",
        "validate.finite(name, value, above=0)",
        KILLS,
        "tests/toolbox/test_toolbox.py",
    ),
    # memory, the planner (floor 3)
    m(
        "planner.zero1_ties_to_last_rank",
        "planner/parallel/sharded.py",
        "rank = sizes.index(min(sizes))",
        "rank = len(sizes) - 1 - sizes[::-1].index(min(sizes))",
        KILLS,
        "tests/sharding/test_sharding.py",
    ),
    m(
        "planner.zero1_smallest_first",
        "planner/parallel/sharded.py",
        "for i in sorted(range(len(shapes)), key=lambda i: math.prod(shapes[i]), reverse=True):",
        "for i in sorted(range(len(shapes)), key=lambda i: math.prod(shapes[i])):",
        KILLS,
        "tests/sharding/test_sharding.py",
    ),
    m(
        "planner.offload_weights_copied_once",
        "planner/parallel/sharded.py",
        '"pcie_per_step": 2 * fp32_weights - root_once + fp32_grads,',
        '"pcie_per_step": fp32_weights - root_once + fp32_grads,',
        "tests/sharding/test_sharding.py",
    ),
    m(
        "planner.offload_kept_root_copied_twice",
        "planner/parallel/sharded.py",
        "root_once = 0 if plan.setup.fsdp_reshard_root else",
        "root_once = 0 if True else",
        "tests/sharding/test_sharding.py",
    ),
    m(
        "planner.paper_shares_floored",
        "planner/parallel/sharded.py",
        "out[category] = math.ceil(values[category] / n)",
        "out[category] = values[category] // n",
        KILLS,
        "tests/sharding/test_sharding.py",
    ),
    m(
        "planner.int32_token_ids",
        "planner/phases/activations.py",
        "batch = 2 * setup.batch * setup.seq * 8",
        "batch = 2 * setup.batch * setup.seq * 4",
        KILLS,
        "tests/planner/test_planner.py",
    ),
    m(
        "planner.qmaps_half",
        "planner/states/model_states.py",
        "BNB_QMAPS_BYTES = 2 * 256 * 4",
        "BNB_QMAPS_BYTES = 256 * 4",
        "tests/planner/test_planner.py",
    ),
    m(
        "planner.nf4_no_code_table",
        "planner/states/model_states.py",
        "return packed, blocks * 4 + 16 * 4",
        "return packed, blocks * 4",
        "tests/planner/test_planner.py",
    ),
    m(
        "planner.bf16_from_sm90",
        "planner/config/gpus.py",
        "return self.compute_capability >= (8, 0)",
        "return self.compute_capability > (8, 0)",
        KILLS,
        "tests/planner/test_planner.py",
    ),
    m(
        "planner.accumulation_trick_from_batch_3",
        "planner/search/fit.py",
        "    if setup.batch > 1:\n        exact.append",
        "    if setup.batch > 2:\n        exact.append",
        KILLS,
        "tests/planner/test_planner.py",
    ),
    # qlora (lesson 5)
    m(
        "qlora.no_accumulation_drops_batch",
        "qlora/recipe.py",
        "return replace(self, batch=self.effective_batch, accum=1)",
        "return replace(self, accum=1)",
        "tests/qlora/test_qlora.py",
    ),
    m(
        "qlora.batch_0_accepted",
        "qlora/recipe.py",
        "or not isinstance(value, int) or value < 1:",
        "or not isinstance(value, int) or value < 0:",
        KILLS,
        "tests/qlora/test_qlora.py",
    ),
    # checks (the exercises' checks)
    m(
        "checks.allocation_order_ties",
        "checks/paging.py",
        "assert alloc_in < lru_in, (",
        "assert alloc_in <= lru_in, (",
        KILLS,
        "tests/checks/test_checks.py",
    ),
    m(
        "checks.mru_ties",
        "checks/paging.py",
        "assert mru[0] < lru[0], (",
        "assert mru[0] <= lru[0], (",
        KILLS,
        "tests/checks/test_checks.py",
    ),
    m(
        "checks.step3_one_key",
        "checks/paging.py",
        "    for key in want:\n",
        "    for key in list(want)[:1]:\n",
        KILLS,
        "tests/checks/test_checks.py",
    ),
    m(
        "checks.zero_kinds_skip_weights",
        "checks/sharding.py",
        "wrong = [kind for kind in _KINDS if abs(got[kind] - expected[kind]) > gpus]",
        'wrong = [kind for kind in _KINDS if kind != "weights" and abs(got[kind] - expected[kind]) > gpus]',
        KILLS,
        "tests/sharding/test_sharding.py",
    ),
    m(
        "checks.best_plan_one_extra_recompute",
        "checks/checkpointing.py",
        "assert _recomputed(plan) <= best_recompute, (",
        "assert _recomputed(plan) <= best_recompute + 1, (",
        KILLS,
        "tests/checks/test_checks.py",
    ),
    m(
        "checks.best_plan_no_raise_needed",
        "checks/checkpointing.py",
        '            raise AssertionError(\n                f"best_plan(saved={saved}, inputs={inputs}, budget={minimum - 1}) returned "',
        '            print(\n                f"best_plan(saved={saved}, inputs={inputs}, budget={minimum - 1}) returned "',
        KILLS,
        "tests/checks/test_checks.py",
    ),
    m(
        "checks.forward_runs_not_checked",
        "checks/checkpointing.py",
        '    assert runs == expected, f"forward runs',
        '    assert runs == expected or runs == [1] * 6, f"forward runs',
        KILLS,
        "tests/checks/test_checks.py",
    ),
    m(
        "checks.saved_bytes_hint_batch",
        "checks/measuring.py",
        "    if predicted == 4 * (inputs + hidden):",
        "    if predicted == 4 * (inputs + hidden + out):",
        "tests/checks/test_checks.py",
    ),
    # exercises (generation and grading)
    m(
        "exercises.stub_unindented",
        "grading/generate.py",
        "indent = line[: len(line) - len(line.lstrip())]",
        'indent = ""',
        "tests/grading/test_exercises.py::test_strip_solutions_keeps_the_indentation_and_the_rest",
    ),
    m(
        "exercises.ids_tie_picks_one",
        "grading/restore.py",
        "shared[best] and list(shared.values()).count(shared[best]) == 1 else None",
        "shared[best] else None",
        KILLS,
        "tests/grading/test_grading.py::test_a_submission_is_identified_by_metadata_then_file_name_then_cell_ids",
    ),
]


# Mutants known to survive, and why: the score is over the others (the non-equivalent ones).
EQUIVALENT = {
    "checks.mru_ties": "practically equivalent: check_mru reaches `mru < lru` on the 10-chunk cycle only for an answer "
    "that already matched the simulator's MRU on all 66 traces of _compare, whose MRU beats LRU there",
}


def copy_repository(into: Path) -> None:
    """The tracked and untracked (not ignored) files of the working tree, as they are now."""
    listed = (
        subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True, capture_output=True
        )
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, into / name)


def run_tests(copy: Path, tests, timeout: float) -> tuple[str, float]:
    """'passed', 'failed' or 'timeout', and the seconds it took."""
    env = dict(os.environ, PYTHONPATH=str(copy), PYTHONDONTWRITEBYTECODE="1")
    start = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-x", "-q", "-n", "0", "-p", "no:cacheprovider", *tests],
            cwd=copy,
            env=env,
            capture_output=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return "timeout", time.perf_counter() - start
    outcome = {0: "passed", 1: "failed"}.get(done.returncode, f"error (pytest exit {done.returncode})")
    return outcome, time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma-separated id prefixes (e.g. memory,checks.mru)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per mutant's tests (default 600)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the run of the unmutated copy")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    args = parser.parse_args(argv)
    prefixes = [p for p in args.only.split(",") if p]
    chosen = [mu for mu in MUTANTS if not prefixes or any(mu.id.startswith(p) for p in prefixes)]
    if not chosen:
        print(f"no mutant's id starts with {args.only!r}; --list shows them")
        return 2
    if args.list:
        for mu in chosen:
            print(f"{mu.id:40} {mu.file}")
        return 0
    with tempfile.TemporaryDirectory(prefix="mutants-") as folder:
        copy = Path(folder)
        copy_repository(copy)
        for mu in chosen:
            found = (copy / mu.file).read_text().count(mu.original)
            if found != 1:
                print(f"{mu.id}: its original text occurs {found} times in {mu.file}, not once: mend the mutant")
                return 2
        if not args.no_baseline:
            union = list(dict.fromkeys(t for mu in chosen for t in mu.tests))
            outcome, seconds = run_tests(copy, union, args.timeout * len(union))
            print(f"baseline, unmutated: {outcome} in {seconds:.0f} s ({len(union)} test targets)")
            if outcome != "passed":
                print("the tests fail without any mutant: fix them first")
                return 2
        print(f"{'mutant':40} {'file':34} {'result':9} {'s':>5}")
        killed = []
        for mu in chosen:
            path = copy / mu.file
            text = path.read_text()
            path.write_text(text.replace(mu.original, mu.replacement))
            try:
                outcome, seconds = run_tests(copy, mu.tests, args.timeout)
            finally:
                path.write_text(text)
            result = {"passed": "survived", "failed": "killed", "timeout": "killed"}.get(outcome, "error")
            if result == "killed":
                killed.append(mu)
            note = "" if outcome in ("passed", "failed") else f"  ({outcome})"
            print(f"{mu.id:40} {mu.file.removeprefix('course_lib/'):34} {result:9} {seconds:5.0f}{note}", flush=True)
    counted = [mu for mu in chosen if mu.id not in EQUIVALENT or mu in killed]
    score = len(killed) / len(counted) if counted else 1.0
    packages = sorted({mu.id.split(".")[0] for mu in chosen})
    print(
        f"\nkilled {len(killed)}, survived {len(chosen) - len(killed)} of {len(chosen)} mutants "
        f"({', '.join(packages)}): score {score:.0%} of the {len(counted)} non-equivalent (goal {GOAL:.0%})"
    )
    for mu in chosen:
        if mu not in killed:
            why = EQUIVALENT.get(mu.id, "not equivalent: add a test that catches it")
            print(f"  survived: {mu.id} ({mu.file}): {mu.original.strip()!r} -> {mu.replacement.strip()!r}; {why}")
    return 0 if score >= GOAL else 1


if __name__ == "__main__":
    sys.exit(main())
