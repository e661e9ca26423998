"""`FileDataset`: examples stored in a list of files, in global batches, shardable by file.

The mirrax counterpart of `tf.data.Dataset.list_files(...).interleave(reader).batch(B)`: it
tells `experimental_distribute_dataset` which files hold the data, so a multi-worker run can
give each worker its own files (`AutoShardPolicy.FILE`, TF's meaning) instead of every worker
reading everything. Files are read with Grain (a background thread reads ahead).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence

import jax
import numpy as np

from mirrax import errors


class FileDataset:
    """The examples of `files`, read in order by `read_file`, in batches of `batch_size`.

    Args:
      files: a sequence of paths (str or os.PathLike); the order is the reading order.
      read_file: `read_file(path)` returns the file's examples: an array, or a tuple/dict of
        arrays, with the examples along the first axis (any number of them, 0 included).
      batch_size: the GLOBAL batch size (examples per step over all replicas), an int >= 1.
        The last batch may be partial (it is padded and masked when distributed).

    Iterating yields batches with the structure `read_file` returns. Under
    `MultiWorkerMirroredStrategy`, `experimental_distribute_dataset` shards it by the
    `InputOptions.experimental_auto_shard_policy`: FILE gives worker i the files i, i + W, ...
    (W workers) in batches of batch_size / W; DATA lets every worker read every file and keep its
    part of each global batch; OFF gives every worker all the data; AUTO is FILE when there are
    at least W files, else DATA.

    Raises:
      TypeError: `files` is a single string, or `read_file` is not callable.
      ValueError: `batch_size` is not an int >= 1.
    """

    def __init__(self, files: Sequence, read_file: Callable, batch_size: int):
        if isinstance(files, (str, bytes)):
            raise errors.InvalidArgumentTypeError(
                f"FileDataset: files must be a sequence of paths; received the single string "
                f"{files!r}. Wrap it in a list: FileDataset([{files!r}], ...)."
            )
        if not hasattr(files, "__iter__"):
            raise errors.InvalidArgumentTypeError(
                f"FileDataset: files must be a sequence of paths; received {files!r} of type "
                f"{type(files).__name__}."
            )
        files = list(files)
        if not files:
            raise errors.InvalidArgumentError(
                "FileDataset: files is empty, so the dataset holds no example and a loop over it "
                "would train on nothing. Pass at least one path (check the glob pattern or "
                "folder that built the list)."
            )
        bad = [f for f in files if not isinstance(f, (str, os.PathLike))]
        if bad:
            raise errors.InvalidArgumentTypeError(
                f"FileDataset: every file must be a path (str or os.PathLike); received "
                f"{bad[0]!r} of type {type(bad[0]).__name__} among the files."
            )
        if not callable(read_file):
            raise errors.InvalidArgumentTypeError(
                "FileDataset: read_file must be callable as read_file(path) -> arrays; "
                f"received {type(read_file).__name__}."
            )
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise errors.InvalidArgumentError(
                f"FileDataset: batch_size must be an int >= 1; received {batch_size!r}."
            )
        self.files = files
        self.read_file = read_file
        self.batch_size = batch_size

    def shard(self, num_shards: int, index: int, batch_size: int) -> FileDataset:
        """The files index, index + num_shards, ... in batches of `batch_size` (one worker's).

        Raises:
          InvalidArgumentError: num_shards < 1, index outside [0, num_shards), or no file
            left for this shard.
        """
        if (
            isinstance(num_shards, bool)
            or not isinstance(num_shards, int)
            or num_shards < 1
            or isinstance(index, bool)
            or not isinstance(index, int)
            or not 0 <= index < num_shards
        ):
            raise errors.InvalidArgumentError(
                f"FileDataset.shard: num_shards must be an int >= 1 and index an int in [0, "
                f"num_shards); received num_shards={num_shards!r}, index={index!r}."
            )
        return FileDataset(self.files[index::num_shards], self.read_file, batch_size)

    def __iter__(self) -> Iterator:
        return _batches(self._examples(), self.batch_size)

    def _examples(self) -> Iterator:
        import grain

        # Grain reads the next files in a background thread while these are batched.
        files = grain.MapDataset.source(self.files).map(self.read_file)
        return iter(files.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=2)))

    def __repr__(self) -> str:
        return f"FileDataset({len(self.files)} files, batch_size={self.batch_size})"


def _batches(chunks: Iterator, batch_size: int) -> Iterator:
    """Re-cuts a stream of example chunks (pytrees of arrays) into batches of `batch_size`."""
    pending, count, treedef = [], 0, None
    for chunk in chunks:
        leaves, chunk_def = jax.tree.flatten(chunk)
        leaves = [np.asarray(a) for a in leaves]
        if treedef is None:
            treedef = chunk_def
        elif chunk_def != treedef:
            raise errors.InvalidArgumentError(
                f"FileDataset: read_file returned {chunk_def} for one file and {treedef} for an "
                "earlier one; every file must give the same structure."
            )
        if not leaves or not leaves[0].shape[0]:
            continue
        pending.append(leaves)
        count += leaves[0].shape[0]
        while count >= batch_size:
            columns = [np.concatenate(column) for column in zip(*pending)]
            yield jax.tree.unflatten(treedef, [c[:batch_size] for c in columns])
            pending = [[c[batch_size:] for c in columns]]
            count -= batch_size
    if count:
        columns = [np.concatenate(column) for column in zip(*pending)]
        yield jax.tree.unflatten(treedef, columns)
