"""The compiled model's optimizer: optimizers named by string (Keras's defaults),
`OptimizerHandle`, Keras's `model.optimizer` (the learning rate and the update count), and the
check at `compile` that `fit` can run the transformation's update."""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from mirrax import errors
from mirrax._src.distribute import sharded_optimizer

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
        if (
            isinstance(value, bool)
            or np.ndim(value) != 0
            or not isinstance(np.asarray(value).item(), (int, float))
            or not math.isfinite(float(value))
            or float(value) < 0
        ):
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
    if isinstance(optimizer, optax.MultiSteps):  # a class of its own, not a transformation
        return optimizer.gradient_transformation()
    raise errors.InvalidArgumentTypeError(
        "compile: optimizer must be an optax.GradientTransformation or one of the names "
        f"{sorted(_OPTIMIZERS)}; received {type(optimizer).__name__} {optimizer!r:.80}. A Keras "
        "optimizer (Adam, AdamW, SGD, RMSprop) is translated; for others pass e.g. 'adam' or "
        "optax.adam(1e-3)."
    )


def make_handle(module, tx, strategy) -> OptimizerHandle:
    """`compile`'s optimizer: an `nnx.Optimizer` of `module`'s `nnx.Param`s with `tx`, once
    `check_fit_update` and, where the strategy shards the optimizer state, the sharding
    check pass (so what cannot run is refused at compile, not at the first step)."""
    nnx_optimizer = nnx.Optimizer(module, tx, wrt=nnx.Param)
    check_fit_update(tx, module, nnx_optimizer)
    if strategy.extended.shard_optimizer_state and strategy.num_replicas_in_sync > 1:
        sharded_optimizer.check_shardable(nnx_optimizer, "compile")
    return OptimizerHandle(tx, nnx_optimizer)


_MISSING = re.compile(r"missing \d+ required (?:keyword-only |positional )?arguments?: (.*)")


def check_fit_update(tx, module, nnx_optimizer) -> None:
    """Refuses a transformation whose update `fit` cannot call: `fit` calls `tx.update(grads,
    state, params)` with nothing else, as Keras's `apply_gradients` takes the gradients only.
    The update is traced on the parameters' shapes (nothing runs): a failure there is the
    failure the first step would meet.

    Raises:
      UnsupportedArgumentError: the update needs extra arguments (optax's `value`, `grad`,
        `value_fn`: `contrib.reduce_on_plateau`, `scale_by_backtracking_linesearch`,
        `polyak_sgd`), or parameters that are not the model's (`optax.lookahead`'s
        `LookaheadParams`), or fails otherwise (the error it raised is the cause).
    """
    params = nnx.as_pure(nnx.state(module, nnx.Param))
    state = nnx.as_pure(nnx_optimizer.opt_state)
    try:
        jax.eval_shape(lambda g, s, p: tx.update(g, s, p), params, state, params)
    except NameError as e:
        if "unbound axis name" in str(e):
            return  # a collective over the replicas: it runs inside the step only
        raise _refusal(e) from e
    except Exception as e:  # noqa: BLE001 (re-raised with the reason and the fix)
        raise _refusal(e) from e


def _refusal(e: Exception) -> errors.UnsupportedArgumentError:
    missing = _MISSING.search(str(e)) if isinstance(e, TypeError) else None
    if missing:
        return errors.UnsupportedArgumentError(
            f"compile: the optimizer's update needs {missing.group(1)} (optax's extra "
            "arguments), which fit does not pass: it calls the update with the gradients "
            "only, as Keras's apply_gradients. Use a transformation without them (to lower the "
            "rate on a plateau: 'adam' with the ReduceLROnPlateau callback), or write a custom "
            "loop that passes them inside strategy.run: optimizer.update(model, grads, "
            "value=mirrax.get_replica_context().all_reduce('sum', loss))."
        )
    if isinstance(e, AttributeError) and "'fast'" in str(e):
        return errors.UnsupportedArgumentError(
            "compile: the optimizer is optax.lookahead, whose update takes "
            "optax.LookaheadParams (a fast and a slow copy of the parameters); a model holds "
            "one copy, so neither fit nor flax's nnx.Optimizer can pass them (under nnx.jit it "
            f"fails the same way: {type(e).__name__}: {e}). Use the fast optimizer alone, or "
            "keep the LookaheadParams yourself in a custom loop and apply tx.update to them."
        )
    return errors.UnsupportedArgumentError(
        "compile: the optimizer's update cannot run on this model's parameters (traced on "
        f"their shapes, as the first step would): {type(e).__name__}: {e}. Fix the "
        "transformation (its update must take (grads, state, params) with the parameters' "
        "structure), or use another."
    )
