"""One entry of the bad-input catalogue, and the environment a case's call receives."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass(frozen=True)
class Case:
    """A bad call and the error it must raise.

    Attributes:
      name: what is bad, as a user would say it ("fit(epochs='3')"); the test id.
      call: performs the bad call; receives an `Env`.
      error: the mirrax error class expected (a subclass of `mirrax.errors.MirraxError` and of
        the builtin a user would catch); the raised error must be an instance of it.
      match: fragments the message must contain (case-sensitive): what was wrong, the value
        received, and the fix, wherever the message can name them.
      each_strategy: run once under every named strategy of tests/conftest.py (otherwise once,
        under Mirrored2CPU).
    """

    name: str
    call: Callable[[Env], Any]
    error: type
    match: tuple = ()
    each_strategy: bool = False


@dataclasses.dataclass
class Env:
    """What a case's call may use: the strategy it runs under (not entered: a call that needs
    `strategy.scope()` enters it) and a fresh temporary folder."""

    strategy: Any
    tmp_path: Any
