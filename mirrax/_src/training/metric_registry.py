"""Metrics by name, as Keras's `metrics.get`: "accuracy" resolved by the loss, "precision", "auc",
"mse" and the other names, or a metric instance as is."""

from __future__ import annotations

import numpy as np

from mirrax import errors
from mirrax._src.training import confusion_metrics as confusion
from mirrax._src.training import losses as losses_lib
from mirrax._src.training import metric_functions
from mirrax._src.training import metrics as metrics_lib
from mirrax._src.training.losses import InvalidIdentifierError

_NEG_INF = float("-inf")

_CLASSES = (
    metrics_lib.Mean,
    metrics_lib.Sum,
    metrics_lib.Accuracy,
    metrics_lib.BinaryAccuracy,
    metrics_lib.CategoricalAccuracy,
    metrics_lib.SparseCategoricalAccuracy,
    confusion.Precision,
    confusion.Recall,
    confusion.AUC,
    metrics_lib.MeanSquaredError,
    metrics_lib.MeanAbsoluteError,
)


_BY_NAME: dict = {cls.__name__: cls for cls in _CLASSES}
_BY_NAME.update(
    {
        "binary_accuracy": metrics_lib.BinaryAccuracy,
        "categorical_accuracy": metrics_lib.CategoricalAccuracy,
        "sparse_categorical_accuracy": metrics_lib.SparseCategoricalAccuracy,
        "precision": confusion.Precision,
        "recall": confusion.Recall,
        "auc": confusion.AUC,
        "mean_squared_error": metrics_lib.MeanSquaredError,
        "mse": metrics_lib.MeanSquaredError,
        "mean_absolute_error": metrics_lib.MeanAbsoluteError,
        "mae": metrics_lib.MeanAbsoluteError,
    }
)


_ACCURACY_NAMES = ("accuracy", "acc")


def get(identifier, loss=None):
    """The `metrics_lib.Metric` an identifier names, as Keras's `compile(metrics=[...])` resolves it.

    "accuracy" / "acc" (any case) follow Keras's rule by the loss: `metrics_lib.BinaryAccuracy` for a
    `BinaryCrossentropy` (threshold 0.0 when the loss takes logits — Keras keeps 0.5, which is
    wrong for logits), `metrics_lib.CategoricalAccuracy` for `CategoricalCrossentropy`,
    `metrics_lib.SparseCategoricalAccuracy` for `SparseCategoricalCrossentropy`; for any other or no loss,
    Keras 3's shape rule at each update (y_pred of shape (batch,) or (batch, 1): binary; labels
    of lower rank or a trailing 1: sparse; else categorical). A metric made from a string is
    named by that string ("acc" stays "acc", "mse" stays "mse"), as Keras 3.

    Args:
      identifier: a `metrics_lib.Metric` (returned as is) or its class (instantiated with default
        arguments, as Keras); a string: "accuracy"/"acc", a class name
        ("confusion.AUC", "metrics_lib.SparseCategoricalAccuracy"), a snake_case name
        ("sparse_categorical_accuracy", "precision", "recall", "auc", "mean_squared_error") or
        alias ("mse", "mae"; also upper case); a callable `fn(y_true, y_pred) -> values of shape
        (batch, ...)` (wrapped in a `metrics_lib.MeanMetricWrapper`); or None (returned as
        None).
      loss: the compiled loss (a `mirrax.losses.Loss` or an identifier `mirrax.losses.get`
        accepts), used only to resolve "accuracy".

    Returns:
      A `metrics_lib.Metric` (a new one for a string or callable), or None.

    Raises:
      InvalidIdentifierError (a ValueError): an unknown string (the message lists the known
        names) or an object that is neither a string, a `metrics_lib.Metric` nor a callable.
    """
    if identifier is None or isinstance(identifier, metrics_lib.Metric):
        return identifier
    if isinstance(identifier, type) and issubclass(identifier, metrics_lib.Metric):
        return identifier()  # a class given for an instance, as Keras's `get` instantiates it
    if isinstance(identifier, str):
        if identifier.lower() in _ACCURACY_NAMES:
            return _accuracy_for(losses_lib.get(loss), identifier)
        cls = _BY_NAME.get(identifier) or _BY_NAME.get(identifier.lower())
        if cls is None:
            known = sorted(set(_BY_NAME) | set(_ACCURACY_NAMES))
            raise InvalidIdentifierError(
                f"Unknown metric {identifier!r}. Known names: {', '.join(known)}. Pass one of "
                "them, a mirrax.metrics.Metric instance, or a function fn(y_true, y_pred) "
                "returning one value per example."
            )
        return cls(name=identifier)
    if callable(identifier):
        return metrics_lib.MeanMetricWrapper(identifier)
    raise InvalidIdentifierError(
        f"Could not interpret metric identifier {identifier!r} (a {type(identifier).__name__}); "
        "pass a metric name such as 'accuracy', a mirrax.metrics.Metric instance, or a function "
        "fn(y_true, y_pred) returning one value per example."
    )


def _accuracy_for(loss, name: str) -> metrics_lib.Metric:
    if isinstance(loss, losses_lib.BinaryCrossentropy):
        return metrics_lib.BinaryAccuracy(name=name, threshold=0.0 if loss.from_logits else 0.5)
    if isinstance(loss, losses_lib.CategoricalCrossentropy):
        return metrics_lib.CategoricalAccuracy(name=name)
    if isinstance(loss, losses_lib.SparseCategoricalCrossentropy):
        return metrics_lib.SparseCategoricalAccuracy(name=name)
    return metrics_lib.MeanMetricWrapper(metric_functions.accuracy_by_shape, name=name)


def per_threshold(metric) -> bool:
    """Whether `metric` is a Precision / Recall of several thresholds, whose `result()` is a
    vector (as Keras 3's) that the logs hold as one scalar per threshold."""
    return isinstance(metric, (confusion.Precision, confusion.Recall)) and len(metric.thresholds) > 1


def log_names(name: str, metric) -> list:
    """The log keys of one metric: `name`, or `<name>_<threshold>` per threshold of a
    several-threshold Precision / Recall ("precision_0.3", "precision_0.6"; the threshold as
    Python's repr of the float), where Keras 3 logs one vector under `name`."""
    if not per_threshold(metric):
        return [name]
    return [f"{name}_{threshold!r}" for threshold in metric.thresholds]


def log_values(name: str, metric) -> dict:
    """{log key: Python float} of one metric (reading it waits for the last step).

    Raises:
      InvalidArgumentError: the result is not a scalar (and not a per-threshold vector).
    """
    value = np.asarray(metric.result())
    names = log_names(name, metric)
    if value.shape != ((len(names),) if per_threshold(metric) else ()):
        raise _not_scalar(name, metric, value.shape)
    return dict(zip(names, (float(v) for v in value.reshape(-1))))


def checked_scalar(names: list, metrics) -> list:
    """`names`, having refused at compile a metric whose `result()` (read from its initial state) is not a
    scalar, so that no epoch trains before its value cannot be logged. A metric whose result
    cannot be read before an update is checked when it is first logged.

    Raises:
      InvalidArgumentError: naming the metric and its result's shape.
    """
    for name, metric in zip(names, metrics):
        if per_threshold(metric):
            continue
        try:
            shape = np.shape(metric.result())
        except Exception:  # noqa: BLE001 - read again (and refused) at the first log
            continue
        if shape != ():
            raise _not_scalar(name, metric, shape)
    return names


def _not_scalar(name, metric, shape):
    return errors.InvalidArgumentError(
        f"Metric {name!r} ({type(metric).__name__}): result() has shape {tuple(shape)}, but the "
        "logs (History, the progress bar, CSVLogger, TensorBoard, EarlyStopping) hold one "
        "scalar per metric. Return a scalar from result() (for example its mean), or pass one "
        "metric per value."
    )
