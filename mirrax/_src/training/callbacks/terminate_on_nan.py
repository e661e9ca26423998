"""`TerminateOnNaN`: stops `fit` at the first training step whose loss is NaN or infinite."""

from __future__ import annotations

import math

from mirrax._src import argument_checks
from mirrax._src.training.callbacks.callback import Callback
from mirrax._src.training.progbar import print_msg


class TerminateOnNaN(Callback):
    """Stops training when the loss becomes NaN or infinite, as `keras.callbacks.TerminateOnNaN`.

    After each training step, if `logs["loss"]` is NaN or ±inf, it prints
    `Batch {batch}: Invalid loss, terminating training` (`batch`: the 0-based step index
    within the epoch) and sets `model.stop_training = True`; `fit` then ends the epoch and calls
    `on_train_end` as usual. With `raise_error=True` it raises instead,
    which skips the other callbacks' `on_train_end` (Keras 3's newer option). Where the batch
    hooks get no logs (ParameterServerStrategy) the epoch's loss is checked at its end instead
    (`Epoch {epoch}: Invalid loss, terminating training`).

    Args:
      raise_error: raise `RuntimeError` instead of stopping gracefully.

    Raises:
      RuntimeError: with `raise_error=True`, at the first invalid loss.
    """

    def __init__(self, raise_error: bool = False):
        super().__init__()
        self.raise_error = argument_checks.flag("TerminateOnNaN", "raise_error", raise_error)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        """Checks `logs["loss"]`; stops (or raises) on NaN or inf."""
        self._check(logs, f"batch {batch}", f"Batch {batch}")

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        """Checks the epoch's loss when no batch check stopped it (batch hooks without logs)."""
        if not self.model.stop_training:
            self._check(logs, f"the end of epoch {epoch}", f"Epoch {epoch}")

    def _check(self, logs, where: str, what: str) -> None:
        loss = (logs or {}).get("loss")
        if loss is None:
            return
        loss = float(loss)
        if math.isnan(loss) or math.isinf(loss):
            if self.raise_error:
                raise RuntimeError(
                    f"NaN or Inf loss encountered at {where}. Loss value: {loss}. "
                    "Terminating training immediately."
                )
            print_msg(f"{what}: Invalid loss, terminating training")
            self.model.stop_training = True
