"""The processes' agreement on each step's input (multi-worker, docs/design.md "Input"): before a
step every worker publishes its local shards' lengths (or that its data has ended), so no worker
waits in a collective its peers never join; DATA-sharded workers also compare a digest of the
global batch they read. A process with no replica of the strategy is refused on every process.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator

import jax
import numpy as np

from mirrax import errors
from mirrax._src.distribute import multihost
from mirrax._src.distribute.batching import Placer, by_replica


def batch_fingerprint(host_batch, n: int) -> str:
    """A short digest of a global batch's bytes: DATA-sharded workers must all read the same.

    CRC-32 of every leaf's bytes (about 5 GB/s: 0.6 ms for a 3 MB batch of 256 CIFAR-10 images
    in float32), computed in the prefetch thread; equal data give equal digests on any host.
    """
    crc = 0
    for leaf in jax.tree.leaves(host_batch):
        crc = zlib.crc32(np.ascontiguousarray(leaf).reshape(-1).view(np.uint8), crc)
    return f"{n} examples, CRC-32 {crc:08x}"


def _signature(shards: list) -> str:
    """The batch's structure, trailing shapes and dtypes: what every worker must agree on
    (`shards`: one per local replica; place_agreed refuses a worker with none first)."""
    leaves, treedef = jax.tree.flatten(shards[0])
    return f"{treedef} " + ", ".join(f"{a.dtype}{list(a.shape[1:])}" for a in leaves)


def place_agreed(strategy, placer: Placer, local_batches: Iterator, uid: str, iteration: int) -> Iterator:
    """Places each local batch; with several processes, first agrees with the peers on it.

    Multi-worker (docs/design.md, "Input"): before each step every process publishes the true
    lengths of its local shards, or that its data has ended. The step happens while ANY process
    still has data; a process whose data has ended feeds fully masked filler rows (copies of its
    last real example), so no worker blocks in a collective its peers never join, and every
    example is counted exactly once. All processes then know every replica's length (for
    `gather`) and the same static row count. A strategy on this process's devices only (the
    default strategy in a multi-worker run) runs on this worker alone: no agreement.

    Raises:
      InvalidBatchError: a process holds none of the strategy's replicas, raised on that
        process at once and on every peer at the first exchange (never a hang).
    """
    replica_devices = strategy.extended.replica_devices
    if not replica_devices.spans_processes:
        for shards, name, _, lengths in local_batches:
            yield placer.place(shards, name, lengths=lengths)
        return
    local = len(replica_devices.local_replica_ids)
    options = getattr(strategy, "communication_options", None)
    timeout = getattr(options, "timeout_seconds", None)
    if local == 0:
        # Published without waiting (the peers' exchange reads it), then refused here.
        multihost.publish(f"input/{iteration}/0", {"dataset": uid, "replicas": 0})
        raise _no_replicas(strategy, [jax.process_index()])
    last = None  # one row of this process's last batch (a real example when it had one)
    ended = False
    step = 0
    while True:
        item = None if ended else next(local_batches, None)
        ended = item is None
        lengths = None if ended else item[3] or [int(jax.tree.leaves(s)[0].shape[0]) for s in item[0]]
        name = f"input/{iteration}/{step}"
        votes = multihost.exchange(
            name,
            {
                "dataset": uid,
                "lengths": lengths,
                "had_data": last is not None or not ended,
                "batch": None if ended else _signature(item[0]),
                "global": None if ended else item[2],
            },
            timeout,
        )
        if step >= 3:
            multihost.forget(f"input/{iteration}/{step - 3}")
        multihost.check_same(name, "which distributed dataset is read", [v["dataset"] for v in votes])
        without = [p for p, v in enumerate(votes) if v.get("replicas") == 0]
        if without:
            raise _no_replicas(strategy, without)
        multihost.check_same(
            name,
            "the structure, trailing shapes and dtypes of the batches",
            [v["batch"] for v in votes if v["batch"] is not None],
        )
        if any(v["global"] is not None for v in votes):
            # DATA sharding: every worker reads the same global batches (their size and a
            # digest of their bytes); a difference means the workers read different data, and
            # each would train on its own part of a batch that exists nowhere: a silent mix.
            multihost.check_same(
                name,
                "the global batch every worker reads (AutoShardPolicy.DATA: every worker "
                "must read the same batches, in the same order: the same files and the same "
                "shuffle seed; for each worker to read its own data, use "
                "distribute_datasets_from_function)",
                [v["global"] for v in votes],
            )
        if all(v["lengths"] is None for v in votes):
            return
        empty = [p for p, v in enumerate(votes) if not v["had_data"]]
        if empty:
            raise errors.InvalidBatchError(
                f"The input pipelines of process(es) {empty} yielded no batch at all while the "
                "others have data; a worker needs at least one batch (its examples set the "
                "shapes it feeds once its data has ended). Give every worker data, e.g. shard "
                "with fewer, larger pieces."
            )
        all_lengths = by_replica(strategy, [v["lengths"] or [0] * local for v in votes])
        if ended:
            yield placer.place([last] * local, "filler", lengths=(0,) * local, all_lengths=all_lengths)
        else:
            shards, first_name, _, given = item
            real = next((s for s in shards if jax.tree.leaves(s)[0].shape[0]), None)
            if real is not None:
                last = jax.tree.map(lambda a: a[:1], real)
            elif last is None:
                last = jax.tree.map(lambda a: np.zeros((1,) + a.shape[1:], a.dtype), shards[0])
            yield placer.place(shards, first_name, lengths=given, all_lengths=all_lengths)
        step += 1


def _no_replicas(strategy, processes: list) -> errors.InvalidBatchError:
    """The error for input fed to a strategy that has no replica on some processes."""
    devices = strategy.extended.replica_devices
    return errors.InvalidBatchError(
        f"{type(strategy).__name__}'s replicas are on the devices of process(es) "
        f"{list(devices.process_indices)} only, so process(es) {processes} have no replica to "
        "feed a batch to. Every process of a multi-worker run must hold at least one of the "
        "strategy's replicas: create mirrax.MultiWorkerMirroredStrategy() (every process's "
        "devices), or a strategy on each process's own devices (jax.local_devices())."
    )
