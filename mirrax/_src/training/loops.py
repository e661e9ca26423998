"""The loops of `Model.fit`, `evaluate` and `predict`: ONE epoch/step loop for fit, with its
callbacks, resume point, validation and logs, over an executor chosen in one place
(`executor_of`): this process's (`local_executor`: one process or multi-worker) or the
parameter-server workers' (`parameter_server_executor`)."""

from __future__ import annotations

import collections

import jax
import numpy as np

from mirrax import errors
from mirrax._src import argument_checks, launch_progress
from mirrax._src.distribute import values as values_lib
from mirrax._src.training import callbacks as callbacks_lib
from mirrax._src.training import data_adapter, local_executor, multi_step
from mirrax._src.training import logs as logs_lib
from mirrax._src.training import parameter_server_executor as ps_executor

# predict copies a batch's outputs to the host this many steps after dispatching it.
PREDICT_AHEAD = 32


def executor_of(strategy):
    """The executor class of fit and evaluate on `strategy`: `ParameterServerExecutor` under a
    ParameterServerStrategy, else `LocalExecutor`."""
    if ps_executor.is_parameter_server(strategy):
        return ps_executor.ParameterServerExecutor
    return local_executor.LocalExecutor


def fit(model, compiled, args):
    """`Model.fit` (its docs and errors there) for the checked `FitArguments` `args`.

    The executor runs the steps; this loop calls the callbacks around them, starts at their
    resume point (`CallbackList.fit_start`: BackupAndRestore), validates every
    `validation_freq` epochs and logs, the same for every executor.
    """
    executor = executor_of(model.distribute_strategy)(model, compiled, args)
    epochs = args.epochs
    cbs = callbacks_lib.CallbackList(
        args.callbacks,
        add_history=True,
        add_progbar=args.verbose != 0,
        model=model,
        verbose=args.verbose,
        epochs=epochs,
        steps=executor.steps_per_epoch,
    )
    cbs.set_params(
        dict(cbs.params, metrics=logs_lib.log_keys(model, compiled, executor.validates, cbs.callbacks))
    )
    model.stop_training = False
    executor.begin_epoch()
    # Before on_train_begin, where BackupAndRestore may restore a mid-epoch backup's metrics.
    logs_lib.reset_metrics(model, compiled)
    cbs.on_train_begin()
    # Asked after on_train_begin, which may set a hook on the instance. Reading the logs waits
    # for the step; do it per step only when a callback uses them.
    batch_logs = executor.batch_logs and cbs.needs_batch_logs("on_train_batch_end")
    # The state is carried between steps and written into the model at the epoch's end, or at
    # every step's when a callback's hook or the batch logs need the model (docs/design.md,
    # "Carried state in fit, evaluate and predict").
    executor.carry_state(not (batch_logs or cbs.needs_model_between_batches("train")))
    first_epoch, first_step = cbs.fit_start(args.initial_epoch, epochs, executor.steps_per_epoch)
    epoch_logs: dict = {}
    # Under `mirrax launch`: where fit is, for the launcher to name if this worker dies.
    progress = launch_progress.Progress.from_environment()
    try:
        for epoch in range(first_epoch, epochs):
            step = first_step if epoch == first_epoch else 0
            if step == 0:  # an epoch resumed mid-way goes on with the metrics restored with it
                logs_lib.reset_metrics(model, compiled)
            if progress is not None:
                progress.mark(epoch, -1)
            cbs.on_epoch_begin(epoch)
            executor.begin_epoch()
            trained = 0
            for group in executor.groups(step, prefetch=batch_logs):
                last = step + len(group) - 1
                if progress is not None:
                    progress.mark(epoch, step)
                cbs.on_train_batch_begin(step)
                executor.run(group)
                cbs.on_train_batch_end(last, logs_lib.logs_of(model, compiled) if batch_logs else {})
                step = last + 1
                trained += len(group)
                if model.stop_training:
                    break
            executor.end_epoch()
            if epoch == first_epoch and step == 0 and not model.stop_training:
                raise errors.EmptyDatasetError(
                    f"fit: the training input ({type(args.x).__name__}) yielded no batch in the "
                    "first epoch, so nothing was trained. Check that the dataset is not "
                    "empty (a generator must yield at least one batch, as Keras requires)."
                )
            # An epoch that ran no step has no values to log (not a loss of 0.0).
            epoch_logs = logs_lib.logs_of(model, compiled) if trained else {}
            if executor.validates and (epoch + 1) % args.validation_freq == 0:
                val_logs = executor.validate(cbs)
                epoch_logs.update({f"val_{k}": v for k, v in val_logs.items()})
            if model.optimizer.has_learning_rate:
                epoch_logs["learning_rate"] = model.optimizer.learning_rate
            cbs.on_epoch_end(epoch, epoch_logs)
            if model.stop_training:
                break
    finally:
        executor.close()
    if progress is not None:
        progress.clear()
    executor.end_fit()
    cbs.on_train_end(epoch_logs)
    return model.history


def evaluate(model, compiled, x, y, batch_size, verbose, sample_weight, steps, callbacks, return_dict):
    """`Model.evaluate` (its arguments, docs and errors there), on `executor_of`'s executor."""
    verbose = argument_checks.progress_verbose("evaluate", verbose)
    steps = argument_checks.count("evaluate", "steps", steps, allow_none=True)
    return_dict = argument_checks.flag("evaluate", "return_dict", return_dict)
    logs = executor_of(model.distribute_strategy).evaluate(
        model, compiled, x, y, batch_size, verbose, sample_weight, steps, callbacks
    )
    if return_dict:
        return logs
    values = list(logs.values())
    return values[0] if len(values) == 1 else values


def predict(model, strategy, step_fn, x, batch_size, verbose, steps, callbacks):
    """`Model.predict` (its arguments, docs and errors there) on `strategy`. `step_fn` is
    (predict_fn, steps per call, the input signatures already checked): each call
    `strategy.run`s that many batches (`steps_per_execution`, as Keras)."""
    verbose = argument_checks.progress_verbose("predict", verbose)
    steps = argument_checks.count("predict", "steps", steps, allow_none=True)
    strategy = executor_of(strategy).predict_strategy(strategy)
    predict_fn, per_call, checked = step_fn
    data = data_adapter.ModelInput(
        model, strategy, x, None, None, batch_size, False, "predict", inputs_only=True, checked=checked
    )
    model.module.eval()
    outputs = []
    cbs = local_executor.one_pass_callbacks(
        callbacks, model, verbose, steps if steps is not None else data.steps
    )
    cbs.on_predict_begin()
    # Outputs are copied to the host at the end, so steps queue without a device round
    # trip each, unless a callback reads each batch's outputs or several processes hold
    # them (strategy.gather then replicates them first).
    per_batch = jax.process_count() > 1 or cbs.needs_batch_logs("on_predict_batch_end")
    pending: collections.deque = collections.deque()
    carried = strategy.extended.carried_steps(
        (model.module, None, None, None, None), carry=not cbs.needs_model_between_batches("predict")
    )
    step = 0
    try:
        batches = data.batches(steps, prefetch=local_executor.prefetches(strategy, per_batch))
        for group in multi_step.groups(batches, per_call):
            cbs.on_predict_batch_begin(step)
            outs = local_executor.run_steps(carried, predict_fn, group)
            assert outs is not None  # predict places its batches one by one (never a HostBatch)
            step += len(group)
            if per_batch:
                gathered = [jax.tree.map(np.asarray, strategy.gather(out, axis=0)) for out in outs]
                outputs += gathered
                # As Keras: the outputs of every step of the call, concatenated.
                cbs.on_predict_batch_end(
                    step - 1, {"outputs": gathered[0] if len(gathered) == 1 else concatenate(gathered)}
                )
            else:
                for out in outs:
                    pending.append(out)
                    if len(pending) > PREDICT_AHEAD:  # bounds the device memory held
                        outputs.append(values_lib.gather_to_host(strategy, pending.popleft()))
                cbs.on_predict_batch_end(step - 1, {})
    finally:
        carried.release()
        data.close()
    outputs += [values_lib.gather_to_host(strategy, out) for out in pending]
    if not outputs:
        raise errors.EmptyDatasetError(
            "predict: the input yielded no batch, so there is nothing to predict (Keras "
            "refuses an empty input too). Check that the dataset is not empty."
        )
    local_executor.warn_if_ran_out("predict", "steps", steps, len(outputs))
    cbs.on_predict_end()
    return concatenate(outputs)


def concatenate(outputs: list):
    """The batches' outputs (NumPy pytrees of one structure) joined along the examples, in new
    (writable) arrays."""
    return jax.tree.map(lambda *parts: np.concatenate(parts, axis=0), *outputs)
