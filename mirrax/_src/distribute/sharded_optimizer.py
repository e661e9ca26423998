"""Optimizer state sharded over the replicas (ZeRO-1): `shard_optimizer_state=True`.

Which arrays are split: every array of an `nnx.Optimizer`'s state (`nnx.OptState` Variables:
Adam's moments, momentum buffers) along its first dimension that the replica count divides;
each replica's device holds 1/R of it. Scalars (step counts) and arrays with no such dimension
(an odd-sized bias) stay whole on every replica: they are small, and a padded array would not
be the logical array a checkpoint stores. Parameters stay replicated.

How the step runs: inside `strategy.run` (per-replica view) `optimizer.update(model, grads)`
only records its arguments; once the replica function returns, the program applies the
optimizer's own `tx.update` and `optax.apply_updates` in global view, in the same compiled
program, where the state arrays are sharded and the parameters replicated. XLA partitions that
update: each device updates its slice of every state array, a cross-leaf reduction such as
`clip_by_global_norm`'s norm is summed over the slices, and the new parameters are all-gathered.
Any optax transformation therefore runs unchanged. Gradients from `mirrax.value_and_grad` (which
`Model.fit` uses) are reduce-scattered, so each replica receives only its slice; with the
all-gather of the new parameters that is one all-reduce's bytes on the wire. Gradients from
`nnx.value_and_grad` arrive all-reduced (JAX sums them) and are sliced locally.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mirrax import errors
from mirrax._src.distribute import _compat
from mirrax._src.distribute.axis import REPLICA_AXIS


def shard_dimension(shape, replicas: int) -> int | None:
    """The first dimension of `shape` that `replicas` divides, or None (the array stays whole)."""
    for dimension, size in enumerate(shape):
        if size >= replicas and size % replicas == 0:
            return dimension
    return None


def spec_for(shape, replicas: int):
    """The PartitionSpec of a sharded array of `shape`, or None when it stays whole."""
    dimension = shard_dimension(shape, replicas)
    if dimension is None:
        return None
    return P(*([None] * dimension), REPLICA_AXIS)


def state_specs(strategy, variables) -> tuple | None:
    """Per state ARRAY (the leaves of the Variables, in program order): the PartitionSpec of a
    sharded one, or None for one that stays whole. None when nothing is deferred: the strategy
    does not shard, has one replica, or the step holds no optimizer state (`nnx.OptState`)."""
    replicas = strategy.num_replicas_in_sync
    if not strategy.extended.shard_optimizer_state or replicas == 1:
        return None
    if not any(isinstance(v, nnx.OptState) for v in variables):
        return None
    specs = []
    for variable in variables:
        value = _compat.raw_value(variable) if isinstance(variable, nnx.Variable) else variable
        leaves = jax.tree.leaves(value)
        if (
            len(leaves) == 1
            and leaves[0] is value
            and isinstance(variable, nnx.OptState)
            and isinstance(value, jax.Array)
            and value.ndim > 0
        ):
            specs.append(spec_for(value.shape, replicas))
        else:
            specs.extend([None] * len(leaves))
    return tuple(specs)


def local_shape(shape, spec, replicas: int) -> tuple:
    """A replica's block of an array of `shape` laid out as `spec` (None: whole)."""
    if spec is None:
        return tuple(shape)
    return tuple(
        n // replicas if axis is not None else n for n, axis in zip(shape, tuple(spec) + (None,) * len(shape))
    )


def variable_positions(variables) -> dict:
    """id(Variable) -> the position of its array among the state leaves, for the Variables
    that hold exactly one array (the others hold a pytree of arrays)."""
    positions, position = {}, 0
    for variable in variables:
        value = _compat.raw_value(variable) if isinstance(variable, nnx.Variable) else variable
        count = len(jax.tree.leaves(value))
        if count == 1:
            positions[id(variable)] = position
        position += count
    return positions


# -- inside the per-replica program ------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Update:
    """What one deferred `optimizer.update` needs in global view (static parts)."""

    tx: Any
    param_def: Any
    param_indices: tuple
    opt_def: Any
    opt_indices: tuple
    grad_specs: tuple
    kwargs_def: Any
    kwargs_count: int


class Recorder:
    """Defers the updates of the optimizers with sharded state during one trace of a step.

    Every `nnx.Optimizer` among the step's objects (once the strategy shards and has more than
    one replica, whatever splits) gets an instance `update` that records `(model, grads,
    **kwargs)` and advances `optimizer.step` (as flax does); `close()` removes it. `updates`
    holds the static part of each record, `arrays()` the traced gradients and keyword arrays, in
    order.
    """

    def __init__(self, nodes, state_variables, specs, fn_name: str, gradients: dict):
        self._index = variable_positions(state_variables)
        self._specs = specs
        self._fn_name = fn_name
        self._gradients = gradients
        self.updates: list = []
        self._done: set = set()
        self._arrays: list = []
        self._recorded_values: list = []  # (Variable, its value when update was recorded)
        self._patched = []
        for _, node in nnx.iter_graph(nodes):
            if isinstance(node, nnx.Optimizer):
                self._check_supported(node)
                # An instance attribute shadowing the method, removed by close().
                node.update = functools.partial(self._record, node)  # type: ignore[method-assign]
                self._patched.append(node)

    def _check_supported(self, optimizer) -> None:
        name = type(optimizer).__name__
        if type(optimizer).update is not nnx.Optimizer.update:
            raise errors.UnsupportedArgumentError(
                f"strategy.run: {self._fn_name} takes a {name}, a subclass of nnx.Optimizer "
                "that overrides update; with shard_optimizer_state=True the update is mirrax's "
                "(applied when the step returns), so the override would never run. Use "
                "nnx.Optimizer itself (do the extra work in the step), or "
                "shard_optimizer_state=False."
            )
        check_shardable(optimizer, f"strategy.run: {self._fn_name}")

    def close(self) -> None:
        for node in self._patched:
            del node.update
        self._patched = []

    def arrays(self) -> list:
        return list(self._arrays)

    def _record(self, optimizer, model, grads, /, **kwargs):
        if id(optimizer) in self._done:
            raise errors.UnsupportedArgumentError(
                f"strategy.run: {self._fn_name} calls optimizer.update twice in one step on a "
                "strategy with shard_optimizer_state=True; the sharded update runs once per "
                "step and optimizer. Sum the gradients first (e.g. accumulate them over "
                "micro-batches) and call optimizer.update once."
            )
        params = nnx.state(model, optimizer.wrt)
        param_variables = jax.tree.leaves(params, is_leaf=_is_variable)
        missing = [v for v in param_variables if id(v) not in self._index]
        if missing:
            raise errors.UnsupportedArgumentError(
                f"strategy.run: {self._fn_name} calls optimizer.update on parameters that are "
                "not the step's own Variables: inside a JAX or NNX transformation (nnx.cond, "
                "nnx.fori_loop, nnx.jit, ...) or on a module reached through a closure. With "
                "shard_optimizer_state=True call optimizer.update directly in the step "
                "function, on a module passed in args (compute or accumulate the gradients "
                "inside the transformation, update after it)."
            )
        param_pure, param_def = jax.tree.flatten(nnx.as_pure(params))
        grad_leaves, grad_def = jax.tree.flatten(nnx.as_pure(nnx.state(grads, optimizer.wrt)))
        # jaxlib ships PyTreeDef (jaxlib/_jax.so) without type stubs: mypy cannot type its methods.
        if grad_def != param_def:  # type: ignore[operator]
            raise errors.InvalidArgumentError(
                f"strategy.run: {self._fn_name}: optimizer.update got gradients whose structure "
                f"({grad_def}) is not the parameters' ({param_def}). Pass the gradients of the "
                "same module, e.g. grads from mirrax.value_and_grad(loss_fn)(model)."
            )
        outputs, specs = [], []
        for g in grad_leaves:
            scattered = self._gradients.get(id(g))
            if scattered is not None and scattered[2] is g:
                outputs.append(scattered[0])
                specs.append(scattered[1])
                continue
            if REPLICA_AXIS in _compat.varying_axes(g):
                raise errors.VaryingVariableError(
                    f"strategy.run: {self._fn_name} passes optimizer.update gradients that "
                    "differ across replicas (not summed over them), so the replicas would "
                    "update the parameters differently. Take them with mirrax.value_and_grad "
                    "or nnx.value_and_grad of the replicated model, which sum over replicas."
                )
            outputs.append(g)
            specs.append(P())
        kwargs_leaves, kwargs_def = jax.tree.flatten(nnx.as_pure(kwargs))
        varying = [
            k
            for k, v in kwargs.items()
            if any(REPLICA_AXIS in _compat.varying_axes(x) for x in jax.tree.leaves(nnx.as_pure(v)))
        ]
        if varying:
            raise errors.VaryingVariableError(
                f"strategy.run: {self._fn_name} passes optimizer.update keyword arguments that "
                f"differ across replicas ({', '.join(varying)}), so the replicas' updates would "
                "differ. Reduce them first, e.g. value=mirrax.get_replica_context()."
                "all_reduce('sum', loss)."
            )
        self.updates.append(
            Update(
                optimizer.tx,
                param_def,
                tuple(self._index[id(v)] for v in param_variables),
                jax.tree.structure(nnx.as_pure(optimizer.opt_state)),
                self._opt_indices(optimizer),
                tuple(specs),
                kwargs_def,
                len(kwargs_leaves),
            )
        )
        self._arrays.extend(outputs)
        self._arrays.extend(kwargs_leaves)
        self._done.add(id(optimizer))
        for variable in param_variables + jax.tree.leaves(optimizer.opt_state, is_leaf=_is_variable):
            self._recorded_values.append((variable, _compat.raw_value(variable)))
        optimizer.step[...] += 1
        return None

    def check_unchanged(self) -> None:
        """Refuses a step that changed a parameter or the optimizer's state after
        `optimizer.update`: the deferred update would overwrite (or ignore) the change."""
        changed = [v for v, value in self._recorded_values if _compat.raw_value(v) is not value]
        if changed:
            raise errors.UnsupportedArgumentError(
                f"strategy.run: {self._fn_name} changes parameters or optimizer state after "
                "optimizer.update (e.g. a constraint, a clip, or keeping the old values when "
                "gradients are not finite); with shard_optimizer_state=True the update is "
                "applied when the step returns, after such changes, which it would overwrite. "
                "Make the change before optimizer.update, express it in the optax "
                "transformation (optax.apply_if_finite, optax.projections), or use "
                "shard_optimizer_state=False."
            )

    def _opt_indices(self, optimizer) -> tuple:
        # A Variable holding an empty pytree (optax.MaskedNode, a parameter outside one of
        # multi_transform's groups) has no array, so no position; the optimizer state's
        # structure (`Update.opt_def`) keeps it.
        variables = jax.tree.leaves(optimizer.opt_state, is_leaf=_is_variable)
        return tuple(self._index[id(v)] for v in variables if jax.tree.leaves(_compat.raw_value(v)))


def check_shardable(optimizer, what: str) -> None:
    """Refuses an `nnx.Optimizer` whose state a sharded optimizer state cannot follow: a
    Variable holding several arrays (nested lists or tuples, as `optax.sm3`'s).

    Raises:
      UnsupportedArgumentError: naming the transformation and its state, with the fix.
    """
    unsplit = {
        id(x)
        for v in jax.tree.leaves(optimizer.opt_state, is_leaf=_is_variable)
        for x in _several(jax.tree.leaves(_compat.raw_value(v)))
    }
    if unsplit:
        owner = _state_owner(nnx.as_pure(optimizer.opt_state), unsplit)
        raise errors.UnsupportedArgumentError(
            f"{what}: the state of {type(optimizer).__name__}'s transformation "
            f"({_transformation_name(optimizer.tx)}{', in its ' + owner if owner else ''}) "
            "holds nested lists or tuples of arrays in one variable, which a sharded "
            "optimizer state cannot follow. Use shard_optimizer_state=False for this "
            "optimizer."
        )


def _several(leaves: list) -> list:
    return leaves if len(leaves) > 1 else []


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def _state_owner(tree, targets: set) -> str | None:
    """The type name of the innermost optax state (a NamedTuple) holding one of `targets`."""
    if isinstance(tree, (tuple, list, Mapping)):
        children = tree.values() if isinstance(tree, Mapping) else tree
        for child in children:
            found = _state_owner(child, targets)
            if found:
                return found
        if hasattr(tree, "_fields") and any(id(x) in targets for x in jax.tree.leaves(tree)):
            return type(tree).__name__
    return None


def _transformation_name(tx) -> str:
    """The optax function that built `tx`, from its update function's name (e.g. "sm3")."""
    qualname = getattr(getattr(tx, "update", None), "__qualname__", "") or ""
    return qualname.split(".<locals>")[0] or type(tx).__name__


# -- after the per-replica program, in global view ---------------------------------------------


def apply_updates(mesh, updates: list, specs: tuple, state: list, arrays: list) -> list:
    """`state` (the step's new state leaves, global arrays) after each deferred update.

    `arrays` are the recorded gradients and keyword arrays, as `Recorder.arrays()` ordered
    them. Sharded state keeps its sharding; parameters come out replicated.
    """
    state = list(state)
    position = 0
    for update in updates:
        count = len(update.grad_specs)
        grads = jax.tree.unflatten(update.param_def, arrays[position : position + count])
        position += count
        kwargs = jax.tree.unflatten(update.kwargs_def, arrays[position : position + update.kwargs_count])
        position += update.kwargs_count
        params = jax.tree.unflatten(update.param_def, [state[i] for i in update.param_indices])
        opt_state = jax.tree.unflatten(update.opt_def, [state[i] for i in update.opt_indices])
        step_updates, new_opt_state = update.tx.update(grads, opt_state, params, **kwargs)
        new_params = optax.apply_updates(params, step_updates)
        replicated = NamedSharding(mesh, P())
        for i, value in zip(update.param_indices, jax.tree.leaves(new_params)):
            state[i] = jax.lax.with_sharding_constraint(value, replicated)
        new_leaves = jax.tree.leaves(new_opt_state)
        if len(new_leaves) != len(update.opt_indices):
            raise errors.UnsupportedArgumentError(
                "strategy.run: the optimizer's transformation changed the structure of its "
                f"state ({len(update.opt_indices)} arrays in, {len(new_leaves)} out), which a "
                "sharded optimizer state cannot follow. Use shard_optimizer_state=False."
            )
        for i, value in zip(update.opt_indices, new_leaves):
            spec = specs[i]
            state[i] = jax.lax.with_sharding_constraint(
                value, NamedSharding(mesh, spec if spec is not None else P())
            )
    return state


def scatter_gradients(grads: list, replicas: int, register: dict, wire_dtype=None, sum_whole=None) -> list:
    """Local (varying) gradients summed over the replicas: each array with a dimension the
    replica count divides is reduce-scattered along it and all-gathered for the caller (an
    all-gather XLA drops when only the optimizer reads the gradients: it reads the slice,
    found through `register`); the others are all-reduced. With `wire_dtype` the sums run
    in that dtype (as `mirrax.value_and_grad`'s `all_reduce_dtype`). With `sum_whole` (the
    packed all-reduce of a list of arrays), one reduce-scatter per dtype carries every split
    array (each replica's block of each, side by side) and `sum_whole` the rest: fewer
    collectives where each costs a round trip (Gloo across processes)."""

    def wire(x):
        return x if wire_dtype is None else x.astype(wire_dtype)

    dimensions = [shard_dimension(g.shape, replicas) for g in grads]
    pieces = [None] * len(grads)
    whole = [i for i, d in enumerate(dimensions) if d is None]
    split = [i for i, d in enumerate(dimensions) if d is not None]
    if sum_whole is not None:
        for i, total in zip(whole, sum_whole([grads[i] for i in whole])):
            pieces[i] = total
        for group in _by_dtype(grads, split):
            # Row r of each (R, size / R) matrix is replica r's block of that array.
            rows = [jnp.moveaxis(wire(grads[i]), dimensions[i], 0).reshape(replicas, -1) for i in group]
            flat = jax.lax.psum_scatter(
                jnp.concatenate(rows, axis=1).reshape(-1), REPLICA_AXIS, scatter_dimension=0, tiled=True
            )
            offset = 0
            for i, row in zip(group, rows):
                moved = jnp.moveaxis(grads[i], dimensions[i], 0).shape
                block = flat[offset : offset + row.shape[1]].reshape((moved[0] // replicas,) + moved[1:])
                pieces[i] = jnp.moveaxis(block, 0, dimensions[i]).astype(grads[i].dtype)
                offset += row.shape[1]
    else:
        for i in whole:
            pieces[i] = jax.lax.psum(wire(grads[i]), REPLICA_AXIS).astype(grads[i].dtype)
        for i in split:
            pieces[i] = jax.lax.psum_scatter(
                wire(grads[i]), REPLICA_AXIS, scatter_dimension=dimensions[i], tiled=True
            ).astype(grads[i].dtype)
    out: list = []
    for g, piece, dimension in zip(grads, pieces, dimensions):
        if dimension is None:
            out.append(piece)
            continue
        gathered = _compat.all_gather_invariant(piece, REPLICA_AXIS, axis=dimension)
        register[id(gathered)] = (piece, spec_for(g.shape, replicas), gathered)
        out.append(gathered)
    return out


def _by_dtype(arrays: list, indices: list) -> list:
    """`indices` grouped by their arrays' dtype, in order."""
    groups: dict = {}
    for i in indices:
        groups.setdefault(jnp.dtype(arrays[i].dtype), []).append(i)
    return list(groups.values())
