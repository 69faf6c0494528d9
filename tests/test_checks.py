"""What every exercise check shares (course_lib/checks/hints.py): a hint in one block, no check source,
and refusing an answer that only calls the library's own implementation (lessons 0 and 1 use it)."""

import math
import traceback
from pathlib import Path

import pytest
import torch

import course_lib.checks
from course_lib import checks
from course_lib.checks import CheckFailed, hints_only, refuse_reference
from course_lib.measure import measure_step
from course_lib.memory import optimizer_state_bytes, plan

CHECKS_DIR = str(Path(course_lib.checks.__file__).parent)


def test_every_check_of_every_lesson_gives_hints_only():
    names = [name for name in dir(checks) if name.startswith("check_")]
    assert len(names) >= 6 and all(getattr(checks, name).__wrapped__ for name in names)


def test_a_failed_check_shows_its_hint_as_one_block_without_source_or_paths():
    with pytest.raises(CheckFailed) as failed:
        checks.check_model_state_bytes(lambda n, precision, optimizer: 3)
    shown = failed.value._render_traceback_()  # what IPython prints instead of a traceback
    assert len(shown) == 1 and "expected 8 bytes" in shown[0]
    assert ".py" not in shown[0] and "raise" not in shown[0] and "master copy" not in shown[0]  # another hint
    assert failed.value.__cause__ is None and failed.value.__suppress_context__


def test_the_learners_own_error_keeps_the_learners_frames_and_not_the_checks():
    def answer(n, precision, optimizer):
        return {}[precision]  # a KeyError in the learner's code

    with pytest.raises(KeyError) as raised:
        checks.check_model_state_bytes(answer)
    files = [frame.filename for frame in traceback.extract_tb(raised.value.__traceback__)]
    assert __file__ in files and not any(f.startswith(CHECKS_DIR) and not f.endswith("hints.py") for f in files)
    with pytest.raises(NotImplementedError):  # an unsolved exercise still says so
        checks.check_saved_bytes(lambda *a: (_ for _ in ()).throw(NotImplementedError()))


def test_hints_only_keeps_a_passing_checks_result():
    assert hints_only(lambda x: x + 1)(1) == 2


def test_refuse_reference_sees_a_call_however_it_was_imported():
    import course_lib.memory as memory
    from course_lib.memory import plan as renamed

    for answer in (lambda: renamed(10).total, lambda: memory.plan(10).total, lambda: [plan][0](10).total):
        with pytest.raises(CheckFailed, match=r"calls course_lib\.memory\.plan, the course library's own answer"):
            with refuse_reference(memory, instead="add it up"):
                answer()
    with refuse_reference(memory):
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


@pytest.mark.parametrize("check, answer", [
    ("check_checkpointed_forward", lambda layers, x, plan: __import__("course_lib.checkpointing").checkpointing
     .checkpointed_forward(layers, x, plan)),
    ("check_best_plan", lambda saved, inputs, budget: __import__("course_lib.checkpointing").checkpointing
     .optimal_plan(saved, inputs, budget).plan),
    ("check_migrated_bytes", lambda accesses, capacity, policy: __import__("course_lib.paging").paging
     .chunk_migrations(accesses, capacity, policy)),
    ("check_step3_prediction", lambda: {k: checks.paging._step3_in(k == "with empty_cache")
                                        for k in ("with empty_cache", "without empty_cache")}),
], ids=lambda value: value if isinstance(value, str) else "")
def test_lesson_checks_refuse_an_answer_that_calls_the_library(check, answer):
    with pytest.raises(CheckFailed, match="the course library's own answer"):
        getattr(checks, check)(answer)


def right_model_state_bytes(n, precision, optimizer):
    weight = 4 if precision == "fp32" else 2
    state = 2 if precision == "bf16" else 4
    return n * (2 * weight + {"sgd": 0, "momentum": 1, "adamw": 2}[optimizer] * state
                + (4 if precision.startswith("mixed") else 0))


def right_8bit(numel):
    return 8 * numel if numel < 4096 else 2 * (numel + 4 * math.ceil(numel / 256))


def adam_state_measured(model):
    x = torch.randn(2, *next(model.parameters()).shape[1:]) if isinstance(model, torch.nn.Linear) else None
    return measure_step(model, torch.optim.AdamW(model.parameters()), lambda: model(x).sum(), inputs=[x]).optimizer_state


@pytest.mark.parametrize("check, copied, right", [
    (checks.check_model_state_bytes, lambda n, p, o: plan(n, precision=p, optimizer=o).total, right_model_state_bytes),
    (checks.check_adamw8bit_state_bytes, lambda n: optimizer_state_bytes("adamw8bit", [n], 4), right_8bit),
    (checks.check_adam_state_bytes, adam_state_measured,
     lambda model: sum(2 * p.numel() * p.element_size() + 4 for p in model.parameters())),
    (checks.check_saved_bytes, lambda b, d, h: plan(1000).total, lambda b, d, h: 4 * (b * d + b * h)),
], ids=["1.1", "1.2", "0.1", "0.2"])
def test_lessons_0_and_1_refuse_an_answer_that_calls_the_library_and_accept_one_that_works_it_out(check, copied, right):
    with pytest.raises(CheckFailed, match="the course library's own answer"):
        check(copied)
    check(right)
