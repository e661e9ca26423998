"""Keras-named losses built on optax: `mirrax.losses.SparseCategoricalCrossentropy()` and friends.

`loss.per_example(y_true, y_pred)` gives one float32 loss per example; `loss(y_true, y_pred,
sample_weight)` is `mirrax.compute_average_loss` of it (inside `strategy.run`, this replica's
share of the global mean); with `reduction=None` (`Reduction.NONE`), one loss per example.
`get(identifier)` resolves Keras's names ("mse", "huber", ...).
"""

from mirrax._src.training.loss_reductions import Reduction as Reduction
from mirrax._src.training.losses import BinaryCrossentropy as BinaryCrossentropy
from mirrax._src.training.losses import CategoricalCrossentropy as CategoricalCrossentropy
from mirrax._src.training.losses import Huber as Huber
from mirrax._src.training.losses import Loss as Loss
from mirrax._src.training.losses import LossFunctionWrapper as LossFunctionWrapper
from mirrax._src.training.losses import MeanAbsoluteError as MeanAbsoluteError
from mirrax._src.training.losses import MeanSquaredError as MeanSquaredError
from mirrax._src.training.losses import (
    SparseCategoricalCrossentropy as SparseCategoricalCrossentropy,
)
from mirrax._src.training.losses import get as get

__all__ = [
    "BinaryCrossentropy",
    "CategoricalCrossentropy",
    "Huber",
    "Loss",
    "LossFunctionWrapper",
    "MeanAbsoluteError",
    "MeanSquaredError",
    "Reduction",
    "SparseCategoricalCrossentropy",
    "get",
]
