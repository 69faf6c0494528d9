"""`validate.checked`: a public function's or dataclass's annotations, enforced at the call (issue 46)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import pytest
import torch

from course_lib.errors import UserError, UserTypeError
from course_lib.paging import PagingError
from course_lib.validate import Count, Device, checked


@checked
def sized(n: Count, scale: float, names: Sequence[str], shape: tuple[int, int], by_name: dict[str, int]) -> int:
    return n


@checked
def optional(width: int | None = None, model: torch.nn.Module | None = None, fn: Callable | None = None):
    return width


@checked(error=PagingError)
def on(device: Device = "cpu"):
    return torch.device(device)


@checked
@dataclass(frozen=True)
class Held:
    nbytes: int
    label: str = "x"
    extra: tuple[int, ...] = ()


GOOD = {"n": 1, "scale": 0.5, "names": ["a"], "shape": (2, 3), "by_name": {"a": 1}}


def test_good_arguments_pass_and_the_result_is_the_functions():
    assert sized(**GOOD) == 1
    assert sized(**{**GOOD, "scale": 2}) == 1  # an int is a float
    assert optional() is None and optional(3) == 3
    assert on("cpu") == torch.device("cpu") and on(torch.device("meta")).type == "meta"
    assert Held(0).nbytes == 0


@pytest.mark.parametrize(
    "name, value, words",
    [
        ("n", True, "a whole number >= 1"),  # a bool is not a count
        ("n", 2.0, "a whole number >= 1"),  # a whole float is not an int either
        ("n", 2.5, "a whole number >= 1"),
        ("n", 0, ">= 1"),  # the boundary of Count itself
        ("shape", (2, 2**63), "int64"),
        ("shape", (2, -(2**63) - 1), "int64"),
        ("scale", math.nan, "finite"),
        ("scale", math.inf, "finite"),
        ("scale", True, "finite"),
        ("scale", "0.5", "finite"),
        ("names", "abc", "a list"),  # never its letters
        ("names", [3], "a string"),
        ("shape", (2,), "2 items"),
        ("shape", (2, 3.0), "an int"),
        ("by_name", {"a": "1"}, "'a'"),
        ("by_name", {1: 1}, "keys"),
    ],
)
def test_a_value_not_of_its_annotation_is_refused_in_one_line(name, value, words):
    with pytest.raises(UserTypeError, match=words) as refused:
        sized(**{**GOOD, name: value})
    assert str(refused.value).startswith(f"{name} must be") and "\n" not in str(refused.value)


def test_the_boundaries_of_count_and_int64_are_accepted():
    assert sized(**{**GOOD, "n": 1}) == 1
    assert sized(**{**GOOD, "n": 2**63 - 1}) == 2**63 - 1


def test_none_only_where_the_annotation_or_the_default_allows_it():
    assert optional(None, None, None) is None
    with pytest.raises(UserTypeError, match="model must be a torch"):
        optional(model="model")
    with pytest.raises(UserTypeError, match="fn must be a callable"):
        optional(fn=3)
    with pytest.raises(UserTypeError, match="n must be"):
        sized(**{**GOOD, "n": None})


def test_a_dataclass_checks_its_fields_and_bytes_are_never_negative():
    with pytest.raises(UserTypeError, match="Held.nbytes must be an int"):
        Held(2.5)
    with pytest.raises(UserTypeError, match="Held.nbytes is a byte count: it must be non-negative"):
        Held(-1)
    with pytest.raises(UserTypeError, match="Held.extra must be a list of items each an int"):
        Held(1, extra=(1, None))


def test_the_packages_own_error_and_a_device_name():
    with pytest.raises(PagingError, match="device must be a device"):
        on("no such device")
    assert issubclass(PagingError, UserError)


def test_a_multi_line_repr_is_shown_on_one_line():
    with pytest.raises(UserTypeError) as refused:
        sized(**{**GOOD, "n": torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())})
    assert "\n" not in str(refused.value) and "Sequential" in str(refused.value)


def test_a_wrong_call_is_a_user_error_not_pythons_type_error_text_alone():
    with pytest.raises(UserTypeError, match="sized: missing a required argument"):
        sized(1)


@checked
def picked(kind: Literal["a", "b"], version: Literal[1, 2], items: Sequence[int], stream: Iterable[int]):
    return kind, version


@checked
def placed(device: Device):
    return device


def test_a_literal_compares_what_a_value_is_and_never_a_tensors_equality():
    assert picked("a", np.int64(2), [1], iter([1])) == ("a", 2)
    for version in (2.0, True, torch.tensor([1, 2]), np.array([1, 2])):
        with pytest.raises(UserTypeError, match="version must be 1 or 2"):
            picked("a", version, [1], [1])
    with pytest.raises(UserTypeError, match="unknown kind 'c'"):
        picked("c", 1, [1], [1])


def test_an_iterator_is_refused_where_it_would_be_used_up_and_let_through_where_it_is_read_once():
    with pytest.raises(UserTypeError, match="not an iterator"):
        picked("a", 1, iter([1]), [1])
    assert picked("a", 1, torch.Size([2, 3]), (n for n in [1])) == ("a", 1)


def test_none_is_no_device_and_int64s_lowest_value_is_an_int():
    with pytest.raises(UserTypeError, match="device must be a device"):
        placed(None)
    assert sized(**{**GOOD, "shape": (2, -(2**63))}) == 1
