"""`ModelCheckpoint`: saves the model (or its weights) during `fit`, as Keras 3's."""

from __future__ import annotations

import math
import os
import tempfile
import warnings

from mirrax import errors
from mirrax._src import argument_checks
from mirrax._src.checkpointing.checkpoint import Checkpoint
from mirrax._src.training.callbacks import _monitor
from mirrax._src.training.callbacks._chief import is_chief
from mirrax._src.training.callbacks.backup_and_restore import (
    BatchCounter,
    check_save_freq,
)
from mirrax._src.training.callbacks.callback import Callback, overrides_batch_hooks
from mirrax._src.training.progbar import print_msg


def check_writable_directory(owner: str, filepath: str) -> None:
    """Creates the directory of `filepath`'s fixed part (before any `{field}`) and writes a
    probe file in it, so a path that cannot be written fails before the first step.

    Raises:
      CheckpointWriteError: naming the path, the directory and the OS's reason.
    """
    literal = filepath.split("{", 1)[0]
    directory = os.path.dirname(os.path.abspath(literal)) or os.sep
    try:
        os.makedirs(directory, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".mirrax-write-probe-", dir=directory)
        os.close(fd)
        os.remove(probe)
    except OSError as error:
        raise errors.CheckpointWriteError(
            f"{owner}: cannot write the saves of filepath={filepath!r}: the directory "
            f"{directory!r} cannot be created or written ({type(error).__name__}: "
            f"{error.strerror or error}). Pass a filepath in a writable directory."
        ) from error


class ModelCheckpoint(Callback):
    """Saves the model at some frequency during training, as `keras.callbacks.ModelCheckpoint`.

    `filepath` is formatted with `str.format` for each save: `epoch` (1-based, as Keras), the
    epoch's (or, for batch saves, the batch's) log keys, and, for batch saves, `batch`
    (1-based), e.g. `"ckpt/weights.{epoch:02d}-{val_loss:.2f}"` gives `ckpt/weights.03-0.41`.
    Each save is a directory written atomically by Orbax: with `save_weights_only`, what
    `model.save_weights` writes; otherwise a `mirrax.Checkpoint(model=model)` (module and
    optimizer state; read it all back with `mirrax.Checkpoint(model=model).restore(path)`).
    `model.load_weights(path)` reads the weights of either. An existing directory is replaced
    atomically (the new save is written beside it and swapped in by rename), so a kill
    during a save never loses the previous best model.

    With `save_best_only`, a save happens only when `monitor` improves on the best value so
    far (strictly: below it in "min" mode, above it in "max"); the first value improves on
    `initial_value_threshold` when given, else on +inf ("min") / -inf ("max"). With a
    filepath without formatting, the file then always holds the best model.

    Every process calls the save (Orbax lets process 0 write); only process 0 creates the
    parent directory and prints.

    Args:
      filepath: path (a directory, created) of each save, optionally with `{epoch:02d}`,
        `{batch}` and `{<log key>:.2f}`-style fields.
      monitor: the log key `save_best_only` compares, e.g. "val_loss", "accuracy".
      verbose: 1 prints a line per save or skipped save; 0 is silent.
      save_best_only: save only when `monitor` improves.
      save_weights_only: save only the module's variables (`model.save_weights`).
      mode: "min", "max" or "auto" (the direction inferred from the name or from the model's
        metric, as `EarlyStopping`). An unknown mode warns and falls back to "auto".
      save_freq: "epoch" (at the end of every epoch) or a positive int: after every that many
        batches, counted across epochs, with the batch's running logs.
      initial_value_threshold: the value the first monitored value must beat
        (`save_best_only`).

    Raises:
      InvalidArgumentError: `save_freq` is neither "epoch" nor a positive int; at the start of
        training, `save_best_only` with `mode="auto"` and a `monitor` whose direction is
        unknown.
      InvalidArgumentTypeError: `filepath` is not a path, `monitor` not a str, a flag not a
        bool, `verbose` not an int, `initial_value_threshold` not a number.
      UnknownFilepathFieldError (a KeyError): at a save, `filepath` names a field that the
        logs do not have.

    Warns:
      UserWarning: `save_best_only` and the logs lack `monitor`; that save is skipped.
    """

    def __init__(
        self,
        filepath,
        monitor: str = "val_loss",
        verbose: int = 0,
        save_best_only: bool = False,
        save_weights_only: bool = False,
        mode: str = "auto",
        save_freq="epoch",
        initial_value_threshold: float | None = None,
    ):
        super().__init__()
        owner = "ModelCheckpoint"
        if not isinstance(filepath, (str, os.PathLike)) or not os.fspath(filepath):
            raise errors.InvalidArgumentTypeError(
                f"{owner}: filepath must be a non-empty path (str or os.PathLike), e.g. "
                f"'ckpt/weights.{{epoch:02d}}'; received {filepath!r}."
            )
        if not isinstance(monitor, str):
            raise errors.InvalidArgumentTypeError(
                f"{owner}: monitor must be a log key (a str such as 'val_loss'); received "
                f"{monitor!r} of type {type(monitor).__name__}."
            )
        if isinstance(verbose, bool) or not isinstance(verbose, int):
            raise errors.InvalidArgumentTypeError(f"{owner}: verbose must be 0 or 1; received {verbose!r}.")
        if initial_value_threshold is not None and (
            isinstance(initial_value_threshold, bool) or not isinstance(initial_value_threshold, (int, float))
        ):
            raise errors.InvalidArgumentTypeError(
                f"{owner}: initial_value_threshold must be a number or None; received "
                f"{initial_value_threshold!r}."
            )
        self.filepath = os.fspath(filepath)
        self.monitor = monitor
        self.verbose = verbose
        self.save_best_only = argument_checks.flag(owner, "save_best_only", save_best_only)
        self.save_weights_only = argument_checks.flag(owner, "save_weights_only", save_weights_only)
        self.mode = _monitor.check_mode(mode, "ModelCheckpoint")
        self.save_freq = check_save_freq(save_freq, "ModelCheckpoint")
        self.initial_value_threshold = initial_value_threshold
        self.monitor_op: str | None = None  # "min" or "max" once resolved
        self.best: float | None = initial_value_threshold
        self._epoch = 0
        self._counter: BatchCounter | None = None

    def needs_batch_logs(self, hook: str) -> bool:
        # Batch-level saves monitor the batch's logs; epoch-level saves need none.
        return hook == "on_train_batch_end" and self.save_freq != "epoch"

    def needs_model_between_batches(self, kind: str) -> bool:
        # Batch-level saves read the model; epoch-level ones only count batches.
        return (kind == "train" and self.save_freq != "epoch") or overrides_batch_hooks(
            self, kind, ModelCheckpoint
        )

    def _resolve_mode(self) -> None:
        self.monitor_op = self.mode if self.mode != "auto" else _monitor.infer_mode(self.monitor, self.model)
        if self.monitor_op is None:
            raise errors.InvalidArgumentError(
                f"ModelCheckpoint received monitor={self.monitor!r} with mode='auto', but "
                "cannot tell whether that quantity should be minimized or maximized. Pass "
                "mode='max' to keep the highest value, or mode='min' to keep the lowest."
            )
        if self.best is None:
            self.best = math.inf if self.monitor_op == "min" else -math.inf

    def on_train_begin(self, logs: dict | None = None) -> None:
        """Resolves `mode="auto"` (with `save_best_only`) and restarts the batch count.

        The best value is kept across `fit` calls, as Keras's.

        Raises:
          InvalidArgumentError: `save_best_only` with epoch saves and a `monitor` that fit will
            not log (e.g. the default "val_loss" without validation data): nothing would ever
            be saved (Keras warns at every epoch end instead).
          CheckpointWriteError: the chief cannot create or write the directory the saves go
            to, so the first save would fail after an epoch of training.
        """
        if is_chief():
            check_writable_directory("ModelCheckpoint", self.filepath)
        if self.save_best_only and self.save_freq == "epoch":
            _monitor.check_monitor_is_logged("ModelCheckpoint", self.monitor, self.params)
        if self.save_best_only and self.monitor_op is None:
            self._resolve_mode()
        self._counter = BatchCounter(self.save_freq) if self.save_freq != "epoch" else None

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._epoch = epoch
        if self._counter is not None:
            self._counter.start_epoch(0)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        """Saves after every `save_freq` batches (int `save_freq` only)."""
        if self._counter is not None and self._counter.due(batch):
            self._save_model(self._epoch, batch, logs)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        """Saves at the end of the epoch (`save_freq="epoch"`)."""
        if self.save_freq == "epoch":
            self._save_model(epoch, None, logs)

    def _file_path(self, epoch: int, batch: int | None, logs: dict) -> str:
        fields = dict(logs, epoch=epoch + 1)
        if batch is not None and "batch" not in logs:
            fields["batch"] = batch + 1
        try:
            return self.filepath.format(**fields)
        except KeyError as e:
            raise errors.UnknownFilepathFieldError(
                f'Failed to format this callback filepath: "{self.filepath}". Reason: {e}. '
                f"Available fields: {sorted(fields)}."
            ) from None

    def _save_model(self, epoch: int, batch: int | None, logs: dict | None) -> None:
        logs = logs or {}
        path = os.path.abspath(self._file_path(epoch, batch, logs))
        if self.save_best_only:
            if self.monitor_op is None:
                self._resolve_mode()
            current = logs.get(self.monitor)
            if current is None:
                warnings.warn(
                    f"Can save best model only with {self.monitor} available, skipping. "
                    + _monitor.missing_monitor_message("ModelCheckpoint", self.monitor, logs),
                    stacklevel=2,
                )
                return
            current = float(current)
            assert self.best is not None  # _resolve_mode set it
            improved = current < self.best if self.monitor_op == "min" else current > self.best
            if not improved:
                self._print(f"Epoch {epoch + 1}: {self.monitor} did not improve from {self.best:.5f}")
                return
            self._print(
                f"Epoch {epoch + 1}: {self.monitor} improved from {self.best:.5f} to "
                f"{current:.5f}, saving model to {path}"
            )
            self.best = current
        else:
            self._print(f"Epoch {epoch + 1}: saving model to {path}")
        if is_chief():
            os.makedirs(os.path.dirname(path), exist_ok=True)
        if self.save_weights_only:
            self.model.save_weights(path, overwrite=True)
        else:
            Checkpoint(model=self.model).write(path)

    def _print(self, message: str) -> None:
        if self.verbose > 0 and is_chief():
            print_msg(f"\n{message}")
