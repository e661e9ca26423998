"""Recurrent layers under the replica mesh: a `jax.lax.scan` whose initial carry is the same on
every replica (zeros) but whose new carry differs per replica (it adds the batch).

JAX's scan refuses such a carry inside `shard_map` ("carry input and carry output must have
equal types"), as do `fori_loop` and `while_loop`. While a replica function is traced,
`varying_carries()` puts wrappers in place of `jax.lax.scan`, `fori_loop` and `while_loop`
(Keras's JAX backend and flax's `nnx.scan` / `nnx.RNN` call `jax.lax.scan` by attribute):
it runs the user's call as it is, and only on that exact error marks the initial carry's leaves
that the body makes varying as varying too (`pcast` / `pvary`, no data movement; its transpose
is a psum, so gradients through the carry stay the global sum), then calls scan again.
"""

from __future__ import annotations

import functools

import jax

from mirrax._src.distribute import _compat, trace_patches

_CARRY_ERROR = "carry input and carry output must have equal types"
_original_scan = jax.lax.scan
_original_fori_loop = jax.lax.fori_loop
_original_while_loop = jax.lax.while_loop


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


def _varying_init(step, init):
    """`init` with each leaf made varying along the axes `step(carry)` (the body's new carry)
    varies along, repeated until the carry's types are stable (a leaf may vary only after
    another does); None where the body's carry does not match `init`'s structure."""
    leaves, treedef = jax.tree.flatten(init)
    for _ in range(len(leaves) + 1):
        carry = jax.tree.unflatten(treedef, leaves)
        new_leaves = jax.tree.leaves(jax.eval_shape(step, carry))
        if len(new_leaves) != len(leaves):
            return None
        grown = [_axes(n) - _axes(x) for x, n in zip(leaves, new_leaves)]
        if not any(grown):
            return carry
        leaves = [_vary(x, axes) if axes else x for x, axes in zip(leaves, grown)]
    return None


def _retrying(call, init, step):
    """`call(init)`, or on JAX's carry type error `call` of the carry made varying."""
    try:
        return call(init)
    except TypeError as e:
        if _CARRY_ERROR not in str(e):
            raise
        carry = _varying_init(step, init)
        if carry is None:
            raise
    return call(carry)


@functools.wraps(_original_scan)
def _scan(f, init, xs=None, *args, **kwargs):
    first = lambda xs: None if xs is None else jax.tree.map(lambda a: a[0], xs)  # noqa: E731
    return _retrying(lambda c: _original_scan(f, c, xs, *args, **kwargs), init, lambda c: f(c, first(xs))[0])


@functools.wraps(_original_fori_loop)
def _fori_loop(lower, upper, body_fun, init_val, **kwargs):
    return _retrying(
        lambda c: _original_fori_loop(lower, upper, body_fun, c, **kwargs),
        init_val,
        lambda c: body_fun(lower, c),
    )


@functools.wraps(_original_while_loop)
def _while_loop(cond_fun, body_fun, init_val):
    return _retrying(lambda c: _original_while_loop(cond_fun, body_fun, c), init_val, body_fun)


_WRAPPED = {
    "scan": (_original_scan, _scan),
    "fori_loop": (_original_fori_loop, _fori_loop),
    "while_loop": (_original_while_loop, _while_loop),
}


_PATCHES = trace_patches.TracePatches(
    lambda: [(jax.lax, name, wrapper) for name, (_, wrapper) in _WRAPPED.items()]
)


def varying_carries():
    """Within: `jax.lax.scan` (and `fori_loop`, `while_loop`) accepts a replica-invariant initial
    carry whose new carry is per-replica (see the module's docstring). Restored on exit; nests."""
    return _PATCHES.active()
