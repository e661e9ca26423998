"""`History`: records every epoch's logs; `fit` returns it (as `keras.callbacks.History`)."""

from __future__ import annotations

from mirrax._src.training.callbacks.callback import Callback


class History(Callback):
    """Records the logs of every epoch, as `keras.callbacks.History`.

    `CallbackList(add_history=True)` adds one to every `fit`, and `fit` returns it.

    Attributes:
      history: `{key: [value of epoch 0, value of epoch 1, ...]}` for every log key seen
        (`"loss"`, `"accuracy"`, `"val_loss"`, `"learning_rate"`, ...). A key that appears only
        in later epochs (validation every other epoch) has one entry per epoch it appeared in.
      epoch: the 0-based indices of the epochs recorded, in order.

    After each epoch it sets `model.history = self` (as Keras), so the model's `history`
    attribute is the latest run's record.
    """

    def __init__(self):
        super().__init__()
        self.history: dict = {}
        self.epoch: list = []

    def on_train_begin(self, logs: dict | None = None) -> None:
        """Starts a new list of epoch indices (as Keras; `history` keeps what it had)."""
        self.epoch = []

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        """Appends `epoch` and every value of `logs` to the record."""
        logs = logs or {}
        self.epoch.append(epoch)
        for key, value in logs.items():
            self.history.setdefault(key, []).append(value)
        if self.model is not None:
            self.model.history = self
