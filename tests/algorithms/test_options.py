"""Options as types: every registered algorithm declares a frozen keyword-only options dataclass, and the
same mistake raises the same error, with the same message shape naming the step and the path, everywhere."""

import dataclasses
import re

import pytest

import qtransform as qt

NAMES = sorted(qt.ALGORITHMS)
#: A value of each type, and the option types it fits (an int fits a float option, a bool no int option).
SAMPLES = ((True, {"bool"}), (3, {"int", "float"}), (1.5, {"float"}), ("x", {"str"}), ([1], {"list"}),
           ({"a": 1}, {"dict"}))


def _wrong(label: str):
    """A value of a type the option (its type label, ``"int | None"``) does not take."""
    kinds = set(label.replace(" | None", "").split(" | "))
    return next(v for v, fits in SAMPLES if not fits & kinds)


@pytest.mark.parametrize("name", NAMES)
def test_every_algorithm_declares_a_frozen_keyword_only_options_dataclass(name):
    algo = qt.get_algorithm(name)
    assert dataclasses.is_dataclass(algo.options), f"{name} has no options dataclass"
    assert algo.options.__dataclass_params__.frozen and all(f.kw_only for f in dataclasses.fields(algo.options))
    defaults = algo.check({})
    assert isinstance(defaults, algo.options)
    assert [(f, d) for f, _, d in algo.option_fields()] == [(f.name, getattr(defaults, f.name))
                                                             for f in dataclasses.fields(defaults)]


@pytest.mark.parametrize("name", NAMES)
def test_an_unknown_option_is_the_same_error_everywhere(name):
    at = f"recipe.steps[0] ({name})"
    known = [f for f, _, _ in qt.get_algorithm(name).option_fields()]
    want = f"{at}: {name}: unknown option(s) ['no_such_option']; known: {known}"
    with pytest.raises(ValueError) as e:
        qt.check_algorithm_options(name, {"no_such_option": 1}, path=at)
    assert str(e.value) == want
    with pytest.raises(ValueError) as e:  # the same through the recipe's check
        qt.check_steps([qt.Step(name, no_such_option=1)])
    assert str(e.value) == want


@pytest.mark.parametrize("name", NAMES)
def test_a_wrong_type_is_the_same_error_everywhere(name):
    at = f"recipe.steps[2] ({name})"
    typed = [(f, t) for f, t, _ in qt.get_algorithm(name).option_fields() if t != "any"]
    assert typed or name == "rtn"
    for option, label in typed:
        value = _wrong(label)
        with pytest.raises(TypeError) as e:
            qt.check_algorithm_options(name, {option: value}, path=at)
        assert re.fullmatch(rf"{re.escape(at)}: {name}: {option} must be .+, got {re.escape(repr(value))}",
                            str(e.value)), str(e.value)


@pytest.mark.parametrize("name", NAMES)
def test_a_value_out_of_range_is_the_same_error_everywhere(name):
    at = f"recipe.steps[1] ({name})"
    algo = qt.get_algorithm(name)
    for f in dataclasses.fields(algo.options):
        meta = f.metadata
        if "ge" in meta or "gt" in meta:
            value = meta["ge"] - 1 if "ge" in meta else meta["gt"]
        elif "choices" in meta:
            value = "no-such-choice"
        else:
            continue
        with pytest.raises(ValueError) as e:
            qt.check_algorithm_options(name, {f.name: value}, path=at)
        assert re.fullmatch(rf"{re.escape(at)}: {name}: {f.name} must be .+, got {re.escape(repr(value))}",
                            str(e.value)), str(e.value)


def test_ints_are_numbers_bools_are_not_ints_and_nan_fits_no_range():
    qt.check_algorithm_options("gptq", {"damp": 0})  # an int for a float option
    with pytest.raises(TypeError, match=r"gptq: block_size must be an int >= 1, got True"):
        qt.check_algorithm_options("gptq", {"block_size": True})
    with pytest.raises(ValueError, match=r"hqq: beta must be a number > 0, got nan"):
        qt.check_algorithm_options("hqq", {"beta": float("nan")})
    qt.check_algorithm_options("hqq", {"error_norm": float("inf")})  # allowed there
    with pytest.raises(ValueError, match=r"hqq: kappa must be a number >= 1, got inf"):
        qt.check_algorithm_options("hqq", {"kappa": float("inf")})


def test_checks_across_options_are_prefixed_the_same_way():
    with pytest.raises(ValueError, match=r"^recipe.steps\[0\] \(gptq\): gptq: act_order=True with static_groups"):
        qt.check_steps([qt.Step("gptq", static_groups=False)])
    with pytest.raises(ValueError, match=r"^smoothquant: \['grid'\] apply to alpha='auto'"):
        qt.check_algorithm_options("smoothquant", {"grid": 5})


def test_third_party_algorithms_may_still_bring_their_own_check():
    def check(*, path=None, **options):
        if options:
            raise ValueError(f"{path}: demo takes no options")

    qt.register_algorithm("demo_own_check", lambda params, plan, *, context: qt.Fit(), check_options=check)
    try:
        with pytest.raises(ValueError, match="here: demo takes no options"):
            qt.check_algorithm_options("demo_own_check", {"x": 1}, path="here")
        assert qt.get_algorithm("demo_own_check").option_fields() == []
    finally:
        qt.ALGORITHMS.unregister("demo_own_check")
