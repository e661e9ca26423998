"""`mirrax.Model`: Keras's compile / fit / evaluate / predict around an `nnx.Module`, distributed.

Every step is one `strategy.run` of a step function built at `compile`: the module, its
`nnx.Optimizer`, the metrics and a loss tracker enter as NNX objects, so gradients are summed
over the replicas by JAX, metric state (sums, counts) is SUM-aggregated over the replicas, and
the caller's objects hold the current values after every step (no separate sync is needed for
callbacks that read or write the model). Batches are global batches split by the strategy's
input pipeline (padded and masked when partial), so every example counts exactly once.

Arguments and inputs are checked before the first step (the "argument checks" block below):
counts, flags, lengths and shapes, and one abstract run (`jax.eval_shape`) of the module and
the loss on the first example, so a bad call is a named mirrax error, not a failure inside the
compiled step.
"""

from __future__ import annotations

import collections
import inspect
import itertools
import math
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from mirrax import errors
from mirrax._src.distribute import batching, gradients
from mirrax._src.distribute import input as input_lib
from mirrax._src.distribute import input_options
from mirrax._src.distribute import invariant
from mirrax._src.distribute import values as values_lib
from mirrax._src.distribute.input import DistributedDataset, DistributedDatasetsFromFunction
from mirrax._src.distribute.losses import compute_average_loss
from mirrax._src.distribute.strategy import get_replica_context, get_strategy, has_strategy
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
    def iterations(self) -> int:
        return int(self.nnx_optimizer.step[...])


def _resolve_optimizer(optimizer):
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
        "optimizer object is not accepted: pass e.g. 'adam' or optax.adam(1e-3)."
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
            raise errors.InvalidArgumentTypeError(
                f"mirrax.Model wraps an nnx.Module; received {type(module).__name__}. Pass the "
                "module itself, e.g. mirrax.Model(MyNet(rngs=nnx.Rngs(0)))."
            )
        self.module = module
        self.optimizer: OptimizerHandle | None = None
        self.loss = None
        self.metrics: list = []
        self.stop_training = False
        self.history = None
        self.distribute_strategy = None
        # As Keras, a model made under a strategy's scope belongs to it (compile uses it).
        self._scope_strategy = get_strategy() if has_strategy() else None
        self._compiled = False
        # Input signatures already run abstractly through the module and loss (see
        # _check_fits_model); compile clears it (the loss or policy may change).
        self._checked_inputs: dict = {}

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    # -- compile ---------------------------------------------------------------------------------

    def compile(self, optimizer="rmsprop", loss=None, loss_weights=None, metrics=None,
                weighted_metrics=None, run_eagerly: bool = False, steps_per_execution: int = 1,
                jit_compile="auto", auto_scale_loss: bool = True,
                gradient_accumulation_steps: int = 1):
        """Configures training, as `keras.Model.compile` (same arguments, same order).

        Args:
          optimizer: an optax `GradientTransformation`, or "adam", "sgd", "rmsprop", "adamw"
            (Keras's default hyperparameters; the learning rate in `inject_hyperparams` state).
          loss: a `mirrax.losses.Loss`, a loss name ("sparse_categorical_crossentropy", "mse",
            ...), or a callable (y_true, y_pred) -> per-example loss (batch,). Required.
          loss_weights: a float that scales the loss (single-output models; a list or dict of
            per-output weights is refused).
          metrics: list of `mirrax.metrics.Metric`s or names ("accuracy" resolves by the loss,
            as Keras); updated WITHOUT sample weights (as Keras).
          weighted_metrics: list of metrics updated with the sample weights (and class
            weights), as Keras; logged under the metric's name, or "weighted_<name>" when
            `metrics` already holds that name.
          run_eagerly: only False (every step is one compiled program; to debug, run under
            `jax.disable_jit()`).
          steps_per_execution: run this many steps in one compiled call (callbacks' batch
            hooks then run once per call, with the first and last step's index).
          jit_compile: "auto" or True (steps are always compiled by XLA); False is refused.
          auto_scale_loss: with the "mixed_float16" policy, apply dynamic loss scaling (as
            Keras); False trains float16 without it. No effect under other policies.
          gradient_accumulation_steps: average the gradients of this many consecutive batches
            and apply them as one update (`optax.MultiSteps`); with SGD, k batches of b give
            the update of one batch of k*b.

        The dtype policy is `mirrax.mixed_precision.global_policy()` at this call. The strategy
        is the one in scope, or else the one in scope when this `Model` was made, or else the
        default strategy; later calls of fit/evaluate/predict use it wherever they are made.

        Raises:
          InvalidIdentifierError: unknown optimizer, loss or metric name.
          InvalidArgumentTypeError / InvalidArgumentError: an argument of the wrong type or
            out of range.
          UnsupportedArgumentError: run_eagerly=True, jit_compile=False, per-output loss
            weights.
          MixedStrategyError: compiled under another strategy's scope than the one the model
            was made in.
        """
        _check_compile_args(loss, loss_weights, metrics, weighted_metrics, run_eagerly,
                            jit_compile, auto_scale_loss)
        steps_per_execution = _check_count("compile", "steps_per_execution", steps_per_execution)
        gradient_accumulation_steps = _check_count(
            "compile", "gradient_accumulation_steps", gradient_accumulation_steps)
        self.distribute_strategy = self._compile_strategy()
        if self.distribute_strategy.replica_invariant:
            invariant.check_no_sync_batch_norm((self.module,), "compile")
        tx = _resolve_optimizer(optimizer)
        self.steps_per_execution = steps_per_execution
        self.gradient_accumulation_steps = gradient_accumulation_steps
        if gradient_accumulation_steps > 1:
            # optax's accumulator: the mean of k micro-batch gradients, applied every k-th step.
            tx = optax.MultiSteps(tx, every_k_schedule=gradient_accumulation_steps)
        self.optimizer = OptimizerHandle(tx, nnx.Optimizer(self.module, tx, wrt=nnx.Param))
        self.loss = losses_lib.get(loss)
        self._loss_scale = 1.0 if loss_weights is None else float(loss_weights)
        plain = [metrics_lib.get(m, loss=self.loss) for m in (metrics or [])]
        weighted = [metrics_lib.get(m, loss=self.loss) for m in (weighted_metrics or [])]
        self.metrics = plain + weighted
        self._weighted = (False,) * len(plain) + (True,) * len(weighted)
        self._metric_names = _metric_names(plain, weighted)
        self._tracker = _LossTracker()
        self.dtype_policy = mixed_precision.global_policy()
        self._dynamic_scale = (
            mixed_precision.LossScale()
            if self.dtype_policy.uses_loss_scaling and auto_scale_loss else None
        )
        micro = self.distribute_strategy.replica_invariant
        self._train_fn = _make_train_step(self.loss, self._loss_scale, self.dtype_policy,
                                          self._weighted, micro)
        self._train_many_fn = _make_multi_step(self._train_fn)
        self._test_fn = _make_test_step(self.loss, self._loss_scale, self.dtype_policy,
                                        self._weighted, micro)
        self._predict_fn = _make_predict_step(self.dtype_policy, micro)
        self._rng = np.random.default_rng(0)
        self._checked_inputs = {}
        self._compiled = True

    def _compile_strategy(self):
        """The strategy of compile: in scope now, else in scope at __init__, else the default."""
        if has_strategy():
            current = get_strategy()
            if self._scope_strategy is not None and current is not self._scope_strategy:
                raise errors.MixedStrategyError(
                    f"compile: this Model was made under the scope of {self._scope_strategy!r} "
                    f"but is compiled under the scope of {current!r}; a model belongs to one "
                    "strategy (as in Keras). Compile it under the strategy it was made in, or "
                    "build a new module and Model under the new strategy's scope."
                )
            return current
        return self._scope_strategy or get_strategy()

    def _check_compiled(self, what: str):
        if not self._compiled:
            raise errors.NotCompiledError(
                f"{what}: the model is not compiled. Call model.compile(optimizer=..., loss=...) "
                "first."
            )
        self._check_scope(what)

    def _check_scope(self, what: str):
        """Refuses a call under another strategy's scope than the model's (as TF's "Mixing
        different tf.distribute.Strategy objects"); outside every scope the model's is used."""
        mine = self.distribute_strategy
        if mine is not None and has_strategy() and get_strategy() is not mine:
            raise errors.MixedStrategyError(
                f"{what}: this Model belongs to {mine!r} but is called under the scope of "
                f"{get_strategy()!r}; a model runs on the strategy it was compiled with. Call "
                "it outside that scope (or under its own), or build a new module and Model "
                "under the new strategy's scope."
            )

    # -- weights ---------------------------------------------------------------------------------

    def get_weights(self) -> list:
        """The module's weights as NumPy arrays, in a fixed order (as `keras.Model.get_weights`).

        Weights are every variable but PRNG state (`nnx.Rngs` keys and counts, e.g. of
        `nnx.Dropout`): parameters and batch statistics, as Keras's `weights` leave out its
        seed generators' state. Checkpoints (`save_weights`, `mirrax.Checkpoint`) keep all.
        """
        return [np.asarray(v.get_value()) for _, v in _weights(self.module)]

    def count_params(self) -> int:
        """The number of values in the module's weights (`get_weights()`), as
        `keras.Model.count_params` (trainable and non-trainable; PRNG state left out)."""
        return int(sum(np.prod(np.shape(v.get_value())) for _, v in _weights(self.module)))

    def save(self, filepath, *args, **kwargs):
        """Refused: mirrax has no `.keras` archive (the model's code is an NNX module).

        Raises:
          UnsupportedArgumentError: always; the message names what to use instead.
        """
        raise errors.UnsupportedArgumentError(
            f"Model.save({filepath!r}): mirrax writes no .keras archive. Use "
            "model.save_weights(path) for the weights, mirrax.Checkpoint(model=model).save(path) "
            "for weights and optimizer state, or mirrax.export(model, path, input_signature) for "
            "a program that serves without the model's code."
        )

    def set_weights(self, weights) -> None:
        """Sets the module's variables from `get_weights()`-ordered arrays (shapes must match).

        Raises:
          ValueError: wrong number of arrays or a shape mismatch (the message names the variable).
        """
        named = _weights(self.module)
        variables = [v for _, v in named]
        if isinstance(weights, (str, bytes, dict)) or not hasattr(weights, "__len__"):
            raise errors.InvalidArgumentTypeError(
                f"set_weights: weights must be a list of arrays (as model.get_weights() "
                f"returns); received {type(weights).__name__} {weights!r:.60}."
            )
        if len(weights) != len(variables):
            raise errors.InvalidArgumentError(
                f"set_weights: the model has {len(variables)} variables but {len(weights)} "
                "arrays were given; pass a list from model.get_weights()."
            )
        paths = [".".join(map(str, path)) for path, _ in named]
        for index, (variable, value) in enumerate(zip(variables, weights)):
            old = variable.get_value()
            if tuple(np.shape(value)) != tuple(old.shape):
                raise errors.InvalidArgumentError(
                    f"set_weights: weights[{index}] has shape {np.shape(value)}, but the "
                    f"variable {paths[index]} has shape {old.shape}; pass the arrays in "
                    "model.get_weights()'s order and shapes."
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
            shuffle: bool = True, class_weight=None, sample_weight=None,
            initial_epoch: int = 0, steps_per_epoch=None, validation_steps=None,
            validation_batch_size=None, validation_freq: int = 1):
        """Trains the model, as `keras.Model.fit` (same arguments, same order); returns the `History`.

        Args:
          x: NumPy arrays (with `y` and `batch_size`), an iterable of (x, y) or (x, y,
            sample_weight) batches (tuples or lists, e.g. a torch DataLoader) of the GLOBAL
            batch size, or a distributed dataset. A generator must be called: pass `gen()`.
          y: labels when `x` is arrays; must be None otherwise.
          batch_size: GLOBAL batch size for array inputs (default 32); an error with datasets.
          epochs: train until this epoch index (exclusive), starting at `initial_epoch`.
          verbose: "auto" (1), 0 (silent), 1 (progress bar), 2 (one line per epoch).
          callbacks: list of `mirrax.callbacks.Callback`.
          validation_split: fraction in [0, 1) of the array inputs, taken from the END before
            shuffling, held out for validation (as Keras); arrays only.
          validation_data: (x_val, y_val[, sample_weight]) arrays, or a dataset.
          shuffle: reshuffle array inputs every epoch (a NumPy RNG seeded at compile, so runs
            are reproducible and independent of the replica count).
          class_weight: {class index: weight}; each training example's loss (and the weighted
            metrics) is weighted by the weight of its label (integer labels, or the argmax of
            one-hot labels), 1.0 for classes not listed, as Keras. Not with `sample_weight`.
          sample_weight: per-example weights of shape (N,) for array inputs.
          initial_epoch: the epoch index to start at (to resume a run); below `epochs`.
          steps_per_epoch: batches per epoch (default: one pass over the data). As Keras, the
            next epoch continues the pass where this one stopped; a pass that ends before
            `steps_per_epoch` ends the epoch with Keras's "Your input ran out of data" warning.
            Larger than the number of batches of a sized input: refused.
          validation_steps: batches per validation (default: one pass).
          validation_batch_size: GLOBAL batch size of array validation data (default
            `batch_size`).
          validation_freq: validate every this many epochs (an int >= 1).

        Raises:
          NotCompiledError: the model is not compiled.
          InvalidArgumentTypeError / InvalidArgumentError: an argument of the wrong type or out
            of range, or inconsistent inputs (x/y lengths, batch_size with a dataset,
            validation_split with a non-array input, labels out of range).
          IncompatibleInputError: the inputs' shapes do not fit the model or the loss.
          EmptyDatasetError: the training (or validation) input yields no batch.
          UnsupportedArgumentError: class_weight with a distributed dataset.
        """
        self._check_compiled("fit")
        epochs, initial_epoch, verbose, shuffle = _check_fit_counts(
            epochs, initial_epoch, verbose, shuffle)
        steps_per_epoch = _check_count("fit", "steps_per_epoch", steps_per_epoch, allow_none=True)
        validation_steps = _check_count("fit", "validation_steps", validation_steps,
                                        allow_none=True)
        validation_freq = _check_count("fit", "validation_freq", validation_freq)
        validation_split = _check_fraction("fit", "validation_split", validation_split)
        class_weight = _check_class_weight(class_weight, sample_weight)
        x, y, sample_weight = (_as_arrays(v) for v in (x, y, sample_weight))
        strategy = self.distribute_strategy
        if validation_split and validation_data is None:
            if not _is_arrays(x):
                raise errors.InvalidArgumentError(
                    "fit: validation_split is only supported for NumPy array inputs (it takes "
                    f"the last {validation_split:.0%} of the arrays); received a "
                    f"{type(x).__name__}. Pass validation_data= instead."
                )
            x, y, sample_weight, validation_data = _split_validation(
                x, y, sample_weight, validation_split
            )
        train = _Input(self, strategy, x, y, sample_weight, batch_size, shuffle, "fit",
                       class_weight=class_weight)
        if steps_per_epoch is not None and train.steps is not None and steps_per_epoch > train.steps:
            raise errors.InvalidArgumentError(
                f"fit: steps_per_epoch={steps_per_epoch} but the input holds {train.steps} "
                f"batch(es) per pass, so every epoch would run out of data (Keras warns \"Your "
                "input ran out of data\" and trains short epochs). Pass steps_per_epoch <= "
                f"{train.steps}, or omit it for one pass per epoch."
            )
        val = None
        if validation_data is not None:
            vx, vy, vw = (_as_arrays(v) for v in _unpack_validation(validation_data))
            vbatch = validation_batch_size if validation_batch_size is not None else batch_size
            val = _Input(self, strategy, vx, vy, vw, vbatch if _is_arrays(vx) else None,
                         False, "fit(validation_data=...)")
        elif validation_batch_size is not None:
            raise errors.InvalidArgumentError(
                f"fit: validation_batch_size={validation_batch_size!r} was given without "
                "validation data; pass validation_data= or validation_split=, or drop it."
            )
        _check_generators_last(train, steps_per_epoch, val, validation_steps,
                               range(initial_epoch, epochs), validation_freq)
        steps = steps_per_epoch if steps_per_epoch is not None else train.steps
        cbs = callbacks_lib.CallbackList(
            callbacks, add_history=True, add_progbar=verbose != 0, model=self,
            verbose=verbose, epochs=epochs, steps=steps,
        )
        cbs.set_params(dict(cbs.params, metrics=self._log_keys(val is not None, cbs.callbacks)))
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
        known = steps_per_epoch if steps_per_epoch is not None else train.steps
        if first_step and known is not None and first_step >= known:
            # The backup was taken at batch `first_step` of an epoch that now has fewer
            # batches (another batch_size, less data): restart that epoch, as Keras does
            # with every mid-epoch resume, rather than run an epoch of no steps.
            warnings.warn(
                f"fit: the backup resumes epoch {first_epoch + 1} at batch {first_step + 1}, but "
                f"this input has {known} batch(es) per epoch; epoch {first_epoch + 1} restarts at "
                "its first batch.", stacklevel=2)
            first_step = 0
        logs: dict = {}
        epoch_logs: dict = {}
        try:
            for epoch in range(first_epoch, epochs):
                self._reset_metrics()
                cbs.on_epoch_begin(epoch)
                self.module.train()
                step = first_step if epoch == first_epoch else 0
                trained = 0
                batches = itertools.islice(
                    train.epoch_batches(steps_per_epoch, prefetch=batch_logs), step, None)
                for group in _groups(batches, self.steps_per_execution):
                    last = step + len(group) - 1
                    cbs.on_train_batch_begin(step)
                    state = (self.module, self.optimizer.nnx_optimizer, self.metrics,
                             self._tracker, self._dynamic_scale)
                    if len(group) == 1:
                        strategy.run(self._train_fn, args=state + (group[0],))
                    else:
                        masks = tuple(PerReplica(strategy, _mask_of(b)) for b in group)
                        strategy.run(self._train_many_fn, args=state + (tuple(group), masks))
                    logs = self._logs() if batch_logs else {}
                    cbs.on_train_batch_end(last, logs)
                    step = last + 1
                    trained += len(group)
                    if self.stop_training:
                        break
                if epoch == first_epoch and step == 0 and not self.stop_training:
                    raise errors.EmptyDatasetError(
                        f"fit: the training input ({type(x).__name__}) yielded no batch in the "
                        "first epoch, so nothing was trained. Check that the dataset is not "
                        "empty (a generator must yield at least one batch, as Keras requires)."
                    )
                # An epoch that ran no step has no values to log (not a loss of 0.0).
                epoch_logs = self._logs() if trained else {}
                if val is not None and (epoch + 1) % validation_freq == 0:
                    val_logs = self._evaluate(val, validation_steps, cbs, "fit(validation_data=...)")
                    epoch_logs.update({f"val_{k}": v for k, v in val_logs.items()})
                    self.module.train()
                if _has_learning_rate(self.optimizer):
                    epoch_logs["learning_rate"] = self.optimizer.learning_rate
                cbs.on_epoch_end(epoch, epoch_logs)
                if self.stop_training:
                    break
        finally:
            train.close()
        self.module.eval()
        cbs.on_train_end(epoch_logs if epochs > first_epoch else {})
        return self.history

    def _log_keys(self, validation: bool, callbacks: list):
        """The keys fit's epoch logs will hold (callbacks get them as params["metrics"]), or
        None when a callback of the user's own (or a LambdaCallback, whose functions are the
        user's) may add keys (as Keras's callbacks may write into the logs): the monitoring callbacks then look for their key at each epoch end."""
        if any(isinstance(c, callbacks_lib.LambdaCallback)
               or not type(c).__module__.startswith("mirrax.") for c in callbacks):
            return None
        keys = ["loss"] + list(self._metric_names)
        if validation:
            keys += [f"val_{key}" for key in keys]
        if _has_learning_rate(self.optimizer):
            keys.append("learning_rate")
        return keys

    # -- evaluate / predict ----------------------------------------------------------------------

    def evaluate(self, x=None, y=None, batch_size=None, verbose="auto", sample_weight=None,
                 steps=None, callbacks=None, return_dict: bool = False):
        """Loss and metrics over the data, as `keras.Model.evaluate` (every example once).

        Args: as `fit`'s (x, y, batch_size, verbose, sample_weight, callbacks); `steps`: the
          number of batches to evaluate (default: one pass).

        Returns:
          The loss (float) when there are no metrics, else [loss, metric...] in compile order;
          with `return_dict=True`, {"loss": ..., "<metric name>": ...}.

        Raises:
          NotCompiledError: the model is not compiled. InvalidArgumentError /
          InvalidArgumentTypeError: inconsistent or mistyped inputs. IncompatibleInputError:
          shapes that do not fit the model. EmptyDatasetError: the input yields no batch.
        """
        self._check_compiled("evaluate")
        verbose = _check_verbose("evaluate", verbose)
        steps = _check_count("evaluate", "steps", steps, allow_none=True)
        return_dict = _check_bool("evaluate", "return_dict", return_dict)
        data = _Input(self, self.distribute_strategy, x, y, sample_weight, batch_size, False,
                      "evaluate")
        cbs = callbacks_lib.CallbackList(
            callbacks, add_progbar=verbose != 0, model=self, verbose=verbose, epochs=1,
            steps=steps if steps is not None else data.steps,
        )
        try:
            logs = self._evaluate(data, steps, cbs, "evaluate")
        finally:
            data.close()
        if return_dict:
            return logs
        values = list(logs.values())
        return values[0] if len(values) == 1 else values

    def _evaluate(self, data, steps, cbs, what):
        """Runs the test step over `data`, calling the on_test_* hooks of the `CallbackList`."""
        strategy = self.distribute_strategy
        self._reset_metrics()
        self.module.eval()
        cbs.on_test_begin()
        batch_logs = _needs_batch_logs(cbs, "on_test_batch_end")
        count = 0
        for step, batch in enumerate(data.batches(steps, prefetch=batch_logs)):
            cbs.on_test_batch_begin(step)
            strategy.run(self._test_fn, args=(self.module, self.metrics, self._tracker, batch))
            cbs.on_test_batch_end(step, self._logs() if batch_logs else {})
            count += 1
        if count == 0:
            raise errors.EmptyDatasetError(
                f"{what}: the input yielded no batch, so there is nothing to evaluate (Keras "
                "refuses an empty input too). Check that the dataset is not empty."
            )
        _warn_if_ran_out(what, "steps", steps, count)
        logs = self._logs()
        cbs.on_test_end(logs)
        return logs

    def predict(self, x, batch_size=None, verbose="auto", steps=None, callbacks=None):
        """The module's outputs for every example, in input order, as NumPy (as `keras.Model.predict`).

        Args:
          x: NumPy array(s) (with `batch_size`, default 32, GLOBAL) or an iterable of batches
            (each an array, or a tuple / list whose first element is the input).
          steps: the number of batches to predict (default: all).

        Returns:
          A NumPy array (or pytree of arrays) with the examples along axis 0, each exactly once.

        Raises:
          InvalidArgumentError / InvalidArgumentTypeError: bad arguments.
          IncompatibleInputError: x does not fit the model. EmptyDatasetError: no batch.
        """
        verbose = _check_verbose("predict", verbose)
        steps = _check_count("predict", "steps", steps, allow_none=True)
        self._check_scope("predict")
        strategy = self.distribute_strategy or self._scope_strategy or get_strategy()
        data = _Input(self, strategy, x, None, None, batch_size, False, "predict", inputs_only=True)
        self.module.eval()
        outputs = []
        cbs = callbacks_lib.CallbackList(
            callbacks, add_progbar=verbose != 0, model=self, verbose=verbose, epochs=1,
            steps=steps if steps is not None else data.steps,
        )
        cbs.on_predict_begin()
        # Outputs are copied to the host at the end, so steps queue without a device round
        # trip each, unless a callback reads each batch's outputs or several processes hold
        # them (strategy.gather then replicates them first).
        per_batch = (jax.process_count() > 1
                     or _needs_batch_logs(cbs, "on_predict_batch_end"))
        pending: collections.deque = collections.deque()
        try:
            for step, batch in enumerate(data.batches(steps)):
                cbs.on_predict_batch_begin(step)
                predict_fn = self._predict_fn if self._compiled else (
                    _PREDICT_FLOAT32_MICRO if strategy.replica_invariant else _PREDICT_FLOAT32)
                out = strategy.run(predict_fn, args=(self.module, batch))
                if per_batch:
                    outputs.append(jax.tree.map(np.asarray, strategy.gather(out, axis=0)))
                    cbs.on_predict_batch_end(step, {"outputs": outputs[-1]})
                else:
                    pending.append(out)
                    if len(pending) > _PREDICT_AHEAD:  # bounds the device memory held
                        outputs.append(values_lib.gather_to_host(strategy, pending.popleft()))
                    cbs.on_predict_batch_end(step, {})
        finally:
            data.close()
        outputs += [values_lib.gather_to_host(strategy, out) for out in pending]
        if not outputs:
            raise errors.EmptyDatasetError(
                "predict: the input yielded no batch, so there is nothing to predict (Keras "
                "refuses an empty input too). Check that the dataset is not empty."
            )
        _warn_if_ran_out("predict", "steps", steps, len(outputs))
        cbs.on_predict_end()
        return jax.tree.map(lambda *parts: np.concatenate(parts, axis=0), *outputs)

    # -- one batch (Keras's *_on_batch) ---------------------------------------------------------

    def train_on_batch(self, x, y=None, sample_weight=None, class_weight=None,
                       return_dict: bool = False):
        """One training step on one GLOBAL batch of arrays, as `keras.Model.train_on_batch`.

        The metrics are reset first (as Keras 3), so the result is this batch's loss and
        metrics. Returns the loss (float) without metrics, else [loss, metric...]; with
        `return_dict`, the logs dict.

        Raises:
          NotCompiledError; InvalidArgumentTypeError (x not arrays); the checks of `fit`.
        """
        self._check_compiled("train_on_batch")
        class_weight = _check_class_weight(class_weight, sample_weight)
        data = self._one_batch("train_on_batch", x, y, sample_weight, class_weight)
        return_dict = _check_bool("train_on_batch", "return_dict", return_dict)
        self._reset_metrics()
        self.module.train()
        state = (self.module, self.optimizer.nnx_optimizer, self.metrics, self._tracker,
                 self._dynamic_scale)
        for batch in data.batches():
            self.distribute_strategy.run(self._train_fn, args=state + (batch,))
        self.module.eval()
        return self._result(self._logs(), return_dict)

    def test_on_batch(self, x, y=None, sample_weight=None, return_dict: bool = False):
        """Loss and metrics of one GLOBAL batch of arrays, as `keras.Model.test_on_batch`
        (metrics reset first, as Keras 3); returns as `train_on_batch`."""
        self._check_compiled("test_on_batch")
        data = self._one_batch("test_on_batch", x, y, sample_weight, None)
        return_dict = _check_bool("test_on_batch", "return_dict", return_dict)
        self._reset_metrics()
        self.module.eval()
        for batch in data.batches():
            self.distribute_strategy.run(self._test_fn,
                                         args=(self.module, self.metrics, self._tracker, batch))
        return self._result(self._logs(), return_dict)

    def predict_on_batch(self, x):
        """The module's outputs for one batch of arrays, as NumPy (`keras.Model.predict_on_batch`)."""
        x = _as_arrays(x)
        if not _is_arrays(x):
            raise errors.InvalidArgumentTypeError(
                f"predict_on_batch: x must be an array (or a dict of arrays); received "
                f"{type(x).__name__}. Use predict() for datasets."
            )
        return self.predict(x, batch_size=max(_num_examples(x), 1), verbose=0)

    def _one_batch(self, what, x, y, sample_weight, class_weight):
        x, y, sample_weight = (_as_arrays(v) for v in (x, y, sample_weight))
        if not _is_arrays(x):
            raise errors.InvalidArgumentTypeError(
                f"{what}: x must be an array (or a dict of arrays) holding one batch; received "
                f"{type(x).__name__}. Use fit() / evaluate() for datasets."
            )
        return _Input(self, self.distribute_strategy, x, y, sample_weight,
                      max(_num_examples(x), 1), False, what, class_weight=class_weight)

    @staticmethod
    def _result(logs: dict, return_dict: bool):
        if return_dict:
            return logs
        values = list(logs.values())
        return values[0] if len(values) == 1 else values

    def reset_metrics(self) -> None:
        """Resets the loss tracker and every metric, as `keras.Model.reset_metrics`."""
        self._check_compiled("reset_metrics")
        self._reset_metrics()

    # -- helpers ---------------------------------------------------------------------------------

    def _reset_metrics(self):
        self._tracker.reset()
        for metric in self.metrics:
            metric.reset_state()

    def _logs(self) -> dict:
        logs = {"loss": float(self._tracker.result())}
        for name, metric in zip(self._metric_names, self.metrics):
            logs[name] = float(metric.result())
        return logs

    def summary(self, line_length=None, positions=None, print_fn=None, expand_nested=False,
                show_trainable=False, layer_range=None):
        """Prints the module's variables: path, type, shape and count (as `keras.Model.summary`).

        Args (Keras 3's):
          line_length: the width of the table in characters (the variable column is widened to
            fill it); default: as wide as the longest path.
          positions: not supported (the columns are fixed).
          print_fn: called with each line (default `print`).
          expand_nested: accepted; every variable of every nested module is always listed.
          show_trainable: add a "Trainable" column (`nnx.Param`s are trainable).
          layer_range: not supported; filter `nnx.state(model.module)` yourself.

        Raises:
          InvalidArgumentTypeError: print_fn not callable, a flag not a bool, line_length not
            an int. UnsupportedArgumentError: positions or layer_range given.
        """
        if print_fn is not None and not callable(print_fn):
            raise errors.InvalidArgumentTypeError(
                f"summary: print_fn must be a function of one str (e.g. print); received "
                f"{type(print_fn).__name__} {print_fn!r}."
            )
        for name, value in (("positions", positions), ("layer_range", layer_range)):
            if value is not None:
                raise errors.UnsupportedArgumentError(
                    f"summary: {name}={value!r} is not supported (the table lists variables, "
                    "not layers, in fixed columns); leave it None."
                )
        _check_bool("summary", "expand_nested", expand_nested)
        show_trainable = _check_bool("summary", "show_trainable", show_trainable)
        line_length = _check_count("summary", "line_length", line_length, minimum=40,
                                   allow_none=True)
        print_fn = print_fn or print
        rows, total = [], 0
        for path, variable in nnx.to_flat_state(nnx.state(self.module)):
            value = variable.get_value()
            size = int(np.prod(np.shape(value)))
            total += size
            rows.append((".".join(map(str, path)), type(variable).__name__, str(np.shape(value)), size,
                         "yes" if isinstance(variable, nnx.Param) else "no"))
        # The fixed columns take 40 characters (11 + 17 + 10 + separators), 10 more with
        # show_trainable.
        fixed = 40 + (10 if show_trainable else 0)
        width = max([len(r[0]) for r in rows] + [8, (line_length or 0) - fixed])
        extra = f" {'Trainable':>9}" if show_trainable else ""
        print_fn(f'Model: "{type(self.module).__name__}"')
        print_fn(f"{'Variable':<{width}}  {'Type':<10} {'Shape':<16} {'Count':>10}{extra}")
        for name, kind, shape, size, trainable in rows:
            extra = f" {trainable:>9}" if show_trainable else ""
            print_fn(f"{name:<{width}}  {kind:<10} {shape:<16} {size:>10,}{extra}")
        print_fn(f"Total: {total:,} values")


def _warn_if_ran_out(what: str, name: str, steps, count: int) -> None:
    """Keras's warning when an input holds fewer batches than `steps` asked for."""
    if steps is not None and count < steps:
        warnings.warn(
            f"Your input ran out of data; interrupting {what} after {count} batch(es) of "
            f"{name}={steps}. Make sure that your dataset or generator can generate at least "
            f"{steps} batches.",
            stacklevel=3,
        )


def _python_numbers(x) -> bool:
    """Whether x looks like examples given as nested Python lists of numbers (X.tolist())."""
    if not isinstance(x, list) or not x:
        return False
    first = x[0]
    if isinstance(first, list) and first:
        first = first[0]
    return isinstance(first, (int, float, list)) and not isinstance(first, bool)


def _check_generators_last(train, steps_per_epoch, val, validation_steps, epochs,
                           validation_freq) -> None:
    """Refuses, before any step, a generator that a later epoch would find exhausted.

    A generator is read once across all epochs (as Keras): without `steps_per_epoch` the first
    epoch reads it to the end, and the next has nothing left. Keras then trains (or validates)
    on nothing; mirrax refuses when it is known at the start of `fit`.

    Raises:
      EmptyDatasetError: a one-shot x with more than one epoch and no `steps_per_epoch`, or
        one-shot validation data validated more than once without `validation_steps`.
    """
    validations = sum(1 for epoch in epochs if (epoch + 1) % validation_freq == 0)
    for data, steps, passes, what, name in (
            (train, steps_per_epoch, len(epochs), "x", "steps_per_epoch"),
            (val, validation_steps, validations, "validation_data", "validation_steps")):
        if data is not None and data.one_shot and steps is None and passes > 1:
            raise errors.EmptyDatasetError(
                f"fit: {what} is a generator (read once across all epochs), and it would be read "
                f"{passes} times without {name}: the second pass would find it exhausted. Pass "
                f"an endless generator with {name}=<batches per pass>, or a re-iterable "
                "dataset (a list of batches, a Grain dataset, a DataLoader)."
            )


def _weights(module) -> list:
    """(path, variable) of every variable but PRNG state, in `nnx.state`'s order."""
    return list(nnx.to_flat_state(nnx.state(module, nnx.Not(nnx.RngState))))


# predict copies a batch's outputs to the host this many steps after dispatching it.
_PREDICT_AHEAD = 32


def _needs_batch_logs(cbs, hook: str) -> bool:
    """Whether any callback reads per-batch logs (the live progress bar, a batch hook)."""
    for callback in cbs.callbacks:
        if isinstance(callback, callbacks_lib.History):
            continue
        if isinstance(callback, callbacks_lib.ProgbarLogger):
            # Only the live bar on a terminal shows batch values (predict's shows none);
            # elsewhere the epoch's line.
            if (callback.verbose == 1 and sys.stdout.isatty()
                    and hook != "on_predict_batch_end"):
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


def _update_metrics(metrics, weighted, y, y_pred, sample_weight):
    # As Keras: `metrics` ignore the sample weights, `weighted_metrics` use them.
    for metric, uses_weights in zip(metrics, weighted):
        metric.update_state(y, y_pred, sample_weight if uses_weights else None)


def _make_train_step(loss_obj, loss_weight: float, policy, weighted, micro_batches=False):
    """The training step; with `micro_batches` (replica-invariant mode) the loss, metrics and
    loss tracker run once per micro-batch and are summed in the fixed tree."""
    def train_step(module, optimizer, metrics, tracker, loss_scale, batch):
        x, y, sample_weight = _unpack(batch)
        scale = 1.0 if loss_scale is None else loss_scale.scale[...]

        if micro_batches:
            score = _make_scorer(loss_obj, loss_weight, policy, weighted)

            def micro_loss(nodes, x, y, sample_weight):
                per_example = score(nodes, x, y, sample_weight)
                return compute_average_loss(per_example, sample_weight) * scale

            _, _, grads = invariant.micro_batch_call(
                micro_loss, (module, metrics, tracker), (x, y, sample_weight),
                differentiate=True, what="fit")
            _apply_gradients(module, optimizer, grads[0], loss_scale, scale)
            return

        def loss_fn(module):
            y_pred = _forward(module, x, policy)
            per_example = loss_obj.per_example(y, y_pred) * loss_weight
            share = compute_average_loss(per_example, sample_weight)
            return share * scale, (y_pred, per_example)

        # One packed all-reduce for every gradient (XLA:CPU's Gloo runs one per array).
        (_, (y_pred, per_example)), grads = gradients.packed_value_and_grad(
            loss_fn, module, has_aux=True)
        _apply_gradients(module, optimizer, grads, loss_scale, scale)
        tracker.update(*_masked_sum(per_example, sample_weight))
        _update_metrics(metrics, weighted, y, y_pred, sample_weight)

    return train_step


def _apply_gradients(module, optimizer, grads, loss_scale, scale):
    """The optimizer update of gradients summed over replicas (and float16 loss scaling)."""
    if loss_scale is None:
        optimizer.update(module, grads)
        return
    # Gradients are already summed over replicas: an overflow on any replica is non-finite
    # here on every replica, so all skip the same step.
    grads = jax.tree.map(lambda g: g / scale, grads)
    finite = jnp.all(jnp.array([jnp.isfinite(g).all() for g in jax.tree.leaves(grads)]))
    before = jax.tree.map(lambda a: a, nnx.state((module, optimizer), _UPDATED))
    optimizer.update(module, grads)
    after = nnx.state((module, optimizer), _UPDATED)
    nnx.update((module, optimizer), jax.tree.map(
        lambda new, old: jnp.where(finite, new, old), after, before))
    loss_scale.adjust(finite)


def _make_scorer(loss_obj, loss_weight: float, policy, weighted):
    """`score((module, metrics, tracker), x, y, sample_weight)`: the forward pass, the
    per-example losses (returned), and the loss tracker and metrics updated with them."""
    def score(nodes, x, y, sample_weight):
        module, metrics, tracker = nodes
        y_pred = _forward(module, x, policy)
        per_example = loss_obj.per_example(y, y_pred) * loss_weight
        tracker.update(*_masked_sum(per_example, sample_weight))
        _update_metrics(metrics, weighted, y, y_pred, sample_weight)
        return per_example

    return score


def _make_test_step(loss_obj, loss_weight: float, policy, weighted, micro_batches=False):
    score = _make_scorer(loss_obj, loss_weight, policy, weighted)

    def update(nodes, x, y, sample_weight):
        score(nodes, x, y, sample_weight)
        return jnp.zeros((), jnp.float32)

    def test_step(module, metrics, tracker, batch):
        x, y, sample_weight = _unpack(batch)
        if micro_batches:
            invariant.micro_batch_call(update, (module, metrics, tracker), (x, y, sample_weight),
                                       differentiate=False, what="evaluate")
        else:
            update((module, metrics, tracker), x, y, sample_weight)

    return test_step


def _make_predict_step(policy, micro_batches=False):
    def predict_step(module, batch):
        if micro_batches:
            _, y_pred, _ = invariant.micro_batch_call(
                lambda nodes, x: (jnp.zeros((), jnp.float32), _forward(nodes[0], x, policy)),
                (module,), (batch[0],), differentiate=False, has_aux=True, what="predict")
            return y_pred
        return _forward(module, batch[0], policy)

    return predict_step


_PREDICT_FLOAT32 = _make_predict_step(mixed_precision.Policy("float32"))
_PREDICT_FLOAT32_MICRO = _make_predict_step(mixed_precision.Policy("float32"), True)


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
                if isinstance(leaf, PerReplica)).mask


# -- argument checks (one block, so they can move with the data adapter) ---------------------


def _check_count(what: str, name: str, value, minimum: int = 1, allow_none: bool = False):
    """`value` as an int >= `minimum` (or None when allowed); bools, floats and strings refused."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        hint = f" (an int, e.g. {name}={int(value)})" if isinstance(value, float) and value.is_integer() else ""
        raise errors.InvalidArgumentTypeError(
            f"{what}: {name} must be an int{' or None' if allow_none else ''}; received "
            f"{type(value).__name__} {value!r}. Pass a whole number >= {minimum}{hint}."
        )
    if value < minimum:
        raise errors.InvalidArgumentError(
            f"{what}: {name} must be >= {minimum}; received {name}={value!r}."
            + (" Pass None for the default." if allow_none else "")
        )
    return int(value)


def _check_verbose(what: str, verbose) -> int:
    """Keras's verbose: "auto" (1), 0, 1 or 2."""
    if verbose == "auto":
        return 1
    if not isinstance(verbose, (int, np.integer)) or verbose not in (0, 1, 2):  # True is 1
        raise errors.InvalidArgumentError(
            f"{what}: verbose must be 'auto', 0 (silent), 1 (progress bar) or 2 (one line per "
            f"epoch); received {verbose!r}."
        )
    return int(verbose)


def _check_bool(what: str, name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise errors.InvalidArgumentTypeError(
            f"{what}: {name} must be True or False; received {type(value).__name__} {value!r}."
        )
    return bool(value)


def _check_fraction(what: str, name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise errors.InvalidArgumentTypeError(
            f"{what}: {name} must be a float in [0, 1); received {type(value).__name__} {value!r}."
        )
    if not 0.0 <= value < 1.0:
        raise errors.InvalidArgumentError(
            f"{what}: {name} must be in [0, 1) (the fraction held out); received {value!r}. "
            "Pass e.g. 0.2 to hold out the last 20%."
        )
    return float(value)


def _check_fit_counts(epochs, initial_epoch, verbose, shuffle):
    epochs = _check_count("fit", "epochs", epochs)
    initial_epoch = _check_count("fit", "initial_epoch", initial_epoch, minimum=0)
    if initial_epoch >= epochs:
        raise errors.InvalidArgumentError(
            f"fit: initial_epoch={initial_epoch} is not below epochs={epochs}, so no epoch would "
            "train. As Keras, epochs is the index to stop at, not a count: to train n more "
            f"epochs from epoch {initial_epoch}, pass epochs={initial_epoch} + n."
        )
    if shuffle == "batch":
        raise errors.UnsupportedArgumentError(
            "fit: shuffle='batch' (tf.keras 2's chunked shuffle for HDF5) is not supported; "
            "pass shuffle=True (every epoch reshuffles the arrays) or False."
        )
    return epochs, initial_epoch, _check_verbose("fit", verbose), _check_bool("fit", "shuffle", shuffle)


def _check_compile_args(loss, loss_weights, metrics, weighted_metrics, run_eagerly, jit_compile,
                        auto_scale_loss):
    if loss is None:
        raise errors.InvalidArgumentError(
            "compile: loss is required (mirrax has no add_loss), e.g. "
            "loss='sparse_categorical_crossentropy'."
        )
    if isinstance(loss, (dict, list, tuple)):
        raise errors.UnsupportedArgumentError(
            f"compile: a {type(loss).__name__} of losses (one per output) is not supported; "
            f"received loss={loss!r}. Pass one loss whose function combines the outputs, e.g. "
            "loss=lambda y, y_pred: ..."
        )
    if loss_weights is not None:
        if isinstance(loss_weights, (dict, list, tuple)):
            raise errors.UnsupportedArgumentError(
                f"compile: per-output loss_weights ({loss_weights!r}) are not supported (mirrax "
                "models have one loss); pass one float that scales the loss, or weight the "
                "outputs inside the loss function."
            )
        if isinstance(loss_weights, bool) or not isinstance(loss_weights, (int, float, np.number)):
            raise errors.InvalidArgumentTypeError(
                f"compile: loss_weights must be a float; received {type(loss_weights).__name__} "
                f"{loss_weights!r}."
            )
        if not math.isfinite(float(loss_weights)):
            raise errors.InvalidArgumentError(
                f"compile: loss_weights must be finite; received {loss_weights!r}."
            )
    for name, value in (("metrics", metrics), ("weighted_metrics", weighted_metrics)):
        if value is not None and not isinstance(value, (list, tuple)):
            raise errors.InvalidArgumentTypeError(
                f"compile: {name} must be a list; received {type(value).__name__} {value!r}. "
                f"Pass e.g. {name}=[{value!r}]."
                if isinstance(value, str) or callable(value) else
                f"compile: {name} must be a list of metrics; received {type(value).__name__} "
                f"{value!r}. A dict of per-output metrics is not supported (one output)."
            )
    if _check_bool("compile", "run_eagerly", run_eagerly):
        raise errors.UnsupportedArgumentError(
            "compile: run_eagerly=True is not supported: every step is one compiled program "
            "over the replicas. To debug a step, run it under `with jax.disable_jit():` or "
            "call the module eagerly on a batch."
        )
    if jit_compile is False:
        raise errors.UnsupportedArgumentError(
            "compile: jit_compile=False is not supported: steps are always compiled by XLA "
            "(pass 'auto' or True)."
        )
    if jit_compile not in ("auto", True):
        raise errors.InvalidArgumentError(
            f"compile: jit_compile must be 'auto' or True; received {jit_compile!r}."
        )
    _check_bool("compile", "auto_scale_loss", auto_scale_loss)


def _metric_names(plain, weighted) -> list:
    """Log names of the metrics then the weighted metrics, as Keras 3's CompileMetrics."""
    names = [m.name for m in plain]
    for metric in weighted:
        name = metric.name if metric.name not in names else f"weighted_{metric.name}"
        base, index = name, 1
        while name in names:
            name = f"{base}_{index}"
            index += 1
        names.append(name)
    return names


def _check_class_weight(class_weight, sample_weight):
    """{int class: float weight}, as Keras's class_weight (int keys only)."""
    if class_weight is None:
        return None
    if sample_weight is not None:
        raise errors.InvalidArgumentError(
            "fit: class_weight and sample_weight were both given; as Keras, pass one of them "
            "(multiply the class weights into sample_weight to combine them)."
        )
    if not hasattr(class_weight, "items"):
        raise errors.InvalidArgumentTypeError(
            "fit: class_weight must be a dict {class index: weight}; received "
            f"{type(class_weight).__name__} {class_weight!r}. Pass e.g. {{0: 1.0, 1: 5.0}}."
        )
    table = {}
    for key, weight in class_weight.items():
        # Only ints: int('1'), int(1.5) and True would silently name another class.
        if isinstance(key, (bool, np.bool_)) or not isinstance(key, (int, np.integer)) \
                or key < 0:
            raise errors.InvalidArgumentTypeError(
                f"fit: class_weight keys must be class indices (ints >= 0); received the key "
                f"{key!r} of type {type(key).__name__}. Write e.g. {{0: 1.0, 1: 5.0}}."
            )
        index = int(key)
        if isinstance(weight, bool) or not isinstance(weight, (int, float, np.number)) \
                or not math.isfinite(float(weight)) or weight < 0:
            raise errors.InvalidArgumentError(
                f"fit: class_weight[{key!r}] must be a finite float >= 0; received {weight!r}."
            )
        table[index] = float(weight)
    return table


def _class_weights_of(y, table) -> np.ndarray:
    """Per-example weights of labels `y` (ints, or one-hot / probabilities: argmax), as Keras."""
    y = np.asarray(y)
    if y.ndim > 1:
        y = np.argmax(y, axis=-1) if y.shape[-1] != 1 else np.squeeze(y, axis=-1)
    if y.ndim != 1:
        raise errors.InvalidArgumentError(
            f"fit: class_weight needs one label per example; received labels of shape {y.shape}."
        )
    y = np.round(y).astype(np.int64)
    return np.array([table.get(int(label), 1.0) for label in y], np.float32)


def _check_sample_weight(what: str, sample_weight, n: int):
    sample_weight = np.asarray(sample_weight, np.float32)
    if sample_weight.shape != (n,):
        raise errors.InvalidArgumentError(
            f"{what}: sample_weight must hold one weight per example, shape ({n},); received "
            f"shape {sample_weight.shape}. Pass a 1-D array of length {n}."
        )
    if not np.isfinite(sample_weight).all():
        raise errors.InvalidArgumentError(
            f"{what}: sample_weight holds NaN or infinite values (first at index "
            f"{int(np.argmin(np.isfinite(sample_weight)))}), which would make the loss NaN."
        )
    return sample_weight


def _check_source(what: str, x):
    """Refuses an x that can be no input at all (before anything is read from it)."""
    if x is None:
        raise errors.InvalidArgumentError(
            f"{what}: x is required (arrays, an iterable of batches, or a distributed dataset)."
        )
    if inspect.isgeneratorfunction(x) or (callable(x) and not hasattr(x, "__iter__")):
        name = getattr(x, "__name__", type(x).__name__)
        raise errors.InvalidArgumentTypeError(
            f"{what}: x is the function {name!r}, not its batches; call it: pass {name}() "
            "(a generator of (x, y) batches), as Keras takes a generator."
        )
    if isinstance(x, (str, bytes)) or not (hasattr(x, "__iter__") or hasattr(x, "as_numpy_iterator")):
        raise errors.InvalidArgumentTypeError(
            f"{what}: x must be NumPy/JAX arrays (or a dict of them), an iterable of batches "
            f"(list, generator, torch DataLoader, Grain loader, tf.data) or a distributed "
            f"dataset; received {type(x).__name__} {x!r:.80}."
        )


def _normalize_batch(batch, inputs_only: bool, class_weight=None):
    """A user batch as a tuple (x, y[, sample_weight]) (or (x,) for predict), as Keras unpacks.

    Lists count as tuples (a torch DataLoader's default collate yields [x, y]).
    """
    if inputs_only:
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        return (jax.tree.map(_to_numpy, x),)
    if not isinstance(batch, (tuple, list)) or len(batch) not in (2, 3):
        size = f" of {len(batch)}" if isinstance(batch, (tuple, list)) else ""
        raise errors.InvalidBatchError(
            "fit/evaluate: each batch of a dataset must be a tuple or list (x, y) or (x, y, "
            f"sample_weight); received a {type(batch).__name__}{size}. For a multi-input "
            "model, make x a dict of arrays."
        )
    if class_weight is not None:
        if len(batch) == 3:
            raise errors.InvalidArgumentError(
                "fit: class_weight was given but the dataset's batches carry sample weights; "
                "as Keras, pass one of them."
            )
    x, y = jax.tree.map(_to_numpy, (batch[0], batch[1]))
    if class_weight is not None:
        return (x, y, _class_weights_of(_host(y), class_weight))
    if len(batch) == 2:
        return (x, y)
    return (x, y, np.asarray(_host(batch[2]), np.float32))


def _host(leaf):
    """A leaf as NumPy (tf.Tensor and torch.Tensor have `.numpy()`)."""
    return np.asarray(_to_numpy(leaf))


def _to_numpy(leaf):
    """A tf / torch tensor as NumPy (a torch tensor detached and on the host first)."""
    if isinstance(leaf, (np.ndarray, jax.Array)) or not hasattr(leaf, "numpy"):
        return leaf
    if hasattr(leaf, "detach") and hasattr(leaf, "cpu"):  # torch: grad-tracking or on a GPU
        leaf = leaf.detach().cpu()
    return leaf.numpy()


def _shapes(tree) -> str:
    leaves = jax.tree.leaves(tree)
    if len(leaves) == 1 and not isinstance(tree, dict):
        return f"{tuple(np.shape(leaves[0]))} ({_dtype(leaves[0])})"
    return str(jax.tree.map(lambda a: tuple(np.shape(a)), tree))


def _dtype(leaf):
    return leaf.dtype if hasattr(leaf, "dtype") else np.asarray(leaf).dtype


def _first_line(error) -> str:
    text = str(error).strip()
    return text.splitlines()[0].rstrip(".") if text else "(no message)"


def _first_layer_hint(module) -> str:
    """What the module's first Linear / Conv layer takes, to name the expected input."""
    for path, node in nnx.iter_graph(module):
        if isinstance(node, (nnx.Linear, nnx.Conv, nnx.LinearGeneral)):
            where = ".".join(map(str, path)) or "the module"
            return (f" The module's first {type(node).__name__} ({where}) takes inputs whose "
                    f"last axis is {node.in_features}.")
    return ""


def _check_fits_model(model, x, y, what: str):
    """Runs the module (and the loss) abstractly on the first example of a batch.

    So shapes or dtypes that do not fit give one named error before any step, instead of a
    jax / flax error from inside the compiled step. Returns the model's output shape.

    Raises:
      IncompatibleInputError: the module cannot take x, or the loss cannot compare y with the
        module's output.
    """
    def one(a):
        a = _host(a) if not isinstance(a, (jax.Array, jax.ShapeDtypeStruct)) else a
        return jax.ShapeDtypeStruct((1,) + tuple(a.shape[1:]), a.dtype)

    x1 = jax.tree.map(one, x)
    y1 = None if y is None else jax.tree.map(one, y)
    policy = getattr(model, "dtype_policy", None) or mixed_precision.Policy("float32")
    # One abstract run per input signature (fit called once per epoch checks once).
    key = (jax.tree.structure((x1, y1)), tuple((a.shape, str(a.dtype)) for a in jax.tree.leaves(
        (x1, y1))), policy.name, id(model.loss))
    checked = model._checked_inputs
    if key in checked:
        return checked[key]
    graphdef, state = nnx.split(model.module)
    try:
        y_pred = jax.eval_shape(lambda s, v: _forward(nnx.merge(graphdef, s), v, policy), state, x1)
    except errors.MirraxError:
        raise
    except Exception as error:  # any failure of the user's module on this input
        detail = _first_line(error)
        raise errors.IncompatibleInputError(
            f"{what}: the model cannot take x of shape {_shapes(x)}: {type(error).__name__}: "
            f"{detail}.{_first_layer_hint(model.module)} Give x the shape the module expects "
            "(batch first), or change the module's input size."
        ) from error
    if y is None or model.loss is None:
        checked[key] = y_pred
        return y_pred
    try:
        per_example = jax.eval_shape(model.loss.per_example, y1, y_pred)
    except errors.MirraxError:
        raise
    except ValueError as error:
        if "does not fit" in str(error) or "expected" in str(error):
            raise errors.IncompatibleInputError(f"{what}: {error}") from error
        raise
    except Exception as error:
        detail = _first_line(error)
        raise errors.IncompatibleInputError(
            f"{what}: the loss cannot compare y of shape {_shapes(y)} with the model's output "
            f"of shape {_shapes(y_pred)}: {type(error).__name__}: {detail}. Give y the shape "
            "the loss expects for this output."
        ) from error
    if tuple(getattr(per_example, "shape", ())[:1]) != (1,):
        raise errors.IncompatibleInputError(
            f"{what}: the loss must give one value per example (shape (batch,)); for a batch of "
            f"1 it gave shape {tuple(per_example.shape)} (y {_shapes(y)}, output "
            f"{_shapes(y_pred)}). Return one loss per example from the loss function."
        )
    checked[key] = y_pred
    return y_pred


# -- input handling ---------------------------------------------------------------------------


def _as_arrays(value):
    """A tensor of another framework (torch.Tensor, tf.Tensor: `.numpy()` and `.shape`), or a
    dict of them, as NumPy, so fit(x_tensor, y_tensor) means what fit(x_array, y_array) does."""
    def convert(leaf):
        return _to_numpy(leaf) if hasattr(leaf, "shape") else leaf

    if isinstance(value, dict):
        return {key: convert(leaf) for key, leaf in value.items()}
    return convert(value)


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
    n = _num_examples(x)
    cut = int(n * (1.0 - fraction))
    if cut == 0 or cut == n:
        raise errors.InvalidArgumentError(
            f"fit: validation_split={fraction} of {n} examples leaves "
            f"{'no training' if cut == 0 else 'no validation'} example; pass a fraction that "
            f"keeps at least one of each (e.g. {max(1, n // 5)}/{n} = {max(1, n // 5) / n:.2f})."
        )
    take = lambda tree, s: None if tree is None else jax.tree.map(lambda a: a[s], tree)  # noqa: E731
    head, tail = slice(0, cut), slice(cut, n)
    return take(x, head), take(y, head), take(sample_weight, head), (
        take(x, tail), take(y, tail), take(sample_weight, tail))


def _unpack_validation(data):
    if isinstance(data, (tuple, list)) and len(data) in (2, 3) and _is_arrays(_as_arrays(data[0])):
        return data[0], data[1], data[2] if len(data) == 3 else None
    if isinstance(data, (tuple, list)) and data and _is_arrays(_as_arrays(data[0])):
        raise errors.InvalidArgumentError(
            f"fit: validation_data as arrays must be (x_val, y_val) or (x_val, y_val, "
            f"sample_weight); received a {type(data).__name__} of {len(data)}."
        )
    return data, None, None


class _Input:
    """One input of fit/evaluate/predict, as a source of distributed (x, y, sample_weight) batches."""

    def __init__(self, model, strategy, x, y, sample_weight, batch_size, shuffle, what,
                 inputs_only=False, class_weight=None):
        self.strategy = strategy
        self.shuffle = shuffle
        self.model = model
        self.inputs_only = inputs_only
        self.class_weight = class_weight
        x, y, sample_weight = (_as_arrays(v) for v in (x, y, sample_weight))
        self.one_shot = False
        self._pass = None
        self._what = what
        # Sparse labels of every dataset batch are checked on the host against this (set from
        # the first batch's model output), and every new batch signature runs abstractly
        # through the model before its step (`_fits`): a bad batch 5 is named, not a NaN loss
        # or a jax error from inside the compiled step.
        self.num_classes = None
        self._signatures: set = set()
        if isinstance(x, (DistributedDataset, DistributedDatasetsFromFunction)):
            if y is not None or batch_size is not None or sample_weight is not None:
                raise errors.InvalidArgumentError(
                    f"{what}: x is a distributed dataset, which carries its own labels, weights "
                    "and batch size; do not pass y, sample_weight or batch_size."
                )
            if class_weight is not None:
                raise errors.UnsupportedArgumentError(
                    f"{what}: class_weight is not supported with a distributed dataset (its "
                    "batches are already split over the replicas); put the weights in the "
                    "batches as (x, y, sample_weight), or pass the undistributed dataset."
                )
            self.arrays = False
            self.dataset, self.steps = x, None
            return
        self.arrays = _is_arrays(x)
        if not self.arrays:
            self._init_dataset(x, y, sample_weight, batch_size, what)
            return
        n = _num_examples(x)
        if isinstance(y, (list, tuple)):
            y = np.asarray(y)  # labels as a Python list, as Keras accepts them
        if y is None and not inputs_only:
            raise errors.InvalidArgumentError(
                f"{what}: y is required with array inputs (the labels).")
        for name, other in (("y", y), ("sample_weight", sample_weight)):
            if other is None:
                continue
            leaf = jax.tree.leaves(other)[0] if _is_arrays(other) else np.asarray(other)
            length = len(leaf) if np.ndim(leaf) else 0
            if length != n:
                raise errors.InvalidArgumentError(
                    f"{what}: x has {n} examples but {name} has {length}; they must have the "
                    "same length along axis 0."
                )
        if n == 0:
            raise errors.EmptyDatasetError(
                f"{what}: x has 0 examples (shape {jax.tree.leaves(x)[0].shape}); there is "
                "nothing to train on or evaluate. Check how the arrays were loaded or split."
            )
        self.batch_size = 32 if batch_size is None else _check_count(what, "batch_size", batch_size)
        self.x, self.y = x, y
        if sample_weight is not None:
            sample_weight = _check_sample_weight(what, sample_weight, n)
        elif class_weight is not None:
            sample_weight = _class_weights_of(y, class_weight)
        self.sample_weight = sample_weight
        self.n = n
        self.steps = math.ceil(n / self.batch_size)
        self.dataset = None
        y_pred = _check_fits_model(model, x, y, what)
        if y is not None and isinstance(model.loss, losses_lib.SparseCategoricalCrossentropy):
            losses_lib.SparseCategoricalCrossentropy.check_labels(np.asarray(y), y_pred.shape[-1])

    def _init_dataset(self, x, y, sample_weight, batch_size, what):
        _check_source(what, x)
        if batch_size is not None:
            raise errors.InvalidArgumentError(
                f"{what}: batch_size={batch_size} was given with a {type(x).__name__}, "
                "which is already batched. Remove batch_size (it applies to NumPy arrays "
                "only)."
            )
        for name, value in (("y", y), ("sample_weight", sample_weight)):
            if value is not None:
                several = isinstance(x, (list, tuple)) and x and all(
                    _is_arrays(_as_arrays(item)) for item in x)
                raise errors.InvalidArgumentError(
                    f"{what}: {name} must be None when x is a dataset of (x, y[, sample_weight]) "
                    f"batches; received {name} of type {type(value).__name__}. Put it in the "
                    "batches."
                    + (" A list or tuple x is a sequence of batches in mirrax; for a model with "
                       "several inputs pass x as a dict of arrays (Keras's list of input "
                       "arrays is not supported)." if several else "")
                    + (" x holds Python numbers (e.g. from X.tolist()): pass the examples as "
                       "arrays, np.asarray(x) and np.asarray(y)." if _python_numbers(x) else "")
                )
        self.dataset = None
        try:
            self.steps = len(x) if hasattr(x, "__len__") else None
        except TypeError:  # objects whose __len__ refuses (an unsized tf.data dataset)
            self.steps = None
        if self.steps == 0:
            raise errors.EmptyDatasetError(
                f"{what}: x is an empty {type(x).__name__} (0 batches); there is nothing to "
                "train on or evaluate (Keras refuses an empty input too)."
            )
        # A generator is consumed across epochs, as Keras does with steps_per_epoch.
        self.one_shot = hasattr(x, "__iter__") and not hasattr(x, "as_numpy_iterator") and iter(x) is x
        missing = object()
        if self.one_shot:
            first = next(x, missing)
            if first is not missing:
                x = itertools.chain([first], x)
        else:
            items = x.as_numpy_iterator() if hasattr(x, "as_numpy_iterator") else x
            first = next(iter(items), missing)
        if first is missing:
            raise errors.EmptyDatasetError(
                f"{what}: x ({type(x).__name__}) yielded no batch; there is nothing to train on "
                "or evaluate. As Keras: a generator must yield at least one batch."
            )
        batch = _normalize_batch(first, self.inputs_only, self.class_weight)
        y_pred = _check_fits_model(self.model, batch[0], None if self.inputs_only else batch[1],
                                   what)
        if not self.inputs_only:
            rows = len(_host(jax.tree.leaves(batch[0])[0]))
            if len(batch) == 3:
                _check_sample_weight(f"{what} (the first batch)", batch[2], rows)
            if isinstance(self.model.loss, losses_lib.SparseCategoricalCrossentropy):
                self.num_classes = y_pred.shape[-1]
                losses_lib.SparseCategoricalCrossentropy.check_labels(_host(batch[1]),
                                                                      self.num_classes)
        self.source = x
        self._stream = None

    def close(self):
        """Ends the pass kept open across epochs (its prefetching, if any)."""
        if self._pass is not None:
            self._pass.close()
            self._pass = None

    def epoch_batches(self, steps_per_epoch, prefetch=True):
        """One training epoch's batches, as Keras's epoch iterator.

        Without `steps_per_epoch`: one pass. With it: up to `steps_per_epoch` batches from the
        pass where the previous epoch stopped; a pass that ends within the epoch ends the epoch
        with Keras's warning, and the next epoch starts a new pass (reshuffled).
        """
        if steps_per_epoch is None or self.one_shot:
            yield from self.batches(steps_per_epoch, prefetch)
            return
        count = 0
        for fresh in (self._pass is None, True):
            if fresh:
                self.close()
                self._pass = self.batches(None, prefetch)
            count = 0
            for batch in self._pass:
                yield batch
                count += 1
                if count >= steps_per_epoch:
                    return
            if count or fresh:
                break
            # The previous epoch ended exactly at the end of a pass: start the next one.
        self._pass = None
        if count:
            warnings.warn(
                "Your input ran out of data; interrupting training. Make sure that your "
                "dataset or generator can generate at least `steps_per_epoch * epochs` "
                f"batches (this epoch got {count} of steps_per_epoch={steps_per_epoch}).",
                stacklevel=3,
            )

    def batches(self, steps=None, prefetch=True):
        """Distributed batches for one epoch (or `steps` of them).

        `prefetch`: for array inputs in one process, make batches in a background thread (when
        the loop waits for every step, e.g. to read batch logs) or else in the caller's thread
        (steps are dispatched asynchronously, so the next batch is cut while the devices run).
        """
        if self.dataset is not None:
            iterator = iter(self.dataset)
        elif self.one_shot:
            yield from self._stream_batches(steps)
            return
        elif self.arrays:
            order = self.model._rng.permutation(self.n) if self.shuffle else None
            if jax.process_count() == 1:
                iterator = input_lib.DistributedIterator(
                    _placed_array_batches(self.strategy, _ArrayBatches(self, order)),
                    input_options.InputOptions(experimental_fetch_to_device=prefetch))
            else:
                iterator = iter(self.strategy.experimental_distribute_dataset(
                    _ArrayBatches(self, order)))
        else:
            iterator = iter(self.strategy.experimental_distribute_dataset(
                _NormalizedBatches(self.source, self.inputs_only, self.class_weight,
                                   self.num_classes)))
        count = 0
        try:
            for batch in iterator:
                if steps is not None and count >= steps:
                    break
                if not self.arrays:
                    self._fits(batch, count)
                yield batch
                count += 1
        finally:
            close = getattr(iterator, "close", None)
            if close is not None:
                close()

    def _fits(self, batch, index: int) -> None:
        """Runs a distributed batch abstractly through the model when its signature is new.

        Raises:
          IncompatibleInputError: the batch's shapes or dtypes do not fit the model or loss.
        """
        leaves, structure = jax.tree.flatten(batch)
        signature = (structure, tuple((leaf.shape[2:], leaf.dtype) for leaf in leaves))
        if signature in self._signatures:
            return
        def global_spec(value):  # a PerReplica's array is (replicas, rows, ...)
            leaf = jax.tree.leaves(value)[0]
            return jax.ShapeDtypeStruct((leaf.shape[0] * leaf.shape[1],) + tuple(leaf.shape[2:]),
                                        leaf.dtype)

        parts = jax.tree.map(global_spec, batch, is_leaf=lambda v: isinstance(v, PerReplica))
        _check_fits_model(self.model, parts[0], None if self.inputs_only else parts[1],
                          f"{self._what} (batch {index + 1})")
        self._signatures.add(signature)

    def _stream_batches(self, steps):
        """Up to `steps` batches from the one iterator over a generator, kept across epochs."""
        first_pass = self._stream is None
        if first_pass:
            self._stream = iter(self.strategy.experimental_distribute_dataset(
                _NormalizedBatches(self.source, self.inputs_only, self.class_weight,
                                   self.num_classes)))
        count = 0
        for batch in self._stream:
            self._fits(batch, count)
            yield batch
            count += 1
            if steps is not None and count >= steps:
                return
        if count == 0 and not first_pass:
            raise errors.EmptyDatasetError(
                f"{self._what}: the generator given as x is exhausted: it yielded no batch for "
                "this epoch. A generator is read once across all epochs; make it endless and "
                "pass steps_per_epoch (as Keras), or pass a re-iterable dataset (a list of "
                "batches, a Grain dataset)."
            )


class _ArrayBatches:
    """Global batches cut from arrays in a given order (None: as stored): (x, y,
    sample_weight) or (x,).

    In stored order a batch is a slice (a view, no copy), so on CPU the placed batch may share
    the arrays' memory while its step runs: the arrays must not be modified during the pass
    (by a callback). A shuffled batch is a fresh copy.
    """

    def __init__(self, data: _Input, order):
        self.data, self.order = data, order

    def __iter__(self):
        d = self.data
        for start in range(0, d.n, d.batch_size):
            if self.order is None:
                index = slice(start, start + d.batch_size)
            else:
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
    placer. On CPU `device_put` may alias a NumPy array instead of copying it: a batch of
    `_ArrayBatches` is a fresh copy (shuffled) or a view of the user's arrays, which the pass
    only reads.
    """
    placer = batching.Placer(strategy)
    replicas = strategy.num_replicas_in_sync
    checked = False
    for batch in batches:
        if not checked:
            batch, n = batching.to_host_batch(batch)  # dtypes and sizes, once per pass
            checked = True
        else:
            n = len(jax.tree.leaves(batch)[0])
        rows = n // replicas
        if n % replicas == 0 and rows == placer.rows:
            lengths = (rows,) * replicas
            stacked = jax.tree.map(lambda a: a.reshape((replicas, rows) + a.shape[1:]), batch)
            mask = placer.mask(lengths)
            yield jax.tree.map(lambda a: PerReplica(strategy, a, mask, lengths),
                               batching.put_stacked(strategy, stacked))
        elif strategy.replica_invariant:
            # The batch size, not the first batch (which may be the only, partial, one), fixes
            # the micro-batch size.
            rows = batching.invariant_rows(strategy, placer.rows, batches.data.batch_size,
                                            f"{batches.data._what} (batch_size)")
            shards, lengths = batching.split_invariant(strategy, batch, n, rows,
                                                        strategy.extended.replica_devices.local_replica_ids)
            yield placer.place(shards, f"global batch of {n} over {replicas} replicas",
                               lengths=lengths)
        else:
            shards = batching.split_global_batch(
                batch, n, replicas, strategy.extended.replica_devices.local_replica_ids)
            yield placer.place(shards, f"global batch of {n} over {replicas} replicas")


class _NormalizedBatches:
    """Batches of a user dataset as (x, y, sample_weight) (or (x,) for predict); with
    `num_classes`, each batch's sparse labels are checked on the host (a min and a max)."""

    def __init__(self, source, inputs_only, class_weight=None, num_classes=None):
        self.source, self.inputs_only, self.class_weight = source, inputs_only, class_weight
        self.num_classes = num_classes

    def __iter__(self):
        items = self.source.as_numpy_iterator() if hasattr(self.source, "as_numpy_iterator") else self.source
        for index, batch in enumerate(items):
            batch = _normalize_batch(batch, self.inputs_only, self.class_weight)
            if self.num_classes is not None:
                try:
                    losses_lib.SparseCategoricalCrossentropy.check_labels(_host(batch[1]),
                                                                          self.num_classes)
                except errors.InvalidLabelError as error:
                    raise errors.InvalidLabelError(f"batch {index + 1} of the dataset: {error}") \
                        from None
            yield batch
