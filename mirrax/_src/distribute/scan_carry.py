"""Recurrent layers under the replica mesh: a `jax.lax.scan` whose initial carry is the same on
every replica (zeros) but whose new carry differs per replica (it adds the batch).

JAX's scan refuses such a carry inside `shard_map` ("carry input and carry output must have
equal types"). While a replica function is traced, `varying_carries()` puts a wrapper in place of
`jax.lax.scan` (which Keras's JAX backend and flax's `nnx.scan` / `nnx.RNN` call by attribute):
it runs the user's call as it is, and only on that exact error marks the initial carry's leaves
that the body makes varying as varying too (`pcast` / `pvary`, no data movement; its transpose
is a psum, so gradients through the carry stay the global sum), then calls scan again.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import jax

from mirrax._src.distribute import _compat

_CARRY_ERROR = "carry input and carry output must have equal types"
_lock = threading.Lock()
_depth = 0
_original_scan = jax.lax.scan


def _axes(x) -> frozenset:
    manual = getattr(x, "manual_axis_type", None)  # a ShapeDtypeStruct from eval_shape
    if manual is not None:
        return frozenset(manual.varying)
    vma = getattr(x, "vma", None)
    return frozenset(vma) if vma is not None else _compat.varying_axes(x)


def _vary(x, axes):
    for axis in sorted(axes):
        x = _compat.pvary(x, axis)
    return x


def _varying_init(f, init, xs):
    """`init` with each leaf made varying along the axes the body's new carry varies along,
    repeated until the carry's types are stable (a leaf may vary only after another does)."""
    leaves, treedef = jax.tree.flatten(init)
    for _ in range(len(leaves) + 1):
        carry = jax.tree.unflatten(treedef, leaves)
        new = jax.eval_shape(
            lambda c, xs: f(c, None if xs is None else jax.tree.map(lambda a: a[0], xs))[0],
            carry, xs)
        new_leaves = jax.tree.leaves(new)
        if len(new_leaves) != len(leaves):
            return None
        grown = [_axes(n) - _axes(x) for x, n in zip(leaves, new_leaves)]
        if not any(grown):
            return carry
        leaves = [_vary(x, axes) if axes else x for x, axes in zip(leaves, grown)]
    return None


@functools.wraps(_original_scan)
def _scan(f, init, xs=None, *args, **kwargs):
    try:
        return _original_scan(f, init, xs, *args, **kwargs)
    except TypeError as e:
        if _CARRY_ERROR not in str(e):
            raise
        carry = _varying_init(f, init, xs)
        if carry is None:
            raise
    return _original_scan(f, carry, xs, *args, **kwargs)


@contextlib.contextmanager
def varying_carries():
    """Within: `jax.lax.scan` accepts a replica-invariant initial carry whose new carry is
    per-replica (see the module's docstring). Restored on exit; nests."""
    global _depth
    with _lock:
        _depth += 1
        if _depth == 1:
            jax.lax.scan = _scan
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                jax.lax.scan = _original_scan
