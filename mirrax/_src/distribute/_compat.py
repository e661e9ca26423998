"""Shims over JAX APIs that changed between the versions mirrax supports (jax 0.10 and 0.11)."""

from __future__ import annotations

import jax


def varying_axes(x) -> frozenset:
    """The manual mesh axes along which `x` varies inside `shard_map` (its vma type)."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)
    if manual is not None:
        return frozenset(manual.varying)
    return frozenset(getattr(aval, "vma", frozenset()))


def pvary(x, axis_name: str):
    """Marks an unvarying value as varying along `axis_name` (no data movement)."""
    if axis_name in varying_axes(x):
        return x
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, axis_name, to="varying")
    return jax.lax.pvary(x, axis_name)


def all_gather_invariant(x, axis_name: str):
    """`all_gather(x, axis_name, tiled=True)` typed as unvarying along `axis_name`.

    Every replica receives the same concatenation, so the result is replicated; JAX types a
    plain all-gather as varying, which `shard_map` would refuse to return as replicated.
    """
    for to in ("invarying", "invariant"):  # jax 0.10's spelling, then a later one's
        try:
            return jax.lax.all_gather(x, axis_name, tiled=True, to=to)
        except (TypeError, ValueError, AssertionError):
            continue
    return jax.lax.all_gather_invariant(x, axis_name, tiled=True)
