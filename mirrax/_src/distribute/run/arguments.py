"""Sorting `strategy.run`'s arguments into the slots of the compiled program.

Each leaf of (the function's own NNX object, args, kwargs) fills one slot: an NNX object (split
into graph and state, entering replicated), a `PerReplica` (its stacked arrays enter sharded
along `REPLICA_AXIS`), a `Mirrored` or plain array (entering replicated), or a hashable Python
value (a compile-time constant, as `tf.function` treats Python values). The slots are part of
the program's cache key, so they are small hashable values compared by type and content.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import jax
import numpy as np
from flax import nnx

from mirrax import errors
from mirrax._src.distribute.values import (
    DistributedInput,
    DistributedValues,
    Mirrored,
    PerReplica,
)


def _per_type(test, doc: str):
    """`test(x)`, computed once per type of `x` and then looked up (isinstance through NNX's
    metaclass costs microseconds, and these run for every argument of every step)."""
    answers: dict = {}

    def check(x) -> bool:
        kind = type(x)
        answer = answers.get(kind)
        if answer is None:
            answer = answers[kind] = test(x)
        return answer

    check.__doc__ = doc
    return check


is_graph_node = _per_type(
    lambda x: isinstance(x, (nnx.Pytree, nnx.Variable)),
    "True for NNX modules, optimizers, metrics and variables (objects with NNX state).",
)
is_variable = _per_type(lambda x: isinstance(x, nnx.Variable), "True for `nnx.Variable`s.")
is_argument_leaf = _per_type(
    lambda x: is_graph_node(x) or isinstance(x, DistributedValues),
    "True for what `strategy.run` takes whole: NNX objects and distributed values.",
)


# Slots are interned (one object per distinct slot) and compared by identity, so the cache key
# of a call hashes and compares in C; a StaticSlot compares its value, as the program must.


@dataclasses.dataclass(frozen=True, eq=False)
class NodeSlot:
    """An NNX object: the `index`-th distinct one of the call."""

    index: int


@dataclasses.dataclass(frozen=True, eq=False)
class ShardedSlot:
    """A `PerReplica`: `count` stacked arrays of structure `treedef`, one row per replica."""

    treedef: Any
    count: int


@dataclasses.dataclass(frozen=True, eq=False)
class MirroredSlot:
    """A `Mirrored`: `count` replicated arrays of structure `treedef`."""

    treedef: Any
    count: int


@dataclasses.dataclass(frozen=True, eq=False)
class ArraySlot:
    """A plain array (NumPy or JAX), entering replicated."""


@dataclasses.dataclass(frozen=True)
class StaticSlot:
    """A hashable Python value, compiled in as a constant."""

    value: Any


ARRAY = ArraySlot()
_NODE_SLOTS: list = []
_VALUE_SLOTS: dict = {}  # (slot class, treedef, count) -> the slot


def _node_slot(index: int) -> NodeSlot:
    while len(_NODE_SLOTS) <= index:
        _NODE_SLOTS.append(NodeSlot(len(_NODE_SLOTS)))
    return _NODE_SLOTS[index]


def _value_slot(kind, treedef, count: int):
    key = (kind, treedef, count)
    slot = _VALUE_SLOTS.get(key)
    if slot is None:
        slot = _VALUE_SLOTS[key] = kind(treedef, count)
    return slot


class Call:
    """One `run` call, sorted.

    Attributes:
      fn_node: the NNX object `fn` is (or is a bound method of), else None.
      fn_key: what identifies `fn` in the cache (the type for an NNX object, so one program
        serves every instance of a module class).
      treedef: the structure of (fn_node, args, kwargs) down to the argument leaves.
      slots: one slot per leaf.
      nodes: the distinct NNX objects, in order of first appearance.
      dynamic: the arrays that enter the program (sharded and replicated), flat.
      mask, lengths: the first masked `PerReplica`'s batch mask and per-replica lengths.
      shortest: the per-replica lengths of the masked `PerReplica` with the fewest real rows on
        a replica (`lengths` but for several batches in one call: steps_per_execution), which
        the padding warning reads.
      names: human names of the leaves, for messages.
    """

    __slots__ = (
        "fn",
        "fn_node",
        "fn_key",
        "treedef",
        "slots",
        "nodes",
        "dynamic",
        "mask",
        "lengths",
        "shortest",
        "names",
        "array_positions",
    )

    def __init__(
        self,
        fn,
        fn_node,
        fn_key,
        treedef,
        slots,
        nodes,
        dynamic,
        mask,
        lengths,
        shortest,
        names,
        array_positions,
    ):
        self.fn, self.fn_node, self.fn_key, self.treedef = fn, fn_node, fn_key, treedef
        self.slots, self.nodes, self.dynamic = slots, nodes, dynamic
        self.mask, self.lengths, self.shortest, self.names = mask, lengths, shortest, names
        # (position in `dynamic`, leaf index) of each plain array, placed by the runner
        self.array_positions = array_positions


def _fewer_rows(lengths, than) -> bool:
    """Whether per-replica `lengths` leave a replica with fewer rows than `than` do (both
    known; the same lengths object, as every leaf of one batch shares, is not fewer)."""
    return lengths is not None and than is not None and lengths is not than and min(lengths) < min(than)


def classify(strategy, fn, args, kwargs, traced: bool = False) -> Call:
    """Sorts the arguments of `strategy.run(fn, args, kwargs)` (validated by the caller);
    `traced`: inside a `mirrax.function` trace, whose values enter as replicated arrays.

    Raises:
      InvalidArgumentError: a PerReplica whose replicas cannot be stacked.
      InvalidArgumentTypeError: a distributed dataset, or an unhashable non-array object.
      MixedStrategyError: a distributed value of another strategy.
      ReplicaContextError: a traced argument (run inside a JAX transformation).
    """
    fn_node = None
    if is_graph_node(fn):
        fn_node = fn
    elif inspect.ismethod(fn) and is_graph_node(fn.__self__):
        fn_node = fn.__self__
    structure = (fn_node, tuple(args), dict(kwargs))
    leaves, treedef = _flatten(structure)
    names = LazyNames(structure)
    nodes: list = []
    node_index: dict = {}
    slots, dynamic, array_positions = [], [], []
    mask, lengths, shortest = None, None, None
    for i, leaf in enumerate(leaves):
        if is_graph_node(leaf):
            index = node_index.get(id(leaf))
            if index is None:
                index = node_index[id(leaf)] = len(nodes)
                nodes.append(leaf)
            slots.append(_NODE_SLOTS[index] if index < len(_NODE_SLOTS) else _node_slot(index))
        elif isinstance(leaf, PerReplica):
            check_owner(strategy, leaf, names, i)
            value = leaf.stacked
            if value is None:
                raise errors.InvalidArgumentError(
                    f"strategy.run: {names[i]} is a PerReplica whose replicas hold values of "
                    "different shapes that cannot be stacked "
                    f"({[jax.tree.map(np.shape, v) for v in leaf.values]}); give every replica "
                    "values with the same shape (pad them) before passing them to run."
                )
            value_leaves, value_def = jax.tree.flatten(value)
            slots.append(_value_slot(ShardedSlot, value_def, len(value_leaves)))
            dynamic.extend(value_leaves)
            if leaf.mask is not None:
                if mask is None:
                    mask, lengths, shortest = leaf.mask, leaf.lengths, leaf.lengths
                elif _fewer_rows(leaf.lengths, shortest):
                    shortest = leaf.lengths
        elif isinstance(leaf, Mirrored):
            check_owner(strategy, leaf, names, i)
            value_leaves, value_def = jax.tree.flatten(leaf.replicated)
            slots.append(_value_slot(MirroredSlot, value_def, len(value_leaves)))
            dynamic.extend(value_leaves)
        elif isinstance(leaf, jax.core.Tracer):
            if not traced:
                raise inside_transformation(f"argument {names[i]}")
            slots.append(ARRAY)
            dynamic.append(leaf)
        elif isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
            slots.append(ARRAY)
            array_positions.append((len(dynamic), i))
            dynamic.append(leaf)
        elif isinstance(leaf, DistributedInput):
            raise errors.InvalidArgumentTypeError(
                f"strategy.run: argument {names[i]} is a {type(leaf).__name__}, not a batch. "
                "Iterate it and pass each batch: for batch in dist_dataset: "
                "strategy.run(step, args=(model, optimizer, batch))."
            )
        else:
            try:
                hash(leaf)
            except TypeError:
                raise errors.InvalidArgumentTypeError(
                    f"strategy.run: argument {names[i]} is a {type(leaf).__name__}, which is "
                    "neither an array, an NNX object, a distributed value, nor a hashable "
                    "Python value (those are passed as compile-time constants). Pass arrays, "
                    "NNX objects, or pytrees (tuples, lists, dicts) of them."
                ) from None
            slots.append(StaticSlot(leaf))
    fn_key: Any  # what the compiled-program cache tells calls of `fn` apart by
    if fn_node is fn:
        fn_key = type(fn)
    elif fn_node is not None:
        fn_key = (type(fn_node), fn.__func__)
    else:
        fn_key = fn
    return Call(
        fn,
        fn_node,
        fn_key,
        treedef,
        tuple(slots),
        nodes,
        dynamic,
        mask,
        lengths,
        shortest,
        names,
        array_positions,
    )


_FLAT_TREEDEFS: dict = {}
_is_flat_leaf = _per_type(
    lambda x: is_argument_leaf(x) or isinstance(x, (jax.Array, np.ndarray, np.generic)),
    "True for a leaf of run's arguments that the flat-argument flatten can take as it is.",
)


def _flatten(structure):
    """`jax.tree.flatten(structure, is_leaf=is_argument_leaf)`; for the common call (no function
    object, no kwargs, each argument a leaf, None or a tuple of leaves: `args=(model, optimizer,
    batch)` with the batch a tuple of `PerReplica`s, fit's steps with None for the objects a
    step does not use) without the flatten's Python callbacks."""
    fn_node, args, kwargs = structure
    if fn_node is None and not kwargs:
        shape: list[int | None] = []
        leaves = []
        for arg in args:
            if arg is None:  # no leaf, as in jax's flatten
                shape.append(-1)
            elif _is_flat_leaf(arg):
                shape.append(None)
                leaves.append(arg)
            elif type(arg) is tuple and all(map(_is_flat_leaf, arg)):
                shape.append(len(arg))
                leaves.extend(arg)
            else:
                break
        else:
            key = tuple(shape)
            treedef = _FLAT_TREEDEFS.get(key)
            if treedef is None:
                template = tuple(0 if n is None else None if n == -1 else (0,) * n for n in key)
                treedef = _FLAT_TREEDEFS[key] = jax.tree.structure((None, template, {}))
            return leaves, treedef
    return jax.tree.flatten(structure, is_leaf=is_argument_leaf)


def check_run_arguments(what: str, fn, args, kwargs) -> None:
    """The checks of `strategy.run` / `experimental_lower`'s own arguments (as passed)."""
    if not callable(fn):
        raise errors.InvalidArgumentTypeError(
            f"{what}: fn must be callable (a function, method or NNX module); received "
            f"{fn!r} of type {type(fn).__name__}. Call it as {what}(step_fn, args=(...))."
        )
    if not isinstance(args, (tuple, list)):
        raise errors.InvalidArgumentTypeError(
            f"{what}: args must be a tuple or list of positional arguments; received a "
            f"{type(args).__name__}. For one argument write args=(x,)."
        )
    if kwargs is not None and not isinstance(kwargs, dict):
        raise errors.InvalidArgumentTypeError(
            f"{what}: kwargs must be a dict or None; received a {type(kwargs).__name__}."
        )


def check_owner(strategy, value, names, index=None) -> None:
    """Refuses a distributed value made by another strategy; `names[index]` names it."""
    owner = value.strategy
    if owner is not strategy:
        what = names if index is None else names[index]
        raise errors.MixedStrategyError(
            f"{what} is a {type(value).__name__} created by another strategy "
            f"({type(owner).__name__} with {owner.num_replicas_in_sync} replicas), not by this "
            f"{type(strategy).__name__}. Distribute the dataset or values with the strategy "
            "that will run them."
        )


def inside_transformation(what: str) -> Exception:
    """The ReplicaContextError for `what` being a tracer: run called inside a transformation."""
    return errors.ReplicaContextError(
        f"strategy.run: {what} is a traced value: strategy.run was called inside jax.jit, "
        "nnx.jit or another JAX transformation, or given a jitted function. strategy.run "
        "already compiles the step into one program: call it directly with the plain step "
        "function, without the decorator; to compile the run with the reduce and the "
        "arithmetic around it into one program, as @tf.function does, decorate the function "
        "that calls strategy.run with @mirrax.function instead."
    )


# What JAX raises when Python asks a traced array for a concrete value.
CONCRETE_VALUE_ERRORS = (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerIntegerConversionError,
    jax.errors.TracerArrayConversionError,
)


def traced_value(what: str, name: str, error: Exception) -> Exception:
    """The TracedValueError for `error` (one of `CONCRETE_VALUE_ERRORS`): `name`, traced into
    one program by `what` ("strategy.run", "mirrax.function"), turned a traced array into a
    Python value. JAX's own message names the program's inner arguments (state_leaves[0],
    dynamic[1]), not the user's."""
    said = str(error).splitlines()[0] if str(error) else type(error).__name__
    return errors.TracedValueError(
        f"{what}: {name} asks for the Python value of an array computed inside the step (an "
        "`if` or `while` on it, bool(), int(), float(), .item() or np.asarray()), but the "
        "step is traced into one compiled program, where arrays have no value yet. Use "
        "jnp.where, jax.lax.cond or jax.lax.while_loop for a decision on data, or return "
        "the array and decide outside the step (as tf.function without AutoGraph). "
        f"(JAX said: {said})"
    )


class LazyNames:
    """Human names ('args[0]', "kwargs['model']") of argument leaves, built only for messages."""

    def __init__(self, structure):
        self._structure = structure
        self._paths = None

    def _all(self):
        if self._paths is None:
            self._paths = jax.tree_util.tree_flatten_with_path(self._structure, is_leaf=is_argument_leaf)[0]
        return self._paths

    def __getitem__(self, i) -> str:
        return describe_path(self._all()[i][0])

    def of_node(self, node) -> str:
        for path, leaf in self._all():
            if leaf is node:
                return describe_path(path)
        return type(node).__name__


def describe_path(path) -> str:
    """'args[0]', "kwargs['model']" or 'the function' for a path into (fn_node, args, kwargs)."""
    if not path:
        return "the function"
    head, rest = path[0], path[1:]
    root = {0: "the function", 1: "args", 2: "kwargs"}[head.idx]
    return root + jax.tree_util.keystr(tuple(rest))


def fn_name(fn) -> str:
    """The name of the user's function (its `__name__`, else its type's) for messages."""
    return getattr(fn, "__name__", None) or type(fn).__name__
