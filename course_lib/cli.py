"""The `course-lib` command: a thin layer over the modules (docs/planner.md)."""

from __future__ import annotations

import argparse
import json
import re
import sys

from course_lib import validate
from course_lib.errors import UserError


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line that says what to do, and `--params -7e9` (or -1.5B, -inf)
    is a value to check, not an unknown option."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(
            r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?[kKmMbBtT]?$|^-(inf|nan)$", re.IGNORECASE
        )

    def error(self, message: str) -> None:
        raise UserError(f"{message} (see `{self.prog} --help`)")


def _check(args: argparse.Namespace) -> int:
    # off the import path: course_lib.device imports torch (a second): keeps the other commands light
    from course_lib.device import check_environment

    return 0 if check_environment() else 1


def _make_exercises(args: argparse.Namespace) -> int:
    # off the import path: course_lib.grading imports nbclient and nbformat (seconds): keeps `course-lib plan` light
    from course_lib.grading import write_exercises

    report = write_exercises(args.solutions, args.exercises, force=args.force)
    for line in report:
        print(line)
    return 1 if any(line.startswith("kept") for line in report) else 0


def _kernelspec(args: argparse.Namespace) -> int:
    # off the import path: course_lib.grading imports nbclient and nbformat (seconds): keeps `course-lib plan` light
    from course_lib.grading import set_kernelspecs

    for path in set_kernelspecs(args.folders):
        print(f"rewritten as JupyterLab saves it: {path}")
    return 0


def _grade(args: argparse.Namespace) -> int:
    # off the import path: course_lib.grading imports nbclient and nbformat (seconds): keeps `course-lib plan` light
    from course_lib.grading import grade

    return grade(
        args.notebooks,
        args.csv,
        reference_dir=args.reference,
        cell_timeout=args.timeout,
        notebook_timeout=args.notebook_timeout,
        jobs=args.jobs,
        only_errors=args.only_errors,
        as_recorded=args.as_recorded,
        junit_path=args.junit,
    )


def _checked(check, **options):
    """An argparse type: the text read as a number, then checked by `check` (course_lib.validate), whose
    one line says what to give instead."""

    def parse(text: str):
        try:
            value = int(text)
        except ValueError:
            try:
                value = float(text)
            except ValueError:
                value = text
        try:
            return check("VALUE", value, **options)
        except UserError as error:  # argparse names the option: "argument --batch: must be ..."
            raise argparse.ArgumentTypeError(str(error).removeprefix("VALUE ")) from None

    return parse


_POSITIVE_INT = _checked(validate.positive_int)


def _lora_targets(text: str) -> str | tuple[str, ...]:
    """--lora-targets: "all-linear", or module names separated by commas (peft's target_modules)."""
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    if not names:
        raise argparse.ArgumentTypeError("give module names separated by commas (e.g. q_proj,v_proj) or all-linear")
    return "all-linear" if names == ("all-linear",) else names


def _plan(args: argparse.Namespace) -> int:
    # off the import path: course_lib.planner imports torch (a second): keeps `course-lib grade` light
    from course_lib.planner import PlanError, plan_from_cli
    from course_lib.planner.config.recipes import RECIPES, describe  # the same: off the import path

    options = dict(
        precision=args.precision,
        optimizer=args.optimizer,
        lora_rank=args.lora_rank,
        lora_targets=args.lora_targets,
        lora_dropout=args.lora_dropout,
        autocast_adapter_dtype=args.autocast_adapter_dtype,
        quant=args.quant,
        batch=args.batch,
        seq=args.seq,
        checkpointing=args.checkpointing,
        accum=args.accum,
        attention=args.attention,
        loop=args.loop,
        legacy_causal_lm_loss=args.legacy_causal_lm_loss,
        empty_cache_each_step=args.empty_cache_each_step,
        gpus=args.gpus,
        shard=args.shard,
        fsdp_wrapping=args.fsdp_wrapping,
        fsdp_reduce_dtype=args.fsdp_reduce_dtype,
        fsdp_reshard_root=args.fsdp_reshard_root,
        fsdp_version=args.fsdp_version,
        fsdp_backward_prefetch=args.fsdp_backward_prefetch,
        fsdp_wrap_from=args.fsdp_wrap_from,
        optimizer_in_backward=args.optimizer_in_backward,
        chunked_loss=args.chunked_loss,
        offload_activations=args.offload_activations,
    )
    options["fsdp_reduce_dtype"] = None if options["fsdp_reduce_dtype"] == "compute" else options["fsdp_reduce_dtype"]
    recipe = {}
    if args.recipe is not None:
        if args.recipe not in RECIPES:
            raise UserError(f"--recipe {args.recipe!r} is not a recipe: give one of {', '.join(RECIPES)}")
        recipe = {key: value for key, value in RECIPES[args.recipe].items() if options.get(key) is None}
        options.update(recipe)
    try:
        result = plan_from_cli(args.model, params=args.params, gpu=args.gpu, **options)
    except PlanError as error:
        raise UserError(str(error)) from None
    if args.json:
        shown = result.to_dict()
        if args.recipe is not None:
            shown["recipe"] = {"name": args.recipe, "set": recipe}  # json writes a tuple as a list
        print(json.dumps(shown, indent=2))
    else:
        if args.recipe is not None:
            print(describe(args.recipe, recipe))
        print(result)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="course-lib", description="Memory tricks course: tools for learners and instructors.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    check = commands.add_parser("check", help="print OK/FAIL for each requirement of the course")
    check.set_defaults(run=_check)

    make = commands.add_parser("make-exercises", help="write exercises/ from solutions/ (never overwrites your work)")
    make.add_argument("--solutions", default="solutions", help="folder of solved notebooks (default: solutions)")
    make.add_argument("--exercises", default="exercises", help="folder to write (default: exercises)")
    make.add_argument("--force", action="store_true", help="overwrite exercises that were edited since generated")
    make.set_defaults(run=_make_exercises)

    grade = commands.add_parser("grade", help="run notebooks with the course's own check cells; PASS/FAIL per exercise")
    grade.add_argument(
        "notebooks",
        nargs="+",
        metavar="NOTEBOOK_OR_FOLDER",
        help="notebooks (.ipynb), or folders of them (e.g. one per learner); not modified",
    )
    grade.add_argument("--csv", metavar="FILE", help="also write a gradebook: one row per notebook and exercise")
    grade.add_argument(
        "--junit",
        metavar="FILE",
        help="also write a JUnit XML report, one test case per notebook "
        "and exercise (for a course's CI or a classroom autograder)",
    )
    grade.add_argument(
        "--as-recorded",
        action="store_true",
        help="grade a notebook whose recorded exercise is of another lesson than its file name says "
        "as the exercise it records (by default it is a FAIL)",
    )
    grade.add_argument(
        "--reference",
        metavar="DIR",
        help="the instructor's copy the setup and check cells come "
        "from: a folder of the course's exercises or solutions (default: the course's solutions/)",
    )
    grade.add_argument(
        "--timeout",
        type=_checked(validate.positive),
        default=300,
        metavar="SECONDS",
        help="the longest a cell may run (default 300)",
    )
    grade.add_argument(
        "--notebook-timeout",
        type=_checked(validate.positive),
        default=1800,
        metavar="SECONDS",
        help="the longest a whole notebook may run, once its kernel is up (default 1800)",
    )
    grade.add_argument(
        "--jobs",
        type=_POSITIVE_INT,
        metavar="N",
        help="grade N notebooks at once, each in its own kernel (default: what this machine can "
        "run, by its CPU cores or its available memory, whichever binds)",
    )
    grade.add_argument(
        "--only-errors",
        action="store_true",
        help="grade again only the notebooks whose rows in the --csv gradebook say ERROR (the "
        "grader could not start a kernel), and put their new rows in its place",
    )
    grade.set_defaults(run=_grade)

    kernelspec = commands.add_parser(
        "kernelspec",
        help="write notebooks as JupyterLab saves them, so that "
        "opening and saving one changes nothing (for maintainers, after a merge)",
    )
    kernelspec.add_argument(
        "folders",
        nargs="*",
        default=["notebooks", "solutions"],
        metavar="FOLDER",
        help="folders of notebooks (default: notebooks solutions)",
    )
    kernelspec.set_defaults(run=_kernelspec)

    plan = commands.add_parser("plan", help="predict the memory of a training step and whether it fits a GPU")
    plan.add_argument(
        "model",
        nargs="?",
        metavar="MODEL_OR_CONFIG",
        help="a bundled model (e.g. llama-3.1-8b), a config.json or its folder; or use --params",
    )
    plan.add_argument("--params", help="a raw parameter count, e.g. 7e9 (activations are then unknown)")
    plan.add_argument(
        "--recipe",
        metavar="NAME",
        help="a preset that sets several options at once: full, lora, qlora, qlora-t4 (lesson 5's) or "
        "fsdp-qlora (Answer.AI's); it prints what it set, and an option given beside it overrides "
        "(docs/planner.md)",
    )
    plan.add_argument("--json", action="store_true", help="print a JSON object (bytes by category)")
    model = plan.add_argument_group("the model")
    precision = plan.add_argument_group("precision and optimizer")
    adapters = plan.add_argument_group("adapters and quantization (LoRA, QLoRA)")
    step = plan.add_argument_group("the step: batch, sequence, loop")
    activations = plan.add_argument_group("activations: checkpointing and lesson 7's tricks")
    target = plan.add_argument_group("the target GPU, and GPUs training together (lesson 6)")
    precision.add_argument(
        "--precision",
        choices=(
            "fp32",
            "bf16",
            "fp16",
            "mixed-bf16",
            "mixed-fp16",
            "mixed-bf16-fp32grads",
            "mixed-fp16-fp32grads",
            "amp-bf16",
            "amp-fp16",
        ),
        help="bf16/fp16: pure 16-bit; mixed-*: 16-bit weights and gradients with an fp32 master copy "
        "(ZeRO/Megatron); mixed-*-fp32grads: Megatron's fp32 main gradients too (18 and 20 bytes "
        "a parameter with Adam); amp-*: the Trainer's bf16=True/fp16=True, fp32 weights and gradients "
        "with torch.autocast. Default with --gpu: amp-bf16 (amp-fp16 on a GPU without bf16), "
        "the Trainer's; without --gpu or with --gpus: mixed-bf16 (mixed-fp16); the base's dtype "
        "for --quant",
    )
    precision.add_argument(
        "--optimizer",
        choices=(
            "sgd",
            "momentum",
            "adamw",
            "adamw_fused",
            "adamw8bit",
            "paged_adamw8bit",
            "paged_adamw32bit",
            "adafactor",
            "lion",
        ),
        help="default: adamw (torch's)",
    )
    adapters.add_argument(
        "--lora-rank",
        type=_checked(validate.non_negative_int),
        metavar="R",
        help="train LoRA adapters of rank R (default 0: a full fine-tune)",
    )
    adapters.add_argument(
        "--lora-targets",
        type=_lora_targets,
        metavar="NAMES",
        help="modules that get adapters, comma-separated (e.g. q_proj,v_proj; default all-linear: "
        "every linear layer but the output layer)",
    )
    adapters.add_argument(
        "--lora-dropout",
        type=_checked(validate.probability, below_one=True),
        metavar="P",
        help="peft's lora_dropout (default 0.0, peft's; the QLoRA paper used 0.05 and 0.1)",
    )
    adapters.add_argument(
        "--no-autocast-adapter-dtype",
        dest="autocast_adapter_dtype",
        action="store_false",
        default=None,
        help="adapters in the base's dtype, as peft made them before 0.11 (default: "
        "get_peft_model's autocast_adapter_dtype=True, fp32 adapters)",
    )
    adapters.add_argument("--quant", choices=("none", "nf4", "nf4-dq"), help="4-bit base (QLoRA; default none)")
    # no argparse defaults for what --params cannot use: the planner tells given options from defaults
    step.add_argument("--batch", type=_POSITIVE_INT, help="micro-batch size (default 1)")
    step.add_argument("--seq", type=_POSITIVE_INT, help="sequence length in tokens (default 512)")
    activations.add_argument(
        "--checkpointing",
        metavar="PLAN",
        help="none (default), every-layer, sqrt, every-K (e.g. every-2) or hf-every-K "
        "(Hugging Face's every_n_layers=K)",
    )
    step.add_argument("--accum", type=_POSITIVE_INT, help="gradient accumulation steps (default 1)")
    model.add_argument("--attention", choices=("sdpa", "eager"), help="attention kernel (default sdpa)")
    step.add_argument(
        "--loop",
        choices=("trainer", "keep-outputs", "outputs-until-step"),
        help="trainer (default): only the loss is kept; keep-outputs: `outputs = model(**batch)` "
        "keeps the logits alive through backward, the step and the next forward; "
        "outputs-until-step: released after the step",
    )
    model.add_argument(
        "--legacy-causal-lm-loss",
        action="store_true",
        default=None,
        help="the loss as transformers before 4.46 computed it: fp32 logits returned, the shifted logits copied",
    )
    step.add_argument(
        "--empty-cache-each-step",
        action="store_true",
        default=None,
        help="the loop calls torch.cuda.empty_cache() after each step (changes the reserved memory)",
    )
    # lesson 7's tricks
    activations.add_argument(
        "--optimizer-in-backward",
        action="store_true",
        default=None,
        help="step each parameter in backward and free its gradient there (no accumulation)",
    )
    activations.add_argument(
        "--chunked-loss",
        type=_POSITIVE_INT,
        metavar="TOKENS",
        help="output layer and loss computed TOKENS tokens at a time, recomputed in backward",
    )
    activations.add_argument(
        "--offload-activations",
        action="store_true",
        default=None,
        help="what autograd saves goes to host memory (torch's save_on_cpu)",
    )
    target.add_argument(
        "--gpu",
        help="a GPU for the fit verdict: t4, l4, a10g, a100-40gb, a100-80gb, h100-80gb, "
        "h200, rtx3090, rtx4090, l40s, a6000, v100-16gb",
    )
    target.add_argument(
        "--gpus",
        type=_POSITIVE_INT,
        metavar="N",
        help="N GPUs train together (data parallel); the plan is one GPU's share, --batch per GPU (lesson 6)",
    )
    target.add_argument(
        "--shard",
        metavar="STAGE",
        help="what the N GPUs partition: none (DDP, default), zero1 "
        "(optimizer state), zero2 (+ gradients), zero3 (+ weights)",
    )
    target.add_argument(
        "--fsdp-wrapping",
        choices=("blocks", "torchtitan"),
        help="zero2/zero3: blocks (default: each decoder layer, then the root) or torchtitan "
        "(embeddings, each layer, [norm, output], then the root)",
    )
    target.add_argument(
        "--fsdp-reduce-dtype",
        choices=("compute", "fp32"),
        help="zero2/zero3: the dtype the gradients are reduce-scattered in: compute (default, FSDP2's) or "
        "fp32 (torchtitan's)",
    )
    target.add_argument(
        "--fsdp-reshard-root",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="zero3: reshard the root after forward too (the course's zero3, default: 3 P sent); "
        "--no-fsdp-reshard-root keeps it gathered (FSDP2's default)",
    )
    target.add_argument(
        "--fsdp-version",
        type=int,
        choices=(1, 2),
        help="zero2/zero3: 2 (FSDP2, default) or 1 (accelerate's FSDP1, the Trainer's FSDP recipes)",
    )
    target.add_argument(
        "--fsdp-backward-prefetch",
        action="store_true",
        default=None,
        help="--fsdp-version 1: BACKWARD_PRE, FullyShardedDataParallel's own default (accelerate's: none)",
    )
    target.add_argument(
        "--fsdp-wrap-from",
        choices=("cpu", "cpu-broadcast"),
        help="FSDP1 (or --shard none: its NO_SHARD) wraps a model on the CPU, which leaves blocks "
        "cached before the first step; cpu-broadcast: with sync_module_states (accelerate's "
        "cpu_ram_efficient_loading). Changes the reserved memory",
    )
    plan.set_defaults(run=_plan)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return args.run(args)
    except UserError as error:
        print(f"course-lib: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
