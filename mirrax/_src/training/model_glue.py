"""`mirrax.Model`'s Keras-model conveniences beyond compile / fit: `save` to a `.keras` file,
`losses` and `trainable_variables` (a base class of `Model`, which is at its size limit)."""

from __future__ import annotations

from flax import nnx

from mirrax._src.training import keras_models, keras_saving


class KerasGlue:
    """`save`, `losses` and `trainable_variables` of `mirrax.Model` (as `keras.Model`'s)."""

    module: nnx.Module
    _keras_compile_args: dict | None = None

    def _remember_compile(self, **arguments) -> None:
        """Keeps `compile`'s arguments as given (Keras objects before translation), for `save`."""
        self._keras_compile_args = arguments

    def save(self, filepath, overwrite: bool = True, **kwargs) -> None:
        """Writes a Keras model, its trained weights and its compile configuration to a
        `.keras` file, as `keras.Model.save` (Keras's own format, written by Keras).

        The weights mirrax trained are first written into the Keras model (`model.keras_model`
        holds them afterwards). When `compile` was given Keras objects or names (a Keras
        optimizer, loss, metrics, or strings), the Keras model is compiled with them too, so
        the file holds the compile configuration and `mirrax.models.load_model` (or
        `keras.models.load_model`) compiles the model again; the optimizer's state (moments,
        update count) is not saved (training continues from a fresh optimizer; use
        `mirrax.Checkpoint` to keep it). An optax optimizer or a mirrax loss or metric cannot be
        saved by Keras: a warning says the file holds no compile configuration.

        The file is written under a temporary name beside `filepath` and renamed over it, so a
        save killed at any moment leaves the previous file (or none) or the new one, never a
        partial one. In a multi-process run every process calls `save` (as in TF) and only the
        chief (process 0) writes; each returns once the file is written.

        Args:
          filepath: a str or os.PathLike ending in ".keras".
          overwrite: replace an existing file (default True); False raises instead of asking
            (Keras asks on the terminal).
          **kwargs: Keras's `zipped` (None or True only).

        Raises:
          UnsupportedArgumentError: the model is an NNX module (the message names
            `save_weights`, `mirrax.Checkpoint` and `mirrax.export`), or `zipped=False`.
          InvalidArgumentError: `filepath` does not end in ".keras".
          InvalidArgumentTypeError: `filepath` is not a path, `overwrite` not a bool.
          ExistingPathError: the file exists and `overwrite` is False, or it is a directory.
        """
        keras_saving.save_model(self, filepath, overwrite, self._keras_compile_args, kwargs)

    @property
    def losses(self) -> list:
        """The model's own losses, as `keras.Model.losses` (a list of float scalars): a Keras
        model's activity and `add_loss` losses of its last call and its weight regularizers'
        losses on the current weights (see `KerasModule.losses`); [] for an NNX module."""
        if isinstance(self.module, keras_models.KerasModule):
            return self.module.losses
        return []

    @property
    def trainable_variables(self) -> list:
        """The `nnx.Param`s the optimizer updates, as `keras.Model.trainable_variables`, in the
        order of the module's state leaves (a Keras model's state is keyed by Keras path, so
        sorted by path): the order of `value_and_grad`'s gradient leaves."""
        if isinstance(self.module, keras_models.KerasModule):
            return self.module.trainable_variables
        return [v for _, v in nnx.to_flat_state(nnx.state(self.module, nnx.Param))]
