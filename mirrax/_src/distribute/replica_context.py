"""Where code runs: the thread-local strategy stack and the replica context inside `run`.

As in tf.distribute there are two contexts. Cross-replica context: inside `strategy.scope()` but
outside `strategy.run`; `get_replica_context()` returns None there. Replica context: inside the
function given to `strategy.run`, where `get_replica_context()` returns a `ReplicaContext` whose
collectives are JAX collectives over `REPLICA_AXIS`. Outside every scope, code runs in the
default strategy's replica context (one replica, collectives are the identity).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mirrax import errors
from mirrax._src.distribute import exact_sums
from mirrax._src.distribute.axis import REPLICA_AXIS
from mirrax._src.distribute.reduce import ReduceOp


class _ThreadState(threading.local):
    def __init__(self):
        self.strategy_stack: list = []
        self.replica_context: ReplicaContext | None = None


_state = _ThreadState()


class ReplicaContext:
    """The replica's view inside `strategy.run`, as `tf.distribute.ReplicaContext`.

    Attributes:
      strategy: the strategy running the function.
      num_replicas_in_sync: number of replicas (a Python int, all workers together).
      replica_id_in_sync_group: this replica's index in `[0, num_replicas_in_sync)`, an int32
        scalar (traced inside `run`; a Python 0 in the default replica context).
      batch_mask: bool array of shape (per_replica_batch,) marking the real examples of this
        replica's shard of the current distributed batch (False for the padding that makes every
        shard the same static size), or None when no input of `run` came from a distributed
        dataset. Reading it marks the step as one that masks its reductions; a step that never
        does, run on a padded batch, gets `mirrax.PaddedBatchWarning` (docs/design.md, "Input").
    """

    def __init__(self, strategy, batch_mask=None, traced: bool = True, example_count=None):
        self.strategy = strategy
        self._batch_mask = batch_mask
        # Whether the traced step read the mask (directly, or through compute_average_loss,
        # mirrax's losses and metrics): a step that did not, run on a padded batch, sums its
        # padding rows (strategy.run warns; docs/design.md, "Input").
        self.mask_consulted = False
        # int32 scalar: the real examples of the distributed batch over ALL replicas, known on
        # the host (so `compute_average_loss` need not sum them across replicas); None if unknown.
        self._example_count = example_count
        self._traced = traced
        # Replica-invariant mode: ids of the arrays that invariant.micro_batch_call already
        # combined over every micro-batch of every replica, and whether it ran at all.
        self._combined: set = set()
        self.micro_batches_used = False
        # Sharded optimizer state: id of each all-gathered gradient -> (its reduce-scattered
        # slice, the slice's PartitionSpec, the gathered array), read by the deferred update.
        self.scattered_gradients: dict = {}

    @property
    def batch_mask(self):
        if self._batch_mask is not None:
            self.mask_consulted = True
        return self._batch_mask

    @batch_mask.setter
    def batch_mask(self, mask):
        # Another mask (a micro-step of steps_per_execution) has its own example count.
        if mask is not self._batch_mask:
            self._example_count = None
        self._batch_mask = mask

    def peek_batch_mask(self):
        """`batch_mask` for mirrax's own plumbing (splitting a batch into micro-batches), which
        does not mark the step as one that masks its reductions."""
        return self._batch_mask

    @property
    def traced(self) -> bool:
        """True inside `strategy.run` (collectives are real); False in the default context."""
        return self._traced

    @property
    def example_count(self):
        """The int32 count of real examples of the distributed batch over all replicas, when
        `strategy.run` knows it from the host; else None."""
        return self._example_count

    def mark_combined(self, value) -> None:
        """Records that `value` (a variable's new value) is already combined over all
        micro-batches of all replicas, so the write-back must not combine it again."""
        self._combined.add(id(value))
        self.micro_batches_used = True

    def is_combined(self, value) -> bool:
        return id(value) in self._combined

    @contextlib.contextmanager
    def micro_batch(self, mask, example_count):
        """Sets the batch mask to one micro-batch's (replica-invariant mode), keeping the
        whole step's example count, so `compute_average_loss` divides by the global count."""
        saved = self._batch_mask, self._example_count
        self._batch_mask, self._example_count = mask, example_count
        try:
            yield self
        finally:
            self._batch_mask, self._example_count = saved

    @property
    def num_replicas_in_sync(self) -> int:
        return self.strategy.num_replicas_in_sync

    @property
    def replica_id_in_sync_group(self):
        if not self._traced:
            return 0
        return jax.lax.axis_index(REPLICA_AXIS)

    def all_reduce(self, reduce_op, value):
        """Combines `value` over all replicas; every replica gets the result.

        As `tf.distribute.ReplicaContext.all_reduce`: SUM adds, MEAN adds and divides by
        `num_replicas_in_sync`. `value` is any pytree of arrays; shapes and dtypes are kept (MEAN
        of integers gives floats, as `jnp.mean`). In replica-invariant mode float sums follow
        the fixed pairwise tree over the replica index (every replica gets the same bits).

        Raises:
          ValueError: `reduce_op` is not SUM or MEAN.
        """
        op = ReduceOp.from_any(reduce_op)
        if not self._traced:
            return jax.tree.map(jnp.asarray, value)
        if self.strategy.replica_invariant:
            # The fixed pairwise tree over the replicas, the same bits on every replica.
            return exact_sums.exact_psum(value) if op is ReduceOp.SUM else exact_sums.exact_pmean(value)
        if op is ReduceOp.SUM:
            return jax.tree.map(lambda x: jax.lax.psum(x, REPLICA_AXIS), value)
        return jax.tree.map(lambda x: jax.lax.pmean(x, REPLICA_AXIS), value)

    def all_gather(self, value, axis: int = 0):
        """Concatenates every replica's `value` along `axis`, as `ReplicaContext.all_gather`.

        Each leaf of shape (..., n, ...) (n at `axis`) becomes (..., n * num_replicas_in_sync, ...),
        replica 0's block first. Padding rows of a partial batch are included: gather
        `batch_mask` alongside to know which rows are real.
        """
        if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
            raise errors.InvalidArgumentTypeError(
                f"ReplicaContext.all_gather: axis must be an int; received {axis!r} of type "
                f"{type(axis).__name__}."
            )

        def gather(x):
            x = jnp.asarray(x)
            if not -x.ndim <= axis < max(x.ndim, 1) or x.ndim == 0:
                raise errors.InvalidArgumentError(
                    f"ReplicaContext.all_gather: axis {axis} is out of range for a value of "
                    f"shape {x.shape} (rank {x.ndim}); use an axis in [{-x.ndim}, {x.ndim})"
                    + (", or gather x[None] (shape (1,))." if x.ndim == 0 else ".")
                )
            if not self._traced:
                return x
            return jax.lax.all_gather(x, REPLICA_AXIS, axis=int(axis) % x.ndim, tiled=True)

        return jax.tree.map(gather, value)

    def __repr__(self) -> str:
        return (
            f"ReplicaContext(strategy={type(self.strategy).__name__}, "
            f"num_replicas_in_sync={self.num_replicas_in_sync})"
        )


def current_strategy_in_scope():
    """The innermost strategy whose `scope()` is open on this thread, or None."""
    return _state.strategy_stack[-1] if _state.strategy_stack else None


@contextlib.contextmanager
def strategy_scope(strategy):
    """Makes `strategy` the innermost open scope on this thread while the block runs."""
    _state.strategy_stack.append(strategy)
    try:
        yield strategy
    finally:
        _state.strategy_stack.pop()


def current_replica_context() -> ReplicaContext | None:
    """The replica context of the `strategy.run` being traced on this thread, or None."""
    return _state.replica_context


class replica_context_scope:
    """Installs a `ReplicaContext` while `strategy.run` traces the user's function."""

    def __init__(self, ctx: ReplicaContext):
        self._ctx = ctx
        self._saved: Any = None

    def __enter__(self):
        self._saved = _state.replica_context
        _state.replica_context = self._ctx
        return self._ctx

    def __exit__(self, *exc):
        _state.replica_context = self._saved
        return False
