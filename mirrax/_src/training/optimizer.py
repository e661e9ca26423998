"""The compiled model's optimizer: optimizers named by string (Keras's defaults) and
`OptimizerHandle`, Keras's `model.optimizer` (the learning rate and the update count)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mirrax import errors


# Keras's defaults for optimizers named by string.
_OPTIMIZERS = {
    "adam": lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-3, b1=0.9, b2=0.999, eps=1e-7),
    "sgd": lambda: optax.inject_hyperparams(optax.sgd)(learning_rate=1e-2),
    "rmsprop": lambda: optax.inject_hyperparams(optax.rmsprop)(learning_rate=1e-3, decay=0.9, eps=1e-7),
    "adamw": lambda: optax.inject_hyperparams(optax.adamw)(
        learning_rate=1e-3, b1=0.9, b2=0.999, eps=1e-7, weight_decay=0.004
    ),
}


class OptimizerHandle:
    """The compiled model's optimizer, as Keras's `model.optimizer`.

    Attributes:
      tx: the optax `GradientTransformation`.
      nnx_optimizer: the `nnx.Optimizer` holding the state (its `step` counts updates).
      learning_rate: the current learning rate (float); set it to change the rate of the next
        step without recompiling. Requires the rate to live in `optax.inject_hyperparams`
        state (string optimizers do).
      iterations: number of updates applied so far (int).
      dynamic_scale: under the "mixed_float16" policy with `auto_scale_loss`, the
        `mirrax.mixed_precision.LossScale` (its `scale` is the current loss scale), as Keras's
        `LossScaleOptimizer.dynamic_scale`; else None.
    """

    def __init__(self, tx, nnx_optimizer, dynamic_scale=None):
        self.tx = tx
        self.nnx_optimizer = nnx_optimizer
        self.dynamic_scale = dynamic_scale

    def _hyperparams(self):
        state = self.nnx_optimizer.opt_state
        # optax.MultiSteps (gradient accumulation) keeps the wrapped optimizer's state inside.
        state = getattr(state, "inner_opt_state", state)
        hyperparams = getattr(state, "hyperparams", None)
        if not hyperparams or "learning_rate" not in hyperparams:
            raise AttributeError(
                "This optimizer keeps no learning rate in its state, so it cannot be read or "
                "changed during training. Build it with optax.inject_hyperparams, e.g. "
                "optax.inject_hyperparams(optax.adam)(learning_rate=1e-3), or pass a string "
                "such as 'adam'."
            )
        return hyperparams

    @property
    def learning_rate(self) -> float:
        return float(self._hyperparams()["learning_rate"][...])

    @learning_rate.setter
    def learning_rate(self, value: float):
        if isinstance(value, bool) or np.ndim(value) != 0 or not isinstance(
                np.asarray(value).item(), (int, float)) or not math.isfinite(float(value)) \
                or float(value) < 0:
            raise errors.InvalidArgumentError(
                f"optimizer.learning_rate must be a finite float >= 0; received {value!r}."
            )
        variable = self._hyperparams()["learning_rate"]
        old = variable[...]
        variable[...] = jax.device_put(jnp.asarray(value, old.dtype), old.sharding)

    @property
    def has_learning_rate(self) -> bool:
        """Whether the learning rate can be read and set (it lives in the optimizer's state)."""
        try:
            self._hyperparams()
        except AttributeError:
            return False
        return True

    @property
    def iterations(self) -> int:
        return int(self.nnx_optimizer.step[...])


def resolve_optimizer(optimizer):
    """An optax `GradientTransformation` for `compile(optimizer=...)`: a name gives Keras's
    defaults in `inject_hyperparams` state.

    Raises:
      InvalidIdentifierError: an unknown name. InvalidArgumentTypeError: another type.
    """
    if isinstance(optimizer, str):
        factory = _OPTIMIZERS.get(optimizer.lower())
        if factory is None:
            raise errors.InvalidIdentifierError(
                f"Unknown optimizer {optimizer!r}; known names: {', '.join(sorted(_OPTIMIZERS))}, "
                "or pass any optax.GradientTransformation."
            )
        return factory()
    if isinstance(optimizer, optax.GradientTransformation):
        return optimizer
    raise errors.InvalidArgumentTypeError(
        "compile: optimizer must be an optax.GradientTransformation or one of the names "
        f"{sorted(_OPTIMIZERS)}; received {type(optimizer).__name__} {optimizer!r:.80}. A Keras "
        "optimizer (Adam, AdamW, SGD, RMSprop) is translated; for others pass e.g. 'adam' or "
        "optax.adam(1e-3)."
    )
