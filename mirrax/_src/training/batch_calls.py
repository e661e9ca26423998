"""Keras's one-batch calls: `train_on_batch`, `test_on_batch` and `predict_on_batch`'s size on
one global batch of arrays, and `make_train_function` / `make_test_function`, one step on a
distributed batch; `Model`'s methods of those names (the `BatchCalls` base class) and what
they run."""

from __future__ import annotations

from collections.abc import Callable

import jax

from mirrax import errors
from mirrax._src import argument_checks
from mirrax._src.distribute.values import PerReplica
from mirrax._src.training import array_inputs, data_adapter, fit_arguments, local_executor, strategy_checks
from mirrax._src.training import logs as logs_lib
from mirrax._src.training import steps as steps_lib


class BatchCalls:
    """`train_on_batch`, `test_on_batch`, `make_train_function` and `make_test_function` of
    `mirrax.Model` (as `keras.Model`'s), on its compiled steps."""

    _compiled: steps_lib.CompiledState | None
    _check_compiled: Callable[[str], None]  # Model's: raises NotCompiledError

    def train_on_batch(self, x, y=None, sample_weight=None, class_weight=None, return_dict: bool = False):
        """One training step on one GLOBAL batch of arrays, as `keras.Model.train_on_batch`.

        The metrics are reset first (as Keras 3), so the result is this batch's loss and
        metrics. Returns the loss (float) without metrics, else [loss, metric...]; with
        `return_dict`, the logs dict.

        Raises:
          NotCompiledError; InvalidArgumentTypeError (x not arrays); the checks of `fit`.
        """
        self._check_compiled("train_on_batch")
        return _train_on_batch(self, self._compiled, x, y, sample_weight, class_weight, return_dict)

    def test_on_batch(self, x, y=None, sample_weight=None, return_dict: bool = False):
        """Loss and metrics of one GLOBAL batch of arrays, as `keras.Model.test_on_batch`
        (metrics reset first, as Keras 3); returns as `train_on_batch`."""
        self._check_compiled("test_on_batch")
        return _test_on_batch(self, self._compiled, x, y, sample_weight, return_dict)

    def make_train_function(self):
        """`train_function(batch)`: one step of `fit` on a distributed batch ((x, y) or (x, y,
        sample_weight) from `strategy.experimental_distribute_dataset`), in training mode, as
        Keras's; returns None. No callbacks, no logs (read them with `get_metrics_result`).

        Raises:
          NotCompiledError: the model is not compiled.
        """
        self._check_compiled("make_train_function")
        return _make_train_function(self, self._compiled)

    def make_test_function(self):
        """`test_function(batch)`: one step of `evaluate` on a distributed batch, as Keras's,
        in inference mode (`module.eval()` at each call; the train function sets training
        mode): the loss tracker and metrics updated; no callbacks, no reset; returns None.

        Raises:
          NotCompiledError: the model is not compiled.
        """
        self._check_compiled("make_test_function")
        return _make_test_function(self, self._compiled)


def _train_on_batch(model, compiled, x, y, sample_weight, class_weight, return_dict):
    """`Model.train_on_batch` (its arguments, docs and errors there)."""
    class_weight = fit_arguments.class_weight_of(compiled, "train_on_batch", class_weight, sample_weight)
    data = one_batch(model, compiled, "train_on_batch", x, y, sample_weight, class_weight)
    return_dict = argument_checks.flag("train_on_batch", "return_dict", return_dict)
    logs_lib.reset_metrics(model, compiled)
    model.module.train()
    state = local_executor.train_objects(model, compiled)
    for batch in data.batches():
        model.distribute_strategy.run(compiled.train_fn, args=state + (batch,))
    model.module.eval()
    return result_of(logs_lib.logs_of(model, compiled), return_dict)


def _test_on_batch(model, compiled, x, y, sample_weight, return_dict):
    """`Model.test_on_batch` (its arguments, docs and errors there)."""
    data = one_batch(model, compiled, "test_on_batch", x, y, sample_weight, None)
    return_dict = argument_checks.flag("test_on_batch", "return_dict", return_dict)
    logs_lib.reset_metrics(model, compiled)
    model.module.eval()
    for batch in data.batches():
        model.distribute_strategy.run(
            compiled.test_fn, args=(model.module, None, model.metrics, compiled.tracker, None, batch)
        )
    return result_of(logs_lib.logs_of(model, compiled), return_dict)


def one_batch(model, compiled, what, x, y, sample_weight, class_weight):
    """The `ModelInput` of one global batch of arrays (`train_on_batch`, `test_on_batch`).

    Raises:
      InvalidArgumentTypeError: `x` is not arrays.
    """
    strategy_checks.check_not_parameter_server(model.distribute_strategy, what)
    x, y, sample_weight = (array_inputs.as_arrays(v) for v in (x, y, sample_weight))
    if not array_inputs.is_arrays(x):
        raise errors.InvalidArgumentTypeError(
            f"{what}: x must be an array (or a dict of arrays) holding one batch; received "
            f"{type(x).__name__}. Use fit() / evaluate() for datasets."
        )
    return data_adapter.ModelInput(
        model,
        model.distribute_strategy,
        x,
        y,
        sample_weight,
        max(array_inputs.num_examples(x), 1),
        False,
        what,
        class_weight=class_weight,
        checked=compiled.checked_inputs,
    )


def result_of(logs: dict, return_dict: bool):
    """Keras's `*_on_batch` result: the logs dict with `return_dict`, else the loss alone, or
    [loss, metric, ...].
    """
    if return_dict:
        return logs
    values = list(logs.values())
    return values[0] if len(values) == 1 else values


def one_batch_size(what: str, x) -> int:
    """The size of the one batch of arrays `x` (`predict_on_batch`).

    Raises:
      InvalidArgumentTypeError: `x` is not arrays.
    """
    x = array_inputs.as_arrays(x)
    if not array_inputs.is_arrays(x):
        raise errors.InvalidArgumentTypeError(
            f"{what}: x must be an array (or a dict of arrays); received "
            f"{type(x).__name__}. Use predict() for datasets."
        )
    return max(array_inputs.num_examples(x), 1)


def _make_train_function(model, compiled):
    """`Model.make_train_function` (its docs and errors there)."""

    def objects():
        model.module.train()  # as Keras's training=True, whatever ran before (a test function)
        return local_executor.train_objects(model, compiled)

    return _batch_function(model, "train_function", compiled.train_fn, objects)


def _make_test_function(model, compiled):
    """`Model.make_test_function` (its docs and errors there)."""

    def objects():
        model.module.eval()  # as evaluate: Dropout off, BatchNorm's moving averages
        return (model.module, None, model.metrics, compiled.tracker, None)

    return _batch_function(model, "test_function", compiled.test_fn, objects)


def _batch_function(model, name: str, step_fn, objects):
    """`name(batch)`: `strategy.run(step_fn, args=objects() + (batch,))` on one distributed
    batch; returns None.

    Raises:
      InvalidArgumentTypeError: (when called) the batch holds no distributed value.
    """
    strategy = model.distribute_strategy
    strategy_checks.check_not_parameter_server(strategy, f"make_{name}")

    def function(batch):
        if not any(
            isinstance(leaf, PerReplica)
            for leaf in jax.tree.leaves(batch, is_leaf=lambda v: isinstance(v, PerReplica))
        ):
            raise errors.InvalidArgumentTypeError(
                f"{name}: batch must be a distributed batch, an element of "
                "strategy.experimental_distribute_dataset(...); received "
                f"{type(batch).__name__}. (A plain array would reach every replica whole.)"
            )
        strategy.run(step_fn, args=objects() + (batch,))

    function.__name__ = name
    return function
