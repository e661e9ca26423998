"""The state a ParameterServerStrategy holds: its NNX objects' leaves, cut into shards and
spread over the parameter servers, and the arithmetic of pulling and pushing them.

The coordinator's objects (modules, optimizers, metrics used by scheduled functions) are the
roots; their joint state (`nnx.split(tuple(roots))`, so a `Variable` two of them share is one
leaf) is a flat list of arrays. Each leaf is cut along axis 0 by the strategy's partitioner
(or kept whole) and its shards are dealt to the parameter servers round-robin, continuing from
the last leaf's, as TF places variables and their shards. A parameter server stores a dict
{(leaf, shard): numpy array}.

Updates travel as differences: a worker pulls the leaves, runs its step on them, and pushes
new - pulled, which the parameter server adds to what it holds now (so updates other workers
pushed meanwhile are kept). Leaves that cannot be added (booleans, PRNG keys) are pushed as
new values when they changed. Under update="gradients" an optimizer's state is laid out with
the parameters it mirrors and its updates are the servers' (`gradient_rule.py`).
"""

from __future__ import annotations

import operator

import jax
import numpy as np
from flax import nnx

from mirrax import errors
from mirrax._src.distribute import _compat, prng_keys
from mirrax._src.distribute.run.arguments import is_variable
from mirrax._src.distribute.run.nodes import NodeCache
from mirrax._src.parameter_server import gradient_rule
from mirrax._src.parameter_server import partitioners as partitioners_lib


def _additive(dtype) -> bool:
    return np.dtype(dtype).kind in "fciu"


class Layout:
    """Where each leaf's shards live: for leaf i, a list of (parameter server, start, stop)
    along axis 0 (start, stop None for a scalar kept whole), and whether updates add."""

    def __init__(self, leaves: list, paths: list, num_ps: int, partitioner, root_leaves=None, groups=()):
        self.paths = list(paths)
        # The optimizers whose updates the servers apply (update="gradients"), and the servers
        # besides its own that hold a copy of a scalar state leaf (each server of its group).
        self.groups: list = list(groups)
        self.copies: dict[int, list[int]] = {}
        # Per held object, the indices of the leaves it reaches (a Variable two objects share
        # is a leaf of both): what a function that names only some objects pulls and pushes.
        self.root_leaves: list = list(root_leaves) if root_leaves is not None else []
        self.signatures: list = []  # per leaf: (shape, dtype) as it travels
        self.shards: list[list] = []
        self.additive: list[bool] = []
        self.keys: list = []  # per leaf: the PRNG key implementation, or None
        self.num_ps = num_ps
        turn = 0
        for leaf, path in zip(leaves, paths):
            key = prng_keys.impl_name(leaf)
            self.keys.append(key)
            host = host_value(leaf)
            self.signatures.append((host.shape, host.dtype))
            count = partitioners_lib.shard_count(partitioner, host.shape, host.dtype, path)
            if host.ndim == 0:
                cuts: list[tuple[int, int | None, int | None]] = [(turn % num_ps, None, None)]
                turn += 1
            else:
                bounds = np.cumsum(
                    [0] + [len(s) for s in np.array_split(np.empty(host.shape[0], dtype=np.int8), count)]
                )
                cuts = []
                for start, stop in zip(bounds[:-1], bounds[1:]):
                    cuts.append((turn % num_ps, int(start), int(stop)))
                    turn += 1
            self.shards.append(cuts)
            self.additive.append(key is None and _additive(host.dtype))
        for group in self.groups:
            self._colocate(group)

    def _colocate(self, group) -> None:
        """Lays a group's state out with its parameters, as TF places slot variables: a leaf
        mirroring a parameter in its shards, a scalar on every server of the group."""
        servers = list(dict.fromkeys(ps for i in group.params for ps, _, _ in self.shards[i])) or [0]
        for j, param, _ in group.mirrored:
            self.shards[j] = list(self.shards[param])
        for j in [j for j, _ in group.scalars] + [group.step]:
            self.shards[j] = [(servers[0], None, None)]
            self.copies[j] = servers[1:]

    def server_groups(self, ps: int) -> list:
        """Per group, what parameter server `ps` holds of it, as `ServerOptimizer`'s arguments
        without the transformation (None for a group it holds none of)."""
        out: list = []
        for group in self.groups:
            params = [(i, s) for i in group.params for s, (at, _, _) in enumerate(self.shards[i]) if at == ps]
            if not params:
                out.append(None)
                continue
            mirrored: dict = {key: [] for key in params}
            for j, param, prefix in group.mirrored:
                for s, (at, _, _) in enumerate(self.shards[j]):
                    if at == ps:
                        mirrored[(param, s)].append((prefix, (j, s)))
            scalars = [(prefix, (j, 0)) for j, prefix in group.scalars]
            out.append((params, mirrored, scalars, (group.step, 0)))
        return out

    def leaves_of(self, objects) -> list[int]:
        """The sorted indices of the leaves the held objects `objects` (indices) reach."""
        if len(objects) == len(self.root_leaves):
            return list(range(len(self.shards)))
        return sorted({i for o in objects for i in self.root_leaves[o]})

    def shard_keys(self, indices: list) -> list[list]:
        """Per parameter server, the (leaf, shard) keys of the leaves `indices`."""
        out: list[list] = [[] for _ in range(self.num_ps)]
        for i in indices:
            for s, (ps, _, _) in enumerate(self.shards[i]):
                out[ps].append((i, s))
        return out

    def split(self, host_leaves: list) -> list[dict]:
        """One dict per parameter server, {(leaf, shard): array} (views, not copies)."""
        out: list[dict] = [{} for _ in range(self.num_ps)]
        for i, (leaf, cuts) in enumerate(zip(host_leaves, self.shards)):
            if leaf is None:
                continue
            for s, (ps, start, stop) in enumerate(cuts):
                out[ps][(i, s)] = leaf if start is None else leaf[start:stop]
            for ps in self.copies.get(i, ()):
                out[ps][(i, 0)] = leaf
        return out

    def join(self, per_ps: list[dict], indices=None) -> list:
        """The whole host leaves (those of `indices`, default all) from the parameter servers'
        dicts (as `split` cut them)."""
        leaves = []
        for i in range(len(self.shards)) if indices is None else indices:
            cuts = self.shards[i]
            parts = [per_ps[ps][(i, s)] for s, (ps, _, _) in enumerate(cuts)]
            leaves.append(
                parts[0] if len(parts) == 1 and cuts[0][1] is None else np.concatenate(parts, axis=0)
            )
        return leaves

    def device_leaves(self, host_leaves: list, indices=None) -> list:
        """Host leaves (those of `indices`, default all) as JAX values, PRNG keys re-wrapped
        as typed keys."""
        keys = self.keys if indices is None else [self.keys[i] for i in indices]
        return prng_keys.from_data(list(host_leaves), keys)

    def updates(self, pulled: list, new: list) -> list:
        """What a worker pushes, per leaf: ("add", new - pulled) for a numeric leaf,
        ("assign", new) for a changed boolean or key, or for a float leaf whose difference
        is not finite (an inf or NaN, before or after: adding it would give NaN), and
        (None, None) where nothing changed."""
        out: list[tuple] = []
        for additive, old, now in zip(self.additive, pulled, new):
            if np.array_equal(old, now, equal_nan=now.dtype.kind in "fc"):
                out.append((None, None))
            elif not additive:
                out.append(("assign", now))
            else:
                with np.errstate(invalid="ignore", over="ignore"):
                    delta = np.subtract(now, old, dtype=now.dtype)
                finite = now.dtype.kind not in "fc" or bool(np.isfinite(delta).all())
                out.append(("add", delta) if finite else ("assign", now))
        return out

    def describe(self, paths: list) -> dict:
        """{path: [(parameter server, rows), ...]} for `strategy.extended.variable_placement`."""
        return {
            path: [(ps, None if start is None else stop - start) for ps, start, stop in cuts]
            for path, cuts in zip(paths, self.shards)
        }


def host_value(leaf) -> np.ndarray:
    """A leaf as a NumPy array (a PRNG key as its uint32 key data)."""
    return np.asarray(jax.device_get(prng_keys.to_data(leaf)[0]))


def split_roots(roots: tuple):
    """(graphdef, treedef, leaves, paths) of the joint state of `roots`."""
    graphdef, state = nnx.split(roots)
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(state)
    paths = [_path_name(path) for path, _ in with_paths]
    return graphdef, treedef, [leaf for _, leaf in with_paths], paths


def _path_name(path) -> str:
    keys = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path]
    if keys and keys[-1] == "value":  # the Variable's own field, not part of its name
        keys = keys[:-1]
    # The first key is the root's index in the strategy's tuple of held objects.
    return f"objects[{keys[0]}]" + "".join(f".{k}" for k in keys[1:])


def _reached(root, leaves: list) -> tuple:
    """The indices of `leaves` (the held objects' joint leaves) whose arrays `root`'s Variables
    hold; all of them when one of its arrays is not found among `leaves`."""
    where: dict = {}
    for i, leaf in enumerate(leaves):
        where.setdefault(id(leaf), []).append(i)
    found: set = set()
    for variable in jax.tree.leaves(root, is_leaf=is_variable):
        if not is_variable(variable):
            continue
        for array in jax.tree.leaves(_compat.raw_value(variable)):
            if id(array) not in where:
                return tuple(range(len(leaves)))
            found.update(where[id(array)])
    return tuple(sorted(found))


def _shape_of(leaf) -> tuple:
    return (tuple(leaf.shape), str(leaf.dtype)) if hasattr(leaf, "shape") else ((), type(leaf).__name__)


def state_of(treedef, leaves: list):
    """The NNX state (of the held objects' joint structure `treedef`) with these leaves."""
    return jax.tree.unflatten(treedef, leaves)


class Holdings:
    """The coordinator's record of the held objects: roots, layout, and the identity of the
    arrays it last wrote into them (a changed identity means the user assigned a new value)."""

    def __init__(self, num_ps: int, partitioner, update: str = gradient_rule.DIFFERENCES):
        self.num_ps = num_ps
        self.partitioner = partitioner
        self.update = update
        self.roots: list = []
        self.version = 0
        self.graphdef = self.treedef = None
        self._latest_graphdef = None  # the held objects' graph at the last current_leaves
        self.layout: Layout | None = None
        self.paths: list = []
        self._seen: list = []
        # The Variables and their values at the last sync, found again by an identity check
        # of the objects' graph (`NodeCache`), so that a schedule that changed nothing on the
        # coordinator costs microseconds, not a split of every held object.
        self._nodes = NodeCache(size=1)
        self._synced: tuple | None = None

    def unchanged(self) -> bool:
        """True when nothing of the held objects was assigned or restructured on the
        coordinator since the last sync (False may also mean: not known cheaply)."""
        synced = self._synced
        if synced is None:
            return False
        state = self._nodes.lookup(list(self.roots))
        values = synced[1]
        return (
            state is synced[0]
            and len(state.variables) == len(values)
            and all(map(operator.is_, map(_compat.raw_value, state.variables), values))
        )

    def _sync(self) -> None:
        state = self._nodes.lookup(list(self.roots))
        self._synced = (state, [_compat.raw_value(v) for v in state.variables])

    def holds(self, obj) -> bool:
        return any(obj is root for root in self.roots)

    def index(self, obj) -> int:
        for i, root in enumerate(self.roots):
            if root is obj:
                return i
        raise KeyError(obj)

    def relayout(self, new_roots: list) -> list[dict]:
        """Adds `new_roots` and returns every parameter server's new dict, from the roots'
        current values (the caller has written the parameter servers' values into them)."""
        roots = self.roots + list(new_roots)
        graphdef, treedef, leaves, paths = split_roots(tuple(roots))
        groups = (
            gradient_rule.groups_of(tuple(roots), leaves, paths)
            if self.update == gradient_rule.GRADIENTS
            else ()
        )
        layout = Layout(  # may refuse: nothing changed
            leaves, paths, self.num_ps, self.partitioner, [_reached(root, leaves) for root in roots], groups
        )
        self.roots, self.graphdef, self.treedef, self.paths = roots, graphdef, treedef, paths
        self.layout = layout
        self.shapes = [_shape_of(leaf) for leaf in leaves]
        self.version += 1
        self._seen = [leaf for leaf in leaves]
        self._sync()
        return layout.split([host_value(leaf) for leaf in leaves])

    def current_leaves(self) -> list:
        """The held objects' leaves now.

        Raises:
          UnsupportedArgumentError: their structure changed since they were laid out (a
            variable added, removed or replaced by one of another shape or dtype).
        """
        graphdef, treedef, leaves, paths = split_roots(tuple(self.roots))
        self._latest_graphdef = graphdef
        if treedef != self.treedef:
            raise errors.UnsupportedArgumentError(
                "ParameterServerStrategy: the variables of an object it holds changed (they "
                f"were {len(self.paths)}, they are {len(leaves)}: a variable or submodule was "
                "added, removed or replaced). The parameter servers keep the structure of an "
                "object's first schedule: build the model and optimizer completely before it, "
                "or make a new strategy for the new model."
            )
        for path, leaf, before in zip(paths, leaves, self.shapes):
            if _shape_of(leaf) != before:
                raise errors.UnsupportedArgumentError(
                    f"ParameterServerStrategy: {path} is held with shape and dtype {before} but "
                    f"is now {_shape_of(leaf)} on the coordinator. The parameter servers keep "
                    "each variable's shape: assign values of the same shape and dtype."
                )
        return leaves

    def take_graphdef(self) -> bool:
        """Whether a static attribute of a held object changed (`model.eval()`, a plain
        attribute) as of the last `current_leaves`; if so its graph is taken as a new version,
        from which the workers rebuild their copies."""
        latest = self._latest_graphdef
        if latest is None or latest == self.graphdef:
            return False
        self.graphdef = latest
        self.version += 1
        return True

    def sync(self) -> None:
        """Records the held objects as they are now as seen (nothing was assigned)."""
        self._sync()

    def assigned(self, leaves: list) -> list:
        """The host values of `leaves` (the current ones) that the user replaced since the
        last sync, None elsewhere."""
        return [None if leaf is seen else host_value(leaf) for leaf, seen in zip(leaves, self._seen)]

    def mark_seen(self) -> None:
        self._seen = self.current_leaves()
        self._sync()

    def write_back(self, host_leaves: list) -> None:
        """Writes the parameter servers' values into the coordinator's objects."""
        assert self.layout is not None  # relayout made it before any value was pulled
        leaves = self.layout.device_leaves(host_leaves)
        leaves = [jax.numpy.asarray(leaf) if not prng_keys.is_key(leaf) else leaf for leaf in leaves]
        nnx.update(tuple(self.roots), state_of(self.treedef, leaves))
        self._seen = self.current_leaves()
        self._sync()
