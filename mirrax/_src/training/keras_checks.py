"""The checks of a Keras model before `mirrax.Model` wraps it (keras_models.py): a Keras object,
on the JAX backend, its variables built, and a warning for the steps it overrides that mirrax's
fit / evaluate / predict do not call. Keras is never imported unless a Keras object exists.
"""

from __future__ import annotations

import sys
import warnings

from mirrax import errors


def is_keras_model(obj) -> bool:
    """Whether `obj` is a Keras 3 model or layer, subclasses included (a Keras object cannot
    exist unless Keras was imported, so Keras is never imported here)."""
    keras = sys.modules.get("keras")
    return keras is not None and isinstance(obj, keras.layers.Layer)


def all_built(layer) -> bool:
    """Whether the layer and every layer inside it have made their variables (a subclassed
    model's `build(input_shape)` can mark it built while its layers still wait for a call)."""
    return layer.built and all(all_built(inner) for inner in getattr(layer, "layers", ()))


def check_keras(keras_model):
    """Refuses a Keras model mirrax cannot wrap.

    Raises:
      UnsupportedArgumentError: Keras runs on another backend than JAX.
      InvalidArgumentError: the model (or a layer inside it) is not built.
    """
    import keras

    backend = keras.backend.backend()
    if backend != "jax":
        raise errors.UnsupportedArgumentError(
            f"mirrax.Model: the Keras model runs on Keras's {backend!r} backend; mirrax runs "
            "Keras models on the JAX backend only. Set the environment variable "
            "KERAS_BACKEND=jax before Keras is first imported (e.g. os.environ['KERAS_BACKEND'] "
            "= 'jax' at the top of the program, or in the shell), then build the model again."
        )
    if not all_built(keras_model):
        raise errors.InvalidArgumentError(
            f"mirrax.Model: the Keras model {keras_model.name!r} is not built (its variables "
            "do not exist yet), so there is nothing to place on the replicas. Give it its input "
            "shape: start a Sequential with keras.Input(shape=...) (or input_shape=... on the "
            "first layer), or call the model once on a batch (keras_model(x[:1])), before "
            "mirrax.Model(...)."
        )


def warn_if_own_steps(keras_model) -> None:
    """Warns (UserWarning) when the Keras model overrides `train_step`, `test_step` or
    `predict_step`, which mirrax's fit / evaluate / predict do not call."""
    import keras

    overridden = [
        name
        for name in ("train_step", "test_step", "predict_step")
        if getattr(type(keras_model), name, None) is not getattr(keras.Model, name, None)
        and isinstance(keras_model, keras.Model)
    ]
    if overridden:
        warnings.warn(
            f"mirrax.Model: the Keras model {keras_model.name!r} overrides {', '.join(overridden)}, "
            "which mirrax's fit / evaluate / predict do not call (they run their own distributed "
            "steps on the model's call). Override the same method of a mirrax.Model subclass "
            "instead (docs/training.md, 'Keras 3 models').",
            UserWarning,
            stacklevel=4,
        )
