"""A Keras 3 optimizer in a custom training loop: `mirrax.KerasOptimizer`, an NNX object.

TF's custom-training tutorial calls `optimizer.apply_gradients(zip(grads,
model.trainable_variables))` inside the step that `strategy.run` runs. Under JAX the step must
carry the optimizer's state in and out, so the Keras optimizer is held here as NNX state: its
variables (update count, learning rate, moments) are `nnx.OptState` copies, and each update is
Keras's own arithmetic, run statelessly (`keras_optimizer.stateless_apply`, as Keras's JAX
trainer runs it). Every Keras optimizer, schedule and option works as in Keras.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mirrax import errors
from mirrax._src.training import keras_models, keras_objects


def _keras_module(model, what: str):
    module = getattr(model, "module", model)  # a mirrax.Model or its KerasModule
    if not isinstance(module, keras_models.KerasModule):
        raise errors.InvalidArgumentTypeError(
            f"{what}: model must be a mirrax.Model of a Keras model (or its .module); received "
            f"{type(model).__name__}. For an NNX module use nnx.Optimizer(module, "
            "optax.adam(1e-3), wrt=nnx.Param) and optimizer.update(module, grads)."
        )
    return module


def _value(leaf):
    return leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf


class KerasOptimizer(nnx.Pytree):
    """A Keras optimizer for a Keras model's `nnx.Param`s in a custom loop, updated by Keras.

    Build it where TF builds the optimizer (under `strategy.scope()`), pass it to
    `strategy.run` with the model's module, and in the step call either
    `optimizer.apply_gradients(zip(grads, model.trainable_variables))` (TF's line; `grads` a
    list in that order) or `optimizer.update(model, grads)` (`grads` as `nnx.grad` /
    `mirrax.value_and_grad` return them, nnx.Optimizer's line). The update is
    `keras_optimizer.stateless_apply`: Keras's arithmetic exactly, for every optimizer class.

    Args:
      model: a `mirrax.Model` of a Keras model, or its `module` (a `KerasModule`).
      optimizer: a `keras.optimizers.Optimizer`, not yet built (it is built here for the
        model's trainable variables, in `trainable_variables`' order).

    Attributes:
      keras_optimizer: the Keras optimizer (its own variables are not updated; `iterations`
        and the state live here).
      variables: one `nnx.OptState` per Keras optimizer variable, in its `variables` order.

    Raises:
      InvalidArgumentTypeError: `optimizer` is not a Keras optimizer, or `model` is not a
        Keras model's.
      InvalidArgumentError: the optimizer is already built.
    """

    def __init__(self, model, optimizer):
        module = _keras_module(model, "KerasOptimizer")
        if not keras_objects.is_keras_optimizer(optimizer):
            raise errors.InvalidArgumentTypeError(
                f"KerasOptimizer: optimizer must be a keras.optimizers.Optimizer (e.g. "
                f"keras.optimizers.Adam(1e-3)); received {type(optimizer).__name__}. For an "
                "optax optimizer use nnx.Optimizer(model.module, tx, wrt=nnx.Param)."
            )
        keras_model = module.keras_model
        trainable = [keras_model.variables[i] for i in module.trainable_index]
        if optimizer.built:
            raise errors.InvalidArgumentError(
                f"KerasOptimizer: the Keras optimizer {optimizer.name!r} is already built (for "
                "some variables, by Keras's fit or apply_gradients); pass a new one, e.g. "
                f"keras.optimizers.{type(optimizer).__name__}.from_config(optimizer.get_config())."
            )
        optimizer.build(trainable)
        self.keras_optimizer = nnx.static(optimizer)
        self.shapes = nnx.static(tuple((tuple(v.shape), str(v.dtype)) for v in trainable))
        self.trainable_index = nnx.static(module.trainable_index)
        # The pairs of apply_gradients come in module.trainable_variables' (state leaf) order;
        # the Keras optimizer's slots are in Keras's.
        self.gradient_order = nnx.static(tuple(module.gradient_order()))
        self.variables = nnx.List([nnx.OptState(jnp.array(v.value, copy=True)) for v in optimizer.variables])
        ids = [id(v) for v in optimizer.variables]
        self.iterations_index = nnx.static(ids.index(id(optimizer.iterations)))
        # Keras's `learning_rate` is one of its variables unless it is a schedule.
        rate = id(optimizer.learning_rate)
        self.learning_rate_index = nnx.static(ids.index(rate) if rate in ids else None)

    @property
    def iterations(self):
        """The number of updates applied (int64 scalar array), as Keras's `iterations`."""
        return self.variables[self.iterations_index].get_value()

    @property
    def learning_rate(self) -> float:
        """The learning rate of the next update (float), as Keras's; settable (e.g. by a
        schedule the loop computes) when it is a constant, not a Keras schedule.

        Raises:
          AttributeError: the optimizer's learning rate is a schedule (Keras computes it).
        """
        return float(self._rate_variable().get_value())

    @learning_rate.setter
    def learning_rate(self, value: float) -> None:
        variable = self._rate_variable()
        old = variable.get_value()
        variable.set_value(jax.device_put(jnp.asarray(value, old.dtype), old.sharding))

    def _rate_variable(self):
        if self.learning_rate_index is None:
            raise AttributeError(
                f"The Keras optimizer {self.keras_optimizer.name!r} has a learning-rate "
                "schedule, which Keras evaluates at each update; it has no value to read or set."
            )
        return self.variables[self.learning_rate_index]

    def _built_optimizer(self):
        """The Keras optimizer, built. A copy made from its config (Keras pickles an optimizer
        that way, e.g. when a ParameterServerStrategy sends this object's structure to its
        workers) is not built: it is built here for variables of the recorded shapes, which
        gives it the same variables (the state itself is this object's `variables`)."""
        optimizer = self.keras_optimizer
        if not optimizer.built:
            keras = sys.modules["keras"]  # a Keras optimizer exists: Keras is imported

            # Eagerly, also inside a traced step: the optimizer's own variables are made from
            # concrete zeros, never from tracers.
            with jax.ensure_compile_time_eval():
                optimizer.build(
                    [
                        keras.Variable(np.zeros(shape, dtype), name=f"variable_{i}")
                        for i, (shape, dtype) in enumerate(self.shapes)
                    ]
                )
        return optimizer

    def _apply(self, grads: list, params: list) -> None:
        values = [p.get_value() for p in params]
        with jax.numpy_rank_promotion("allow"):
            new_values, new_state = self._built_optimizer().stateless_apply(
                [v.get_value() for v in self.variables], grads, values
            )
        for param, value in zip(params, new_values):
            param.set_value(jnp.asarray(value, param.get_value().dtype))
        for variable, value in zip(self.variables, new_state):
            variable.set_value(jnp.asarray(value, variable.get_value().dtype))

    def apply_gradients(self, grads_and_vars) -> None:
        """Applies one update, as `keras.optimizers.Optimizer.apply_gradients`.

        Args:
          grads_and_vars: (gradient, variable) pairs for every trainable variable, in
            `model.trainable_variables`' order (TF's `zip(grads, model.trainable_variables)`):
            a gradient is an array (or an `nnx.Variable` holding one) of the variable's shape.

        Raises:
          InvalidArgumentError: not one pair per trainable variable, or a shape that differs
            (the message names the position).
        """
        pairs = list(grads_and_vars)
        if len(pairs) != len(self.shapes):
            raise errors.InvalidArgumentError(
                f"apply_gradients: received {len(pairs)} (gradient, variable) pairs for the "
                f"model's {len(self.shapes)} trainable variables; pass zip(grads, "
                "model.trainable_variables) with one gradient per variable, in that order."
            )
        grads = [jnp.asarray(_value(g)) for g, _ in pairs]
        shapes = [self.shapes[k] for k in self.gradient_order]
        for i, (grad, (_, variable), (shape, _)) in enumerate(zip(grads, pairs, shapes)):
            if tuple(grad.shape) != shape or tuple(jnp.shape(_value(variable))) != shape:
                raise errors.InvalidArgumentError(
                    f"apply_gradients: pair {i} has a gradient of shape {tuple(grad.shape)} for "
                    f"a variable of shape {tuple(jnp.shape(_value(variable)))}, where trainable "
                    f"variable {i} has shape {shape}; pass the pairs in "
                    "model.trainable_variables' order."
                )
        keras_order = sorted(range(len(pairs)), key=lambda i: self.gradient_order[i])
        self._apply([grads[i] for i in keras_order], [pairs[i][1] for i in keras_order])

    def update(self, model, grads) -> None:
        """Applies one update from `nnx.grad`'s gradients of `model`, as `nnx.Optimizer.update`.

        Args:
          model: the `KerasModule` (the step's copy of `mirrax.Model(...).module`).
          grads: the gradient state `nnx.grad` / `mirrax.value_and_grad` return for it.
        """
        module = _keras_module(model, "KerasOptimizer.update")
        flat = {path: _value(leaf) for path, leaf in nnx.to_flat_state(grads)}
        missing = [i for i in self.trainable_index if module.state_path(i) not in flat]
        if missing or module.trainable_index != self.trainable_index:
            raise errors.InvalidArgumentError(
                f"KerasOptimizer.update: the gradients hold no entry for the trainable "
                f"variables {missing} (or the model's trainable variables changed since the "
                "optimizer was made); differentiate the module itself: "
                "grads = nnx.grad(loss_fn)(model)."
            )
        self._apply(
            [flat[module.state_path(i)] for i in self.trainable_index], module.keras_trainable_variables
        )
