"""Keras 3 loss, optimizer and metric objects given to `Model.compile`, as their mirrax equals.

A tf.keras user's `compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
optimizer=keras.optimizers.Adam(1e-3), metrics=[keras.metrics.SparseCategoricalAccuracy()])`
keeps working: a Keras loss is evaluated per example by its own `call` (Keras's arithmetic,
then mirrax's masked, cross-replica reduction), a Keras optimizer becomes the optax
transformation with the same update rule and hyperparameters, and a Keras metric becomes the
mirrax metric of the same class. What has no equal is refused with the alternative.
"""

from __future__ import annotations

import inspect
import math
import sys
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
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


def keras_config(obj) -> dict:
    """`obj.get_config()` of a Keras object, without NumPy 2's warning about Keras's code."""
    # Keras's get_config reads its variables with np.array(variable), which NumPy 2 warns
    # about (Keras's code, not the user's); the values are right.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return obj.get_config()


# Keras reductions that mean mirrax's: the weighted sum over the batch / the number of examples.
_MEAN_REDUCTIONS = ("sum_over_batch_size", "mean")


def _mirrax_class(keras_object, lookup):
    """The mirrax class of the Keras object's class name, or None."""
    try:
        return type(lookup(type(keras_object).__name__))
    except errors.InvalidIdentifierError:
        return None


def _arguments_for(cls, keras_object, config) -> tuple[dict, dict]:
    """(the config's arguments `cls` takes, the ones it does not take whose value differs from
    a default-constructed Keras object's); "name" always passes, "dtype" never."""
    try:
        defaults = keras_config(type(keras_object)())
    except Exception:  # a class without defaults for every argument
        defaults = {}
    taken = set(inspect.signature(cls.__init__).parameters)
    passed = {k: v for k, v in config.items() if k in taken and k != "dtype"}
    dropped = {
        k: v
        for k, v in config.items()
        if k not in taken and k not in ("name", "dtype") and (k not in defaults or defaults[k] != v)
    }
    return passed, dropped


def loss_from_keras(loss) -> losses_lib.Loss:
    """The `mirrax.losses.Loss` of a Keras loss: mirrax's loss of the same class and arguments
    when there is one (so its label checks run), else one computing `loss.call(y_true, y_pred)`
    per example (Keras's arithmetic), reduced by mirrax.

    Raises:
      UnsupportedArgumentError: the loss reduces otherwise than Keras's default
        "sum_over_batch_size", or ignores a class (`ignore_class`: mirrax would count the
        ignored examples in the mean); the message names the alternative.
    """
    config = keras_config(loss)
    reduction = config.get("reduction", "sum_over_batch_size")
    if reduction not in _MEAN_REDUCTIONS:
        raise errors.UnsupportedArgumentError(
            f"compile: the Keras loss {type(loss).__name__} has reduction={reduction!r}; mirrax "
            "reduces every loss as Keras's default 'sum_over_batch_size' (the weighted sum over "
            "the global batch divided by its number of examples, every replica's share added "
            "once). Build the loss with the default reduction."
        )
    if config.get("ignore_class") is not None:
        raise errors.UnsupportedArgumentError(
            f"compile: the Keras loss {type(loss).__name__} has ignore_class="
            f"{config['ignore_class']!r}, which mirrax does not translate (its mean would still "
            "count the ignored examples). Pass sample_weight 0 for the examples of that class "
            "and the loss without ignore_class."
        )
    cls = _mirrax_class(loss, losses_lib.get)
    if cls is not None:
        config = {
            k: v
            for k, v in config.items()
            if not (k == "reduction" or (k == "axis" and v == -1) or k == "ignore_class")
        }
        passed, dropped = _arguments_for(cls, loss, config)
        if not dropped:
            return cls(**passed)
    return losses_lib.LossFunctionWrapper(loss.call, name=loss.name)


def metric_from_keras(metric):
    """The `mirrax.metrics` metric of the Keras metric's class, with its name and arguments.

    Raises:
      UnsupportedArgumentError: mirrax has no metric of that class, or not with those
        arguments (the message names the class, the arguments and the mirrax metrics to use).
    """
    cls = _mirrax_class(metric, metric_registry.get)
    if cls is None:
        raise errors.UnsupportedArgumentError(
            f"compile: mirrax has no metric like the Keras metric {type(metric).__name__} "
            f"({metric.name!r}). Pass a name ('accuracy', 'mse', ...), a mirrax.metrics "
            "metric, or a function fn(y_true, y_pred) returning one value per example."
        )
    passed, dropped = _arguments_for(cls, metric, keras_config(metric))
    if dropped:
        raise errors.UnsupportedArgumentError(
            f"compile: the Keras metric {type(metric).__name__} has {dropped}, which "
            f"mirrax.metrics.{cls.__name__} does not take; pass mirrax.metrics.{cls.__name__}"
            f"(...) with the arguments it takes, or leave those at Keras's defaults."
        )
    return cls(**passed)


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
    "clipnorm": (None, "clip with an optax optimizer, e.g. optax.chain(optax.clip(...), optax.adam(...))"),
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


class KerasAdamState(NamedTuple):
    """Adam's state: the update count and the first and second moments."""

    # optax's field name (its ScaleByAdamState's), which shadows tuple.count as optax's does.
    count: jax.Array  # type: ignore[assignment]
    mu: optax.Updates
    nu: optax.Updates


def scale_by_keras_adam(b1: float, b2: float, eps: float) -> optax.GradientTransformation:
    """Adam's direction exactly as Keras 3 computes it: alpha * m / (sqrt(v) + eps) with
    alpha = sqrt(1 - b2^t) / (1 - b1^t). optax's adam adds eps to sqrt(v_hat) instead, which
    is Keras's with eps * sqrt(1 - b2^t): a different step wherever sqrt(v) is near eps."""

    def init(params):
        zeros = jax.tree.map(jnp.zeros_like, params)
        return KerasAdamState(jnp.zeros((), jnp.int32), zeros, zeros)

    def update(updates, state, params=None):
        mu = optax.tree_utils.tree_update_moment(updates, state.mu, b1, 1)
        nu = optax.tree_utils.tree_update_moment_per_elem_norm(updates, state.nu, b2, 2)
        count = optax.safe_increment(state.count)
        t = count.astype(jnp.float32)
        alpha = jnp.sqrt(1 - b2**t) / (1 - b1**t)
        direction = jax.tree.map(lambda m, v: alpha * m / (jnp.sqrt(v) + eps), mu, nu)
        return direction, KerasAdamState(count, mu, nu)

    return optax.GradientTransformation(init, update)


def keras_adam(learning_rate, b1, b2, eps) -> optax.GradientTransformation:
    """`keras.optimizers.Adam`'s update (for `optax.inject_hyperparams`)."""
    return optax.chain(scale_by_keras_adam(b1, b2, eps), optax.scale_by_learning_rate(learning_rate))


def keras_adamw(learning_rate, b1, b2, eps, weight_decay) -> optax.GradientTransformation:
    """`keras.optimizers.AdamW`'s: Keras subtracts lr * weight_decay * w before Adam's step."""
    return optax.chain(
        scale_by_keras_adam(b1, b2, eps),
        optax.add_decayed_weights(weight_decay),
        optax.scale_by_learning_rate(learning_rate),
    )


def keras_sgd(learning_rate, momentum: float, nesterov: bool) -> optax.GradientTransformation:
    """`keras.optimizers.SGD`'s: the velocity accumulates lr * g (v = momentum * v - lr * g),
    so a changed rate leaves the steps already taken as they were (optax's sgd scales the
    accumulated velocity by the new rate instead)."""
    scaled = optax.scale_by_learning_rate(learning_rate)
    if not momentum:
        return scaled
    return optax.chain(scaled, optax.trace(decay=momentum, nesterov=nesterov))


def optimizer_from_keras(optimizer) -> optax.GradientTransformation:
    """The optax transformation with the Keras optimizer's update rule and hyperparameters, its
    learning rate in `optax.inject_hyperparams` state (so callbacks can change it).

    Adam, AdamW, SGD (momentum, nesterov) and RMSprop (rho, momentum, centered) translate.

    Raises:
      UnsupportedArgumentError: another optimizer class, a learning-rate schedule, weight
        decay on an optimizer other than AdamW, amsgrad, or gradient clipping / EMA / loss
        scaling options (the message names the optax route).
    """
    config = keras_config(optimizer)
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
        if config.get("amsgrad"):
            raise errors.UnsupportedArgumentError(
                f"compile: keras.optimizers.{name}(amsgrad=True) is not translated (optax's "
                "amsgrad keeps the maximum of another moment than Keras's); pass amsgrad=False, "
                "or optax.amsgrad(...) for optax's variant."
            )
        kwargs = dict(learning_rate=rate, b1=config["beta_1"], b2=config["beta_2"], eps=config["epsilon"])
        if name == "AdamW":
            return inject(keras_adamw)(weight_decay=decay, **kwargs)
        return inject(keras_adam)(**kwargs)
    if name == "SGD":
        return inject(keras_sgd, static_args=("momentum", "nesterov"))(
            learning_rate=rate,
            momentum=float(config.get("momentum") or 0.0),
            nesterov=bool(config.get("nesterov")),
        )
    if name == "RMSprop":
        # Keras divides by sqrt(velocity + epsilon) (centered: velocity - mean² + epsilon).
        return inject(optax.rmsprop)(
            learning_rate=rate,
            decay=config["rho"],
            eps=config["epsilon"],
            eps_in_sqrt=True,
            momentum=config.get("momentum") or None,
            centered=bool(config.get("centered")),
        )
    raise errors.UnsupportedArgumentError(
        f"compile: the Keras optimizer {name} has no translation in mirrax (Adam, AdamW, SGD and "
        "RMSprop have). Pass an optax optimizer, e.g. optax.inject_hyperparams(optax.adagrad)("
        "learning_rate=1e-3), or a name: 'adam', 'adamw', 'sgd', 'rmsprop'."
    )


def from_keras(loss, optimizer, metrics, weighted_metrics):
    """`compile`'s loss, optimizer and metric lists with every Keras object translated (in a
    list or dict of per-output losses or metrics too)."""

    def translate(items):
        if isinstance(items, dict):
            return {k: translate(v) for k, v in items.items()}
        if isinstance(items, (list, tuple)):
            return [translate(m) for m in items]
        return metric_from_keras(items) if is_keras_metric(items) else items

    def translate_loss(loss):
        if isinstance(loss, dict):
            return {k: translate_loss(v) for k, v in loss.items()}
        if isinstance(loss, (list, tuple)):
            return [translate_loss(v) for v in loss]
        return loss_from_keras(loss) if is_keras_loss(loss) else loss

    if is_keras_optimizer(optimizer):
        optimizer = optimizer_from_keras(optimizer)
    return translate_loss(loss), optimizer, translate(metrics), translate(weighted_metrics)
