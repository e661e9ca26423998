"""`ReduceLROnPlateau`: multiplies the learning rate by `factor` when a quantity stops improving."""

from __future__ import annotations

import warnings

import numpy as np

from mirrax import errors
from mirrax._src import argument_checks
from mirrax._src.training.callbacks import _monitor
from mirrax._src.training.callbacks.callback import Callback
from mirrax._src.training.progbar import print_msg


class ReduceLROnPlateau(Callback):
    """Reduces the learning rate when `monitor` has stopped improving, as
    `keras.callbacks.ReduceLROnPlateau`.

    At the end of each epoch: while in cooldown, the cooldown counter drops by one and `wait`
    is reset. A value that beats the best by more than `min_delta` (`value < best - min_delta`
    in "min" mode, `value > best + min_delta` in "max") becomes the best and resets `wait`.
    Otherwise, outside cooldown, `wait` grows by one; when it reaches `patience` and the rate
    is above `min_lr`, the rate becomes `max(rate * factor, min_lr)`, the cooldown starts
    (`cooldown` epochs) and `wait` is reset. The new rate is set with
    `model.optimizer.learning_rate = new_rate`, which the next step uses without recompiling.
    So with `patience=2, cooldown=0` and a loss that never improves after epoch 0, the rate is
    cut at the end of epochs 2, 4, 6, ... (0-based).

    The epoch's logs get `"learning_rate"` (the rate before any cut at this epoch), as Keras.

    Args:
      monitor: the log key to watch.
      factor: the rate is multiplied by it; must be below 1.
      patience: epochs without improvement before the rate is cut.
      verbose: 1 prints "Epoch N: ReduceLROnPlateau reducing learning rate to R." (N 1-based).
      mode: "min", "max" or "auto". "auto" infers the direction from the name as
        `EarlyStopping` does and, where the name tells nothing, minimizes (Keras's
        default for names without "acc"). An unknown mode warns and falls back to "auto".
      min_delta: the smallest change that counts as an improvement.
      cooldown: epochs after a cut during which `wait` stays 0.
      min_lr: the rate is never cut below it.

    Raises:
      InvalidArgumentError / InvalidArgumentTypeError: `factor` not in [0, 1), a negative
        `patience` / `cooldown` / `min_lr`, or an argument of the wrong type.
      FixedLearningRateError: at the start of training, the optimizer's learning rate is a
        constant (`optax.adam(1e-3)`); compile with "adam" or `optax.inject_hyperparams`.
      InvalidArgumentError: at the start of training, `monitor` is not among the keys `fit`
        will log (Keras warns at every epoch end instead).

    Warns:
      UserWarning: at the end of an epoch whose logs lack `monitor`.
    """

    def __init__(
        self,
        monitor: str = "val_loss",
        factor: float = 0.1,
        patience: int = 10,
        verbose: int = 0,
        mode: str = "auto",
        min_delta: float = 1e-4,
        cooldown: int = 0,
        min_lr: float = 0.0,
        **kwargs,
    ):
        super().__init__()
        owner = "ReduceLROnPlateau"
        if kwargs:
            raise errors.UnsupportedArgumentError(
                f"ReduceLROnPlateau got {', '.join(map(repr, sorted(kwargs)))}, which it does "
                "not take"
                + (
                    "; epsilon is tf.keras 1's name of min_delta: pass min_delta="
                    if "epsilon" in kwargs
                    else ""
                )
                + ". Its arguments are monitor, factor, patience, verbose, mode, min_delta, "
                "cooldown, min_lr."
            )
        factor = argument_checks.number(owner, "factor", factor)
        if not 0.0 <= factor < 1.0:
            raise errors.InvalidArgumentError(
                "ReduceLROnPlateau does not support a factor >= 1.0 or < 0 (the rate is "
                f"multiplied by it and must go down); received factor={factor}. Pass e.g. "
                "factor=0.5."
            )
        self.monitor = argument_checks.monitor(owner, monitor)
        self.factor = factor
        self.patience = argument_checks.count(owner, "patience", patience, minimum=0)
        self.verbose = argument_checks.message_verbose(owner, verbose)
        self.mode = _monitor.check_mode(mode, owner)
        self.min_delta = argument_checks.number(owner, "min_delta", min_delta)
        self.cooldown = argument_checks.count(owner, "cooldown", cooldown, minimum=0)
        self.min_lr = argument_checks.number(owner, "min_lr", min_lr, minimum=0.0)
        self.cooldown_counter = 0
        self.wait = 0
        self.monitor_op: str = "min"
        self.best = np.inf
        self._reset()

    def _reset(self) -> None:
        mode = self.mode
        if mode == "auto":
            mode = _monitor.infer_mode(self.monitor, self.model) or "min"
        self.monitor_op = mode
        self.best = np.inf if mode == "min" else -np.inf
        self.cooldown_counter = 0
        self.wait = 0

    def _is_improvement(self, value: float) -> bool:
        if self.monitor_op == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta

    def in_cooldown(self) -> bool:
        """Whether the callback is in its cooldown after a cut."""
        return self.cooldown_counter > 0

    def on_train_begin(self, logs: dict | None = None) -> None:
        """Checks the optimizer and the monitor; resets the best value, `wait` and the cooldown.

        Raises:
          FixedLearningRateError: the optimizer's learning rate cannot be changed.
          InvalidArgumentError: `monitor` is not among the keys fit will log.
        """
        _monitor.check_learning_rate(self.model, "ReduceLROnPlateau")
        _monitor.check_monitor_is_logged("ReduceLROnPlateau", self.monitor, self.params)
        self._reset()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        """Adds `"learning_rate"` to `logs`; cuts the rate when patience ran out."""
        logs = logs if logs is not None else {}
        logs["learning_rate"] = _monitor.get_learning_rate(self.model, "ReduceLROnPlateau")
        current = logs.get(self.monitor)
        if current is None:
            warnings.warn(
                _monitor.missing_monitor_message("Learning rate reduction", self.monitor, logs),
                stacklevel=2,
            )
            return
        current = float(current)
        if self.in_cooldown():
            self.cooldown_counter -= 1
            self.wait = 0
        if self._is_improvement(current):
            self.best = current
            self.wait = 0
        elif not self.in_cooldown():
            self.wait += 1
            if self.wait >= self.patience:
                old_lr = _monitor.get_learning_rate(self.model, "ReduceLROnPlateau")
                # float32 as Keras: a rate stored in float32 equal to min_lr is not cut again.
                if old_lr > np.float32(self.min_lr):
                    new_lr = max(old_lr * self.factor, self.min_lr)
                    self.model.optimizer.learning_rate = new_lr
                    if self.verbose > 0:
                        print_msg(
                            f"\nEpoch {epoch + 1}: ReduceLROnPlateau reducing learning rate to {new_lr}."
                        )
                    self.cooldown_counter = self.cooldown
                    self.wait = 0
