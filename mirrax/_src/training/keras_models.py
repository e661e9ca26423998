"""Keras 3 models (JAX backend) as NNX modules, so `mirrax.Model` trains them like any module.

`KerasModule` holds a Keras model's variables as NNX variables and runs the model through
Keras's stateless API (`keras_model.stateless_call`), the way Keras's own JAX trainer does:
trainable variables are `nnx.Param`s (what the optimizer updates; gradients summed over the
replicas), float non-trainable variables (BatchNormalization's moving statistics) are
`nnx.BatchStat`s (averaged over the replicas), and each `keras.random.SeedGenerator` state
becomes a PRNG key plus a draw count, so every replica draws its own dropout mask and every
step a new one. Keras's own losses (`add_loss`, kernel/activity regularizers) come back from
`call_with_losses`, which the training step adds once to the global loss; a custom loop reads
them as Keras's list, `module.losses`, beside `module.trainable_variables`. The variables are
keyed by their Keras paths (`keras_names`), so the optimizer's state and checkpoints are too.

Keras is imported only when a Keras model is given; it is the optional extra `mirrax[keras]`.
"""

from __future__ import annotations

import inspect
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mirrax import errors
from mirrax._src.training import keras_checks, keras_names

_SEED_STATE_NAME = "seed_generator_state"

# The activity and `add_loss` losses of each KerasModule object's last call (Keras's
# `layer.losses` keeps them until the next call). Held beside the module, not in it, so NNX
# never sees them: inside a step the module is a fresh copy, so traced losses stay there.
_LAST_CALL_LOSSES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

# Each KerasModule object's Keras variables' values as of its last exchange with them (the
# arrays themselves: Keras's `assign` and `set_weights` replace a variable's array, so an array
# that is no longer the variable's means the user wrote to the Keras model after wrapping).
_KERAS_VALUES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _put(tree: dict, keys: tuple, value) -> None:
    for key in keys[:-1]:
        tree = tree.setdefault(key, {})
    tree[keys[-1]] = value


def _get(tree: dict, keys: tuple):
    for key in keys:
        tree = tree[key]
    return tree


class KerasSeedKey(nnx.RngKey):
    """The PRNG key of a Keras `SeedGenerator` (its state at wrapping, uint32 of shape (2,)).

    An `nnx.RngKey`, so the replica id (or, in replica-invariant mode, the micro-batch index)
    is folded into it during each step, as into an `nnx.Rngs` key.
    """


class KerasSeedCount(nnx.RngCount):
    """How far a Keras `SeedGenerator` has advanced since wrapping (uint32 scalar)."""


def _copy(variable):
    return jnp.array(variable.value, copy=True)


def _non_trainable_variable(value):
    if jnp.issubdtype(value.dtype, jnp.floating):
        return nnx.BatchStat(value)
    # Integer counters and the like must stay equal on every replica (aggregation NONE).
    return nnx.Variable(value)


class KerasModule(nnx.Module):
    """A Keras 3 model as an `nnx.Module`: `module(x)` is `keras_model(x)` on the NNX variables.

    Args:
      keras_model: a built Keras 3 model or layer (Sequential, functional or subclassed) on
        the JAX backend.

    Attributes:
      keras_model: the Keras model (its own variables are written by `write_to_keras`).
      variables: one NNX variable per Keras variable, in nested dicts keyed by the segments
        of its Keras path (`variables["sequential"]["dense"]["kernel"]`, made unique by
        `keras_names.state_keys`): trainable ones as `nnx.Param`, float non-trainable ones as
        `nnx.BatchStat`, other non-trainable ones as `nnx.Variable`, seed states as
        `KerasSeedKey` (with their draw counts in `seed_counts`, keyed the same way).
        `variable_list` lists them in `keras_model.variables` order, `weights()` in
        `keras_model.get_weights()` order.
      paths: the Keras variables' paths (e.g. "sequential/dense/kernel"), in
        `keras_model.variables` order; `names` the same made unique ("/".join of the keys).
      deterministic: False under `module.train()` (Keras's `training=True`: dropout on, batch
        statistics from the batch), True under `module.eval()` (the default, as Keras's
        `training=None` outside fit).

    Raises:
      UnsupportedArgumentError: Keras runs on another backend than JAX.
      InvalidArgumentError: the model is not built.
    """

    def __init__(self, keras_model):
        keras_checks.check_keras(keras_model)
        keras_checks.warn_if_own_steps(keras_model)
        self.keras_model = nnx.static(keras_model)
        everything = list(keras_model.variables)
        position = {id(v): i for i, v in enumerate(everything)}
        self.paths = nnx.static(tuple(v.path for v in everything))
        keys = keras_names.state_keys(self.paths)
        self.keys = nnx.static(keys)
        self.names = nnx.static(tuple("/".join(key) for key in keys))
        self.weight_index = nnx.static(tuple(position[id(v)] for v in keras_model.weights))
        self.trainable_index = nnx.static(tuple(position[id(v)] for v in keras_model.trainable_variables))
        self.non_trainable_index = nnx.static(
            tuple(position[id(v)] for v in keras_model.non_trainable_variables)
        )
        trainable = set(self.trainable_index)
        seeds = tuple(v.name == _SEED_STATE_NAME and i not in trainable for i, v in enumerate(everything))
        self.is_seed = nnx.static(seeds)
        # Copies: Keras's own fit / predict donate the buffers of its variables.
        variables: dict = {}
        counts: dict = {}
        for i, v in enumerate(everything):
            _put(
                variables,
                keys[i],
                nnx.Param(_copy(v))
                if i in trainable
                else KerasSeedKey(_copy(v))
                if seeds[i]
                else _non_trainable_variable(_copy(v)),
            )
            # The count advances by what Keras adds per draw, the same on every replica; JAX
            # still types it as varying (it is read off the replica's folded key), hence
            # replica 0's.
            if seeds[i]:
                _put(
                    counts,
                    keys[i],
                    KerasSeedCount(jnp.zeros((), jnp.uint32), aggregation="only_first_replica"),
                )
        self.variables = nnx.data(variables)
        self.seed_counts = nnx.data(counts)
        # As Keras's trainer: `training` goes only to a call that takes it.
        self.takes_training = nnx.static("training" in inspect.signature(keras_model.call).parameters)
        self.deterministic = True
        _KERAS_VALUES[self] = tuple(v.value for v in everything)

    @property
    def variable_list(self) -> list:
        """The NNX variables in `keras_model.variables` order (seed states included)."""
        return [_get(self.variables, key) for key in self.keys]

    def _counts(self) -> list:
        """The seed states' draw counts, in `keras_model.variables` order."""
        return [_get(self.seed_counts, key) for key, seed in zip(self.keys, self.is_seed) if seed]

    def weights(self) -> list:
        """(name, NNX variable) of each of `keras_model.weights`, in its order (that of
        `keras_model.get_weights()`: seed states left out); the name is the Keras path
        ("dense/kernel"), made unique as the state's keys are (`keras_names.state_keys`)."""
        return [(self.names[i], _get(self.variables, self.keys[i])) for i in self.weight_index]

    def state_path(self, index: int) -> tuple:
        """The NNX state path of the Keras variable at `index` in `keras_model.variables`:
        ("variables", *its path's segments), e.g. ("variables", "dense", "kernel")."""
        return ("variables",) + self.keys[index]

    def checkpoint_aliases(self, stored_paths):
        """How a checkpoint not keyed by this module's paths holds each variable (keyed by
        position, or by the same model's earlier Keras names): a function from a state path to
        the stored one, or None (`keras_names.checkpoint_aliases`; `stored_paths`: the paths of
        the stored module state)."""
        return keras_names.checkpoint_aliases(self.keys, self.is_seed, stored_paths)

    def _split_now(self) -> tuple[tuple, tuple]:
        """(positions of the trainable variables, of the others), in Keras's orders, now."""
        position = {id(v): i for i, v in enumerate(self.keras_model.variables)}
        return (
            tuple(position[id(v)] for v in self.keras_model.trainable_variables),
            tuple(position[id(v)] for v in self.keras_model.non_trainable_variables),
        )

    def check_trainable_unchanged(self, what: str) -> None:
        """Refuses to train after a layer's `trainable` changed since compile (the optimizer
        updates the variables that were trainable then).

        Raises:
          InvalidArgumentError: the trainable variables differ from compile's.
        """
        if self._split_now()[0] != self.trainable_index:
            raise errors.InvalidArgumentError(
                f"{what}: a layer of the Keras model {self.keras_model.name!r} changed its "
                f"`trainable` after compile ({len(self.trainable_index)} trainable variables "
                f"then, {len(self.keras_model.trainable_variables)} now). As in Keras, call "
                "model.compile(...) again after changing `trainable`, then fit."
            )

    def refresh_trainable(self) -> None:
        """Re-reads which Keras variables are trainable (a layer's `trainable` set after
        wrapping, as Keras's fine-tuning recipe does before compiling again): `compile` calls
        it, so its optimizer updates exactly the trainable ones."""
        trainable, non_trainable = self._split_now()
        if trainable == self.trainable_index:
            return
        self.trainable_index = nnx.static(trainable)
        self.non_trainable_index = nnx.static(non_trainable)
        for i, variable in enumerate(self.variable_list):
            if self.is_seed[i]:
                continue
            value = variable.get_value()
            if i in trainable and not isinstance(variable, nnx.Param):
                _put(self.variables, self.keys[i], nnx.Param(value))
            elif i not in trainable and isinstance(variable, nnx.Param):
                _put(self.variables, self.keys[i], _non_trainable_variable(value))

    def _values(self) -> list:
        """Every variable's value as Keras sees it (a seed state advanced by its count)."""
        values, counts = [], iter(self._counts())
        for variable, seed in zip(self.variable_list, self.is_seed):
            value = variable.get_value()
            if seed:
                # Keras advances a seed state by adding to its second word.
                value = value + jnp.stack([jnp.zeros((), jnp.uint32), next(counts).get_value()])
            values.append(value)
        return values

    def call_with_losses(self, *args, **kwargs):
        """`(outputs, losses)`: the Keras model's outputs on `args` and the sum of its own
        losses (`keras_model.losses`: regularizers, `add_loss`; a float32 scalar, 0.0 when it
        has none), with Keras's `training` flag set by `train()` / `eval()`.

        The non-trainable variables (moving statistics, seed states) are updated in place.
        """
        if len(self.keras_model.variables) != len(self.keys):
            raise errors.InvalidArgumentError(
                f"mirrax.Model: the Keras model {self.keras_model.name!r} had "
                f"{len(self.keys)} variables when it was wrapped and has "
                f"{len(self.keras_model.variables)} now: a layer made its variables later, at "
                "its first call. Call the model once on a batch (keras_model(x[:1])) before "
                "mirrax.Model(keras_model)."
            )
        # Keras's split as it is now (a layer's `trainable` may have changed since compile;
        # `check_trainable_unchanged` makes fit refuse that, evaluate and predict need not).
        trainable, non_trainable = self._split_now()
        values = self._values()
        given = [values[i] for i in non_trainable]
        # Keras's layers broadcast by rank (a bias added to a batch), which a program run
        # under jax_numpy_rank_promotion="raise" would refuse inside Keras's code.
        if self.takes_training:
            kwargs = {"training": not self.deterministic, **kwargs}
        with jax.numpy_rank_promotion("allow"):
            outputs, new_values, losses = self.keras_model.stateless_call(
                [values[i] for i in trainable], given, *args, return_losses=True, **kwargs
            )
        seed_positions = [i for i, seed in enumerate(self.is_seed) if seed]
        counts = dict(zip(seed_positions, self._counts()))
        for i, old, new in zip(non_trainable, given, new_values):
            if i in counts:
                counts[i].set_value(counts[i].get_value() + (jnp.asarray(new)[1] - old[1]))
            else:
                variable = _get(self.variables, self.keys[i])
                variable.set_value(jnp.asarray(new, variable.get_value().dtype))
        # Keras lists the weight regularizers' losses last (`Layer.losses`).
        _LAST_CALL_LOSSES[self] = list(losses[: len(losses) - len(self._regularized())])
        total = sum((jnp.asarray(loss, jnp.float32) for loss in losses), jnp.float32(0.0))
        return outputs, total

    def _regularized(self) -> list:
        """(position, regularizer) of each trainable Keras variable that has a regularizer."""
        keras_variables = self.keras_model.variables
        return [
            (i, keras_variables[i].regularizer)
            for i in self.trainable_index
            if getattr(keras_variables[i], "regularizer", None) is not None
        ]

    @property
    def losses(self) -> list:
        """The model's own losses, as `keras.Model.losses`: a list of scalars, the activity and
        `add_loss` losses of this module's last call (none before a call), then each weight
        regularizer's loss on the current weights (e.g. L2(l2): l2 * sum(w ** 2)).

        Inside a step (a function `strategy.run` runs) the module is that step's copy: after
        `predictions = model(x, training=True)` in a loss function, `model.losses` are that
        call's, differentiable, as in TF's custom-training tutorial.
        """
        values = self._values()
        own = list(_LAST_CALL_LOSSES.get(self, ()))
        with jax.numpy_rank_promotion("allow"):
            return own + [regularizer(values[i]) for i, regularizer in self._regularized()]

    @property
    def trainable_variables(self) -> list:
        """The `nnx.Param`s of the Keras model's trainable variables (as of the last compile or
        wrapping), in the order of the leaves of `nnx.state(module, nnx.Param)`: the state is
        keyed by Keras path, so sorted by path, not in `keras_model.trainable_variables`'
        order. It is the order of the gradients `nnx.grad` / `mirrax.value_and_grad` return,
        so `zip(jax.tree.leaves(grads), model.trainable_variables)` pairs each gradient with
        its variable, for `mirrax.KerasOptimizer.apply_gradients`."""
        keras_order = self.keras_trainable_variables
        return [keras_order[k] for k in self.gradient_order()]

    @property
    def keras_trainable_variables(self) -> list:
        """The trainable `nnx.Param`s in `keras_model.trainable_variables`' order."""
        return [_get(self.variables, self.keys[i]) for i in self.trainable_index]

    def gradient_order(self) -> list:
        """For each leaf of the trainable state, in leaf order, its position in
        `keras_model.trainable_variables` (what `trainable_variables` lists)."""
        leaf = {tuple(path): n for n, (path, _) in enumerate(nnx.to_flat_state(nnx.state(self, nnx.Param)))}
        return sorted(
            range(len(self.trainable_index)), key=lambda k: leaf[self.state_path(self.trainable_index[k])]
        )

    def __call__(self, *args, **kwargs):
        """The Keras model's outputs on `args` (its own losses dropped; see `call_with_losses`)."""
        return self.call_with_losses(*args, **kwargs)[0]

    def write_to_keras(self) -> None:
        """Assigns the current values to the Keras model's own variables (so `keras_model`
        used directly, e.g. `keras_model.predict` or `keras_model.save`, sees the trained
        weights). Seed states get their advanced values."""
        for keras_variable, value in zip(self.keras_model.variables, self._values()):
            keras_variable.assign(np.asarray(value))
        _KERAS_VALUES[self] = tuple(v.value for v in self.keras_model.variables)

    def read_keras_writes(self) -> None:
        """Takes the values written to the Keras model's own variables since wrapping (or since
        the last `write_to_keras`): `keras_model.layers[0].kernel.assign(...)`,
        `keras_model.set_weights(...)`, `keras_model.load_weights(...)`. `mirrax.Model` calls it
        before each use (fit, evaluate, predict, get_weights, saves), so such writes are not
        lost, as they are not in Keras (whose model IS its variables). Each changed value is
        placed where the NNX variable's lives; a seed state restarts its draw count."""
        seen = _KERAS_VALUES.get(self)
        now = tuple(v.value for v in self.keras_model.variables)
        if seen is None or len(now) != len(seen):
            return  # a copy inside a step, or a model that grew (call_with_losses refuses it)
        counts = iter(self._counts())
        for variable, seed, old, new in zip(self.variable_list, self.is_seed, seen, now):
            count = next(counts) if seed else None
            if new is old:
                continue
            current = variable.get_value()
            variable.set_value(jax.device_put(jnp.asarray(new, current.dtype), current.sharding))
            if count is not None:
                count.set_value(jnp.zeros((), jnp.uint32))
        _KERAS_VALUES[self] = now
