"""PRNG keys: typed key arrays as their raw key data and back, and keys folded per replica or
per micro-batch.

A typed key array (`jax.random.key`, the keys of every `nnx.Rngs` stream) cannot be written to
Orbax or an .npz, cut into parameter-server shards, or packed into a broadcast buffer; its
uint32 key data (`jax.random.key_data`: shape `key.shape + (2,)` for threefry2x32,
`+ (4,)` for rbg) can, and the implementation's name (`jax.random.key_impl`) turns the data
back into the same key. A legacy uint32 key (`jax.random.PRNGKey`) is a plain array already and
passes through unchanged. Checkpoints, exports, parameter servers and broadcasts all go through
`to_data` / `from_data`.

Inside a step, every `nnx.RngKey` is folded (`jax.random.fold_in`) with the replica id, or in
replica-invariant mode with the global micro-batch index, so each draws its own randomness;
`folded` is that one place.
"""

from __future__ import annotations

import contextlib

import jax
import numpy as np
from flax import nnx

from mirrax import errors


def is_key(x) -> bool:
    """True for a typed PRNG key array (`jax.random.key`, the keys of `nnx.Rngs`); False for a
    legacy uint32 key, any other array, and values without a dtype."""
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def impl_name(x):
    """The name of a typed key's implementation (`jax.random.key_impl`, e.g. "threefry2x32",
    "rbg"); None for anything else."""
    return jax.random.key_impl(x) if is_key(x) else None


def impl_names(tree) -> list:
    """`impl_name` of each leaf of `tree`, in `jax.tree.leaves` order."""
    return [impl_name(x) for x in jax.tree.leaves(tree)]


def to_data(tree) -> tuple:
    """(`tree` with each typed key replaced by its uint32 key data, `impl_names(tree)`).

    Works on concrete and traced arrays; other leaves are returned as they are."""
    leaves, treedef = jax.tree.flatten(tree)
    names = [impl_name(x) for x in leaves]
    data = [x if name is None else jax.random.key_data(x) for x, name in zip(leaves, names, strict=True)]
    return jax.tree.unflatten(treedef, data), names


def from_data(tree, names):
    """The inverse of `to_data`: each leaf whose entry in `names` is an implementation name
    re-wrapped as a typed key of it (`jax.random.wrap_key_data`), the others unchanged.

    Raises:
      InvalidArgumentError: `names` has not one entry per leaf of `tree`.
      InvalidArgumentTypeError: a leaf to re-wrap is not key data of its implementation
        (uint32, last axis the key's words).
    """
    leaves, treedef = jax.tree.flatten(tree)
    names = list(names)
    if len(names) != len(leaves):
        raise errors.InvalidArgumentError(
            f"prng_keys.from_data: {len(names)} implementation names for a tree of {len(leaves)} "
            f"{'leaf' if len(leaves) == 1 else 'leaves'}; pass the names that to_data (or "
            "impl_names) gave for this tree."
        )
    out = []
    for i, (x, name) in enumerate(zip(leaves, names, strict=True)):
        if name is None:
            out.append(x)
            continue
        try:
            out.append(jax.random.wrap_key_data(x, impl=name))
        except TypeError as e:
            raise errors.InvalidArgumentTypeError(
                f"prng_keys.from_data: leaf {i} is not {name} key data: received "
                f"{type(x).__name__} of shape {np.shape(x)} and dtype {getattr(x, 'dtype', None)}; "
                f"{name} key data is uint32 of shape (..., {_key_words(name)}), as jax.random.key_data "
                "gives it."
            ) from e
    return jax.tree.unflatten(treedef, out)


def _key_words(name) -> int:
    """The uint32 words of one key of implementation `name` (2 for threefry2x32, 4 for rbg)."""
    return jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0, impl=name))).shape[-1]


@contextlib.contextmanager
def folded(nodes, index):
    """Inside the block, every `nnx.RngKey` reachable from `nodes` (once, however many paths
    reach it; a typed or a legacy uint32 key) holds its key folded with `index`
    (`jax.random.fold_in`: the replica id in `strategy.run`, the global micro-batch index in
    replica-invariant mode); on leaving it, each holds its own key again, while the
    `RngCount`s keep the draws made inside."""
    keys = [v for _, v in nnx.iter_graph(nodes) if isinstance(v, nnx.RngKey)]
    originals = [v.get_value() for v in keys]
    for variable in keys:
        variable.set_value(jax.random.fold_in(variable.get_value(), index))
    yield
    # Not restored when the block raises: the nodes are the trace's own copies, dropped with it.
    for variable, key in zip(keys, originals, strict=True):
        variable.set_value(key)
