"""Batch-wide layers on a padded batch: BatchNorm statistics and activity regularizers over the
real rows only.

A partial last batch reaches each replica padded to the per-replica batch size, with the
replica context's `batch_mask` marking the real rows. Losses and metrics honour the mask; the
layers that reduce over the batch inside the model do not know it. While a replica function is
traced, `masked_batch_layers()` puts wrappers in place of `nnx.BatchNorm.__call__`, Keras 3's
`BatchNormalization.call` / `_moments` and the `activity_regularizer` Keras layers read, which,
when the layer's input has the batch's rows first and the caller gave no mask of its own:

- compute the batch statistics over the real rows only. Synchronized statistics
  (`nnx.BatchNorm(axis_name=mirrax.REPLICA_AXIS)`; Keras 3 refuses `synchronized=True` on
  JAX) are count-weighted: the sums and the real-row counts are added over the replicas, so
  replicas with different numbers of real rows (or none) give the whole real batch's;
- leave the moving statistics of a replica whose rows are all padding unchanged (unsynchronized
  statistics of no rows are undefined; its old value then enters mirrax's MEAN of the replicas'
  BatchStats instead of zeros);
- regularize a layer's output with its padding rows zeroed and divided by the real examples'
  count (Keras divides by the rows it sees), so the summed loss is Keras's on the smaller batch.

Full and partial batches run one program (the mask is a traced input), so a `lax.cond` on
"every row is real" takes the layer's own statistics on a full batch and computes the masked
ones only on a padded batch: the same values (XLA may round the last bit differently, fusing
around the cond), at the cost of the cond (measured by benchmarks/batch_norm_mask.py). See
docs/design.md, "Padded batches and batch-wide layers".
"""

from __future__ import annotations

import functools
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx.nn import normalization as flax_normalization

from mirrax._src.distribute import _compat, trace_patches
from mirrax._src.distribute.axis import REPLICA_AXIS
from mirrax._src.distribute.replica_context import current_replica_context

_original_nnx_call = nnx.BatchNorm.__call__
_original_compute_stats = getattr(flax_normalization, _compat.FLAX_COMPUTE_STATS)


class _Active(threading.local):
    """The row mask of the BatchNorm call being traced on this thread (None outside one), and
    whether its statistics were computed from the batch (not the moving averages)."""

    def __init__(self):
        self.rows = None
        self.used = False


_active = _Active()


def _rows_of(x):
    """The replica's (rows,) bool batch mask when `x` has the batch's rows first, else None."""
    ctx = current_replica_context()
    if ctx is None or not ctx.traced:
        return None
    mask = ctx.peek_batch_mask()
    shape = jnp.shape(x)
    if mask is None or not shape or shape[0] != mask.shape[0]:
        return None
    return mask


def _expand(rows, ndim: int):
    return jnp.reshape(rows, rows.shape + (1,) * (ndim - 1))


def _abs_sq(x):
    """|x|^2 elementwise, as flax's BatchNorm computes it."""
    if jnp.iscomplexobj(x):
        return jnp.square(x.real) + jnp.square(x.imag)
    return jnp.square(x)


def _masked_sum(x, keep, axes, keepdims=False):
    return jnp.sum(jnp.where(keep, x, jnp.zeros((), x.dtype)), axes, keepdims=keepdims)


def _count(keep, shape, axes, dtype, keepdims=False):
    """The number of selected elements per feature, as a float of `dtype`."""
    return jnp.sum(jnp.broadcast_to(keep, shape), axes, dtype=dtype, keepdims=keepdims)


# -- nnx.BatchNorm ----------------------------------------------------------------------------


def _stats(
    x, axes, dtype, axis_name=None, axis_index_groups=None, use_mean=True, use_fast_variance=True, mask=None
):
    """flax's `_compute_stats` over the real rows of the BatchNorm call now traced: flax's own
    result on a full batch (selected: the same values as without masking), the masked one on
    a padded batch."""
    rows = _active.rows
    unmasked = _original_compute_stats(
        x, axes, dtype, axis_name, axis_index_groups, use_mean, use_fast_variance, mask
    )
    if rows is None or mask is not None or axis_index_groups is not None:
        return unmasked
    _active.used = True
    dtype = jnp.promote_types(jnp.result_type(x) if dtype is None else dtype, jnp.float32)
    x = jnp.asarray(x, dtype)
    axes = tuple(sorted({a % x.ndim for a in (axes if isinstance(axes, tuple) else (axes,))}))
    keep = _expand(rows, x.ndim)
    count = _count(keep, x.shape, axes, x.real.dtype)
    if axis_name is None:
        full = jnp.all(rows)
    else:
        count = jax.lax.psum(count, axis_name)
        size = int(np.prod([x.shape[a] for a in axes])) * jax.lax.psum(1, axis_name)
        full = jnp.all(count == size)
    safe = jnp.maximum(count, 1)

    def mean(*values):
        """The real rows' means of `values` (over all replicas when synchronized)."""
        sums = [_masked_sum(v, keep, axes) for v in values]
        if axis_name is not None:
            sums = list(jax.lax.psum(jnp.stack(sums), axis_name))
        return [s / safe for s in sums]

    def masked():
        if not use_mean:
            var = mean(_abs_sq(x))[0]
            return jnp.zeros_like(var), var
        if use_fast_variance:
            mu, mu2 = mean(x, _abs_sq(x))
            return mu, jnp.maximum(0.0, mu2 - _abs_sq(mu))
        mu = mean(x)[0]
        return mu, mean(_abs_sq(x - jnp.expand_dims(mu, axes)))[0]

    unmasked = tuple(jnp.asarray(u, dtype) for u in unmasked)
    # A cond, not a where: a full batch runs only the layer's own reductions. `full` is the
    # same on every replica when synchronized (from the psum of the counts), so all replicas
    # take one branch and its psum.
    return jax.lax.cond(full, lambda: unmasked, lambda: tuple(masked()))


@functools.wraps(_original_nnx_call)
def _nnx_call(self, x, use_running_average=None, *, mask=None):
    rows = None if mask is not None else _rows_of(x)
    feature_axes = tuple(self.axis) if isinstance(self.axis, (tuple, list)) else (self.axis,)
    if (
        rows is None
        or 0 in {a % jnp.ndim(x) for a in feature_axes}
        or self.axis_name not in (None, REPLICA_AXIS)
    ):
        return _original_nnx_call(self, x, use_running_average, mask=mask)
    old = self.mean[...], self.var[...]
    saved = _active.rows, _active.used
    _active.rows, _active.used = rows, False
    try:
        y = _original_nnx_call(self, x, use_running_average)
        used = _active.used
    finally:
        _active.rows, _active.used = saved
    if used and self.axis_name is None:
        real = jnp.any(rows)
        self.mean[...] = jnp.where(real, self.mean[...], old[0])
        self.var[...] = jnp.where(real, self.var[...], old[1])
    return y


# -- Keras 3 BatchNormalization and activity regularizers -------------------------------------


def _keras_moments(original, self, inputs, mask):
    """Keras's `_moments` over the real rows (and the Keras mask, if any): Keras's own result
    on a full batch (selected, so the same bits as without masking)."""
    rows = _active.rows
    if rows is None:
        return original(self, inputs, mask)
    _active.used = True
    ndim = inputs.ndim
    keep = _expand(rows, ndim)
    if mask is not None:  # Keras's own masked moments, of the combined mask
        return original(self, inputs, jnp.logical_and(jnp.asarray(mask, bool), keep[..., 0]))
    axes = tuple(i for i in range(ndim) if i != self.axis % ndim)

    def masked():
        count = jnp.maximum(_count(keep, inputs.shape, axes, inputs.dtype, True), 1)
        mean = _masked_sum(inputs, keep, axes, True) / count
        var = _masked_sum(jnp.square(inputs - mean), keep, axes, True) / count
        return tuple(jnp.asarray(jnp.squeeze(m, axes), u.dtype) for m, u in zip((mean, var), own))

    own = tuple(original(self, inputs, None))
    # A cond, not a where: a full batch runs only Keras's own reductions.
    return jax.lax.cond(jnp.all(rows), lambda: own, masked)


def _keras_call(original, self, inputs, training=None, mask=None):
    # Keras 3 refuses synchronized=True on the JAX backend (at construction).
    rows = _rows_of(inputs)
    if rows is None or self.axis % jnp.ndim(inputs) == 0:
        return original(self, inputs, training, mask)
    old = self.moving_mean.value, self.moving_variance.value
    saved = _active.rows, _active.used
    _active.rows, _active.used = rows, False
    try:
        outputs = original(self, inputs, training, mask)
        used = _active.used
    finally:
        _active.rows, _active.used = saved
    if used:
        real = jnp.any(rows)
        self.moving_mean.assign(jnp.where(real, self.moving_mean.value, old[0]))
        self.moving_variance.assign(jnp.where(real, self.moving_variance.value, old[1]))
    return outputs


class _MaskedActivity:
    """A layer's activity regularizer applied to its output's real rows, scaled so that Keras's
    division by the rows it sees becomes a division by the real examples' count over the step
    (this replica's or micro-batch's share: the step divides the model's own losses by the
    replicas or micro-batches, steps.py)."""

    def __init__(self, regularizer):
        self.regularizer = regularizer

    def __call__(self, output):
        rows = _rows_of(output)
        if rows is None:
            return self.regularizer(output)
        loss = self.regularizer(jnp.where(_expand(rows, output.ndim), output, jnp.zeros((), output.dtype)))
        ctx = current_replica_context()
        assert ctx is not None  # a patched regularizer is called only while strategy.run traces
        strategy = ctx.strategy
        shares = strategy.micro_batches if strategy.replica_invariant else strategy.num_replicas_in_sync
        count = ctx.example_count
        if count is None:
            count = jax.lax.psum(rows.sum(dtype=jnp.int32), REPLICA_AXIS)
        dtype = jnp.result_type(loss)
        # On a full batch count == rows * shares, so the factor is exactly 1.
        factor = jnp.asarray(rows.shape[0] * shares, dtype) / jnp.maximum(jnp.asarray(count, dtype), 1)
        return loss * factor


def _activity_property():
    def get(layer):
        regularizer = layer.__dict__.get("activity_regularizer")
        if regularizer is None or current_replica_context() is None:
            return regularizer
        return _MaskedActivity(regularizer)

    def put(layer, value):
        layer.__dict__["activity_regularizer"] = value

    return property(get, put)


def _keras_patches() -> list:
    """(owner, name, wrapper) for Keras 3's layers, when Keras is loaded (no Keras model can be
    traced otherwise)."""
    keras = sys.modules.get("keras")
    layers = getattr(keras, "layers", None)
    if layers is None or not hasattr(layers, "BatchNormalization"):
        return []
    bn = layers.BatchNormalization
    call, moments = bn.__dict__.get("call"), bn.__dict__.get(_compat.KERAS_MOMENTS)
    if call is None or moments is None:
        return []
    return [
        (bn, "call", functools.wraps(call)(functools.partial(_keras_call, call))),
        (bn, _compat.KERAS_MOMENTS, functools.wraps(moments)(functools.partial(_keras_moments, moments))),
        (layers.Layer, "activity_regularizer", _activity_property()),
    ]


class _Method:
    """A wrapper installed as a method: `functools.partial` objects do not bind `self`."""

    def __init__(self, function):
        self.function = function

    def __get__(self, obj, owner=None):
        return self.function if obj is None else functools.partial(self.function, obj)


def _patches() -> list:
    patches = [
        (nnx.BatchNorm, "__call__", _nnx_call),
        (flax_normalization, _compat.FLAX_COMPUTE_STATS, _stats),
    ]
    for owner, name, wrapper in _keras_patches():
        patches.append((owner, name, wrapper if isinstance(wrapper, property) else _Method(wrapper)))
    return patches


_PATCHES = trace_patches.TracePatches(_patches)


def masked_batch_layers():
    """Within: BatchNorm layers and Keras activity regularizers see only the real rows of the
    replica's batch (see the module's docstring). Restored on exit; nests."""
    return _PATCHES.active()
