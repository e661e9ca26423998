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
