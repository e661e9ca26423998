"""The one home of mirrax's checks of plain arguments (counts, numbers, flags, fractions,
verbosity, a monitored log name): each takes (owner, name, value), returns the value
normalized, and refuses a bad one with one message form: "<owner>: <name> must be <what>;
received <type> <value>. <what to pass>"."""

from __future__ import annotations

import math
from typing import Literal, overload

import numpy as np

from mirrax import errors


@overload
def count(owner: str, name: str, value, minimum: int = 1, allow_none: Literal[False] = False) -> int:
    """Without `allow_none`: an int, never None (for type checkers; the body is below)."""


@overload
def count(owner: str, name: str, value, minimum: int = 1, *, allow_none: bool) -> int | None:
    """With `allow_none`: an int or None (for type checkers; the body is below)."""


def count(owner: str, name: str, value, minimum: int = 1, allow_none: bool = False) -> int | None:
    """`value` as an int >= `minimum` (or None when allowed); bools, floats and strings refused.

    Raises:
      InvalidArgumentTypeError: not an int (a whole float is named with its int form).
      InvalidArgumentError: an int below `minimum`.
    """
    if value is None and allow_none:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        hint = (
            f" (an int, e.g. {name}={int(value)})" if isinstance(value, float) and value.is_integer() else ""
        )
        raise errors.InvalidArgumentTypeError(
            f"{owner}: {name} must be an int{' or None' if allow_none else ''}; received "
            f"{type(value).__name__} {value!r}. Pass a whole number >= {minimum}{hint}."
        )
    if value < minimum:
        raise errors.InvalidArgumentError(
            f"{owner}: {name} must be >= {minimum}{' or None' if allow_none else ''}; received "
            f"{name}={value!r}. Pass a whole number >= {minimum}."
        )
    return int(value)


@overload
def number(owner: str, name: str, value, allow_none: Literal[False] = False, minimum=None) -> float:
    """Without `allow_none`: a float, never None (for type checkers; the body is below)."""


@overload
def number(owner: str, name: str, value, allow_none: bool, minimum=None) -> float | None:
    """With `allow_none`: a float or None (for type checkers; the body is below)."""


def number(owner: str, name: str, value, allow_none: bool = False, minimum=None) -> float | None:
    """`value` as a finite float (>= `minimum` when given), or None when allowed.

    Raises:
      InvalidArgumentTypeError: not a real scalar. InvalidArgumentError: not finite, or below
        `minimum`.
    """
    if value is None and allow_none:
        return None
    if (
        isinstance(value, (bool, np.bool_))
        or not isinstance(value, (int, float, np.number))
        or np.ndim(value)
    ):
        raise errors.InvalidArgumentTypeError(
            f"{owner}: {name} must be a number{' or None' if allow_none else ''}; received "
            f"{type(value).__name__} {value!r}."
        )
    value = float(value)
    if not math.isfinite(value):
        raise errors.InvalidArgumentError(f"{owner}: {name} must be finite; received {value!r}.")
    if minimum is not None and value < minimum:
        raise errors.InvalidArgumentError(f"{owner}: {name} must be >= {minimum}; received {name}={value!r}.")
    return value


def flag(owner: str, name: str, value) -> bool:
    """`value` as a bool; only True / False (and NumPy bools) are taken: "no" is not False.

    Raises:
      InvalidArgumentTypeError: any other value.
    """
    if not isinstance(value, (bool, np.bool_)):
        raise errors.InvalidArgumentTypeError(
            f"{owner}: {name} must be True or False; received {type(value).__name__} {value!r}."
        )
    return bool(value)


def fraction(owner: str, name: str, value) -> float:
    """`value` as a float in [0, 1) (e.g. `validation_split`).

    Raises:
      InvalidArgumentTypeError / InvalidArgumentError: not a number, or outside [0, 1).
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise errors.InvalidArgumentTypeError(
            f"{owner}: {name} must be a float in [0, 1); received {type(value).__name__} {value!r}."
        )
    if not 0.0 <= value < 1.0:
        raise errors.InvalidArgumentError(
            f"{owner}: {name} must be in [0, 1) (the fraction held out); received {value!r}. "
            "Pass e.g. 0.2 to hold out the last 20%."
        )
    return float(value)


def progress_verbose(owner: str, value) -> int:
    """Keras's `verbose` of fit / evaluate / predict: "auto" (1), 0, 1 or 2.

    Raises:
      InvalidArgumentError: any other value.
    """
    if value == "auto":
        return 1
    if not isinstance(value, (int, np.integer)) or value not in (0, 1, 2):  # True is 1
        raise errors.InvalidArgumentError(
            f"{owner}: verbose must be 'auto', 0 (silent), 1 (progress bar) or 2 (one line per "
            f"epoch); received {value!r}."
        )
    return int(value)


def message_verbose(owner: str, value) -> int:
    """Keras's callback verbosity: 0 (silent) or 1 (print); 2 counts as 1.

    Raises:
      InvalidArgumentError: any other value.
    """
    if (
        isinstance(value, (bool, np.bool_))
        or not isinstance(value, (int, np.integer))
        or value not in (0, 1, 2)
    ):
        raise errors.InvalidArgumentError(
            f"{owner}: verbose must be 0 (silent) or 1 (print messages); received {value!r}."
        )
    return int(value)


def monitor(owner: str, value) -> str:
    """`value` as the name of a logged quantity ("val_loss", "accuracy"), as Keras's `monitor`.

    Raises:
      InvalidArgumentTypeError: `value` is not a non-empty str.
    """
    if not isinstance(value, str) or not value:
        raise errors.InvalidArgumentTypeError(
            f"{owner}: monitor must be the name of a logged quantity (a str such as 'val_loss' "
            f"or 'accuracy'); received {type(value).__name__} {value!r}."
        )
    return value
