"""Argument checks shared by the callbacks' constructors: each refuses a bad value with a mirrax
error that names the callback, the argument, the value received and what to pass."""

from __future__ import annotations

import math
from typing import Literal, overload

import numpy as np

from mirrax import errors


def count(owner: str, name: str, value, minimum: int = 0) -> int:
    """`value` as an int >= `minimum` (bools, floats and strings refused)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise errors.InvalidArgumentTypeError(
            f"{owner}: {name} must be an int; received {type(value).__name__} {value!r}. Pass "
            f"a whole number >= {minimum}."
        )
    if value < minimum:
        raise errors.InvalidArgumentError(
            f"{owner}: {name} must be >= {minimum}; received {name}={value!r}. Pass a whole "
            f"number >= {minimum}."
        )
    return int(value)


@overload
def number(owner: str, name: str, value, allow_none: Literal[False] = False, minimum=None) -> float:
    """Without `allow_none`: a float, never None (for type checkers; the body is below)."""


@overload
def number(owner: str, name: str, value, allow_none: bool, minimum=None) -> float | None:
    """With `allow_none`: a float or None (for type checkers; the body is below)."""


def number(owner: str, name: str, value, allow_none: bool = False, minimum=None) -> float | None:
    """`value` as a finite float (>= `minimum` when given), or None when allowed."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)) or np.ndim(value):
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
      InvalidArgumentTypeError: any other value (the message names `owner` and `name`).
    """
    if not isinstance(value, (bool, np.bool_)):
        raise errors.InvalidArgumentTypeError(
            f"{owner}: {name} must be True or False; received {type(value).__name__} {value!r}."
        )
    return bool(value)


def verbose(owner: str, value) -> int:
    """Keras's callback verbosity: 0 (silent) or 1 (print); 2 counts as 1."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value not in (0, 1, 2):
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
