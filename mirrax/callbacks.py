"""Callbacks for `mirrax.Model.fit`, `evaluate` and `predict`, as `keras.callbacks`.

Same protocol (`Callback` hooks, `set_model`, `set_params`), names, arguments and log keys
(`"loss"`, `"accuracy"`, `"val_loss"`, `"learning_rate"`) as Keras 3::

    model.fit(x, y, epochs=50, validation_split=0.2, callbacks=[
        mirrax.callbacks.EarlyStopping(patience=3, restore_best_weights=True),
        mirrax.callbacks.ReduceLROnPlateau(factor=0.5, patience=2),
        mirrax.callbacks.CSVLogger("training.csv"),
        mirrax.callbacks.TensorBoard("logs"),
    ])
"""

from mirrax._src.training.callbacks import BackupAndRestore as BackupAndRestore
from mirrax._src.training.callbacks import Callback as Callback
from mirrax._src.training.callbacks import CallbackList as CallbackList
from mirrax._src.training.callbacks import CSVLogger as CSVLogger
from mirrax._src.training.callbacks import EarlyStopping as EarlyStopping
from mirrax._src.training.callbacks import History as History
from mirrax._src.training.callbacks import LambdaCallback as LambdaCallback
from mirrax._src.training.callbacks import LearningRateScheduler as LearningRateScheduler
from mirrax._src.training.callbacks import ModelCheckpoint as ModelCheckpoint
from mirrax._src.training.callbacks import ProgbarLogger as ProgbarLogger
from mirrax._src.training.callbacks import ReduceLROnPlateau as ReduceLROnPlateau
from mirrax._src.training.callbacks import TensorBoard as TensorBoard
from mirrax._src.training.callbacks import TerminateOnNaN as TerminateOnNaN

__all__ = [
    "BackupAndRestore",
    "CSVLogger",
    "Callback",
    "CallbackList",
    "EarlyStopping",
    "History",
    "LambdaCallback",
    "LearningRateScheduler",
    "ModelCheckpoint",
    "ProgbarLogger",
    "ReduceLROnPlateau",
    "TensorBoard",
    "TerminateOnNaN",
]
