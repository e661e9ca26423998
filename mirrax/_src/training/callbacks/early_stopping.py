"""`EarlyStopping`: stops `fit` when a monitored quantity stops improving (Keras 3's rules)."""

from __future__ import annotations

import warnings

from mirrax import errors
from mirrax._src import argument_checks
from mirrax._src.training.callbacks import _monitor
from mirrax._src.training.callbacks.callback import Callback
from mirrax._src.training.progbar import print_msg


class EarlyStopping(Callback):
    """Stops training when `monitor` has stopped improving, as `keras.callbacks.EarlyStopping`.

    At the end of each epoch (from epoch index `start_from_epoch` on) the monitored value is
    compared with the best so far: it improves when it beats the best by more than
    `min_delta` (`value < best - min_delta` in "min" mode, `value > best + min_delta` in "max").
    The first monitored epoch always improves. Each epoch without improvement adds one to
    `wait`; an improvement resets `wait` to 0 only if it also beats `baseline` (when given).
    Training stops (`model.stop_training = True`) at the end of the first epoch, after epoch
    0, where `wait >= patience`. So with `patience=2` and the best value at epoch 3, training
    stops at the end of epoch 5 (epochs 4 and 5 did not improve).

    Args:
      monitor: the log key to watch, e.g. "val_loss", "loss", "val_accuracy".
      min_delta: the smallest change that counts as an improvement (its sign is ignored).
      patience: epochs without improvement after which training stops.
      verbose: 1 prints "Epoch N: early stopping" (N 1-based) and the restore message at the
        end of training; 0 is silent.
      mode: "min", "max" or "auto". "auto" infers the direction from the name ("loss" and
        errors: min; accuracy, AUC, precision, recall...: max; or the direction a model's
        metric declares, as Keras 3). An unknown mode warns and falls back to "auto".
      baseline: a value to reach; an improvement that does not beat it does not reset the
        patience, so training stops after `patience` epochs unless the baseline is beaten.
      restore_best_weights: at the end of training, set the model's weights to those of the
        best epoch (as Keras 3: also when training ran all its epochs, and also when no epoch
        beat `baseline`, in which case the best epoch seen is restored).
      start_from_epoch: epochs (0-based indices below it) to wait before monitoring starts;
        they can neither improve nor stop.

    Attributes:
      stopped_epoch: the 0-based index of the epoch at whose end training was stopped, or 0
        if it was not stopped.
      best: the best monitored value so far (None before the first monitored epoch).
      best_epoch: the 0-based index of the best epoch.
      wait: epochs since the last improvement that beat the baseline.

    Raises:
      InvalidArgumentTypeError / InvalidArgumentError: an argument of the wrong type or range
        (`patience=-1`, `monitor=None`, ...).
      InvalidArgumentError: at the start of training, when `monitor` is not among the keys
        `fit` will log (the message lists them; Keras warns at every epoch end instead), or
        when `mode="auto"` and the direction of `monitor` cannot be inferred (pass
        `mode="min"` or `mode="max"`).

    Warns:
      UserWarning: at the end of an epoch whose logs lack `monitor`; that epoch is skipped.
    """

    def __init__(
        self,
        monitor: str = "val_loss",
        min_delta: float = 0,
        patience: int = 0,
        verbose: int = 0,
        mode: str = "auto",
        baseline: float | None = None,
        restore_best_weights: bool = False,
        start_from_epoch: int = 0,
    ):
        super().__init__()
        owner = "EarlyStopping"
        self.monitor = argument_checks.monitor(owner, monitor)
        self.min_delta = abs(argument_checks.number(owner, "min_delta", min_delta))
        self.patience = argument_checks.count(owner, "patience", patience, minimum=0)
        self.verbose = argument_checks.message_verbose(owner, verbose)
        self.mode = _monitor.check_mode(mode, owner)
        self.baseline = argument_checks.number(owner, "baseline", baseline, allow_none=True)
        self.restore_best_weights = argument_checks.flag(owner, "restore_best_weights", restore_best_weights)
        self.start_from_epoch = argument_checks.count(owner, "start_from_epoch", start_from_epoch, minimum=0)
        self.monitor_op: str | None = None  # "min" or "max" once resolved
        self.wait = 0
        self.stopped_epoch = 0
        self.best: float | None = None
        self.best_epoch = 0
        self.best_weights: list | None = None

    def _resolve_mode(self) -> None:
        if self.mode != "auto":
            self.monitor_op = self.mode
            return
        self.monitor_op = _monitor.infer_mode(self.monitor, self.model)
        if self.monitor_op is None:
            raise errors.InvalidArgumentError(
                f"EarlyStopping received monitor={self.monitor!r} with mode='auto', but cannot "
                "tell whether that quantity should be minimized or maximized (auto knows "
                "losses and errors, minimized, and accuracy, AUC, precision, recall and other "
                "Keras metric names, maximized). Pass mode='max' to stop when its highest "
                "value stops rising, or mode='min' to stop when its lowest value stops "
                "falling."
            )

    def on_train_begin(self, logs: dict | None = None) -> None:
        """Resets the state (so an instance can be reused) and resolves `mode="auto"`.

        Raises:
          InvalidArgumentError: `monitor` is not among the keys fit will log, or the direction
            of `monitor` cannot be inferred.
        """
        _monitor.check_monitor_is_logged("EarlyStopping", self.monitor, self.params)
        self.wait = 0
        self.stopped_epoch = 0
        self.best = None
        self.best_epoch = 0
        self.best_weights = None
        self._resolve_mode()

    def _is_improvement(self, value: float, reference: float | None) -> bool:
        if reference is None:
            return True
        if self.monitor_op == "min":
            return value + self.min_delta < reference
        return value - self.min_delta > reference

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        """Updates the best value and `wait`; sets `model.stop_training` when patience ran out."""
        if self.monitor_op is None:
            self._resolve_mode()
        logs = logs or {}
        current = logs.get(self.monitor)
        if current is None:
            warnings.warn(
                _monitor.missing_monitor_message("Early stopping", self.monitor, logs),
                stacklevel=2,
            )
            return
        if epoch < self.start_from_epoch:
            return
        current = float(current)
        if self.restore_best_weights and self.best_weights is None:
            # Until something improves, the first monitored epoch's weights are the best seen.
            self.best_weights = self.model.get_weights()
            self.best_epoch = epoch
        self.wait += 1
        if self._is_improvement(current, self.best):
            self.best = current
            self.best_epoch = epoch
            if self.restore_best_weights:
                self.best_weights = self.model.get_weights()
            if self.baseline is None or self._is_improvement(current, self.baseline):
                self.wait = 0
            return
        if self.wait >= self.patience and epoch > 0:
            self.stopped_epoch = epoch
            self.model.stop_training = True

    def on_train_end(self, logs: dict | None = None) -> None:
        """Reports the stop (verbose) and restores the best epoch's weights if asked."""
        if self.stopped_epoch > 0 and self.verbose > 0:
            print_msg(f"Epoch {self.stopped_epoch + 1}: early stopping")
        if self.restore_best_weights and self.best_weights is not None:
            if self.verbose > 0:
                print_msg(f"Restoring model weights from the end of the best epoch: {self.best_epoch + 1}.")
            self.model.set_weights(self.best_weights)
