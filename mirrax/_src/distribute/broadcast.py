"""Mirrored state made equal on every worker: process-local arrays broadcast from worker 0.

TF broadcasts each mirrored variable's initial value from worker 0 when a multi-worker strategy
creates it (CollectiveAllReduceExtended's variable creator: worker 0's first device sends, every
other device receives), so an unseeded initializer gives one model, not one per worker. mirrax's
objects exist before any strategy sees them, so the same happens at the strategy's FIRST use of
an array that is still local to its process (just initialized, restored, or assigned on the
host): every such array of one call is packed into ONE buffer of 32-bit words and summed over the
replicas in one all-reduce in which only worker 0's first replica contributes (the others give
zeros), so the result is worker 0's bits exactly (integer adds of zeros: -0.0 and NaN payloads
survive). Arrays a step wrote back are already global and never come here.

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
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mirrax._src.distribute import multihost
from mirrax._src.distribute.replica_context import REPLICA_AXIS

_COUNTER = itertools.count()
_PROGRAMS: dict = {}  # (layout, mesh, shardings) -> jitted program; a few per model
_PROGRAMS_KEPT = 64


class _Leaf:
    """What packing needs of one array: its shape, dtype (a PRNG key's implementation) and
    its number of 32-bit words."""

    __slots__ = ("shape", "dtype", "impl", "words")

    def __init__(self, x):
        self.shape = tuple(x.shape)
        dtype = jax.dtypes.canonicalize_dtype(x.dtype) if not _is_key(x) else x.dtype
        self.dtype = dtype
        self.impl = jax.random.key_impl(x) if _is_key(x) else None
        if self.impl is None:
            data = jax.ShapeDtypeStruct(self.shape, dtype)
        else:
            data = jax.eval_shape(jax.random.key_data, x)
        nbytes = int(np.prod(data.shape, dtype=np.int64)) * np.dtype(data.dtype).itemsize
        self.words = -(-nbytes // 4)

    def key(self):
        return (self.shape, str(self.dtype), str(self.impl))


def _is_key(x) -> bool:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _to_words(x, leaf: _Leaf):
    """`x` as a flat uint32 vector of `leaf.words` words (its bytes, zero-padded)."""
    if leaf.impl is not None:
        x = jax.random.key_data(x)
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
        return jax.random.wrap_key_data(data.reshape(leaf.shape + (-1,)), impl=leaf.impl)
    dtype = jnp.dtype(leaf.dtype)
    if dtype.itemsize == 4 and dtype != jnp.bool_:
        return jax.lax.bitcast_convert_type(words, dtype).reshape(leaf.shape)
    data = jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(-1)
    size = int(np.prod(leaf.shape, dtype=np.int64))
    if dtype == jnp.bool_:
        return (data[:size] != 0).reshape(leaf.shape)
    data = data[:size * dtype.itemsize]
    if dtype.itemsize == 1:
        return jax.lax.bitcast_convert_type(data, dtype).reshape(leaf.shape)
    return jax.lax.bitcast_convert_type(data.reshape(-1, dtype.itemsize), dtype).reshape(
        leaf.shape)


@jax.jit(static_argnums=1)
def _pack(xs, leaves):
    return jnp.concatenate([_to_words(x, leaf) for x, leaf in zip(xs, leaves)])


@jax.jit(static_argnums=(2, 3))
def _compare(xs, words, leaves, wanted):
    """Per flagged array (indices `wanted`), whether the bits of `xs` differ from `words`."""
    mine = _pack(xs, leaves)
    ends = list(itertools.accumulate(leaf.words for leaf in leaves))
    return jnp.stack([jnp.any(mine[ends[i] - leaves[i].words:ends[i]]
                              != words[ends[i] - leaves[i].words:ends[i]]) for i in wanted])


def _program(leaves, mesh, shardings):
    """The jitted broadcast: (replicas, words) rows, zeros except worker 0's first replica's,
    summed over the replicas, unpacked into arrays placed as `shardings`; also the words."""
    key = (tuple(leaf.key() for leaf in leaves), mesh, tuple(shardings))
    program = _PROGRAMS.get(key)
    if program is not None:
        return program

    def sum_rows(rows):
        return jax.lax.psum(rows[0], REPLICA_AXIS)

    def broadcast(rows):
        words = jax.shard_map(sum_rows, mesh=mesh, in_specs=P(REPLICA_AXIS), out_specs=P())(rows)
        out, offset = [], 0
        for leaf in leaves:
            out.append(_from_words(words[offset:offset + leaf.words], leaf))
            offset += leaf.words
        return out, words

    program = jax.jit(broadcast, out_shardings=(list(shardings), NamedSharding(mesh, P())))
    if len(_PROGRAMS) >= _PROGRAMS_KEPT:
        _PROGRAMS.clear()
    _PROGRAMS[key] = program
    return program


def _signature(leaves) -> str:
    layout = repr([leaf.key() for leaf in leaves])
    return (f"{len(leaves)} arrays, {4 * sum(leaf.words for leaf in leaves)} bytes, shapes and "
            f"dtypes CRC-32 {zlib.crc32(layout.encode()):08x}")


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
        name, "the shapes and dtypes of the mirrored state placed on the replicas at its first "
        "use (every worker must build the same models, optimizers and metrics)", votes)
    replica_devices = strategy.extended.replica_devices
    local = replica_devices.local_devices
    total = sum(leaf.words for leaf in leaves)
    source = replica_devices.devices[0]
    rows = []
    for device in local:
        if device == source:
            rows.append(_pack([jax.device_put(x, device) for x in xs], _Hashable(leaves))[None])
        else:
            rows.append(jnp.zeros((1, total), jnp.uint32, device=device))
    stacked = jax.make_array_from_single_device_arrays(
        (len(replica_devices), total), replica_devices.stacked, rows)
    results, words = _program(leaves, strategy.mesh, shardings)(stacked)
    differing = []
    if check is not None and any(check) and jax.process_index() != 0:
        differing = _differing(xs, leaves, check, words.addressable_data(0))
    return results, differing


def _differing(xs, leaves, check, words) -> list:
    """Indices of the flagged arrays whose bits differ from worker 0's `words`."""
    device = next(iter(words.devices()))
    wanted = tuple(i for i, flag in enumerate(check) if flag)
    flags = np.asarray(_compare([jax.device_put(x, device) for x in xs], words,
                                _Hashable(leaves), wanted))
    return [i for i, flag in zip(wanted, flags) if flag]


class _Hashable(tuple):
    """The leaves' descriptions as a static argument of the packing program (hashed by
    layout, so one program serves every call with the same shapes and dtypes)."""

    def __new__(cls, leaves):
        self = super().__new__(cls, leaves)
        self._key = tuple(leaf.key() for leaf in leaves)
        return self

    def __hash__(self):
        return hash(self._key)

    def __eq__(self, other):
        return isinstance(other, _Hashable) and self._key == other._key
