"""course_lib.validate's bounds at the bound itself: an inclusive bound accepts the value exactly at it,
a strict one (`above`, a dropout's `below_one`) refuses it; and a dataclass's fields are checked against
their annotations resolved in the class (a nested class's name)."""

from __future__ import annotations

import dataclasses

import pytest

from course_lib.errors import UserError, UserTypeError
from course_lib.validate import checked, finite, integer, positive, probability


def test_an_integers_minimum_and_maximum_are_inclusive():
    assert integer("n", 5, minimum=5, maximum=5) == 5
    assert integer("n", 7.0, maximum=7) == 7
    for outside in (4, 6):
        with pytest.raises(UserError, match="n must be a whole number >= 5 and <= 5"):
            integer("n", outside, minimum=5, maximum=5)


def test_a_finite_numbers_above_is_strict_and_at_least_and_at_most_are_inclusive():
    assert finite("x", 1.0, at_least=1.0, at_most=1.0) == 1.0
    assert finite("x", 0.5, above=0.0, at_most=1.0) == 0.5
    with pytest.raises(UserError, match="above 0"):
        finite("x", 0.0, above=0.0)
    with pytest.raises(UserError, match="<= 1"):
        finite("x", 1.0 + 2**-52, at_most=1.0)
    with pytest.raises(UserError, match=">= 1"):
        finite("x", 1.0 - 2**-53, at_least=1.0)
    with pytest.raises(UserError, match="above 0"):
        positive("seconds", 0)


def test_a_probability_takes_0_and_1_and_a_dropout_not_1():
    assert probability("p", 0) == 0
    assert probability("p", 1) == 1
    assert probability("dropout", 0, below_one=True) == 0
    with pytest.raises(UserError, match="not including"):
        probability("dropout", 1, below_one=True)
    for outside in (-(2**-60), 1 + 2**-52):
        with pytest.raises(UserError, match="from 0 to 1"):
            probability("p", outside)


@checked
@dataclasses.dataclass
class _Outer:
    @dataclasses.dataclass
    class Inner:
        x: int = 0

    inner: Inner  # a name the class's own namespace resolves, not the module's
    n: int = 1


def test_a_dataclass_field_annotated_with_a_nested_class_is_checked():
    assert _Outer(_Outer.Inner()).n == 1
    with pytest.raises(UserTypeError, match=r"_Outer\.inner must be a .*Inner, got 'not an inner' \(str\)"):
        _Outer("not an inner")
