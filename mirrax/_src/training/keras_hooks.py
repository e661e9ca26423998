"""What `mirrax.Model`'s calls do for a wrapped Keras model, and nothing for other modules: before
compile (trainable flags, the dtype policy) and fit, before each use (the Keras model's own
writes taken), after `set_weights`, the call with its loss collection, and a Keras weights file
refused (keras_models.py has the `KerasModule` they act on).
"""

from __future__ import annotations

from mirrax import errors
from mirrax._src.training.keras_models import KerasModule


def before_compile(module, policy) -> None:
    """For `Model.compile` of a Keras model: re-reads which variables are trainable, and
    refuses a dtype policy the model's layers were not built with (Keras layers cast their
    inputs to their own compute dtype, so mirrax's casts alone would leave the model computing
    in float32, or in bfloat16 without loss scaling).

    Raises:
      UnsupportedArgumentError: the policies' compute dtypes differ (the message says to set
        the policy before building the model).
    """
    if not isinstance(module, KerasModule):
        return
    built = module.keras_model.dtype_policy
    if built.compute_dtype != policy.compute_dtype:
        raise errors.UnsupportedArgumentError(
            f"compile: mirrax's mixed precision policy is {policy.name!r} but the Keras model "
            f"{module.keras_model.name!r} was built under Keras's policy {built.name!r} "
            f"(its layers compute in {built.compute_dtype}). Set the policy you want with "
            "mirrax.mixed_precision.set_global_policy(name) (it sets Keras's policy too) after "
            "importing Keras and BEFORE building the Keras model, as Keras's mixed precision "
            "guide does; then build, wrap and compile it. (keras.mixed_precision."
            "set_global_policy alone leaves mirrax's policy as it was.)"
        )
    module.refresh_trainable()


def before_fit(module) -> None:
    """`Model.fit`'s check of a Keras model (see `KerasModule.check_trainable_unchanged`)."""
    if isinstance(module, KerasModule):
        module.check_trainable_unchanged("fit")


def read_keras_writes(module) -> None:
    """Before a `Model` use: a Keras model's variables written directly since wrapping are
    taken (`KerasModule.read_keras_writes`); nothing for other modules."""
    if isinstance(module, KerasModule):
        module.read_keras_writes()


def after_weights_set(module) -> None:
    """Writes a Keras model's variables after `set_weights` / `load_weights`, so the Keras
    model used directly sees them too."""
    if isinstance(module, KerasModule):
        module.write_to_keras()


def call_with_losses(module, *args):
    """(outputs, the module's own losses summed): a Keras model's regularization and
    `add_loss` losses; None for any other module (NNX modules have no loss collection)."""
    if isinstance(module, KerasModule):
        return module.call_with_losses(*args)
    return module(*args), None


def check_weights_path(module, filepath) -> None:
    """Refuses a Keras weights file given to `Model.load_weights` of a Keras model, naming the
    route: Keras's own `load_weights` before wrapping (mirrax reads its own checkpoints).

    Raises:
      UnsupportedArgumentError: `filepath` ends in .h5 or .keras.
    """
    if isinstance(module, KerasModule) and str(filepath).endswith((".h5", ".keras")):
        raise errors.UnsupportedArgumentError(
            f"load_weights({str(filepath)!r}): that is a Keras weights file; mirrax.Model reads "
            "the checkpoints mirrax writes (save_weights, Checkpoint, ModelCheckpoint). Load it "
            "into the Keras model before wrapping it: keras_model.load_weights(path), then "
            "mirrax.Model(keras_model)."
        )
