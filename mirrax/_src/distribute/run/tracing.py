"""Whether a `mirrax.function` is being traced, and what its trace learns.

While `mirrax.function` traces the user's function, `strategy.run` calls inside it do not run
a program of their own: they add their step to the function's program (their state arrives as
the trace's values, their new state is written into the trace's copies of the NNX objects).
The trace records the strategies whose `run` it called, so the function's state is placed on
their devices before the real program is built.
"""

from __future__ import annotations

import contextlib
import threading

_local = threading.local()


class Trace:
    """One trace of a `mirrax.function`.

    Attributes:
      name: the traced function's name, for messages.
      strategies: the distinct strategies whose `run` the function called, in call order.
    """

    __slots__ = ("name", "strategies")

    def __init__(self, name: str):
        self.name = name
        self.strategies: list = []

    def used(self, strategy) -> None:
        if all(s is not strategy for s in self.strategies):
            self.strategies.append(strategy)


def current() -> Trace | None:
    """The `mirrax.function` trace open on this thread, or None."""
    return getattr(_local, "trace", None)


@contextlib.contextmanager
def tracing(trace: Trace):
    """Marks `trace` as open on this thread for the block."""
    previous = current()
    _local.trace = trace
    try:
        yield trace
    finally:
        _local.trace = previous
