"""The traced body's copy of a `strategy.run` step that captures NNX objects (captures.py finds
them): the same function, reaching the merged, traced objects of the program instead of the
caller's, through the same routes (closure cells, defaults, globals, partial arguments,
`self`, plain objects' attributes). Runs at trace time only; the caller's function and
objects are left as they are.
"""

from __future__ import annotations

import copy
import functools
import operator
import types

import jax

from mirrax import errors
from mirrax._src.distribute.run import captures
from mirrax._src.distribute.run.arguments import is_graph_node


def substitute(fn, fn_node, replacements: tuple):
    """`fn` rebuilt to reach `replacements[i]` wherever it reaches `Captured.nodes[i]` (the
    same walk: closure cells, defaults, globals, partial arguments, `self`, plain objects'
    attributes). Runs at trace time only.

    Raises:
      CapturedStateError: an object holding captured state that cannot be copied.
    """
    found = captures.Walk(fn_node)
    found.run(fn)
    mapping = {id(node): new for node, new in zip(found.nodes, replacements)}
    return _Rebuild(fn_node, mapping).callable(fn, 0)


class _Rebuild:
    def __init__(self, fn_node, mapping: dict):
        self.fn_node = fn_node
        self.mapping = mapping
        self.done: dict = {}  # id -> rebuilt (recursion, shared helpers)

    def callable(self, fn, depth):
        if isinstance(fn, functools.partial):
            used = captures.names_used(fn.func)
            return functools.partial(
                self.callable(fn.func, depth + 1),
                *[self.value(a, depth, used) for a in fn.args],
                **{k: self.value(v, depth, used) for k, v in fn.keywords.items()},
            )
        if isinstance(fn, types.MethodType):
            owner = fn.__self__
            if owner is self.fn_node:
                new_owner = owner
            elif is_graph_node(owner):
                new_owner = self.mapping.get(id(owner), owner)
            elif captures.plain_object(owner):
                new_owner = self.object(owner, captures.names_used(fn.__func__))
            else:
                new_owner = owner
            func = self.callable(fn.__func__, depth + 1)
            if new_owner is owner and func is fn.__func__:
                return fn
            return types.MethodType(func, new_owner)
        if not captures.user_function(fn) or depth > captures.MAX_DEPTH:
            return fn
        if id(fn) in self.done:
            return self.done[id(fn)]
        self.done[id(fn)] = fn  # a recursive reference keeps the original
        used = captures.names_used(fn)
        changed = False
        cells = []
        for cell in fn.__closure__ or ():
            try:
                contents = cell.cell_contents
            except ValueError:
                cells.append(cell)
                continue
            new = self.value(contents, depth, used)
            changed |= new is not contents
            cells.append(types.CellType(new) if new is not contents else cell)
        defaults = fn.__defaults__
        if defaults:
            new_defaults = tuple(self.value(v, depth, used) for v in defaults)
            changed |= any(map(operator.is_not, new_defaults, defaults))
            defaults = new_defaults
        kwdefaults = fn.__kwdefaults__
        if kwdefaults:
            new_kw = {k: self.value(v, depth, used) for k, v in kwdefaults.items()}
            changed |= any(new_kw[k] is not v for k, v in kwdefaults.items())
            kwdefaults = new_kw
        module_globals = fn.__globals__
        replaced = {}
        for global_name in captures.global_names(fn.__code__):
            value = module_globals.get(global_name, captures.MISSING)
            if value is captures.MISSING:
                continue
            new = self.value(value, depth, used)
            if new is not value:
                replaced[global_name] = new
        if not changed and not replaced:
            return fn
        if replaced:
            # A copy of the module's namespace for the traced copy only (global writes during
            # the trace stay in it, as Python side effects of a trace do not repeat anyway).
            module_globals = {**module_globals, **replaced}
        new_fn = types.FunctionType(fn.__code__, module_globals, fn.__name__, defaults, tuple(cells) or None)
        new_fn.__kwdefaults__ = kwdefaults
        new_fn.__qualname__ = fn.__qualname__
        new_fn.__dict__.update(fn.__dict__)
        self.done[id(fn)] = new_fn
        return new_fn

    def value(self, value, depth, used=frozenset()):
        if value is self.fn_node and value is not None:
            return value
        if is_graph_node(value):
            return self.mapping.get(id(value), value)
        if isinstance(value, (list, tuple, dict)):
            if not captures.nodes_in(value):
                return value
            return jax.tree.map(
                lambda x: self.mapping.get(id(x), x) if is_graph_node(x) else x, value, is_leaf=is_graph_node
            )
        if isinstance(value, (types.FunctionType, functools.partial, types.MethodType)):
            return self.callable(value, depth + 1)
        if captures.plain_object(value):
            return self.object(value, used)
        return value

    def object(self, obj, used):
        if id(obj) in self.done:
            return self.done[id(obj)]
        replaced = {}
        for attribute, value in captures.held_attributes(obj, used):
            if value is self.fn_node:
                continue
            new = self.value(value, captures.MAX_DEPTH + 1)
            if new is not value:
                replaced[attribute] = new
        if not replaced:
            return obj
        try:
            new_obj = copy.copy(obj)
            vars(new_obj).update(replaced)
        except Exception as e:  # noqa: BLE001 - any failure to copy: say what to do
            raise errors.CapturedStateError(
                f"strategy.run: the step reaches NNX state through a {type(obj).__name__} "
                f"({', '.join(replaced)}), which mirrax could not copy to carry that state into "
                f"the program ({type(e).__name__}: {e}). Pass the NNX objects themselves in "
                "args, or capture them directly (a closure or global holding the module)."
            ) from e
        self.done[id(obj)] = new_obj
        return new_obj
