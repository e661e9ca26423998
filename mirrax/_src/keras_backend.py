"""Keras on the JAX backend by default in a program that imports mirrax before Keras.

Keras 3 picks its backend once, when it is first imported: `KERAS_BACKEND`, else
~/.keras/keras.json, whose default is "tensorflow". So `import mirrax; import keras` without
the variable fails inside Keras ("No module named 'tensorflow'") on a machine without
TensorFlow, or gives a Keras whose models `mirrax.Model` refuses (mirrax runs Keras models on
JAX only). Importing mirrax sets `KERAS_BACKEND=jax` when it is unset and Keras is not imported
yet (a value the user set is kept). When Keras was imported earlier on another backend, it is
too late to change: a warning says so at `import mirrax`, and `mirrax.Model(keras_model)`
refuses the model with the fix; mirrax itself (NNX models, tf.data or torch input) still works.
Standard library only: it runs first in `mirrax/__init__.py`, before anything can import Keras.
"""

from __future__ import annotations

import os
import sys
import warnings

BACKEND = "jax"


def default_to_jax() -> None:
    """Sets `KERAS_BACKEND=jax` unless it is set or Keras is imported; warns when Keras was
    imported with another backend (as read from `keras.backend.backend()`)."""
    keras = sys.modules.get("keras")
    if keras is None:
        os.environ.setdefault("KERAS_BACKEND", BACKEND)
        return
    read_backend = getattr(getattr(keras, "backend", None), "backend", None)
    if not callable(read_backend):  # a Keras still being imported (or not Keras 3)
        return
    backend = read_backend()
    if backend != BACKEND:
        warnings.warn(
            f"mirrax: Keras was imported before mirrax, on its {backend!r} backend; mirrax "
            "trains Keras models on the JAX backend only, so mirrax.Model(keras_model) will "
            "refuse them. Import mirrax before Keras (it then defaults KERAS_BACKEND to jax), "
            "or set KERAS_BACKEND=jax before Keras is first imported. NNX models are not "
            "affected.",
            UserWarning,
            stacklevel=2,
        )


default_to_jax()
