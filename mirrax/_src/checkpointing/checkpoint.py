"""`mirrax.Checkpoint` (tf.train.Checkpoint's API) on Orbax; `Model.save_weights` / `load_weights`.

A checkpoint is an Orbax composite checkpoint directory with one item per tracked part (an NNX
module's state, an optimizer's state, a metric's state, a step counter). mirrax writes no
format of its own: Orbax writes every array once (whatever the replica count), to a temporary
directory that it renames when complete, so a reader never sees a half-written checkpoint.
Overwriting a checkpoint is atomic too (atomic_dirs.py): the new one is written beside the old
one and swapped in by rename, so a kill at any moment leaves the old or the new one restorable.
Restoring reads each array straight onto the CURRENT placement of the object it restores into,
so a checkpoint written under 4 replicas restores under 1, 2 or 8, or `OneDeviceStrategy`.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

import numpy as np
import orbax.checkpoint as ocp

from mirrax import errors
from mirrax._src import atomic_dirs
from mirrax._src.checkpointing import writer_lock
from mirrax._src.checkpointing.directory import (
    SAVE_COUNTER,
    is_complete,
    refuse_to_replace,
    stored_items,
    write_checkpoint,
)
from mirrax._src.checkpointing.parts import as_arrays, nnx_part, tracked_parts
from mirrax._src.checkpointing.restore import CheckpointLoadStatus, restore_parts
from mirrax._src.checkpointing.state_file import update_state
from mirrax._src.checkpointing.workers import (
    checked_everywhere,
    chief_path,
    for_save,
    write_stub,
)


class Checkpoint:
    """Saves and restores training state, as `tf.train.Checkpoint`, written by Orbax.

    Tracked objects are passed by keyword: `nnx.Module`s, `nnx.Optimizer`s, mirrax metrics
    (any `nnx.Pytree`), `nnx.Variable`s, `mirrax.Model`s (their module and, once compiled,
    their optimizer state) and plain numbers or arrays such as a step counter (restoring
    rebinds the attribute: `ckpt.step`). Tracked objects are attributes: `ckpt.model`.
    A `DistributedIterator` is tracked by its position (batches handed out, not prefetched);
    restoring into a fresh iterator over the same dataset re-reads and discards that many
    batches, so the source must be deterministic (a shuffling source seeded alike).

    Each array is written once (not once per replica), so the size does not depend on the
    replica count. Restoring places every array where the target object's array lives NOW,
    so a checkpoint saved under any strategy restores under any other. Loading never executes
    code from the checkpoint: Orbax stores arrays (TensorStore) and JSON metadata, not pickle.

    Example:
      ckpt = mirrax.Checkpoint(model=model, optimizer=optimizer, step=0)
      path = ckpt.save("/tmp/training/ckpt")        # '/tmp/training/ckpt-1'
      ckpt.restore(mirrax.train.latest_checkpoint("/tmp/training")).assert_consumed()

    Attributes:
      save_counter: number of `save` calls (and `CheckpointManager.save` calls), restored by
        `restore`, not by `read`, as TF's; `write` leaves it alone.
    """

    def __init__(self, **objects: Any):
        object.__setattr__(self, "_objects", {})
        object.__setattr__(self, "save_counter", 0)
        # Prefix -> the writer lock its numbered saves hold, released with this Checkpoint.
        locks: dict = {}
        object.__setattr__(self, "_writer_locks", locks)
        weakref.finalize(self, _release_all, locks)
        for name, obj in objects.items():
            setattr(self, name, obj)

    def __setattr__(self, name, value):
        if name.startswith("_") or name == SAVE_COUNTER:
            if name == SAVE_COUNTER:
                object.__setattr__(self, name, value)
                return
            raise errors.InvalidArgumentError(
                f"Checkpoint cannot track a name that starts with '_': {name!r}; rename it, "
                "e.g. Checkpoint(model=...) (names starting with '_' are the Checkpoint's own)."
            )
        tracked_parts(self._objects, name, value)  # validates the kind
        self._objects[name] = value

    def __getattr__(self, name):
        objects = self.__dict__.get("_objects", {})
        if name in objects:
            return objects[name]
        raise AttributeError(f"Checkpoint tracks no object named {name!r}; it tracks {sorted(objects)}.")

    def _all_parts(self) -> list:
        return [
            part for name, obj in self._objects.items() for part in tracked_parts(self._objects, name, obj)
        ]

    def save(self, file_prefix) -> str:
        """Writes a new numbered checkpoint `<file_prefix>-<save_counter>`, as
        `tf.train.Checkpoint.save`: `save_counter` is incremented first (so the first save
        writes `prefix-1`) and stored with the checkpoint; the `checkpoint` state file in
        `file_prefix`'s directory then names it, for `mirrax.train.latest_checkpoint`.

        Atomic as `write`; the state file is replaced only after the checkpoint is committed,
        so it never names a half-written one. In a multi-process run every process calls
        `save`; the chief's (process 0's) prefix is the one written (see `write`).

        Args:
          file_prefix: str or os.PathLike, e.g. '/tmp/training/ckpt'; its directory is created.

        Returns:
          The absolute path written, `<file_prefix>-<n>`.

        Raises:
          InvalidArgumentTypeError: `file_prefix` is not a str or os.PathLike.
          InvalidArgumentError: `file_prefix` is empty or names a directory (a prefix ending in
            '/'); TF would write files named '-1' inside it.
          ExistingPathError: as `write`, for the numbered path.
          LockedCheckpointError / CheckpointWriteError: as `write`; the prefix's writer lock
            (`<file_prefix>.mirrax-writer`) is held while this Checkpoint lives.
        """
        prefix = checked_everywhere(lambda: _checked_prefix(file_prefix), "Checkpoint.save")
        self.save_counter += 1
        try:
            path, target = self._write(f"{prefix}-{self.save_counter}", "Checkpoint.save", numbered=True)
        except BaseException:
            self.save_counter -= 1
            raise
        update_state(os.path.dirname(target), target)
        # Every worker's latest_checkpoint after save() sees this one.
        atomic_dirs.barrier(f"mirrax_checkpoint_state:{target}")
        return path

    def write(self, path) -> str:
        """Writes every tracked object to the directory `path` (replaced if it exists), as
        `tf.train.Checkpoint.write`: exactly `path`, no numbering, `save_counter` unchanged.

        Atomic, also when replacing: Orbax writes the new checkpoint to a temporary directory
        beside `path` and renames it when complete, then mirrax swaps it in by rename, so a
        kill at any moment leaves the old or the new checkpoint restorable from `path`. In a
        multi-process run every process calls `write`; Orbax lets process 0 write. When the
        processes pass different paths (TF's tutorials: the chief `ckpt`, the others
        `workertemp_<i>/ckpt`), the chief's path holds the checkpoint and every other
        process's path becomes a stub directory naming it (deleting a stub deletes nothing of
        the chief's; restoring one is refused with the chief's path). Host-local state (no
        step has touched it yet) is written with the chief's values.

        Returns:
          The absolute path written (in a non-chief process with its own path: that stub).

        Raises:
          ExistingPathError: `path` is a regular file, or a non-empty directory that is no
            checkpoint (neither is ever replaced).
          InvalidArgumentTypeError: `path` is not a str or os.PathLike.
          InvalidArgumentError: a non-chief path contains or lies in the chief's.
          LockedCheckpointError: another process is writing `path` (its writer lock
            `<path>.mirrax-writer` names its pid and host); nothing was written.
          CheckpointWriteError: no space left (disk, quota or file size limit); the
            checkpoint that was at `path` is unchanged.
        """
        what = "Checkpoint.write"
        return self._write(checked_everywhere(lambda: atomic_dirs.checked_path(path, what), what), what)[0]

    def _write(self, path: str, what: str, numbered: bool = False) -> tuple:
        """Writes the checkpoint for this process's `path`; returns (`path`, the path written).

        The writer lock (writer_lock.py) of a numbered save's prefix is held while this
        Checkpoint lives (its numbers and state file are its own); a `write`'s only while
        it writes.
        """
        target = chief_path(path, what, lambda own: refuse_to_replace(own, what))
        save_args = orbax_save_args(self)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        token = []
        if numbered:
            prefix = target.rsplit("-", 1)[0]
            if prefix not in self._writer_locks:
                self._writer_locks[prefix] = writer_lock.take(
                    prefix + writer_lock.SUFFIX, what, f"{prefix}-<n>"
                )
        else:
            token = writer_lock.take(target + writer_lock.SUFFIX, what, target)
        try:
            atomic_dirs.replace_atomically(
                target, lambda new: write_checkpoint(new, save_args, what), is_complete
            )
        finally:
            writer_lock.release(token)
        if target != path:
            write_stub(path, target)
        return path, target

    def restore(self, path) -> CheckpointLoadStatus:
        """Reads the checkpoint at `path` into the tracked objects, placed where they are now.

        A tracked object whose name is not in the checkpoint keeps its values, and a stored
        item nothing tracks is left unread; the returned status reports both
        (`assert_consumed()`, `expect_partial()`), as TF's. Nothing is changed unless every
        matched item fits. PRNG state (`nnx.Rngs` keys and counts, typed or legacy keys) is
        restored exactly. If a save was killed while replacing `path` (between its two
        renames), the complete checkpoint left beside it is read instead (logged).

        Raises:
          MissingCheckpointError (a FileNotFoundError): no directory at `path`.
          InvalidCheckpointError (a ValueError): the directory is not a complete, readable
            checkpoint (no metadata, an unfinished save, a truncated data file), or `path` is
            a file.
          IncompatibleCheckpointError (a ValueError): a tracked object's structure, shapes or
            dtypes differ from the stored ones (the message lists each path with its stored
            and current shape or dtype); or no tracked name is in the checkpoint at all (a
            partial match is TF's status instead).
          ValueError: a tracked `DistributedIterator` has already handed out batches.
        """
        return self._restore(path, "restore", with_counter=True)

    def read(self, path) -> CheckpointLoadStatus:
        """As `restore`, but leaves `save_counter` alone (TF's `read` for `write`'s files)."""
        return self._restore(path, "read", with_counter=False)

    def _restore(self, path, what: str, with_counter: bool) -> CheckpointLoadStatus:
        what = f"Checkpoint.{what}"
        path = atomic_dirs.resolve(atomic_dirs.checked_path(path, what), what, is_complete)
        stored = stored_items(path, what)
        parts = self._all_parts()
        matched = [part for part in parts if part.item in stored]
        items = sorted(set(stored) - {SAVE_COUNTER})
        if parts and items and not matched:
            # TF returns a status that asserts later; a restore that changes nothing is never
            # what was meant, so it is refused while nothing has been touched.
            hint = (
                " It holds 'weights', Model.save_weights's output: read it with "
                "model.load_weights(path), or track the module as weights=model.module."
                if "weights" in items
                else " A mirrax.Model saved as NAME is stored as NAME.module (and NAME.optimizer): "
                "track a mirrax.Model under NAME to restore it."
                if any(i.endswith(".module") for i in items)
                else ""
            )
            raise errors.IncompatibleCheckpointError(
                f"{what}: nothing this Checkpoint tracks ({sorted(p.item for p in parts)}) is in "
                f"the checkpoint at {path}, which holds {items}; nothing was restored. Track the "
                f"objects under the names they were saved with.{hint}"
            )
        counter = with_counter and SAVE_COUNTER in stored
        restored = restore_parts(path, what, matched, stored, counter)
        if counter:
            self.save_counter = int(np.asarray(restored[SAVE_COUNTER]["value"]))
        tracked = {part.item for part in parts}
        return CheckpointLoadStatus(
            path,
            unused_in_checkpoint=sorted(set(stored) - tracked - {SAVE_COUNTER}),
            not_in_checkpoint=sorted(tracked - set(stored)),
        )


def _checked_prefix(file_prefix) -> str:
    """`Checkpoint.save`'s prefix as an absolute path; refuses a directory (TF would write files
    named '-1' inside it)."""
    prefix = atomic_dirs.checked_path(file_prefix, "Checkpoint.save")
    if os.fspath(file_prefix).endswith(("/", os.sep)) or os.path.isdir(prefix):
        raise errors.InvalidArgumentError(
            f"Checkpoint.save: file_prefix must be a path prefix inside a directory, not a "
            f"directory; received {file_prefix!r}. Pass e.g. "
            f"os.path.join({os.fspath(file_prefix)!r}, 'ckpt') (saves become ckpt-1, ckpt-2, "
            "...), or write(path) to write exactly a path."
        )
    return prefix


def _release_all(locks: dict) -> None:
    for token in locks.values():
        writer_lock.release(token)


def orbax_save_args(checkpoint: Checkpoint) -> ocp.args.Composite:
    """One save's Orbax arguments: every part `checkpoint` tracks, and its save_counter (for
    `Checkpoint.save` and `CheckpointManager.save`)."""
    items = {
        part.item: ocp.args.StandardSave(for_save(as_arrays(part.get()))) for part in checkpoint._all_parts()
    }
    counter = np.asarray(checkpoint.save_counter, np.int64)
    items[SAVE_COUNTER] = ocp.args.StandardSave({"value": counter})
    return ocp.args.Composite(**items)


# -- Model.save_weights / Model.load_weights (model.py delegates here) ---------------------------


def save_weights(model, filepath, overwrite: bool = True) -> None:
    """`Model.save_weights`: the module's variables as a `Checkpoint(weights=model.module)`."""
    path = atomic_dirs.checked_path(filepath, "save_weights")
    if not isinstance(overwrite, (bool, np.bool_)):
        raise errors.InvalidArgumentTypeError(
            f"save_weights: overwrite must be True or False; received {overwrite!r}."
        )
    refuse_to_replace(path, "save_weights")
    if os.path.exists(path) and not overwrite:
        raise errors.ExistingPathError(f"save_weights: {path} exists; pass overwrite=True to replace it.")
    Checkpoint(weights=model.module).write(path)


def load_weights(model, filepath) -> None:
    """`Model.load_weights`: from `save_weights`'s output, or the module of a full checkpoint
    (`Checkpoint(model=model)`, `ModelCheckpoint`'s default), as Keras's from a full save."""
    path = atomic_dirs.resolve(
        atomic_dirs.checked_path(filepath, "load_weights"),
        "load_weights",
        is_complete,
        missing=f"load_weights: no weights directory at {os.path.abspath(os.fspath(filepath))}; "
        "write one with model.save_weights(path).",
    )
    stored = stored_items(path, "load_weights")
    modules = sorted(n for n in stored if n.endswith(".module"))
    if "weights" in stored:
        item = "weights"
    elif len(modules) == 1:
        item = modules[0]
    else:
        items = sorted(set(stored) - {SAVE_COUNTER}) or sorted(stored)
        name = modules[0].rsplit(".", 1)[0] if modules else items[0]
        raise errors.IncompatibleCheckpointError(
            f"load_weights: the checkpoint at {path} holds no single model's weights (its "
            f"items: {items}); load_weights reads what model.save_weights or "
            f"Checkpoint(model=model) wrote. Restore it with "
            f"mirrax.Checkpoint({name}=<the object saved>).restore({path!r})."
        )
    restore_parts(path, "load_weights", [nnx_part(item, model.module)], stored, counter=False)
