"""The function `strategy.run` runs for a `Model`'s step method (`train_step`, `test_step`,
`predict_step`): the replica's objects bound to the model while the step is traced, and the
model held weakly, so the compiled programs that keep the function do not keep the model."""

from __future__ import annotations

import weakref

from mirrax import errors


class StepBinding:
    """The replica's objects (module, optimizer, metrics, loss tracker, loss scale) while a
    `Model`'s step is traced, so `Model.train_step` & co. reach them through the model."""

    def __init__(self):
        self.current = None

    def objects(self, what: str) -> tuple:
        """The bound objects.

        Raises:
          ReplicaContextError: no step is being traced (the method was called directly).
        """
        if self.current is None:
            raise errors.ReplicaContextError(
                f"Model.{what} runs inside strategy.run (fit, evaluate and predict call it on "
                f"every replica); call fit / evaluate / predict instead of {what} directly."
            )
        return self.current


class ModelHandle:
    """The model a bound step calls, held weakly: the programs `strategy.run` caches keep their
    step functions, and so kept every model a session compiled alive (with its weights) until
    256 newer programs pushed them out. A pickled copy (a parameter-server worker's, where
    nothing else holds the model) holds it strongly."""

    __slots__ = ("_ref", "_strong")

    def __init__(self, model, strong: bool = False):
        self._ref = weakref.ref(model)
        self._strong = model if strong else None

    def __call__(self):
        """The model (None once nothing else holds it)."""
        return self._ref()

    def __reduce__(self):
        return (ModelHandle, (self._ref(), True))


def bound_step(model, binding: StepBinding, method: str):
    """The function `strategy.run` runs for `model.<method>(data)`: while it is traced, the
    model's `module`, `metrics` and `optimizer.nnx_optimizer` are the replica's objects (so an
    override reads them through `self`, as in Keras), and `binding` holds all of them. The
    function holds the model weakly (`ModelHandle`)."""
    held = ModelHandle(model)

    def step(module, optimizer, metrics, tracker, loss_scale, data):
        model = held()
        assert model is not None  # traced only from the model's own fit / evaluate / predict
        saved = (model.module, model.metrics, binding.current)
        handle = model.optimizer
        saved_optimizer = None if handle is None else handle.nnx_optimizer
        model.module, model.metrics = module, metrics
        binding.current = (module, optimizer, metrics, tracker, loss_scale)
        if handle is not None and optimizer is not None:
            handle.nnx_optimizer = optimizer
        try:
            return getattr(model, method)(data)
        finally:
            model.module, model.metrics, binding.current = saved
            if handle is not None:
                handle.nnx_optimizer = saved_optimizer

    step.__name__ = method
    return step
