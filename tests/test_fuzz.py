"""Adversarial arguments (wrong types, NaN, inf, negative, zero, huge, empty, strings for lists, lists for
strings) to the CLI and to the public API of each package: every call ends in a result that passes the
function's own invariants, or in the library's error class (`UserError`) with a one-line message; never a
raw exception from a dependency, never a silent NaN (issue 29, docs/planner.md "Bad input").

Deterministic (derandomize) and small: the functions that train or spawn processes are called so that
their validation answers first (the spawn itself is replaced by a stub that says it was reached).
"""

import functools
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from course_lib import accumulation, checkpointing, paging, planner, qlora, sharding, toolbox, validate
from course_lib.cli import main
from course_lib.errors import UserError
from course_lib.measure import measure_step

FUZZ = settings(
    max_examples=15,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

# The values a user gets wrong, and random ones of every type.
CORNERS = [
    None,
    True,
    False,
    0,
    -1,
    1,
    2,
    -7e9,
    1e30,
    10**20,
    0.5,
    1.5,
    math.nan,
    math.inf,
    -math.inf,
    "",
    "no",
    "off",
    "7",
    "c_attn",
    "zero3",
    [],
    [1, 2],
    ["a"],
    {},
    {"batch": 2},
    (),
    b"x",
]
VALUES = st.one_of(
    st.sampled_from(CORNERS),
    st.integers(-(10**12), 10**12),
    st.floats(allow_nan=True),
    st.text(max_size=6),
    st.lists(st.one_of(st.integers(-3, 3), st.text(max_size=3)), max_size=3),
)


def outcome(call, check=lambda result: None):
    """Run `call()`: a UserError with one line, or a result that passes `check`."""
    try:
        result = call()
    except UserError as error:
        message = str(error)
        assert message and "\n" not in message and len(message) < 600, repr(message)
        return None
    check(result)
    return result


def finite_numbers(values) -> None:
    for value in values:
        assert isinstance(value, (int, float)) and math.isfinite(value), values


def good_plan(result) -> None:
    finite_numbers(result.bytes.values())
    assert all(value >= 0 for value in result.bytes.values()), result.bytes
    assert result.total >= result.bytes["weights"] and result.n_params >= result.trainable_params >= 0


# ------------------------------------------------------------------ the CLI

PLAN_OPTIONS = [
    "--params",
    "--batch",
    "--seq",
    "--accum",
    "--lora-rank",
    "--lora-dropout",
    "--gpus",
    "--shard",
    "--checkpointing",
    "--chunked-loss",
    "--gpu",
    "--precision",
    "--optimizer",
    "--quant",
]
TEXTS = st.one_of(
    st.sampled_from(
        ["0", "-1", "-7e9", "1e30", "nan", "inf", "-inf", "1.5", "", "no", "7B", "2", "zero3", "every-2", "t4"]
    ),
    st.text(max_size=6),
)


@FUZZ
@given(option=st.sampled_from(PLAN_OPTIONS), text=TEXTS)
def test_plan_command(capsys, option, text):
    # a shape option with a bare count is refused, whatever its value: that is one line too
    args = ["plan", "--params", text] if option == "--params" else ["plan", "--params", "1e9", option, text]
    code = main(args)
    out, err = capsys.readouterr()
    assert code in (0, 2), (args, code, err)
    if code == 2:
        assert out == "" and err.count("\n") == 1 and err.startswith("course-lib: error: "), (args, err)
    else:
        assert err == "" and out and "nan" not in out.lower(), (args, out)


@settings(FUZZ, max_examples=8)  # each valid value traces the model (under a second)
@given(option=st.sampled_from(["--batch", "--seq", "--accum", "--chunked-loss", "--lora-dropout"]), text=TEXTS)
def test_plan_command_of_a_model(capsys, tiny_config, option, text):
    extra = ["--lora-rank", "4"] if option == "--lora-dropout" else []
    code = main(["plan", tiny_config, *extra, option, text])
    out, err = capsys.readouterr()
    assert code in (0, 2) and (code == 0) == (err == ""), (option, text, err)
    assert code == 0 or err.count("\n") == 1


@FUZZ
@given(option=st.sampled_from(["--timeout", "--notebook-timeout", "--jobs"]), text=TEXTS)
def test_grade_command_options(capsys, tmp_path, option, text):
    code = main(["grade", str(tmp_path / "missing.ipynb"), option, text])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1, (option, text, err)


# ------------------------------------------------------------------ memory, qlora


@pytest.mark.parametrize("field", sorted(planner.Setup.__dataclass_fields__))
@FUZZ
@given(value=VALUES)
def test_plan_of_a_count_with_any_setup_field(field, value):
    outcome(lambda: planner.plan(10**9, **{field: value}), good_plan)


@FUZZ
@given(
    field=st.sampled_from(["batch", "seq", "accum", "checkpointing", "chunked_loss", "lora_targets", "gpus"]),
    value=VALUES,
)
def test_plan_of_a_model_with_a_shape_field(tiny_config, field, value):
    options = {"lora_rank": 4} if field == "lora_targets" else {"shard": "zero3"} if field == "gpus" else {}
    outcome(lambda: planner.plan(tiny_config, **options, **{field: value}), good_plan)


@FUZZ
@given(model=VALUES, gpu=st.one_of(st.none(), VALUES))
def test_plan_of_any_model_and_gpu(model, gpu):
    outcome(lambda: planner.plan(model, gpu=gpu, precision="fp32"), good_plan)


@pytest.mark.parametrize("field", sorted(qlora.Recipe.__dataclass_fields__))
@FUZZ
@given(value=VALUES)
def test_recipe_fields(field, value):
    outcome(lambda: qlora.Recipe(**{field: value}).validate(), lambda recipe: recipe.describe())


# ------------------------------------------------------------------ paging


@FUZZ
@given(argument=st.sampled_from(["context", "prefetch_efficiency", "flops"]), value=VALUES)
def test_t4_hardware(argument, value):
    def check(hardware):
        assert hardware.h2d_bandwidth <= hardware.link_bandwidth and hardware.memory > 0

    outcome(lambda: paging.Hardware.t4(**{argument: value}), check)


@FUZZ
@given(value=VALUES)
def test_simulate_any_trace(value):
    outcome(lambda: paging.simulate(value), lambda result: finite_numbers([result.peak_used]))


@FUZZ
@given(tokens=VALUES, setup=st.sampled_from(["setup", {"params": []}, None, 3]))
def test_simulate_offload(tokens, setup):
    real = paging.TrainingSetup(paging.transformer_params(2, 32, 64))
    chosen = real if setup == "setup" else setup

    def check(result):
        finite_numbers([result.total, result.device_peak])
        assert result.total >= 0 and result.device_peak >= 0

    outcome(lambda: paging.simulate_offload(chosen, tokens), check)


@FUZZ
@given(argument=st.sampled_from([0, 1, 2]), value=VALUES)
def test_transformer_params(argument, value):
    args = [2, 32, 64]
    args[argument] = value
    outcome(
        lambda: paging.TrainingSetup(paging.transformer_params(*args)), lambda setup: finite_numbers([setup.n_params])
    )


# ------------------------------------------------------------------ toolbox, accumulation, checkpointing


@FUZZ
@given(argument=st.sampled_from(["chunk_size", "num_items_in_batch", "labels", "hidden"]), value=VALUES)
def test_chunked_cross_entropy(argument, value):
    arguments = {
        "hidden": torch.randn(1, 4, 8),
        "weight": torch.randn(10, 8),
        "labels": torch.randint(0, 10, (1, 4)),
        "chunk_size": 2,
    }
    arguments[argument] = value

    def check(loss):
        assert torch.isfinite(loss) and loss >= 0

    outcome(lambda: toolbox.chunked_cross_entropy(**arguments), check)


@FUZZ
@given(value=VALUES)
def test_accumulation_breaks_with_any_batches(value):
    outcome(
        lambda: toolbox.accumulation_breaks(
            lambda: torch.nn.Linear(2, 2), value, lambda p: torch.optim.SGD(p, lr=0.1), lambda m, b: m(b).sum()
        ),
        lambda report: finite_numbers(report.values()),
    )


@FUZZ
@given(value=VALUES)
def test_accumulation_steps_and_loops(value):
    def steps(k):
        assert type(k) is int and k == value >= 1, (value, k)

    def loop(cls):  # the reference loop only for no mistake at all, a broken one only for its name
        assert issubclass(cls, accumulation.AccumulationLoop), cls
        expected = (
            accumulation.AccumulationLoop
            if value in ((), [])
            else accumulation.BROKEN_LOOPS.get(
                value[0] if isinstance(value, (list, tuple)) and len(value) == 1 else value
            )
        )
        assert cls is expected, (value, cls)

    outcome(lambda: accumulation.check_accumulation_steps(value), steps)
    outcome(lambda: accumulation.loop_class(value), loop)


@FUZZ
@given(argument=st.sampled_from(["accumulation_steps", "batches", "max_grad_norm", "empty_window"]), value=VALUES)
def test_train_with_accumulation(argument, value):
    model = accumulation.TinyTokenLM(seed=0)
    arguments = {"batches": accumulation.padded_token_batches(2, batch_size=2), "accumulation_steps": 2}
    arguments[argument] = value
    outcome(
        lambda: accumulation.train_with_accumulation(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            loss=accumulation.TokenLoss(),
            progress=False,
            **arguments,
        ),
        lambda result: finite_numbers(result.losses),
    )


@FUZZ
@given(value=VALUES.filter(lambda v: not (isinstance(v, str) and v in accumulation.BROKEN_LOOPS)))
def test_demonstrate_mistakes_refuses_what_names_no_mistake(value):
    if value in (None, [], ()):  # None: every mistake, which trains each (lesson 2's own call)
        return
    with pytest.raises(UserError):
        accumulation.demonstrate_mistakes(value)


@FUZZ
@given(layers=VALUES, name=VALUES)
def test_named_checkpointing_plans(layers, name):
    def check(plan):
        assert all(0 <= start < end <= layers for start, end in plan)

    outcome(lambda: checkpointing.named_plan(layers, name), check)


# ------------------------------------------------------------------ sharding, measure, validate


def _spawned(*args, **kwargs):
    raise _Reached


class _Reached(Exception):
    """The stub of run_ranks: validation let the call through to the spawn."""


@FUZZ
@given(
    argument=st.sampled_from(["world_size", "stages", "batch", "seq", "micro_batches", "skip_sync", "repeats"]),
    value=VALUES,
)
def test_measure_sharding_validates_before_spawning(monkeypatch, argument, value):
    monkeypatch.setattr(sharding.measuring, "run_ranks", _spawned)
    arguments = {"world_size": 2, argument: value}
    try:
        outcome(
            lambda: sharding.measure_sharding(
                functools.partial(checkpointing.tiny_decoder, "llama", n_layers=2), **arguments
            )
        )
    except _Reached:
        pass


@FUZZ
@given(
    argument=st.sampled_from(["variants", "world_size", "n_micro", "accumulation_steps", "rows_per_rank"]), value=VALUES
)
def test_ddp_demo_validates_before_spawning(monkeypatch, argument, value):
    monkeypatch.setattr(accumulation.crosschecks, "run_ranks", _spawned)
    try:
        outcome(lambda: accumulation.ddp_accumulation_demo(**{argument: value}))
    except _Reached:
        pass


@FUZZ
@given(
    model=st.sampled_from(["meta", "module", "no parameters", None, "text"]),
    optimizer=st.sampled_from(["own", "other", None, "text"]),
)
def test_measure_step_inputs(model, optimizer):
    built = {
        "meta": torch.nn.Linear(2, 2, device="meta"),
        "module": torch.nn.Linear(2, 2),
        "no parameters": torch.nn.ReLU(),
        None: None,
        "text": "model",
    }[model]
    params = built.parameters() if isinstance(built, torch.nn.Module) and model != "no parameters" else None
    opt = {
        "own": torch.optim.SGD(params, lr=0.1) if params is not None else None,
        "other": torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1),
        None: None,
        "text": "adam",
    }[optimizer]
    outcome(
        lambda: measure_step(built, opt, lambda: built(torch.ones(1, 2)).sum()),
        lambda step: finite_numbers([step.peak, step.parameters]),
    )


@FUZZ
@given(value=VALUES)
def test_the_checks_themselves(value):
    """Each check refuses in one line or returns what it promises, of the value given."""

    def real(x) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

    promises = {
        validate.positive_int: lambda n: type(n) is int and n == value and n >= 1,  # never a bool
        validate.non_negative_int: lambda n: type(n) is int and n == value and n >= 0,
        validate.positive: lambda x: real(x) and x > 0,
        validate.probability: lambda x: real(x) and 0 <= x <= 1,
        validate.strict_bool: lambda b: b is value,
        validate.strings: lambda items: (
            type(items) is tuple and len(items) > 0 and all(isinstance(item, str) and item for item in items)
        ),
        validate.non_empty: lambda items: type(items) is list and len(items) > 0,
    }
    for check, promise in promises.items():

        def kept(result, check=check, promise=promise):
            assert promise(result), (check.__name__, value, result)

        outcome(lambda: check("x", value), kept)
    outcome(lambda: validate.choice("x", value, ("a", "b")), lambda result: result in ("a", "b"))


# ------------------------------------------------------------------ more of each package's public functions


def _non_negative(result) -> None:
    values = result if isinstance(result, (tuple, list)) else [result]
    finite_numbers(values)
    assert all(value >= 0 for value in values), result


ONE_ARGUMENT = {
    "planner.get_gpu": (lambda v: planner.get_gpu(v), lambda gpu: gpu.memory_bytes > 0),
    "planner.nf4_bytes": (lambda v: planner.nf4_bytes(v, True), _non_negative),
    "planner.korthikanti_bytes": (lambda v: planner.korthikanti_bytes(v, 64, 32, 2, 2), _non_negative),
    "planner.what_makes_it_fit": (lambda v: planner.what_makes_it_fit(10**9, v, planner.get_gpu("t4")), None),
    "planner.optimizer_state_bytes": (lambda v: planner.optimizer_state_bytes(v, [10, 20], 4), _non_negative),
    "toolbox.transfer_seconds": (lambda v: toolbox.transfer_seconds(v, v), _non_negative),
    "checkpointing.segments_plan": (lambda v: checkpointing.segments_plan(4, v), None),
    "checkpointing.validate_plan": (lambda v: checkpointing.validate_plan(v, 4), None),
    "paging.bnb_estimate_ms": (lambda v: paging.bnb_estimate_ms(v), _non_negative),
    "paging.block_bytes": (lambda v: paging.block_bytes(v), _non_negative),
    "paging.sweep_faults": (lambda v: paging.sweep_faults(v, 2), _non_negative),
    "accumulation.padded_token_batches": (
        lambda v: accumulation.padded_token_batches(v, batch_size=2) if not isinstance(v, int) or v < 50 else [],
        None,
    ),
    "accumulation.split_batch": (lambda v: accumulation.split_batch(accumulation.regression_batches(1)[0], v), None),
    "accumulation.tiny_mlp": (lambda v: accumulation.tiny_mlp(v), None),
    "qlora.Recipe.without": (lambda v: qlora.Recipe().without(v), lambda recipe: recipe.validate()),
}


@pytest.mark.parametrize("name", sorted(ONE_ARGUMENT))
@FUZZ
@given(value=VALUES)
def test_one_argument_of_each_package(name, value):
    call, check = ONE_ARGUMENT[name]
    outcome(lambda: call(value), check or (lambda result: None))
