"""What every exercise check shares (course_lib/checks/hints.py): a hint in one block, no check source,
and refusing an answer that only calls the library's own implementation (lessons 0 and 1 use it)."""

import math
import re
import traceback
from pathlib import Path

import pytest
import torch

import course_lib
import course_lib.checks
from course_lib import checks
from course_lib.checks import CheckFailed, hints_only, refuse_reference
from course_lib.checks.adam import CATEGORIES
from course_lib.measure import measure_step
from course_lib.planner import optimizer_state_bytes, plan

CHECKS_DIR = str(Path(course_lib.checks.__file__).parent)


def test_every_check_of_every_lesson_gives_hints_only():
    names = [name for name in dir(checks) if name.startswith("check_")]
    assert len(names) >= 6 and all(getattr(checks, name).__wrapped__ for name in names)


def test_a_failed_check_shows_its_hint_as_one_block_without_source_or_paths():
    with pytest.raises(CheckFailed) as failed:
        checks.check_model_state_bytes(lambda n, p, o: right_model_state_bytes(n, p, o, weights=lambda n, p, o: 3 * n))
    shown = failed.value._render_traceback_()  # what IPython prints instead of a traceback
    assert len(shown) == 1 and "weights 3 B (3 B/param), expected 4" in shown[0]
    assert ".py" not in shown[0] and "raise" not in shown[0] and "master copy" not in shown[0]  # another hint
    assert failed.value.__cause__ is None and failed.value.__suppress_context__


def test_the_learners_own_error_keeps_the_learners_frames_and_not_the_checks():
    def answer(n, precision, optimizer):
        return {}[precision]  # a KeyError in the learner's code

    with pytest.raises(KeyError) as raised:
        checks.check_model_state_bytes(answer)
    files = [frame.filename for frame in traceback.extract_tb(raised.value.__traceback__)]
    assert __file__ in files and not any(f.startswith(CHECKS_DIR) and not f.endswith("hints.py") for f in files)
    with pytest.raises(checks.CheckFailed) as raised:  # an unsolved exercise says so in one line
        checks.check_saved_bytes(lambda *a: (_ for _ in ()).throw(NotImplementedError()))
    assert raised.value._render_traceback_() == [f"\x1b[31mNot yet:\x1b[0m {checks.NOT_DONE}"]


def test_a_count_of_the_wrong_type_is_named_not_shown_as_a_number():
    def as_text(model):
        return str(8 * sum(p.numel() for p in model.parameters()))

    with pytest.raises(
        CheckFailed, match=r"adam_state_bytes returned '\d+', a str: return the number of bytes as an int"
    ):
        checks.check_adam_state_bytes(as_text)
    with pytest.raises(CheckFailed, match="a bool"):
        checks.check_saved_bytes(lambda batch, widths: True)


def test_hints_only_keeps_a_passing_checks_result():
    assert hints_only(lambda x: x + 1)(1) == 2


def test_refuse_reference_sees_a_call_however_it_was_imported():
    import course_lib.planner as planner
    from course_lib.planner import plan as renamed

    for answer in (lambda: renamed(10).total, lambda: planner.plan(10).total, lambda: [plan][0](10).total):
        with pytest.raises(
            CheckFailed, match=r"calls course_lib\.planner\.entry\.plan, the course library's own answer"
        ):
            with refuse_reference(planner, instead="add it up"):
                answer()
    with refuse_reference(planner):
        assert sum(range(4)) == 6  # no call into the reference: nothing to refuse


def test_refuse_reference_names_functions_and_refuses_even_when_the_answer_then_raises():
    from course_lib.checks import refusing
    from course_lib.paging import chunk_migrations

    def answer():
        chunk_migrations([0, 1], 1, "lru")
        raise ValueError("the learner's own error")

    with pytest.raises(CheckFailed, match=r"calls course_lib\.paging\.simulator\.chunk_migrations"):
        refusing(answer, chunk_migrations)()
    assert refusing(lambda a, b: a + b, chunk_migrations)(2, 3) == 5  # a call that stays clear is passed through


@pytest.mark.parametrize(
    "check, answer",
    [
        (
            "check_checkpointed_forward",
            lambda layers, x, plan: __import__("course_lib.checkpointing").checkpointing.checkpointed_forward(
                layers, x, plan
            ),
        ),
        (
            "check_best_plan",
            lambda saved, inputs, budget: (
                __import__("course_lib.checkpointing").checkpointing.optimal_plan(saved, inputs, budget).plan
            ),
        ),
        (
            "check_migrated_bytes",
            lambda accesses, capacity, policy: __import__("course_lib.paging").paging.chunk_migrations(
                accesses, capacity, policy
            ),
        ),
        (
            "check_step3_prediction",
            lambda: {
                k: checks.paging._step3_in(k == "with empty_cache") for k in ("with empty_cache", "without empty_cache")
            },
        ),
    ],
    ids=lambda value: value if isinstance(value, str) else "",
)
def test_lesson_checks_refuse_an_answer_that_calls_the_library(check, answer):
    with pytest.raises(CheckFailed, match="the course library's own answer"):
        getattr(checks, check)(answer)


def right_model_state_bytes(n, precision, optimizer, **wrong):
    """Exercise 1.1's answer by category; `wrong` replaces a category: name=lambda n, precision, optimizer: bytes."""
    weight = 4 if precision == "fp32" else 2
    state = 2 if precision == "bf16" else 4
    answer = {
        "weights": weight * n,
        "gradients": weight * n,
        "optimizer_state": {"sgd": 0, "momentum": 1, "adamw": 2}[optimizer] * state * n,
        "master_weights": 4 * n if precision.startswith("mixed") else 0,
    }
    answer.update({category: bytes_of(n, precision, optimizer) for category, bytes_of in wrong.items()})
    return answer


def right_8bit(numel):
    return 8 * numel if numel < 4096 else 2 * (numel + 4 * math.ceil(numel / 256))


def right_adam_state(model):
    return sum(2 * p.numel() * p.element_size() + 4 for p in model.parameters() if p.requires_grad)


def adam_state_measured(model):
    x = torch.randn(2, *next(model.parameters()).shape[1:]) if isinstance(model, torch.nn.Linear) else None
    return measure_step(
        model, torch.optim.AdamW(model.parameters()), lambda: model(x).sum(), inputs=[x]
    ).optimizer_state


def paging_8bit(numel):
    from course_lib.paging.trace import ParamSpec, optimizer_state

    return sum(t.nbytes for t in optimizer_state(ParamSpec("w", numel), "adamw8bit"))


@pytest.mark.parametrize(
    "check, copied, right",
    [
        (
            checks.check_model_state_bytes,
            lambda n, p, o: {c: plan(n, precision=p, optimizer=o).bytes[c] for c in CATEGORIES},
            right_model_state_bytes,
        ),
        (checks.check_adamw8bit_state_bytes, lambda n: optimizer_state_bytes("adamw8bit", [n], 4), right_8bit),
        (checks.check_adamw8bit_state_bytes, paging_8bit, right_8bit),  # the same layout, in another package
        (checks.check_adam_state_bytes, adam_state_measured, right_adam_state),
        (checks.check_saved_bytes, lambda b, widths: plan(1000).total, lambda b, widths: 4 * b * sum(widths[:-1])),
    ],
    ids=["1.1", "1.2", "1.2-paging", "0.1", "0.2"],
)
def test_lessons_0_and_1_refuse_an_answer_that_calls_the_library_and_accept_one_that_works_it_out(check, copied, right):
    with pytest.raises(CheckFailed, match="the course library's own answer"):
        check(copied)
    check(right)


def test_refusing_the_whole_library_names_the_module_called_and_never_the_checks_own_code():
    from course_lib.paging.trace import ParamSpec, optimizer_state

    with pytest.raises(CheckFailed, match=r"calls course_lib\.paging\.trace\.optimizer_state,"):
        with refuse_reference(course_lib):
            optimizer_state(ParamSpec("w", 10), "adamw")
    with refuse_reference(course_lib):
        assert checks.adam._layout_hint(right_model_state_bytes(10, "fp32", "sgd"), 10, "fp32", "sgd") is None


@pytest.mark.parametrize(
    "answer, hint",
    [
        (lambda m: sum(8 * p.numel() + 4 for p in m.parameters() if p.requires_grad), "2 in bf16 or fp16"),  # fp32 only
        (lambda m: sum(8 * p.numel() + 4 for p in m.parameters()), "2 in bf16 or fp16"),
        (
            lambda m: sum(2 * p.numel() * p.element_size() + 4 for p in m.parameters()),
            "frozen parameter",
        ),  # the old solution
        (lambda m: sum(2 * p.numel() * p.element_size() for p in m.parameters() if p.requires_grad), "'step' counter"),
        (
            lambda m: sum(
                2 * p.numel() * p.element_size() + p.element_size() for p in m.parameters() if p.requires_grad
            ),
            r"float32 scalar \(4 bytes\) whatever the parameter's dtype",
        ),
        (
            lambda m: sum(
                2 * p.numel() * p.element_size() + 4
                for _, p in m.named_parameters(remove_duplicate=False)
                if p.requires_grad
            ),
            "shared by two layers",
        ),
        (
            lambda m: sum(3 * p.numel() * p.element_size() + 4 for p in m.parameters() if p.requires_grad),
            "exp_avg and exp_avg_sq take the parameter's",
        ),
    ],
)
def test_exercise_0_1_fails_plausible_wrong_answers_with_their_hint(answer, hint):
    with pytest.raises(CheckFailed, match=hint):
        checks.check_adam_state_bytes(answer)


@pytest.mark.parametrize(
    "answer, hint",
    [
        (lambda b, w: 4 * b * (w[0] + w[1]), "every hidden layer's ReLU output"),  # lesson 0's one-hidden-layer count
        (lambda b, w: 4 * b * (w[0] + 2 * sum(w[1:-1])), "one storage"),  # ReLU's output counted twice
        (lambda b, w: 4 * b * sum(w), "last Linear's output is not saved"),
        (lambda b, w: 4 * b * sum(w[1:-1]), "saves its input x"),
        (lambda b, w: b * sum(w[:-1]), "return bytes"),
        (lambda b, w: 4 * sum(w[:-1]), "multiply by the batch"),
        (lambda b, w: 4 * b * sum(w[:-1]) + sum(4 * (i + 1) * o for i, o in zip(w, w[1:])), "Weights are parameters"),
    ],
)
def test_exercise_0_2_fails_plausible_wrong_answers_with_their_hint(answer, hint):
    with pytest.raises(CheckFailed, match=hint):
        checks.check_saved_bytes(answer)


def _mixed(value):
    return lambda n, p, o: value * n if p == "mixed-bf16" else right_model_state_bytes(n, p, o)["weights"]


@pytest.mark.parametrize(
    "wrong, hint, not_hint",
    [
        (
            dict(weights=_mixed(4), gradients=_mixed(4), master_weights=lambda n, p, o: 0),
            "torch AMP's layout",
            r"you left out",
        ),
        (dict(master_weights=lambda n, p, o: 0), "left out the fp32 master copy", "AMP"),
        (dict(weights=_mixed(4)), "the fp32 copy is master_weights", "AMP"),
        (dict(gradients=_mixed(4)), "18 B/param", "AMP"),
        (
            dict(
                optimizer_state=lambda n, p, o: {"sgd": 0, "momentum": 1, "adamw": 2}[o] * 4 * n
            ),  # pure bf16, fp32 state
            "in pure bf16, torch keeps the optimizer state in the parameter's dtype",
            "ONE buffer",
        ),
        (
            dict(
                optimizer_state=lambda n, p, o: {"sgd": 0, "momentum": 2, "adamw": 2}[o] * (2 if p == "bf16" else 4) * n
            ),
            "ONE buffer",
            "pure bf16",
        ),
        (
            dict(
                optimizer_state=lambda n, p, o: {"sgd": 0, "momentum": 1, "adamw": 2}[o] * (4 if p == "fp32" else 2) * n
            ),
            "the optimizer state is fp32",
            "ONE buffer",
        ),
        (dict(optimizer_state=lambda n, p, o: 4 * n), "plain SGD keeps no state", "ONE buffer"),
        (dict(master_weights=lambda n, p, o: 4 * n), "has no master copy", "AMP"),
    ],
)
def test_exercise_1_1_tells_the_layouts_apart_with_a_hint_right_for_each(wrong, hint, not_hint):
    with pytest.raises(CheckFailed, match=hint) as failed:
        checks.check_model_state_bytes(lambda n, p, o: right_model_state_bytes(n, p, o, **wrong))
    assert not re.search(not_hint, str(failed.value))


@pytest.mark.parametrize(
    "answer, hint",
    [
        (
            lambda n, p, o: 16 * n,
            "return a dict",
        ),  # one total: torch AMP's 4 + 4 + 8 and the master copy's 2 + 2 + 8 + 4
        (lambda n, p, o: {"weights": 4 * n}, "give exactly weights, gradients, optimizer_state, master_weights"),
    ],
)
def test_exercise_1_1_asks_for_the_categories_not_a_total(answer, hint):
    with pytest.raises(CheckFailed, match=hint):
        checks.check_model_state_bytes(answer)


@pytest.mark.parametrize(
    "answer, hint",
    [
        (lambda n: 8 * n if n < 4096 else 2 * n, "absmax"),
        (lambda n: 8 * n if n < 4096 else 2 * n + 8 * (n // 256), "round the number"),
        (lambda n: right_8bit(max(n, 4096)) if n < 4096 else right_8bit(n), "keep 32-bit state"),
    ],
)
def test_exercise_1_2_fails_plausible_wrong_answers_with_their_hint(answer, hint):
    with pytest.raises(CheckFailed, match=hint):
        checks.check_adamw8bit_state_bytes(answer)
