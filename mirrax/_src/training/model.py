"""`mirrax.Model`: Keras's compile / fit / evaluate / predict around an `nnx.Module`, distributed.

Every step is one `strategy.run` of a step function built at `compile`: the module, its
`nnx.Optimizer`, the metrics and a loss tracker enter as NNX objects, so gradients are summed
over the replicas by JAX, metric state (sums, counts) is SUM-aggregated over the replicas, and
the caller's objects hold the current values after every step (no separate sync is needed for
callbacks that read or write the model). Batches are global batches split by the strategy's
input pipeline (padded and masked when partial), so every example counts exactly once.

The rooms: the loops in loops.py over the executors of local_executor.py and
parameter_server_executor.py (the one-batch calls in batch_calls.py, the logs in logs.py), the
steps in steps.py, inputs in data_adapter.py, array_inputs.py and dataset_batches.py, checks in
fit_arguments.py, arguments.py, strategy_checks.py, optimizer.py, weights.py (the other weight
methods in model_weights.py, the metrics' and the shuffling RNG's in model_state.py).
"""

from __future__ import annotations

from flax import nnx

from mirrax import errors
from mirrax._src.distribute.current import get_strategy, has_strategy
from mirrax._src.training import (
    batch_calls,
    keras_checks,
    keras_hooks,
    keras_models,
    local_executor,
    loops,
    mixed_precision,
    model_compile,
    model_glue,
    model_state,
    model_steps,
    model_weights,
    step_binding,
    strategy_checks,
)
from mirrax._src.training import optimizer as optimizers
from mirrax._src.training import steps as steps_lib
from mirrax._src.training.fit_arguments import FitArguments


class Model(
    model_glue.KerasGlue,
    model_weights.ModelWeights,
    batch_calls.BatchCalls,
    model_steps.ModelSteps,
    model_state.TrainingState,
):
    """A Keras-style model around an `nnx.Module`, as `keras.Model` with a distribution strategy.

    `compile` picks the strategy in scope (or the default strategy); `fit`, `evaluate` and
    `predict` then run every step on all of its replicas. `batch_size` is always the GLOBAL
    batch size (split over replicas), as Keras under `tf.distribute`.

    Args:
      module: the `nnx.Module` to train; `model.module` returns it and `model(x)` calls it.
        Or a built Keras 3 model (Sequential, functional or subclassed) on the JAX backend:
        it is wrapped in a `KerasModule` (`model.module`; `model.keras_model` is the Keras
        model), trained through Keras's stateless API with its own losses (regularizers,
        `add_loss`) added once to the loss (docs/training.md, "Keras 3 models").

    Raises:
      InvalidArgumentTypeError: `module` is neither an nnx.Module nor a Keras model.
      UnsupportedArgumentError: a Keras model on another backend than JAX.
      InvalidArgumentError: a Keras model that is not built.

    Attributes:
      module, optimizer (an `OptimizerHandle` after compile), loss, metrics, stop_training,
      history (the `History` of the last fit), distribute_strategy; `save`, `losses` and
      `trainable_variables` come from `KerasGlue` (model_glue.py), `get_weights` and the other
      weight methods from `ModelWeights` (model_weights.py), `train_on_batch`, `test_on_batch`
      and `make_*_function` from `BatchCalls` (batch_calls.py), `train_step`, `test_step`,
      `predict_step` and `loss_tracker` from `ModelSteps` (model_steps.py).
    """

    def __init__(self, module):
        if keras_checks.is_keras_model(module):
            module = keras_models.KerasModule(module)
        if not isinstance(module, nnx.Module):
            raise errors.InvalidArgumentTypeError(
                f"mirrax.Model wraps an nnx.Module or a Keras 3 model; received "
                f"{type(module).__name__}. Pass the module itself, e.g. "
                "mirrax.Model(MyNet(rngs=nnx.Rngs(0))) or mirrax.Model(keras.Sequential([...]))."
            )
        self.module = module
        self.optimizer: optimizers.OptimizerHandle | None = None
        self.loss = None
        self.metrics: list = []
        self.stop_training, self.history = False, None
        self.distribute_strategy = None
        # As Keras, a model made under a strategy's scope belongs to it (compile uses it).
        self._scope_strategy = get_strategy() if has_strategy() else None
        self.steps_per_execution = self.gradient_accumulation_steps = self.dtype_policy = None
        self._compiled: steps_lib.CompiledState | None = None  # the compiled steps and state
        self._binding = step_binding.StepBinding()  # the replica's objects while a step is traced
        self._uncompiled_predict_fn = step_binding.bound_step(self, self._binding, "predict_step")
        self._uncompiled_checked: dict = {}  # predict's checked inputs before compile

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @property
    def keras_model(self):
        """The Keras model this `Model` was made from (None for an NNX module). Its own
        variables hold the trained values after each `fit` (and after `write_to_keras()` of
        `model.module`); during training `model.get_weights()` is current."""
        return self.module.keras_model if isinstance(self.module, keras_models.KerasModule) else None

    def checkpoint_children(self) -> dict:
        """What `mirrax.Checkpoint` stores for this model (mirrax's checkpoint protocol): the
        module and, once compiled, the `nnx.Optimizer` (as f"{name}.module" and
        f"{name}.optimizer")."""
        keras_hooks.read_keras_writes(self.module)
        children = {"module": self.module}
        if self.optimizer is not None:
            children["optimizer"] = self.optimizer.nnx_optimizer
        return children

    # -- compile ---------------------------------------------------------------------------------

    def compile(
        self,
        optimizer="rmsprop",
        loss=None,
        loss_weights=None,
        metrics=None,
        weighted_metrics=None,
        run_eagerly: bool = False,
        steps_per_execution: int = 1,
        jit_compile="auto",
        auto_scale_loss: bool = True,
        gradient_accumulation_steps: int = 1,
    ):
        """Configures training, as `keras.Model.compile` (same arguments, same order).

        Args:
          optimizer: an optax `GradientTransformation`, or "adam", "sgd", "rmsprop", "adamw"
            (Keras's default hyperparameters; the learning rate in `inject_hyperparams` state).
          loss: a `mirrax.losses.Loss`, a loss name ("sparse_categorical_crossentropy", "mse",
            ...), or a callable (y_true, y_pred) -> per-example loss (batch,). Required. For
            several outputs, as Keras 3: one loss for all, a list (output order; None skips
            one) or a dict by output name (docs/training.md, "Several outputs").
          loss_weights: a float that scales the loss; several outputs: a list or dict.
          metrics: list of `mirrax.metrics.Metric`s or names ("accuracy" resolves by the loss,
            as Keras); updated WITHOUT sample weights; a taken name gets `_1`, `_2`, ... (as
            Keras). Several outputs: one entry per output (a list or a dict by output name).
          weighted_metrics: list of metrics updated with the sample weights (and class
            weights), as Keras; logged under the metric's name, or "weighted_<name>" when
            `metrics` already holds that name.
          run_eagerly: only False (every step is one compiled program; to debug, run under
            `jax.disable_jit()`).
          steps_per_execution: run this many steps in one compiled call, in fit, evaluate
            and predict (callbacks' batch hooks then run once per call, with the first and
            last step's index), as Keras.
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
          UnsupportedArgumentError: run_eagerly=True, jit_compile=False; under
            `shard_optimizer_state=True`, steps_per_execution > 1 or dynamic loss scaling.
          MixedStrategyError: compiled under another strategy's scope than the one the model
            was made in.
        """
        keras_hooks.before_compile(self.module, mixed_precision.global_policy())
        self._remember_compile(
            optimizer=optimizer,
            loss=loss,
            loss_weights=loss_weights,
            metrics=metrics,
            weighted_metrics=weighted_metrics,
        )
        done = model_compile.configure(
            self,
            self.module,
            self._scope_strategy,
            self._binding,
            optimizer,
            loss,
            loss_weights,
            metrics,
            weighted_metrics,
            run_eagerly,
            steps_per_execution,
            jit_compile,
            auto_scale_loss,
            gradient_accumulation_steps,
        )
        self.distribute_strategy = done.strategy
        if self._scope_strategy is not None:  # it may have moved off one that was shut down
            self._scope_strategy = done.strategy
        self.steps_per_execution = done.steps_per_execution
        self.gradient_accumulation_steps = done.gradient_accumulation_steps
        self.optimizer, self.loss, self.metrics = done.optimizer, done.loss, done.metrics
        self.dtype_policy = done.dtype_policy
        self._compiled = done.compiled

    def _check_compiled(self, what: str):
        if not self._compiled:
            raise errors.NotCompiledError(
                f"{what}: the model is not compiled. Call model.compile(optimizer=..., loss=...) first."
            )
        self._check_scope(what)

    def _check_scope(self, what: str):
        strategy = strategy_checks.check_model_scope(what, self.distribute_strategy)
        if strategy is not self.distribute_strategy:  # moved off a strategy that was shut down
            self.distribute_strategy = self._scope_strategy = strategy
        keras_hooks.read_keras_writes(self.module)  # writes to model.keras_model count

    # -- fit -------------------------------------------------------------------------------------

    def fit(
        self,
        x=None,
        y=None,
        batch_size=None,
        epochs: int = 1,
        verbose="auto",
        callbacks=None,
        validation_split: float = 0.0,
        validation_data=None,
        shuffle: bool = True,
        class_weight=None,
        sample_weight=None,
        initial_epoch: int = 0,
        steps_per_epoch=None,
        validation_steps=None,
        validation_batch_size=None,
        validation_freq: int = 1,
    ):
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
          sample_weight: per-example weights of shape (N,) (several outputs: one per output).
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
          UnsupportedArgumentError: class_weight with a distributed dataset or several outputs.

        Under a ParameterServerStrategy each step runs on a free worker: x is arrays or a
        dataset function, steps_per_epoch is required (docs/parameter_server.md, "fit").
        """
        self._check_compiled("fit")
        keras_hooks.before_fit(self.module)
        args = FitArguments.checked(
            self._compiled,
            x=x,
            y=y,
            batch_size=batch_size,
            epochs=epochs,
            verbose=verbose,
            callbacks=callbacks,
            validation_split=validation_split,
            validation_data=validation_data,
            shuffle=shuffle,
            class_weight=class_weight,
            sample_weight=sample_weight,
            initial_epoch=initial_epoch,
            steps_per_epoch=steps_per_epoch,
            validation_steps=validation_steps,
            validation_batch_size=validation_batch_size,
            validation_freq=validation_freq,
        )
        try:
            return loops.fit(self, self._compiled, args)
        finally:
            if isinstance(self.module, keras_models.KerasModule):
                self.module.write_to_keras()

    # -- evaluate / predict ----------------------------------------------------------------------

    def evaluate(
        self,
        x=None,
        y=None,
        batch_size=None,
        verbose="auto",
        sample_weight=None,
        steps=None,
        callbacks=None,
        return_dict: bool = False,
    ):
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
        return loops.evaluate(
            self, self._compiled, x, y, batch_size, verbose, sample_weight, steps, callbacks, return_dict
        )

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
        self._check_scope("predict")
        strategy = self.distribute_strategy or self._scope_strategy or get_strategy()
        compiled = self._compiled
        step_fn = (
            (self._uncompiled_predict_fn, 1, self._uncompiled_checked)
            if compiled is None
            else (compiled.predict_fn, self.steps_per_execution, compiled.checked_inputs)
        )
        return loops.predict(self, strategy, step_fn, x, batch_size, verbose, steps, callbacks)

    # -- one batch (Keras's *_on_batch; more in batch_calls.BatchCalls) ---------------------------

    def predict_on_batch(self, x):
        """The module's outputs for one batch of arrays, as NumPy (`keras.Model.predict_on_batch`)."""
        return self.predict(x, batch_size=batch_calls.one_batch_size("predict_on_batch", x), verbose=0)


def train_call(model: Model, what: str) -> tuple:
    """`fit`'s step as (fn, objects), for `strategy.run(fn, args=objects + (batch,))` on other
    strategies (the scaling report); raises NotCompiledError, naming `what`, before compile."""
    model._check_compiled(what)
    compiled = model._compiled
    assert compiled is not None  # _check_compiled raised otherwise
    return compiled.train_fn, local_executor.train_objects(model, compiled)
