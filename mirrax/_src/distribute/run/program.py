"""The compiled program of one `strategy.run` call structure: one `jax.jit(jax.shard_map(...))`.

Inside, the NNX objects are merged back from their state, RNG streams are folded with the
replica id, the user's function runs under a `ReplicaContext`, and the new state is aggregated
by each variable's `VariableAggregation` before it leaves the program unvarying (docs/design.md,
"`strategy.run`"). JAX's vma typing tells which outputs vary across replicas: those come back
as `PerReplica`, the others as `Mirrored`. Finding which outputs vary needs one abstract trace
before the real one, so a program's first call traces the function twice.

The state buffers are donated to the program when its new state has the old one's shapes and
dtypes (the normal training step): the caller's Variables are rewritten after every step, so
their old buffers are reused for the new values instead of allocating fresh ones.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import Any

import flax.errors
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from mirrax import errors
from mirrax._src.distribute import (
    _compat,
    batch_stats,
    exact_sums,
    invariant,
    prng_keys,
    scan_carry,
    sharded_optimizer,
)
from mirrax._src.distribute.reduce import VariableAggregation, aggregation_of
from mirrax._src.distribute.replica_context import (
    REPLICA_AXIS,
    ReplicaContext,
    replica_context_scope,
)
from mirrax._src.distribute.run import rebuild
from mirrax._src.distribute.run.arguments import (
    CONCRETE_VALUE_ERRORS,
    ArraySlot,
    MirroredSlot,
    NodeSlot,
    ShardedSlot,
    fn_name,
    inside_transformation,
    is_graph_node,
    is_variable,
    traced_value,
)

_ARRAY_LIKE = (jax.Array, np.ndarray, np.generic, bool, int, float, complex)


@dataclasses.dataclass(frozen=True)
class Spec:
    """Everything static about one `run` call: what the compiled body must rebuild."""

    strategy: Any
    fn: Any
    fn_node: Any
    treedef: Any
    slots: tuple
    graphdef: Any
    state_def: Any
    node_names: tuple
    state_specs: tuple | None = None  # per state leaf, sharded_optimizer.state_specs
    captured: tuple = ()  # per NNX object `fn` captures (captures.py order), its index in nodes


@dataclasses.dataclass(eq=False)  # hashed by identity: a key of NodeState.memo
class Program:
    """A compiled step and what its first trace learned about the outputs.

    Attributes:
      compiled: the jitted program, (state leaves, dynamic leaves, batch info) -> (new state,
        outputs).
      out_treedef: the structure of the function's outputs.
      out_varying: per output leaf, whether it differs across replicas.
      same_state: the new state has the old one's structure, returned as a flat list.
      donates: the state leaves are donated (same structure, shapes and dtypes).
      order: for NNX objects that flatten to distinct Variables, the position in that
        flatten of each state leaf's Variable (so objects of the same structure find their
        Variables without `nnx.split`); else None.
      sums_padding: the step takes a distributed batch, never reads its mask, and updates
        state or returns more than per-example rows: on a padded batch its reductions
        count the padding rows (the runner warns, `padding_warned` once set).
      batch_rows: the static per-replica rows of the step's distributed batch, or None.
      state_def: the structure of the state (and, with `same_state`, of the new state).
      step: the program's function before `jax.jit` (a `mirrax.function` traces it into its
        own program: a nested jit cannot carry the compiler options).
    """

    compiled: Any
    out_treedef: Any
    out_varying: tuple
    same_state: bool
    donates: bool
    order: tuple | None = None
    sums_padding: bool = False
    padding_warned: bool = False
    batch_rows: int | None = None
    state_def: Any = None
    step: Any = None


def compile_program(spec: Spec, state_leaves, dynamic, batch_info) -> Program:
    """Traces `spec`'s function abstractly, then builds its program (compiled on first call).

    Raises:
      ReplicaContextError: a value of the step is a tracer of an outer transformation.
    """
    mesh = spec.strategy.mesh
    dynamic_specs = []
    for slot in spec.slots:
        if isinstance(slot, ShardedSlot):
            dynamic_specs.extend([P(REPLICA_AXIS)] * slot.count)
        elif isinstance(slot, MirroredSlot):
            dynamic_specs.extend([P()] * slot.count)
        elif isinstance(slot, ArraySlot):
            dynamic_specs.append(P())
    if batch_info is None:
        batch_spec = None
    else:
        batch_spec = (P(REPLICA_AXIS), None if batch_info[1] is None else P())
    specs = spec.state_specs
    state_specs = P() if specs is None else [s if s is not None else P() for s in specs]
    in_specs = (state_specs, dynamic_specs, batch_spec)
    found: dict = {}

    def probe(state_leaves, dynamic, batch_info):
        new_state, outputs, found["treedef"], recorded = _body(spec, state_leaves, dynamic, batch_info, found)
        found["varying"] = tuple(REPLICA_AXIS in _compat.varying_axes(x) for x in outputs)
        if batch_info is not None:
            # Per-example outputs (one row per row of the batch) are trimmed of their padding
            # by experimental_local_results; anything else is a reduction or a state update.
            rows = batch_info[0].shape[-1]
            found["sums_padding"] = not found["mask_consulted"] and (
                found["state_changed"]
                or not all(
                    v and x.ndim >= 1 and x.shape[0] == rows for x, v in zip(outputs, found["varying"])
                )
            )
        found["same_state"] = jax.tree.structure(new_state) == spec.state_def
        found["new_avals"] = [(x.shape, x.dtype) for x in jax.tree.leaves(new_state)]
        if specs is not None:
            if not found["same_state"]:
                raise errors.UnsupportedArgumentError(
                    f"strategy.run: {fn_name(spec.fn)} creates or removes variables, which a "
                    "strategy with shard_optimizer_state=True does not support. Create every "
                    "variable before the step (e.g. build the model and optimizer first)."
                )
            new_state = jax.tree.leaves(new_state)
        return new_state, [_compat.pvary(x, REPLICA_AXIS)[None] for x in list(outputs) + list(recorded)]

    try:
        jax.eval_shape(
            jax.shard_map(probe, mesh=mesh, in_specs=in_specs, out_specs=(state_specs, P(REPLICA_AXIS))),
            state_leaves,
            dynamic,
            batch_info,
        )
    except jax.errors.UnexpectedTracerError as e:
        raise inside_transformation("a value of the step") from e
    varying, same_state = found["varying"], found["same_state"]
    # The probe saw each replica's block of a sharded array: compare blocks with blocks.
    blocks = specs or (None,) * len(state_leaves)
    replicas = spec.strategy.num_replicas_in_sync
    donates = (
        same_state
        and bool(state_leaves)
        and found["new_avals"]
        == [
            (sharded_optimizer.local_shape(jnp.shape(x), s, replicas), jnp.result_type(x))
            for x, s in zip(state_leaves, blocks)
        ]
    )
    updates = found.get("updates", [])
    recorded_specs = [s for u in updates for s in u.grad_specs + (P(),) * u.kwargs_count]

    def body(state_leaves, dynamic, batch_info):
        new_state, outputs, _, recorded = _body(spec, state_leaves, dynamic, batch_info)
        if same_state:
            new_state = jax.tree.leaves(new_state)
        return new_state, [x[None] if v else x for x, v in zip(outputs, varying)], recorded

    out_specs = (state_specs, [P(REPLICA_AXIS) if v else P() for v in varying], recorded_specs)
    per_replica = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs)

    def step(state_leaves, dynamic, batch_info):
        new_state, outputs, recorded = per_replica(state_leaves, dynamic, batch_info)
        if updates:  # the deferred optimizer updates, in global view (sharded_optimizer.py)
            new_state = sharded_optimizer.apply_updates(mesh, updates, specs, new_state, recorded)
        return new_state, outputs

    compiled = jax.jit(
        step,
        donate_argnums=(0,) if donates else (),
        compiler_options=invariant.compiler_options(spec.strategy),
    )
    return Program(
        compiled,
        found["treedef"],
        varying,
        same_state,
        donates,
        sums_padding=found.get("sums_padding", False),
        batch_rows=None if batch_info is None else batch_info[0].shape[-1],
        state_def=spec.state_def,
        step=step,
    )


def _body(spec: Spec, state_leaves, dynamic, batch_info, found=None):
    """The per-replica program: rebuild the arguments, run the user's function, aggregate state.

    `batch_info` is None, or (this replica's (1, rows) batch mask, the step's int32 count of
    real examples over all replicas or None). With sharded optimizer state, the optimizers'
    updates are recorded (their arrays are the last result) for the program to apply after
    this body; `found`, on the first trace, receives their static part.
    """
    state = jax.tree.unflatten(spec.state_def, state_leaves)
    variables = jax.tree.leaves(state, is_leaf=is_variable)
    sharded_paths: frozenset = frozenset()
    if spec.state_specs is not None:
        at = sharded_optimizer.variable_positions(variables)
        sharded_paths = frozenset(
            path
            for path, v in nnx.to_flat_state(state)
            if id(v) in at and spec.state_specs[at[id(v)]] is not None
        )
    # Read before merging: merge may reuse these Variable objects, which the step then mutates.
    old_values = {path: v.get_value() for path, v in nnx.to_flat_state(state)}
    nodes = nnx.merge(spec.graphdef, state)
    rebuilt, position = [], 0
    for slot in spec.slots:
        if isinstance(slot, NodeSlot):
            rebuilt.append(nodes[slot.index])
        elif isinstance(slot, (ShardedSlot, MirroredSlot)):
            chunk = dynamic[position : position + slot.count]
            position += slot.count
            if isinstance(slot, ShardedSlot):
                chunk = [x[0] for x in chunk]
            rebuilt.append(jax.tree.unflatten(slot.treedef, chunk))
        elif isinstance(slot, ArraySlot):
            rebuilt.append(dynamic[position])
            position += 1
        else:
            rebuilt.append(slot.value)
    fn_node, args, kwargs = jax.tree.unflatten(spec.treedef, rebuilt)

    replica_id = jax.lax.axis_index(REPLICA_AXIS)
    # Replica-invariant mode keys randomness by the global micro-batch index instead
    # (invariant.micro_batch_call), which does not depend on the replica count.
    keys_folded = (
        contextlib.nullcontext() if spec.strategy.replica_invariant else prng_keys.folded(nodes, replica_id)
    )

    mask, count = (None, None) if batch_info is None else batch_info
    ctx = ReplicaContext(spec.strategy, batch_mask=None if mask is None else mask[0], example_count=count)
    recorder = (
        None
        if spec.state_specs is None
        else sharded_optimizer.Recorder(
            nodes, variables, spec.state_specs, fn_name(spec.fn), ctx.scattered_gradients
        )
    )
    fn = spec.fn
    if spec.captured:  # the function reaching the merged objects instead of the caller's
        fn = rebuild.substitute(fn, spec.fn_node, tuple(nodes[i] for i in spec.captured))
    try:
        # A scan whose carry starts replica-invariant but turns per-replica (an RNN) is
        # made to start varying (scan_carry.py).
        with (
            keys_folded,
            replica_context_scope(ctx),
            scan_carry.varying_carries(),
            batch_stats.masked_batch_layers(),
        ):
            if spec.fn_node is None:
                outputs = fn(*args, **kwargs)
            elif spec.fn_node is spec.fn:
                outputs = fn_node(*args, **kwargs)
            else:
                outputs = fn.__func__(fn_node, *args, **kwargs)
        if recorder is not None:
            recorder.check_unchanged()
    except flax.errors.TraceContextError as e:
        raise errors.CapturedStateError(
            f"strategy.run: {fn_name(spec.fn)} mutates an NNX object it reaches by a path "
            "mirrax does not carry (an attribute of an attribute of a plain object, or a "
            "helper more than three calls deep), not through its arguments or a direct "
            "capture; the update would be lost. Pass the object in args, e.g. "
            "strategy.run(step, args=(model, optimizer, batch)), or capture the object itself "
            f"(a closure variable or global holding it). (flax said: {e})"
        ) from e
    except CONCRETE_VALUE_ERRORS as e:
        raise traced_value("strategy.run", fn_name(spec.fn), e) from e
    except ValueError as e:
        # flax's nnx.split / nnx.grad of an object that belongs to no trace of this step (it was
        # reached through an unrelated object); flax raises a plain ValueError for it.
        if "different trace level" not in str(e):
            raise
        raise errors.CapturedStateError(
            f"strategy.run: {fn_name(spec.fn)} uses an NNX object it reaches through an "
            "object that is not one of its arguments (an attribute of a plain object, a "
            "closure or a global), so flax cannot transform it inside the step. Pass the NNX "
            "objects themselves in args, e.g. strategy.run(step, args=(model, optimizer, "
            f"batch)), and use the arguments inside the function. (flax said: {e})"
        ) from e
    finally:
        if recorder is not None:
            recorder.close()

    _, new_state = nnx.split(nodes)
    _warn_if_not_invariant(spec, new_state, old_values, ctx)
    if found is not None:
        found["mask_consulted"] = ctx.mask_consulted
        # RNG streams advance at every call whatever the batch; every other update counts.
        found["state_changed"] = any(
            not isinstance(variable, nnx.RngState) and variable.get_value() is not old_values.get(path)
            for path, variable in nnx.to_flat_state(new_state)
        )
    new_state = _aggregate(spec, new_state, old_values, replica_id, ctx, sharded_paths)

    # Variables (e.g. the gradients nnx.grad returns) come back as their values.
    outputs = jax.tree.map(lambda x: x.get_value() if is_variable(x) else x, outputs, is_leaf=is_variable)
    out_leaves = jax.tree.leaves(outputs, is_leaf=is_graph_node)
    for leaf in out_leaves:
        if is_graph_node(leaf) or not isinstance(leaf, _ARRAY_LIKE):
            raise errors.InvalidArgumentTypeError(
                f"strategy.run: {fn_name(spec.fn)} returned a {type(leaf).__name__}; the "
                "function must return arrays or pytrees (tuples, lists, dicts) of arrays. NNX "
                "objects passed in args are updated in place and need not be returned."
            )
    out_leaves, out_treedef = jax.tree.flatten(jax.tree.map(jnp.asarray, outputs))
    recorded = [] if recorder is None else recorder.arrays()
    if found is not None and recorder is not None:
        found["updates"] = recorder.updates
    return new_state, out_leaves, out_treedef, recorded


def _aggregate(spec: Spec, new_state, old: dict, replica_id, ctx, sharded=frozenset()):
    """Makes every state leaf unvarying, by its variable's aggregation.

    See docs/design.md, "`strategy.run`".

    `old` maps each state path to its value before the step (for SUM: old + sum of updates).
    Paths in `sharded` (slices of sharded optimizer state) are left as they are.
    """
    flat = []
    exact = spec.strategy.replica_invariant
    for path, variable in nnx.to_flat_state(new_state):
        value = variable.get_value()
        if not isinstance(value, jax.Array) or path in sharded:
            # A sharded optimizer-state slice is this replica's own; the update after the
            # body writes it.
            flat.append((path, variable))
            continue
        aggregation = aggregation_of(variable)
        varying = REPLICA_AXIS in _compat.varying_axes(value)
        before = old.get(path)
        if exact and aggregation in (VariableAggregation.SUM, VariableAggregation.MEAN):
            # The fixed tree over the replicas (the same bits at every replica count), with
            # TF's meaning: every replica's SUM update counts. Values that
            # invariant.micro_batch_call already combined over all micro-batches are final.
            if (
                ctx.is_combined(value)
                or value is before
                or (aggregation is VariableAggregation.MEAN and not varying)
            ):
                flat.append((path, variable))
                continue
            if aggregation is VariableAggregation.MEAN:
                value = exact_sums.exact_pmean(value).astype(value.dtype)
            elif before is not None:
                value = before + exact_sums.exact_psum(value - before)
            else:
                value = exact_sums.exact_psum(value)
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
                f"strategy.run: after {fn_name(spec.fn)}, variable {name} "
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


def _warn_if_not_invariant(spec: Spec, new_state, old: dict, ctx) -> None:
    """Replica-invariant mode: warns when the step changed parameters without
    `mirrax.value_and_grad` (e.g. with `nnx.value_and_grad`), which loses the guarantee."""
    if not spec.strategy.replica_invariant or ctx.micro_batches_used:
        return
    changed = [
        path
        for path, variable in nnx.to_flat_state(new_state)
        if isinstance(variable, nnx.Param) and variable.get_value() is not old.get(path)
    ]
    if changed:
        warnings.warn(
            f"strategy.run: {fn_name(spec.fn)} changed parameters on a strategy with "
            "replica_invariant=True without computing gradients through "
            "mirrax.value_and_grad(loss_fn)(model, batch), so its results depend on the replica "
            "count (nnx.value_and_grad or jax.grad sum each replica's whole shard at once). "
            "Take the gradients with mirrax.value_and_grad, passing the batch as an argument.",
            stacklevel=4,
        )
