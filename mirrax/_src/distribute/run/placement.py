"""Putting `strategy.run`'s replicated inputs on the replicas, and refusing another strategy's.

An array already replicated on this strategy's mesh enters as it is; one placed elsewhere by a
single-device computation is copied over; one placed by ANOTHER multi-replica strategy is
refused with a message naming the argument (or the NNX object and variable path) that holds it,
since silently moving a model between strategies would hide a bug.

Several processes: an array still local to its process (each worker's own copy: initialized,
restored or assigned on the host) becomes worker 0's value on every worker, all of a call's
such arrays in one broadcast (broadcast.py), as TF broadcasts a mirrored variable's initial
value from worker 0. A host assignment that differed from worker 0's after the object's first
step is warned about on the worker whose value was replaced.
"""

from __future__ import annotations

import warnings

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from mirrax import errors
from mirrax._src.distribute import broadcast
from mirrax._src.distribute import devices as devices_lib
from mirrax._src.distribute.run.arguments import inside_transformation, is_variable


def place(strategy, x, names, index, nodes=None, fresh=False, spec=None):
    """`x` replicated on `strategy`'s mesh (a copy unless it already is); non-arrays unchanged.

    `names[index]` (or, with `nodes`, the NNX objects) names the argument in the error. With
    `fresh`, a copy never shares `x`'s buffers (device_put may reuse the buffer already on its
    device for that device's shard): the copy is then safe to donate while `x` is held. With
    `spec` (a PartitionSpec: sharded optimizer state), `x` is split over the replicas instead.

    Raises:
      MixedStrategyError: `x` lives on another multi-replica strategy's devices.
      ReplicaContextError: `x` is traced.
    """
    if not isinstance(x, jax.Array):
        return x
    if isinstance(x, jax.core.Tracer):
        raise inside_transformation("the state of the NNX objects")
    replica_devices = strategy.extended.replica_devices
    target = replica_devices.replicated if spec is None else NamedSharding(strategy.mesh, spec)
    if x.sharding == target:
        return x
    if elsewhere(strategy, x):
        raise _mixed_placement(strategy, x, names, index, nodes)
    if spec is not None:
        return _split(x, target, fresh)
    if x.is_fully_addressable and (fresh or jax.process_count() > 1):
        # One copy per local device, assembled: with several processes, this process's copy
        # of a replicated value (every process holds the same one, e.g. just initialized or
        # restored; JAX would otherwise attempt a cross-host transfer); with `fresh`, copies
        # that share no buffer with `x` (a replicated device_put reuses x's own buffer for
        # the shard on x's device, even with may_alias=False).
        copies = [
            jax.device_put(x, d, may_alias=False if fresh else None) for d in replica_devices.local_devices
        ]
        if not isinstance(copies[0], jax.core.Tracer):  # inside an outer jit: refused later
            return jax.make_array_from_single_device_arrays(x.shape, target, copies)
    return jax.device_put(x, target)


def place_state(strategy, xs: list, names, nodes, specs, later=None) -> list:
    """The NNX objects' state arrays `xs` placed as `place(..., fresh=True, spec=s)` places
    each, except that with several processes every process-local array among them becomes
    worker 0's value, all of them in ONE broadcast.

    `later` (optional, per array): the array replaced one that a step of this program had
    written (the user assigned it between steps); such an array is broadcast too, even when
    it is already a global replicated array (each process may hold its own value under it),
    and one that differed from worker 0's is warned about on this worker, naming the variable.

    Raises:
      MixedStrategyError, ReplicaContextError: as `place`.
      UnresponsivePeerError, DivergentWorkersError: as `broadcast.from_worker_zero`.
    """
    if not strategy.extended.replica_devices.spans_processes:
        # One process, or a strategy on this worker's devices only (its state is its own).
        return [place(strategy, x, names, None, nodes, fresh=True, spec=s) for x, s in zip(xs, specs)]
    placed, pending, targets = [], [], []
    sources = []
    for i, (x, spec) in enumerate(zip(xs, specs)):
        target = _target(strategy, spec)
        if _process_local(strategy, x, target):
            sources.append(x)
        elif (
            later is not None
            and later[i]
            and spec is None
            and isinstance(x, jax.Array)
            and not isinstance(x, jax.core.Tracer)
            and x.is_fully_replicated
            and not x.is_fully_addressable
        ):
            # Assigned between steps as a global array (e.g. `variable[...] = value`, which
            # computes on the global array): each process may hold its own value under one
            # replicated sharding; worker 0's is taken, as for a local one.
            sources.append(x.addressable_data(0))
        else:
            placed.append(place(strategy, x, names, None, nodes, fresh=True, spec=spec))
            continue
        pending.append(i)
        targets.append(target)
        placed.append(None)
    if pending:
        check = None if later is None else [later[i] for i in pending]
        results, differing = broadcast.from_worker_zero(strategy, sources, targets, check)
        for i, result in zip(pending, results):
            placed[i] = result
        if differing:
            _warn_replaced(nodes, [xs[pending[k]] for k in differing])
    return placed


def _target(strategy, spec):
    if spec is None:
        return strategy.extended.replica_devices.replicated
    return NamedSharding(strategy.mesh, spec)


def _process_local(strategy, x, target) -> bool:
    """Whether `x` is this process's own copy of a value that must be made global (a NumPy
    array, or a jax.Array on this process's devices that no other strategy placed)."""
    if isinstance(x, np.ndarray):
        return True
    return (
        isinstance(x, jax.Array)
        and not isinstance(x, jax.core.Tracer)
        and x.sharding != target
        and x.is_fully_addressable
        and not elsewhere(strategy, x)
    )


def _warn_replaced(nodes, arrays) -> None:
    """Warns that this worker's host-assigned values were replaced by worker 0's."""
    wanted = {id(a) for a in arrays}
    paths = []
    for node in nodes or ():
        for path, variable in nnx.to_flat_state(nnx.state(node)):
            value = variable.get_raw_value() if is_variable(variable) else variable
            if any(id(leaf) in wanted for leaf in jax.tree.leaves(value)):
                paths.append(f"{type(node).__name__}.{'.'.join(map(str, path))}")
    warnings.warn(
        f"strategy.run: on worker {jax.process_index()}, the value assigned to "
        f"{', '.join(paths) or f'{len(arrays)} state array(s)'} differs from worker 0's, and "
        "worker 0's was taken: mirrored state is the same on every worker (a checkpoint of it "
        "is one model). Assign the same value on every worker (e.g. computed from the same "
        "seed, or read from the same file); every worker must assign it, since the workers "
        "meet at the broadcast.",
        stacklevel=5,
    )


def _split(x, target, fresh: bool):
    """`x` (whole on every process) sharded as `target`: each local device gets its slice."""
    if jax.process_count() == 1:
        return jax.device_put(x, target, may_alias=False if fresh else None)
    local = x.addressable_shards[0].data  # every process holds the whole value
    pieces = [
        jax.device_put(local[index], device)
        for device, index in target.addressable_devices_indices_map(x.shape).items()
    ]
    return jax.make_array_from_single_device_arrays(x.shape, target, pieces)


def elsewhere(strategy, x) -> bool:
    """True for an array placed by a multi-replica strategy on other devices than `strategy`'s."""
    sharding = getattr(x, "sharding", None)
    return (
        isinstance(x, jax.Array)
        and isinstance(sharding, NamedSharding)
        and sharding.mesh.size > 1
        and strategy.num_replicas_in_sync > 1
        and tuple(sharding.mesh.devices.flat) != tuple(strategy.mesh.devices.flat)
    )


def _mixed_placement(strategy, x, names, index, nodes) -> Exception:
    """The MixedStrategyError for `x`, placed by another multi-replica strategy.

    Names what the user passed: the argument position and, for NNX state, the object's type
    and the variable's path inside it (e.g. "args[0] (a Net): variable l.kernel (Param)").
    """
    theirs = devices_lib.listing(x.sharding.mesh.devices.flat)
    mine = devices_lib.listing(strategy.mesh.devices.flat)
    if nodes is None:
        what = f"argument {names[index]} (a {type(x).__name__} of shape {tuple(x.shape)})"
        fix = f"jax.device_get({names[index]}) (a NumPy copy) in its place"
    else:
        offenders = []
        for node in nodes:
            for path, variable in nnx.to_flat_state(nnx.state(node)):
                value = variable.get_raw_value() if is_variable(variable) else variable
                if any(leaf is x or elsewhere(strategy, leaf) for leaf in jax.tree.leaves(value)):
                    offenders.append(
                        f"{names.of_node(node)} (a {type(node).__name__}): variable "
                        f"{'.'.join(map(str, path)) or '(itself)'} ({type(variable).__name__})"
                    )
                    break
        what = "; ".join(offenders) or "the state of the NNX objects"
        fix = (
            "its state back to the host first: nnx.update(obj, jax.device_get(nnx.state("
            "obj))) for each object named (for a mirrax.Model, on the module, before "
            "mirrax.Model(module) and compile)"
        )
    return errors.MixedStrategyError(
        f"strategy.run: {what} lives on another strategy's devices ({theirs}), but this "
        f"{type(strategy).__name__} runs on {mine}: the object was placed there when another "
        "multi-replica strategy used it (its strategy.run, or a Model's fit / evaluate / "
        f"predict). One object is used by one multi-replica strategy at a time. To use it "
        f"here, bring {fix}; or create (or restore) it anew for this strategy."
    )
