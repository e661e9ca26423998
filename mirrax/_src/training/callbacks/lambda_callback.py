"""`LambdaCallback`: a callback made of plain functions, one per hook."""

from __future__ import annotations

from collections.abc import Callable

from mirrax import errors
from mirrax._src.training.callbacks.callback import HOOKS, Callback


class LambdaCallback(Callback):
    """A callback whose hooks are the functions given, as `keras.callbacks.LambdaCallback`.

    The functions receive the hook's arguments: `on_epoch_begin(epoch, logs)` and
    `on_epoch_end(epoch, logs)`; `on_train_begin(logs)` and `on_train_end(logs)`;
    `on_train_batch_begin(batch, logs)` and `on_train_batch_end(batch, logs)` (`logs` passed
    by keyword, as Keras). Any other hook (`on_test_end=...`, `on_predict_batch_end=...`) may be
    given by name. Example::

        LambdaCallback(on_epoch_end=lambda epoch, logs: print(epoch, logs["loss"]))

    Raises:
      TypeError: a keyword names no hook of `Callback`, or a value is not callable.
    """

    def __init__(
        self,
        on_epoch_begin: Callable | None = None,
        on_epoch_end: Callable | None = None,
        on_train_begin: Callable | None = None,
        on_train_end: Callable | None = None,
        on_train_batch_begin: Callable | None = None,
        on_train_batch_end: Callable | None = None,
        **kwargs,
    ):
        super().__init__()
        unknown = sorted(set(kwargs) - set(HOOKS))
        if unknown:
            raise errors.InvalidArgumentTypeError(
                f"LambdaCallback got {', '.join(repr(k) for k in unknown)}, which "
                f"{'is not a hook' if len(unknown) == 1 else 'are not hooks'} of "
                f"mirrax.callbacks.Callback. The hooks are: {', '.join(HOOKS)}."
            )
        hooks = dict(
            on_epoch_begin=on_epoch_begin,
            on_epoch_end=on_epoch_end,
            on_train_begin=on_train_begin,
            on_train_end=on_train_end,
            on_train_batch_begin=on_train_batch_begin,
            on_train_batch_end=on_train_batch_end,
            **kwargs,
        )
        for name, function in hooks.items():
            if function is None:
                continue
            if not callable(function):
                raise errors.InvalidArgumentTypeError(
                    f"LambdaCallback: {name} must be a function; received "
                    f"{type(function).__name__} {function!r}."
                )
            setattr(self, name, function)
