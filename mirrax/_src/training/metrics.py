"""Keras metrics as NNX objects whose state the replicas add up: the `Metric` base, Mean, Sum,
accuracies and errors (Precision, Recall and AUC in confusion_metrics.py; names in
metric_registry.py).

A metric holds only sums and counts (float32 `nnx.metrics.MetricState` variables: a total and a
count, or confusion counts per threshold), and `result()` is computed from them. Pass metrics to
`strategy.run` in `args` and call `update_state` inside: each replica adds the counts of ITS
shard, and on write-back the runtime SUM-aggregates metric state (every replica's increment
new - old is added to the old value; docs/design.md, "`strategy.run`"), so the state afterwards
holds the counts of the whole global batch and `result()` is the metric of all examples — never
an average of per-replica results (a mean of per-replica precisions is not the precision). The same objects
work eagerly outside any strategy, as Keras metrics do.

Every update multiplies by the replica's batch mask (`mirrax.get_replica_context().batch_mask`)
when there is one, so the padding rows of a partial last batch never count and every example
counts exactly once, whatever the replica count.

Two rules follow from SUM aggregation: call `reset_state()` outside `strategy.run` (inside, every
replica's reset would be added), and read `result()` outside it (inside, it shows only this
replica's increment on top of the previous state).
"""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp
import numpy as np
from flax import nnx

from mirrax import errors
from mirrax._src.distribute.replica_context import current_replica_context
from mirrax._src.training.metric_functions import (
    absolute_error,
    accuracy,
    align_weight,
    batch_mask,
    binary_accuracy,
    categorical_accuracy,
    divide_no_nan,
    mean_trailing,
    scalar_weight,
    snake,
    sparse_categorical_accuracy,
    squared_error,
)

NEG_INF = float("-inf")


class Metric(nnx.Pytree):
    """Base class of the metrics, as `keras.metrics.Metric`, holding state the replicas SUM.

    Subclasses keep their state in float32 `nnx.metrics.MetricState` variables (sums, counts,
    confusion counts), implement `update_state` and `result`, and inherit `reset_state` (which
    zeroes every `MetricState`). Being an `nnx.Pytree` (as `flax.nnx.metrics.Metric`), a metric
    passed to `strategy.run` in `args` is updated in place there.

    Args:
      name: the metric's name (the key of its value in Keras's logs); defaults to the class
        name in snake_case.
      dtype: None or "float32" (accepted for Keras's signature; the state is always float32).

    Raises:
      TypeError: `name` is not a string.
      ValueError: a `dtype` other than float32.
    """

    def __init__(self, name: str | None = None, dtype=None):
        if name is not None and not isinstance(name, str):
            raise errors.InvalidArgumentTypeError(
                f"{type(self).__name__}: name must be a string; received {name!r}."
            )
        if dtype is not None and jnp.dtype(dtype) != jnp.float32:
            raise errors.InvalidArgumentError(
                f"{type(self).__name__}: mirrax metrics keep float32 state; received "
                f"dtype={dtype!r}. Leave dtype unset (cast the result if you need another type)."
            )
        self.name = name or snake(type(self).__name__)

    def update_state(self, *args, **kwargs) -> None:
        """Adds a batch to the state (see the subclass for the arguments)."""
        raise NotImplementedError(f"{type(self).__name__} must implement update_state.")

    def result(self):
        """The metric's value from the accumulated state: float32, a scalar unless noted."""
        raise NotImplementedError(f"{type(self).__name__} must implement result.")

    def reset_state(self) -> None:
        """Zeroes the state, as `keras.metrics.Metric.reset_state` (e.g. at the start of an epoch).

        Raises:
          ReplicaContextError: called inside `strategy.run`, where every replica's reset would be
            SUM-aggregated into the state; reset before or after `run`.
        """
        if current_replica_context() is not None:
            raise errors.ReplicaContextError(
                f"{self.name}.reset_state() was called inside strategy.run; metric state is "
                "SUM-aggregated over the replicas on write-back, so each replica's reset would be "
                "added up. Call reset_state() outside strategy.run (e.g. between epochs)."
            )
        for value in vars(self).values():
            if isinstance(value, nnx.metrics.MetricState):
                value.set_value(jnp.zeros_like(value.get_value()))

    def reset_states(self) -> None:
        """`reset_state()` under tf.keras 2's name (the custom-training tutorial's), which
        Keras 3 dropped."""
        self.reset_state()

    def __call__(self, *args, **kwargs):
        """`update_state(*args, **kwargs)`, then `result()`, as `keras.metrics.Metric.__call__`
        (e.g. `accuracy(y_true, y_pred)`). Inside `strategy.run` the result shows this
        replica's increment only (see the module's rules); read `result()` after the step."""
        self.update_state(*args, **kwargs)
        return self.result()

    def _add(self, variable, increment) -> None:
        variable.set_value(variable.get_value() + jnp.asarray(increment, jnp.float32))


class Mean(Metric):
    """The (weighted) mean of the values seen, as `keras.metrics.Mean`.

    State: `total` (sum of weighted per-example values) and `count` (sum of the examples'
    weights), float32 scalars. `result()` is `total / count`, 0.0 while `count` is 0 (Keras's
    `divide_no_nan`).

    Args:
      name: defaults to "mean".
      dtype: None or "float32".
    """

    def __init__(self, name: str | None = "mean", dtype=None):
        super().__init__(name=name, dtype=dtype)
        self.total = nnx.metrics.MetricState(jnp.zeros((), jnp.float32))
        self.count = nnx.metrics.MetricState(jnp.zeros((), jnp.float32))

    def update_state(self, values, sample_weight=None) -> None:
        """Adds a batch of values, as `keras.metrics.Mean.update_state`.

        Each example's value is the mean of its `values` over trailing axes; `count` grows by the
        examples' weights (1 each when unweighted). Padding rows of the replica's batch (its
        batch mask) add nothing.

        Args:
          values: array of shape (batch, ...), or a scalar (one value, counted once; a scalar
            has no batch axis, so the batch mask does not apply).
          sample_weight: None, a scalar (every example's weight), or an array aligned with the
            leading axes of `values`: (batch,), (batch, 1), or e.g. (batch, time) for values of
            shape (batch, time, ...), as Keras.

        Raises:
          ValueError: `sample_weight` does not fit `values`, or `values` has a different batch
            size from the replica's batch mask.
        """
        values = jnp.asarray(values, jnp.float32)
        if values.ndim == 0:
            weight = (
                jnp.ones((), jnp.float32)
                if sample_weight is None
                else scalar_weight(self.name, sample_weight)
            )
            self._add(self.total, values * weight)
            self._add(self.count, weight)
            return
        if sample_weight is None:
            per_example, weight = mean_trailing(values), None
        else:
            weight = align_weight(self.name, sample_weight, values.shape)
            if values.ndim > weight.ndim:
                values = values.mean(axis=tuple(range(weight.ndim, values.ndim)))
            weight = jnp.broadcast_to(weight, values.shape)
            per_example, weight = mean_trailing(values * weight), mean_trailing(weight)
        mask = batch_mask(self.name, values.shape[0])
        if mask is None:
            count = values.shape[0] if weight is None else weight.sum()
        else:
            per_example = jnp.where(mask, per_example, 0.0)
            count = mask.sum() if weight is None else jnp.where(mask, weight, 0.0).sum()
        self._add(self.total, per_example.sum())
        self._add(self.count, count)

    def result(self):
        """`total / count` as a float32 scalar (0.0 before any weight was added)."""
        return divide_no_nan(self.total.get_value(), self.count.get_value())


class Sum(Metric):
    """The (weighted) sum of the values seen, as `keras.metrics.Sum`.

    State: `total`, a float32 scalar.

    Args:
      name: defaults to "sum".
      dtype: None or "float32".
    """

    def __init__(self, name: str | None = "sum", dtype=None):
        super().__init__(name=name, dtype=dtype)
        self.total = nnx.metrics.MetricState(jnp.zeros((), jnp.float32))

    def update_state(self, values, sample_weight=None) -> None:
        """Adds `sum(values * sample_weight)` over the real examples, as `keras.metrics.Sum`.

        Args:
          values: array of shape (batch, ...), or a scalar (added once, no batch mask).
          sample_weight: None, a scalar, or an array aligned with the leading axes of `values`.

        Raises:
          ValueError: `sample_weight` does not fit `values`, or the batch size differs from the
            replica's batch mask.
        """
        values = jnp.asarray(values, jnp.float32)
        if values.ndim == 0:
            weight = 1.0 if sample_weight is None else scalar_weight(self.name, sample_weight)
            self._add(self.total, values * weight)
            return
        if sample_weight is not None:
            weight = align_weight(self.name, sample_weight, values.shape)
            weight = weight.reshape(weight.shape + (1,) * (values.ndim - weight.ndim))
            values = values * jnp.broadcast_to(weight, values.shape)
        per_example = values.sum(axis=tuple(range(1, values.ndim))) if values.ndim > 1 else values
        mask = batch_mask(self.name, values.shape[0])
        if mask is not None:
            per_example = jnp.where(mask, per_example, 0.0)
        self._add(self.total, per_example.sum())

    def result(self):
        """The accumulated sum, a float32 scalar."""
        return self.total.get_value()


class MeanMetricWrapper(Mean):
    """The mean of a per-example function of the examples seen, as Keras's `MeanMetricWrapper`.

    Args:
      fn: `fn(y_true, y_pred, **kwargs) -> values of shape (batch, ...)` (one value per example,
        or per element; trailing axes are averaged per example).
      name: defaults to `fn.__name__`.
      dtype: None or "float32".
      **kwargs: hashable keyword arguments passed on to `fn` (they are compile-time constants
        inside `strategy.run`).
    """

    def __init__(self, fn: Callable, name: str | None = None, dtype=None, **kwargs):
        if not callable(fn):
            raise errors.InvalidArgumentTypeError(
                f"MeanMetricWrapper needs a function fn(y_true, y_pred) -> per-example values; "
                f"received {type(fn).__name__} {fn!r:.60}."
            )
        super().__init__(name=name or getattr(fn, "__name__", None), dtype=dtype)
        self.fn = fn
        self.fn_kwargs = tuple(sorted(kwargs.items()))

    # As Keras's MeanMetricWrapper: a Mean whose update_state takes (y_true, y_pred), not values.
    def update_state(self, y_true, y_pred, sample_weight=None) -> None:  # type: ignore[override]
        """Adds `fn(y_true, y_pred)` of a batch, weighted, to the mean (see `Mean.update_state`).

        Args:
          y_true: targets of shape (batch, ...).
          y_pred: predictions of shape (batch, ...).
          sample_weight: None, a scalar, or an array of shape (batch,) / (batch, 1) (or aligned
            with the leading axes of `fn`'s values).

        Raises:
          ValueError: the shapes do not fit the metric or the replica's batch.
        """
        values = self.fn(y_true, y_pred, **dict(self.fn_kwargs))
        super().update_state(values, sample_weight)


class Accuracy(MeanMetricWrapper):
    """How often predictions equal labels exactly, as `keras.metrics.Accuracy`.

    `y_true` and `y_pred` have the same shape (after Keras's rank matching of a trailing 1);
    an example's value is the fraction of its elements that match.

    Args:
      name: defaults to "accuracy".
      dtype: None or "float32".
    """

    def __init__(self, name: str | None = "accuracy", dtype=None):
        super().__init__(accuracy, name=name, dtype=dtype)


class BinaryAccuracy(MeanMetricWrapper):
    """How often `y_pred > threshold` equals the 0/1 label, as `keras.metrics.BinaryAccuracy`.

    Shapes: `y_true`, `y_pred` (batch, ...) (e.g. (batch, 1) or (batch,)); multi-label rows
    count the fraction of their labels that match.

    Args:
      name: defaults to "binary_accuracy".
      dtype: None or "float32".
      threshold: float; a prediction above it is class 1 (use 0.0 for logits).
    """

    def __init__(self, name: str | None = "binary_accuracy", dtype=None, threshold: float = 0.5):
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float, np.number)):
            raise errors.InvalidArgumentTypeError(
                f"BinaryAccuracy: threshold must be a float; received {type(threshold).__name__} "
                f"{threshold!r}. Pass e.g. 0.5 (0.0 for logits)."
            )
        super().__init__(binary_accuracy, name=name, dtype=dtype, threshold=float(threshold))


class CategoricalAccuracy(MeanMetricWrapper):
    """How often the argmax of `y_pred` equals the argmax of one-hot `y_true`, as Keras's.

    Shapes: `y_true`, `y_pred` (batch, ..., num_classes). Ties go to the first index (argmax).

    Args:
      name: defaults to "categorical_accuracy".
      dtype: None or "float32".
    """

    def __init__(self, name: str | None = "categorical_accuracy", dtype=None):
        super().__init__(categorical_accuracy, name=name, dtype=dtype)


class SparseCategoricalAccuracy(MeanMetricWrapper):
    """How often the argmax of `y_pred` equals the integer label, as Keras's.

    Shapes: `y_pred` (batch, ..., num_classes) probabilities or logits; `y_true` class ids of
    shape (batch, ...) or (batch, ..., 1).

    Args:
      name: defaults to "sparse_categorical_accuracy".
      dtype: None or "float32".
    """

    def __init__(self, name: str | None = "sparse_categorical_accuracy", dtype=None):
        super().__init__(sparse_categorical_accuracy, name=name, dtype=dtype)


class MeanSquaredError(MeanMetricWrapper):
    """The mean squared error over the examples seen, as `keras.metrics.MeanSquaredError`.

    Shapes: `y_true`, `y_pred` (batch, ...), equal after rank matching.

    Args:
      name: defaults to "mean_squared_error".
      dtype: None or "float32".
    """

    def __init__(self, name: str | None = "mean_squared_error", dtype=None):
        super().__init__(squared_error, name=name, dtype=dtype)


class MeanAbsoluteError(MeanMetricWrapper):
    """The mean absolute error over the examples seen, as `keras.metrics.MeanAbsoluteError`.

    Shapes: `y_true`, `y_pred` (batch, ...), equal after rank matching.

    Args:
      name: defaults to "mean_absolute_error".
      dtype: None or "float32".
    """

    def __init__(self, name: str | None = "mean_absolute_error", dtype=None):
        super().__init__(absolute_error, name=name, dtype=dtype)


# -- per-example functions (Keras's keras.metrics.* functions) -------------------------------
