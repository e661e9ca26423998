"""The fixed summation tree of replica-invariant mode: float sums whose bits do not depend on how
many replicas hold the terms.

`pairwise_sum` adds the rows of an array in the balanced pairwise tree; `exact_psum` continues
that tree across the replicas inside `strategy.run` (an all-to-all gives replica j chunk j of
every replica's partial sum, it adds them pairwise in replica order, an all-gather hands the
chunks to everyone); `barrier` keeps XLA from reassociating the terms (docs/design.md,
"Replica invariance").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mirrax._src.distribute import _compat
from mirrax._src.distribute.axis import REPLICA_AXIS


def pairwise_sum(x):
    """The balanced pairwise tree sum over the leading axis of `x` (a power of two long).

    ((x0 + x1) + (x2 + x3)) + ...: the order that `exact_psum` continues across replicas.
    The rows pass an optimization barrier first, and on CPU the step is compiled without the
    algebraic simplifier (`compiler_options`), so XLA keeps these additions as written.
    """
    parts = list(barrier([x[i] for i in range(x.shape[0])]))
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] for i in range(0, len(parts), 2)]
    return parts[0]


def exact_psum(tree):
    """Sums each leaf over the replicas in the fixed pairwise tree; every replica gets the same bits.

    Inside `strategy.run` of a strategy in replica-invariant mode. Float leaves are packed per
    dtype into one vector: one all-to-all and one all-gather for the whole tree. Integer and
    bool leaves use `psum`, which is exact in any order.

    Args:
      tree: a pytree of arrays, this replica's partial sums (varying or not).

    Returns:
      The same pytree, summed over replicas, unvarying (as `jax.lax.psum` returns it).
    """
    leaves, treedef = jax.tree.flatten(tree)
    out = [None] * len(leaves)
    groups: dict = {}
    for i, leaf in enumerate(leaves):
        leaf = jnp.asarray(leaf)
        leaves[i] = leaf
        if jnp.issubdtype(leaf.dtype, jnp.inexact):
            groups.setdefault(leaf.dtype, []).append(i)
        else:
            integer = leaf.astype(jnp.int32) if leaf.dtype == jnp.bool_ else leaf
            out[i] = jax.lax.psum(_compat.pvary(integer, REPLICA_AXIS), REPLICA_AXIS)
    for indices in groups.values():
        flat = jnp.concatenate([leaves[i].reshape(-1) for i in indices])
        total = _exact_psum_flat(_compat.pvary(flat, REPLICA_AXIS))
        offset = 0
        for i in indices:
            size = leaves[i].size
            out[i] = total[offset : offset + size].reshape(leaves[i].shape)
            offset += size
    return jax.tree.unflatten(treedef, out)


def _exact_psum_flat(flat):
    replicas = jax.lax.axis_size(REPLICA_AXIS)
    n = flat.shape[0]
    chunk = -(-n // replicas) if n else 1
    x = jnp.pad(flat, (0, chunk * replicas - n)).reshape(replicas, chunk)
    if replicas > 1:
        # Row j becomes replica j's chunk of this replica's index: the tree's next levels.
        x = jax.lax.all_to_all(x, REPLICA_AXIS, 0, 0, tiled=True)
    return _compat.all_gather_invariant(pairwise_sum(x), REPLICA_AXIS)[:n]


def exact_pmean(tree):
    """`exact_psum(tree)` divided by the replica count (floats keep their dtype)."""
    replicas = jax.lax.axis_size(REPLICA_AXIS)

    def mean(x):
        x = jnp.asarray(x)
        dtype = x.dtype if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.float32
        return x.astype(dtype) / jnp.asarray(replicas, dtype)

    return jax.tree.map(mean, exact_psum(tree))


def barrier(tree):
    """`lax.optimization_barrier(tree)` keeping each leaf's vma type (one barrier would type
    every output as varying if any input is)."""
    leaves, treedef = jax.tree.flatten(tree)
    groups: dict = {}
    for i, leaf in enumerate(leaves):
        groups.setdefault(REPLICA_AXIS in _compat.varying_axes(leaf), []).append(i)
    out = list(leaves)
    for indices in groups.values():
        for i, value in zip(indices, jax.lax.optimization_barrier([leaves[i] for i in indices])):
            out[i] = value
    return jax.tree.unflatten(treedef, out)
