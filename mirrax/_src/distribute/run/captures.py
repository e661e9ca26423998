"""The capture check of `strategy.run`: NNX state the step reaches other than through its arguments.

Such state would be compiled into the program as constants (stale after the first step) and its
updates lost. TF programs often do this (a step closing over `model`), so the errors show the
fix. The check runs once per compiled program, not per step.
"""

from __future__ import annotations

import functools
import inspect
import types

import jax

from mirrax import errors
from mirrax._src.distribute.run.arguments import StaticSlot, fn_name, is_graph_node

# Modules whose functions never hold user state; the check does not look inside them.
_LIBRARY_PREFIXES = ("jax", "flax", "optax", "numpy", "mirrax", "builtins", "functools")


def check_captures(fn, fn_node):
    """Refuses functions that reach NNX objects through closures, globals or `self` attributes.

    Such state would be baked into the compiled program as constants (stale after the first
    step) and its updates lost; TF programs often do this, so the message shows the fix.
    """
    found = _captured_nodes(fn, fn_node, depth=0, seen=set())
    if found:
        names = ", ".join(f"{name!r} ({type(obj).__name__})" for name, obj in found)
        raise errors.CapturedStateError(
            f"strategy.run: {fn_name(fn)} captures NNX state {names} from outside its "
            "arguments (a closure, a global, or an attribute of self). Its values would be "
            "compiled in as constants and its updates lost. Pass the object in args and use the "
            f"argument: def {fn_name(fn)}(model, optimizer, batch): ... ; "
            "strategy.run(step, args=(model, optimizer, batch))."
        )


def check_static_holders(slots, names):
    """Refuses a compile-time-constant argument (a plain object) that holds NNX objects.

    Such an object is hashed, not traversed, so the NNX state inside it would be compiled in
    as constants and its updates lost, as with a captured object.
    """
    for i, slot in enumerate(slots):
        if not isinstance(slot, StaticSlot):
            continue
        held = _attribute_nodes(names[i], slot.value, None)
        if held:
            listing = ", ".join(f"{name} ({type(obj).__name__})" for name, obj in held)
            raise errors.CapturedStateError(
                f"strategy.run: argument {names[i]} is a {type(slot.value).__name__} that holds "
                f"NNX state ({listing}). Only NNX objects, arrays, distributed values and "
                "tuples/lists/dicts of them are traversed; any other object is a compile-time "
                "constant, so the state inside it would be compiled in and its updates lost. "
                f"Pass the NNX objects themselves, e.g. args=({held[0][0]}, ...), or a tuple or "
                "dict of them."
            )


def _code_names(code) -> set:
    """Every global and attribute name that `code` (or a function nested in it) refers to."""
    found = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            found |= _code_names(const)
    return found


def _attribute_nodes(name: str, value, used) -> list:
    """(f"{name}.{attr}", node) for the NNX objects in `value`'s attributes.

    Only plain user objects are looked into (not modules, classes, functions, or objects of
    the libraries in `_LIBRARY_PREFIXES`); with `used`, only the attributes named in it.
    """
    if isinstance(value, (types.ModuleType, type, types.FunctionType, types.MethodType,
                          functools.partial)) or is_graph_node(value):
        return []
    if (type(value).__module__ or "").split(".")[0] in _LIBRARY_PREFIXES:
        return []
    attributes = getattr(value, "__dict__", None)
    if not isinstance(attributes, dict):
        return []
    found = []
    for attribute, held in attributes.items():
        if used is None or attribute in used:
            found += [(f"{name}.{attribute}", leaf) for leaf in _nodes_in(held)]
    return found


def _captured_nodes(fn, fn_node, depth: int, seen: set) -> list:
    if depth > 3 or id(fn) in seen:
        return []
    seen.add(id(fn))
    found = []
    if isinstance(fn, functools.partial):
        for value in list(fn.args) + list(fn.keywords.values()):
            found += [("partial argument", leaf) for leaf in _nodes_in(value)]
        return found + _captured_nodes(fn.func, fn_node, depth + 1, seen)
    if inspect.ismethod(fn):
        owner = fn.__self__
        if owner is not fn_node and not is_graph_node(owner):
            for name, value in vars(owner).items() if hasattr(owner, "__dict__") else []:
                found += [(f"self.{name}", leaf) for leaf in _nodes_in(value)]
        fn = fn.__func__
    if not inspect.isfunction(fn):
        return found
    module = getattr(fn, "__module__", "") or ""
    if module.split(".")[0] in _LIBRARY_PREFIXES:
        return found
    try:
        closure = inspect.getclosurevars(fn)
    except (TypeError, ValueError):
        return found
    used = None
    for name, value in {**closure.nonlocals, **closure.globals}.items():
        if value is fn_node:
            continue
        nodes = _nodes_in(value)
        if nodes:
            found += [(name, leaf) for leaf in nodes]
        elif inspect.isfunction(value) or isinstance(value, functools.partial):
            found += _captured_nodes(value, fn_node, depth + 1, seen)
        else:
            # A plain object (a trainer, a registry) whose attributes the function reads: its
            # NNX objects are captured as surely as a closure variable.
            if used is None:
                used = _code_names(fn.__code__)
            found += [(n, leaf) for n, leaf in _attribute_nodes(name, value, used)
                      if leaf is not fn_node]
    return found


def _nodes_in(value) -> list:
    if is_graph_node(value):
        return [value]
    if isinstance(value, (list, tuple, dict)):
        return [x for x in jax.tree.leaves(value, is_leaf=is_graph_node) if is_graph_node(x)]
    return []
