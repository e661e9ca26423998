"""`strategy.run`: one user function, compiled once into ONE `jax.jit(jax.shard_map(...))` program.

Arguments are sorted by what they are: distributed values enter sharded along `REPLICA_AXIS`
(each replica sees its own row), NNX objects are split into graph and state and enter
replicated, plain arrays enter replicated, Python scalars and other hashable objects are static
(as `tf.function` treats Python values). Inside, the NNX objects are merged back, RNG streams are
folded with the replica id, the user's function runs under a `ReplicaContext`, and the new state
is aggregated by each variable's `VariableAggregation` before it leaves the program unvarying.
Outside, the state is written back into the caller's objects, so mutation looks in place as in
TF. JAX's vma typing tells which outputs vary across replicas: those come back as `PerReplica`,
the others as `Mirrored`.

The compiled program is cached per (function, argument structure, static values): a second call
with same-shaped inputs runs without retracing. Finding which outputs vary needs one abstract
trace before the real one, so the first call traces the function twice.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import inspect
import types
import warnings
from typing import Any

import flax.errors
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from mirrax import errors
from mirrax._src.distribute import _compat, invariant
from mirrax._src.distribute.reduce import VariableAggregation, aggregation_of
from mirrax._src.distribute.replica_context import (
    REPLICA_AXIS,
    ReplicaContext,
    current_replica_context,
    replica_context_scope,
)
from mirrax._src.distribute.values import Mirrored, PerReplica

_CACHE_SIZE = 256
_ARRAY_LIKE = (jax.Array, np.ndarray, np.generic, bool, int, float, complex)
# Modules whose functions never hold user state; the capture check does not look inside them.
_LIBRARY_PREFIXES = ("jax", "flax", "optax", "numpy", "mirrax", "builtins", "functools")


_GRAPH_NODE_TYPES: dict = {}


def is_graph_node(x) -> bool:
    """True for NNX modules, optimizers, metrics and variables (objects with NNX state)."""
    kind = type(x)
    answer = _GRAPH_NODE_TYPES.get(kind)
    if answer is None:
        answer = _GRAPH_NODE_TYPES[kind] = isinstance(x, (nnx.Pytree, nnx.Variable))
    return answer


def _is_argument_leaf(x) -> bool:
    return is_graph_node(x) or isinstance(x, (PerReplica, Mirrored))


@dataclasses.dataclass
class _Program:
    """A compiled step and what its first trace learned about the outputs."""

    compiled: Any
    out_treedef: Any
    out_varying: tuple
    same_state: bool  # the new state has the old one's structure: returned as a flat list
    # For the fast path: position in the pytree flatten of each state leaf's Variable.
    order: tuple | None = None


def run(strategy, fn, args, kwargs):
    """Implements `Strategy.run` (validated there)."""
    program, live, nodes, state_leaves, dynamic, batch_info, mask_value, lengths = _prepare(
        strategy, fn, args, kwargs)
    new_state, outputs = program.compiled(state_leaves, dynamic, batch_info)
    return _finish(strategy, program, live, nodes, new_state, outputs, mask_value, lengths)


def lower(strategy, fn, args, kwargs):
    """Implements `Strategy.experimental_lower` (validated there): the program `run` would
    execute, lowered on the arguments it would give it; nothing runs, nothing is written back."""
    program, _, _, state_leaves, dynamic, batch_info, _, _ = _prepare(strategy, fn, args, kwargs)
    return program.compiled.lower(state_leaves, dynamic, batch_info)


def _prepare(strategy, fn, args, kwargs):
    """Sorts the arguments, finds (or compiles) the cached program, places the state.

    Returns (program, live Variables, NNX objects, state leaves, dynamic leaves, batch info,
    the batch's mask, its lengths).
    """
    if current_replica_context() is not None:
        raise errors.ReplicaContextError(
            "strategy.run was called inside a function that strategy.run is already running; "
            "nested run is not supported. Call the inner function directly: it already runs "
            "once per replica."
        )
    fn_node = None
    if is_graph_node(fn):
        fn_node = fn
    elif inspect.ismethod(fn) and is_graph_node(fn.__self__):
        fn_node = fn.__self__
    structure = (fn_node, tuple(args), dict(kwargs))
    leaves, treedef = jax.tree.flatten(structure, is_leaf=_is_argument_leaf)
    names = _LazyNames(structure)
    nodes, node_index = [], {}
    kinds, dynamic = [], []
    mask_value, lengths = None, None
    for i, leaf in enumerate(leaves):
        if is_graph_node(leaf):
            if id(leaf) not in node_index:
                node_index[id(leaf)] = len(nodes)
                nodes.append(leaf)
            kinds.append(("node", node_index[id(leaf)]))
        elif isinstance(leaf, PerReplica):
            _check_owner(strategy, leaf, names, i)
            if leaf._ragged is not None:
                raise errors.InvalidArgumentError(
                    f"strategy.run: {names[i]} is a PerReplica whose replicas hold values of "
                    "different shapes that cannot be stacked "
                    f"({[jax.tree.map(np.shape, v) for v in leaf.values]}); give every replica "
                    "values with the same shape (pad them) before passing them to run."
                )
            value_leaves, value_def = jax.tree.flatten(leaf._value)
            kinds.append(("sharded", value_def, len(value_leaves)))
            dynamic.extend(value_leaves)
            if leaf._mask is not None and mask_value is None:
                mask_value, lengths = leaf._mask, leaf._lengths
        elif isinstance(leaf, Mirrored):
            _check_owner(strategy, leaf, names, i)
            value_leaves, value_def = jax.tree.flatten(leaf._value)
            kinds.append(("mirrored", value_def, len(value_leaves)))
            dynamic.extend(value_leaves)
        elif isinstance(leaf, jax.core.Tracer):
            raise _inside_transformation(f"argument {names[i]}")
        elif isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
            kinds.append(("array",))
            dynamic.append(_place(strategy, leaf, names, i))
        elif isinstance(leaf, _DATASET_TYPES()):
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
            kinds.append(("static", leaf))
    kinds = tuple(kinds)
    # The batch mask enters sharded, with the step's number of real examples (all replicas)
    # replicated, so `compute_average_loss` needs no cross-replica sum to count them.
    batch_info = None
    if mask_value is not None:
        batch_info = (mask_value, None if lengths is None else _example_count(strategy, lengths))
    mask_key = None if batch_info is None else batch_info[1] is not None
    if fn_node is fn:
        fn_key = type(fn)
    elif fn_node is not None:
        fn_key = (type(fn_node), fn.__func__)
    else:
        fn_key = fn

    # Fast path: NNX modules and optimizers are pytrees whose leaves are their Variables, so
    # JAX's C++ flatten finds the caller's Variables and a hashable structure in microseconds;
    # `nnx.split` (a Python walk of the object graph) runs only when a program is compiled, or
    # for graphs a pytree cannot express (shared Variables, non-pytree modules).
    variables, node_def = jax.tree.flatten(tuple(nodes), is_leaf=_is_variable)
    fast = len({id(v) for v in variables}) == len(variables) and all(map(_is_variable, variables))
    if fast:
        key = (fn_key, treedef, kinds, node_def, tuple(map(type, variables)), mask_key)
        program = strategy._run_cache.get(key)
        live = None if program is None or program.order is None else [
            variables[i] for i in program.order
        ]
    if not fast or live is None:
        graphdef, state = nnx.split(tuple(nodes))
        state_def = jax.tree.structure(state)
        live = jax.tree.leaves(state, is_leaf=_is_variable)
        if not fast:
            key = (fn_key, treedef, kinds, graphdef, state_def, mask_key)
            program = strategy._run_cache.get(key)
    state_leaves = [
        _place(strategy, x, names, None, nodes)
        for x in jax.tree.leaves([v.get_raw_value() for v in live])
    ]
    if program is None:
        _check_captures(fn, fn_node)
        _check_static_holders(kinds, names)
        _warn_on_retracing(strategy, fn_key, fn, kinds)
        node_names = tuple(names.of_node(node) for node in nodes)
        spec = _Spec(strategy, fn, fn_node, treedef, kinds, graphdef, state_def, node_names)
        program = _compile(spec, state_leaves, dynamic, batch_info)
        per_variable = state_def.num_leaves == len(live)
        if fast and per_variable:
            index = {id(v): i for i, v in enumerate(variables)}
            program.order = tuple(index[id(v)] for v in live)
        strategy._run_cache[key] = program
        if len(strategy._run_cache) > _CACHE_SIZE:
            strategy._run_cache.pop(next(iter(strategy._run_cache)))

    return program, live, nodes, state_leaves, dynamic, batch_info, mask_value, lengths


def _finish(strategy, program, live, nodes, new_state, outputs, mask_value, lengths):
    """Writes the step's new state back into the caller's objects and wraps the outputs."""
    if program.same_state:  # a flat list: its first leaf, without a flatten on the fast path
        first = new_state[0] if new_state else (outputs[0] if outputs else None)
    else:
        first = next(iter(jax.tree.leaves((new_state, outputs))), None)
    if isinstance(first, jax.core.Tracer):
        # Called inside an outer jax.jit / nnx.jit with the NNX objects captured by the jitted
        # function (so no argument was traced): the new state exists only inside that trace,
        # and writing it back into the caller's objects would fail in flax.
        raise _inside_transformation("the step's result")
    _bound_in_flight(strategy, new_state, outputs)
    if program.same_state and len(live) == len(new_state) and live:
        # The caller's own Variable objects: set them directly (no graph walk). The first set
        # checks that we are outside any JAX trace; that holds for the rest too, so they skip
        # NNX's per-set trace check (Variable.__setattr__ runs it even when set_raw_value is
        # told to bypass it; about 1.2 µs per variable).
        live[0].set_raw_value(new_state[0])
        if _RAW_VALUE_SLOT and not getattr(live[0], "hijax", False):
            for variable, value in zip(live[1:], new_state[1:]):
                object.__setattr__(variable, _RAW_VALUE, value)
        else:  # another flax layout: the public setter
            for variable, value in zip(live[1:], new_state[1:]):
                variable.set_raw_value(value, _unsafe_bypass_check=True)
    elif nodes:
        nnx.update(tuple(nodes), new_state)
    wrapped = [
        PerReplica(strategy, x, mask=mask_value, lengths=lengths)
        if varying
        else Mirrored(strategy, x)
        for x, varying in zip(outputs, program.out_varying)
    ]
    return jax.tree.unflatten(program.out_treedef, wrapped)


# Where flax's Variable keeps its value (`get_raw_value` returns it): a slot of nnx.Variable.
_RAW_VALUE = "_raw_value"
_RAW_VALUE_SLOT = _RAW_VALUE in getattr(nnx.Variable, "__slots__", ())


# XLA:CPU runs a multi-device program's all-reduce as a rendezvous of host threads; with about
# 100 such steps queued it deadlocks and aborts the process. On CPU, wait for the oldest step
# once this many are in flight (accelerators queue steps on their own streams and need no cap).
_CPU_MAX_IN_FLIGHT = 4


def _bound_in_flight(strategy, new_state, outputs):
    queue_ = strategy._in_flight
    if queue_ is None:
        return
    token = next(iter(jax.tree.leaves((new_state, outputs))), None)
    if token is None:
        return
    queue_.append(token)
    if len(queue_) > _CPU_MAX_IN_FLIGHT:
        jax.block_until_ready(queue_.popleft())


def new_in_flight(devices):
    """The per-strategy queue of in-flight steps, or None where no cap is needed."""
    if len(devices) > 1 and devices[0].platform == "cpu":
        return collections.deque()
    return None


_RETRACE_WARNING_AT = 6


def _warn_on_retracing(strategy, fn_key, fn, kinds):
    """Warns, as tf.function does, when one function keeps being compiled anew."""
    counts = strategy._compile_counts
    counts[fn_key] = counts.get(fn_key, 0) + 1
    if counts[fn_key] == _RETRACE_WARNING_AT:
        statics = [repr(kind[1]) for kind in kinds if kind[0] == "static"]
        warnings.warn(
            f"strategy.run has compiled {_fn_name(fn)} {_RETRACE_WARNING_AT} times. Each new "
            "input shape, structure or Python value (compile-time constant) makes a new "
            f"program; this call's Python values: {', '.join(statics) or 'none'}. Pass values "
            "that change every step as arrays (jnp.int32(step)) and keep batch shapes fixed.",
            stacklevel=3,
        )


def _inside_transformation(what: str) -> Exception:
    return errors.ReplicaContextError(
        f"strategy.run: {what} is a traced value: strategy.run was called inside jax.jit, "
        "nnx.jit or another JAX transformation, or given a jitted function. strategy.run "
        "already compiles the step into one program: call it directly with the plain step "
        "function, without the decorator (the TF habit of wrapping it in @tf.function is not "
        "needed)."
    )


def _DATASET_TYPES():
    from mirrax._src.distribute import input as input_lib

    return (input_lib.DistributedDataset, input_lib.DistributedDatasetsFromFunction,
            input_lib.DistributedIterator)


class _LazyNames:
    """Human names ('args[0]', "kwargs['model']") of argument leaves, built only for messages."""

    def __init__(self, structure):
        self._structure = structure
        self._paths = None

    def _all(self):
        if self._paths is None:
            self._paths = [
                (path, leaf)
                for path, leaf in jax.tree_util.tree_flatten_with_path(
                    self._structure, is_leaf=_is_argument_leaf
                )[0]
            ]
        return self._paths

    def __getitem__(self, i) -> str:
        return _describe_path(self._all()[i][0])

    def of_node(self, node) -> str:
        for path, leaf in self._all():
            if leaf is node:
                return _describe_path(path)
        return type(node).__name__


def new_cache() -> dict:
    """The per-strategy cache of compiled programs (oldest first; the oldest is dropped)."""
    return {}


_VARIABLE_TYPES: dict = {}


def _is_variable(x) -> bool:
    # isinstance through NNX's metaclass costs microseconds; cache the answer per type.
    kind = type(x)
    answer = _VARIABLE_TYPES.get(kind)
    if answer is None:
        answer = _VARIABLE_TYPES[kind] = isinstance(x, nnx.Variable)
    return answer


@dataclasses.dataclass(frozen=True)
class _Spec:
    """Everything static about one `run` call: what the compiled body must rebuild."""

    strategy: Any
    fn: Any
    fn_node: Any
    treedef: Any
    kinds: tuple
    graphdef: Any
    state_def: Any
    node_names: tuple


def _example_count(strategy, lengths) -> jax.Array:
    """The int32 total of `lengths` (every replica's real rows), replicated; cached per value."""
    total = int(sum(lengths))
    cache = strategy._example_counts
    count = cache.get(total)
    if count is None:
        count = jax.make_array_from_callback(
            (), strategy._replicated, lambda _: np.asarray(total, np.int32))
        if len(cache) >= _CACHE_SIZE:
            cache.pop(next(iter(cache)))
        cache[total] = count
    return count


def _compile(spec: _Spec, state_leaves, dynamic, batch_info) -> _Program:
    mesh = spec.strategy.mesh
    dynamic_specs = []
    for kind in spec.kinds:
        if kind[0] == "sharded":
            dynamic_specs.extend([P(REPLICA_AXIS)] * kind[2])
        elif kind[0] == "mirrored":
            dynamic_specs.extend([P()] * kind[2])
        elif kind[0] == "array":
            dynamic_specs.append(P())
    if batch_info is None:
        batch_spec = None
    else:
        batch_spec = (P(REPLICA_AXIS), None if batch_info[1] is None else P())
    in_specs = (P(), dynamic_specs, batch_spec)
    found = {}

    def probe(state_leaves, dynamic, batch_info):
        new_state, outputs, found["treedef"] = _body(spec, state_leaves, dynamic, batch_info)
        found["varying"] = tuple(REPLICA_AXIS in _compat.varying_axes(x) for x in outputs)
        found["same_state"] = jax.tree.structure(new_state) == spec.state_def
        return new_state, [_compat.pvary(x, REPLICA_AXIS)[None] for x in outputs]

    try:
        jax.eval_shape(
            jax.shard_map(probe, mesh=mesh, in_specs=in_specs, out_specs=(P(), P(REPLICA_AXIS))),
            state_leaves,
            dynamic,
            batch_info,
        )
    except jax.errors.UnexpectedTracerError as e:
        raise _inside_transformation("a value of the step") from e
    varying, same_state = found["varying"], found["same_state"]

    def body(state_leaves, dynamic, batch_info):
        new_state, outputs, _ = _body(spec, state_leaves, dynamic, batch_info)
        if same_state:
            new_state = jax.tree.leaves(new_state)
        return new_state, [x[None] if v else x for x, v in zip(outputs, varying)]

    out_specs = (P(), [P(REPLICA_AXIS) if v else P() for v in varying])
    compiled = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs),
                       compiler_options=invariant.compiler_options(spec.strategy))
    return _Program(compiled, found["treedef"], varying, same_state)


def _body(spec: _Spec, state_leaves, dynamic, batch_info):
    """The per-replica program: rebuild the arguments, run the user's function, aggregate state.

    `batch_info` is None, or (this replica's (1, rows) batch mask, the step's int32 count of
    real examples over all replicas or None).
    """
    state = jax.tree.unflatten(spec.state_def, state_leaves)
    # Read before merging: merge may reuse these Variable objects, which the step then mutates.
    old_values = {path: v.get_value() for path, v in nnx.to_flat_state(state)}
    nodes = nnx.merge(spec.graphdef, state)
    rebuilt, position = [], 0
    for kind in spec.kinds:
        if kind[0] == "node":
            rebuilt.append(nodes[kind[1]])
        elif kind[0] in ("sharded", "mirrored"):
            chunk = dynamic[position : position + kind[2]]
            position += kind[2]
            if kind[0] == "sharded":
                chunk = [x[0] for x in chunk]
            rebuilt.append(jax.tree.unflatten(kind[1], chunk))
        elif kind[0] == "array":
            rebuilt.append(dynamic[position])
            position += 1
        else:
            rebuilt.append(kind[1])
    fn_node, args, kwargs = jax.tree.unflatten(spec.treedef, rebuilt)

    replica_id = jax.lax.axis_index(REPLICA_AXIS)
    # Replica-invariant mode keys randomness by the global micro-batch index instead
    # (invariant.micro_batch_call), which does not depend on the replica count.
    rng_keys = [] if spec.strategy.replica_invariant else [
        v for _, v in nnx.iter_graph(nodes) if isinstance(v, nnx.RngKey)]
    original_keys = [v.get_value() for v in rng_keys]
    for variable in rng_keys:
        variable.set_value(jax.random.fold_in(variable.get_value(), replica_id))

    mask, count = (None, None) if batch_info is None else batch_info
    ctx = ReplicaContext(spec.strategy, batch_mask=None if mask is None else mask[0],
                         example_count=count)
    try:
        with replica_context_scope(ctx):
            if spec.fn_node is None:
                outputs = spec.fn(*args, **kwargs)
            elif spec.fn_node is spec.fn:
                outputs = fn_node(*args, **kwargs)
            else:
                outputs = spec.fn.__func__(fn_node, *args, **kwargs)
    except flax.errors.TraceContextError as e:
        raise errors.CapturedStateError(
            f"strategy.run: {_fn_name(spec.fn)} mutates an NNX object it reaches through a "
            "closure, a global or an attribute, not through its arguments; the update would be "
            "lost. Pass the object in args, e.g. strategy.run(step, args=(model, optimizer, "
            f"batch)), and use the argument inside the function. (flax said: {e})"
        ) from e
    except ValueError as e:
        # flax's nnx.split / nnx.grad of an object that belongs to no trace of this step (it was
        # reached through an unrelated object); flax raises a plain ValueError for it.
        if "different trace level" not in str(e):
            raise
        raise errors.CapturedStateError(
            f"strategy.run: {_fn_name(spec.fn)} uses an NNX object it reaches through an "
            "object that is not one of its arguments (an attribute of a plain object, a "
            "closure or a global), so flax cannot transform it inside the step. Pass the NNX "
            "objects themselves in args, e.g. strategy.run(step, args=(model, optimizer, "
            f"batch)), and use the arguments inside the function. (flax said: {e})"
        ) from e

    for variable, key in zip(rng_keys, original_keys):
        variable.set_value(key)
    _, new_state = nnx.split(nodes)
    _warn_if_not_invariant(spec, new_state, old_values, ctx)
    new_state = _aggregate(spec, new_state, old_values, replica_id, ctx)

    # Variables (e.g. the gradients nnx.grad returns) come back as their values.
    outputs = jax.tree.map(
        lambda x: x.get_value() if _is_variable(x) else x, outputs, is_leaf=_is_variable
    )
    out_leaves = jax.tree.leaves(outputs, is_leaf=is_graph_node)
    for leaf in out_leaves:
        if is_graph_node(leaf) or not isinstance(leaf, _ARRAY_LIKE):
            raise errors.InvalidArgumentTypeError(
                f"strategy.run: {_fn_name(spec.fn)} returned a {type(leaf).__name__}; the "
                "function must return arrays or pytrees (tuples, lists, dicts) of arrays. NNX "
                "objects passed in args are updated in place and need not be returned."
            )
    out_leaves, out_treedef = jax.tree.flatten(jax.tree.map(jnp.asarray, outputs))
    return new_state, out_leaves, out_treedef


def _aggregate(spec: _Spec, new_state, old: dict, replica_id, ctx):
    """Makes every state leaf unvarying, by its variable's aggregation.

    See docs/design.md, "`strategy.run`".

    `old` maps each state path to its value before the step (for SUM: old + sum of updates).
    """
    flat = []
    exact = spec.strategy.replica_invariant
    for path, variable in nnx.to_flat_state(new_state):
        value = variable.get_value()
        if not isinstance(value, jax.Array):
            flat.append((path, variable))
            continue
        aggregation = aggregation_of(variable)
        varying = REPLICA_AXIS in _compat.varying_axes(value)
        before = old.get(path)
        if exact and aggregation in (VariableAggregation.SUM, VariableAggregation.MEAN):
            # The fixed tree over the replicas (the same bits at every replica count), with
            # TF's meaning: every replica's SUM update counts. Values that
            # invariant.micro_batch_call already combined over all micro-batches are final.
            if ctx.is_combined(value) or value is before or (
                    aggregation is VariableAggregation.MEAN and not varying):
                flat.append((path, variable))
                continue
            if aggregation is VariableAggregation.MEAN:
                value = invariant.exact_pmean(value).astype(value.dtype)
            elif before is not None:
                value = before + invariant.exact_psum(value - before)
            else:
                value = invariant.exact_psum(value)
            flat.append((path, variable.replace(value)))
            continue
        if aggregation is VariableAggregation.SUM and before is not None:
            # Every replica's update counts, as in TF, even when JAX proves they are equal.
            delta = _compat.pvary(value - before, REPLICA_AXIS)
            value = before + jax.lax.psum(delta, REPLICA_AXIS)
            flat.append((path, variable.replace(value)))
            continue
        if not varying:
            flat.append((path, variable))
            continue
        if aggregation is VariableAggregation.NONE:
            name = spec.node_names[path[0]] + "".join(f".{p}" for p in path[1:])
            raise errors.VaryingVariableError(
                f"strategy.run: after {_fn_name(spec.fn)}, variable {name} "
                f"({type(variable).__name__}, aggregation NONE) holds a different value on each "
                "replica, so there is no single value to write back. Usually it was updated "
                "from a per-replica quantity: make the update identical on every replica (e.g. "
                "mirrax.get_replica_context().all_reduce('mean', x)), or declare how replicas "
                "combine it, e.g. nnx.Variable(value, aggregation=mirrax.VariableAggregation.MEAN)."
            )
        if aggregation is VariableAggregation.MEAN:
            value = jax.lax.pmean(value, REPLICA_AXIS).astype(value.dtype)
        elif aggregation is VariableAggregation.SUM:  # a variable the step created
            value = jax.lax.psum(value, REPLICA_AXIS)
        else:  # ONLY_FIRST_REPLICA
            first = jnp.where(replica_id == 0, value, jnp.zeros_like(value))
            value = jax.lax.psum(first.astype(jnp.result_type(value, jnp.int32)), REPLICA_AXIS)
            value = value.astype(variable.get_value().dtype)
        flat.append((path, variable.replace(value)))
    return nnx.from_flat_state(flat)


def _warn_if_not_invariant(spec: _Spec, new_state, old: dict, ctx) -> None:
    """Replica-invariant mode: warns when the step changed parameters without
    `mirrax.value_and_grad` (e.g. with `nnx.value_and_grad`), which loses the guarantee."""
    if not spec.strategy.replica_invariant or ctx.micro_batches_used:
        return
    changed = [path for path, variable in nnx.to_flat_state(new_state)
               if isinstance(variable, nnx.Param) and variable.get_value() is not old.get(path)]
    if changed:
        warnings.warn(
            f"strategy.run: {_fn_name(spec.fn)} changed parameters on a strategy with "
            "replica_invariant=True without computing gradients through "
            "mirrax.value_and_grad(loss_fn)(model, batch), so its results depend on the replica "
            "count (nnx.value_and_grad or jax.grad sum each replica's whole shard at once). "
            "Take the gradients with mirrax.value_and_grad, passing the batch as an argument.",
            stacklevel=4,
        )


def _place(strategy, x, names, index, nodes=None):
    """Puts an input array on the strategy's mesh, replicated; refuses another strategy's arrays.

    `names[index]` (or, with `nodes`, the NNX objects) names the argument in the error.
    """
    if not isinstance(x, jax.Array):
        return x
    if isinstance(x, jax.core.Tracer):
        raise _inside_transformation("the state of the NNX objects")
    target = strategy._replicated
    sharding = x.sharding
    if sharding == target:
        return x
    if _elsewhere(strategy, x):
        raise _mixed_placement(strategy, x, names, index, nodes)
    if jax.process_count() > 1 and x.is_fully_addressable:
        # This process's copy of a replicated value (every process holds the same one, e.g.
        # just initialized or restored): copy it to the local devices; JAX would otherwise
        # attempt a cross-host transfer.
        local = [d for d in strategy.mesh.devices.flat if d.process_index == jax.process_index()]
        return jax.make_array_from_single_device_arrays(
            x.shape, target, [jax.device_put(x, d) for d in local]
        )
    return jax.device_put(x, target)


def _mixed_placement(strategy, x, names, index, nodes) -> Exception:
    """The MixedStrategyError for `x`, placed by another multi-replica strategy.

    Names what the user passed: the argument position and, for NNX state, the object's type
    and the variable's path inside it (e.g. "args[0] (a Net): variable l.kernel (Param)").
    """
    devices = _device_names(x.sharding.mesh.devices.flat)
    mine = _device_names(strategy.mesh.devices.flat)
    if nodes is None:
        what = (f"argument {names[index]} (a {type(x).__name__} of shape {tuple(x.shape)})")
        fix = f"jax.device_get({names[index]}) (a NumPy copy) in its place"
    else:
        offenders = []
        for node in nodes:
            for path, variable in nnx.to_flat_state(nnx.state(node)):
                value = variable.get_raw_value() if _is_variable(variable) else variable
                if any(leaf is x or _elsewhere(strategy, leaf)
                       for leaf in jax.tree.leaves(value)):
                    offenders.append(
                        f"{names.of_node(node)} (a {type(node).__name__}): variable "
                        f"{'.'.join(map(str, path)) or '(itself)'} ({type(variable).__name__})")
                    break
        what = "; ".join(offenders) or "the state of the NNX objects"
        fix = ("its state back to the host first: nnx.update(obj, jax.device_get(nnx.state("
               "obj))) for each object named (for a mirrax.Model, on the module, before "
               "mirrax.Model(module) and compile)")
    return errors.MixedStrategyError(
        f"strategy.run: {what} lives on another strategy's devices ({devices}), but this "
        f"{type(strategy).__name__} runs on {mine}: the object was placed there when another "
        "multi-replica strategy used it (its strategy.run, or a Model's fit / evaluate / "
        f"predict). One object is used by one multi-replica strategy at a time. To use it "
        f"here, bring {fix}; or create (or restore) it anew for this strategy."
    )


def _elsewhere(strategy, x) -> bool:
    """True for an array placed by a multi-replica strategy on other devices than `strategy`'s."""
    sharding = getattr(x, "sharding", None)
    return (
        isinstance(x, jax.Array)
        and isinstance(sharding, NamedSharding)
        and sharding.mesh.size > 1
        and strategy.num_replicas_in_sync > 1
        and tuple(sharding.mesh.devices.flat) != tuple(strategy.mesh.devices.flat)
    )


def _check_owner(strategy, value, names, index=None):
    """Refuses a distributed value made by another strategy; `names[index]` names it."""
    if value._strategy is not strategy:
        what = names if index is None else names[index]
        raise errors.MixedStrategyError(
            f"{what} is a {type(value).__name__} created by another strategy "
            f"({type(value._strategy).__name__} with {value._strategy.num_replicas_in_sync} "
            f"replicas), not by this {type(strategy).__name__}. Distribute the dataset or values "
            "with the strategy that will run them."
        )


def _check_captures(fn, fn_node):
    """Refuses functions that reach NNX objects through closures, globals or `self` attributes.

    Such state would be baked into the compiled program as constants (stale after the first
    step) and its updates lost; TF programs often do this, so the message shows the fix.
    """
    found = _captured_nodes(fn, fn_node, depth=0, seen=set())
    if found:
        names = ", ".join(f"{name!r} ({type(obj).__name__})" for name, obj in found)
        raise errors.CapturedStateError(
            f"strategy.run: {_fn_name(fn)} captures NNX state {names} from outside its "
            "arguments (a closure, a global, or an attribute of self). Its values would be "
            "compiled in as constants and its updates lost. Pass the object in args and use the "
            f"argument: def {_fn_name(fn)}(model, optimizer, batch): ... ; "
            "strategy.run(step, args=(model, optimizer, batch))."
        )


def _check_static_holders(kinds, names):
    """Refuses a compile-time-constant argument (a plain object) that holds NNX objects.

    Such an object is hashed, not traversed, so the NNX state inside it would be compiled in
    as constants and its updates lost, as with a captured object.
    """
    for i, kind in enumerate(kinds):
        if kind[0] != "static":
            continue
        held = _attribute_nodes(names[i], kind[1], None)
        if held:
            listing = ", ".join(f"{name} ({type(obj).__name__})" for name, obj in held)
            raise errors.CapturedStateError(
                f"strategy.run: argument {names[i]} is a {type(kind[1]).__name__} that holds "
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


def _describe_path(path) -> str:
    """'args[0]', "kwargs['model']" or 'the function' for a path into (fn_node, args, kwargs)."""
    if not path:
        return "the function"
    head, rest = path[0], path[1:]
    root = {0: "the function", 1: "args", 2: "kwargs"}[head.idx]
    return root + jax.tree_util.keystr(tuple(rest))


def _device_names(devices) -> str:
    names = [f"{d.platform}:{d.id}" for d in devices]
    return ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")


def _fn_name(fn) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__
