"""Whole-model save of a Keras model in Keras's own `.keras` format, and loading it back.

`mirrax.Model(keras_model).save("m.keras")` writes what `keras_model.save("m.keras")` writes,
with the weights mirrax trained (the wrapper holds copies of Keras's variables, written into the
Keras model first) and, where the model was compiled with Keras-serializable arguments, the
compile configuration (Keras's `compile_config`), so `load_model` compiles it again. The file is
written under a temporary name beside the target and renamed over it (one atomic step), so a
save killed at any moment leaves the old file or the new one, never a half-written archive. In a
multi-process run only process 0 (the chief) writes; every process waits until it has.
"""

from __future__ import annotations

import glob
import itertools
import os
import warnings

import jax

from mirrax import errors
from mirrax._src import atomic_dirs
from mirrax._src.distribute import multihost
from mirrax._src.training import keras_models, keras_objects

# The exchange names of this process's saves: every process counts its saves, so the n-th save
# of each process meets the others' n-th (TF's Model.save is collective in the same way).
_SAVES = itertools.count()
_TEMP_INFIX = ".mirrax-tmp-"

# compile()'s arguments that Keras's compile takes too (the rest are mirrax's own).
_KERAS_COMPILE_ARGUMENTS = ("optimizer", "loss", "loss_weights", "metrics", "weighted_metrics")


def _refuse_nnx(filepath):
    raise errors.UnsupportedArgumentError(
        f"Model.save({filepath!r}): the model is an NNX module, which has no .keras archive (its "
        "code is Python, not a Keras config). Use model.save_weights(path) for the weights, "
        "mirrax.Checkpoint(model=model).write(path) for weights and optimizer state, or "
        "mirrax.export(model, path, input_signature) for a program that serves without the "
        "model's code. (A Keras 3 model wrapped in mirrax.Model saves as .keras.)"
    )


def _checked_path(filepath) -> str:
    if not isinstance(filepath, (str, os.PathLike)):
        raise errors.InvalidArgumentTypeError(
            f"Model.save: filepath must be a str or os.PathLike ending in .keras; received "
            f"{type(filepath).__name__} {filepath!r:.60}."
        )
    path = os.fsdecode(os.fspath(filepath))
    if not path.endswith(".keras"):
        raise errors.InvalidArgumentError(
            f"Model.save({path!r}): the path must end in .keras (Keras's native format, the one "
            "mirrax writes). Add the extension, e.g. model.save('model.keras'); for the weights "
            "alone use model.save_weights(path), for a serving program mirrax.export(...)."
        )
    return os.path.abspath(path)


def _serializable(value) -> bool:
    """Whether Keras's compile config can hold `value` (a compile argument)."""
    if value is None or isinstance(value, (str, int, float)):
        return True
    if isinstance(value, (list, tuple, dict)):  # dicts: per-output losses / metrics
        return all(_serializable(v) for v in (value.values() if isinstance(value, dict) else value))
    return (
        keras_objects.is_keras_loss(value)
        or keras_objects.is_keras_optimizer(value)
        or keras_objects.is_keras_metric(value)
    )


def compile_keras_model(keras_model, compile_args: dict | None, handle=None) -> None:
    """Compiles the Keras model with `Model.compile`'s Keras arguments, so its file holds them
    (Keras saves `compile_config` for a compiled model only), a Keras optimizer with the
    current learning rate of `handle` (the model's `OptimizerHandle`; a callback may have
    changed it), as Keras saves its rate variable; warns when they cannot be saved."""
    if not compile_args:
        return
    keras_args = {k: compile_args[k] for k in _KERAS_COMPILE_ARGUMENTS}
    unsaved = [k for k, v in keras_args.items() if not _serializable(v)]
    if unsaved:
        if keras_model.compiled:
            return  # the user's own keras_model.compile(...) is what the file keeps
        warnings.warn(
            f"Model.save: the compile arguments {', '.join(unsaved)} are not Keras objects or "
            "names (e.g. an optax optimizer or a mirrax loss), so the file holds no compile "
            "configuration and load_model returns an uncompiled model: call compile() after "
            "loading, or compile with Keras objects (keras.optimizers.Adam(), keras.losses...).",
            UserWarning,
            stacklevel=3,
        )
        return
    optimizer = keras_args["optimizer"]
    if keras_objects.is_keras_optimizer(optimizer):
        # A fresh copy, built: Keras saves the optimizer's variables and, at load, skips them
        # with a warning unless they match the built optimizer's.
        optimizer = type(optimizer).from_config(keras_objects.keras_config(optimizer))
        optimizer.build(keras_model.trainable_variables)
        if handle is not None and handle.has_learning_rate:
            optimizer.learning_rate = handle.learning_rate
        keras_args["optimizer"] = optimizer
    keras_model.compile(**keras_args)


def _write_atomically(keras_model, path: str) -> None:
    directory, base = os.path.split(path)
    os.makedirs(directory, exist_ok=True)
    for leftover in glob.glob(os.path.join(glob.escape(directory), f".{glob.escape(base)}{_TEMP_INFIX}*")):
        atomic_dirs.delete(leftover)  # from a save killed before its rename
    # Keras insists on the .keras extension, so the temporary name keeps it.
    temporary = os.path.join(directory, f".{base}{_TEMP_INFIX}{os.getpid()}.keras")
    try:
        with warnings.catch_warnings(), jax.numpy_rank_promotion("allow"):
            # Keras's get_config reads variables with np.array(variable) (NumPy 2 warns).
            warnings.simplefilter("ignore", DeprecationWarning)
            keras_model.save(temporary)
        with open(temporary, "rb") as written:
            os.fsync(written.fileno())
        os.replace(temporary, path)
    finally:
        if os.path.lexists(temporary):
            atomic_dirs.delete(temporary)


def save_model(model, filepath, overwrite, compile_args, kwargs: dict) -> None:
    """`Model.save` (its docs there)."""
    module = model.module
    if not isinstance(module, keras_models.KerasModule):
        _refuse_nnx(filepath)
    path = _checked_path(filepath)
    if not isinstance(overwrite, bool):
        raise errors.InvalidArgumentTypeError(
            f"Model.save: overwrite must be True or False; received {overwrite!r}."
        )
    zipped = kwargs.pop("zipped", None)
    if zipped not in (None, True) or kwargs:
        raise errors.UnsupportedArgumentError(
            f"Model.save: {dict(kwargs, **({'zipped': zipped} if zipped is not None else {}))} "
            "not supported; mirrax writes the zipped .keras file only (no other options)."
        )
    if os.path.lexists(path) and (not overwrite or os.path.isdir(path)):
        raise errors.ExistingPathError(
            f"Model.save: {path} exists{' and is a directory' if os.path.isdir(path) else ''}; "
            "pass overwrite=True to replace a file, or another path."
        )
    module.read_keras_writes()  # a write to the Keras model since wrapping is kept
    module.write_to_keras()
    compile_keras_model(module.keras_model, compile_args, model.optimizer)
    failure = None
    if jax.process_index() == 0:
        try:
            _write_atomically(module.keras_model, path)
        except Exception as e:  # told to the other processes, then raised here
            failure = f"{type(e).__name__}: {e}"
            raise
        finally:
            _tell_peers(failure)
    else:
        _tell_peers(None)


def _tell_peers(failure) -> None:
    """Waits until every process reached this save, the chief's write done; raises on the
    others when the chief's write failed."""
    outcomes = multihost.exchange(f"keras_save/{next(_SAVES)}", failure)
    if jax.process_index() != 0 and outcomes[0] is not None:
        raise errors.MirraxError(f"Model.save: the chief (process 0) failed to write the file: {outcomes[0]}")


def load_keras_model(filepath, custom_objects, compile, safe_mode):
    """(the Keras model read from `filepath`, the compile arguments its file holds or None)."""
    import keras

    if not isinstance(filepath, (str, os.PathLike)):
        raise errors.InvalidArgumentTypeError(
            f"load_model: filepath must be a str or os.PathLike; received "
            f"{type(filepath).__name__} {filepath!r:.60}."
        )
    path = os.fsdecode(os.fspath(filepath))
    if not os.path.exists(path):
        raise errors.MissingCheckpointError(
            f"load_model: no file at {path!r}; pass the path that model.save('....keras') wrote."
        )
    if not path.endswith(".keras"):
        raise errors.InvalidArgumentError(
            f"load_model({path!r}): mirrax reads Keras's .keras files (what Model.save writes); "
            "for mirrax's checkpoints use model.load_weights(path) or mirrax.Checkpoint(...)."
            "restore(path), for an exported program mirrax.load_exported(path)."
        )
    with warnings.catch_warnings():
        # Keras's get_config reads variables with np.array(variable), which NumPy 2 warns about.
        warnings.simplefilter("ignore", DeprecationWarning)
        with jax.numpy_rank_promotion("allow"):
            keras_model = keras.saving.load_model(
                path, custom_objects=custom_objects, compile=compile, safe_mode=safe_mode
            )
    config = keras_model.get_compile_config() if compile and keras_model.compiled else None
    if config is None:
        return keras_model, None
    arguments = keras.saving.deserialize_keras_object(config)
    return keras_model, {
        k: arguments[k]
        for k in _KERAS_COMPILE_ARGUMENTS + ("steps_per_execution",)
        if arguments.get(k) is not None
    }
