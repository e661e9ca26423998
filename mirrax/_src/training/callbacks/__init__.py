"""Keras 3's callbacks for `mirrax.Model.fit / evaluate / predict`: same protocol, names, log keys.

One class per module. Public names are re-exported by `mirrax.callbacks`; the training loop
imports `CallbackList` from here.
"""

from mirrax._src.training.callbacks.backup_and_restore import (
    BackupAndRestore as BackupAndRestore,
)
from mirrax._src.training.callbacks.callback import Callback as Callback
from mirrax._src.training.callbacks.callback_list import CallbackList as CallbackList
from mirrax._src.training.callbacks.csv_logger import CSVLogger as CSVLogger
from mirrax._src.training.callbacks.early_stopping import EarlyStopping as EarlyStopping
from mirrax._src.training.callbacks.history import History as History
from mirrax._src.training.callbacks.lambda_callback import LambdaCallback as LambdaCallback
from mirrax._src.training.callbacks.learning_rate_scheduler import (
    LearningRateScheduler as LearningRateScheduler,
)
from mirrax._src.training.callbacks.model_checkpoint import ModelCheckpoint as ModelCheckpoint
from mirrax._src.training.callbacks.progbar_logger import ProgbarLogger as ProgbarLogger
from mirrax._src.training.callbacks.reduce_lr_on_plateau import (
    ReduceLROnPlateau as ReduceLROnPlateau,
)
from mirrax._src.training.callbacks.tensorboard import TensorBoard as TensorBoard
from mirrax._src.training.callbacks.terminate_on_nan import TerminateOnNaN as TerminateOnNaN

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
