"""The loops of `Model.fit`, `evaluate`, `predict` and the `*_on_batch` calls: each step one
`strategy.run` of the compiled step, the callbacks around it, the logs read from the loss
tracker and metrics, and Keras's warnings for inputs that run out."""

from __future__ import annotations

import collections
import itertools
import warnings

import jax
import numpy as np

from mirrax import errors
from mirrax._src.distribute import values as values_lib
from mirrax._src.distribute.values import PerReplica
from mirrax._src.training import arguments as checks
from mirrax._src.training import array_inputs, data_adapter, multi_step
from mirrax._src.training import callbacks as callbacks_lib
from mirrax._src.training import logs as logs_lib


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


# predict copies a batch's outputs to the host this many steps after dispatching it.
PREDICT_AHEAD = 32


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
    """`Model.fit` (its arguments, docs and errors there)."""
    epochs, initial_epoch, verbose, shuffle = checks.check_fit_counts(epochs, initial_epoch, verbose, shuffle)
    steps_per_epoch = checks.check_count("fit", "steps_per_epoch", steps_per_epoch, allow_none=True)
    validation_steps = checks.check_count("fit", "validation_steps", validation_steps, allow_none=True)
    validation_freq = checks.check_count("fit", "validation_freq", validation_freq)
    validation_split = checks.check_fraction("fit", "validation_split", validation_split)
    class_weight = class_weight_of(compiled, "fit", class_weight, sample_weight)
    x, y, sample_weight = (array_inputs.as_arrays(v) for v in (x, y, sample_weight))
    strategy = model.distribute_strategy
    if validation_split and validation_data is None:
        if not array_inputs.is_arrays(x):
            raise errors.InvalidArgumentError(
                "fit: validation_split is only supported for NumPy array inputs (it takes "
                f"the last {validation_split:.0%} of the arrays); received a "
                f"{type(x).__name__}. Pass validation_data= instead."
            )
        x, y, sample_weight, validation_data = array_inputs.split_validation(
            x, y, sample_weight, validation_split
        )
    train = data_adapter.ModelInput(
        model,
        strategy,
        x,
        y,
        sample_weight,
        batch_size,
        shuffle,
        "fit",
        class_weight=class_weight,
        rng=compiled.rng,
        checked=compiled.checked_inputs,
    )
    if steps_per_epoch is not None and train.steps is not None and steps_per_epoch > train.steps:
        raise errors.InvalidArgumentError(
            f"fit: steps_per_epoch={steps_per_epoch} but the input holds {train.steps} "
            f'batch(es) per pass, so every epoch would run out of data (Keras warns "Your '
            'input ran out of data" and trains short epochs). Pass steps_per_epoch <= '
            f"{train.steps}, or omit it for one pass per epoch."
        )
    val = None
    if validation_data is not None:
        vx, vy, vw = (array_inputs.as_arrays(v) for v in array_inputs.unpack_validation(validation_data))
        vbatch = validation_batch_size if validation_batch_size is not None else batch_size
        val = data_adapter.ModelInput(
            model,
            strategy,
            vx,
            vy,
            vw,
            vbatch if array_inputs.is_arrays(vx) else None,
            False,
            "fit(validation_data=...)",
            checked=compiled.checked_inputs,
        )
    elif validation_batch_size is not None:
        raise errors.InvalidArgumentError(
            f"fit: validation_batch_size={validation_batch_size!r} was given without "
            "validation data; pass validation_data= or validation_split=, or drop it."
        )
    check_generators_last(
        train, steps_per_epoch, val, validation_steps, range(initial_epoch, epochs), validation_freq
    )
    steps = steps_per_epoch if steps_per_epoch is not None else train.steps
    cbs = callbacks_lib.CallbackList(
        callbacks,
        add_history=True,
        add_progbar=verbose != 0,
        model=model,
        verbose=verbose,
        epochs=epochs,
        steps=steps,
    )
    cbs.set_params(
        dict(cbs.params, metrics=logs_lib.log_keys(model, compiled, val is not None, cbs.callbacks))
    )
    model.stop_training = False
    model.module.train()
    # Reading the logs waits for the step; do it per step only when a callback uses them.
    batch_logs = cbs.needs_batch_logs("on_train_batch_end")
    cbs.on_train_begin()
    known = steps_per_epoch if steps_per_epoch is not None else train.steps
    first_epoch, first_step = cbs.fit_start(initial_epoch, epochs, known)
    logs: dict = {}
    epoch_logs: dict = {}
    try:
        for epoch in range(first_epoch, epochs):
            logs_lib.reset_metrics(model, compiled)
            cbs.on_epoch_begin(epoch)
            model.module.train()
            step = first_step if epoch == first_epoch else 0
            trained = 0
            batches = itertools.islice(train.epoch_batches(steps_per_epoch, prefetch=batch_logs), step, None)
            for group in multi_step.groups(batches, model.steps_per_execution):
                last = step + len(group) - 1
                cbs.on_train_batch_begin(step)
                run_steps(strategy, compiled.train_fn, train_objects(model, compiled), group)
                logs = logs_lib.logs_of(model, compiled) if batch_logs else {}
                cbs.on_train_batch_end(last, logs)
                step = last + 1
                trained += len(group)
                if model.stop_training:
                    break
            if epoch == first_epoch and step == 0 and not model.stop_training:
                raise errors.EmptyDatasetError(
                    f"fit: the training input ({type(x).__name__}) yielded no batch in the "
                    "first epoch, so nothing was trained. Check that the dataset is not "
                    "empty (a generator must yield at least one batch, as Keras requires)."
                )
            # An epoch that ran no step has no values to log (not a loss of 0.0).
            epoch_logs = logs_lib.logs_of(model, compiled) if trained else {}
            if val is not None and (epoch + 1) % validation_freq == 0:
                val_logs = evaluate_loop(
                    model, compiled, val, validation_steps, cbs, "fit(validation_data=...)"
                )
                epoch_logs.update({f"val_{k}": v for k, v in val_logs.items()})
                model.module.train()
            if model.optimizer.has_learning_rate:
                epoch_logs["learning_rate"] = model.optimizer.learning_rate
            cbs.on_epoch_end(epoch, epoch_logs)
            if model.stop_training:
                break
    finally:
        train.close()
    model.module.eval()
    cbs.on_train_end(epoch_logs if epochs > first_epoch else {})
    return model.history


def evaluate(model, compiled, x, y, batch_size, verbose, sample_weight, steps, callbacks, return_dict):
    """`Model.evaluate` (its arguments, docs and errors there)."""
    verbose = checks.check_verbose("evaluate", verbose)
    steps = checks.check_count("evaluate", "steps", steps, allow_none=True)
    return_dict = checks.check_bool("evaluate", "return_dict", return_dict)
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
    cbs = callbacks_lib.CallbackList(
        callbacks,
        add_progbar=verbose != 0,
        model=model,
        verbose=verbose,
        epochs=1,
        steps=steps if steps is not None else data.steps,
    )
    try:
        logs = evaluate_loop(model, compiled, data, steps, cbs, "evaluate")
    finally:
        data.close()
    if return_dict:
        return logs
    values = list(logs.values())
    return values[0] if len(values) == 1 else values


def predict(model, strategy, step_fn, x, batch_size, verbose, steps, callbacks):
    """`Model.predict` (its arguments, docs and errors there) on `strategy`. `step_fn` is
    (predict_fn, steps per call, the input signatures already checked): each call
    `strategy.run`s that many batches (`steps_per_execution`, as Keras)."""
    verbose = checks.check_verbose("predict", verbose)
    steps = checks.check_count("predict", "steps", steps, allow_none=True)
    predict_fn, per_call, checked = step_fn
    data = data_adapter.ModelInput(
        model, strategy, x, None, None, batch_size, False, "predict", inputs_only=True, checked=checked
    )
    model.module.eval()
    outputs = []
    cbs = callbacks_lib.CallbackList(
        callbacks,
        add_progbar=verbose != 0,
        model=model,
        verbose=verbose,
        epochs=1,
        steps=steps if steps is not None else data.steps,
    )
    cbs.on_predict_begin()
    # Outputs are copied to the host at the end, so steps queue without a device round
    # trip each, unless a callback reads each batch's outputs or several processes hold
    # them (strategy.gather then replicates them first).
    per_batch = jax.process_count() > 1 or cbs.needs_batch_logs("on_predict_batch_end")
    pending: collections.deque = collections.deque()
    objects = (model.module, None, None, None, None)
    step = 0
    try:
        for group in multi_step.groups(data.batches(steps), per_call):
            cbs.on_predict_batch_begin(step)
            outs = run_steps(strategy, predict_fn, objects, group)
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
        data.close()
    outputs += [values_lib.gather_to_host(strategy, out) for out in pending]
    if not outputs:
        raise errors.EmptyDatasetError(
            "predict: the input yielded no batch, so there is nothing to predict (Keras "
            "refuses an empty input too). Check that the dataset is not empty."
        )
    warn_if_ran_out("predict", "steps", steps, len(outputs))
    cbs.on_predict_end()
    return concatenate(outputs)


def concatenate(outputs: list):
    """The batches' outputs (NumPy pytrees of one structure) joined along the examples, in new
    (writable) arrays."""
    return jax.tree.map(lambda *parts: np.concatenate(parts, axis=0), *outputs)


def run_steps(strategy, step_fn, objects: tuple, group: list) -> tuple:
    """Runs the consecutive batches `group` as ONE `strategy.run`: `step_fn(*objects, batch)`
    for one batch, else its `multi_step_of` with each batch's mask (`steps_per_execution`).
    Returns each batch's result; its `PerReplica` values carry that batch's rows (mask and
    lengths: `run` gives every output the first batch's, and the last batch may be partial)."""
    if len(group) == 1:
        return (strategy.run(step_fn, args=objects + (group[0],)),)
    masks = tuple(PerReplica(strategy, multi_step.mask_of(b)) for b in group)
    results = strategy.run(multi_step.multi_step_of(step_fn), args=objects + (tuple(group), masks))
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


def class_weight_of(compiled, what: str, class_weight, sample_weight):
    """`check_class_weight`'s table; refused for several outputs (as Keras 3).

    Raises:
      UnsupportedArgumentError: class_weight with several outputs.
    """
    if class_weight is not None and compiled.outputs is not None:
        raise errors.UnsupportedArgumentError(
            f"{what}: class_weight is not supported for a model of several outputs "
            f"{list(compiled.outputs.names)} (Keras 3 refuses it too: which output's labels "
            "would pick the weight?). Pass sample_weight instead: one array per output (a list "
            "or a dict by output name), e.g. the class weights of that output's labels."
        )
    return checks.check_class_weight(class_weight, sample_weight)


def evaluate_loop(model, compiled, data, steps, cbs, what):
    """Runs the test step over `data`, calling the on_test_* hooks of the `CallbackList`."""
    strategy = model.distribute_strategy
    logs_lib.reset_metrics(model, compiled)
    model.module.eval()
    cbs.on_test_begin()
    batch_logs = cbs.needs_batch_logs("on_test_batch_end")
    objects = (model.module, None, model.metrics, compiled.tracker, None)
    count = 0
    for group in multi_step.groups(data.batches(steps, prefetch=batch_logs), model.steps_per_execution):
        cbs.on_test_batch_begin(count)
        run_steps(strategy, compiled.test_fn, objects, group)
        count += len(group)
        cbs.on_test_batch_end(count - 1, logs_lib.logs_of(model, compiled) if batch_logs else {})
    if count == 0:
        raise errors.EmptyDatasetError(
            f"{what}: the input yielded no batch, so there is nothing to evaluate (Keras "
            "refuses an empty input too). Check that the dataset is not empty."
        )
    warn_if_ran_out(what, "steps", steps, count)
    logs = logs_lib.logs_of(model, compiled)
    cbs.on_test_end(logs)
    return logs
