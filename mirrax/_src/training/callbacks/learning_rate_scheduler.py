"""`LearningRateScheduler`: sets the learning rate from `schedule(epoch, lr)` at each epoch."""

from __future__ import annotations

import inspect
from collections.abc import Callable

from mirrax import errors
from mirrax._src import argument_checks
from mirrax._src.training.callbacks import _monitor
from mirrax._src.training.callbacks.callback import Callback
from mirrax._src.training.progbar import print_msg


def _takes_one_argument(function) -> bool:
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    varargs = any(p.kind is p.VAR_POSITIONAL for p in parameters)
    required = [p for p in positional if p.default is p.empty]
    return not varargs and len(required) <= 1 and len(positional) == 1


class LearningRateScheduler(Callback):
    """Sets the learning rate at the start of every epoch, as
    `keras.callbacks.LearningRateScheduler`.

    At `on_epoch_begin(epoch)` the callback calls `schedule(epoch, lr)` with the 0-based epoch
    index and the current rate (a float), and sets `model.optimizer.learning_rate` to the
    result, which the epoch's steps then use (no recompilation). A `schedule(epoch)` of one
    argument (Keras's older form) is accepted too. At the end of each epoch, `"learning_rate"`
    is added to the logs.

    Example: `LearningRateScheduler(lambda epoch, lr: lr if epoch < 10 else lr * 0.9)` keeps the
    rate for epochs 0-9, then multiplies it by 0.9 at the start of every later epoch.

    Args:
      schedule: `(epoch: int, lr: float) -> float`, or `(epoch: int) -> float`.
      verbose: 1 prints "Epoch N: LearningRateScheduler setting learning rate to R." (N 1-based).

    Raises:
      InvalidArgumentTypeError: `schedule` is not callable.
      FixedLearningRateError: at the start of training, the optimizer's learning rate is a
        constant (`optax.adam(1e-3)`); compile with "adam" or `optax.inject_hyperparams`.
      InvalidArgumentError: at an epoch start, the schedule returned something other than a
        real number (or a 0-d array of one).
    """

    def __init__(self, schedule: Callable, verbose: int = 0):
        super().__init__()
        if not callable(schedule):
            raise errors.InvalidArgumentTypeError(
                "LearningRateScheduler needs a function schedule(epoch, lr) -> new lr; "
                f"received {type(schedule).__name__} {schedule!r}."
            )
        self.schedule = schedule
        self.verbose = argument_checks.message_verbose("LearningRateScheduler", verbose)

    def on_train_begin(self, logs: dict | None = None) -> None:
        """Checks, before any step, that the optimizer's learning rate can be set.

        Raises:
          FixedLearningRateError: the optimizer's rate is a constant (e.g. optax.adam(1e-3)).
        """
        _monitor.check_learning_rate(self.model, "LearningRateScheduler")

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        """Sets `model.optimizer.learning_rate = schedule(epoch, current rate)`."""
        current = _monitor.get_learning_rate(self.model, "LearningRateScheduler")
        if _takes_one_argument(self.schedule):
            rate = self.schedule(epoch)
        else:
            rate = self.schedule(epoch, current)
        rate = _monitor.to_learning_rate(rate, "LearningRateScheduler")
        self.model.optimizer.learning_rate = rate
        if self.verbose > 0:
            print_msg(f"\nEpoch {epoch + 1}: LearningRateScheduler setting learning rate to {rate}.")

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        """Adds the current `"learning_rate"` to the epoch's logs."""
        if logs is not None:
            logs["learning_rate"] = _monitor.get_learning_rate(self.model, "LearningRateScheduler")
