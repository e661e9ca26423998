"""The arguments and results of a `mirrax.function`'s program (function.py): a call's
arguments sorted into slots (NNX objects, distributed values, plain arrays, iterators, Python
constants) with the arrays that enter the program, the same arguments rebuilt around the
trace's values, and the distributed values that leave it.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import jax
import numpy as np

from mirrax import errors
from mirrax._src.distribute.run.arguments import StaticSlot, is_argument_leaf, is_graph_node, is_variable
from mirrax._src.distribute.values import DistributedInput, Mirrored, PerReplica

ARRAY_LIKE = (jax.Array, np.ndarray, np.generic, bool, int, float, complex)
NODE = "node"
ARRAY = "array"


@jax.tree_util.register_pytree_node_class
class DistributedOut:
    """A distributed value leaving the program: its arrays (value, mask) as leaves, the rest static."""

    __slots__ = ("kind", "strategy", "lengths", "value", "mask")

    def __init__(self, kind, strategy, lengths, value, mask):
        self.kind, self.strategy, self.lengths, self.value, self.mask = kind, strategy, lengths, value, mask

    def tree_flatten(self):
        return (self.value, self.mask), (self.kind, self.strategy, self.lengths)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*aux, *children)

    def restored(self):
        if self.kind == "mirrored":
            return Mirrored(self.strategy, self.value)
        return PerReplica(self.strategy, self.value, mask=self.mask, lengths=self.lengths)


@dataclasses.dataclass(frozen=True)
class ValueSlot:
    """A `PerReplica` or `Mirrored` argument: `count` arrays of `treedef` (then its mask)."""

    kind: str
    treedef: Any
    count: int
    has_mask: bool
    lengths: tuple | None
    strategy: Any


@dataclasses.dataclass(frozen=True)
class IteratorSlot:
    """An iterator argument (leaf `index`): the slots of the batches taken from it for this call."""

    index: int
    batches: tuple  # per batch: (its treedef, its leaves' slots)


class NeedsBatch(Exception):
    """The trace called `next` on iterator argument `index` more often than batches were taken."""

    def __init__(self, index: int):
        super().__init__(index)
        self.index = index


class TracedIterator(DistributedInput):
    """An iterator argument as the traced function sees it: it hands out the batches taken
    from the caller's iterator for this call, as traced distributed values."""

    def __init__(self, index: int, batches: list):
        self.index = index
        self._batches = collections.deque(batches)

    def __next__(self):
        if not self._batches:
            raise NeedsBatch(self.index)
        return self._batches.popleft()

    def exhausted(self) -> bool:
        """Whether the trace took every batch given."""
        return not self._batches

    def get_next(self):
        """As `DistributedIterator.get_next`."""
        return next(self)

    def __iter__(self):
        raise errors.InvalidArgumentTypeError(
            "mirrax.function: iterating over an iterator argument inside the function (for x "
            "in iterator) would trace every batch of the data set into one program. Call "
            "next(iterator) a fixed number of times inside, or loop outside the function."
        )


class Sorter:
    """Sorts argument leaves into slots, gathering the NNX objects and the program's inputs."""

    def __init__(self, name: str, names):
        self.name, self.names = name, names
        self.nodes: list = []
        self.node_index: dict = {}
        self.dynamic: list = []
        self.arrays: list = []  # (position in dynamic, leaf index): plain arrays to place
        self.strategy = None

    def batch(self, batch, i: int) -> tuple:
        """A batch an iterator argument (leaf `i`) gave: its structure and its leaves' slots."""
        leaves, treedef = jax.tree.flatten(batch, is_leaf=is_argument_leaf)
        return (treedef, tuple(self.leaf(leaf, i) for leaf in leaves))

    def leaf(self, leaf, i: int):
        name, names = self.name, self.names
        if is_graph_node(leaf):
            index = self.node_index.get(id(leaf))
            if index is None:
                index = self.node_index[id(leaf)] = len(self.nodes)
                self.nodes.append(leaf)
            return (NODE, index)
        if isinstance(leaf, (PerReplica, Mirrored)):
            self.strategy = _owner(self.strategy, leaf, names, i, name)
            if isinstance(leaf, PerReplica):
                kind, value, mask, lengths = "per_replica", leaf.stacked, leaf.mask, leaf.lengths
            else:
                kind, value, mask, lengths = "mirrored", leaf.replicated, None, None
            if value is None:
                raise errors.InvalidArgumentError(
                    f"mirrax.function: {name}'s argument {names[i]} is a PerReplica whose "
                    "replicas hold values of different shapes that cannot be stacked; give "
                    "every replica values of one shape (pad them)."
                )
            value_leaves, value_def = jax.tree.flatten(value)
            self.dynamic.extend(value_leaves)
            if mask is not None:
                self.dynamic.append(mask)
            return ValueSlot(kind, value_def, len(value_leaves), mask is not None, lengths, leaf.strategy)
        if isinstance(leaf, jax.core.Tracer):
            raise errors.ReplicaContextError(
                f"mirrax.function: {name}'s argument {names[i]} is a traced value: the "
                "function was called inside jax.jit, nnx.jit or another JAX transformation. "
                "A mirrax.function is already one compiled program: call it outside them."
            )
        if isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
            self.arrays.append((len(self.dynamic), i))
            self.dynamic.append(leaf)
            return (ARRAY,)
        if isinstance(leaf, DistributedInput):
            raise errors.InvalidArgumentTypeError(
                f"mirrax.function: {name}'s argument {names[i]} is a "
                f"{type(leaf).__name__}, not a batch or an iterator. Pass a batch "
                f"(for batch in dist_dataset: {name}(batch)) or an iterator "
                f"({name}(iter(dist_dataset)), calling next(iterator) inside)."
            )
        try:
            hash(leaf)
        except TypeError:
            raise errors.InvalidArgumentTypeError(
                f"mirrax.function: {name}'s argument {names[i]} is a {type(leaf).__name__}, "
                "which is neither an array, an NNX object, a distributed value, an iterator "
                "of a distributed dataset, nor a hashable Python value (those are "
                "compile-time constants). Pass arrays, NNX objects, or pytrees of them."
            ) from None
        return StaticSlot(leaf)


def _owner(strategy, value, names, i: int, name: str):
    """The strategy of the call's distributed values; refuses values of two strategies."""
    if strategy is not None and value.strategy is not strategy:
        raise errors.MixedStrategyError(
            f"mirrax.function: {name}'s argument {names[i]} is a {type(value).__name__} of another "
            f"strategy ({type(value.strategy).__name__}) than the call's other distributed "
            f"values ({type(strategy).__name__}); one call's program runs on one strategy's "
            "devices. Distribute every input with the same strategy."
        )
    return value.strategy


def rebuilt(slots, copies, dynamic, position: int = 0) -> tuple[list, int]:
    """The call's argument leaves inside the trace (from `dynamic[position:]`): the traced
    copies of the NNX objects, distributed values around the traced arrays, and for each
    iterator one that hands out its traced batches; and the position after them."""
    leaves = []
    for slot in slots:
        if type(slot) is tuple:
            if slot[0] == NODE:
                leaves.append(copies[slot[1]])
            else:
                leaves.append(dynamic[position])
                position += 1
        elif isinstance(slot, ValueSlot):
            value = jax.tree.unflatten(slot.treedef, dynamic[position : position + slot.count])
            position += slot.count
            if slot.kind == "mirrored":
                leaves.append(Mirrored(slot.strategy, value))
                continue
            mask = None
            if slot.has_mask:
                mask = dynamic[position]
                position += 1
            leaves.append(PerReplica(slot.strategy, value, mask=mask, lengths=slot.lengths))
        elif isinstance(slot, IteratorSlot):
            batches = []
            for treedef, batch_slots in slot.batches:
                batch_leaves, position = rebuilt(batch_slots, copies, dynamic, position)
                batches.append(jax.tree.unflatten(treedef, batch_leaves))
            leaves.append(TracedIterator(slot.index, batches))
        else:
            leaves.append(slot.value)
    return leaves, position


def encoded(outputs, name: str):
    """`outputs` as the program returns them: distributed values as `DistributedOut`s,
    Variables as their values; anything that is not an array is refused."""

    def one(x):
        if isinstance(x, PerReplica):
            return DistributedOut("per_replica", x.strategy, x.lengths, x.stacked, x.mask)
        if isinstance(x, Mirrored):
            return DistributedOut("mirrored", x.strategy, None, x.replicated, None)
        if is_variable(x):
            return x.get_value()
        if is_graph_node(x) or not isinstance(x, ARRAY_LIKE):
            raise errors.InvalidArgumentTypeError(
                f"mirrax.function: {name} returned a {type(x).__name__}; it must return arrays, "
                "distributed values (what strategy.run returns), Python numbers, or pytrees of "
                "them. NNX objects it reaches are updated in place and need not be returned."
            )
        return x

    return jax.tree.map(one, outputs, is_leaf=is_argument_leaf)


def is_out(x) -> bool:
    """True for a distributed value as the program returns it (a `DistributedOut`)."""
    return isinstance(x, DistributedOut)


def restored(x):
    """`x` as the caller gets it: a `DistributedOut` as its `PerReplica` / `Mirrored`."""
    return x.restored() if isinstance(x, DistributedOut) else x
