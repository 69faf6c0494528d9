"""The planner against published GPU measurements (issue 26; lesson 1, "the planner").

Every row of benchmarks/data/published_runs.csv is one peak someone measured on a GPU and published,
with its source (repository, file and commit; docs/references.md has an entry per source), the run's
configuration, the statistic measured (allocated = `torch.cuda.max_memory_allocated`, reserved =
`max_memory_reserved`, nvidia-smi = reserved plus the CUDA context) and its unit (GB = 10^9 bytes,
GiB = 2^30). For each row this prints the planner's prediction (`course_lib.planner.plan`, the setup
`course-lib plan` builds from the same options) beside the published figure, the error, and the fit
verdict beside a published fit or OOM; then the worst error per statistic.

Rows of Hugging Face stacks (transformers' model code) are the accuracy goal; rows measured on another
stack's model code (litgpt, torchtune) are a comparison, printed apart; rows left out (their reason in
the data) are printed last, planned where the planner can. A setup the planner refuses prints its
one-line refusal.

    .venv/bin/python benchmarks/published_accuracy.py             # every row (traces are cached on disk)
    .venv/bin/python benchmarks/published_accuracy.py --quick     # the Hugging Face rows only
    .venv/bin/python benchmarks/published_accuracy.py --rows mm-full,fq-lora-b1-512
    .venv/bin/python benchmarks/published_accuracy.py --markdown  # the table of docs/planner_accuracy.md
"""

from __future__ import annotations

import argparse
import csv
import sys
from dataclasses import dataclass
from pathlib import Path

from course_lib.errors import UserError
from course_lib.measure import GiB, MiB
from course_lib.models import model_spec
from course_lib.planner import GPU, LOOPS, Plan, PlanError, Setup, get_gpu, plan
from course_lib.planner.config.fields import FSDP_WRAP_FROM
from course_lib.planner.parallel.fsdp_wrap import after_wrap
from course_lib.planner.trace.step_trace import trace_request

DATA = Path(__file__).with_name("data") / "published_runs.csv"
UNITS = {"bytes": 1, "MB": 10**6, "MiB": MiB, "GB": 10**9, "GiB": GiB}
STATISTICS = ("allocated", "reserved", "active", "nvidia-smi")
STACKS = ("hf", "comparison")
OUTCOMES = ("fit", "oom")
TRUST = {
    "A": "configuration and statistic as published",
    "B": "configuration as published; the tokens at the peak an upper bound or the longest sample",
    "C": "part of the configuration inferred (the row's facts say which)",
}
SHARDINGS = {"none": "none", "fsdp-no-shard": "none", "fsdp-full-shard": "zero3"}  # the data's -> Setup.shard
REQUIRED = (
    "id",
    "source",
    "ref",
    "stack",
    "published_model",
    "method",
    "micro_batch",
    "seq",
    "tokens_at_peak",
    "dtype",
    "autocast",
    "optimizer",
    "checkpointing",
    "autocast_adapter_dtype",
    "loop",
    "legacy_causal_lm_loss",
    "empty_cache_each_step",
    "fsdp_backward_prefetch",
    "gpus",
    "sharding",
    "statistic",
    "unit",
    "outcome",
    "trust",
    "facts",
)


@dataclass
class Result:
    row: dict
    published: int | None  # bytes; None for an OOM
    predicted: int | None  # bytes of the row's statistic; None when not planned
    label: str  # how the prediction was made, or why there is none
    fits: bool | None
    planned: Plan | None = None  # the plan itself, where the row was planned


def load_rows(path: Path = DATA) -> list[dict]:
    """The rows of the data file, each checked: UserError (one line) naming the first bad field."""
    with open(path, newline="") as file:
        rows = list(csv.DictReader(file))
    seen = set()
    for number, row in enumerate(rows, start=2):
        where = f"{path.name} line {number} ({row.get('id') or 'no id'})"
        missing = [name for name in REQUIRED if not (row.get(name) or "").strip()]
        if missing:
            raise UserError(f"{where}: empty {', '.join(missing)}")
        for name, options in (
            ("unit", UNITS),
            ("statistic", STATISTICS),
            ("stack", STACKS),
            ("outcome", OUTCOMES),
            ("trust", TRUST),
        ):
            if row[name] not in options:
                raise UserError(f"{where}: unknown {name} {row[name]!r}: use one of {', '.join(options)}")
        if row["id"] in seen:
            raise UserError(f"{where}: the id {row['id']!r} is used twice")
        seen.add(row["id"])
        if (row["outcome"] == "fit") != bool(row["value"].strip()):
            raise UserError(f"{where}: a fit has a measured value and an OOM none")
        if row["sharding"].split("+")[0] not in SHARDINGS:
            raise UserError(f"{where}: unknown sharding {row['sharding']!r}: use one of {', '.join(SHARDINGS)}")
        for name in (
            "autocast_adapter_dtype",
            "legacy_causal_lm_loss",
            "empty_cache_each_step",
            "fsdp_backward_prefetch",
        ):
            if row[name] not in ("True", "False"):  # autocast_adapter_dtype True: peft's fp32 adapters (>= 0.11)
                raise UserError(f"{where}: {name} is True or False, not {row[name]!r}")
        if row["loop"] not in LOOPS:
            raise UserError(f"{where}: loop is one of {', '.join(LOOPS)}, not {row['loop']!r}")
        if row["fsdp_version"] not in ("", "1", "2") or bool(row["fsdp_version"]) != ("full-shard" in row["sharding"]):
            raise UserError(f"{where}: fsdp_version is 1 or 2 for a sharded row, empty for the others")
        if row.get("fsdp_wrap_from") not in ("", *FSDP_WRAP_FROM):
            raise UserError(
                f"{where}: fsdp_wrap_from is empty (a step from an empty cache) or one of "
                f"{', '.join(FSDP_WRAP_FROM)}, not {row.get('fsdp_wrap_from')!r}"
            )
        if row["method"] != "full" and not row["lora_rank"].strip():
            raise UserError(f"{where}: a {row['method']} row needs its lora_rank")
    return rows


def published_bytes(row: dict) -> int | None:
    """The published figure in bytes (GB = 10^9, GiB = 2^30), None for an OOM."""
    return round(float(row["value"]) * UNITS[row["unit"]]) if row["value"].strip() else None


def setup_of(row: dict) -> Setup:
    """The planner's setup for a row: what `course-lib plan` builds from the same options."""
    gpus = int(row["gpus"])
    lora = row["method"] != "full"
    if row["quant"] not in ("", "none"):
        precision = row["dtype"]  # a 4-bit base is planned in its compute dtype
    elif row["autocast"] != "none":  # torch.autocast on one GPU; FSDP's MixedPrecision of an fp32 model
        precision = f"amp-{row['autocast']}" if gpus == 1 else f"mixed-{row['autocast']}"
    else:
        precision = row["dtype"]
    targets = row["lora_targets"].strip()
    return Setup(
        precision=precision,
        optimizer=row["optimizer"],
        batch=int(row["micro_batch"]),
        seq=int(row["seq"]),
        checkpointing=row["checkpointing"],
        quant=row["quant"] or "none",
        lora_rank=int(row["lora_rank"]) if lora else 0,
        lora_targets=(targets if targets == "all-linear" else tuple(targets.split())) if lora else "all-linear",
        lora_dropout=float(row["lora_dropout"] or 0) if lora else 0.0,
        autocast_adapter_dtype=row["autocast_adapter_dtype"] == "True",
        loop=row["loop"],
        legacy_causal_lm_loss=row["legacy_causal_lm_loss"] == "True",
        empty_cache_each_step=row["empty_cache_each_step"] == "True",
        gpus=None if gpus == 1 else gpus,
        shard=SHARDINGS[row["sharding"].split("+")[0]],
        fsdp_version=int(row["fsdp_version"] or 2),
        fsdp_backward_prefetch=row["fsdp_backward_prefetch"] == "True",
        fsdp_wrap_from=row["fsdp_wrap_from"] or None,
    )


def card_of(row: dict) -> GPU | None:
    name = row["gpu"].strip()
    return get_gpu(name) if name else None


def predicted_bytes(result_plan, statistic: str) -> tuple[int, str]:
    """The planner's figure for a published statistic, and its label: from the plan's OOM line (a row is
    planned on its GPU) allocated, reserved, or nvidia-smi's estimate (reserved, the CUDA context and
    resident paged state). A plan without a GPU has allocated only, labelled "alloc" where compared."""
    line = result_plan.oom_line
    if line is not None:
        figures = {"allocated": line.allocated, "active": line.allocated, "reserved": line.reserved}
        return figures.get(statistic, line.nvidia_smi), statistic if statistic in figures else "nvidia-smi"
    allocated = result_plan.total - result_plan.bytes["overhead"]  # max_memory_allocated has no CUDA context
    return (allocated, "allocated") if statistic in ("allocated", "active") else (allocated, "alloc")


def evaluate(row: dict) -> Result:
    published = published_bytes(row)
    if not row["model"].strip():
        return Result(row, published, None, "not planned: no bundled config", None)
    if "unknown" in row.values():
        return Result(row, published, None, "not planned: config incomplete", None)
    if "+" in row["sharding"]:
        return Result(row, published, None, f"not planned: {row['sharding'].split('+')[1]}", None)
    try:
        result_plan = plan(row["model"], setup_of(row), gpu=card_of(row), suggest=False)
    except PlanError as error:
        return Result(row, published, None, f"refused: {error}", None)
    predicted, label = predicted_bytes(result_plan, row["statistic"])
    return Result(row, published, predicted, label, result_plan.fits, result_plan)


def error_percent(result: Result) -> float | None:
    if result.published is None or result.predicted is None:
        return None
    return 100 * (result.predicted - result.published) / result.published


def verdict(result: Result) -> str:
    """The fit verdict beside the published outcome: 'fit ok', 'OOM ok', or what went wrong."""
    if result.fits is None:
        return "-"
    said = ("fits at the limit" if result.planned.oom_line.retries else "fits") if result.fits else "OOM"
    right = result.fits == (result.row["outcome"] == "fit")
    return f"{said} {'ok' if right else 'WRONG'}"


def _configuration(row: dict) -> str:
    method = (
        row["method"]
        + (f" r{row['lora_rank']}" if row["method"] != "full" else "")
        + (f" {row['quant']}" if row["quant"] not in ("", "none") else "")
    )
    gpus = f"{row['gpus']}x{row['gpu'] or '?'}" + ("" if row["sharding"] == "none" else f" {row['sharding']}")
    return f"{row['published_model'].split('/')[-1]}, {method}, b{row['micro_batch']}x{row['seq']}, {gpus}"


def table(results: list[Result], markdown: bool) -> list[str]:
    head = ("row", "configuration", "statistic", "published GiB", "predicted GiB", "error", "verdict")
    lines = []
    for result in results:
        error = error_percent(result)
        cells = (
            result.row["id"],
            _configuration(result.row),
            f"{result.row['statistic']} ({result.row['trust']})",
            "OOM" if result.published is None else f"{result.published / GiB:.2f}",
            result.label if result.predicted is None else f"{result.predicted / GiB:.2f} {result.label}",
            "" if error is None else f"{error:+.1f}%",
            verdict(result),
        )
        lines.append(cells)
    if markdown:
        return [f"| {' | '.join(head)} |", f"|{'---|' * len(head)}"] + [f"| {' | '.join(c)} |" for c in lines]
    return [f"{c[0]:<28} {c[1]:<62} {c[2]:<14} {c[3]:>8} {c[4]:>20} {c[5]:>7}  {c[6]}" for c in lines]


def worst_errors(results: list[Result], bullet: str = "  ") -> list[str]:
    """The worst error (in absolute value) per statistic, with its row, over the rows whose tokens at the
    peak are known; rows whose tokens are an upper bound are counted apart (a prediction above the
    published figure is what they can check)."""
    lines = []
    for statistic in STATISTICS:
        scored = [
            (abs(e), e, r.row["id"])
            for r in results
            if r.row["statistic"] == statistic
            and r.row["tokens_at_peak"] != "upper bound"
            and (e := error_percent(r)) is not None
        ]
        if scored:
            _, error, row_id = max(scored)
            lines.append(f"{bullet}{statistic}: worst {error:+.1f}% ({row_id}), over {len(scored)} rows")
    bounded = [
        (e, r.row["id"])
        for r in results
        if r.row["tokens_at_peak"] == "upper bound" and (e := error_percent(r)) is not None
    ]
    if bounded:
        below = [row_id for e, row_id in bounded if e < 0]
        lines.append(
            f"{bullet}tokens an upper bound: {len(bounded) - len(below)} of {len(bounded)} rows predicted "
            f"at or above the published figure ({min(e for e, _ in bounded):+.1f}% to "
            f"{max(e for e, _ in bounded):+.1f}%){': below: ' + ', '.join(below) if below else ''}"
        )
    wrong = [r.row["id"] for r in results if verdict(r).endswith("WRONG")]
    lines.append(
        f"{bullet}fit verdicts: {sum(verdict(r).endswith('ok') for r in results)} right, "
        f"{len(wrong)} wrong{': ' + ', '.join(wrong) if wrong else ''}"
    )
    return lines


# Answer.AI's benchmarks_03_2024.md (the fq- rows' source): "It's actually about 3.72GiB (see
# `reserved_after_model_wrap`)" for the QLoRA template (fq-qlora-b1-512), before the first step
RESERVED_AFTER_WRAP = ("fq-qlora-b1-512", 3.72 * GiB)


def loader_residue(results: list[Result]) -> str | None:
    """What Answer.AI's loader leaves reserved before the first step: the published reserved_after_model_wrap
    beside the planner's prediction for the same row (`course_lib.planner.parallel.fsdp_wrap.after_wrap`)."""
    result = next((r for r in results if r.row["id"] == RESERVED_AFTER_WRAP[0] and r.planned), None)
    if result is None:
        return None
    row, published = result.row, RESERVED_AFTER_WRAP[1]
    reserved, allocated = after_wrap(model_spec(row["model"]), setup_of(row))
    return (
        f"{row['id']}: reserved after FSDP's wrap, before the first step: {published / GiB:.2f} GiB published, "
        f"{reserved / GiB:.2f} GiB predicted ({100 * (reserved - published) / published:+.1f}%; "
        f"{(reserved - allocated) / GiB:.2f} GiB of it cached)"
    )


def limit_lines(results: list[Result]) -> list[str]:
    """For each row predicted at the card's limit (`course_lib.planner.allocator.limit`): the caching allocator frees its
    cache and retries where a cudaMalloc fails, so max_memory_reserved records the reserve at the first failure,
    between the card less the context and the step's largest request, and the card less the context."""
    lines = []
    for result in results:
        line = result.planned.oom_line if result.planned is not None else None
        if line is None or not line.retries:
            continue
        top = line.capacity - line.context - line.managed
        largest = max(trace_request(model_spec(result.row["model"]), setup_of(result.row), "cuda").stream())
        lines.append(
            f"{result.row['id']}: at the card's limit: the replay's reserve passes what CUDA gives, the "
            f"allocations fit; the allocator frees its cache and retries, and max_memory_reserved stops where "
            f"the first cudaMalloc fails, between {(top - largest) / GiB:.2f} and {top / GiB:.2f} GiB (the "
            f"card {line.capacity / GiB:.2f} GiB less the context {line.context / GiB:.2f} GiB, less the "
            f"step's largest request, {largest / GiB:.2f} GiB); what else holds the card's memory decides"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the Hugging Face rows that are not left out")
    parser.add_argument("--rows", help="comma-separated row ids")
    parser.add_argument("--markdown", action="store_true", help="Markdown tables (docs/planner_accuracy.md)")
    parser.add_argument("--data", type=Path, default=DATA, help="the CSV file (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        rows = load_rows(args.data)
    except (UserError, OSError) as error:
        print(f"published_accuracy: {error}", file=sys.stderr)
        return 2
    if args.rows:
        wanted = args.rows.split(",")
        unknown = sorted(set(wanted) - {row["id"] for row in rows})
        if unknown:
            print(f"published_accuracy: unknown row id(s) {', '.join(unknown)}", file=sys.stderr)
            return 2
        rows = [row for row in rows if row["id"] in wanted]
    groups = {
        "Hugging Face stacks": [r for r in rows if r["stack"] == "hf" and not r["exclusion"]],
        "Comparison: litgpt and torchtune model code": [
            r for r in rows if r["stack"] == "comparison" and not r["exclusion"]
        ],
        "Left out (the reason in the data; planned where the planner can)": [r for r in rows if r["exclusion"]],
    }
    if args.quick:
        groups = dict(list(groups.items())[:1])
    for title, members in groups.items():
        if not members:
            continue
        results = [evaluate(row) for row in members]
        print(f"\n{'### ' if args.markdown else ''}{title}\n")
        print("\n".join(table(results, args.markdown)))
        if not title.startswith("Left out"):
            print(
                "\nWorst error per statistic (predicted - published, % of published):" + ("\n" if args.markdown else "")
            )
            print("\n".join(worst_errors(results, "- " if args.markdown else "  ")))
            if title.startswith("Hugging Face") and (residue := loader_residue(results)):
                print(f"\n{'- ' if args.markdown else '  '}{residue}")
            for line in limit_lines(results):
                print(f"{'- ' if args.markdown else '  '}{line}")
        else:
            print("\nWhy each is left out:" + ("\n" if args.markdown else ""))
            print("\n".join(f"{'- ' if args.markdown else '  '}{r['id']}: {r['exclusion']}" for r in members))
    print(
        "\nalloc: a statistic compared with the allocated prediction (a plan without a GPU); trust grades: "
        + "; ".join(f"{k} {v}" for k, v in TRUST.items())
        + "."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
