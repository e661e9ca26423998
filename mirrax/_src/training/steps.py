"""The step functions a `Model` runs through `strategy.run`: the forward pass under the dtype
policy, the loss tracker, and the train, test and predict steps built at `compile`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mirrax import errors
from mirrax._src.distribute import gradients, invariant
from mirrax._src.distribute.current import get_replica_context
from mirrax._src.distribute.losses import compute_average_loss
from mirrax._src.training import keras_hooks, mixed_precision


class LossTracker(nnx.Pytree):
    """[sum of the real examples' weighted losses, their count], SUM-aggregated over replicas.

    One variable, so the write-back adds both over the replicas in one all-reduce. With
    `outputs` > 0 it also holds each output's (unweighted) loss sum, Keras's "<output>_loss".
    """

    def __init__(self, outputs: int = 0):
        self.sums = nnx.metrics.MetricState(jnp.zeros((2 + outputs,), jnp.float32))

    def update(self, total, count):
        self.sums[...] = self.sums[...].at[:2].add(jnp.stack([total, count]).astype(jnp.float32))

    def update_outputs(self, sums):
        """Adds each output's loss sum over this step's real examples."""
        self.sums[...] = self.sums[...].at[2:].add(sums)

    def reset(self):
        self.sums[...] = jnp.zeros_like(self.sums[...])

    def result(self):
        total, count = self.sums[...][:2]
        return total / jnp.maximum(count, 1.0)

    def output_results(self):
        """Each output's mean loss (as Keras's per-output `Mean` trackers)."""
        return self.sums[...][2:] / jnp.maximum(self.sums[...][1], 1.0)


def _masked_sum(per_example, sample_weight):
    ctx = get_replica_context()
    assert ctx is not None  # a step runs in a replica context (None is cross-replica only)
    mask = ctx.batch_mask
    weighted = per_example if sample_weight is None else per_example * sample_weight
    valid = jnp.ones(per_example.shape[:1], bool) if mask is None else mask
    return jnp.where(valid, weighted, 0.0).sum(), valid.sum().astype(jnp.float32)


def forward_with_losses(module, x, policy):
    """(y_pred, own loss): the module's output in float32, computed in the policy's dtype
    (parameters cast), and the module's own losses summed (a Keras model's regularization
    and `add_loss` losses, float32; None for an NNX module)."""
    if policy.compute_dtype == "float32":
        return keras_hooks.call_with_losses(module, x)
    dtype = jnp.dtype(policy.compute_dtype)
    # flax types nnx.split's result as a variadic tuple, which mypy will not unpack into names.
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)  # type: ignore[misc]
    view = nnx.merge(graphdef, mixed_precision.cast_floating(params, dtype), rest)
    y_pred, own = keras_hooks.call_with_losses(view, mixed_precision.cast_floating(x, dtype))
    # What the call changed besides the parameters (batch statistics, seed counts) is kept.
    nnx.update(module, nnx.state(view, nnx.Not(nnx.Param)))
    y_pred = jax.tree.map(
        lambda a: a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a, y_pred
    )
    return y_pred, own


def forward(module, x, policy):
    """The module's output in float32, computed in the policy's dtype (parameters cast)."""
    return forward_with_losses(module, x, policy)[0]


def _own_loss_share(own):
    """This replica's (or micro-batch's) share of a loss computed whole on each of them (a
    Keras model's regularization losses), so the shares add up to the loss once."""
    if own is None:
        return 0.0
    ctx = get_replica_context()
    assert ctx is not None  # a step runs in a replica context (None is cross-replica only)
    strategy = ctx.strategy
    shares = strategy.micro_batches if strategy.replica_invariant else strategy.num_replicas_in_sync
    return own / shares


def _tracked(per_example, sample_weight, own):
    """(total, count) for the loss tracker: Keras logs the compiled loss plus the model's own
    losses, so each real example carries the own loss once."""
    total, count = _masked_sum(per_example, sample_weight)
    return (total, count) if own is None else (total + own * count, count)


def _unpack(batch):
    """(x, y, sample_weight) of a batch given as (x, y) or (x, y, sample_weight)."""
    if isinstance(batch, (tuple, list)) and len(batch) in (2, 3):
        return tuple(batch) + (None,) * (3 - len(batch))
    # Inside the step a bare batch is a tracer: name what the user passed, an array.
    what = (
        f"a tuple of {len(batch)}"
        if isinstance(batch, (tuple, list))
        else "an array (x alone)"
        if hasattr(batch, "shape")
        else f"a {type(batch).__name__}"
    )
    raise errors.InvalidBatchError(
        "fit / evaluate (and train_function / test_function): each batch must be a tuple "
        f"(x, y) or (x, y, sample_weight); received {what}. Give the labels with the inputs, "
        "e.g. experimental_distribute_dataset([(x, y), ...])."
    )


# What an optimizer step changes (and a skipped float16 step restores).
_UPDATED = nnx.Any(nnx.Param, nnx.OptState)


def _update_metrics(metrics, weighted, y, y_pred, sample_weight, outputs=None, where=()):
    # As Keras: `metrics` ignore the sample weights, `weighted_metrics` use them; with several
    # outputs each metric sees its output's y, y_pred and sample weight (`where`: its index).
    if outputs is not None:
        ys, preds = outputs.split(y, "y"), outputs.split(y_pred, "the model's output")
        weights = outputs.split(sample_weight, "sample_weight", shared=True)
        for metric, uses_weights, i in zip(metrics, weighted, where):
            metric.update_state(ys[i], preds[i], weights[i] if uses_weights else None)
        return
    for metric, uses_weights in zip(metrics, weighted):
        metric.update_state(y, y_pred, sample_weight if uses_weights else None)


def _losses(loss_obj, loss_weight, outputs, y, y_pred, sample_weight):
    """(per-example loss, the sample weight still to apply, each output's loss or None)."""
    if outputs is None:
        return loss_obj.per_example(y, y_pred) * loss_weight, sample_weight, None
    per_output = outputs.per_output(y, y_pred, sample_weight)
    return outputs.total(per_output), None, per_output


def _track(tracker, per_example, sample_weight, own, per_output):
    tracker.update(*_tracked(per_example, sample_weight, own))
    if per_output is not None and len(per_output) > 1:
        tracker.update_outputs(jnp.stack([_masked_sum(v, None)[0] for v in per_output]))


def make_train_step(
    loss_obj, loss_weight: float, policy, weighted, micro_batches=False, outputs=None, where=()
):
    """The training step; with `micro_batches` (replica-invariant mode) the loss, metrics and
    loss tracker run once per micro-batch and are summed in the fixed tree. `outputs` (an
    `outputs.Outputs`) for several outputs; `where`: each metric's output index."""

    def train_step(module, optimizer, metrics, tracker, loss_scale, batch):
        x, y, sample_weight = _unpack(batch)
        scale = 1.0 if loss_scale is None else loss_scale.scale[...]

        if micro_batches:
            score = _make_scorer(loss_obj, loss_weight, policy, weighted, outputs, where)

            def micro_loss(nodes, x, y, sample_weight):
                per_example, left, own = score(nodes, x, y, sample_weight)
                share = compute_average_loss(per_example, left) + _own_loss_share(own)
                return share * scale

            _, _, grads = invariant.micro_batch_call(
                micro_loss, (module, metrics, tracker), (x, y, sample_weight), differentiate=True, what="fit"
            )
            _apply_gradients(module, optimizer, grads[0], loss_scale, scale)
            return

        def loss_fn(module):
            y_pred, own = forward_with_losses(module, x, policy)
            per_example, left, per_output = _losses(loss_obj, loss_weight, outputs, y, y_pred, sample_weight)
            share = compute_average_loss(per_example, left) + _own_loss_share(own)
            return share * scale, (y_pred, per_example, left, own, per_output)

        # One packed all-reduce for every gradient (XLA:CPU's Gloo runs one per array).
        (_, (y_pred, per_example, left, own, per_output)), grads = gradients.packed_value_and_grad(
            loss_fn, module, has_aux=True
        )
        _apply_gradients(module, optimizer, grads, loss_scale, scale)
        _track(tracker, per_example, left, own, per_output)
        _update_metrics(metrics, weighted, y, y_pred, sample_weight, outputs, where)

    return train_step


def _apply_gradients(module, optimizer, grads, loss_scale, scale):
    """The optimizer update of gradients summed over replicas (and float16 loss scaling)."""
    if loss_scale is None:
        optimizer.update(module, grads)
        return
    # Gradients are already summed over replicas: an overflow on any replica is non-finite
    # here on every replica, so all skip the same step.
    grads = jax.tree.map(lambda g: g / scale, grads)
    finite = jnp.all(jnp.array([jnp.isfinite(g).all() for g in jax.tree.leaves(grads)]))
    before = jax.tree.map(lambda a: a, nnx.state((module, optimizer), _UPDATED))
    optimizer.update(module, grads)
    after = nnx.state((module, optimizer), _UPDATED)
    nnx.update((module, optimizer), jax.tree.map(lambda new, old: jnp.where(finite, new, old), after, before))
    loss_scale.adjust(finite)


def _make_scorer(loss_obj, loss_weight: float, policy, weighted, outputs=None, where=()):
    """`score((module, metrics, tracker), x, y, sample_weight)`: the forward pass, the
    per-example losses, the sample weight still to apply to them and the module's own loss
    (returned), and the loss tracker and metrics updated with them."""

    def score(nodes, x, y, sample_weight):
        module, metrics, tracker = nodes
        y_pred, own = forward_with_losses(module, x, policy)
        per_example, left, per_output = _losses(loss_obj, loss_weight, outputs, y, y_pred, sample_weight)
        _track(tracker, per_example, left, own, per_output)
        _update_metrics(metrics, weighted, y, y_pred, sample_weight, outputs, where)
        return per_example, left, own

    return score


def make_test_step(
    loss_obj, loss_weight: float, policy, weighted, micro_batches=False, outputs=None, where=()
):
    """`test_step(module, metrics, tracker, batch)`: the loss tracker and metrics updated on
    this replica's shard (per micro-batch in replica-invariant mode).
    """
    score = _make_scorer(loss_obj, loss_weight, policy, weighted, outputs, where)

    def update(nodes, x, y, sample_weight):
        score(nodes, x, y, sample_weight)
        return jnp.zeros((), jnp.float32)

    def test_step(module, metrics, tracker, batch):
        x, y, sample_weight = _unpack(batch)
        if micro_batches:
            invariant.micro_batch_call(
                update,
                (module, metrics, tracker),
                (x, y, sample_weight),
                differentiate=False,
                what="evaluate",
            )
        else:
            update((module, metrics, tracker), x, y, sample_weight)

    return test_step


def make_predict_step(policy, micro_batches=False):
    """`predict_step(module, batch)`: the module's outputs for this replica's shard under
    `policy` (per micro-batch in replica-invariant mode).
    """

    def predict_step(module, batch):
        if micro_batches:
            _, y_pred, _ = invariant.micro_batch_call(
                lambda nodes, x: (jnp.zeros((), jnp.float32), forward(nodes[0], x, policy)),
                (module,),
                (batch[0],),
                differentiate=False,
                has_aux=True,
                what="predict",
            )
            return y_pred
        return forward(module, batch[0], policy)

    return predict_step


PREDICT_FLOAT32 = make_predict_step(mixed_precision.Policy("float32"))


PREDICT_FLOAT32_MICRO = make_predict_step(mixed_precision.Policy("float32"), True)


@dataclasses.dataclass
class CompiledState:
    """What `Model.compile` builds besides the public attributes (optimizer, loss, metrics).

    Attributes:
      loss_scale: the float `loss_weights` scales the loss by.
      weighted: per metric, whether it is updated with the sample weights.
      metric_names: the log names of the metrics, in order.
      outputs: the `outputs.Outputs` of a several-output compile, else None.
      tracker: the `LossTracker` of the logged loss.
      dynamic_scale: the `LossScale` of mixed_float16 training, else None.
      rng: the NumPy generator that shuffles array inputs (seeded at compile).
      checked_inputs: input signatures already run abstractly through the module and loss.
      train_impl, test_impl, predict_impl: the default steps (`Model.train_step` & co. call
        them on the model's objects).
      train_fn, test_fn, predict_fn: what fit / evaluate / predict pass to `strategy.run`
        (they call `Model.train_step`, `test_step`, `predict_step`); `multi_step_of` (in
        multi_step.py) gives each one's several-steps-per-call form.
    """

    loss_scale: float
    weighted: tuple
    metric_names: list
    tracker: LossTracker
    dynamic_scale: Any
    rng: Any
    train_impl: Callable
    test_impl: Callable
    predict_impl: Callable
    train_fn: Callable | None = None
    test_fn: Callable | None = None
    predict_fn: Callable | None = None
    checked_inputs: dict = dataclasses.field(default_factory=dict)
    outputs: Any = None


def compiled_state(
    loss,
    loss_scale: float,
    policy,
    metric_names,
    weighted,
    dynamic: bool,
    micro: bool,
    outputs=None,
    where=(),
) -> CompiledState:
    """`Model.compile`'s `CompiledState` (without the bound step functions): the default
    steps for `loss` (scaled by `loss_scale`) under `policy`, the metrics' names and weight
    flags, dynamic loss scaling if `dynamic`, micro-batched steps if `micro`; `outputs` and
    `where` (each metric's output) for several outputs."""
    return CompiledState(
        loss_scale=loss_scale,
        weighted=weighted,
        metric_names=metric_names,
        outputs=outputs,
        tracker=LossTracker(len(outputs.loss_log_names) if outputs is not None else 0),
        dynamic_scale=mixed_precision.LossScale() if dynamic else None,
        rng=np.random.default_rng(0),
        train_impl=make_train_step(loss, loss_scale, policy, weighted, micro, outputs, where),
        test_impl=make_test_step(loss, loss_scale, policy, weighted, micro, outputs, where),
        predict_impl=make_predict_step(policy, micro),
    )
