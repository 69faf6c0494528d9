"""The planner's entry points: `plan` (a prediction and, when it does not fit, what makes it fit) and
`course-lib plan`'s `plan_from_cli` (lesson 1, "the planner")."""

from __future__ import annotations

import numbers
import os
from dataclasses import replace
from decimal import Decimal, InvalidOperation

from course_lib import validate
from course_lib.models import ModelNotFound, ModelSpec, model_spec
from course_lib.planner.config.errors import PlanError
from course_lib.planner.config.gpus import GPU, get_gpu
from course_lib.planner.config.setup import Setup
from course_lib.planner.predict import Plan, predict
from course_lib.planner.search.elsewhere import where_it_fits
from course_lib.planner.search.fit import what_makes_it_fit
from course_lib.validate import checked


@checked(error=PlanError)
def plan(
    model: str | os.PathLike | ModelSpec | numbers.Real,  # a number is checked by its own rule: a positive whole one
    setup: Setup | None = None,
    *,
    gpu: str | GPU | None = None,
    suggest: bool = True,
    **options,
) -> Plan:
    """Predict the memory of one training step (lesson 1, "the planner").

    `model`: a bundled name ('llama-3.1-8b'), a config.json path, a ModelSpec, or a parameter count
    (then activations are unknown and counted as 0). `setup` or keyword options (see Setup).
    `gpu`: a catalog name; adds the CUDA context, a fit verdict and, when it does not fit, the
    tricks that make it fit. A precision left None (in `setup` or the options) is the GPU's, as
    `course-lib plan` picks it (`default_precision`: amp-fp16 on a T4, the Trainer's fp16=True).
    """
    setup = validate.instance(
        "setup", setup or Setup(), Setup, "a planner Setup (or None, with keyword options)", error=PlanError
    )
    if options:
        unknown = set(options) - set(Setup.__dataclass_fields__)
        if unknown:
            raise PlanError(f"unknown option(s) {', '.join(sorted(unknown))}")
        setup = replace(setup, **options)
    card = get_gpu(gpu) if gpu is not None else None
    setup = setup.for_gpu(card)
    setup.validate()
    result = predict(model, setup, card)
    if card is not None and suggest and not result.fits:
        result.tricks = what_makes_it_fit(model, setup, card, result)
        if not (result.tricks and result.tricks[-1].fits_after):
            result.closing = where_it_fits(model, setup, card, result.tricks)
    return result


def _parse_count(text: str) -> int:
    """'7e9', '7B', '1.5b', '124,439,808' -> a positive whole number of parameters."""
    cleaned = str(text).strip().replace(",", "").replace("_", "")
    scale = {"k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}.get(cleaned[-1:].lower())
    try:  # decimal, not float: 1e30 is 10**30 exactly
        value = Decimal(cleaned[:-1]) * scale if scale else Decimal(cleaned)
    except InvalidOperation:
        raise PlanError(f"--params must be a number of parameters like 7e9 or 7B, got {text!r}") from None
    if not value.is_finite() or value < 1 or value != int(value):
        raise PlanError(f"--params must be a positive whole number of parameters, got {text!r}")
    return int(value)


def plan_from_cli(
    model: str | None, *, params: str | None = None, precision: str | None = None, gpu: str | None = None, **options
) -> Plan:
    """`course-lib plan`: a model name/config or --params, and the options (lesson 1)."""

    if (model is None) == (params is None):
        raise PlanError(
            "give a model (bundled name or config.json) or --params N, not both"
            if model is not None
            else "give a model (e.g. llama-3.1-8b, or a config.json) or --params N"
        )
    options = {key: value for key, value in options.items() if value is not None}
    try:
        target = _parse_count(params) if params is not None else model_spec(model)
    except ModelNotFound as error:
        raise PlanError(str(error)) from None
    return plan(target, Setup(precision=precision, **options), gpu=gpu)
