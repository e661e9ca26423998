"""`ProgbarLogger`: the progress bar and epoch lines of `fit`, `evaluate` and `predict`."""

from __future__ import annotations

import sys

from mirrax._src.training.callbacks.callback import Callback, overrides_batch_hooks
from mirrax._src.training.progbar import Progbar, print_msg


class ProgbarLogger(Callback):
    """Prints progress to stdout, as `keras.callbacks.ProgbarLogger` (tf.keras 2's look).

    With `params["verbose"]`:

    - 1 (or `"auto"`): an `Epoch 3/10` line, then a bar redrawn after every step on a terminal;
      the epoch's last line holds the validation results too::

          Epoch 3/10
          782/782 [==============================] - 15s 18ms/step - loss: 1.2345 - val_loss: 0.9876

      When stdout is not a terminal (a log file, CI) only that last line is written, once per
      epoch, with no carriage returns.
    - 2: the `Epoch 3/10` line and one line per epoch without the bar
      (`782/782 - 15s 18ms/step - loss: 1.2345 - ...`).
    - 0: nothing.

    The count is the step within the epoch. With `params["steps"]` None (steps unknown) the bar
    shows the count so far (`     13/Unknown - 2s 150ms/step - ...`); at the end of the epoch
    it shows `13/13`, and later epochs use that count as their target (as Keras) until a step
    goes past it. Inside `fit` the validation run is silent (its results are in the epoch's
    line); `evaluate` and `predict` show their own bar.

    `CallbackList(add_progbar=True)` adds one to every run.
    """

    def __init__(self):
        super().__init__()
        self.verbose = 1
        self.epochs = 1
        self.target: int | None = None
        self.seen = 0
        self.progbar: Progbar | None = None
        self._inferred_target: int | None = None
        self._called_in_fit = False

    def set_params(self, params: dict) -> None:
        """Reads `verbose` ("auto" means 1), `epochs` and `steps` (per epoch, or None)."""
        super().set_params(params)
        verbose = params.get("verbose", 1)
        self.verbose = 1 if verbose == "auto" else int(verbose)
        self.epochs = params.get("epochs", 1)
        self.target = params.get("steps")
        self._inferred_target = None

    def on_train_begin(self, logs: dict | None = None) -> None:
        """Marks that validation runs of this `fit` must be silent."""
        self._called_in_fit = True

    def on_train_end(self, logs: dict | None = None) -> None:
        """Ends the `fit`; a later `evaluate` with this logger shows its bar again."""
        self._called_in_fit = False

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        """Prints `Epoch {epoch + 1}/{epochs}` and starts the epoch's bar."""
        self._start_progbar()
        if self.verbose:
            print_msg(f"Epoch {epoch + 1}/{self.epochs}")

    def needs_batch_logs(self, hook: str) -> bool:
        # Only the live bar on a terminal shows batch values (predict's shows none); elsewhere
        # the epoch's line.
        return self.verbose == 1 and sys.stdout.isatty() and hook != "on_predict_batch_end"

    def needs_model_between_batches(self, kind: str) -> bool:
        # The bar reads its logs only; a subclass's own batch hooks may read the model.
        return overrides_batch_hooks(self, kind, ProgbarLogger)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        """Redraws the bar at step `batch + 1` with the running logs."""
        self._update(batch, logs)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        """Prints the epoch's final line with the training and validation logs."""
        self._finalize(logs)

    def on_test_begin(self, logs: dict | None = None) -> None:
        """Starts the bar of `evaluate` (silent inside `fit`)."""
        if not self._called_in_fit:
            self._start_progbar()

    def on_test_batch_end(self, batch: int, logs: dict | None = None) -> None:
        """Redraws the bar of `evaluate` (silent inside `fit`)."""
        if not self._called_in_fit:
            self._update(batch, logs)

    def on_test_end(self, logs: dict | None = None) -> None:
        """Prints the final line of `evaluate` (silent inside `fit`)."""
        if not self._called_in_fit:
            self._finalize(logs)

    def on_predict_begin(self, logs: dict | None = None) -> None:
        """Starts the bar of `predict`."""
        self._start_progbar()

    def on_predict_batch_end(self, batch: int, logs: dict | None = None) -> None:
        """Redraws the bar of `predict` (without the outputs)."""
        self._update(batch, None)

    def on_predict_end(self, logs: dict | None = None) -> None:
        """Prints the final line of `predict`."""
        self._finalize(None)

    def _start_progbar(self) -> Progbar:
        self.seen = 0
        target = self.target if self.target is not None else self._inferred_target
        # `()`: fit's logs are already running means, so the bar shows them as given.
        self.progbar = Progbar(target=target, verbose=self.verbose, stateless_metrics=())
        return self.progbar

    def _update(self, batch: int, logs: dict | None) -> None:
        progbar = self.progbar if self.progbar is not None else self._start_progbar()
        self.seen = batch + 1
        if self.verbose == 1:
            progbar.update(self.seen, logs or {}, finalize=False)

    def _finalize(self, logs: dict | None) -> None:
        progbar = self.progbar if self.progbar is not None else self._start_progbar()
        if self.target is None:
            self._inferred_target = self.seen or None
        if progbar.target is None or self.seen > progbar.target:
            progbar.target = self.seen or None
        # The true count: fewer steps than the target when training stopped mid-epoch.
        count = self.seen if self.seen else (progbar.target or 0)
        progbar.update(count, logs or {}, finalize=True)
