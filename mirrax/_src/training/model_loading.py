"""`mirrax.models.load_model`: a `.keras` file (what `Model.save` writes) as a `mirrax.Model`."""

from __future__ import annotations

from mirrax._src.training import keras_saving
from mirrax._src.training.model import Model


def load_model(filepath, custom_objects=None, compile: bool = True, safe_mode: bool = True):
    """Reads a Keras model from a `.keras` file as a `mirrax.Model`, as
    `keras.models.load_model` (same arguments), compiled again from the file's compile
    configuration where it holds one.

    The Keras model is read by Keras (`keras.saving.load_model`) and wrapped in a
    `mirrax.Model`; with `compile=True` and a compile configuration in the file (Keras saves one
    for a compiled model; `mirrax.Model.save` saves `compile`'s Keras arguments), the model is
    compiled with the file's optimizer, loss, loss weights, metrics and steps_per_execution, as
    Keras compiles it. Not restored: the optimizer's state (training continues with a fresh
    one, as the counts and moments were not saved), a mixed precision policy (set it before
    loading), and mirrax-only compile arguments (`gradient_accumulation_steps`,
    `auto_scale_loss`). The model belongs to the strategy in scope at this call, if any (as
    under TF, `load_model` inside `strategy.scope()` gives a model trained on its replicas);
    else compile's rules apply.

    Args:
      filepath: a str or os.PathLike of a ".keras" file.
      custom_objects: as Keras's (classes and functions of a custom model, by name).
      compile: whether to compile the model from the file's configuration.
      safe_mode: as Keras's (refuses lambda layers' bytecode unless False).

    Returns:
      A `mirrax.Model` whose `keras_model` is the loaded Keras model.

    Raises:
      MissingCheckpointError (a FileNotFoundError): no file at `filepath`.
      InvalidArgumentError: `filepath` does not end in ".keras" (the message names the readers
        of mirrax's checkpoints and exports).
      InvalidArgumentTypeError: `filepath` is not a path.
      UnsupportedArgumentError: the file's compile arguments have no mirrax translation (the
        message of `compile` names them); load with compile=False and compile yourself.
    """
    keras_model, compile_args = keras_saving.load_keras_model(filepath, custom_objects, compile, safe_mode)
    model = Model(keras_model)
    if compile_args is not None:
        model.compile(**compile_args)
    return model
