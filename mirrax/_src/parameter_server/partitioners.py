"""How a ParameterServerStrategy cuts a large variable into shards, as
`tf.distribute.experimental.partitioners`.

A partitioner is called as `partitioner(shape, dtype, axis=0)` and returns the number of
shards along each axis (a list as long as `shape`, 1 everywhere but `axis`), TF's contract.
The shards are consecutive slices along `axis`; when the count does not divide the axis, the
first shards are one longer (TF's rule, `numpy.array_split`'s too).
"""

from __future__ import annotations

import math

import numpy as np

from mirrax import errors

_STRING_KINDS = ("U", "S", "O")


def _positive(owner: str, name: str, value, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise errors.InvalidArgumentError(
            f"{owner}: {name} must be a positive int{' or None' if optional else ''}; received {value!r}."
        )


def _element_bytes(dtype, bytes_per_string: int) -> int:
    dtype = np.dtype(dtype)
    return bytes_per_string if dtype.kind in _STRING_KINDS else dtype.itemsize


def _check_axis(owner: str, shape: tuple, axis: int) -> None:
    if not 0 <= axis < len(shape):
        raise errors.InvalidArgumentError(
            f"{owner}: cannot partition a variable of shape {shape} along axis {axis}; the "
            f"axis must be in [0, {len(shape)})."
        )


class Partitioner:
    """Base class of the partitioners, as `tf.distribute.experimental.partitioners.Partitioner`."""

    def __call__(self, shape, dtype, axis: int = 0) -> list:
        """The number of shards along each axis of a variable of `shape` and `dtype`.

        Args:
          shape: the variable's shape, a tuple of ints of length >= 1.
          dtype: its dtype (anything `numpy.dtype` accepts).
          axis: the axis to cut along.

        Returns:
          A list of ints as long as `shape`: 1 for every axis but `axis`.
        """
        raise NotImplementedError


class FixedShardsPartitioner(Partitioner):
    """`num_shards` shards (fewer when the axis is shorter), as TF's class of that name.

    Raises:
      ValueError: `num_shards` is not a positive int.
    """

    def __init__(self, num_shards: int):
        _positive("FixedShardsPartitioner", "num_shards", num_shards)
        self._num_shards = num_shards

    def __call__(self, shape, dtype, axis: int = 0) -> list:
        shape = tuple(shape)
        _check_axis("FixedShardsPartitioner", shape, axis)
        partitions = [1] * len(shape)
        partitions[axis] = min(self._num_shards, shape[axis])
        return partitions

    def __repr__(self) -> str:
        return f"FixedShardsPartitioner(num_shards={self._num_shards})"


class MinSizePartitioner(Partitioner):
    """As many shards as keep each at least `min_shard_bytes`, at most `max_shards`.

    As `tf.distribute.experimental.partitioners.MinSizePartitioner`: shards =
    max(1, min(shape[axis], max_shards, ceil(total_bytes / min_shard_bytes))). E.g. a float32
    variable of shape (6, 1) (24 bytes) with min_shard_bytes=4, max_shards=2 gets [2, 1].

    Args:
      min_shard_bytes: the least bytes per shard (default 256 KiB).
      max_shards: the most shards (default 1: no partitioning).
      bytes_per_string: the bytes counted per element of a string variable.

    Raises:
      ValueError: an argument is not a positive int.
    """

    def __init__(self, min_shard_bytes: int = 256 << 10, max_shards: int = 1, bytes_per_string: int = 16):
        for name, value in (
            ("min_shard_bytes", min_shard_bytes),
            ("max_shards", max_shards),
            ("bytes_per_string", bytes_per_string),
        ):
            _positive("MinSizePartitioner", name, value)
        self._min_shard_bytes = min_shard_bytes
        self._max_shards = max_shards
        self._bytes_per_string = bytes_per_string

    def __call__(self, shape, dtype, axis: int = 0) -> list:
        shape = tuple(shape)
        _check_axis("MinSizePartitioner", shape, axis)
        total = math.prod(shape) * _element_bytes(dtype, self._bytes_per_string)
        partitions = [1] * len(shape)
        partitions[axis] = max(
            1, min(shape[axis], self._max_shards, math.ceil(total / self._min_shard_bytes))
        )
        return partitions

    def __repr__(self) -> str:
        return f"MinSizePartitioner(min_shard_bytes={self._min_shard_bytes}, max_shards={self._max_shards})"


class MaxSizePartitioner(Partitioner):
    """As few shards as keep each at most `max_shard_bytes` (capped by `max_shards`).

    As `tf.distribute.experimental.partitioners.MaxSizePartitioner`: a slice is one index
    along `axis`; slices_per_shard = max(1, floor(max_shard_bytes / bytes_per_slice)) and
    shards = ceil(shape[axis] / slices_per_shard), at most `max_shards`. E.g. float32 (6, 1)
    with max_shard_bytes=8 gets [3, 1] (two 4-byte slices per shard).

    Args:
      max_shard_bytes: the most bytes per shard (a single slice may exceed it).
      max_shards: the most shards, or None for no limit.
      bytes_per_string: the bytes counted per element of a string variable.

    Raises:
      ValueError: an argument is not a positive int (or None for `max_shards`).
    """

    def __init__(self, max_shard_bytes: int, max_shards: int | None = None, bytes_per_string: int = 16):
        _positive("MaxSizePartitioner", "max_shard_bytes", max_shard_bytes)
        _positive("MaxSizePartitioner", "max_shards", max_shards, optional=True)
        _positive("MaxSizePartitioner", "bytes_per_string", bytes_per_string)
        self._max_shard_bytes = max_shard_bytes
        self._max_shards = max_shards
        self._bytes_per_string = bytes_per_string

    def __call__(self, shape, dtype, axis: int = 0) -> list:
        shape = tuple(shape)
        _check_axis("MaxSizePartitioner", shape, axis)
        partitions = [1] * len(shape)
        if shape[axis] == 0:
            return partitions
        slice_bytes = math.prod(shape) / shape[axis] * _element_bytes(dtype, self._bytes_per_string)
        per_shard = max(1, math.floor(self._max_shard_bytes / slice_bytes)) if slice_bytes else shape[axis]
        shards = math.ceil(shape[axis] / per_shard)
        if self._max_shards:
            shards = min(self._max_shards, shards)
        partitions[axis] = shards
        return partitions

    def __repr__(self) -> str:
        return f"MaxSizePartitioner(max_shard_bytes={self._max_shard_bytes}, max_shards={self._max_shards})"


def shard_count(partitioner, shape: tuple, dtype, path: str) -> int:
    """How many shards along axis 0 `partitioner` gives a variable (1 for a scalar or None).

    Raises:
      ValueError: the partitioner's answer is not a list of positive ints as long as `shape`
        with every entry but the first equal to 1 (mirrax cuts along axis 0 only, as TF's
        ParameterServerStrategy).
    """
    if partitioner is None or len(shape) == 0 or shape[0] <= 1:
        return 1
    answer = partitioner(tuple(shape), np.dtype(dtype), axis=0)
    if isinstance(answer, (list, tuple)):  # NumPy ints are ints here
        answer = [int(n) if isinstance(n, np.integer) else n for n in answer]
    if (
        not isinstance(answer, list)
        or len(answer) != len(shape)
        or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in answer)
        or any(n != 1 for n in answer[1:])
    ):
        raise errors.InvalidArgumentError(
            f"ParameterServerStrategy: variable_partitioner {partitioner!r} returned {answer!r} "
            f"for {path} of shape {tuple(shape)}; it must return a list of {len(shape)} positive "
            "ints, 1 on every axis but axis 0 (variables are cut along their first axis)."
        )
    return min(answer[0], shape[0])
