"""Mirrored state made equal on every worker: process-local arrays broadcast from worker 0.

TF broadcasts each mirrored variable's initial value from worker 0 when a multi-worker strategy
creates it (CollectiveAllReduceExtended's variable creator: worker 0's first device sends, every
other device receives), so an unseeded initializer gives one model, not one per worker. mirrax's
objects exist before any strategy sees them, so the same happens at the strategy's FIRST use of
an array that is still local to its process (just initialized, restored, or assigned on the
host): every such array of one call is packed into ONE buffer of 32-bit words (arrays over
1 MiB are bitcast, not copied, each its own buffer) and the buffers are summed across the
processes in one all-reduce in which only worker 0 contributes (the others give zeros), so the
result is worker 0's bits exactly (integer adds of zeros: -0.0 and NaN payloads survive).
Arrays a step wrote back are already global and never come here.

Bounded in time: before the collective the processes meet at a named host exchange (multihost,
with the strategy's `CommunicationOptions(timeout_seconds=...)`) that also compares the arrays'
shapes and dtypes, so a peer that never arrives is an `UnresponsivePeerError` and a program that
differs a `DivergentWorkersError`, never a hang or a wrong sum. A DEAD peer ends every process
through the coordination service's heartbeat, as at any collective.
"""

from __future__ import annotations

import itertools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mirrax._src.distribute import multihost, prng_keys

_COUNTER = itertools.count()
_PROGRAMS: dict = {}  # (layout, mesh, shardings) -> jitted program; a few per model
_PROGRAMS_KEPT = 64
_PROCESSES, _LOCAL = "processes", "local"
_ALONE_WORDS = 1 << 18  # an array over 1 MiB is broadcast as its own buffer


class _Leaf:
    """What packing needs of one array: its shape, dtype (a PRNG key's implementation) and
    its number of 32-bit words."""

    __slots__ = ("shape", "dtype", "impl", "words")

    def __init__(self, x):
        self.shape = tuple(x.shape)
        self.impl = prng_keys.impl_name(x)
        dtype = jax.dtypes.canonicalize_dtype(x.dtype) if self.impl is None else x.dtype
        self.dtype = dtype
        if self.impl is None:
            data = jax.ShapeDtypeStruct(self.shape, dtype)
        else:
            data = jax.eval_shape(lambda key: prng_keys.to_data(key)[0], x)
        nbytes = int(np.prod(data.shape, dtype=np.int64)) * np.dtype(data.dtype).itemsize
        self.words = -(-nbytes // 4)

    def key(self):
        return (self.shape, str(self.dtype), str(self.impl))


def _to_words(x, leaf: _Leaf):
    """`x` as a flat uint32 vector of `leaf.words` words (its bytes, zero-padded)."""
    if leaf.impl is not None:
        x = prng_keys.to_data(x)[0]
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    if x.dtype.itemsize == 4:
        return jax.lax.bitcast_convert_type(x, jnp.uint32).reshape(-1)
    data = jax.lax.bitcast_convert_type(x, jnp.uint8).reshape(-1)
    data = jnp.pad(data, (0, 4 * leaf.words - data.shape[0]))
    return jax.lax.bitcast_convert_type(data.reshape(-1, 4), jnp.uint32)


def _from_words(words, leaf: _Leaf):
    """The inverse of `_to_words`."""
    if leaf.impl is not None:
        data = jax.lax.bitcast_convert_type(words, jnp.uint32)
        return prng_keys.from_data(data.reshape(leaf.shape + (-1,)), [leaf.impl])
    dtype = jnp.dtype(leaf.dtype)
    if dtype.itemsize == 4 and dtype != jnp.bool_:
        return jax.lax.bitcast_convert_type(words, dtype).reshape(leaf.shape)
    data = jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(-1)
    size = int(np.prod(leaf.shape, dtype=np.int64))
    if dtype == jnp.bool_:
        return (data[:size] != 0).reshape(leaf.shape)
    data = data[: size * dtype.itemsize]
    if dtype.itemsize == 1:
        return jax.lax.bitcast_convert_type(data, dtype).reshape(leaf.shape)
    return jax.lax.bitcast_convert_type(data.reshape(-1, dtype.itemsize), dtype).reshape(leaf.shape)


@jax.jit(static_argnums=1)
def _pack(xs, leaves):
    return jnp.concatenate([_to_words(x, leaf) for x, leaf in zip(xs, leaves)])


@jax.jit(static_argnums=(2, 3))
def _compare(xs, words, leaves, wanted):
    """Per flagged array (indices `wanted`), whether the bits of `xs` differ from `words`."""
    mine = _pack(xs, leaves)
    ends = list(itertools.accumulate(leaf.words for leaf in leaves))
    return jnp.stack(
        [
            jnp.any(mine[ends[i] - leaves[i].words : ends[i]] != words[ends[i] - leaves[i].words : ends[i]])
            for i in wanted
        ]
    )


def _process_mesh(replica_devices):
    """The replicas' devices as a (processes, local devices) mesh: the sum runs across the
    processes only (one all-reduce per local device index, none inside a process)."""
    rows: dict = {}
    for device in replica_devices.devices:
        rows.setdefault(device.process_index, []).append(device)
    grid = [rows[p] for p in sorted(rows)]
    if len({len(row) for row in grid}) != 1:  # uneven processes: one flat axis
        return Mesh(np.array(replica_devices.devices, dtype=object).reshape(-1, 1), (_PROCESSES, _LOCAL))
    return Mesh(np.array(grid, dtype=object), (_PROCESSES, _LOCAL))


def _segments(leaves) -> tuple:
    """The buffers of one broadcast: every small array packed into one, each big one alone
    (bitcast in place: packing and unpacking it would copy it twice, while its own
    all-reduce costs its bytes either way)."""
    small = tuple(i for i, leaf in enumerate(leaves) if leaf.words <= _ALONE_WORDS)
    big = tuple((i,) for i, leaf in enumerate(leaves) if leaf.words > _ALONE_WORDS)
    return ((small,) if small else ()) + big


def _program(leaves, segments, mesh, shardings):
    """The jitted broadcast: per segment (processes, words) rows, zeros except worker 0's,
    summed over the processes in one all-reduce, unpacked into arrays placed as `shardings`;
    also each segment's words."""
    key = (tuple(leaf.key() for leaf in leaves), mesh, tuple(shardings))
    program = _PROGRAMS.get(key)
    if program is not None:
        return program

    def sum_rows(rows):
        return jax.lax.psum([r[0] for r in rows], _PROCESSES)

    def broadcast(rows):
        summed = jax.shard_map(sum_rows, mesh=mesh, in_specs=P(_PROCESSES), out_specs=P())(rows)
        out = [None] * len(leaves)
        words = [jax.lax.bitcast_convert_type(w, jnp.uint32) for w in summed]
        for segment, segment_words in zip(segments, words):
            offset = 0
            for i in segment:
                out[i] = _from_words(segment_words[offset : offset + leaves[i].words], leaves[i])
                offset += leaves[i].words
        return out, words

    replicated = NamedSharding(mesh, P())
    program = jax.jit(broadcast, out_shardings=(list(shardings), [replicated] * len(segments)))
    if len(_PROGRAMS) >= _PROGRAMS_KEPT:
        _PROGRAMS.clear()
    _PROGRAMS[key] = program
    return program


def _signature(leaves) -> str:
    layout = repr([leaf.key() for leaf in leaves])
    return (
        f"{len(leaves)} arrays, {4 * sum(leaf.words for leaf in leaves)} bytes, shapes and "
        f"dtypes CRC-32 {zlib.crc32(layout.encode()):08x}"
    )


def from_worker_zero(strategy, xs: list, shardings: list, check=None) -> tuple[list, list]:
    """Worker 0's value of each process-local array in `xs`, as a global array on every worker.

    Every process must call this with the same arrays (shapes and dtypes) at the same point of
    its program; worker 0's values win, whatever the others hold.

    Args:
      strategy: the multi-worker strategy whose mesh the results live on.
      xs: fully addressable `jax.Array`s (or NumPy arrays), each this process's copy.
      shardings: per array, the `NamedSharding` of the result on `strategy.mesh` (replicated,
        or split over the replicas for sharded optimizer state).
      check: optional per-array flags; for flagged arrays this process reports whether its own
        value differed from worker 0's (bitwise).

    Returns:
      (results in `shardings`, indices of the flagged arrays whose local value differed).

    Raises:
      UnresponsivePeerError: a peer did not reach this broadcast within the strategy's
        communication timeout.
      DivergentWorkersError: the processes broadcast arrays of other shapes or dtypes.
    """
    leaves = [_Leaf(x) for x in xs]
    n = next(_COUNTER)
    name = f"broadcast/{n}"
    options = getattr(strategy, "communication_options", None)
    votes = multihost.exchange(name, _signature(leaves), getattr(options, "timeout_seconds", None))
    if n >= 2:
        multihost.forget(f"broadcast/{n - 2}")
    multihost.check_same(
        name,
        "the shapes and dtypes of the mirrored state placed on the replicas at its first "
        "use (every worker must build the same models, optimizers and metrics)",
        votes,
    )
    replica_devices = strategy.extended.replica_devices
    mesh = _process_mesh(replica_devices)
    segments = _segments(leaves)
    source = replica_devices.devices[0]
    sharding = NamedSharding(mesh, P(_PROCESSES))
    stacked = []
    for segment in segments:
        total = sum(leaves[i].words for i in segment)
        # Each device of worker 0's process holds the words, every other device zeros.
        rows = []
        for device in mesh.local_devices:
            if device.process_index != source.process_index:
                rows.append(jnp.zeros((1, total), jnp.int32, device=device))
            elif not rows:
                packed = _pack(
                    [jax.device_put(xs[i], device) for i in segment], _Hashable([leaves[i] for i in segment])
                )
                rows.append(jax.lax.bitcast_convert_type(packed, jnp.int32)[None])
            else:
                rows.append(jax.device_put(rows[0], device))
        stacked.append(
            jax.make_array_from_single_device_arrays((mesh.devices.shape[0], total), sharding, rows)
        )
    results, words = _program(leaves, segments, mesh, shardings)(stacked)
    differing = []
    if check is not None and any(check) and jax.process_index() != 0:
        differing = _differing(xs, leaves, segments, check, [w.addressable_data(0) for w in words])
    return results, differing


def _differing(xs, leaves, segments, check, words) -> list:
    """Indices of the flagged arrays whose bits differ from worker 0's `words` (per segment)."""
    found: list[int] = []
    for segment, segment_words in zip(segments, words):
        wanted = tuple(k for k, i in enumerate(segment) if check[i])
        if not wanted:
            continue
        device = next(iter(segment_words.devices()))
        flags = np.asarray(
            _compare(
                [jax.device_put(xs[i], device) for i in segment],
                segment_words,
                _Hashable([leaves[i] for i in segment]),
                wanted,
            )
        )
        found.extend(segment[k] for k, flag in zip(wanted, flags) if flag)
    return sorted(found)


class _Hashable(tuple):
    """The leaves' descriptions as a static argument of the packing program (hashed by
    layout, so one program serves every call with the same shapes and dtypes)."""

    _key: tuple

    def __new__(cls, leaves):
        self = super().__new__(cls, leaves)
        self._key = tuple(leaf.key() for leaf in leaves)
        return self

    def __hash__(self):
        return hash(self._key)

    def __eq__(self, other):
        return isinstance(other, _Hashable) and self._key == other._key
