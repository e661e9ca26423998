"""What monitoring callbacks share: which way a logged quantity improves, and reading the rate.

`mode="auto"` follows Keras 3: `loss` (and `val_loss`) improve downwards, and a metric of the
model that declares a direction (`_direction` or `direction`, `"up"` / `"down"`, as Keras 3's
metrics do) improves that way. Beyond that, mirrax knows the Keras metric names (mirrax's
metrics may not carry a direction): accuracies, AUC, precision, recall, F-scores, IoU, R²,
true positives/negatives and correlations improve upwards; losses, errors, crossentropies,
hinge, divergences and false positives/negatives downwards.
"""

from __future__ import annotations

import math
import warnings
from typing import Optional

import numpy as np

_UP = (
    "acc", "auc", "precision", "recall", "f1_score", "fbeta_score", "iou", "r2_score",
    "true_positives", "true_negatives", "cosine_similarity", "correlation", "sensitivity",
    "specificity",
)
_DOWN = (
    "loss", "error", "mse", "mae", "mape", "msle", "crossentropy", "hinge", "divergence",
    "poisson", "logcosh", "false_positives", "false_negatives",
)


def infer_mode(monitor: str, model=None) -> Optional[str]:
    """`"min"` or `"max"` for a logged quantity, or None when its direction is unknown.

    Args:
      monitor: a log key, e.g. `"val_loss"`, `"accuracy"`; a `val_` prefix is ignored.
      model: when given, its `metrics` are searched for one named like `monitor` that declares
        a direction (`_direction` / `direction`: `"up"` or `"down"`).
    """
    name = monitor.removeprefix("val_")
    if name == "loss" or name.endswith("_loss"):
        return "min"
    for metric in _metrics_of(model):
        if getattr(metric, "name", None) != name:
            continue
        direction = getattr(metric, "_direction", None) or getattr(metric, "direction", None)
        if direction == "up":
            return "max"
        if direction == "down":
            return "min"
    if any(part in name for part in _DOWN):
        return "min"
    if any(part in name for part in _UP):
        return "max"
    return None


def _metrics_of(model) -> list:
    try:
        metrics = getattr(model, "metrics", None)
        return list(metrics) if metrics is not None else []
    except Exception:  # a model whose metrics cannot be listed yet has no direction to offer
        return []


def check_mode(mode: str, owner: str) -> str:
    """`mode` if it is "auto", "min" or "max"; otherwise "auto" with a warning (as Keras)."""
    if mode in ("auto", "min", "max"):
        return mode
    warnings.warn(
        f"{owner}: mode={mode!r} is unknown; using mode='auto'. Pass mode='min', 'max' or "
        "'auto'.",
        stacklevel=3,
    )
    return "auto"


def missing_monitor_message(owner: str, monitor: str, logs: dict) -> str:
    """The warning for a monitored key absent from the epoch's logs (names what is there)."""
    available = ",".join(logs.keys()) or "(none)"
    hint = (
        " Validation keys (val_*) appear only when fit is given validation_data or "
        "validation_split, and only in the epochs that validate."
        if monitor.startswith("val_") else ""
    )
    return (
        f"{owner} is conditioned on metric `{monitor}` which is not available. Available "
        f"metrics are: {available}.{hint}"
    )


def get_learning_rate(model, owner: str) -> float:
    """`model.optimizer.learning_rate` as a Python float.

    Raises:
      ValueError: the model has no optimizer or the optimizer no `learning_rate`.
    """
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or not hasattr(optimizer, "learning_rate"):
        raise ValueError(
            f"{owner} needs model.optimizer.learning_rate, but the model's optimizer "
            f"({type(optimizer).__name__}) has none. Compile the model with an optimizer "
            "whose learning rate is a hyperparameter, e.g. 'adam' or "
            "optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)."
        )
    return float(np.asarray(optimizer.learning_rate))


def to_learning_rate(value, owner: str) -> float:
    """A schedule's result as a Python float.

    Raises:
      ValueError: `value` is not a real number (or a 0-d array of one), or is NaN.
    """
    if isinstance(value, (bool, str, bytes)) or np.ndim(value) != 0:
        raise ValueError(
            f"{owner}: the schedule must return a float learning rate; it returned "
            f"{type(value).__name__} {value!r}. Return e.g. `lr * 0.5`."
        )
    try:
        rate = float(value)
    except (TypeError, ValueError):
        raise ValueError(
            f"{owner}: the schedule must return a float learning rate; it returned "
            f"{type(value).__name__} {value!r}. Return e.g. `lr * 0.5`."
        ) from None
    if math.isnan(rate):
        raise ValueError(f"{owner}: the schedule returned a NaN learning rate ({value!r}).")
    return rate
