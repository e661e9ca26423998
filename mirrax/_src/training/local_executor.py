"""fit's and evaluate's steps in this process (one process, or each process of a
MultiWorkerMirroredStrategy): the inputs read by `data_adapter.ModelInput`, k consecutive
batches per `strategy.run` (`steps_per_execution`), and Keras's warnings for inputs that run
out. The loop around them is `loops.fit`, shared with the parameter-server executor."""

from __future__ import annotations

import itertools
import operator
import warnings

import jax

from mirrax import errors
from mirrax._src.distribute import batching
from mirrax._src.distribute import values as values_lib
from mirrax._src.distribute.values import PerReplica
from mirrax._src.training import array_inputs, data_adapter, multi_step
from mirrax._src.training import callbacks as callbacks_lib
from mirrax._src.training import logs as logs_lib


class LocalExecutor:
    """Runs `fit`'s epochs in this process, for `loops.fit` (docs/design.md, "One fit loop").

    Args:
      model: the compiled `mirrax.Model`; compiled: its `CompiledState`.
      args: the `FitArguments`.

    Raises:
      InvalidArgumentError: steps_per_epoch above the batches of a sized input, or
        inconsistent inputs (`data_adapter.ModelInput`).
      EmptyDatasetError: a generator that a later epoch would find exhausted.
    """

    batch_logs = True  # each call's logs can be read for on_train_batch_end

    def __init__(self, model, compiled, args):
        self.model, self.compiled, self.args = model, compiled, args
        strategy = model.distribute_strategy
        self.train = data_adapter.ModelInput(
            model,
            strategy,
            args.x,
            args.y,
            args.sample_weight,
            args.batch_size,
            args.shuffle,
            "fit",
            class_weight=args.class_weight,
            rng=compiled.rng,
            checked=compiled.checked_inputs,
        )
        known = self.train.steps
        if args.steps_per_epoch is not None and known is not None and args.steps_per_epoch > known:
            raise errors.InvalidArgumentError(
                f"fit: steps_per_epoch={args.steps_per_epoch} but the input holds {known} "
                f'batch(es) per pass, so every epoch would run out of data (Keras warns "Your '
                'input ran out of data" and trains short epochs). Pass steps_per_epoch <= '
                f"{known}, or omit it for one pass per epoch."
            )
        self.val = None
        if args.validation_data is not None:
            vx, vy, vw = args.validation_arrays()
            self.val = data_adapter.ModelInput(
                model,
                strategy,
                vx,
                vy,
                vw,
                args.validation_batch() if array_inputs.is_arrays(vx) else None,
                False,
                "fit(validation_data=...)",
                checked=compiled.checked_inputs,
            )
        check_generators_last(
            self.train,
            args.steps_per_epoch,
            self.val,
            args.validation_steps,
            range(args.initial_epoch, args.epochs),
            args.validation_freq,
        )
        self.steps_per_epoch = args.steps_per_epoch if args.steps_per_epoch is not None else known
        self.validates = self.val is not None
        self.carried = None  # the training step's CarriedSteps, made at the first call
        self.carry = True  # whether it carries the state between calls (`carry_state`)

    def begin_epoch(self) -> None:
        """Before an epoch's first step (and before fit's first callback): training mode."""
        self.model.module.train()

    def groups(self, first_step: int, prefetch: bool):
        """The epoch's calls from batch `first_step` on: lists of consecutive batches, each
        one `strategy.run` (`steps_per_execution`; the last may be shorter)."""
        batches = self.train.epoch_batches(self.args.steps_per_epoch, prefetch, deferred(self.model))
        return multi_step.groups(itertools.islice(batches, first_step, None), self.model.steps_per_execution)

    def run(self, group: list) -> None:
        """One call: the training step on each batch of `group`, the model's state carried
        (`release` writes it into the model)."""
        objects = train_objects(self.model, self.compiled)
        self.carried = carried_for(self.model.distribute_strategy, self.carried, objects, self.carry)
        run_steps(self.carried, self.compiled.train_fn, group)

    def carry_state(self, carry: bool) -> None:
        """Whether the state is carried between calls (False: written back after every call,
        when a callback's batch hook or the batch logs need the model after each)."""
        self.carry = carry

    def release(self) -> None:
        """Writes the carried state into the model (before anything else reads or changes it)."""
        if self.carried is not None:
            self.carried.release()

    def end_epoch(self) -> None:
        """After an epoch's last call: the carried state written into the model (nothing
        waits here: the logs read the values)."""
        self.release()

    def validate(self, cbs) -> dict:
        """One pass of the validation data (on_test_* hooks of `cbs`); its logs."""
        logs = evaluate_loop(
            self.model, self.compiled, self.val, self.args.validation_steps, cbs, "fit(validation_data=...)"
        )
        self.model.module.train()
        return logs

    def close(self) -> None:
        """Ends fit (done or raised): the model holds the last completed step's state and the
        training input's prefetch stops."""
        try:
            self.release()
        finally:
            self.train.close()

    def end_fit(self) -> None:
        """After fit's last epoch: inference mode, as Keras leaves the model."""
        self.model.module.eval()

    @staticmethod
    def predict_strategy(strategy):
        """Where `predict` runs: on `strategy` itself."""
        return strategy

    @staticmethod
    def evaluate(model, compiled, x, y, batch_size, verbose, sample_weight, steps, callbacks) -> dict:
        """`Model.evaluate`'s logs, in this process (the arguments checked by `loops.evaluate`)."""
        data = data_adapter.ModelInput(
            model,
            model.distribute_strategy,
            x,
            y,
            sample_weight,
            batch_size,
            False,
            "evaluate",
            checked=compiled.checked_inputs,
        )
        cbs = one_pass_callbacks(callbacks, model, verbose, steps if steps is not None else data.steps)
        try:
            return evaluate_loop(model, compiled, data, steps, cbs, "evaluate")
        finally:
            data.close()


def one_pass_callbacks(callbacks, model, verbose: int, steps) -> callbacks_lib.CallbackList:
    """The `CallbackList` of one pass over an input (evaluate, predict): a progress bar unless
    `verbose` is 0, over `steps` batches (None: not known)."""
    return callbacks_lib.CallbackList(
        callbacks, add_progbar=verbose != 0, model=model, verbose=verbose, epochs=1, steps=steps
    )


def warn_if_ran_out(what: str, name: str, steps, count: int) -> None:
    """Keras's warning when an input holds fewer batches than `steps` asked for."""
    if steps is not None and count < steps:
        warnings.warn(
            f"Your input ran out of data; interrupting {what} after {count} batch(es) of "
            f"{name}={steps}. Make sure that your dataset or generator can generate at least "
            f"{steps} batches.",
            stacklevel=3,
        )


def check_generators_last(train, steps_per_epoch, val, validation_steps, epochs, validation_freq) -> None:
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
        (val, validation_steps, validations, "validation_data", "validation_steps"),
    ):
        if data is not None and data.one_shot and steps is None and passes > 1:
            raise errors.EmptyDatasetError(
                f"fit: {what} is a generator (read once across all epochs), and it would be read "
                f"{passes} times without {name}: the second pass would find it exhausted. Pass "
                f"an endless generator with {name}=<batches per pass>, or a re-iterable "
                "dataset (a list of batches, a Grain dataset, a DataLoader)."
            )


def prefetches(strategy, waits: bool) -> bool:
    """Whether a pass's array batches are made in a background thread: when the loop waits for
    every step (`waits`: it reads each step's logs or outputs), or the batch is placed on
    several devices, whose placement costs the host more than the thread's hand-off. On one
    device, with steps running ahead, cutting the batch in the loop's own thread was faster
    (predict of a 784-256-256-10 MLP at batch 128, 1 device: 1.05 against 1.15 with the thread;
    4 devices: 1.23-1.29 without it, 1.15 with; BENCHMARKS.md, "Carried state")."""
    return waits or len(strategy.extended.replica_devices.local_devices) > 1


def deferred(model) -> bool:
    """Whether fit's and evaluate's array batches are placed k at once (`batching.HostBatch`):
    `steps_per_execution` > 1, outside replica-invariant mode (which runs its k unrolled)."""
    return model.steps_per_execution > 1 and not model.distribute_strategy.replica_invariant


def carried_for(strategy, carried, objects: tuple, carry: bool = True):
    """`carried` if it steps `objects` (the same objects, by identity), else a new
    `CarriedSteps` of `objects` on `strategy` (`carried` released first); `carry`: as
    `carried_steps`."""
    if carried is not None:
        if len(carried.objects) == len(objects) and all(map(operator.is_, carried.objects, objects)):
            return carried
        carried.release()
    return strategy.extended.carried_steps(objects, carry)


def run_steps(carried, step_fn, group: list) -> tuple | None:
    """Runs the consecutive batches `group` as ONE step of `carried` (a `CarriedSteps`):
    `step_fn(*objects, batch)` for one batch, else its `multi_step_of` with each batch's mask
    (`steps_per_execution`). Returns each batch's result; its `PerReplica` values carry that
    batch's rows (mask and lengths: `run` gives every output the first batch's, and the last
    batch may be partial). A group of `HostBatch`es placed as one (`batching.place_group`)
    runs stacked and returns None (fit and evaluate, which read no step's result)."""
    stacked = batching.place_group(group)
    if stacked is not None:
        carried.run(multi_step.multi_step_of(step_fn, stacked=True), stacked)
        return None
    group = [b.place() if isinstance(b, batching.HostBatch) else b for b in group]
    if len(group) == 1:
        return (carried.run(step_fn, group[0]),)
    strategy = carried.strategy
    masks = tuple(PerReplica(strategy, multi_step.mask_of(b)) for b in group)
    results = carried.run(multi_step.multi_step_of(step_fn), tuple(group), masks)
    return tuple(_with_rows_of(strategy, result, batch) for result, batch in zip(results, group))


def _with_rows_of(strategy, result, batch):
    rows = next(
        leaf
        for leaf in jax.tree.leaves(batch, is_leaf=values_lib.is_distributed)
        if isinstance(leaf, PerReplica)
    )
    return jax.tree.map(
        lambda v: (
            PerReplica(strategy, v.stacked, rows.mask, rows.lengths) if isinstance(v, PerReplica) else v
        ),
        result,
        is_leaf=values_lib.is_distributed,
    )


def train_objects(model, compiled) -> tuple:
    """The NNX objects `compiled.train_fn` takes before the batch: (module, nnx.Optimizer,
    metrics, loss tracker, float16 loss scale or None)."""
    return (
        model.module,
        model.optimizer.nnx_optimizer,
        model.metrics,
        compiled.tracker,
        compiled.dynamic_scale,
    )


def evaluate_loop(model, compiled, data, steps, cbs, what):
    """Runs the test step over `data`, calling the on_test_* hooks of the `CallbackList`; the
    state carried between batches unless a callback's hook needs the model."""
    strategy = model.distribute_strategy
    logs_lib.reset_metrics(model, compiled)
    model.module.eval()
    cbs.on_test_begin()
    batch_logs = cbs.needs_batch_logs("on_test_batch_end")
    carried = strategy.extended.carried_steps(
        (model.module, None, model.metrics, compiled.tracker, None),
        carry=not (batch_logs or cbs.needs_model_between_batches("test")),
    )
    count = 0
    batches = data.batches(steps, prefetch=prefetches(strategy, batch_logs), defer=deferred(model))
    try:
        for group in multi_step.groups(batches, model.steps_per_execution):
            cbs.on_test_batch_begin(count)
            run_steps(carried, compiled.test_fn, group)
            count += len(group)
            cbs.on_test_batch_end(count - 1, logs_lib.logs_of(model, compiled) if batch_logs else {})
    finally:
        carried.release()
    if count == 0:
        raise errors.EmptyDatasetError(
            f"{what}: the input yielded no batch, so there is nothing to evaluate (Keras "
            "refuses an empty input too). Check that the dataset is not empty."
        )
    warn_if_ran_out(what, "steps", steps, count)
    logs = logs_lib.logs_of(model, compiled)
    cbs.on_test_end(logs)
    return logs
