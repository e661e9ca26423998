"""What a checkpoint stores of each tracked object: its parts (one Orbax item each), and each
part's tree as Orbax writes and reads it.

An NNX object is stored as its pure-dict state (integer keys as strings, as Orbax requires), a
plain value as {"value": ...}, an object of mirrax's checkpoint protocol as what it names; a
typed PRNG key array as its uint32 key data, re-wrapped on restore with the key implementation
the target holds. A part can also say where a checkpoint keyed otherwise holds its leaves
(`aliases`: a Keras model's variables keyed by position, as mirrax once wrote them, or by the
same model's earlier auto-numbered Keras names).
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from mirrax import errors
from mirrax._src.distribute import prng_keys
from mirrax._src.parameter_server import store as parameter_servers


class Part:
    """One Orbax item: how to read a tracked object's state and how to write it back."""

    def __init__(self, item: str, get, set_, check=None, aliases=None):
        self.item = item
        self.get = get  # () -> pytree of arrays (the current state, on its current placement)
        self.set = set_  # (restored pytree) -> None
        self.check = check  # () -> None; raises ValueError if the object cannot take a restore
        # ({item: stored tree}) -> None, or a function from a leaf's path (tuple of str keys)
        # to the path that checkpoint holds it under (None: the same path)
        self.aliases = aliases


def _str_keys(tree):
    """Orbax stores dict keys as strings; NNX's pure dicts index sequences with ints."""
    if isinstance(tree, dict):
        return {str(k): _str_keys(v) for k, v in tree.items()}
    return tree


def _keys_like(tree, template):
    """Orbax's string keys back as the state's own: ints where NNX indexes a sequence, strings
    elsewhere (a Keras layer named "0" stays "0")."""
    if not isinstance(tree, dict) or not isinstance(template, dict):
        return tree
    own = {str(key): key for key in template}
    return {
        own.get(key, key): _keys_like(value, template.get(own.get(key, key))) for key, value in tree.items()
    }


def flat_dict(tree, prefix: tuple = ()) -> dict:
    """{path: leaf} of nested dicts (string keys); anything else, an empty dict too, is a leaf."""
    if not isinstance(tree, dict) or not tree:
        return {prefix: tree}
    return {
        path: leaf for key, value in tree.items() for path, leaf in flat_dict(value, prefix + (key,)).items()
    }


def renamed(tree, rename: dict):
    """`tree` (nested dicts) with each leaf moved from its path p to rename.get(p, p)."""
    out: dict = {}
    for path, leaf in flat_dict(tree).items():
        path = rename.get(path, path)
        if not path:
            return leaf
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = leaf
    return out


def module_aliases(module, item: str):
    """A Part's `aliases` from a module's `checkpoint_aliases` (a Keras model's), given the
    stored module state of `item`; None for a module without it."""
    find = getattr(module, "checkpoint_aliases", None)
    if not callable(find):
        return None
    return lambda stored: find(list(flat_dict(stored[item]))) if item in stored else None


def nnx_part(item: str, obj) -> Part:
    """An NNX object (module, optimizer, metric) stored as its pure-dict state."""

    def set_(restored):
        state = nnx.state(obj)
        nnx.replace_by_pure_dict(state, _keys_like(restored, nnx.to_pure_dict(state)))
        nnx.update(obj, state)

    def get():
        parameter_servers.refresh_if_held(obj)  # a ParameterServerStrategy's values are remote
        return _str_keys(nnx.to_pure_dict(nnx.state(obj)))

    return Part(item, get, set_, aliases=module_aliases(obj, item))


def _value_part(item: str, objects: dict, name: str) -> Part:
    """A plain value (a Python int or float, an array) held in `objects` (a Checkpoint's tracked
    objects): restoring rebinds `objects[name]`, so the Checkpoint's attribute."""

    def get():
        return {"value": objects[name]}

    def set_(restored):
        old = objects[name]
        new = restored["value"]
        if isinstance(old, (bool, int, float)):
            new = type(old)(np.asarray(new).item())
        objects[name] = new

    return Part(item, get, set_)


def _protocol_part(item: str, obj) -> Part:
    """An object that names its own state (`checkpoint_state()`, `restore_checkpoint_state(state)`,
    and optionally `check_restorable()`, called before any restore): a data iterator's position."""
    return Part(
        item, obj.checkpoint_state, obj.restore_checkpoint_state, getattr(obj, "check_restorable", None)
    )


def tracked_parts(objects: dict, name: str, obj) -> list:
    """The stored parts of `obj` tracked as `name` in `objects` (a Checkpoint's tracked objects).

    mirrax's checkpoint protocol, for objects that are not NNX objects or plain values: an
    object with `checkpoint_children()` (a `mirrax.Model`: {"module": ..., "optimizer": ...})
    is stored as its children, each under f"{name}.{key}"; an object with `checkpoint_state()`
    and `restore_checkpoint_state(state)` (a `DistributedIterator`: its position) stores that
    dict of arrays.
    """
    children = getattr(obj, "checkpoint_children", None)
    if callable(children):
        parts = [
            part
            for key, child in children().items()
            for part in tracked_parts(objects, f"{name}.{key}", child)
        ]
        # A Keras model's variables key the optimizer's state too: both follow the module's.
        aliases = module_aliases(getattr(obj, "module", None), f"{name}.module")
        for part in parts:
            part.aliases = part.aliases or aliases
        return parts
    if isinstance(obj, nnx.Variable):
        return [
            Part(name, lambda: {"value": obj.get_value()}, lambda restored: obj.set_value(restored["value"]))
        ]
    if isinstance(obj, nnx.Pytree):
        return [nnx_part(name, obj)]
    if callable(getattr(obj, "checkpoint_state", None)):
        return [_protocol_part(name, obj)]
    if isinstance(obj, (bool, int, float, np.ndarray, np.generic, jax.Array)):
        return [_value_part(name, objects, name)]
    raise errors.InvalidArgumentTypeError(
        f"Checkpoint cannot track {name}={type(obj).__name__}; it tracks nnx.Module, "
        "nnx.Optimizer, mirrax metrics (nnx.Pytree), nnx.Variable, mirrax.Model, a "
        "DistributedIterator (its position), and plain numbers or arrays (step counters)."
    )


def storable(tree):
    """The tree as Orbax stores it: each typed PRNG key array (`jax.random.key`, the keys of
    `nnx.Rngs`) as its raw uint32 key data, so the shapes a restore compares are the stored
    ones; a legacy uint32 key (`jax.random.PRNGKey`) is a plain array already."""
    return prng_keys.to_data(tree)[0]


def unstorable(restored, current):
    """Re-wraps restored key data as typed keys of the implementation the target holds now."""
    return prng_keys.from_data(restored, prng_keys.impl_names(current))


def abstract(tree):
    """The restore target: each leaf's shape and dtype, placed where the leaf lives now."""

    def leaf(a):
        if isinstance(a, jax.Array):
            return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
        return np.asarray(a)  # a host value restores as a NumPy array

    return jax.tree.map(leaf, tree)


def as_arrays(tree):
    """Leaves as arrays, typed PRNG keys as their key data (what Orbax writes and reads)."""
    return storable(jax.tree.map(lambda a: a if isinstance(a, jax.Array) else np.asarray(a), tree))
