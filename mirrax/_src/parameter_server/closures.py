"""The coordinator's queue of scheduled functions: those waiting, the count running, the
first error a function raised and the fatal error (a lost parameter server), under one
condition variable that `join` waits on."""

from __future__ import annotations

import collections
import threading

from mirrax import errors


class WorkerConstant:
    """Base of objects a scheduled function uses that never change once made (a `Model`'s
    compiled steps): sent to each worker once, not with every function, and cached there."""


class Closure:
    """One scheduled function: its pickled (fn, args, kwargs), the indices of the held objects
    it names, and its RemoteValue."""

    def __init__(self, payload: bytes, objects: tuple, value):
        self.payload = payload
        self.objects = objects
        self.value = value
        self.deaths = 0  # times a worker died while running it
        self.generation = 0  # the queue's error generation when it was scheduled


class Queue:
    """Closures waiting and running, and the first error, under one condition variable."""

    def __init__(self):
        self.cond = threading.Condition()
        self.waiting: collections.deque = collections.deque()
        self.running = 0
        self.error: BaseException | None = None
        self.fatal: BaseException | None = None
        self.stopped = False
        # Raised errors so far: a function scheduled before the last raise that fails after it
        # belongs to the failed batch (its RemoteValue gets its error), not to the next one.
        self.generation = 0

    def put(self, closure: Closure) -> None:
        with self.cond:
            closure.generation = self.generation
            self.waiting.append(closure)
            self.cond.notify_all()

    def take(self, block: bool = True) -> Closure | None:
        """The next closure to run (counted as running); None when stopped, or, without
        `block`, when none is waiting."""
        with self.cond:
            # As TF's coordinator, queued functions keep running after one fails, until
            # join/done/schedule raises its error and cancels those still waiting.
            while block and not self.waiting and not self.stopped:
                self.cond.wait(0.5)
            if self.stopped or not self.waiting:
                return None
            self.running += 1
            return self.waiting.popleft()

    def finish(self, closure: Closure, error: BaseException | None = None, give_back: bool = False) -> None:
        with self.cond:
            self.running -= 1
            if give_back and closure.generation != self.generation:
                closure.value.set_error(_cancelled())  # its batch failed meanwhile
            elif give_back:
                self.waiting.appendleft(closure)
            elif error is not None and self.error is None and closure.generation == self.generation:
                self.error = error
            self.cond.notify_all()

    def fail_all(self, error: BaseException) -> None:
        with self.cond:
            if self.fatal is None:
                self.fatal = error
            self._cancel(error)
            self.cond.notify_all()

    def _cancel(self, reason: BaseException | None = None) -> None:
        while self.waiting:
            self.waiting.popleft().value.set_error(reason or _cancelled())

    def stop(self, error: BaseException) -> int:
        """Stops the dispatchers; fails the waiting functions with `error`; returns how many
        were waiting or running."""
        with self.cond:
            pending = len(self.waiting) + self.running
            self.stopped = True
            if self.fatal is None:
                self.fatal = error
            self._cancel(error)
            self.cond.notify_all()
            return pending

    def raise_if_error(self) -> None:
        """Raises the fatal error, or the first function error (then cancels the queued
        closures and clears it, as TF's coordinator). Called with `cond` held."""
        if self.fatal is not None:
            raise self.fatal
        if self.error is not None:
            error, self.error = self.error, None
            self.generation += 1
            self._cancel()
            raise error


def _cancelled() -> errors.CancelledFunctionError:
    return errors.CancelledFunctionError(
        "This scheduled function was cancelled before it ran because an earlier one failed "
        "(the error join() raised). Schedule it again."
    )
