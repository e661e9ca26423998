"""What the built-in metrics compute per example (accuracies, squared and absolute errors) and
what every metric's update shares: the replica's batch mask, a sample weight aligned to the
values, the shape check of labels against predictions, a divide that gives 0 for 0/0, and the
snake-case default names (metrics.py has the classes).
"""

from __future__ import annotations

import re

import jax.numpy as jnp

from mirrax import errors
from mirrax._src.distribute.current import get_replica_context
from mirrax._src.training.targets import match_rank, sparse_labels


def accuracy(y_true, y_pred):
    """Per example, 1.0 where y_true equals y_pred, else 0.0 (float32, y_pred's shape after
    rank matching), as Keras's `accuracy`.

    Raises:
      IncompatibleInputError: labels and predictions of different shapes.
    """
    y_pred = jnp.asarray(y_pred)
    y_true, y_pred = match_rank(jnp.asarray(y_true).astype(y_pred.dtype), y_pred)
    check_same_shape("accuracy", y_true, y_pred)
    return (y_true == y_pred).astype(jnp.float32)


def binary_accuracy(y_true, y_pred, threshold=0.5):
    """Per element, 1.0 where y_true equals (y_pred > threshold), else 0.0 (float32), as Keras's
    `binary_accuracy`.

    Raises:
      IncompatibleInputError: labels and predictions of different shapes.
    """
    y_true, y_pred = match_rank(jnp.asarray(y_true, jnp.float32), jnp.asarray(y_pred, jnp.float32))
    check_same_shape("binary_accuracy", y_true, y_pred)
    return (y_true == (y_pred > threshold).astype(jnp.float32)).astype(jnp.float32)


def categorical_accuracy(y_true, y_pred):
    """Per example (batch,), 1.0 where the arg-max of one-hot y_true (..., classes) equals
    y_pred's, else 0.0 (float32), as Keras's `categorical_accuracy`.

    Raises:
      IncompatibleInputError: labels and predictions of different shapes.
    """
    y_true, y_pred = jnp.asarray(y_true), jnp.asarray(y_pred)
    check_same_shape("categorical_accuracy", y_true, y_pred)
    return (jnp.argmax(y_true, axis=-1) == jnp.argmax(y_pred, axis=-1)).astype(jnp.float32)


def sparse_categorical_accuracy(y_true, y_pred):
    """Per example (batch,), 1.0 where the integer label equals the arg-max of y_pred
    (batch, classes), else 0.0 (float32), as Keras's `sparse_categorical_accuracy`.

    Raises:
      IncompatibleInputError: labels whose shape does not fit y_pred (batch, ..., classes).
    """
    y_pred = jnp.asarray(y_pred)
    y_true = sparse_labels("sparse_categorical_accuracy", y_true, y_pred, "CategoricalAccuracy")
    predicted = jnp.argmax(y_pred, axis=-1).astype(jnp.float32)
    return (y_true.astype(jnp.float32) == predicted).astype(jnp.float32)


def accuracy_by_shape(y_true, y_pred):
    """Keras 3's resolution of "accuracy" from the shapes (compile_utils.get_metric)."""
    y_true, y_pred = jnp.asarray(y_true), jnp.asarray(y_pred)
    if y_pred.ndim <= 1 or y_pred.shape[-1] == 1:
        return binary_accuracy(y_true, y_pred)
    if y_true.ndim < y_pred.ndim or y_true.shape[-1] == 1:
        return sparse_categorical_accuracy(y_true, y_pred)
    return categorical_accuracy(y_true, y_pred)


def squared_error(y_true, y_pred):
    """Per element, (y_pred - y_true) ** 2 in float32 (MeanSquaredError averages it).

    Raises:
      IncompatibleInputError: labels and predictions of different shapes.
    """
    y_true, y_pred = match_rank(jnp.asarray(y_true, jnp.float32), jnp.asarray(y_pred, jnp.float32))
    check_same_shape("mean_squared_error", y_true, y_pred)
    return jnp.square(y_pred - y_true)


def absolute_error(y_true, y_pred):
    """Per element, |y_pred - y_true| in float32 (MeanAbsoluteError averages it).

    Raises:
      IncompatibleInputError: labels and predictions of different shapes.
    """
    y_true, y_pred = match_rank(jnp.asarray(y_true, jnp.float32), jnp.asarray(y_pred, jnp.float32))
    check_same_shape("mean_absolute_error", y_true, y_pred)
    return jnp.abs(y_pred - y_true)


# -- helpers -----------------------------------------------------------------------------------


def batch_mask(owner: str, batch_size: int):
    """The replica's batch mask (bool (batch,)), or None outside a run with a distributed batch."""
    ctx = get_replica_context()
    mask = None if ctx is None else ctx.batch_mask
    if mask is None:
        return None
    if mask.shape[0] != batch_size:
        raise errors.IncompatibleInputError(
            f"{owner}: update_state received {batch_size} examples but this replica's batch has "
            f"{mask.shape[0]} rows; update metrics inside strategy.run with the per-example "
            "values of the batch that run passed in (not gathered or reduced ones)."
        )
    return mask


def align_weight(owner: str, sample_weight, shape: tuple):
    """`sample_weight` as float32, aligned with the leading axes of `shape` (rank matching)."""
    weight = jnp.asarray(sample_weight, jnp.float32)
    while weight.ndim > len(shape) and weight.shape[-1] == 1:
        weight = weight.reshape(weight.shape[:-1])
    if weight.ndim == 0:
        return jnp.broadcast_to(weight, shape[:1])
    lead = shape[: weight.ndim]
    if weight.ndim > len(shape) or any(w not in (1, s) for w, s in zip(weight.shape, lead)):
        raise errors.IncompatibleInputError(
            f"{owner}: sample_weight of shape {weight.shape} does not fit values of shape "
            f"{tuple(shape)}; pass a scalar, one weight per example (shape {tuple(shape[:1])}), "
            "or an array matching the leading axes of the values."
        )
    return jnp.broadcast_to(weight, lead)


def scalar_weight(owner: str, sample_weight):
    """`sample_weight` as a float32 scalar, for a metric updated with one scalar value.

    Raises:
      IncompatibleInputError: a weight with more than one element; `owner` names the metric.
    """
    weight = jnp.asarray(sample_weight, jnp.float32)
    if weight.size != 1:
        raise errors.IncompatibleInputError(
            f"{owner}: a scalar value takes a scalar sample_weight; received sample_weight of "
            f"shape {weight.shape}. Pass per-example values of shape (batch,) to weight each."
        )
    return weight.reshape(())


def check_same_shape(owner: str, y_true, y_pred) -> None:
    """Refuses labels and predictions of different shapes; `owner` names the metric.

    Raises:
      IncompatibleInputError: the shapes differ.
    """
    if y_true.shape != y_pred.shape:
        raise errors.IncompatibleInputError(
            f"{owner}: y_true of shape {y_true.shape} does not match y_pred of shape "
            f"{y_pred.shape}; give labels of the predictions' shape (a trailing axis of size 1 "
            "may be added or left out)."
        )


def mean_trailing(values):
    """`values` (batch, ...) averaged over every axis after the first: one value per example."""
    if values.ndim > 1:
        values = values.mean(axis=tuple(range(1, values.ndim)))
    return values


def divide_no_nan(numerator, denominator):
    """`numerator / denominator` in float32, 0 where the denominator is 0 (Keras's)."""
    safe = jnp.where(denominator == 0, 1.0, denominator)
    return jnp.where(denominator == 0, 0.0, numerator / safe).astype(jnp.float32)


def snake(name: str) -> str:
    """A CamelCase class name in snake_case, as Keras names a metric by default
    ("SparseCategoricalAccuracy" -> "sparse_categorical_accuracy")."""
    name = re.sub(r"(.)([A-Z][a-z]+)", r"\1_\2", name)
    return re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower()
