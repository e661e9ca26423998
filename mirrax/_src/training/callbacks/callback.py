"""`Callback`: the base class of every callback, with Keras 3's hooks, all no-ops."""

from __future__ import annotations

from typing import Any


class Callback:
    """Base class for objects that `Model.fit`, `evaluate` and `predict` call back, as
    `keras.callbacks.Callback`.

    Subclass it and override the hooks you need; the others do nothing. The training loop calls:

    - `on_train_begin(logs)` / `on_train_end(logs)` once per `fit`;
    - `on_epoch_begin(epoch, logs)` / `on_epoch_end(epoch, logs)`: `epoch` is the 0-based epoch
      index (as Keras: the first epoch is 0, printed as "Epoch 1/N");
    - `on_train_batch_begin(batch, logs)` / `on_train_batch_end(batch, logs)`: `batch` is the
      0-based index of the step within the epoch;
    - `on_test_begin/end(logs)`, `on_test_batch_begin/end(batch, logs)` in `evaluate` (and in
      the validation of `fit`); `on_predict_begin/end(logs)`,
      `on_predict_batch_begin/end(batch, logs)` in `predict`.

    `logs` is a dict of Python floats with Keras's keys: `"loss"`, the metric names
    (`"accuracy"`), their validation twins (`"val_loss"`, `"val_accuracy"`) in epoch-end logs,
    and `"learning_rate"` in epoch-end logs when the optimizer has one. Training-batch logs hold
    the running means over the epoch so far. Epoch-end logs are one dict shared by every
    callback in order, so a key a callback adds is seen by those after it (as Keras).

    `on_batch_begin` / `on_batch_end` are Keras's older names: the training-batch hooks call
    them by default.

    Attributes:
      model: the `mirrax.Model` being trained (set by `set_model`); callbacks read and write
        `model.stop_training`, `model.optimizer.learning_rate`, `model.get_weights()` /
        `model.set_weights(...)`.
      params: `{"epochs": int, "steps": int or None (steps per epoch), "verbose": int}`.
    """

    def __init__(self):
        # None until the loop calls `set_model` / `set_params`, which it does before any hook, so
        # the hooks use them unchecked. Any: the model is a `mirrax.Model`, whose module imports
        # this one.
        self.model: Any = None
        self.params: Any = None

    def set_params(self, params: dict) -> None:
        """Receives the run's parameters: `{"epochs", "steps" (per epoch, or None), "verbose"}`."""
        self.params = params

    def set_model(self, model) -> None:
        """Receives the model the callback is used with."""
        self.model = model

    # -- what the training loop asks of a callback (mirrax's own) -------------------------------

    def needs_batch_logs(self, hook: str) -> bool:
        """Whether this callback reads the logs passed to `hook` ("on_train_batch_end",
        "on_test_batch_end", "on_predict_batch_end"): reading them waits for the step, so the
        loop makes them only when some callback needs them. Default: when the subclass
        overrides that hook (or, for training, `on_batch_end`), or sets it on the instance (as
        `LambdaCallback` does). Override it where a hook does not always read its logs.
        """
        names = (hook, "on_batch_end") if hook == "on_train_batch_end" else (hook,)
        return any(
            name in vars(self) or getattr(type(self), name) is not getattr(Callback, name) for name in names
        )

    def needs_model_between_batches(self, kind: str) -> bool:
        """Whether a hook of this callback between two `kind` ("train", "test", "predict")
        batches may read or change the model (weights, optimizer, metrics, layers): the loop
        then writes the step's state into the model before each such hook; otherwise it
        carries the state and writes it at the end of the pass (docs/design.md, "Carried
        state in fit, evaluate and predict"). Default: when the subclass overrides (or the
        instance sets) `on_{kind}_batch_begin` or `on_{kind}_batch_end` (for training also
        `on_batch_begin` / `on_batch_end`). Override it where those hooks only read their
        logs or count batches.
        """
        return overrides_batch_hooks(self, kind, Callback)

    def resume_point(self) -> tuple | None:
        """Where `fit` resumes after `on_train_begin`: (epoch index, batches of that epoch
        already done), or None (start at `initial_epoch`). `BackupAndRestore` returns the
        position of the backup it restored; the first callback with one wins."""
        return None

    # -- old-style training-batch names -------------------------------------------------------

    def on_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        """Older name of `on_train_batch_begin` (as Keras); called by it by default."""

    def on_batch_end(self, batch: int, logs: dict | None = None) -> None:
        """Older name of `on_train_batch_end` (as Keras); called by it by default."""

    # -- fit ------------------------------------------------------------------------------------

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        """Called at the start of epoch `epoch` (0-based index) in `fit`."""

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        """Called at the end of epoch `epoch` (0-based) with the epoch's training and
        validation results (`"loss"`, `"val_loss"`, metrics, `"learning_rate"`)."""

    def on_train_begin(self, logs: dict | None = None) -> None:
        """Called once at the start of `fit`."""

    def on_train_end(self, logs: dict | None = None) -> None:
        """Called once at the end of `fit` with the last epoch's logs."""

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        """Called before training step `batch` (0-based index within the epoch)."""
        self.on_batch_begin(batch, logs=logs)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        """Called after training step `batch` (0-based) with the running means of the epoch."""
        self.on_batch_end(batch, logs=logs)

    # -- evaluate -------------------------------------------------------------------------------

    def on_test_begin(self, logs: dict | None = None) -> None:
        """Called at the start of `evaluate` (and of each validation run in `fit`)."""

    def on_test_end(self, logs: dict | None = None) -> None:
        """Called at the end of `evaluate` with its results (`"loss"`, metrics)."""

    def on_test_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        """Called before evaluation step `batch` (0-based)."""

    def on_test_batch_end(self, batch: int, logs: dict | None = None) -> None:
        """Called after evaluation step `batch` (0-based)."""

    # -- predict --------------------------------------------------------------------------------

    def on_predict_begin(self, logs: dict | None = None) -> None:
        """Called at the start of `predict`."""

    def on_predict_end(self, logs: dict | None = None) -> None:
        """Called at the end of `predict`."""

    def on_predict_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        """Called before prediction step `batch` (0-based)."""

    def on_predict_batch_end(self, batch: int, logs: dict | None = None) -> None:
        """Called after prediction step `batch` (0-based); `logs["outputs"]` holds its outputs."""


HOOKS = (
    "on_batch_begin",
    "on_batch_end",
    "on_epoch_begin",
    "on_epoch_end",
    "on_train_begin",
    "on_train_end",
    "on_train_batch_begin",
    "on_train_batch_end",
    "on_test_begin",
    "on_test_end",
    "on_test_batch_begin",
    "on_test_batch_end",
    "on_predict_begin",
    "on_predict_end",
    "on_predict_batch_begin",
    "on_predict_batch_end",
)
"""The names of every hook a `Callback` has."""


def overrides_batch_hooks(callback: Callback, kind: str, base: type) -> bool:
    """Whether `callback`'s class overrides (or the instance sets) a hook between `kind`
    batches that `base` (one of its classes) does not define: `on_{kind}_batch_begin` / `_end`,
    for "train" also `on_batch_begin` / `_end`. A class whose own batch hooks only read their
    logs answers `needs_model_between_batches` with this and itself as `base`, so a subclass
    that adds its own hooks is still seen."""
    names: tuple[str, ...] = (f"on_{kind}_batch_begin", f"on_{kind}_batch_end")
    if kind == "train":
        names += ("on_batch_begin", "on_batch_end")
    return any(
        name in vars(callback) or getattr(type(callback), name) is not getattr(base, name) for name in names
    )
