"""Host-side agreement between the processes of a multi-worker run, on jax.distributed's store.

Collectives inside the compiled step move arrays; what the HOSTS must agree on before a step
(does every worker still have data? how many rows does the static batch shape need? how long is
each replica's shard?) is exchanged through the key-value store of JAX's coordination service
(`jax.distributed`), not through a transport of our own. Every exchange is named; a process
that reaches a different exchange than its peers (a divergent program) gets an error naming
both instead of a silent mismatch.

All functions are no-ops in a single-process run.
"""

from __future__ import annotations

import json

import jax

from mirrax import errors
from mirrax._src.distribute import _compat

# Long enough for a slow peer (a first compilation, a long evaluation or checkpoint); a DEAD
# peer is detected sooner by the coordination service's heartbeat, which ends every process.
# A live peer that never arrives (a divergent program) is an error after this long, unless
# CommunicationOptions(timeout_seconds=...) says otherwise.
DEFAULT_EXCHANGE_TIMEOUT_SECONDS = 3600


def coordination_client():
    """jax.distributed's coordination client (its key-value store carries the exchanges).

    Raises:
      StartedBackendError: several JAX processes but no client (jax.distributed not initialized
        by mirrax).
    """
    client = _compat.distributed_state().client
    if client is None:
        raise errors.StartedBackendError(
            f"This process is one of {jax.process_count()} JAX processes but jax.distributed's "
            "coordination client is not available; create the strategy with "
            "mirrax.MultiWorkerMirroredStrategy() (it initializes jax.distributed) before any "
            "other JAX call."
        )
    return client


def exchange(name: str, value, timeout_seconds: float | None = None) -> list:
    """Every process's `value` for the exchange `name`, in process order.

    Args:
      name: a key unique to this exchange within the run, the same string on every process
        (e.g. "input/3/0/17": dataset 3, pass 0, step 17).
      value: this process's value, anything `json.dumps` accepts.
      timeout_seconds: how long to wait for the slowest peer (default 1 hour).

    Returns:
      A list with one value per process (`jax.process_count()` entries), index = process id.

    Raises:
      UnresponsivePeerError: a peer did not publish within the timeout (the message names it).
    """
    count = jax.process_count()
    if count == 1:
        return [value]
    client = coordination_client()
    me = jax.process_index()
    timeout_ms = int(1000 * (timeout_seconds or DEFAULT_EXCHANGE_TIMEOUT_SECONDS))
    client.key_value_set(f"mirrax/{name}/{me}", json.dumps(value))
    values = []
    for process in range(count):
        if process == me:
            values.append(value)
            continue
        try:
            raw = client.blocking_key_value_get(f"mirrax/{name}/{process}", timeout_ms)
        except Exception as e:  # the runtime's error type differs across jax versions
            raise errors.UnresponsivePeerError(
                f"Process {me} got no answer from process {process} at the host exchange "
                f"{name!r} (waited up to {timeout_ms / 1000:g} s, or the connection to the "
                f"coordinator failed: {e}). That process is stuck, crashed, or runs a different "
                "program: every process must create the same distributed datasets, in the same "
                "order, and iterate them the same number of times. "
                "CommunicationOptions(timeout_seconds=...) bounds this wait."
            ) from e
        values.append(json.loads(raw))
    return values


def publish(name: str, value) -> None:
    """Publishes this process's `value` for the exchange `name` without waiting for the peers
    (a process that leaves the program afterwards, so that the peers' exchange gets its word)."""
    if jax.process_count() > 1:
        coordination_client().key_value_set(f"mirrax/{name}/{jax.process_index()}", json.dumps(value))


def forget(name: str) -> None:
    """Deletes this process's entry of the exchange `name` (once every peer has read it)."""
    if jax.process_count() > 1:
        try:
            coordination_client().key_value_delete(f"mirrax/{name}/{jax.process_index()}")
        except Exception:  # best effort: a leftover key costs a few bytes on the coordinator
            pass


def check_same(name: str, what: str, values: list) -> None:
    """Raises when the processes disagree about `what` (a divergent program).

    Raises:
      DivergentWorkersError: the values differ; the message lists each process's value.
    """
    if any(v != values[0] for v in values[1:]):
        listing = "; ".join(f"process {i}: {v!r}" for i, v in enumerate(values))
        raise errors.DivergentWorkersError(
            f"The processes disagree about {what} at {name!r} ({listing}). Every process of a "
            "multi-worker run must execute the same program: the same distributed datasets, "
            "created in the same order, and the same steps."
        )
