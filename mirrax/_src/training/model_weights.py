"""`mirrax.Model`'s weights: `get_weights`, `set_weights`, `count_params`, `save_weights`,
`load_weights` and `summary` (a base class of `Model`), as `keras.Model`'s."""

from __future__ import annotations

import numpy as np
from flax import nnx

from mirrax._src.checkpointing import checkpoint
from mirrax._src.training import keras_hooks
from mirrax._src.training import weights as weights_lib


class ModelWeights:
    """`get_weights`, `set_weights`, `count_params`, `save_weights`, `load_weights` and
    `summary` of `mirrax.Model` (as `keras.Model`'s), on its `module`."""

    module: nnx.Module

    def get_weights(self) -> list:
        """The module's weights as NumPy arrays, in a fixed order (as `keras.Model.get_weights`).

        Weights are every variable but PRNG state (`nnx.Rngs` keys and counts, e.g. of
        `nnx.Dropout`): parameters and batch statistics, as Keras's `weights` leave out its
        seed generators' state. Checkpoints (`save_weights`, `mirrax.Checkpoint`) keep all.
        """
        keras_hooks.read_keras_writes(self.module)
        return [np.asarray(v.get_value()) for _, v in weights_lib.module_weights(self.module)]

    def count_params(self) -> int:
        """The number of values in the module's weights (`get_weights()`), as
        `keras.Model.count_params` (trainable and non-trainable; PRNG state left out)."""
        return int(sum(np.prod(np.shape(v.get_value())) for _, v in weights_lib.module_weights(self.module)))

    def set_weights(self, weights) -> None:
        """Sets the module's variables from `get_weights()`-ordered arrays (shapes must match).

        Raises:
          ValueError: wrong number of arrays or a shape mismatch (the message names the variable).
        """
        weights_lib.set_weights(self.module, weights)
        keras_hooks.after_weights_set(self.module)

    def save_weights(self, filepath, overwrite: bool = True) -> None:
        """Writes the module's variables to the directory `filepath` (a `mirrax.Checkpoint`).

        As `keras.Model.save_weights`, but the file is an Orbax checkpoint directory written by
        `mirrax.Checkpoint(weights=model.module)`: atomic (also when replacing an earlier
        save), each array once whatever the replica count, readable back into any replica
        count. PRNG state (`nnx.Rngs`, e.g. of `nnx.Dropout`) and batch statistics included.

        Raises:
          ExistingPathError (a FileExistsError): `filepath` exists and `overwrite` is False,
            or `filepath` is a regular file.
          InvalidArgumentTypeError: `filepath` is not a str or os.PathLike.
        """
        keras_hooks.read_keras_writes(self.module)
        checkpoint.save_weights(self, filepath, overwrite)

    def load_weights(self, filepath) -> None:
        """Reads variables into the module (placed where they are now), as `keras.Model.load_weights`.

        Reads what `save_weights` wrote, or the module's variables of a full checkpoint
        (`mirrax.Checkpoint(model=model).write`, `ModelCheckpoint`'s default output), as Keras
        loads weights from a full save; the optimizer state of a full checkpoint is not read.

        Raises:
          MissingCheckpointError (a FileNotFoundError): no checkpoint at `filepath`.
          InvalidCheckpointError (a ValueError): the directory is not a complete checkpoint.
          IncompatibleCheckpointError (a ValueError): the checkpoint's variables do not match
            the module's (the message lists the paths and shapes that differ), or it holds no
            model's weights (the message names the call that restores it).
        """
        keras_hooks.check_weights_path(self.module, filepath)
        checkpoint.load_weights(self, filepath)
        keras_hooks.after_weights_set(self.module)

    def summary(
        self,
        line_length=None,
        positions=None,
        print_fn=None,
        expand_nested=False,
        show_trainable=False,
        layer_range=None,
    ):
        """A Keras model: `keras_model.summary(...)` (Keras's table, all its arguments). An NNX
        module: its variables' path, type, shape and count, with line_length, print_fn,
        show_trainable (`nnx.Param`s are), expand_nested (accepted: all are listed); positions
        and layer_range raise UnsupportedArgumentError, a bad type InvalidArgumentTypeError."""
        weights_lib.print_summary(
            self.module, line_length, positions, print_fn, expand_nested, show_trainable, layer_range
        )
