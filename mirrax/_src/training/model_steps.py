"""`mirrax.Model`'s steps, overridable as Keras's `train_step`, `test_step` and `predict_step`,
and the loss tracker they update (a base class of `Model`, model.py; the step functions that run
them inside `strategy.run` are built at compile, steps.py)."""

from __future__ import annotations

from mirrax._src.distribute.current import get_replica_context
from mirrax._src.training import step_binding
from mirrax._src.training import steps as steps_lib


class ModelSteps:
    """The steps of `mirrax.Model` (see `Model`): each runs once per replica inside a step."""

    _compiled: steps_lib.CompiledState | None
    _binding: step_binding.StepBinding

    def train_step(self, data):
        """One training step on this replica's shard of a batch, as `keras.Model.train_step`.

        `fit` (and `train_on_batch`) run it inside `strategy.run`, once per replica, with
        `data = (x, y)` or `(x, y, sample_weight)` (as the input has weights or not): this
        replica's rows of the global batch (`get_replica_context().batch_mask` marks the real
        rows of a partial batch). Inside, `self.module`, `self.optimizer.nnx_optimizer`,
        `self.metrics` and `self.loss_tracker` are this replica's objects: update them in
        place (e.g. `mirrax.value_and_grad(loss_fn)(self.module, ...)`, then
        `self.optimizer.nnx_optimizer.update(self.module, grads)`, and
        `self.loss_tracker.update(total, count)` for the logged loss). Gradients of
        replicated parameters are summed over the replicas by JAX (divide the loss by the
        global batch, as `compute_average_loss` does). The return value is ignored: fit's
        logs are read from the loss tracker and the metrics. Traced once per program, so it
        must be a pure function of its inputs and the objects above (as a `tf.function`).

        The default: the compiled loss (mixed precision and loss scaling included) and its
        gradients, the optimizer's update, the loss tracker and the metrics.
        """
        module, optimizer, metrics, tracker, loss_scale = self._binding.objects("train_step")
        assert self._compiled is not None  # the step runs only once compiled
        self._compiled.train_impl(module, optimizer, metrics, tracker, loss_scale, data)

    def test_step(self, data):
        """One evaluation step on this replica's shard, as `keras.Model.test_step`: updates the
        loss tracker and metrics (see `train_step` for where it runs and what it may use)."""
        module, _, metrics, tracker, _ = self._binding.objects("test_step")
        assert self._compiled is not None  # the step runs only once compiled
        self._compiled.test_impl(module, metrics, tracker, data)

    def predict_step(self, data):
        """The outputs for this replica's shard `data = (x,)`, as `keras.Model.predict_step`:
        an array (or pytree of arrays) with the shard's rows first (see `train_step`)."""
        module = self._binding.objects("predict_step")[0]
        if self._compiled is not None:
            return self._compiled.predict_impl(module, data)
        # Not compiled: float32, micro-batched in replica-invariant mode.
        ctx = get_replica_context()
        assert ctx is not None  # a step runs in a replica context (None is cross-replica only)
        micro = ctx.strategy.replica_invariant
        impl = steps_lib.PREDICT_FLOAT32_MICRO if micro else steps_lib.PREDICT_FLOAT32
        return impl(module, data)

    @property
    def loss_tracker(self):
        """The `LossTracker` of the logged loss (`update(total, count)`, `result()`, `reset()`):
        inside a step, this replica's; None before compile."""
        if self._binding.current is not None:
            return self._binding.current[3]
        return None if self._compiled is None else self._compiled.tracker
