"""The confusion-matrix metrics, as Keras's: `Precision`, `Recall` and `AUC`, whose counts of true
and false positives and negatives (per threshold) the replicas add up."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mirrax import errors
from mirrax._src import argument_checks
from mirrax._src.training import metric_functions, targets
from mirrax._src.training import metrics as metrics_lib
from mirrax._src.training.targets import match_rank

_NEG_INF = float("-inf")


class _ConfusionMetric(metrics_lib.Metric):
    """Confusion counts per threshold from every element of a batch (Keras's metrics_utils).

    Each element of `y_pred` is one binary prediction: positive at threshold t when
    `y_pred > t`; its label is positive when `y_true != 0`. Counts are weighted sums (float32
    vectors of shape (num_thresholds,)).
    """

    _COUNTS: tuple = ()
    _scalar: bool  # one threshold given as a number: results are scalars (set by each subclass)

    def __init__(self, thresholds: tuple, top_k, class_id, from_logits: bool, name, dtype):
        super().__init__(name=name, dtype=dtype)
        owner = type(self).__name__
        for argument, value in (("top_k", top_k), ("class_id", class_id)):
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise errors.InvalidArgumentTypeError(
                    f"{owner}: {argument} must be an int or None; received {type(value).__name__} {value!r}."
                )
            if value < (1 if argument == "top_k" else 0):
                raise errors.InvalidArgumentError(
                    f"{owner}: {argument} must be >= {1 if argument == 'top_k' else 0}; "
                    f"received {argument}={value!r}."
                )
        self.thresholds = thresholds
        self.top_k = top_k
        self.class_id = class_id
        self.from_logits = argument_checks.flag(owner, "from_logits", from_logits)
        for count in self._COUNTS:
            zeros = jnp.zeros((len(thresholds),), jnp.float32)
            setattr(self, count, nnx.metrics.MetricState(zeros))

    def update_state(self, y_true, y_pred, sample_weight=None) -> None:
        """Adds a batch's weighted confusion counts, as Keras's `update_state`.

        Args:
          y_true: labels of `y_pred`'s shape (a trailing 1 may differ); nonzero is positive.
          y_pred: predictions in [0, 1] (or logits with `from_logits=True`), shape (batch, ...).
          sample_weight: None, a scalar, or an array aligned with the leading axes of `y_pred`
            ((batch,), (batch, 1), or y_pred's shape).

        Raises:
          ValueError: the shapes do not fit each other or the replica's batch.
        """
        counts = _confusion_counts(self, y_true, y_pred, sample_weight)
        for name in self._COUNTS:
            self._add(getattr(self, name), counts[name])

    def _maybe_scalar(self, value):
        return value[0] if self._scalar else value


def _thresholds_argument(owner: str, thresholds, top_k) -> tuple[tuple, bool]:
    """Keras's thresholds argument as a tuple of floats, and whether `result()` is a scalar."""
    if thresholds is None:
        return ((0.5 if top_k is None else metrics_lib.NEG_INF),), True
    values = tuple(thresholds) if isinstance(thresholds, (list, tuple)) else (thresholds,)
    if not values or any(
        isinstance(t, (bool, str)) or not isinstance(t, (int, float, np.number)) or not 0.0 <= float(t) <= 1.0
        for t in values
    ):
        raise errors.InvalidArgumentError(
            f"{owner}: thresholds must be a float or a non-empty list of floats in [0, 1]; "
            f"received thresholds={thresholds!r}."
        )
    # As Keras: one threshold (a float or a list of one) gives a scalar result.
    return tuple(float(t) for t in values), len(values) == 1


class Precision(_ConfusionMetric):
    """Precision `tp / (tp + fp)` from weighted counts, as `keras.metrics.Precision`.

    State: `true_positives`, `false_positives`, float32 of shape (len(thresholds),).

    Args:
      thresholds: a float in [0, 1] (default 0.5, or -inf with `top_k`), or a list of them; with
        several, `result()` is a vector with one precision per threshold.
      top_k: int or None; only the k largest predictions of each row (last axis) can be positive.
      class_id: int or None; only that class (an index of the last axis) is scored.
      name: defaults to "precision".
      dtype: None or "float32".

    Raises:
      ValueError: a threshold outside [0, 1].
    """

    _COUNTS = ("true_positives", "false_positives")
    # Made by _ConfusionMetric.__init__ from _COUNTS (setattr).
    true_positives: nnx.metrics.MetricState
    false_positives: nnx.metrics.MetricState

    def __init__(
        self,
        thresholds=None,
        top_k: int | None = None,
        class_id: int | None = None,
        name: str | None = None,
        dtype=None,
    ):
        values, self._scalar = _thresholds_argument("Precision", thresholds, top_k)
        super().__init__(values, top_k, class_id, False, name, dtype)

    def result(self):
        """Precision (0.0 where nothing was predicted positive), float32 scalar or (T,) vector."""
        tp = self.true_positives.get_value()
        return self._maybe_scalar(metric_functions.divide_no_nan(tp, tp + self.false_positives.get_value()))


class Recall(_ConfusionMetric):
    """Recall `tp / (tp + fn)` from weighted counts, as `keras.metrics.Recall`.

    State: `true_positives`, `false_negatives`, float32 of shape (len(thresholds),).

    Args:
      thresholds: a float in [0, 1] (default 0.5, or -inf with `top_k`), or a list of them; with
        several, `result()` is a vector with one recall per threshold.
      top_k: int or None; only the k largest predictions of each row can be positive.
      class_id: int or None; only that class (an index of the last axis) is scored.
      name: defaults to "recall".
      dtype: None or "float32".

    Raises:
      ValueError: a threshold outside [0, 1].
    """

    _COUNTS = ("true_positives", "false_negatives")
    # Made by _ConfusionMetric.__init__ from _COUNTS (setattr).
    true_positives: nnx.metrics.MetricState
    false_negatives: nnx.metrics.MetricState

    def __init__(
        self,
        thresholds=None,
        top_k: int | None = None,
        class_id: int | None = None,
        name: str | None = None,
        dtype=None,
    ):
        values, self._scalar = _thresholds_argument("Recall", thresholds, top_k)
        super().__init__(values, top_k, class_id, False, name, dtype)

    def result(self):
        """Recall (0.0 where there were no positive labels), float32 scalar or (T,) vector."""
        tp = self.true_positives.get_value()
        return self._maybe_scalar(metric_functions.divide_no_nan(tp, tp + self.false_negatives.get_value()))


class AUC(_ConfusionMetric):
    """Area under the ROC or PR curve from confusion counts at thresholds, as `keras.metrics.AUC`.

    Thresholds are `num_thresholds` points: -1e-7, i / (num_thresholds - 1) for i = 1 ..
    num_thresholds - 2, and 1 + 1e-7 (Keras's). The area is a Riemann sum over them (Keras 3):
    "interpolation" takes the trapezoid for ROC and Davis & Goadrich's interpolation for PR;
    "minoring"/"majoring" the lower/upper rectangle. Every element of `y_pred` is one prediction
    (Keras's `multi_label=False`).

    State: `true_positives`, `false_positives`, `true_negatives`, `false_negatives`, float32 of
    shape (num_thresholds,).

    Args:
      num_thresholds: int > 1 (default 200).
      curve: "ROC" (default) or "PR", any case.
      summation_method: "interpolation" (default), "minoring" or "majoring".
      name: defaults to "auc".
      dtype: None or "float32".
      thresholds: optional list of floats in [0, 1] to use instead of `num_thresholds` evenly
        spaced ones (the two end points are added, as Keras).
      from_logits: whether `y_pred` holds logits (a sigmoid is applied first).

    Raises:
      ValueError: `num_thresholds` < 2, an unknown `curve` or `summation_method`, or thresholds
        outside [0, 1].
    """

    _COUNTS = ("true_positives", "false_positives", "true_negatives", "false_negatives")
    # Made by _ConfusionMetric.__init__ from _COUNTS (setattr).
    true_positives: nnx.metrics.MetricState
    false_positives: nnx.metrics.MetricState
    true_negatives: nnx.metrics.MetricState
    false_negatives: nnx.metrics.MetricState

    def __init__(
        self,
        num_thresholds: int = 200,
        curve: str = "ROC",
        summation_method: str = "interpolation",
        name: str | None = None,
        dtype=None,
        thresholds=None,
        *,
        from_logits: bool = False,
    ):
        if thresholds is not None:
            inner, _ = _thresholds_argument("AUC", list(thresholds), None)
            inner = tuple(sorted(inner))
        else:
            if isinstance(num_thresholds, bool) or not isinstance(num_thresholds, int) or num_thresholds <= 1:
                raise errors.InvalidArgumentError(
                    f"AUC: num_thresholds must be an integer > 1; received {num_thresholds!r}."
                )
            inner = tuple((i + 1) / (num_thresholds - 1) for i in range(num_thresholds - 2))
        if not isinstance(curve, str) or curve.upper() not in ("ROC", "PR"):
            raise errors.InvalidArgumentError(f"AUC: curve must be 'ROC' or 'PR'; received {curve!r}.")
        methods = ("interpolation", "minoring", "majoring")
        if not isinstance(summation_method, str) or summation_method.lower() not in methods:
            raise errors.InvalidArgumentError(
                f"AUC: summation_method must be one of {', '.join(map(repr, methods))}; "
                f"received {summation_method!r}."
            )
        self.curve = curve.upper()
        self.summation_method = summation_method.lower()
        edges = (0.0 - targets.EPSILON,) + inner + (1.0 + targets.EPSILON,)
        super().__init__(edges, None, None, from_logits, name, dtype)

    @property
    def num_thresholds(self) -> int:
        return len(self.thresholds)

    def result(self):
        """The area under the curve, a float32 scalar (0.0 before any update)."""
        tp = self.true_positives.get_value()
        fp = self.false_positives.get_value()
        tn = self.true_negatives.get_value()
        fn = self.false_negatives.get_value()
        if self.curve == "PR" and self.summation_method == "interpolation":
            return _interpolate_pr_auc(tp, fp, fn)
        recall = metric_functions.divide_no_nan(tp, tp + fn)
        if self.curve == "ROC":
            x, y = metric_functions.divide_no_nan(fp, fp + tn), recall
        else:
            x, y = recall, metric_functions.divide_no_nan(tp, tp + fp)
        if self.summation_method == "interpolation":
            heights = (y[:-1] + y[1:]) / 2.0
        elif self.summation_method == "minoring":
            heights = jnp.minimum(y[:-1], y[1:])
        else:
            heights = jnp.maximum(y[:-1], y[1:])
        return ((x[:-1] - x[1:]) * heights).sum()


def _interpolate_pr_auc(tp, fp, fn):
    """Keras's `AUC.interpolate_pr_auc` (Davis & Goadrich 2006, closed form)."""
    dtp = tp[:-1] - tp[1:]
    p = tp + fp
    dp = p[:-1] - p[1:]
    slope = metric_functions.divide_no_nan(dtp, jnp.maximum(dp, 0.0))
    intercept = tp[1:] - slope * p[1:]
    both = (p[:-1] > 0) & (p[1:] > 0)
    ratio = jnp.where(both, metric_functions.divide_no_nan(p[:-1], jnp.maximum(p[1:], 0.0)), 1.0)
    increment = metric_functions.divide_no_nan(
        slope * (dtp + intercept * jnp.log(ratio)), jnp.maximum(tp[1:] + fn[1:], 0.0)
    )
    return increment.sum()


def _confusion_counts(metric: _ConfusionMetric, y_true, y_pred, sample_weight) -> dict:
    y_true = jnp.asarray(y_true)
    y_pred = jnp.asarray(y_pred, jnp.float32)
    if metric.from_logits:
        y_pred = jax.nn.sigmoid(y_pred)
    if y_pred.ndim == 0:
        raise errors.IncompatibleInputError(
            f"{metric.name}: y_pred must have a leading batch axis, but received a scalar; pass "
            "the predictions for a batch of examples."
        )
    batch = y_pred.shape[0]
    if metric.top_k is not None:
        _, top = jax.lax.top_k(y_pred, metric.top_k)
        keep = jax.nn.one_hot(top, y_pred.shape[-1], dtype=jnp.bool_).any(axis=-2)
        y_pred = jnp.where(keep, y_pred, metrics_lib.NEG_INF)
    if metric.class_id is not None:
        if not 0 <= metric.class_id < y_pred.shape[-1]:
            raise errors.IncompatibleInputError(
                f"{metric.name}: class_id={metric.class_id} is outside y_pred's last axis of "
                f"size {y_pred.shape[-1]}; pass a class index in [0, {y_pred.shape[-1]})."
            )
        y_true = y_true[..., metric.class_id, None]
        y_pred = y_pred[..., metric.class_id, None]
    y_true, y_pred = match_rank(y_true, y_pred)
    metric_functions.check_same_shape(metric.name, y_true, y_pred)
    if sample_weight is None:
        weight = jnp.ones(y_pred.shape, jnp.float32)
    else:
        weight = metric_functions.align_weight(metric.name, sample_weight, y_pred.shape)
        weight = weight.reshape(weight.shape + (1,) * (y_pred.ndim - weight.ndim))
        weight = jnp.broadcast_to(weight, y_pred.shape)
    mask = metric_functions.batch_mask(metric.name, batch)
    if mask is not None:
        mask = jnp.broadcast_to(mask.reshape((batch,) + (1,) * (y_pred.ndim - 1)), y_pred.shape)
        weight = jnp.where(mask, weight, 0.0)
    labels = (y_true != 0).reshape(-1)
    weight = weight.reshape(-1)
    thresholds = jnp.asarray(metric.thresholds, jnp.float32)
    above = (y_pred.reshape(-1)[:, None] > thresholds[None, :]).astype(jnp.float32)
    positive = jnp.where(labels, weight, 0.0)
    negative = jnp.where(labels, 0.0, weight)
    return {
        "true_positives": positive @ above,
        "false_negatives": positive @ (1.0 - above),
        "false_positives": negative @ above,
        "true_negatives": negative @ (1.0 - above),
    }
