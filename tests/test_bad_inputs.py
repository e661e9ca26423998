"""The bad-input catalogue: every case raises its mirrax error class with a message that says what
was wrong, echoes the value received, and names the fix (tests/bad_inputs/ holds the cases)."""

import importlib
import pkgutil

import pytest

import mirrax
from tests import bad_inputs
from tests.bad_inputs.case import Case, Env
from tests.conftest import STRATEGY_NAMES, named_strategy


def _cases() -> list:
    cases = []
    for module in pkgutil.iter_modules(bad_inputs.__path__):
        if module.name != "case":
            cases += importlib.import_module(f"tests.bad_inputs.{module.name}").CASES
    return cases


_CASES = _cases()
_RUNS = [
    pytest.param(case, name, id=f"{case.name}-{name}")
    for case in _CASES
    for name in (STRATEGY_NAMES if case.each_strategy else ["Mirrored2CPU"])
]


def test_the_catalogue_holds_at_least_80_distinct_cases():
    names = [case.name for case in _CASES]
    assert len(set(names)) == len(names), sorted(n for n in names if names.count(n) > 1)
    assert len(names) >= 80, len(names)


@pytest.mark.slow
@pytest.mark.parametrize("case,strategy_name", _RUNS)
def test_bad_input_raises_a_named_mirrax_error(case: Case, strategy_name, tmp_path):
    assert issubclass(case.error, mirrax.errors.MirraxError), case.error
    strategy = named_strategy(strategy_name)
    with pytest.raises(case.error) as info:
        case.call(Env(strategy=strategy, tmp_path=tmp_path))
    message = str(info.value)
    missing = [fragment for fragment in case.match if fragment not in message]
    assert not missing, f"{case.name}: {missing} not in the message: {message}"
