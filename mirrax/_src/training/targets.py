"""Targets and predictions, for losses and metrics alike: Keras's rank matching, sparse labels
checked against the number of classes, clipped probabilities, and the checks of their flags."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from mirrax import errors

EPSILON = 1e-7


def sparse_labels(name: str, y_true, y_pred, one_hot_class: str):
    """Integer class ids (int32, shape y_pred.shape[:-1]) from labels with or without a trailing 1.

    Raises:
      ValueError: the labels' shape does not fit predictions of shape (batch, ..., classes).
    """
    labels = jnp.asarray(y_true)
    if labels.ndim == y_pred.ndim and labels.shape[-1] == 1:
        labels = labels.reshape(labels.shape[:-1])
    if y_pred.ndim < 2 or labels.shape != y_pred.shape[:-1]:
        raise errors.IncompatibleInputError(
            f"{name}: y_true of shape {jnp.shape(y_true)} does not fit y_pred of shape "
            f"{y_pred.shape}; expected integer labels of shape {y_pred.shape[:-1]} (or with "
            "a trailing 1) for predictions of shape (batch, ..., num_classes). For one-hot "
            f"labels use {one_hot_class}."
        )
    return labels.astype(jnp.int32)


def mean_trailing(values):
    """float32 `values` averaged over every axis but the first: one value per example."""
    values = jnp.asarray(values).astype(jnp.float32)
    if values.ndim > 1:
        values = values.mean(axis=tuple(range(1, values.ndim)))
    return values


def normalise(probs):
    """`probs` divided by their sum over the last axis."""
    return probs / probs.sum(axis=-1, keepdims=True)


def clip_probabilities(probs):
    """`probs` clipped to [EPSILON, 1 - EPSILON], so logs stay finite (Keras's)."""
    return jnp.clip(probs, EPSILON, 1.0 - EPSILON)


def check_smoothing(label_smoothing, owner: str) -> float:
    """`label_smoothing` as a float in [0, 1]; `owner` names the loss.

    Raises:
      InvalidArgumentTypeError / InvalidArgumentError: not a number, or outside [0, 1].
    """
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float, np.number)):
        raise errors.InvalidArgumentTypeError(
            f"{owner}: label_smoothing must be a float in [0, 1]; received "
            f"{type(label_smoothing).__name__} {label_smoothing!r}."
        )
    if not 0.0 <= label_smoothing <= 1.0:
        raise errors.InvalidArgumentError(
            f"{owner}: label_smoothing must be a float in [0, 1]; received {label_smoothing!r}."
        )
    return float(label_smoothing)


def match_rank(a, b):
    """Keras's `squeeze_or_expand_to_same_rank`: ranks that differ by one trailing 1 are matched.

    A rank-1 array next to a (batch, 1) one is expanded to (batch, 1); otherwise the trailing
    size-1 axis of the higher-rank array is squeezed. Other shapes are returned unchanged.
    """
    if a.ndim == b.ndim + 1 and a.shape[-1] == 1:
        if b.ndim == 1:
            b = b[:, None]
        else:
            a = a.reshape(a.shape[:-1])
    elif b.ndim == a.ndim + 1 and b.shape[-1] == 1:
        if a.ndim == 1:
            a = a[:, None]
        else:
            b = b.reshape(b.shape[:-1])
    return a, b


def same_shape(name: str, y_true, y_pred):
    """(y_true, y_pred) as float32 with ranks matched (`match_rank`); `name` names the loss.

    Raises:
      IncompatibleInputError: the shapes still differ.
    """
    y_true, y_pred = match_rank(jnp.asarray(y_true, jnp.float32), jnp.asarray(y_pred, jnp.float32))
    if y_true.shape != y_pred.shape:
        raise errors.IncompatibleInputError(
            f"{name}: y_true of shape {jnp.shape(y_true)} does not match y_pred of shape "
            f"{jnp.shape(y_pred)}; give targets of the predictions' shape (a trailing axis of "
            "size 1 may be added or left out)."
        )
    return y_true, y_pred
