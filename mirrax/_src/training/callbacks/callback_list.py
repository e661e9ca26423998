"""`CallbackList`: holds a run's callbacks and calls each hook on all of them, in order."""

from __future__ import annotations

import warnings
from collections.abc import Iterable

from mirrax import errors
from mirrax._src.training.callbacks.callback import Callback
from mirrax._src.training.callbacks.history import History
from mirrax._src.training.callbacks.progbar_logger import ProgbarLogger


def _flatten(callbacks) -> list:
    if callbacks is None:
        return []
    if isinstance(callbacks, Callback):
        return [callbacks]
    if isinstance(callbacks, (str, bytes)) or not isinstance(callbacks, Iterable):
        raise errors.InvalidArgumentTypeError(
            "callbacks must be a list of mirrax.callbacks.Callback instances; received "
            f"{type(callbacks).__name__} {callbacks!r}. Pass e.g. "
            "callbacks=[mirrax.callbacks.EarlyStopping()]."
        )
    flat = []
    for item in callbacks:
        flat.extend(_flatten(item) if isinstance(item, (list, tuple)) else [item])
    for item in flat:
        if not isinstance(item, Callback) and (type(item).__module__ or "").startswith("keras"):
            name = type(item).__name__
            raise errors.InvalidArgumentTypeError(
                f"callbacks: {name} is a Keras callback, which drives a keras.Model; mirrax's "
                f"fit takes mirrax.callbacks.{name} (the same arguments and hooks; `from mirrax "
                "import callbacks`), or a mirrax.callbacks.Callback subclass."
            )
        if not isinstance(item, Callback):
            raise errors.InvalidArgumentTypeError(
                "callbacks must be mirrax.callbacks.Callback instances; received a "
                f"{type(item).__name__} ({item!r}). Subclass mirrax.callbacks.Callback, or "
                "wrap functions in mirrax.callbacks.LambdaCallback(on_epoch_end=...)."
            )
    return flat


def _pythonify(logs: dict | None) -> dict:
    """Logs with NumPy / JAX scalars turned into Python floats (other values kept), as Keras."""
    result: dict = {}
    for key, value in (logs or {}).items():
        if isinstance(value, (str, bytes)):
            result[key] = value
            continue
        try:
            result[key] = float(value)
        except (TypeError, ValueError):
            result[key] = value
    return result


class CallbackList(Callback):
    """The callbacks of one `fit` / `evaluate` / `predict`, as `keras.callbacks.CallbackList`.

    Every hook of this object calls the same hook of each callback, in list order. The
    training loop creates one per run::

        callbacks = CallbackList(user_callbacks, add_history=True, add_progbar=verbose != 0,
                                 model=model, verbose=verbose, epochs=epochs, steps=steps)

    Args:
      callbacks: a list (nested lists are flattened) of `Callback`s, a single `Callback`, or
        None.
      add_history: append a `History` unless the list already holds one (as Keras).
      add_progbar: append a `ProgbarLogger` unless the list already holds one (as Keras).
      model: the model, passed to every callback with `set_model`; `model.history` is set to
        the `History`.
      **params: the run's parameters (`epochs`, `steps` per epoch or None, `verbose`), passed
        to every callback with `set_params` when given.

    Batch-end logs are copied with NumPy / JAX scalars turned into Python floats (as Keras's
    `_pythonify_logs`, but key order is kept: the progress bar shows `loss` first). As Keras,
    batch hooks get `logs` as a keyword argument, the other hooks positionally. Epoch-end
    logs are passed as the SAME dict to every callback, so a key added by one (e.g.
    `"learning_rate"`) is seen by the next. Unlike Keras, batch hooks run in the calling thread
    (no asynchronous dispatch): a callback sees the step it was called for.

    Raises:
      TypeError: an element of `callbacks` is not a `Callback`.
    """

    def __init__(
        self, callbacks=None, add_history: bool = False, add_progbar: bool = False, model=None, **params
    ):
        super().__init__()
        self.callbacks: list = _flatten(callbacks)
        self._history: History | None = None
        self._progbar: ProgbarLogger | None = None
        for callback in self.callbacks:
            if isinstance(callback, ProgbarLogger):
                self._progbar = callback
            elif isinstance(callback, History):
                self._history = callback
        if self._history is None and add_history:
            self._history = History()
            self.callbacks.append(self._history)
        if self._progbar is None and add_progbar:
            self._progbar = ProgbarLogger()
            self.callbacks.append(self._progbar)
        self.set_model(model)
        self.set_params(params)

    def append(self, callback: Callback) -> None:
        """Adds one callback at the end of the list.

        Raises:
          TypeError: `callback` is not a `Callback`.
        """
        (callback,) = _flatten([callback])
        self.callbacks.append(callback)
        if self.model is not None:
            callback.set_model(self.model)
        if self.params:
            callback.set_params(self.params)

    def set_params(self, params: dict) -> None:
        """Passes `params` to every callback (nothing is passed when `params` is empty)."""
        self.params = params
        if params:
            for callback in self.callbacks:
                callback.set_params(params)

    def set_model(self, model) -> None:
        """Passes `model` to every callback and sets `model.history` to the `History` (if any)."""
        if model is None:
            return
        super().set_model(model)
        if self._history is not None:
            model.history = self._history
        for callback in self.callbacks:
            callback.set_model(model)

    def needs_batch_logs(self, hook: str) -> bool:
        """Whether any callback reads the logs of `hook` (see `Callback.needs_batch_logs`).

        Raises:
          InvalidArgumentTypeError: a callback's answer is not a bool.
        """
        return self._any(lambda callback: callback.needs_batch_logs(hook), f"needs_batch_logs({hook!r})")

    def _any(self, ask, what: str) -> bool:
        """Whether `ask(callback)` is True for any callback, each answer checked to be a bool."""
        for callback in self.callbacks:
            answer = ask(callback)
            if not isinstance(answer, bool):
                raise errors.InvalidArgumentTypeError(
                    f"{type(callback).__name__}.{what} returned {answer!r}; it must return True or False."
                )
            if answer:
                return True
        return False

    def needs_model_between_batches(self, kind: str) -> bool:
        """Whether any callback's hook between `kind` batches may read or change the model
        (see `Callback.needs_model_between_batches`).

        Raises:
          InvalidArgumentTypeError: a callback's answer is not a bool.
        """
        return self._any(
            lambda callback: callback.needs_model_between_batches(kind),
            f"needs_model_between_batches({kind!r})",
        )

    def resume_point(self) -> tuple | None:
        """The first callback's resume point that is not None (see `Callback.resume_point`).

        Raises:
          InvalidArgumentError: a resume point that is not (epoch, step) of ints >= 0.
        """
        for callback in self.callbacks:
            point = callback.resume_point()
            if point is None:
                continue
            if not (
                isinstance(point, tuple)
                and len(point) == 2
                and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in point)
            ):
                raise errors.InvalidArgumentError(
                    f"{type(callback).__name__}.resume_point() returned {point!r}; it must "
                    "return None or (epoch index, batches of that epoch already done), two "
                    "ints >= 0, e.g. (2, 0)."
                )
            return point
        return None

    def fit_start(self, initial_epoch: int, epochs: int, steps_per_epoch: int | None) -> tuple:
        """(epoch index, batches of it to skip) where `fit` starts: a callback's resume point
        (a restored backup: BackupAndRestore), else (initial_epoch, 0). Called by every fit
        loop after `on_train_begin`, which restores the backup.

        A resume point past the epoch's `steps_per_epoch` batches (None: not known) restarts
        that epoch, as Keras does with every mid-epoch resume, and one at or after `epochs`
        trains nothing; each is warned about (UserWarning).
        """
        first_epoch, first_step = self.resume_point() or (initial_epoch, 0)
        if first_step and steps_per_epoch is not None and first_step >= steps_per_epoch:
            # The backup was taken at batch `first_step` of an epoch that now has fewer
            # batches (another batch_size, less data): rather than an epoch of no steps.
            warnings.warn(
                f"fit: a callback's resume point (a restored backup) resumes epoch "
                f"{first_epoch + 1} at batch {first_step + 1}, but this input has "
                f"{steps_per_epoch} batch(es) per epoch; epoch {first_epoch + 1} restarts at its "
                "first batch.",
                stacklevel=4,
            )
            first_step = 0
        if first_epoch >= epochs:
            warnings.warn(
                f"fit: a callback's resume point (a restored backup) is epoch {first_epoch + 1}, "
                f"at or after epochs={epochs}: training is already done and this fit trains "
                "nothing. Pass a larger epochs to train more.",
                stacklevel=4,
            )
        return first_epoch, first_step

    def _call(self, hook: str, *args, **kwargs) -> None:
        for callback in self.callbacks:
            getattr(callback, hook)(*args, **kwargs)

    def on_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        """Calls `on_batch_begin` of every callback."""
        self._call("on_batch_begin", batch, logs=logs or {})

    def on_batch_end(self, batch: int, logs: dict | None = None) -> None:
        """Calls `on_batch_end` of every callback (logs as Python floats)."""
        self._call("on_batch_end", batch, logs=_pythonify(logs))

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        """Calls `on_epoch_begin` of every callback."""
        self._call("on_epoch_begin", epoch, logs if logs is not None else {})

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        """Calls `on_epoch_end` of every callback, all with the same `logs` dict."""
        self._call("on_epoch_end", epoch, logs if logs is not None else {})

    def on_train_begin(self, logs: dict | None = None) -> None:
        """Calls `on_train_begin` of every callback."""
        self._call("on_train_begin", logs if logs is not None else {})

    def on_train_end(self, logs: dict | None = None) -> None:
        """Calls `on_train_end` of every callback."""
        self._call("on_train_end", logs if logs is not None else {})

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        """Calls `on_train_batch_begin` of every callback."""
        self._call("on_train_batch_begin", batch, logs=logs or {})

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        """Calls `on_train_batch_end` of every callback (logs as Python floats)."""
        self._call("on_train_batch_end", batch, logs=_pythonify(logs))

    def on_test_begin(self, logs: dict | None = None) -> None:
        """Calls `on_test_begin` of every callback."""
        self._call("on_test_begin", logs if logs is not None else {})

    def on_test_end(self, logs: dict | None = None) -> None:
        """Calls `on_test_end` of every callback."""
        self._call("on_test_end", logs if logs is not None else {})

    def on_test_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        """Calls `on_test_batch_begin` of every callback."""
        self._call("on_test_batch_begin", batch, logs=logs or {})

    def on_test_batch_end(self, batch: int, logs: dict | None = None) -> None:
        """Calls `on_test_batch_end` of every callback (logs as Python floats)."""
        self._call("on_test_batch_end", batch, logs=_pythonify(logs))

    def on_predict_begin(self, logs: dict | None = None) -> None:
        """Calls `on_predict_begin` of every callback."""
        self._call("on_predict_begin", logs if logs is not None else {})

    def on_predict_end(self, logs: dict | None = None) -> None:
        """Calls `on_predict_end` of every callback."""
        self._call("on_predict_end", logs if logs is not None else {})

    def on_predict_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        """Calls `on_predict_batch_begin` of every callback."""
        self._call("on_predict_batch_begin", batch, logs=logs or {})

    def on_predict_batch_end(self, batch: int, logs: dict | None = None) -> None:
        """Calls `on_predict_batch_end` of every callback (outputs passed as they are)."""
        self._call("on_predict_batch_end", batch, logs=logs or {})
