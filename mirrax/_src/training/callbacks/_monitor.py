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

import numpy as np

from mirrax import errors
from mirrax._src.distribute import _compat

_UP = (
    "acc",
    "auc",
    "precision",
    "recall",
    "f1_score",
    "fbeta_score",
    "iou",
    "r2_score",
    "true_positives",
    "true_negatives",
    "cosine_similarity",
    "correlation",
    "sensitivity",
    "specificity",
)
_DOWN = (
    "loss",
    "error",
    "mse",
    "mae",
    "mape",
    "msle",
    "crossentropy",
    "hinge",
    "divergence",
    "poisson",
    "logcosh",
    "false_positives",
    "false_negatives",
)


def infer_mode(monitor: str, model=None) -> str | None:
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
        direction = _compat.keras_metric_direction(metric) or getattr(metric, "direction", None)
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
        f"{owner}: mode={mode!r} is unknown; using mode='auto'. Pass mode='min', 'max' or 'auto'.",
        stacklevel=3,
    )
    return "auto"


def missing_monitor_message(owner: str, monitor: str, logs: dict) -> str:
    """The warning for a monitored key absent from the epoch's logs (names what is there)."""
    available = ",".join(logs.keys()) or "(none)"
    hint = (
        " Validation keys (val_*) appear only when fit is given validation_data or "
        "validation_split, and only in the epochs that validate."
        if monitor.startswith("val_")
        else ""
    )
    return (
        f"{owner} is conditioned on metric `{monitor}` which is not available. Available "
        f"metrics are: {available}.{hint}"
    )


def check_learning_rate(model, owner: str) -> None:
    """Raises unless `model.optimizer.learning_rate` can be read and set (call at train begin).

    Raises:
      FixedLearningRateError: the optimizer's learning rate is a constant (e.g. optax.adam(1e-3)).
    """
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or not hasattr(optimizer, "learning_rate"):
        raise errors.FixedLearningRateError(
            f"{owner} changes the learning rate, but the model's optimizer keeps it as a fixed "
            "constant (an optax optimizer such as optax.adam(1e-3) bakes the rate into its "
            "update). Compile with a name such as 'adam' (Keras's defaults), or with "
            "optax.inject_hyperparams(optax.adam)(learning_rate=1e-3), which keeps the rate in "
            "the optimizer state so callbacks can change it without recompiling."
        )


def get_learning_rate(model, owner: str) -> float:
    """`model.optimizer.learning_rate` as a Python float.

    Raises:
      FixedLearningRateError: the model has no optimizer or the optimizer no `learning_rate`.
    """
    check_learning_rate(model, owner)
    return float(np.asarray(model.optimizer.learning_rate))


def check_monitor_is_logged(owner: str, monitor: str, params: dict) -> None:
    """Raises when fit's logs (`params["metrics"]`, set by `Model.fit`) will never hold `monitor`.

    Keras 3 warns at every epoch end instead and trains on; a misspelt monitor then silently
    does nothing, so mirrax refuses it before the first step.

    Raises:
      InvalidArgumentError: `monitor` is not among the log keys.
    """
    keys = (params or {}).get("metrics")
    if keys is None or monitor in keys:
        return
    hint = (
        " Validation keys (val_*) appear only when fit is given validation_data or validation_split."
        if monitor.startswith("val_") and not any(k.startswith("val_") for k in keys)
        else ""
    )
    raise errors.InvalidArgumentError(
        f"{owner}: monitor={monitor!r} is not among the logs of this fit, which hold: "
        f"{', '.join(keys)}. Pass one of them as monitor.{hint}"
    )


def to_learning_rate(value, owner: str) -> float:
    """A schedule's result as a Python float.

    Raises:
      InvalidArgumentError: `value` is not a real number (or a 0-d array of one), or is NaN.
    """
    if isinstance(value, (bool, str, bytes)) or np.ndim(value) != 0:
        raise errors.InvalidArgumentError(
            f"{owner}: the schedule must return a float learning rate; it returned "
            f"{type(value).__name__} {value!r}. Return e.g. `lr * 0.5`."
        )
    try:
        rate = float(value)
    except (TypeError, ValueError):
        raise errors.InvalidArgumentError(
            f"{owner}: the schedule must return a float learning rate; it returned "
            f"{type(value).__name__} {value!r}. Return e.g. `lr * 0.5`."
        ) from None
    if math.isnan(rate):
        raise errors.InvalidArgumentError(f"{owner}: the schedule returned a NaN learning rate ({value!r}).")
    return rate
