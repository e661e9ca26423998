"""The NNX state a `strategy.run` step reaches other than through its arguments (TF's style:
the step captures the model, optimizer and metrics from its closure or globals).

`lookup(fn)` finds the NNX objects `fn` reaches through its closure cells, default values,
globals (followed into user helper functions three levels deep), `functools.partial`
arguments, a method's `self` and the attributes of plain objects it holds (one level). The
runner carries them into the program as extra NNX objects, exactly like arguments (state in,
state out), and `rebuild.substitute` gives the traced body a copy of `fn` that reaches the merged,
traced objects instead. The same walk gives the program's cache key for `fn`: its code and
what its closure holds (NNX objects by position, hashable constants by value, anything else by
identity), so a step defined anew inside another function compiles once. A walk is cached per
(code, globals, closure contents) and reused while every global and attribute it read is the
same object, so a step costs a few identity checks per call.

What cannot be carried is refused here with the fix (`check_static_holders`: a plain object
passed in `args`); state reached deeper than the walk looks is caught by flax at trace time
(program.py).
"""

from __future__ import annotations

import functools
import itertools
import operator
import types

import jax

from mirrax import errors
from mirrax._src.distribute.run.arguments import StaticSlot, is_graph_node

# Modules whose functions never hold user state; the walk does not look inside them. Plain
# objects of mirrax (a `mirrax.Model` holding its module) are looked into, its functions not.
_OBJECT_LIBRARIES = ("jax", "jaxlib", "flax", "optax", "numpy", "builtins", "functools", "keras")
_LIBRARY_PREFIXES = _OBJECT_LIBRARIES + ("mirrax",)
# mirrax's example programs are user code (the steps of `mirrax train --loop custom`).
_USER_MODULES = ("mirrax.examples",)
MAX_DEPTH = 3
_CACHE_SIZE = 64
MISSING = object()
MISSINGS = itertools.repeat(MISSING)
_CONSTANT_TYPES = (type(None), bool, int, str, bytes)


class _Identity:
    """A cache-key part that compares by identity and holds its object (so the id cannot be
    reused by another object while the key lives)."""

    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __eq__(self, other):
        return type(other) is _Identity and other.obj is self.obj

    def __hash__(self):
        return id(self.obj)


class Captured:
    """What one walk of a function found.

    Attributes:
      nodes: the NNX objects reached, distinct, in walk order.
      names: for each, how the function reaches it ('model', 'trainer.model', 'self.net').
      key: the function's part of the program cache key (None: key by the function itself).
    """

    __slots__ = ("nodes", "names", "key", "_dicts", "_names", "_values", "_sequences")

    def __init__(self, nodes, names, key, reads, sequences):
        self.nodes, self.names, self.key = tuple(nodes), tuple(names), key
        self._dicts = tuple(d for d, _, _ in reads)
        self._names = tuple(n for _, n, _ in reads)
        self._values = tuple(v for _, _, v in reads)
        self._sequences = tuple(sequences)

    def valid(self) -> bool:
        """Every global and attribute the walk read is still the same object (by identity),
        and every list or dict of NNX objects it read holds the same items."""
        if not all(map(operator.is_, map(dict.get, self._dicts, self._names, MISSINGS), self._values)):
            return False
        return not self._sequences or all(_snapshot(c) == s for c, s in self._sequences)


_cache: dict = {}


def lookup(fn, fn_node) -> Captured:
    """The captures of `fn` (the callable given to `strategy.run`); cached while valid."""
    key = _lookup_key(fn)
    entry = _cache.get(key)
    if entry is not None and entry[0] is fn_node and entry[1].valid():
        return entry[1]
    captured = Walk(fn_node).run(fn)
    captured.key = _interned(captured.key)
    if len(_cache) >= _CACHE_SIZE:
        _cache.pop(next(iter(_cache)))
    # The entry holds what the key's ids name (its function's closure, via the values read),
    # so those ids stay taken while it lives.
    _cache[key] = (fn_node, captured, fn)
    return captured


def clear() -> None:
    """Forgets every cached capture walk (mirrax.clear_session); the next call walks again."""
    _cache.clear()
    _tokens.clear()


_tokens: dict = {}


class _Token:
    """One function structure, interned: the cache key compares and hashes it by identity
    (hashing the nested key itself would cost microseconds at every call)."""

    __slots__ = ("key", "__weakref__")

    def __init__(self, key):
        self.key = key


def _interned(key):
    if key is None:
        return None
    try:
        token = _tokens.get(key)
    except TypeError:  # an unhashable part: this walk's own token (compiles per walk)
        return _Token(key)
    if token is None:
        if len(_tokens) >= 4 * _CACHE_SIZE:
            _tokens.clear()
        token = _tokens[key] = _Token(key)
    return token


def _lookup_key(fn):
    if not isinstance(fn, types.FunctionType):
        if isinstance(fn, types.MethodType):  # a new bound method at every attribute access
            return ("method", id(fn.__self__), id(fn.__func__))
        return ("object", id(fn))
    closure = fn.__closure__
    if closure is None and fn.__defaults__ is None and fn.__kwdefaults__ is None:
        return (fn.__code__, id(fn.__globals__))
    return (
        fn.__code__,
        id(fn.__globals__),
        id(fn.__defaults__),
        id(fn.__kwdefaults__),
        *map(_cell_id, closure or ()),
    )


def _cell_id(cell):
    try:
        return id(cell.cell_contents)
    except ValueError:  # an empty cell
        return None


def _is_library(value) -> bool:
    module = getattr(value, "__module__", None) or ""
    return module.split(".")[0] in _LIBRARY_PREFIXES and not module.startswith(_USER_MODULES)


def user_function(value) -> bool:
    """True for a plain Python function outside the libraries the walk never looks into."""
    return isinstance(value, types.FunctionType) and not _is_library(value)


def plain_object(value) -> bool:
    """A user object (a trainer, a registry, a mirrax.Model) whose attributes may hold NNX
    objects: not a module, class, function, NNX object or library object."""
    if isinstance(
        value,
        (
            types.ModuleType,
            type,
            types.FunctionType,
            types.MethodType,
            types.BuiltinFunctionType,
            functools.partial,
        ),
    ) or is_graph_node(value):
        return False
    if (type(value).__module__ or "").split(".")[0] in _OBJECT_LIBRARIES:
        return False
    return isinstance(getattr(value, "__dict__", None), dict)


def nodes_in(value) -> list:
    """The NNX objects `value` is or holds (inside lists, tuples and dicts), in tree order."""
    if is_graph_node(value):
        return [value]
    if isinstance(value, (list, tuple, dict)):
        return [x for x in jax.tree.leaves(value, is_leaf=is_graph_node) if is_graph_node(x)]
    return []


def _snapshot(container):
    items = container.items() if isinstance(container, dict) else container
    return tuple(map(id, itertools.chain.from_iterable(items) if isinstance(container, dict) else items))


def _constant_key(value):
    """A key equal only for values the program cannot tell apart (1, 1.0 and True differ;
    so do 0.0 and -0.0), or None when `value` is no plain constant."""
    kind = type(value)
    if kind in _CONSTANT_TYPES:
        return (kind, value)
    if kind in (float, complex):
        return (kind, repr(value))
    if kind is tuple:
        keys = tuple(map(_constant_key, value))
        return None if None in keys else (tuple, keys)
    return None


class Walk:
    """One walk: the NNX objects found, how each is reached, the reads to re-check, the key."""

    def __init__(self, fn_node):
        self.fn_node = fn_node
        self.nodes, self.names, self.index = [], [], {}
        self.reads: list = []
        self.sequences: list = []
        self.functions: dict = {}  # id -> key of functions being walked (recursion)

    def run(self, fn) -> Captured:
        key = self.callable_key(fn, 0, getattr(fn, "__name__", "fn"))
        if not self.nodes and not isinstance(fn, types.FunctionType):
            key = None
        return Captured(self.nodes, self.names, key, self.reads, self.sequences)

    def node_key(self, node, name):
        index = self.index.get(id(node))
        if index is None:
            index = self.index[id(node)] = len(self.nodes)
            self.nodes.append(node)
            self.names.append(name)
        return ("node", index)

    def callable_key(self, fn, depth, name):
        if isinstance(fn, functools.partial):
            used = names_used(fn.func)
            return (
                "partial",
                self.callable_key(fn.func, depth + 1, name),
                tuple(self.value_key(a, depth, f"{name} partial argument", used) for a in fn.args),
                tuple(
                    (k, self.value_key(v, depth, f"{name} partial argument {k}", used))
                    for k, v in sorted(fn.keywords.items())
                ),
            )
        if isinstance(fn, types.MethodType):
            owner = fn.__self__
            if owner is self.fn_node or is_graph_node(owner):
                owner_key = ("fn_node",) if owner is self.fn_node else self.node_key(owner, "self")
            elif plain_object(owner):
                owner_key = self.object_key(owner, "self", names_used(fn.__func__))
            else:
                owner_key = _Identity(owner)
            return ("method", owner_key, self.callable_key(fn.__func__, depth + 1, name))
        if not user_function(fn) or depth > MAX_DEPTH:
            return _Identity(fn)
        if id(fn) in self.functions:
            return ("recursive", fn.__code__)
        self.functions[id(fn)] = True
        used = names_used(fn)
        cells = []
        for cell, cell_name in zip(fn.__closure__ or (), fn.__code__.co_freevars):
            try:
                contents = cell.cell_contents
            except ValueError:
                cells.append(("empty",))
                continue
            cells.append(self.value_key(contents, depth, cell_name, used))
        defaults = tuple(self.value_key(v, depth, f"{name} default", used) for v in fn.__defaults__ or ())
        kwdefaults = tuple(
            (k, self.value_key(v, depth, f"{name} default {k}", used))
            for k, v in sorted((fn.__kwdefaults__ or {}).items())
        )
        module_globals = fn.__globals__
        read = []
        for global_name in global_names(fn.__code__):
            value = module_globals.get(global_name, MISSING)
            if value is MISSING:
                continue  # a builtin, or an attribute name that is no global
            self.reads.append((module_globals, global_name, value))
            read.append((global_name, self.value_key(value, depth, global_name, used)))
        return (
            "function",
            fn.__code__,
            _Identity(module_globals),
            tuple(cells),
            defaults,
            kwdefaults,
            tuple(read),
        )

    def value_key(self, value, depth, name, used=frozenset()):
        if value is self.fn_node and value is not None:
            return ("fn_node",)
        if is_graph_node(value):
            return self.node_key(value, name)
        constant = _constant_key(value)
        if constant is not None:
            return constant
        if isinstance(value, (list, tuple, dict)):
            nodes = nodes_in(value)
            if not nodes:
                return _Identity(value)
            leaves, treedef = jax.tree.flatten(value, is_leaf=is_graph_node)
            if not isinstance(value, tuple):
                self.sequences.append((value, _snapshot(value)))
            return (
                "tree",
                treedef,
                tuple(
                    self.node_key(x, name) if is_graph_node(x) else _constant_key(x) or _Identity(x)
                    for x in leaves
                ),
            )
        if isinstance(value, (types.FunctionType, functools.partial, types.MethodType)):
            return self.callable_key(value, depth + 1, name)
        if plain_object(value):
            return self.object_key(value, name, used)
        return _Identity(value)

    def object_key(self, obj, name, used):
        attributes = vars(obj)
        held = []
        for attribute, value in held_attributes(obj, used):
            if value is self.fn_node:
                continue
            self.reads.append((attributes, attribute, value))
            held.append((attribute, self.value_key(value, MAX_DEPTH + 1, f"{name}.{attribute}")))
        return ("object", _Identity(obj), tuple(held)) if held else _Identity(obj)


def names_used(fn) -> frozenset:
    """The attribute (and global) names a function's code names, nested functions included:
    the attributes of a plain object it may read."""
    code = getattr(fn, "__code__", None)
    return frozenset() if code is None else frozenset(global_names(code))


def held_attributes(obj, used) -> list:
    """(attribute, value) for the attributes of plain object `obj` that hold NNX objects and
    that the code reading it names (`trainer.model`); every one for a mirrax object (a
    `mirrax.Model` called as `model(x)` reads its module in mirrax's code)."""
    every = (type(obj).__module__ or "").split(".")[0] == "mirrax"
    return [
        (attribute, value)
        for attribute, value in vars(obj).items()
        if (every or attribute in used) and nodes_in(value)
    ]


def global_names(code) -> list:
    """The global names `code` (or a function nested in it) loads; attribute names too (a
    global of the same name is then read needlessly, never missed)."""
    names = list(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names += [n for n in global_names(const) if n not in names]
    return names


def check_static_holders(slots, names, what: str = "strategy.run"):
    """Refuses a compile-time-constant argument (a plain object) that holds NNX objects.

    Such an object is hashed, not traversed, so the NNX state inside it would be compiled in
    as constants and its updates lost.
    """
    for i, slot in enumerate(slots):
        if not isinstance(slot, StaticSlot) or not plain_object(slot.value):
            continue
        held = [
            (f"{names[i]}.{attribute}", leaf)
            for attribute, value in vars(slot.value).items()
            for leaf in nodes_in(value)
        ]
        if held:
            listing = ", ".join(f"{name} ({type(obj).__name__})" for name, obj in held)
            raise errors.CapturedStateError(
                f"{what}: argument {names[i]} is a {type(slot.value).__name__} that holds "
                f"NNX state ({listing}). Only NNX objects, arrays, distributed values and "
                "tuples/lists/dicts of them are traversed; any other object is a compile-time "
                "constant, so the state inside it would be compiled in and its updates lost. "
                f"Pass the NNX objects themselves, e.g. args=({held[0][0]}, ...), or a tuple or "
                "dict of them."
            )
