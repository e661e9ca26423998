"""Keras-named losses built on optax, whose `__call__` is a replica's share of the global mean.

The built-in classes and `get` (Keras's names); what every `Loss` computes is in loss_base.py.

Probabilities (`from_logits=False`) are clipped to [1e-7, 1 - 1e-7] before the log, as Keras's
backend does: a probability of 0 gives a large finite loss.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax

from mirrax import errors
from mirrax._src import argument_checks
from mirrax._src.training import targets
from mirrax._src.training.loss_base import Loss, LossFunctionWrapper

# These two belong in mirrax/errors.py (with the rest of the hierarchy); they live here until
# that file gains them, and are shared with the metrics module.
InvalidIdentifierError = errors.InvalidIdentifierError
InvalidLabelError = errors.InvalidLabelError


class SparseCategoricalCrossentropy(Loss):
    """Cross-entropy with integer labels, as `keras.losses.SparseCategoricalCrossentropy`.

    Shapes: `y_pred` (batch, ..., num_classes), probabilities or (with `from_logits=True`)
    logits; `y_true` integer class ids of shape (batch, ...) or (batch, ..., 1). Probabilities
    are normalised to sum to 1 over the class axis and clipped to [1e-7, 1 - 1e-7] (Keras).

    A label outside [0, num_classes) gives a NaN loss for that example (Keras's JAX backend
    silently gives 0, TF errors on CPU): no compiled step can raise, so the value says it. Call
    `check_labels` on the host for an error naming the bad labels (`Model.fit` does for NumPy
    inputs).

    Args:
      from_logits: whether `y_pred` holds logits (optax's
        `softmax_cross_entropy_with_integer_labels`) instead of probabilities.
      name: defaults to "sparse_categorical_crossentropy".
    """

    default_name = "sparse_categorical_crossentropy"

    def __init__(self, from_logits: bool = False, name: str | None = None):
        super().__init__(name=name)
        self.from_logits = argument_checks.flag(type(self).__name__, "from_logits", from_logits)

    def _elementwise(self, y_true, y_pred):
        y_pred = y_pred.astype(jnp.float32)
        labels = targets.sparse_labels(self.name, y_true, y_pred, "CategoricalCrossentropy")
        num_classes = y_pred.shape[-1]
        valid = (labels >= 0) & (labels < num_classes)
        safe = jnp.where(valid, labels, 0)
        if self.from_logits:
            loss = optax.losses.softmax_cross_entropy_with_integer_labels(y_pred, safe)
        else:
            log_probs = jnp.log(targets.clip_probabilities(targets.normalise(y_pred)))
            loss = -jnp.take_along_axis(log_probs, safe[..., None], axis=-1)[..., 0]
        return jnp.where(valid, loss, jnp.nan)

    @staticmethod
    def check_labels(y_true, num_classes: int) -> None:
        """Host-side debug check that sparse labels are class ids in [0, num_classes).

        Meant for NumPy inputs before training (`Model.fit` calls it); it reads every label, so
        it is not for the compiled step.

        Args:
          y_true: array-like of labels, any shape (e.g. (n,) or (n, 1)), integer or
            integer-valued float.
          num_classes: the number of classes (the last axis of `y_pred`), a positive int.

        Raises:
          InvalidLabelError (a ValueError): some labels are not integers in [0, num_classes);
            the message names the offending values, how many there are, and the valid range.
          ValueError: `num_classes` is not a positive integer.
        """
        if isinstance(num_classes, bool) or not isinstance(num_classes, (int, np.integer)) or num_classes < 1:
            raise errors.InvalidArgumentError(
                f"check_labels: num_classes must be a positive int (the size of y_pred's last "
                f"axis); received {num_classes!r}."
            )
        labels = np.asarray(y_true)
        if labels.dtype == bool or not np.issubdtype(labels.dtype, np.number):
            raise InvalidLabelError(
                f"sparse_categorical_crossentropy: labels must be integer class ids in "
                f"[0, {num_classes}); received an array of dtype {labels.dtype}."
            )
        flat = labels.reshape(-1)
        bad = ~np.isfinite(flat) | (flat < 0) | (flat >= num_classes) | (flat != np.round(flat))
        if not bad.any():
            return
        values = np.unique(flat[bad])
        shown = ", ".join(repr(v.item()) for v in values[:10])
        more = f" (and {len(values) - 10} more)" if len(values) > 10 else ""
        first = int(np.flatnonzero(bad)[0])
        raise InvalidLabelError(
            f"sparse_categorical_crossentropy: {int(bad.sum())} of {flat.size} labels are not "
            f"class ids in the valid range [0, {num_classes}): values {shown}{more}; the first "
            f"is at flat index {first}. The model predicts {num_classes} classes (y_pred's last "
            "axis): re-map the labels to 0..num_classes-1, or give the model's last layer "
            "as many outputs as there are classes."
        )


class _SmoothedCrossentropy(Loss):
    """The arguments shared by the categorical and binary cross-entropies."""

    def __init__(self, from_logits: bool = False, label_smoothing: float = 0.0, name: str | None = None):
        super().__init__(name=name)
        self.from_logits = argument_checks.flag(type(self).__name__, "from_logits", from_logits)
        self.label_smoothing = targets.check_smoothing(label_smoothing, type(self).__name__)


class CategoricalCrossentropy(_SmoothedCrossentropy):
    """Cross-entropy with one-hot (or soft) labels, as `keras.losses.CategoricalCrossentropy`.

    Shapes: `y_true` and `y_pred` both (batch, ..., num_classes). Probabilities are normalised
    over the class axis and clipped to [1e-7, 1 - 1e-7]; logits go through optax's
    `softmax_cross_entropy`.

    Args:
      from_logits: whether `y_pred` holds logits.
      label_smoothing: float in [0, 1]; labels become `y * (1 - s) + s / num_classes`
        (optax's `smooth_labels`, Keras's formula).
      name: defaults to "categorical_crossentropy".

    Raises:
      ValueError: `label_smoothing` outside [0, 1].
    """

    default_name = "categorical_crossentropy"

    def _elementwise(self, y_true, y_pred):
        y_pred = y_pred.astype(jnp.float32)
        labels = jnp.asarray(y_true, jnp.float32)
        if labels.shape != y_pred.shape or y_pred.ndim < 2:
            raise errors.IncompatibleInputError(
                f"{self.name}: y_true of shape {labels.shape} does not match y_pred of shape "
                f"{y_pred.shape}; both must be (batch, ..., num_classes) with one-hot labels. "
                "For integer class ids use SparseCategoricalCrossentropy."
            )
        if self.label_smoothing:
            labels = optax.smooth_labels(labels, self.label_smoothing)
        if self.from_logits:
            return optax.losses.softmax_cross_entropy(y_pred, labels)
        return -(labels * jnp.log(targets.clip_probabilities(targets.normalise(y_pred)))).sum(axis=-1)


class BinaryCrossentropy(_SmoothedCrossentropy):
    """Binary cross-entropy, as `keras.losses.BinaryCrossentropy`.

    Shapes: `y_true` and `y_pred` (batch, ...), equal after Keras's rank matching ((batch,) and
    (batch, 1) fit each other); each element is one binary prediction and `per_example` averages
    them. Probabilities are clipped to [1e-7, 1 - 1e-7]; logits go through optax's
    `sigmoid_binary_cross_entropy` (stable for large logits).

    Args:
      from_logits: whether `y_pred` holds logits.
      label_smoothing: float in [0, 1]; labels become `y * (1 - s) + 0.5 * s` (Keras).
      name: defaults to "binary_crossentropy".
    """

    default_name = "binary_crossentropy"

    def _elementwise(self, y_true, y_pred):
        labels, y_pred = targets.same_shape(self.name, y_true, y_pred)
        if self.label_smoothing:
            labels = labels * (1.0 - self.label_smoothing) + 0.5 * self.label_smoothing
        if self.from_logits:
            return optax.losses.sigmoid_binary_cross_entropy(y_pred, labels)
        p = targets.clip_probabilities(y_pred)
        return -(labels * jnp.log(p) + (1.0 - labels) * jnp.log(1.0 - p))


class MeanSquaredError(Loss):
    """Mean of squared errors over the last axis, as `keras.losses.MeanSquaredError`.

    Shapes: `y_true`, `y_pred` (batch, ...), equal after rank matching; optax's `squared_error`.
    """

    default_name = "mean_squared_error"

    def _elementwise(self, y_true, y_pred):
        y_true, y_pred = targets.same_shape(self.name, y_true, y_pred)
        return optax.losses.squared_error(y_pred, y_true)


class MeanAbsoluteError(Loss):
    """Mean of absolute errors over the last axis, as `keras.losses.MeanAbsoluteError`.

    Shapes: `y_true`, `y_pred` (batch, ...), equal after rank matching.
    """

    default_name = "mean_absolute_error"

    def _elementwise(self, y_true, y_pred):
        y_true, y_pred = targets.same_shape(self.name, y_true, y_pred)
        return jnp.abs(y_pred - y_true)


class Huber(Loss):
    """Huber loss, as `keras.losses.Huber`, of the error e = y_pred - y_true.

    Elementwise `e^2 / 2` where `|e| <= delta`, else `delta * (|e| - delta / 2)`. Shapes:
    `y_true`, `y_pred` (batch, ...), equal after rank matching; optax's `huber_loss`.

    Args:
      delta: the positive float where the loss turns from quadratic to linear.
      name: defaults to "huber_loss" (Keras's name).

    Raises:
      ValueError: `delta` is not positive.
    """

    default_name = "huber_loss"

    def __init__(self, delta: float = 1.0, name: str | None = None):
        super().__init__(name=name)
        if isinstance(delta, bool) or not isinstance(delta, (int, float, np.number)) or np.ndim(delta):
            raise errors.InvalidArgumentTypeError(
                f"Huber: delta must be a float; received {type(delta).__name__} {delta!r}."
            )
        if not delta > 0:
            raise errors.InvalidArgumentError(f"Huber: delta must be a positive float; received {delta!r}.")
        self.delta = float(delta)

    def _elementwise(self, y_true, y_pred):
        y_true, y_pred = targets.same_shape(self.name, y_true, y_pred)
        return optax.losses.huber_loss(y_pred, y_true, delta=self.delta)


_CLASSES = (
    SparseCategoricalCrossentropy,
    CategoricalCrossentropy,
    BinaryCrossentropy,
    MeanSquaredError,
    MeanAbsoluteError,
    Huber,
)
# Keras's names: class names, the snake_case function names, and the short aliases.
_BY_NAME: dict = {cls.__name__: cls for cls in _CLASSES}
_BY_NAME.update(
    {
        "sparse_categorical_crossentropy": SparseCategoricalCrossentropy,
        "categorical_crossentropy": CategoricalCrossentropy,
        "binary_crossentropy": BinaryCrossentropy,
        "bce": BinaryCrossentropy,
        "mean_squared_error": MeanSquaredError,
        "mse": MeanSquaredError,
        "mean_absolute_error": MeanAbsoluteError,
        "mae": MeanAbsoluteError,
        "huber": Huber,
        "huber_loss": Huber,
    }
)


def get(identifier):
    """The `Loss` an identifier names, as `keras.losses.get`.

    Args:
      identifier: a `Loss` (returned as is) or its class (instantiated with default
        arguments, as Keras); a string: a class name ("MeanSquaredError"), a
        Keras function name ("sparse_categorical_crossentropy", "mean_squared_error", "huber")
        or alias ("mse", "mae", "bce"; aliases also in upper case, "MSE"); a callable
        `fn(y_true, y_pred) -> per-example loss of shape (batch, ...)` (wrapped in a
        `LossFunctionWrapper`); or None (returned as None, as Keras).

    Returns:
      A `Loss` instance (a new one with default arguments for a string), or None.

    Raises:
      InvalidIdentifierError (a ValueError): an unknown string (the message lists the known
        names) or an object that is neither a string, a `Loss` nor a callable.
    """
    if identifier is None or isinstance(identifier, Loss):
        return identifier
    if isinstance(identifier, type) and issubclass(identifier, Loss):
        return identifier()  # a class given for an instance, as Keras's `get` instantiates it
    if isinstance(identifier, str):
        cls = _BY_NAME.get(identifier) or _BY_NAME.get(identifier.lower())
        if cls is None:
            raise InvalidIdentifierError(
                f"Unknown loss {identifier!r}. Known names: {', '.join(sorted(_BY_NAME))}. "
                "Pass one of them, a mirrax.losses.Loss instance, or a function "
                "fn(y_true, y_pred) returning one loss per example."
            )
        return cls()
    if callable(identifier):
        return LossFunctionWrapper(identifier)
    raise InvalidIdentifierError(
        f"Could not interpret loss identifier {identifier!r} (a {type(identifier).__name__}); "
        "pass a loss name such as 'sparse_categorical_crossentropy', a mirrax.losses.Loss "
        "instance, or a function fn(y_true, y_pred) returning one loss per example."
    )
