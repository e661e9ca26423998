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
import itertools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from mirrax import errors
from mirrax._src import checkpoint
from mirrax._src.distribute import invariant
from mirrax._src.distribute import values as values_lib
from mirrax._src.distribute.strategy import get_strategy, has_strategy
from mirrax._src.distribute.values import PerReplica
from mirrax._src.training import callbacks as callbacks_lib
from mirrax._src.training import losses as losses_lib
from mirrax._src.training import metrics as metrics_lib
from mirrax._src.training import mixed_precision
from mirrax._src.training import arguments as checks
from mirrax._src.training import data_adapter
from mirrax._src.training import loops
from mirrax._src.training import optimizer as optimizers
from mirrax._src.training import steps as steps_lib


class Model:
    """A Keras-style model around an `nnx.Module`, as `keras.Model` with a distribution strategy.

    `compile` picks the strategy in scope (or the default strategy); `fit`, `evaluate` and
    `predict` then run every step on all of its replicas. `batch_size` is always the GLOBAL
    batch size (split over replicas), as Keras under `tf.distribute`.

    Args:
      module: the `nnx.Module` to train; `model.module` returns it and `model(x)` calls it.

    Attributes:
      module, optimizer (an `optimizers.OptimizerHandle` after compile), loss, metrics, stop_training,
      history (the `History` of the last fit), distribute_strategy.
    """

    def __init__(self, module: nnx.Module):
        if not isinstance(module, nnx.Module):
            raise errors.InvalidArgumentTypeError(
                f"mirrax.Model wraps an nnx.Module; received {type(module).__name__}. Pass the "
                "module itself, e.g. mirrax.Model(MyNet(rngs=nnx.Rngs(0)))."
            )
        self.module = module
        self.optimizer: optimizers.OptimizerHandle | None = None
        self.loss = None
        self.metrics: list = []
        self.stop_training = False
        self.history = None
        self.distribute_strategy = None
        # As Keras, a model made under a strategy's scope belongs to it (compile uses it).
        self._scope_strategy = get_strategy() if has_strategy() else None
        self._compiled = False
        # Input signatures already run abstractly through the module and loss (see
        # checks.check_fits_model); compile clears it (the loss or policy may change).
        self._checked_inputs: dict = {}

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def checkpoint_children(self) -> dict:
        """What `mirrax.Checkpoint` stores for this model (mirrax's checkpoint protocol): the
        module and, once compiled, the `nnx.Optimizer` (as f"{name}.module" and
        f"{name}.optimizer")."""
        children = {"module": self.module}
        if self.optimizer is not None:
            children["optimizer"] = self.optimizer.nnx_optimizer
        return children

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
        checks.check_compile_args(loss, loss_weights, metrics, weighted_metrics, run_eagerly,
                            jit_compile, auto_scale_loss)
        steps_per_execution = checks.check_count("compile", "steps_per_execution", steps_per_execution)
        gradient_accumulation_steps = checks.check_count(
            "compile", "gradient_accumulation_steps", gradient_accumulation_steps)
        self.distribute_strategy = self._compile_strategy()
        if self.distribute_strategy.replica_invariant:
            invariant.check_no_sync_batch_norm((self.module,), "compile")
        tx = optimizers.resolve_optimizer(optimizer)
        self.steps_per_execution = steps_per_execution
        self.gradient_accumulation_steps = gradient_accumulation_steps
        if gradient_accumulation_steps > 1:
            # optax's accumulator: the mean of k micro-batch gradients, applied every k-th step.
            tx = optax.MultiSteps(tx, every_k_schedule=gradient_accumulation_steps)
        self.optimizer = optimizers.OptimizerHandle(tx, nnx.Optimizer(self.module, tx, wrt=nnx.Param))
        self.loss = losses_lib.get(loss)
        self._loss_scale = 1.0 if loss_weights is None else float(loss_weights)
        plain = [metrics_lib.get(m, loss=self.loss) for m in (metrics or [])]
        weighted = [metrics_lib.get(m, loss=self.loss) for m in (weighted_metrics or [])]
        self.metrics = plain + weighted
        self._weighted = (False,) * len(plain) + (True,) * len(weighted)
        self._metric_names = checks.metric_names(plain, weighted)
        self._tracker = steps_lib.LossTracker()
        self.dtype_policy = mixed_precision.global_policy()
        self._dynamic_scale = (
            mixed_precision.LossScale()
            if self.dtype_policy.uses_loss_scaling and auto_scale_loss else None
        )
        micro = self.distribute_strategy.replica_invariant
        self._train_fn = steps_lib.make_train_step(self.loss, self._loss_scale, self.dtype_policy,
                                          self._weighted, micro)
        self._train_many_fn = steps_lib.make_multi_step(self._train_fn)
        self._test_fn = steps_lib.make_test_step(self.loss, self._loss_scale, self.dtype_policy,
                                        self._weighted, micro)
        self._predict_fn = steps_lib.make_predict_step(self.dtype_policy, micro)
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
        epochs, initial_epoch, verbose, shuffle = checks.check_fit_counts(
            epochs, initial_epoch, verbose, shuffle)
        steps_per_epoch = checks.check_count("fit", "steps_per_epoch", steps_per_epoch, allow_none=True)
        validation_steps = checks.check_count("fit", "validation_steps", validation_steps,
                                        allow_none=True)
        validation_freq = checks.check_count("fit", "validation_freq", validation_freq)
        validation_split = checks.check_fraction("fit", "validation_split", validation_split)
        class_weight = checks.check_class_weight(class_weight, sample_weight)
        x, y, sample_weight = (data_adapter.as_arrays(v) for v in (x, y, sample_weight))
        strategy = self.distribute_strategy
        if validation_split and validation_data is None:
            if not data_adapter.is_arrays(x):
                raise errors.InvalidArgumentError(
                    "fit: validation_split is only supported for NumPy array inputs (it takes "
                    f"the last {validation_split:.0%} of the arrays); received a "
                    f"{type(x).__name__}. Pass validation_data= instead."
                )
            x, y, sample_weight, validation_data = data_adapter.split_validation(
                x, y, sample_weight, validation_split
            )
        train = data_adapter.ModelInput(self, strategy, x, y, sample_weight, batch_size, shuffle, "fit",
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
            vx, vy, vw = (data_adapter.as_arrays(v) for v in data_adapter.unpack_validation(validation_data))
            vbatch = validation_batch_size if validation_batch_size is not None else batch_size
            val = data_adapter.ModelInput(self, strategy, vx, vy, vw, vbatch if data_adapter.is_arrays(vx) else None,
                         False, "fit(validation_data=...)")
        elif validation_batch_size is not None:
            raise errors.InvalidArgumentError(
                f"fit: validation_batch_size={validation_batch_size!r} was given without "
                "validation data; pass validation_data= or validation_split=, or drop it."
            )
        loops.check_generators_last(train, steps_per_epoch, val, validation_steps,
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
        batch_logs = cbs.needs_batch_logs("on_train_batch_end")
        cbs.on_train_begin()
        # A callback that restored a backup (BackupAndRestore) says where training resumes:
        # (epoch index, batches of that epoch already done).
        first_epoch, first_step = cbs.resume_point() or (initial_epoch, 0)
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
                for group in steps_lib.groups(batches, self.steps_per_execution):
                    last = step + len(group) - 1
                    cbs.on_train_batch_begin(step)
                    state = (self.module, self.optimizer.nnx_optimizer, self.metrics,
                             self._tracker, self._dynamic_scale)
                    if len(group) == 1:
                        strategy.run(self._train_fn, args=state + (group[0],))
                    else:
                        masks = tuple(PerReplica(strategy, steps_lib.mask_of(b)) for b in group)
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
                if loops.has_learning_rate(self.optimizer):
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
        if loops.has_learning_rate(self.optimizer):
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
        verbose = checks.check_verbose("evaluate", verbose)
        steps = checks.check_count("evaluate", "steps", steps, allow_none=True)
        return_dict = checks.check_bool("evaluate", "return_dict", return_dict)
        data = data_adapter.ModelInput(self, self.distribute_strategy, x, y, sample_weight, batch_size, False,
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
        batch_logs = cbs.needs_batch_logs("on_test_batch_end")
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
        loops.warn_if_ran_out(what, "steps", steps, count)
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
        verbose = checks.check_verbose("predict", verbose)
        steps = checks.check_count("predict", "steps", steps, allow_none=True)
        self._check_scope("predict")
        strategy = self.distribute_strategy or self._scope_strategy or get_strategy()
        data = data_adapter.ModelInput(self, strategy, x, None, None, batch_size, False, "predict", inputs_only=True)
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
                     or cbs.needs_batch_logs("on_predict_batch_end"))
        pending: collections.deque = collections.deque()
        try:
            for step, batch in enumerate(data.batches(steps)):
                cbs.on_predict_batch_begin(step)
                predict_fn = self._predict_fn if self._compiled else (
                    steps_lib.PREDICT_FLOAT32_MICRO if strategy.replica_invariant else steps_lib.PREDICT_FLOAT32)
                out = strategy.run(predict_fn, args=(self.module, batch))
                if per_batch:
                    outputs.append(jax.tree.map(np.asarray, strategy.gather(out, axis=0)))
                    cbs.on_predict_batch_end(step, {"outputs": outputs[-1]})
                else:
                    pending.append(out)
                    if len(pending) > loops.PREDICT_AHEAD:  # bounds the device memory held
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
        loops.warn_if_ran_out("predict", "steps", steps, len(outputs))
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
        class_weight = checks.check_class_weight(class_weight, sample_weight)
        data = self._one_batch("train_on_batch", x, y, sample_weight, class_weight)
        return_dict = checks.check_bool("train_on_batch", "return_dict", return_dict)
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
        return_dict = checks.check_bool("test_on_batch", "return_dict", return_dict)
        self._reset_metrics()
        self.module.eval()
        for batch in data.batches():
            self.distribute_strategy.run(self._test_fn,
                                         args=(self.module, self.metrics, self._tracker, batch))
        return self._result(self._logs(), return_dict)

    def predict_on_batch(self, x):
        """The module's outputs for one batch of arrays, as NumPy (`keras.Model.predict_on_batch`)."""
        x = data_adapter.as_arrays(x)
        if not data_adapter.is_arrays(x):
            raise errors.InvalidArgumentTypeError(
                f"predict_on_batch: x must be an array (or a dict of arrays); received "
                f"{type(x).__name__}. Use predict() for datasets."
            )
        return self.predict(x, batch_size=max(data_adapter.num_examples(x), 1), verbose=0)

    def _one_batch(self, what, x, y, sample_weight, class_weight):
        x, y, sample_weight = (data_adapter.as_arrays(v) for v in (x, y, sample_weight))
        if not data_adapter.is_arrays(x):
            raise errors.InvalidArgumentTypeError(
                f"{what}: x must be an array (or a dict of arrays) holding one batch; received "
                f"{type(x).__name__}. Use fit() / evaluate() for datasets."
            )
        return data_adapter.ModelInput(self, self.distribute_strategy, x, y, sample_weight,
                      max(data_adapter.num_examples(x), 1), False, what, class_weight=class_weight)

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
        checks.check_bool("summary", "expand_nested", expand_nested)
        show_trainable = checks.check_bool("summary", "show_trainable", show_trainable)
        line_length = checks.check_count("summary", "line_length", line_length, minimum=40,
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


def _weights(module) -> list:
    """(path, variable) of every variable but PRNG state, in `nnx.state`'s order."""
    return list(nnx.to_flat_state(nnx.state(module, nnx.Not(nnx.RngState))))
