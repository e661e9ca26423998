"""Loss scaling for synchronous data parallelism: `compute_average_loss`, `scale_regularization_loss`.

Each replica returns its share of the global loss, so that the gradients JAX sums over the
replicas equal the gradient of the global-batch loss (the arithmetic of TF's MirroredStrategy).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mirrax import errors
from mirrax._src.distribute import _compat
from mirrax._src.distribute.current import get_replica_context, in_cross_replica_context
from mirrax._src.distribute.replica_context import REPLICA_AXIS, current_replica_context
from mirrax._src.distribute.values import is_distributed


def compute_average_loss(per_example_loss, sample_weight=None, global_batch_size=None):
    """This replica's share of the global mean loss, as `tf.nn.compute_average_loss`.

    Returns `sum(per_example_loss * sample_weight over real examples) / divisor`: the divisor is
    `global_batch_size` when given; otherwise the number of real (unmasked) examples summed over
    ALL replicas, i.e. the true global batch size of this step. Padding rows of a partial batch
    (`get_replica_context().batch_mask`) never count, and a loss of NaN/inf in a padding row is
    ignored. An empty shard contributes 0.0, never NaN.

    Differs from TF on partial batches when `global_batch_size` is omitted: TF divides by this
    replica's batch size times `num_replicas_in_sync`, which over-weights the examples of short
    shards; mirrax divides by the true number of examples, so each example counts once. Note
    that weights are not a divisor: sample weights [1, 0] still divide by 2 examples.

    Args:
      per_example_loss: float array of shape (per_replica_batch, ...); extra axes are summed.
      sample_weight: None, a scalar, or an array broadcastable to `per_example_loss`.
      global_batch_size: the GLOBAL batch size (examples over all replicas per step), an int,
        or None to count the real examples.

    Returns:
      A float scalar (this replica's share; `strategy.reduce("sum", ...)` of the replicas'
      values is the global mean).

    Raises:
      ReplicaContextError: called in cross-replica context (inside `scope()`, outside `run`)
        without `global_batch_size`, where there is no replica to count examples over.
      ValueError: `per_example_loss` is a scalar, or its first axis does not match the batch.
    """
    if is_distributed(per_example_loss):
        raise errors.InvalidArgumentTypeError(
            "compute_average_loss: per_example_loss is a "
            f"{type(per_example_loss).__name__} (a value of all replicas). Call "
            "compute_average_loss inside the function given to strategy.run, on that replica's "
            "per-example losses; outside, combine results with strategy.reduce."
        )
    if global_batch_size is not None and (
        isinstance(global_batch_size, bool)
        or not (
            isinstance(global_batch_size, (int, np.integer))
            or (
                isinstance(global_batch_size, (jax.Array, np.ndarray))
                and global_batch_size.ndim == 0
                and jnp.issubdtype(global_batch_size.dtype, jnp.integer)
            )
        )
    ):
        # A fractional size (len(x) / 2) would scale the loss and gradients silently.
        raise errors.InvalidArgumentTypeError(
            "compute_average_loss: global_batch_size must be an int (the number of examples per "
            f"step over all replicas) or None; received {global_batch_size!r} of type "
            f"{type(global_batch_size).__name__}. Pass an int, e.g. "
            "global_batch_size=batch_size_per_replica * strategy.num_replicas_in_sync (use // "
            "rather than /), or omit it to count the real examples."
        )
    if isinstance(global_batch_size, (int, np.integer)) and not global_batch_size > 0:
        raise errors.InvalidArgumentError(
            f"compute_average_loss: global_batch_size must be positive; received "
            f"{global_batch_size!r}. Pass the number of examples per step over all replicas, "
            "or omit it to count the real examples."
        )
    try:
        loss = jnp.asarray(per_example_loss)
    except TypeError:
        raise errors.InvalidArgumentTypeError(
            "compute_average_loss: per_example_loss must be an array of losses, one per example "
            f"(shape (batch, ...)); received {per_example_loss!r:.80} of type "
            f"{type(per_example_loss).__name__}."
        ) from None
    if loss.ndim == 0:
        raise errors.InvalidArgumentError(
            "compute_average_loss: per_example_loss must have a leading batch axis (one loss "
            "per example), but received a scalar. Use a loss with reduction=None, e.g. "
            "optax.softmax_cross_entropy_with_integer_labels(logits, labels)."
        )
    if in_cross_replica_context() and global_batch_size is None:
        raise errors.ReplicaContextError(
            "compute_average_loss was called in cross-replica context (inside strategy.scope() "
            "but outside strategy.run) without global_batch_size, so there are no replicas to "
            "count examples over. Call it inside the function given to strategy.run, or pass "
            "global_batch_size=."
        )
    if not jnp.issubdtype(loss.dtype, jnp.floating):
        loss = loss.astype(jnp.float32)
    ctx = get_replica_context()
    mask = ctx.batch_mask if ctx is not None else None
    valid = jnp.ones(loss.shape[:1], bool) if mask is None else mask
    if valid.shape[0] != loss.shape[0]:
        raise errors.InvalidArgumentError(
            f"compute_average_loss: per_example_loss has {loss.shape[0]} rows but this replica's "
            f"batch has {valid.shape[0]}; compute one loss per example of the batch that "
            "strategy.run passed in."
        )
    if sample_weight is None:
        weighted = loss
    else:
        weight = jnp.asarray(sample_weight, loss.dtype)
        try:
            weighted = loss * weight.reshape(weight.shape + (1,) * (loss.ndim - weight.ndim))
        except (TypeError, ValueError):
            raise errors.InvalidArgumentError(
                f"compute_average_loss: sample_weight of shape {weight.shape} does not fit "
                f"per_example_loss of shape {loss.shape}; give one weight per example (shape "
                f"({loss.shape[0]},)) or a scalar."
            ) from None
    keep = valid.reshape(valid.shape + (1,) * (loss.ndim - 1))
    total = jnp.where(keep, weighted, jnp.zeros((), loss.dtype)).sum()
    if global_batch_size is not None:
        return _per_replica(total / jnp.asarray(global_batch_size, loss.dtype))
    count = valid.sum()
    if current_replica_context() is not None:
        # strategy.run knows the step's example count from the host (a distributed batch's
        # lengths); otherwise count the real rows over the replicas.
        known = ctx.example_count if mask is not None else None
        count = known if known is not None else jax.lax.psum(count, REPLICA_AXIS)
    return _per_replica(total / jnp.maximum(count, 1).astype(loss.dtype))


def _per_replica(loss):
    """Marks a replica's loss share as varying, so its gradient is summed over the replicas.

    JAX sums the gradient of a replicated parameter only through values that vary across
    replicas; a share computed from replicated values alone (a penalty) would otherwise give
    one replica's gradient. Marking it varying gives TF's arithmetic in every case: the
    gradient is the sum over replicas of each replica's gradient.
    """
    if current_replica_context() is None:
        return loss
    return _compat.pvary(loss, REPLICA_AXIS)


def scale_regularization_loss(regularization_loss):
    """Divides a regularization loss by `num_replicas_in_sync`, as TF's function of that name.

    A penalty added on every replica is then counted once in the gradient JAX sums over the
    replicas (not `num_replicas_in_sync` times).

    Args:
      regularization_loss: a float scalar (e.g. 0.5 * 0.01 * sum(w ** 2)).

    Returns:
      `regularization_loss / num_replicas_in_sync`, same dtype.

    Raises:
      ReplicaContextError: called in cross-replica context (inside `scope()`, outside `run`).
    """
    if in_cross_replica_context():
        raise errors.ReplicaContextError(
            "scale_regularization_loss was called in cross-replica context (inside "
            "strategy.scope() but outside strategy.run); call it inside the function given to "
            "strategy.run, where each replica adds its share of the penalty."
        )
    loss = jnp.asarray(regularization_loss)
    return _per_replica(loss / jnp.asarray(get_replica_context().num_replicas_in_sync, loss.dtype))
