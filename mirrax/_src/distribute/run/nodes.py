"""The Variables of a call's NNX objects: found by a flatten, or by a cheap check when the same
objects come back (a training loop passes the same model and optimizer every step).

NNX modules and optimizers are pytrees whose leaves are their Variables, so JAX's flatten finds
the caller's Variables and a hashable structure; but it runs flax's Python flatten for every
object of the graph (about 6 µs each). `NodeCache` keeps, per tuple of objects, what that
flatten found and the identity of everything it walked through: each object's attributes, each
dict's and list's items, each Variable's metadata. When every one of them is the same object
as before, nothing reachable from the objects changed, so the same Variables in the same order
are the answer; a changed attribute, a new submodule, an appended layer or new Variable
metadata fails the check and the objects are flattened again. Objects held only weakly: a
model nobody holds drops its entry (and with it the references to its Variables).
"""

from __future__ import annotations

import itertools
import operator
import weakref

import jax
from flax import nnx

from mirrax._src.distribute import _compat
from mirrax._src.distribute.run.arguments import is_variable


class NodeState:
    """What one flatten of a tuple of NNX objects found.

    Attributes:
      variables: the Variables, in flatten order.
      key: a hashable description of the structure (the flatten's treedef, the Variables'
        types and metadata), or None when the graph is not a plain pytree of distinct Variables
        (shared Variables) or has unhashable metadata: then `nnx.split` describes it.
      memo: the runner's, per call structure: the program and its binding to these objects
        (their Variables in the program's state order, the arrays it last wrote back).
    """

    __slots__ = ("variables", "key", "memo", "_checks", "__weakref__")

    def __init__(self, variables, key, checks):
        self.variables = variables
        self.key = key
        self.memo: dict = {}
        self._checks = checks

    def unchanged(self, nodes) -> bool:
        """True when every object the flatten of `nodes` walked through is as it was."""
        return self._checks is not None and self._checks.hold(nodes)


class _Checks:
    """Identity checks over a graph, run as a few C-level passes (no per-object Python).

    `dicts`: every attribute dict (`vars(obj)` of each object), plain dict and Variable
    metadata dict walked through; `lists`: every list; `variables` with the metadata dict each
    held. The graph is unchanged when each still holds the same dict, and every dict and list
    the same number of entries with the same keys and values (by identity).
    """

    __slots__ = (
        "roots",
        "root_owned",
        "owners",
        "owned",
        "dicts",
        "lists",
        "variables",
        "metadata",
        "lengths",
        "keys",
        "values",
        "items",
    )

    def __init__(self, nodes, objects, dicts, lists, variables):
        chain = itertools.chain.from_iterable
        # The objects of the call themselves are not held (the caller passes them to `hold`), so
        # a model nobody holds is collected and its weak reference drops the cache entry; the
        # objects below them are held: they cannot be reused ids while the entry lives.
        position = {id(node): i for i, node in enumerate(nodes)}
        roots = [(position[id(o)], d) for o, d in objects if id(o) in position]
        self.roots = tuple(i for i, _ in roots)
        self.root_owned = tuple(d for _, d in roots)
        self.owners = tuple(o for o, _ in objects if id(o) not in position)
        self.owned = tuple(d for o, d in objects if id(o) not in position)  # each owner's attribute dict
        self.dicts = tuple(dicts)
        self.lists = tuple(lists)
        self.variables = tuple(variables)
        self.metadata = tuple(map(_compat.metadata_dict, variables))
        self.lengths = tuple(map(len, self.dicts)) + tuple(map(len, self.lists))
        # The keys, values and items themselves are held, so compared by identity they cannot
        # be other objects that reuse a collected one's id.
        self.keys = tuple(chain(self.dicts))
        self.values = tuple(chain(map(dict.values, self.dicts)))
        self.items = tuple(chain(self.lists))

    def hold(self, nodes) -> bool:
        """True when nothing reachable from `nodes` (the objects the checks were made for)
        changed."""
        # Everything by identity (an object's own == may say equal for another object: a
        # Variable compares its value). The lengths come first: `map` stops at the shorter
        # side, so equal lengths make each pass see every entry. A key that is an equal string
        # but another object fails the check: a needless flatten, never a missed change.
        chain, is_ = itertools.chain.from_iterable, operator.is_
        return (
            all(map(is_, map(vars, map(nodes.__getitem__, self.roots)), self.root_owned))
            and all(map(is_, map(vars, self.owners), self.owned))
            and all(map(is_, map(_compat.metadata_dict, self.variables), self.metadata))
            and tuple(map(len, self.dicts)) + tuple(map(len, self.lists)) == self.lengths
            and all(map(is_, chain(self.dicts), self.keys))
            and all(map(is_, chain(map(dict.values, self.dicts)), self.values))
            and all(map(is_, chain(self.lists), self.items))
        )


def flatten(nodes: tuple) -> NodeState:
    """Flattens `nodes` (a tuple of NNX objects) to their Variables."""
    variables, node_def = jax.tree.flatten(nodes, is_leaf=is_variable)
    fast = len({id(v) for v in variables}) == len(variables) and all(map(is_variable, variables))
    key = _key(node_def, variables) if fast else None
    checks = _walk(nodes, variables) if key is not None else None
    return NodeState(variables, key, checks)


def _key(node_def, variables):
    """The structure's cache key: the treedef, and each Variable's type and metadata (which
    the treedef leaves out, and the program depends on: e.g. its aggregation); None when some
    metadata is not hashable (then `nnx.split`'s graphdef is the key)."""
    metadata = []
    for variable in variables:
        held = _compat.variable_metadata(variable)
        if held is None:
            return None
        metadata.append((type(variable), tuple(held.items())))
    key = (node_def, tuple(metadata))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _walk(nodes, variables) -> _Checks | None:
    """The identity checks that prove the graph unchanged, or None when the walk cannot see
    every Variable the flatten found (a container type it does not know)."""
    objects, dicts, lists, found = [], [], [], []
    seen: set = set()

    def visit(x):
        if is_variable(x):
            metadata = _compat.variable_metadata(x)
            if metadata is None:
                raise _Unknown
            found.append(x)
            dicts.append(metadata)
            return
        if id(x) in seen:
            return
        if isinstance(x, (nnx.Pytree, nnx.State)) or (hasattr(x, "__dict__") and _is_pytree_node(x)):
            seen.add(id(x))
            attributes = vars(x)
            objects.append((x, attributes))
            dicts.append(attributes)
            for value in attributes.values():
                visit(value)
        elif type(x) is dict:
            seen.add(id(x))
            dicts.append(x)
            for value in x.values():
                visit(value)
        elif type(x) is list:
            seen.add(id(x))
            lists.append(x)
            for value in x:
                visit(value)
        elif isinstance(x, tuple):  # immutable: its items are checked through its holder
            for value in x:
                visit(value)
        elif _is_pytree_node(x):
            raise _Unknown  # a registered container without attributes to compare

    try:
        for node in nodes:
            visit(node)
    except _Unknown:
        return None
    if {id(v) for v in found} != {id(v) for v in variables}:
        return None
    return _Checks(nodes, objects, dicts, lists, found)


class _Unknown(Exception):
    pass


def _is_pytree_node(x) -> bool:
    return not jax.tree_util.treedef_is_leaf(jax.tree.structure(x, is_leaf=is_variable))


class NodeCache:
    """Per tuple of NNX objects (by identity, held weakly), the `NodeState` of their last
    flatten, reused while `NodeState.unchanged()` holds."""

    def __init__(self, size: int = 8):
        self._size = size
        self._entries: dict = {}  # tuple of ids -> (weakrefs, NodeState)

    def lookup(self, nodes: list) -> NodeState:
        ids = tuple(map(id, nodes))
        entry = self._entries.get(ids)
        if entry is not None:
            refs, state = entry
            if all(ref() is node for ref, node in zip(refs, nodes)) and state.unchanged(nodes):
                return state
            del self._entries[ids]
        state = flatten(tuple(nodes))
        if state._checks is not None:
            self._remember(ids, nodes, state)
        return state

    def _remember(self, ids, nodes, state) -> None:
        entries = self._entries

        def forget(_, ids=ids):
            current = entries.get(ids)
            if current is not None and current[1] is state_ref():
                del entries[ids]

        state_ref = weakref.ref(state)
        try:
            refs = tuple(weakref.ref(node, forget) for node in nodes)
        except TypeError:  # an object that cannot be weakly referenced: not cached
            return
        if len(entries) >= self._size:
            entries.pop(next(iter(entries)))
        entries[ids] = (refs, state)

    def clear(self) -> None:
        self._entries.clear()
