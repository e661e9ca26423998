"""The reductions of mirrax's losses other than the global mean: Keras's `reduction=None`
(one loss per example, for `mirrax.compute_average_loss`) and "sum", with tf.keras's
`Reduction` names."""

from __future__ import annotations

import jax.numpy as jnp

from mirrax import errors
from mirrax._src.distribute.losses import compute_average_loss


class Reduction:
    """tf.keras's `tf.keras.losses.Reduction` names, for `reduction=` of mirrax's losses (Keras 3
    spells them as strings; both spellings are accepted)."""

    NONE = "none"
    SUM = "sum"
    SUM_OVER_BATCH_SIZE = "sum_over_batch_size"


# Keras 3's spellings (`keras.losses.Loss(reduction=...)`) of the reductions mirrax has.
_REDUCTIONS = {
    None: None,
    "none": None,
    "sum": "sum",
    "sum_over_batch_size": "sum_over_batch_size",
    "mean": "sum_over_batch_size",
}


def check_reduction(owner: str, reduction):
    """The reduction `reduction` names: None (one loss per example), "sum" or
    "sum_over_batch_size" (Keras's "mean" is the same).

    Raises:
      UnsupportedArgumentError: another value (tf.keras's "auto", Keras's
        "mean_with_sample_weight", anything else), naming the accepted ones.
    """
    if isinstance(reduction, str) or reduction is None:
        key = reduction.lower() if isinstance(reduction, str) else None
        if key in _REDUCTIONS:
            return _REDUCTIONS[key]
    raise errors.UnsupportedArgumentError(
        f"{owner}(reduction={reduction!r}): mirrax's losses reduce by 'sum_over_batch_size' "
        "(the default: inside strategy.run this replica's share of the global mean), 'sum' (the "
        "weighted sum of the replica's real examples) or None / 'none' (one loss per example, "
        "TF's Reduction.NONE, for mirrax.compute_average_loss)."
    )


def unaveraged(loss, per_example, sample_weight):
    """`loss(...)` for `loss.reduction` None: each example's loss times its weight, shape
    (batch,), as Keras's (padding rows included: `compute_average_loss` masks them); "sum":
    the weighted sum over the replica's real examples, a scalar.

    Raises:
      IncompatibleInputError: `sample_weight` is neither a scalar nor one weight per example.
    """
    if sample_weight is not None:
        weight = jnp.asarray(sample_weight, jnp.float32)
        if weight.ndim > 1 and all(d == 1 for d in weight.shape[1:]):
            weight = weight.reshape(weight.shape[:1])
        if weight.ndim > 1 or (weight.ndim == 1 and weight.shape != per_example.shape):
            raise errors.IncompatibleInputError(
                f"{loss.name}: with reduction={loss.reduction!r}, sample_weight must be a "
                f"scalar or one weight per example, shape {per_example.shape}; received "
                f"shape {weight.shape}."
            )
        per_example = per_example * weight
    if loss.reduction is None:
        return per_example
    return compute_average_loss(per_example, global_batch_size=1)
