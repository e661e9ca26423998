"""`Model.fit`'s executor, `evaluate` and `predict` under a ParameterServerStrategy: each
training step (or `steps_per_execution` steps) is one function scheduled on a free worker,
which reads its own dataset (the loop around them is `loops.fit`, shared with this process's
executor); evaluation batches are dealt out by the coordinator, one group per function,
and every group's metric sums are added once on the coordinator, so each evaluation example
counts exactly once even when a function runs twice (TF's visitation guarantee)."""

from __future__ import annotations

import inspect
import math

import jax
import numpy as np
from flax import nnx

from mirrax import errors
from mirrax._src import argument_checks
from mirrax._src.distribute.current import default_strategy, get_strategy
from mirrax._src.distribute.input_options import InputContext
from mirrax._src.parameter_server.closures import WorkerConstant
from mirrax._src.parameter_server.coordinator import ClusterCoordinator
from mirrax._src.parameter_server.strategy import ParameterServerStrategy
from mirrax._src.training import array_inputs, data_adapter
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


def _train_dataset_fn(model, x, y, sample_weight, batch_size, shuffle, checked_inputs):
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
    # The checks fit makes of arrays under every other strategy, here on the coordinator before
    # any function is scheduled: lengths, empty input, shapes through the model, label range.
    checked = data_adapter.ModelInput(
        model, default_strategy(), x, y, sample_weight, batch_size, shuffle, "fit", checked=checked_inputs
    )
    batch_size, n = checked.batch_size, checked.n
    arrays = tuple(a for a in (checked.x, checked.y, checked.sample_weight) if a is not None)

    def dataset_fn(input_context):
        rng = np.random.default_rng(input_context.input_pipeline_id)
        while True:  # each pass: every example once, the last batch short (as Keras)
            yield from array_inputs.global_batches(
                arrays, batch_size, rng.permutation(n) if shuffle else None
            )

    return dataset_fn


class ParameterServerExecutor:
    """Runs `fit`'s epochs on the workers of a ParameterServerStrategy, for `loops.fit`: each
    call of `steps_per_execution` steps is one function scheduled on a free worker, which
    reads its own dataset (docs/parameter_server.md, "fit").

    Args:
      model: the compiled `mirrax.Model`; compiled: its `CompiledState`.
      args: the `FitArguments`.

    Raises:
      InvalidArgumentError: no steps_per_epoch (as TF: the workers' datasets are endless).
      UnsupportedArgumentError: class_weight, or an x the workers cannot read.
    """

    batch_logs = False  # a batch's logs would wait for its step (docs/parameter_server.md)

    def __init__(self, model, compiled, args):
        if args.steps_per_epoch is None:
            raise errors.InvalidArgumentError(
                "fit under ParameterServerStrategy needs steps_per_epoch (as TF): the workers "
                "read their own endless datasets, so an epoch is a number of steps. Pass e.g. "
                "steps_per_epoch=len(x_train) // global_batch_size."
            )
        if args.class_weight is not None:
            raise errors.UnsupportedArgumentError(
                "fit: class_weight is not supported under ParameterServerStrategy; pass "
                "per-example sample weights in the batches instead."
            )
        self.model, self.compiled, self.args = model, compiled, args
        dataset_fn = _train_dataset_fn(
            model, args.x, args.y, args.sample_weight, args.batch_size, args.shuffle, compiled.checked_inputs
        )
        self.coordinator = ClusterCoordinator(model.distribute_strategy)
        self.iterator = iter(self.coordinator.create_per_worker_dataset(dataset_fn))
        self.steps = Steps(model, compiled)
        self.steps_per_epoch = args.steps_per_epoch
        self.validates = args.validation_data is not None

    def begin_epoch(self) -> None:
        """Before an epoch: nothing here (each worker's function sets training mode)."""

    def groups(self, first_step: int, prefetch: bool):
        """The epoch's calls from step `first_step` on, as ranges of step indices."""
        del prefetch  # each worker reads its own dataset
        per_call, total = self.model.steps_per_execution, self.steps_per_epoch
        return (range(first, min(first + per_call, total)) for first in range(first_step, total, per_call))

    def run(self, group: range) -> None:
        """Schedules `len(group)` steps as one function on a free worker (returns at once)."""
        self.coordinator.schedule(self.steps.train, args=(self.iterator, len(group)))

    def carry_state(self, carry: bool) -> None:
        """Nothing to choose: the parameter servers hold the state."""

    def end_epoch(self) -> None:
        """Waits for every scheduled function (TF's `coordinator.join()` at epoch boundaries)."""
        self.coordinator.join()

    def validate(self, cbs) -> dict:
        """The validation data evaluated on the workers (on_test_* hooks of `cbs`); its logs."""
        vx, vy, vw = self.args.validation_arrays()
        batches = _evaluation_batches(
            vx, vy, vw, self.args.validation_batch(), self.args.validation_steps, "fit(validation_data=...)"
        )
        return evaluate_loop(self.model, self.compiled, self.steps, batches, cbs)

    def close(self) -> None:
        """Ends fit (done or raised): the scheduled functions stay the coordinator's."""

    def end_fit(self) -> None:
        """After fit's last epoch: nothing here (the workers hold their own mode)."""

    @staticmethod
    def predict_strategy(strategy):
        """Where `predict` runs under a ParameterServerStrategy: on the coordinator's device, with
        the parameter servers' current values (read into the model first)."""
        coordinator = strategy.extended.coordinator
        if coordinator is not None:
            coordinator.join()
        strategy.extended.variable_store.refresh()
        return default_strategy()

    @staticmethod
    def evaluate(model, compiled, x, y, batch_size, verbose, sample_weight, steps, callbacks) -> dict:
        """`Model.evaluate`'s logs on the workers (the arguments checked by `loops.evaluate`)."""
        x, y, sample_weight = (array_inputs.as_arrays(v) for v in (x, y, sample_weight))
        batches = _evaluation_batches(x, y, sample_weight, batch_size, steps, "evaluate")
        cbs = callbacks_lib.CallbackList(
            callbacks, add_progbar=verbose != 0, model=model, verbose=verbose, epochs=1, steps=len(batches)
        )
        return evaluate_loop(model, compiled, Steps(model, compiled), batches, cbs)


def _evaluation_batches(x, y, sample_weight, batch_size, steps, what) -> list:
    if array_inputs.is_arrays(x):
        batch_size = 32 if batch_size is None else argument_checks.count(what, "batch_size", batch_size)
        arrays = tuple(a for a in (x, y, sample_weight) if a is not None)
        batches = list(array_inputs.global_batches(arrays, batch_size))
    else:
        if y is not None:
            raise errors.InvalidArgumentError(f"{what}: y must be None when x is a dataset.")
        if callable(x):  # a dataset function, as fit takes: read here, on the coordinator
            if steps is None:
                x_name, steps_name = (
                    ("validation_data", "validation_steps") if what.startswith("fit") else ("x", "steps")
                )
                raise errors.InvalidArgumentError(
                    f"{what}: with a dataset function as {x_name}, pass {steps_name}= (its dataset "
                    "may be endless); or pass the batches (a list, a dataset) themselves."
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


def evaluate_loop(model, compiled, steps, batches: list, cbs) -> dict:
    """Evaluates `batches` on the workers: dealt out in groups, each group's metric sums added
    once into the coordinator's loss tracker and metrics. The test-batch hooks of `cbs` (the
    progress bar among them) are called once per group, in order, with the logs of the
    batches so far: `on_test_batch_begin(first)` and `on_test_batch_end(last, logs)`."""
    coordinator = ClusterCoordinator(model.distribute_strategy)
    workers = len(model.distribute_strategy.extended.cluster.workers)
    size = max(1, math.ceil(len(batches) / (workers * _EVALUATION_GROUPS_PER_WORKER)))
    cbs.on_test_begin()
    starts = range(0, len(batches), size)
    results = [coordinator.schedule(steps.evaluate, args=(batches[i : i + size],)) for i in starts]
    totals, logs = None, {}
    accumulators = _accumulators(compiled, model)
    for first, result in zip(starts, results):
        cbs.on_test_batch_begin(first)
        sums = result.fetch()
        # Copies: the arrays Ray hands over are read-only, and the metrics' sums are written
        # in place later (reset_metrics).
        totals = jax.tree.map(np.array, sums) if totals is None else jax.tree.map(np.add, totals, sums)
        nnx.replace_by_pure_dict(accumulators, totals)
        nnx.update((compiled.tracker, model.metrics), accumulators)
        logs = logs_lib.logs_of(model, compiled)
        cbs.on_test_batch_end(min(first + size, len(batches)) - 1, logs)
    cbs.on_test_end(logs)
    return logs
