"""`mirrax.Model`: Keras's compile / fit / evaluate / predict around an `nnx.Module`, distributed.

Every step is one `strategy.run` of a step function built at `compile`: the module, its
`nnx.Optimizer`, the metrics and a loss tracker enter as NNX objects, so gradients are summed
over the replicas by JAX, metric state (sums, counts) is SUM-aggregated over the replicas, and
the caller's objects hold the current values after every step (no separate sync is needed for
callbacks that read or write the model). Batches are global batches split by the strategy's
input pipeline (padded and masked when partial), so every example counts exactly once.
"""

from __future__ import annotations

import itertools
import math
import os
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from mirrax import errors
from mirrax._src.distribute import gradients
from mirrax._src.distribute import input as input_lib
from mirrax._src.distribute import values as values_lib
from mirrax._src.distribute.input import DistributedDataset, DistributedDatasetsFromFunction
from mirrax._src.distribute.losses import compute_average_loss
from mirrax._src.distribute.replica_context import REPLICA_AXIS
from mirrax._src.distribute.strategy import get_replica_context, get_strategy
from mirrax._src.distribute.values import PerReplica
from mirrax._src.training import callbacks as callbacks_lib
from mirrax._src.training import losses as losses_lib
from mirrax._src.training import metrics as metrics_lib
from mirrax._src.training import mixed_precision

# Keras's defaults for optimizers named by string.
_OPTIMIZERS = {
    "adam": lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-3, b1=0.9, b2=0.999, eps=1e-7),
    "sgd": lambda: optax.inject_hyperparams(optax.sgd)(learning_rate=1e-2),
    "rmsprop": lambda: optax.inject_hyperparams(optax.rmsprop)(learning_rate=1e-3, decay=0.9, eps=1e-7),
    "adamw": lambda: optax.inject_hyperparams(optax.adamw)(
        learning_rate=1e-3, b1=0.9, b2=0.999, eps=1e-7, weight_decay=0.004
    ),
}


class _LossTracker(nnx.Pytree):
    """[sum of the real examples' weighted losses, their count], SUM-aggregated over replicas.

    One variable, so the write-back adds both over the replicas in one all-reduce.
    """

    def __init__(self):
        self.sums = nnx.metrics.MetricState(jnp.zeros((2,), jnp.float32))

    def update(self, total, count):
        self.sums[...] += jnp.stack([total, count]).astype(jnp.float32)

    def reset(self):
        self.sums[...] = jnp.zeros((2,), jnp.float32)

    def result(self):
        total, count = self.sums[...]
        return total / jnp.maximum(count, 1.0)


class OptimizerHandle:
    """The compiled model's optimizer, as Keras's `model.optimizer`.

    Attributes:
      tx: the optax `GradientTransformation`.
      nnx_optimizer: the `nnx.Optimizer` holding the state (its `step` counts updates).
      learning_rate: the current learning rate (float); set it to change the rate of the next
        step without recompiling. Requires the rate to live in `optax.inject_hyperparams`
        state (string optimizers do).
      iterations: number of updates applied so far (int).
    """

    def __init__(self, tx, nnx_optimizer):
        self.tx = tx
        self.nnx_optimizer = nnx_optimizer

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
        variable = self._hyperparams()["learning_rate"]
        old = variable[...]
        variable[...] = jax.device_put(jnp.asarray(value, old.dtype), old.sharding)

    @property
    def iterations(self) -> int:
        return int(self.nnx_optimizer.step[...])


def _resolve_optimizer(optimizer):
    if isinstance(optimizer, str):
        factory = _OPTIMIZERS.get(optimizer.lower())
        if factory is None:
            raise ValueError(
                f"Unknown optimizer {optimizer!r}; known names: {', '.join(sorted(_OPTIMIZERS))}, "
                "or pass any optax.GradientTransformation."
            )
        return factory()
    if isinstance(optimizer, optax.GradientTransformation):
        return optimizer
    raise TypeError(
        "optimizer must be an optax.GradientTransformation or one of the names "
        f"{sorted(_OPTIMIZERS)}; received {type(optimizer).__name__}."
    )


class Model:
    """A Keras-style model around an `nnx.Module`, as `keras.Model` with a distribution strategy.

    `compile` picks the strategy in scope (or the default strategy); `fit`, `evaluate` and
    `predict` then run every step on all of its replicas. `batch_size` is always the GLOBAL
    batch size (split over replicas), as Keras under `tf.distribute`.

    Args:
      module: the `nnx.Module` to train; `model.module` returns it and `model(x)` calls it.

    Attributes:
      module, optimizer (an `OptimizerHandle` after compile), loss, metrics, stop_training,
      history (the `History` of the last fit), distribute_strategy.
    """

    def __init__(self, module: nnx.Module):
        if not isinstance(module, nnx.Module):
            raise TypeError(
                f"mirrax.Model wraps an nnx.Module; received {type(module).__name__}."
            )
        self.module = module
        self.optimizer: OptimizerHandle | None = None
        self.loss = None
        self.metrics: list = []
        self.stop_training = False
        self.history = None
        self.distribute_strategy = None
        self._compiled = False

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    # -- compile ---------------------------------------------------------------------------------

    def compile(self, optimizer="rmsprop", loss=None, metrics=None, loss_weights=None,
                steps_per_execution: int = 1, gradient_accumulation_steps: int = 1):
        """Configures training, as `keras.Model.compile`.

        Args:
          optimizer: an optax `GradientTransformation`, or "adam", "sgd", "rmsprop", "adamw"
            (Keras's default hyperparameters; the learning rate in `inject_hyperparams` state).
          loss: a `mirrax.losses.Loss`, a loss name ("sparse_categorical_crossentropy", "mse",
            ...), or a callable (y_true, y_pred) -> per-example loss (batch,).
          metrics: list of `mirrax.metrics.Metric`s or names ("accuracy" resolves by the loss,
            as Keras).
          loss_weights: accepted for single-output models only (a float scales the loss).

        The dtype policy is `mirrax.mixed_precision.global_policy()` at this call.
          steps_per_execution: run this many steps in one compiled call (callbacks' batch
            hooks then run once per call, with the first and last step's index).
          gradient_accumulation_steps: average the gradients of this many consecutive batches
            and apply them as one update (`optax.MultiSteps`); with SGD, k batches of b give
            the update of one batch of k*b.

        Raises:
          ValueError: unknown optimizer, loss or metric name; unsupported options.
          TypeError: an argument of the wrong type.
        """
        if loss is None:
            raise ValueError("compile: loss is required, e.g. loss='sparse_categorical_crossentropy'.")
        for name, value in (("steps_per_execution", steps_per_execution),
                            ("gradient_accumulation_steps", gradient_accumulation_steps)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"compile: {name} must be an int >= 1; received {value!r}.")
        self.distribute_strategy = get_strategy()
        tx = _resolve_optimizer(optimizer)
        self.steps_per_execution = steps_per_execution
        self.gradient_accumulation_steps = gradient_accumulation_steps
        if gradient_accumulation_steps > 1:
            # optax's accumulator: the mean of k micro-batch gradients, applied every k-th step.
            tx = optax.MultiSteps(tx, every_k_schedule=gradient_accumulation_steps)
        self.optimizer = OptimizerHandle(tx, nnx.Optimizer(self.module, tx, wrt=nnx.Param))
        self.loss = losses_lib.get(loss)
        self._loss_scale = 1.0 if loss_weights is None else float(loss_weights)
        self.metrics = [metrics_lib.get(m, loss=self.loss) for m in (metrics or [])]
        self._tracker = _LossTracker()
        self.dtype_policy = mixed_precision.global_policy()
        self._dynamic_scale = (
            mixed_precision.LossScale() if self.dtype_policy.uses_loss_scaling else None
        )
        self._train_fn = _make_train_step(self.loss, self._loss_scale, self.dtype_policy)
        self._train_many_fn = _make_multi_step(self._train_fn)
        self._test_fn = _make_test_step(self.loss, self._loss_scale, self.dtype_policy)
        self._predict_fn = _make_predict_step(self.dtype_policy)
        self._rng = np.random.default_rng(0)
        self._compiled = True

    def _check_compiled(self, what: str):
        if not self._compiled:
            raise RuntimeError(
                f"{what}: the model is not compiled. Call model.compile(optimizer=..., loss=...) "
                "first."
            )

    # -- weights ---------------------------------------------------------------------------------

    def get_weights(self) -> list:
        """The module's variables as NumPy arrays, in a fixed order (as `keras.Model.get_weights`)."""
        return [np.asarray(v.get_value()) for v in _variables(self.module)]

    def set_weights(self, weights) -> None:
        """Sets the module's variables from `get_weights()`-ordered arrays (shapes must match).

        Raises:
          ValueError: wrong number of arrays or a shape mismatch (the message names the variable).
        """
        variables = _variables(self.module)
        if len(weights) != len(variables):
            raise ValueError(
                f"set_weights: the model has {len(variables)} variables but {len(weights)} "
                "arrays were given; pass a list from model.get_weights()."
            )
        for variable, value in zip(variables, weights):
            old = variable.get_value()
            if tuple(np.shape(value)) != tuple(old.shape):
                raise ValueError(
                    f"set_weights: shape {np.shape(value)} does not match the variable's "
                    f"{old.shape}."
                )
            variable.set_value(jax.device_put(jnp.asarray(value, old.dtype), old.sharding))

    def save_weights(self, filepath, overwrite: bool = True) -> None:
        """Writes the module's variables to the directory `filepath` (a `mirrax.Checkpoint`).

        As `keras.Model.save_weights`, but the file is an Orbax checkpoint directory written by
        `mirrax.Checkpoint(weights=model.module)`: atomic (also when replacing an earlier
        save), each array once whatever the replica count, readable back into any replica
        count. PRNG state (`nnx.Rngs`, e.g. of `nnx.Dropout`) and batch statistics included.

        Raises:
          ExistingPathError (a FileExistsError): `filepath` exists and `overwrite` is False,
            or `filepath` is a regular file.
          InvalidArgumentTypeError: `filepath` is not a str or os.PathLike.
        """
        from mirrax._src import checkpoint  # checkpoint.py imports this module

        checkpoint.save_weights(self, filepath, overwrite)

    def load_weights(self, filepath) -> None:
        """Reads variables into the module (placed where they are now), as `keras.Model.load_weights`.

        Reads what `save_weights` wrote, or the module's variables of a full checkpoint
        (`mirrax.Checkpoint(model=model).save`, `ModelCheckpoint`'s default output), as Keras
        loads weights from a full save; the optimizer state of a full checkpoint is not read.

        Raises:
          MissingCheckpointError (a FileNotFoundError): no checkpoint at `filepath`.
          InvalidCheckpointError (a ValueError): the directory is not a complete checkpoint.
          IncompatibleCheckpointError (a ValueError): the checkpoint's variables do not match
            the module's (the message lists the paths and shapes that differ), or it holds no
            model's weights (the message names the call that restores it).
        """
        from mirrax._src import checkpoint  # checkpoint.py imports this module

        checkpoint.load_weights(self, filepath)

    # -- fit -------------------------------------------------------------------------------------

    def fit(self, x=None, y=None, batch_size=None, epochs: int = 1, verbose="auto",
            callbacks=None, validation_split: float = 0.0, validation_data=None,
            shuffle: bool = True, initial_epoch: int = 0, steps_per_epoch=None,
            validation_steps=None, validation_freq: int = 1, sample_weight=None):
        """Trains the model, as `keras.Model.fit`; returns the `History`.

        Args:
          x: NumPy arrays (with `y` and `batch_size`), an iterable of (x, y) or (x, y,
            sample_weight) batches of the GLOBAL batch size, or a distributed dataset.
          y: labels when `x` is arrays; must be None otherwise.
          batch_size: GLOBAL batch size for array inputs (default 32); an error with datasets.
          epochs: train until this epoch index (exclusive), starting at `initial_epoch`.
          verbose: "auto" (1), 0 (silent), 1 (progress bar), 2 (one line per epoch).
          callbacks: list of `mirrax.callbacks.Callback`.
          validation_split: fraction (0..1) of the array inputs, taken from the END before
            shuffling, held out for validation (as Keras); arrays only.
          validation_data: (x_val, y_val[, sample_weight]) arrays, or a dataset.
          shuffle: reshuffle array inputs every epoch (a NumPy RNG seeded at compile, so runs
            are reproducible and independent of the replica count).
          steps_per_epoch: batches per epoch (default: one pass over the data).
          validation_steps: batches per validation (default: one pass).
          validation_freq: validate every this many epochs.
          sample_weight: per-example weights (N,) for array inputs.

        Raises:
          RuntimeError: the model is not compiled.
          ValueError: inconsistent inputs (x/y lengths, batch_size with a dataset,
            validation_split with a non-array input, labels out of range).
        """
        self._check_compiled("fit")
        verbose = 1 if verbose == "auto" else int(verbose)
        strategy = self.distribute_strategy
        if validation_split and validation_data is None:
            if not _is_arrays(x):
                raise ValueError(
                    "fit: validation_split is only supported for NumPy array inputs (it takes "
                    f"the last {validation_split:.0%} of the arrays); received a "
                    f"{type(x).__name__}. Pass validation_data= instead."
                )
            x, y, sample_weight, validation_data = _split_validation(
                x, y, sample_weight, validation_split
            )
        train = _Input(self, strategy, x, y, sample_weight, batch_size, shuffle, "fit")
        val = None
        if validation_data is not None:
            vx, vy, vw = _unpack_validation(validation_data)
            val = _Input(self, strategy, vx, vy, vw, batch_size if _is_arrays(vx) else None,
                         False, "fit(validation_data=...)")
        steps = steps_per_epoch if steps_per_epoch is not None else train.steps
        cbs = callbacks_lib.CallbackList(
            callbacks, add_history=True, add_progbar=verbose != 0, model=self,
            verbose=verbose, epochs=epochs, steps=steps,
        )
        self.stop_training = False
        self.module.train()
        # Reading the logs waits for the step; do it per step only when a callback uses them.
        batch_logs = _needs_batch_logs(cbs, "on_train_batch_end")
        self._resume = None
        cbs.on_train_begin()
        # A callback that restored a backup (BackupAndRestore) says where training resumes:
        # (epoch index, batches of that epoch already done).
        first_epoch, first_step = self._resume or (initial_epoch, 0)
        self._resume = None
        logs: dict = {}
        for epoch in range(first_epoch, epochs):
            self._reset_metrics()
            cbs.on_epoch_begin(epoch)
            self.module.train()
            step = first_step if epoch == first_epoch else 0
            batches = itertools.islice(train.batches(steps, prefetch=batch_logs), step, None)
            for group in _groups(batches, self.steps_per_execution):
                last = step + len(group) - 1
                cbs.on_train_batch_begin(step)
                state = (self.module, self.optimizer.nnx_optimizer, self.metrics, self._tracker,
                         self._dynamic_scale)
                if len(group) == 1:
                    strategy.run(self._train_fn, args=state + (group[0],))
                else:
                    masks = tuple(PerReplica(strategy, _mask_of(b)) for b in group)
                    strategy.run(self._train_many_fn, args=state + (tuple(group), masks))
                logs = self._logs() if batch_logs else {}
                cbs.on_train_batch_end(last, logs)
                step = last + 1
                if self.stop_training:
                    break
            epoch_logs = self._logs() if step else {}
            if val is not None and (epoch + 1) % validation_freq == 0:
                val_logs = self._evaluate(val, validation_steps, cbs)
                epoch_logs.update({f"val_{k}": v for k, v in val_logs.items()})
                self.module.train()
            if _has_learning_rate(self.optimizer):
                epoch_logs["learning_rate"] = self.optimizer.learning_rate
            cbs.on_epoch_end(epoch, epoch_logs)
            if self.stop_training:
                break
        self.module.eval()
        cbs.on_train_end(epoch_logs if epochs > first_epoch else {})
        return self.history

    # -- evaluate / predict ----------------------------------------------------------------------

    def evaluate(self, x=None, y=None, batch_size=None, verbose="auto", sample_weight=None,
                 steps=None, callbacks=None, return_dict: bool = False):
        """Loss and metrics over the data, as `keras.Model.evaluate` (every example once).

        Returns:
          The loss (float) when there are no metrics, else [loss, metric...] in compile order;
          with `return_dict=True`, {"loss": ..., "<metric name>": ...}.

        Raises:
          RuntimeError: the model is not compiled. ValueError: inconsistent inputs.
        """
        self._check_compiled("evaluate")
        data = _Input(self, self.distribute_strategy, x, y, sample_weight, batch_size, False,
                      "evaluate")
        verbose = 1 if verbose == "auto" else int(verbose)
        cbs = callbacks_lib.CallbackList(
            callbacks, add_progbar=verbose != 0, model=self, verbose=verbose, epochs=1,
            steps=steps if steps is not None else data.steps,
        )
        logs = self._evaluate(data, steps, cbs)
        if return_dict:
            return logs
        values = list(logs.values())
        return values[0] if len(values) == 1 else values

    def _evaluate(self, data, steps, cbs):
        """Runs the test step over `data`, calling the on_test_* hooks of the `CallbackList`."""
        strategy = self.distribute_strategy
        self._reset_metrics()
        self.module.eval()
        cbs.on_test_begin()
        batch_logs = _needs_batch_logs(cbs, "on_test_batch_end")
        for step, batch in enumerate(data.batches(steps, prefetch=batch_logs)):
            cbs.on_test_batch_begin(step)
            strategy.run(self._test_fn, args=(self.module, self.metrics, self._tracker, batch))
            cbs.on_test_batch_end(step, self._logs() if batch_logs else {})
        logs = self._logs()
        cbs.on_test_end(logs)
        return logs

    def predict(self, x, batch_size=None, verbose="auto", steps=None, callbacks=None):
        """The module's outputs for every example, in input order, as NumPy (as `keras.Model.predict`).

        Args:
          x: NumPy array(s) (with `batch_size`, default 32, GLOBAL) or an iterable of batches
            (each an array, or a tuple whose first element is the input).

        Returns:
          A NumPy array (or pytree of arrays) with the examples along axis 0, each exactly once.
        """
        strategy = self.distribute_strategy or get_strategy()
        data = _Input(self, strategy, x, None, None, batch_size, False, "predict", inputs_only=True)
        self.module.eval()
        outputs = []
        verbose = 1 if verbose == "auto" else int(verbose)
        cbs = callbacks_lib.CallbackList(
            callbacks, add_progbar=verbose != 0, model=self, verbose=verbose, epochs=1,
            steps=steps if steps is not None else data.steps,
        )
        cbs.on_predict_begin()
        for step, batch in enumerate(data.batches(steps)):
            cbs.on_predict_batch_begin(step)
            predict_fn = self._predict_fn if self._compiled else _PREDICT_FLOAT32
            out = strategy.run(predict_fn, args=(self.module, batch))
            outputs.append(jax.tree.map(np.asarray, strategy.gather(out, axis=0)))
            cbs.on_predict_batch_end(step, {"outputs": outputs[-1]})
        cbs.on_predict_end()
        if not outputs:
            raise ValueError("predict: the input holds no examples.")
        return jax.tree.map(lambda *parts: np.concatenate(parts, axis=0), *outputs)

    # -- helpers ---------------------------------------------------------------------------------

    def _reset_metrics(self):
        self._tracker.reset()
        for metric in self.metrics:
            metric.reset_state()

    def _logs(self) -> dict:
        logs = {"loss": float(self._tracker.result())}
        for metric in self.metrics:
            logs[metric.name] = float(metric.result())
        return logs

    def summary(self, print_fn=None):
        """Prints the module's variables: path, type, shape and count (as `keras.Model.summary`)."""
        print_fn = print_fn or print
        rows, total = [], 0
        for path, variable in nnx.to_flat_state(nnx.state(self.module)):
            value = variable.get_value()
            size = int(np.prod(np.shape(value)))
            total += size
            rows.append((".".join(map(str, path)), type(variable).__name__, str(np.shape(value)), size))
        width = max([len(r[0]) for r in rows] + [8])
        print_fn(f'Model: "{type(self.module).__name__}"')
        print_fn(f"{'Variable':<{width}}  {'Type':<10} {'Shape':<16} {'Count':>10}")
        for name, kind, shape, size in rows:
            print_fn(f"{name:<{width}}  {kind:<10} {shape:<16} {size:>10,}")
        print_fn(f"Total: {total:,} values")


def _variables(module) -> list:
    return [v for _, v in nnx.to_flat_state(nnx.state(module))]


def _needs_batch_logs(cbs, hook: str) -> bool:
    """Whether any callback reads per-batch logs (the live progress bar, a batch hook)."""
    for callback in cbs.callbacks:
        if isinstance(callback, callbacks_lib.History):
            continue
        if isinstance(callback, callbacks_lib.ProgbarLogger):
            # Only the live bar on a terminal shows batch values; elsewhere the epoch's line.
            if callback.verbose == 1 and sys.stdout.isatty():
                return True
            continue
        for name in (hook, "on_batch_end"):
            if name in vars(callback) or getattr(type(callback), name) is not getattr(
                callbacks_lib.Callback, name
            ):
                return True
    return False


def _has_learning_rate(optimizer) -> bool:
    try:
        optimizer._hyperparams()
        return True
    except AttributeError:
        return False


# -- step functions (built once per compile; the strategy caches their programs) ---------------


def _masked_sum(per_example, sample_weight):
    mask = get_replica_context().batch_mask
    weighted = per_example if sample_weight is None else per_example * sample_weight
    valid = jnp.ones(per_example.shape[:1], bool) if mask is None else mask
    return jnp.where(valid, weighted, 0.0).sum(), valid.sum().astype(jnp.float32)


def _forward(module, x, policy):
    """The module's output in float32, computed in the policy's dtype (parameters cast)."""
    if policy.compute_dtype == "float32":
        return module(x)
    dtype = jnp.dtype(policy.compute_dtype)
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    view = nnx.merge(graphdef, mixed_precision.cast_floating(params, dtype), rest)
    y_pred = view(mixed_precision.cast_floating(x, dtype))
    return jax.tree.map(
        lambda a: a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a, y_pred
    )


def _unpack(batch):
    """(x, y, sample_weight) of a batch given as (x, y) or (x, y, sample_weight)."""
    if isinstance(batch, (tuple, list)) and len(batch) in (2, 3):
        return tuple(batch) + (None,) * (3 - len(batch))
    raise errors.InvalidBatchError(
        "fit/evaluate: each batch must be a tuple (x, y) or (x, y, sample_weight); received "
        f"a {type(batch).__name__}."
    )


# What an optimizer step changes (and a skipped float16 step restores).
_UPDATED = nnx.Any(nnx.Param, nnx.OptState)


def _make_train_step(loss_obj, loss_weight: float, policy):
    def train_step(module, optimizer, metrics, tracker, loss_scale, batch):
        x, y, sample_weight = _unpack(batch)
        scale = 1.0 if loss_scale is None else loss_scale.scale[...]

        def loss_fn(module):
            y_pred = _forward(module, x, policy)
            per_example = loss_obj.per_example(y, y_pred) * loss_weight
            share = compute_average_loss(per_example, sample_weight)
            return share * scale, (y_pred, per_example)

        # One packed all-reduce for every gradient (XLA:CPU's Gloo runs one per array).
        (_, (y_pred, per_example)), grads = gradients.packed_value_and_grad(
            loss_fn, module, has_aux=True)
        if loss_scale is None:
            optimizer.update(module, grads)
        else:
            # Gradients are already summed over replicas: an overflow on any replica is
            # non-finite here on every replica, so all skip the same step.
            grads = jax.tree.map(lambda g: g / scale, grads)
            finite = jnp.all(jnp.array([jnp.isfinite(g).all() for g in jax.tree.leaves(grads)]))
            before = jax.tree.map(lambda a: a, nnx.state((module, optimizer), _UPDATED))
            optimizer.update(module, grads)
            after = nnx.state((module, optimizer), _UPDATED)
            nnx.update((module, optimizer), jax.tree.map(
                lambda new, old: jnp.where(finite, new, old), after, before))
            loss_scale.adjust(finite)
        tracker.update(*_masked_sum(per_example, sample_weight))
        for metric in metrics:
            metric.update_state(y, y_pred, sample_weight)

    return train_step


def _make_test_step(loss_obj, loss_weight: float, policy):
    def test_step(module, metrics, tracker, batch):
        x, y, sample_weight = _unpack(batch)
        y_pred = _forward(module, x, policy)
        per_example = loss_obj.per_example(y, y_pred) * loss_weight
        tracker.update(*_masked_sum(per_example, sample_weight))
        for metric in metrics:
            metric.update_state(y, y_pred, sample_weight)

    return test_step


def _make_predict_step(policy):
    def predict_step(module, batch):
        return _forward(module, batch[0], policy)

    return predict_step


_PREDICT_FLOAT32 = _make_predict_step(mixed_precision.Policy("float32"))


def _make_multi_step(train_step):
    """k training steps in one program: each micro-step sees its own batch mask."""

    def train_steps(module, optimizer, metrics, tracker, loss_scale, batches, masks):
        ctx = get_replica_context()
        saved = ctx.batch_mask
        try:
            for batch, mask in zip(batches, masks):
                ctx.batch_mask = mask
                train_step(module, optimizer, metrics, tracker, loss_scale, batch)
        finally:
            ctx.batch_mask = saved

    return train_steps


def _groups(batches, size: int):
    """Consecutive groups of `size` batches (the last may be shorter)."""
    group = []
    for batch in batches:
        group.append(batch)
        if len(group) == size:
            yield group
            group = []
    if group:
        yield group


def _mask_of(batch):
    """The (num_replicas, rows) mask array shared by a distributed batch's leaves."""
    return next(leaf for leaf in jax.tree.leaves(batch, is_leaf=lambda x: isinstance(x, PerReplica))
                if isinstance(leaf, PerReplica))._mask


# -- input handling ---------------------------------------------------------------------------


def _is_arrays(x) -> bool:
    """True for in-memory examples: an array, or a dict of arrays (a multi-input model's x).

    Tuples and lists are datasets (sequences of batches), as everywhere in mirrax.
    """
    if isinstance(x, (np.ndarray, jax.Array)):
        return True
    return isinstance(x, dict) and bool(x) and all(
        isinstance(leaf, (np.ndarray, jax.Array)) for leaf in jax.tree.leaves(x)
    )


def _num_examples(x) -> int:
    return len(jax.tree.leaves(x)[0])


def _split_validation(x, y, sample_weight, fraction):
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"fit: validation_split must be in (0, 1); received {fraction!r}.")
    n = _num_examples(x)
    cut = int(n * (1.0 - fraction))
    take = lambda tree, s: None if tree is None else jax.tree.map(lambda a: a[s], tree)  # noqa: E731
    head, tail = slice(0, cut), slice(cut, n)
    return take(x, head), take(y, head), take(sample_weight, head), (
        take(x, tail), take(y, tail), take(sample_weight, tail))


def _unpack_validation(data):
    if isinstance(data, tuple) and len(data) in (2, 3) and _is_arrays(data[0]) and _is_arrays(data[1]):
        return data[0], data[1], data[2] if len(data) == 3 else None
    return data, None, None


class _Input:
    """One input of fit/evaluate/predict, as a source of distributed (x, y, sample_weight) batches."""

    def __init__(self, model, strategy, x, y, sample_weight, batch_size, shuffle, what,
                 inputs_only=False):
        self.strategy = strategy
        self.shuffle = shuffle
        self.model = model
        self.inputs_only = inputs_only
        self.arrays = _is_arrays(x)
        if isinstance(x, (DistributedDataset, DistributedDatasetsFromFunction)):
            if y is not None or batch_size is not None:
                raise ValueError(
                    f"{what}: x is a distributed dataset, which carries its own labels and "
                    "batch size; do not pass y or batch_size."
                )
            self.dataset, self.steps = x, None
            return
        if not self.arrays:
            if x is None:
                raise ValueError(f"{what}: x is required.")
            if batch_size is not None:
                raise ValueError(
                    f"{what}: batch_size={batch_size} was given with a {type(x).__name__}, "
                    "which is already batched. Remove batch_size (it applies to NumPy arrays "
                    "only)."
                )
            if y is not None:
                raise ValueError(
                    f"{what}: y must be None when x is a dataset of (x, y) batches; "
                    f"received y of type {type(y).__name__}."
                )
            self.source = x
            self.steps = len(x) if hasattr(x, "__len__") else None
            self.dataset = None
            # A generator is consumed across epochs, as Keras does with steps_per_epoch.
            self.one_shot = iter(x) is x if hasattr(x, "__iter__") else False
            self._stream = None
            self._what = what
            return
        n = _num_examples(x)
        for name, other in (("y", y), ("sample_weight", sample_weight)):
            if other is not None and _num_examples(other) != n:
                raise ValueError(
                    f"{what}: x has {n} examples but {name} has {_num_examples(other)}; they "
                    "must have the same length along axis 0."
                )
        if y is None and not inputs_only:
            raise ValueError(f"{what}: y is required with array inputs (the labels).")
        if n == 0:
            raise ValueError(
                f"{what}: x has 0 examples (shape {jax.tree.leaves(x)[0].shape}); there is "
                "nothing to train on or evaluate. Check how the arrays were loaded or split."
            )
        self.batch_size = 32 if batch_size is None else int(batch_size)
        if self.batch_size < 1:
            raise ValueError(f"{what}: batch_size must be >= 1; received {batch_size!r}.")
        self.x, self.y = x, y
        self.sample_weight = None if sample_weight is None else np.asarray(sample_weight, np.float32)
        self.n = n
        self.steps = math.ceil(n / self.batch_size)
        self.dataset = None
        if y is not None and isinstance(model.loss, losses_lib.SparseCategoricalCrossentropy):
            _check_sparse_labels(model, x, y)

    def batches(self, steps=None, prefetch=True):
        """Distributed batches for one epoch (or `steps` of them).

        `prefetch`: for array inputs in one process, make batches in a background thread (when
        the loop waits for every step, e.g. to read batch logs) or else in the caller's thread
        (steps are dispatched asynchronously, so the next batch is cut while the devices run).
        """
        if self.dataset is not None:
            iterator = iter(self.dataset)
        elif getattr(self, "one_shot", False):
            yield from self._stream_batches(steps)
            return
        elif self.arrays:
            order = self.model._rng.permutation(self.n) if self.shuffle else np.arange(self.n)
            if jax.process_count() == 1:
                iterator = input_lib.DistributedIterator(
                    _placed_array_batches(self.strategy, _ArrayBatches(self, order)),
                    input_lib.InputOptions(experimental_fetch_to_device=prefetch))
            else:
                iterator = iter(self.strategy.experimental_distribute_dataset(
                    _ArrayBatches(self, order)))
        else:
            iterator = iter(self.strategy.experimental_distribute_dataset(
                _NormalizedBatches(self.source, self.inputs_only)))
        count = 0
        try:
            for batch in iterator:
                if steps is not None and count >= steps:
                    break
                yield batch
                count += 1
        finally:
            close = getattr(iterator, "close", None)
            if close is not None:
                close()


    def _stream_batches(self, steps):
        """Up to `steps` batches from the one iterator over a generator, kept across epochs."""
        first_pass = self._stream is None
        if first_pass:
            self._stream = iter(self.strategy.experimental_distribute_dataset(
                _NormalizedBatches(self.source, self.inputs_only)))
        count = 0
        for batch in self._stream:
            yield batch
            count += 1
            if steps is not None and count >= steps:
                return
        if count == 0 and not first_pass:
            raise RuntimeError(
                f"{self._what}: the generator given as x is exhausted: it yielded no batch for "
                "this epoch. A generator is read once across all epochs; make it endless and "
                "pass steps_per_epoch (as Keras), or pass a re-iterable dataset (a list of "
                "batches, a Grain dataset)."
            )


class _ArrayBatches:
    """Global batches cut from arrays in a given order: (x, y, sample_weight) or (x,)."""

    def __init__(self, data: _Input, order):
        self.data, self.order = data, order

    def __iter__(self):
        d = self.data
        for start in range(0, d.n, d.batch_size):
            index = self.order[start : start + d.batch_size]
            x = jax.tree.map(lambda a: np.asarray(a)[index], d.x)
            if d.inputs_only:
                yield (x,)
                continue
            y = jax.tree.map(lambda a: np.asarray(a)[index], d.y)
            yield (x, y) if d.sample_weight is None else (x, y, d.sample_weight[index])


def _placed_array_batches(strategy, batches):
    """fit's array input in one process: distributed batches made in the caller's thread.

    The same batches `experimental_distribute_dataset(batches)` yields (TF's split rule, the
    first batch's per-replica size, padding and mask), made more cheaply: a global batch that
    splits evenly over the replicas is reshaped to (replicas, rows, ...) and placed with one
    `device_put` per leaf; others (the first and the partial last batch) go through the general
    placer. On CPU `device_put` may alias a NumPy array instead of copying it: that is safe
    here because every batch of `_ArrayBatches` is a fresh fancy-indexed copy nobody else holds.
    """
    placer = input_lib._Placer(strategy)
    replicas = strategy.num_replicas_in_sync
    checked = False
    for batch in batches:
        if not checked:
            batch, n = input_lib.to_host_batch(batch)  # dtypes and sizes, once per pass
            checked = True
        else:
            n = len(jax.tree.leaves(batch)[0])
        rows = n // replicas
        if n % replicas == 0 and rows == placer.rows:
            lengths = (rows,) * replicas
            stacked = jax.tree.map(lambda a: a.reshape((replicas, rows) + a.shape[1:]), batch)
            mask = placer._mask(lengths)
            yield jax.tree.map(lambda a: PerReplica(strategy, a, mask, lengths),
                               values_lib.put_stacked(strategy, stacked))
        else:
            shards = input_lib.split_global_batch(batch, n, replicas, strategy._local_replica_ids)
            yield placer.place(shards, f"global batch of {n} over {replicas} replicas")


class _NormalizedBatches:
    """Batches of a user dataset as (x, y, sample_weight) (or (x,) for predict)."""

    def __init__(self, source, inputs_only):
        self.source, self.inputs_only = source, inputs_only

    def __iter__(self):
        items = self.source.as_numpy_iterator() if hasattr(self.source, "as_numpy_iterator") else self.source
        for batch in items:
            if self.inputs_only:
                yield (batch[0],) if isinstance(batch, tuple) else (batch,)
                continue
            if not isinstance(batch, tuple) or len(batch) not in (2, 3):
                raise errors.InvalidBatchError(
                    "fit/evaluate: each batch of a dataset must be a tuple (x, y) or (x, y, "
                    f"sample_weight); received a {type(batch).__name__}."
                )
            yield batch if len(batch) == 2 else (batch[0], batch[1], np.asarray(batch[2], np.float32))


def _check_sparse_labels(model, x, y):
    """Debug check (NumPy inputs): sparse labels must lie in [0, number of classes)."""
    sample = jax.tree.map(lambda a: np.asarray(a)[:1], x)
    graphdef, state = nnx.split(model.module)
    shape = jax.eval_shape(lambda s, v: nnx.merge(graphdef, s)(v), state, sample).shape
    losses_lib.SparseCategoricalCrossentropy.check_labels(np.asarray(y), shape[-1])
