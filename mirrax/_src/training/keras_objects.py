"""Keras 3 loss, optimizer and metric objects given to `Model.compile`, as their mirrax equals.

A tf.keras user's `compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
optimizer=keras.optimizers.Adam(1e-3), metrics=[keras.metrics.SparseCategoricalAccuracy()])`
keeps working: a Keras loss is evaluated per example by its own `call` (Keras's arithmetic,
then mirrax's masked, cross-replica reduction), a Keras optimizer becomes the optax
transformation with the same update rule and hyperparameters, and a Keras metric becomes the
mirrax metric of the same class. What has no equal is refused with the alternative.
"""

from __future__ import annotations

import math
import sys
import warnings

import optax

from mirrax import errors
from mirrax._src.training import losses as losses_lib
from mirrax._src.training import metric_registry


def _is_keras(obj, package: str, base: str) -> bool:
    # A Keras object (or a user's subclass of one) cannot exist unless Keras was imported.
    keras = sys.modules.get("keras")
    return keras is not None and isinstance(obj, getattr(getattr(keras, package), base))


def is_keras_loss(obj) -> bool:
    """Whether `obj` is a `keras.losses.Loss` instance (Keras is not imported otherwise)."""
    return _is_keras(obj, "losses", "Loss")


def is_keras_optimizer(obj) -> bool:
    """Whether `obj` is a `keras.optimizers.Optimizer` instance."""
    return _is_keras(obj, "optimizers", "Optimizer")


def is_keras_metric(obj) -> bool:
    """Whether `obj` is a `keras.metrics.Metric` instance."""
    return _is_keras(obj, "metrics", "Metric")


def _config(obj) -> dict:
    # Keras's get_config reads its variables with np.array(variable), which NumPy 2 warns
    # about (Keras's code, not the user's); the values are right.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return obj.get_config()


# Keras reductions that mean mirrax's: the weighted sum over the batch / the number of examples.
_MEAN_REDUCTIONS = ("sum_over_batch_size", "mean")


def loss_from_keras(loss) -> losses_lib.Loss:
    """A `mirrax.losses.Loss` computing `loss.call(y_true, y_pred)` per example.

    Raises:
      UnsupportedArgumentError: the loss reduces otherwise than Keras's default
        "sum_over_batch_size" (the message names the reduction received).
    """
    reduction = _config(loss).get("reduction", "sum_over_batch_size")
    if reduction not in _MEAN_REDUCTIONS:
        raise errors.UnsupportedArgumentError(
            f"compile: the Keras loss {type(loss).__name__} has reduction={reduction!r}; mirrax "
            "reduces every loss as Keras's default 'sum_over_batch_size' (the weighted sum over "
            "the global batch divided by its number of examples, every replica's share added "
            "once). Build the loss with the default reduction."
        )
    return losses_lib.LossFunctionWrapper(loss.call, name=loss.name)


def metric_from_keras(metric):
    """The `mirrax.metrics` metric of the Keras metric's class, with its name and arguments.

    Raises:
      UnsupportedArgumentError: mirrax has no metric of that class, or not with those
        arguments (the message names the class and the mirrax metrics to use).
    """
    try:
        cls = type(metric_registry.get(type(metric).__name__))
    except errors.InvalidIdentifierError:
        cls = None
    config = {k: v for k, v in _config(metric).items() if k != "dtype"}
    if cls is None:
        raise errors.UnsupportedArgumentError(
            f"compile: mirrax has no metric like the Keras metric {type(metric).__name__} "
            f"({metric.name!r}). Pass a name ('accuracy', 'mse', ...), a mirrax.metrics "
            "metric, or a function fn(y_true, y_pred) returning one value per example."
        )
    try:
        return cls(**config)
    except TypeError as error:
        raise errors.UnsupportedArgumentError(
            f"compile: the Keras metric {type(metric).__name__} with {config} has no mirrax "
            f"equal ({error}); pass mirrax.metrics.{cls.__name__}(...) with the arguments it "
            "takes."
        ) from None


def _learning_rate(optimizer, config) -> float:
    rate = config["learning_rate"]
    if not isinstance(rate, (int, float)) or isinstance(rate, bool) or not math.isfinite(rate):
        raise errors.UnsupportedArgumentError(
            f"compile: the Keras optimizer {type(optimizer).__name__} has learning_rate="
            f"{rate!r}; mirrax takes a Keras optimizer with a constant learning rate only. For "
            "a schedule, pass an optax optimizer with an optax schedule, or keep the constant "
            "rate and change it with mirrax.callbacks.LearningRateScheduler."
        )
    return float(rate)


# Keras's options of every optimizer, with the value that means "off", and what to use instead.
_COMMON_OFF = {
    "clipnorm": (None, "clip with an optax optimizer, e.g. optax.chain(optax.clip(...), "
                       "optax.adam(...))"),
    "clipvalue": (None, "pass optax.chain(optax.clip(value), optax.adam(...))"),
    "global_clipnorm": (None, "pass optax.chain(optax.clip_by_global_norm(n), optax.adam(...))"),
    "use_ema": (False, "keep an average of the weights in a callback"),
    "loss_scale_factor": (None, "set the dtype policy to 'mixed_float16' for loss scaling"),
    "gradient_accumulation_steps": (None, "pass compile(gradient_accumulation_steps=k)"),
}


def _refuse_options(optimizer, config, allowed):
    for name, (off, instead) in _COMMON_OFF.items():
        if name not in allowed and config.get(name, off) not in (off, 0.0):
            raise errors.UnsupportedArgumentError(
                f"compile: the Keras optimizer {type(optimizer).__name__} has {name}="
                f"{config[name]!r}, which mirrax does not translate; {instead}."
            )


def optimizer_from_keras(optimizer) -> optax.GradientTransformation:
    """The optax transformation with the Keras optimizer's update rule and hyperparameters, its
    learning rate in `optax.inject_hyperparams` state (so callbacks can change it).

    Adam, AdamW, SGD (momentum, nesterov) and RMSprop (rho, momentum, centered) translate.

    Raises:
      UnsupportedArgumentError: another optimizer class, a learning-rate schedule, weight
        decay on an optimizer other than AdamW, amsgrad, or gradient clipping / EMA / loss
        scaling options (the message names the optax route).
    """
    config = _config(optimizer)
    name = type(optimizer).__name__
    rate = _learning_rate(optimizer, config)
    decay = config.get("weight_decay") or 0.0
    if decay and name != "AdamW":
        raise errors.UnsupportedArgumentError(
            f"compile: the Keras optimizer {name} has weight_decay={decay!r}; mirrax translates "
            "weight decay for keras.optimizers.AdamW only. Use AdamW, or optax.adamw(...)."
        )
    _refuse_options(optimizer, config, allowed=())
    inject = optax.inject_hyperparams
    if name in ("Adam", "AdamW"):
        kwargs = dict(learning_rate=rate, b1=config["beta_1"], b2=config["beta_2"],
                      eps=config["epsilon"])
        if config.get("amsgrad"):
            # optax.amsgrad keeps the maximum of the bias-corrected second moment, Keras of
            # the raw one: different updates (2e-3 relative after 3 steps).
            raise errors.UnsupportedArgumentError(
                f"compile: keras.optimizers.{name}(amsgrad=True) has no optax equal with "
                "Keras's arithmetic; pass amsgrad=False, or optax.amsgrad(...) for optax's "
                "variant.")
        if name == "AdamW":
            return inject(optax.adamw)(weight_decay=decay, **kwargs)
        return inject(optax.adam)(**kwargs)
    if name == "SGD":
        momentum = config.get("momentum") or None
        return inject(optax.sgd)(learning_rate=rate, momentum=momentum,
                                 nesterov=bool(config.get("nesterov")))
    if name == "RMSprop":
        # Keras adds epsilon outside the square root.
        return inject(optax.rmsprop)(learning_rate=rate, decay=config["rho"],
                                     eps=config["epsilon"], eps_in_sqrt=False,
                                     momentum=config.get("momentum") or None,
                                     centered=bool(config.get("centered")))
    raise errors.UnsupportedArgumentError(
        f"compile: the Keras optimizer {name} has no translation in mirrax (Adam, AdamW, SGD and "
        "RMSprop have). Pass an optax optimizer, e.g. optax.inject_hyperparams(optax.adagrad)("
        "learning_rate=1e-3), or a name: 'adam', 'adamw', 'sgd', 'rmsprop'."
    )


def from_keras(loss, optimizer, metrics, weighted_metrics):
    """`compile`'s loss, optimizer and metric lists with every Keras object translated."""
    def translate(items):
        if items is None or isinstance(items, (str, dict)) or not hasattr(items, "__iter__"):
            return items
        return [metric_from_keras(m) if is_keras_metric(m) else m for m in items]

    if is_keras_loss(loss):
        loss = loss_from_keras(loss)
    if is_keras_optimizer(optimizer):
        optimizer = optimizer_from_keras(optimizer)
    return loss, optimizer, translate(metrics), translate(weighted_metrics)
