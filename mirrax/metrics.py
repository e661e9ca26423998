"""Keras metrics as NNX objects whose sums and counts the replicas add up (`mirrax.metrics.AUC()`).

Pass metrics to `strategy.run` in `args` and call `update_state` inside; read `result()` and call
`reset_state()` outside. `get(identifier, loss=None)` resolves Keras's names ("accuracy" by the
loss, "precision", "auc", "mse", ...).
"""

from mirrax._src.training.confusion_metrics import AUC as AUC
from mirrax._src.training.confusion_metrics import Precision as Precision
from mirrax._src.training.confusion_metrics import Recall as Recall
from mirrax._src.training.metric_registry import get as get
from mirrax._src.training.metrics import Accuracy as Accuracy
from mirrax._src.training.metrics import BinaryAccuracy as BinaryAccuracy
from mirrax._src.training.metrics import CategoricalAccuracy as CategoricalAccuracy
from mirrax._src.training.metrics import Mean as Mean
from mirrax._src.training.metrics import MeanAbsoluteError as MeanAbsoluteError
from mirrax._src.training.metrics import MeanMetricWrapper as MeanMetricWrapper
from mirrax._src.training.metrics import MeanSquaredError as MeanSquaredError
from mirrax._src.training.metrics import Metric as Metric
from mirrax._src.training.metrics import (
    SparseCategoricalAccuracy as SparseCategoricalAccuracy,
)
from mirrax._src.training.metrics import Sum as Sum

__all__ = [
    "AUC",
    "Accuracy",
    "BinaryAccuracy",
    "CategoricalAccuracy",
    "Mean",
    "MeanAbsoluteError",
    "MeanMetricWrapper",
    "MeanSquaredError",
    "Metric",
    "Precision",
    "Recall",
    "SparseCategoricalAccuracy",
    "Sum",
    "get",
]
