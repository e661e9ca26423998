"""`strategy.experimental_distribute_values_from_function`: one value per local replica from a
function of the replica's `ValueContext`, stacked (padded and masked when first axes differ, or
kept per replica when trailing shapes differ) and placed on the replicas.
"""

from __future__ import annotations

import jax

from mirrax import errors
from mirrax._src.distribute import multihost
from mirrax._src.distribute.batching import (
    by_replica,
    mask_from_lengths,
    put_stacked,
    stack_host_values,
)
from mirrax._src.distribute.input_options import ValueContext
from mirrax._src.distribute.values import PerReplica


def values_from_function(strategy, value_fn) -> PerReplica:
    """`strategy.experimental_distribute_values_from_function(value_fn)` (validated there).

    Values whose first axes differ are padded and masked; values with different trailing
    shapes are kept per replica ("ragged"), which one process can hold but several cannot.
    """
    replica_devices = strategy.extended.replica_devices
    values = [
        value_fn(ValueContext(r, strategy.num_replicas_in_sync)) for r in replica_devices.local_replica_ids
    ]
    stacked, lengths = stack_host_values(values)
    if replica_devices.spans_processes:
        lengths = _agree_value_lengths(strategy, values, stacked, lengths)
        if lengths is not None:
            stacked, _ = stack_host_values(values, rows=max(lengths))
    if stacked is None:
        placed = tuple(jax.device_put(v, d) for v, d in zip(values, replica_devices.local_devices))
        return PerReplica(strategy, None, ragged=placed)
    if lengths is None:
        return PerReplica(strategy, put_stacked(strategy, stacked))
    local_lengths = [lengths[r] for r in replica_devices.local_replica_ids]
    mask = put_stacked(strategy, mask_from_lengths(local_lengths, max(lengths)))
    return PerReplica(strategy, put_stacked(strategy, stacked), mask=mask, lengths=lengths)


def _agree_value_lengths(strategy, values, stacked, lengths):
    """Every replica's first-axis length (all processes), or None when no padding is needed.

    Raises:
      ValueError: some process's values cannot be stacked (trailing shapes differ), which
        a multi-process PerReplica cannot hold.
    """
    mine = (
        None
        if stacked is None
        else [int(jax.tree.leaves(v)[0].shape[0]) if jax.tree.leaves(v)[0].ndim else -1 for v in values]
    )
    votes = multihost.exchange(strategy.extended.pipeline_names.values(), mine)
    if any(v is None for v in votes):
        raise errors.InvalidArgumentError(
            "experimental_distribute_values_from_function: the replicas' values have "
            "different trailing shapes on some process, which a multi-process PerReplica "
            "cannot hold. Return values of one shape (first axis may differ)."
        )
    every = by_replica(strategy, votes)
    if len(set(every)) == 1 and lengths is None:
        return None
    return tuple(every)
