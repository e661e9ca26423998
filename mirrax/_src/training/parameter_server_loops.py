"""`Model.fit`, `evaluate` and `predict` under a ParameterServerStrategy: each training step
(or `steps_per_execution` steps) is one function scheduled on a free worker, which reads its
own dataset; evaluation batches are dealt out by the coordinator, one group per function,
and every group's metric sums are added once on the coordinator, so each evaluation example
counts exactly once even when a function runs twice (TF's visitation guarantee)."""

from __future__ import annotations

import inspect
import math

import jax
import numpy as np
from flax import nnx

from mirrax import errors
from mirrax._src.distribute.current import default_strategy, get_strategy
from mirrax._src.distribute.input_options import InputContext
from mirrax._src.parameter_server.closures import WorkerConstant
from mirrax._src.parameter_server.coordinator import ClusterCoordinator
from mirrax._src.parameter_server.strategy import ParameterServerStrategy
from mirrax._src.training import arguments as checks
from mirrax._src.training import array_inputs
from mirrax._src.training import callbacks as callbacks_lib
from mirrax._src.training import logs as logs_lib

# Evaluation functions per worker: enough that a slow or restarted worker delays little.
_EVALUATION_GROUPS_PER_WORKER = 4


def is_parameter_server(strategy) -> bool:
    """True when `strategy` is a ParameterServerStrategy (its fit / evaluate are these)."""
    return isinstance(strategy, ParameterServerStrategy)


def _accumulators(compiled, model):
    """The loss tracker's and the metrics' sums and counts (all `MetricState`s)."""
    return nnx.state((compiled.tracker, model.metrics), nnx.metrics.MetricState)


class Steps(WorkerConstant):
    """A compiled model's steps as the workers run them (sent to each worker once)."""

    def __init__(self, model, compiled):
        self.model = model
        self.compiled = compiled

    def _objects(self):
        m, c = self.model, self.compiled
        return m.module, m.optimizer.nnx_optimizer, m.metrics, c.tracker, c.dynamic_scale

    def train(self, iterator, steps: int) -> None:
        """`steps` training steps on this worker's next batches (pushed when they end)."""
        strategy = get_strategy()
        self.model.module.train()
        for _ in range(steps):
            strategy.run(self.compiled.train_fn, args=self._objects() + (next(iterator),))

    def evaluate(self, batches: list):
        """The metric sums of `batches` (global batches), returned, not pushed: the held
        accumulators are put back as pulled, so the worker pushes no change."""
        strategy = get_strategy()
        module, _, metrics, tracker, _ = self._objects()
        pulled = jax.tree.map(lambda a: a, nnx.state((tracker, metrics)))
        tracker.reset()
        for metric in metrics:
            metric.reset_state()
        module.eval()
        for batch in strategy.experimental_distribute_dataset(batches):
            strategy.run(self.compiled.test_fn, args=(module, None, metrics, tracker, None, batch))
        sums = jax.device_get(nnx.to_pure_dict(_accumulators(self.compiled, self.model)))
        nnx.update((tracker, metrics), pulled)
        module.train()
        return sums


def _train_dataset_fn(model, x, y, sample_weight, batch_size, shuffle):
    """The per-worker dataset of fit: `x` itself when it is a dataset function, else endless
    (reshuffled) global batches of the arrays, a different order on each worker."""
    if callable(x) and not array_inputs.is_arrays(x):
        if y is not None or batch_size is not None:
            raise errors.InvalidArgumentError(
                "fit: with a dataset function as x (ParameterServerStrategy), y and batch_size "
                f"must be None (the function returns (x, y) batches); received y={type(y).__name__}"
                f", batch_size={batch_size!r}."
            )
        return x
    if not array_inputs.is_arrays(x):
        raise errors.UnsupportedArgumentError(
            "fit under ParameterServerStrategy takes NumPy arrays (x, y, batch_size) or a "
            "dataset function (called on every worker, as TF's DatasetCreator: "
            "`def dataset_fn(input_context): ... return batches`); received a "
            f"{type(x).__name__}, which cannot be read on the workers."
        )
    batch_size = 32 if batch_size is None else checks.check_count("fit", "batch_size", batch_size)
    arrays = tuple(a for a in (x, y, sample_weight) if a is not None)
    n = array_inputs.num_examples(arrays[0])
    if n == 0:
        raise errors.EmptyDatasetError("fit: x holds no example, so there is nothing to train on.")

    def dataset_fn(input_context):
        rng = np.random.default_rng(input_context.input_pipeline_id)
        while True:  # each pass: every example once, the last batch short (as Keras)
            order = rng.permutation(n) if shuffle else np.arange(n)
            for start in range(0, n, batch_size):
                rows = order[start : start + batch_size]
                yield tuple(jax.tree.map(lambda a, rows=rows: a[rows], arrays))

    return dataset_fn


def fit(
    model,
    compiled,
    x,
    y,
    batch_size,
    epochs,
    verbose,
    callbacks,
    validation_split,
    validation_data,
    shuffle,
    class_weight,
    sample_weight,
    initial_epoch,
    steps_per_epoch,
    validation_steps,
    validation_batch_size,
    validation_freq,
):
    """`Model.fit` under a ParameterServerStrategy (docs/parameter_server.md, "fit")."""
    if steps_per_epoch is None:
        raise errors.InvalidArgumentError(
            "fit under ParameterServerStrategy needs steps_per_epoch (as TF): the workers read "
            "their own endless datasets, so an epoch is a number of steps. Pass e.g. "
            "steps_per_epoch=len(x_train) // global_batch_size."
        )
    steps_per_epoch = checks.check_count("fit", "steps_per_epoch", steps_per_epoch)
    epochs, initial_epoch, verbose, shuffle = checks.check_fit_counts(epochs, initial_epoch, verbose, shuffle)
    validation_freq = checks.check_count("fit", "validation_freq", validation_freq)
    validation_split = checks.check_fraction("fit", "validation_split", validation_split)
    if class_weight is not None:
        raise errors.UnsupportedArgumentError(
            "fit: class_weight is not supported under ParameterServerStrategy; pass "
            "per-example sample weights in the batches instead."
        )
    x, y, sample_weight = (array_inputs.as_arrays(v) for v in (x, y, sample_weight))
    if validation_split and validation_data is None:
        if not array_inputs.is_arrays(x):
            raise errors.InvalidArgumentError(
                "fit: validation_split needs NumPy array inputs; pass validation_data= instead."
            )
        x, y, sample_weight, validation_data = array_inputs.split_validation(
            x, y, sample_weight, validation_split
        )
    coordinator = ClusterCoordinator(model.distribute_strategy)
    iterator = iter(
        coordinator.create_per_worker_dataset(
            _train_dataset_fn(model, x, y, sample_weight, batch_size, shuffle)
        )
    )
    steps = Steps(model, compiled)
    cbs = callbacks_lib.CallbackList(
        callbacks,
        add_history=True,
        add_progbar=verbose != 0,
        model=model,
        verbose=verbose,
        epochs=epochs,
        steps=steps_per_epoch,
    )
    cbs.set_params(
        dict(
            cbs.params, metrics=logs_lib.log_keys(model, compiled, validation_data is not None, cbs.callbacks)
        )
    )
    model.stop_training = False
    cbs.on_train_begin()
    first_epoch, first_step = cbs.fit_start(initial_epoch, epochs, steps_per_epoch)
    epoch_logs: dict = {}
    per_call = model.steps_per_execution
    for epoch in range(first_epoch, epochs):
        logs_lib.reset_metrics(model, compiled)
        cbs.on_epoch_begin(epoch)
        for first in range(first_step if epoch == first_epoch else 0, steps_per_epoch, per_call):
            count = min(per_call, steps_per_epoch - first)
            cbs.on_train_batch_begin(first)
            coordinator.schedule(steps.train, args=(iterator, count))
            # Batch logs would wait for the step; the hooks get none (docs/parameter_server.md).
            cbs.on_train_batch_end(first + count - 1, {})
            if model.stop_training:
                break
        coordinator.join()
        epoch_logs = logs_lib.logs_of(model, compiled)
        if validation_data is not None and (epoch + 1) % validation_freq == 0:
            vx, vy, vw = (array_inputs.as_arrays(v) for v in array_inputs.unpack_validation(validation_data))
            vbatch = validation_batch_size if validation_batch_size is not None else batch_size
            val_logs = evaluate_loop(
                model, compiled, steps, vx, vy, vw, vbatch, validation_steps, cbs, "fit(validation_data=...)"
            )
            epoch_logs.update({f"val_{k}": v for k, v in val_logs.items()})
        if model.optimizer.has_learning_rate:
            epoch_logs["learning_rate"] = model.optimizer.learning_rate
        cbs.on_epoch_end(epoch, epoch_logs)
        if model.stop_training:
            break
    cbs.on_train_end(epoch_logs)
    return model.history


def _evaluation_batches(x, y, sample_weight, batch_size, steps, what) -> list:
    if array_inputs.is_arrays(x):
        batch_size = 32 if batch_size is None else checks.check_count(what, "batch_size", batch_size)
        arrays = tuple(a for a in (x, y, sample_weight) if a is not None)
        n = array_inputs.num_examples(arrays[0])
        batches = [
            tuple(jax.tree.map(lambda a, i=i: a[i : i + batch_size], arrays)) for i in range(0, n, batch_size)
        ]
    else:
        if y is not None:
            raise errors.InvalidArgumentError(f"{what}: y must be None when x is a dataset.")
        if callable(x):  # a dataset function, as fit takes: read here, on the coordinator
            if steps is None:
                raise errors.InvalidArgumentError(
                    f"{what}: with a dataset function as x, pass steps= (its dataset may be "
                    "endless); or pass the batches (a list, a dataset) themselves."
                )
            x = x(InputContext()) if _takes_argument(x) else x()
        batches = []
        for batch in x:
            batches.append(tuple(batch) if isinstance(batch, list) else batch)
            if steps is not None and len(batches) == steps:
                break
    batches = batches[:steps] if steps is not None else batches
    if not batches:
        raise errors.EmptyDatasetError(
            f"{what}: the input yielded no batch, so there is nothing to evaluate."
        )
    return batches


def _takes_argument(fn) -> bool:
    try:
        return len(inspect.signature(fn).parameters) >= 1
    except (TypeError, ValueError):
        return False


def evaluate_loop(model, compiled, steps, x, y, sample_weight, batch_size, max_steps, cbs, what) -> dict:
    """Evaluates on the workers: the batches dealt out in groups, each group's metric sums
    added once into the coordinator's loss tracker and metrics."""
    coordinator = ClusterCoordinator(model.distribute_strategy)
    batches = _evaluation_batches(x, y, sample_weight, batch_size, max_steps, what)
    workers = len(model.distribute_strategy.extended.cluster.workers)
    size = max(1, math.ceil(len(batches) / (workers * _EVALUATION_GROUPS_PER_WORKER)))
    cbs.on_test_begin()
    results = [
        coordinator.schedule(steps.evaluate, args=(batches[i : i + size],))
        for i in range(0, len(batches), size)
    ]
    totals = None
    for result in results:
        sums = result.fetch()
        totals = sums if totals is None else jax.tree.map(np.add, totals, sums)
    accumulators = _accumulators(compiled, model)
    nnx.replace_by_pure_dict(accumulators, totals)
    nnx.update((compiled.tracker, model.metrics), accumulators)
    logs = logs_lib.logs_of(model, compiled)
    cbs.on_test_end(logs)
    return logs


def evaluate(model, compiled, x, y, batch_size, verbose, sample_weight, steps, callbacks, return_dict):
    """`Model.evaluate` under a ParameterServerStrategy."""
    verbose = checks.check_verbose("evaluate", verbose)
    steps = checks.check_count("evaluate", "steps", steps, allow_none=True)
    return_dict = checks.check_bool("evaluate", "return_dict", return_dict)
    x, y, sample_weight = (array_inputs.as_arrays(v) for v in (x, y, sample_weight))
    cbs = callbacks_lib.CallbackList(
        callbacks, add_progbar=False, model=model, verbose=verbose, epochs=1, steps=steps
    )
    logs = evaluate_loop(
        model, compiled, Steps(model, compiled), x, y, sample_weight, batch_size, steps, cbs, "evaluate"
    )
    if return_dict:
        return logs
    values = list(logs.values())
    return values[0] if len(values) == 1 else values


def predict_strategy(strategy):
    """Where `predict` runs under a ParameterServerStrategy: on the coordinator's device, with
    the parameter servers' current values (read into the model first)."""
    coordinator = strategy.extended.coordinator
    if coordinator is not None:
        coordinator.join()
    strategy.extended.variable_store.refresh()
    return default_strategy()
