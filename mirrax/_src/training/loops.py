"""What `fit`, `evaluate` and `predict` share around their loops: Keras's warnings for inputs that
run out, and which callbacks need per-batch logs."""

from __future__ import annotations

import warnings


from mirrax import errors


def warn_if_ran_out(what: str, name: str, steps, count: int) -> None:
    """Keras's warning when an input holds fewer batches than `steps` asked for."""
    if steps is not None and count < steps:
        warnings.warn(
            f"Your input ran out of data; interrupting {what} after {count} batch(es) of "
            f"{name}={steps}. Make sure that your dataset or generator can generate at least "
            f"{steps} batches.",
            stacklevel=3,
        )


def check_generators_last(train, steps_per_epoch, val, validation_steps, epochs,
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


# predict copies a batch's outputs to the host this many steps after dispatching it.
PREDICT_AHEAD = 32


def has_learning_rate(optimizer) -> bool:
    try:
        optimizer._hyperparams()
        return True
    except AttributeError:
        return False
