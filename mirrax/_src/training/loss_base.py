"""The base of mirrax's Keras-named losses (losses.py has the built-in classes and `get`).

A `Loss` has two faces. `per_example(y_true, y_pred)` is the float32 loss of each example
(Keras's `reduction=None`, averaged over trailing axes as Keras's loss functions average the last
one). `loss(y_true, y_pred, sample_weight)` is `mirrax.compute_average_loss` of that: inside
`strategy.run` this replica's share of the global mean over the real (unmasked) examples, so the
replicas' shares add up to Keras's "sum_over_batch_size" of the global batch; outside every
strategy the plain weighted mean.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax.numpy as jnp

from mirrax import errors
from mirrax._src.distribute.losses import compute_average_loss
from mirrax._src.training import loss_reductions as reductions
from mirrax._src.training import targets

# Keras 3 loss arguments mirrax does not take, and what to use instead.
_KERAS_ONLY_ARGUMENTS = {
    "ignore_class": "mask those examples with sample_weight (0 for the ignored class)",
    "axis": "put the class axis last",
    "dtype": "losses compute in float32 (mirrax.mixed_precision keeps them there)",
}


def refusing_keras_only_arguments(init):
    """`init`, raising UnsupportedArgumentError (naming the alternative) for Keras-only keywords;
    `reduction` is taken here, for every class (see `reductions.check_reduction`)."""

    @functools.wraps(init)
    def wrapper(self, *args, reduction="sum_over_batch_size", **kwargs):
        for name in kwargs:
            if name in _KERAS_ONLY_ARGUMENTS:
                raise errors.UnsupportedArgumentError(
                    f"{type(self).__name__}({name}={kwargs[name]!r}): mirrax's losses do not take "
                    f"Keras's {name!r} argument; {_KERAS_ONLY_ARGUMENTS[name]}."
                )
        reduction = reductions.check_reduction(type(self).__name__, reduction)
        init(self, *args, **kwargs)
        self.reduction = reduction

    return wrapper


class Loss:
    """Base class of the losses, as `keras.losses.Loss` with reduction "sum_over_batch_size".

    Subclasses implement `_elementwise(y_true, y_pred)`, the loss of each element of shape
    (batch, ...) in float32; `per_example` averages its trailing axes and `__call__` reduces it
    with `mirrax.compute_average_loss`.

    Every class takes Keras's `reduction=`: "sum_over_batch_size" (the default), "sum", or None /
    "none" / `Reduction.NONE` (TF users' spelling): `__call__` then returns one loss per example,
    shape (batch,), for `mirrax.compute_average_loss`. `compile` uses `per_example` whatever the
    reduction (and refuses a loss built with another reduction than the default).

    Attributes:
      name: the loss's name (Keras's default names, e.g. "sparse_categorical_crossentropy").
      reduction: None, "sum" or "sum_over_batch_size".
    """

    default_name = "loss"
    reduction: str | None  # set by the wrapper every __init__ gets (refusing_keras_only_arguments)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "__init__" in vars(cls):
            # Wrapped in place: every class takes reduction= and refuses Keras-only arguments.
            cls.__init__ = refusing_keras_only_arguments(cls.__init__)  # type: ignore[method-assign]

    def __init__(self, name: str | None = None):
        if name is not None and not isinstance(name, str):
            raise errors.InvalidArgumentTypeError(
                f"{type(self).__name__}: name must be a string; received {name!r}."
            )
        self.name = name or self.default_name

    def _elementwise(self, y_true, y_pred):
        raise NotImplementedError(f"{type(self).__name__} must implement _elementwise.")

    def per_example(self, y_true, y_pred):
        """The loss of each example, as a Keras loss with `reduction=None`.

        Args:
          y_true: labels/targets of shape (batch, ...) (see the subclass for the exact shape).
          y_pred: predictions of shape (batch, ...); cast to float32.

        Returns:
          float32 array of shape (batch,): each example's loss, averaged over every axis after
          the batch axis (Keras averages the last axis; "sum_over_batch_size" then averages the
          rest, so the mean of these values is Keras's reduced loss).

        Raises:
          ValueError: `y_pred` has no batch axis, or the shapes do not fit the loss.
        """
        y_pred = jnp.asarray(y_pred)
        if y_pred.ndim == 0:
            raise errors.IncompatibleInputError(
                f"{type(self).__name__}: y_pred must have a leading batch axis, but received a "
                "scalar. Pass the predictions for a batch of examples, shape (batch, ...)."
            )
        return targets.mean_trailing(self._elementwise(y_true, y_pred))

    def __call__(self, y_true, y_pred, sample_weight=None):
        """The weighted mean loss, as `keras.losses.Loss.__call__` ("sum_over_batch_size").

        Equals `mirrax.compute_average_loss(self.per_example(y_true, y_pred), sample_weight)`:
        the weighted sum of the real examples' losses divided by the number of real examples
        over all replicas (weights never divide). Inside `strategy.run` the result is this
        replica's share (the shares add up to the global mean); outside every strategy, the mean
        over the batch.

        Args:
          y_true, y_pred: as `per_example`.
          sample_weight: None, a scalar, an array of shape (batch,) or (batch, 1), or an array
            matching the leading axes of the element loss (e.g. (batch, time) for a sequence
            model): the axes it does not cover are averaged first, then it weighs, then the
            rest are averaged, as Keras.

        Returns:
          A float32 scalar.

        Raises:
          ReplicaContextError: called in cross-replica context (inside `strategy.scope()`,
            outside `strategy.run`), where there is no replica to count examples over.
          ValueError: the shapes do not fit the loss or each other.
        """
        if self.reduction != "sum_over_batch_size":
            return reductions.unaveraged(self, self.per_example(y_true, y_pred), sample_weight)
        if sample_weight is None:
            return compute_average_loss(self.per_example(y_true, y_pred))
        weight = jnp.asarray(sample_weight, jnp.float32)
        if weight.ndim > 1 and all(d == 1 for d in weight.shape[1:]):
            weight = weight.reshape(weight.shape[:1])
        if weight.ndim <= 1:
            per_example = self.per_example(y_true, y_pred)
            if weight.ndim == 1 and weight.shape != per_example.shape:
                raise errors.IncompatibleInputError(
                    f"{self.name}: sample_weight has {weight.shape[0]} entries but the batch has "
                    f"{per_example.shape[0]} examples; pass one weight per example."
                )
            return compute_average_loss(per_example, weight)
        y_pred = jnp.asarray(y_pred)
        elementwise = self._elementwise(y_true, y_pred)
        if weight.ndim > elementwise.ndim or weight.shape != elementwise.shape[: weight.ndim]:
            raise errors.IncompatibleInputError(
                f"{self.name}: sample_weight of shape {weight.shape} fits neither the batch "
                f"{elementwise.shape[:1]} nor the leading axes of the element loss "
                f"{elementwise.shape}; pass one weight per example, shape (batch,), or e.g. "
                "one per time step, shape (batch, time)."
            )
        # As Keras: average the axes the weights do not cover, weigh, then average the rest.
        covered = elementwise.mean(axis=tuple(range(weight.ndim, elementwise.ndim)))
        return compute_average_loss(targets.mean_trailing(covered * weight))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


Loss.__init__ = refusing_keras_only_arguments(Loss.__init__)  # type: ignore[method-assign]


class LossFunctionWrapper(Loss):
    """A `Loss` from a function `fn(y_true, y_pred) -> per-example loss`, as Keras's wrapper.

    `fn` returns an array of shape (batch, ...); trailing axes are averaged. Note the argument
    order: Keras's (y_true, y_pred), not optax's (predictions, targets).

    Raises (from `per_example`):
      ValueError: `fn` returned a scalar (a reduced loss) instead of one loss per example.
    """

    def __init__(self, fn: Callable, name: str | None = None):
        if not callable(fn):
            raise errors.InvalidArgumentTypeError(
                f"LossFunctionWrapper needs a function fn(y_true, y_pred) -> per-example loss; "
                f"received {type(fn).__name__} {fn!r:.60}."
            )
        super().__init__(name=name or getattr(fn, "__name__", "loss"))
        self.fn = fn

    def _elementwise(self, y_true, y_pred):
        values = jnp.asarray(self.fn(y_true, y_pred))
        if values.ndim == 0:
            raise errors.IncompatibleInputError(
                f"loss function {self.name!r} returned a scalar; it must return one loss per "
                f"example, shape (batch, ...) (Keras's reduction=None), for batch size "
                f"{y_pred.shape[0]}. Remove the final mean/sum from the function."
            )
        return values.astype(jnp.float32)
