"""`mirrax.CheckpointManager`: numbered checkpoints in one directory, as tf.train's, on Orbax's
manager.

Orbax keeps the newest `max_to_keep` and writes in the background; mirrax adds TF's
`checkpoint_interval` rule, skips (and moves aside) numbered folders that are no checkpoint,
replaces an existing number atomically, and waits for a save in flight before reading the
directory and at process exit.
"""

from __future__ import annotations

import datetime
import errno
import logging
import os
import time
import weakref

import jax
import numpy as np
import orbax.checkpoint as ocp

from mirrax import errors
from mirrax._src import argument_checks, atomic_dirs
from mirrax._src.checkpointing import space, writer_lock
from mirrax._src.checkpointing.checkpoint import Checkpoint, orbax_save_args
from mirrax._src.checkpointing.directory import (
    METADATA_FILE,
    is_complete,
    refuse_non_directory,
    write_checkpoint,
)
from mirrax._src.checkpointing.orbax_quiet import quiet_orbax
from mirrax._src.checkpointing.workers import checked_everywhere, chief_path, write_stub
from mirrax._src.distribute import _compat

_LOG = logging.getLogger("mirrax")

# Where CheckpointManager's Orbax manager renames a checkpoint it drops (max_to_keep), so the
# checkpoint vanishes from the directory in one rename; mirrax then deletes it from there.
_DELETED_SUBDIR = ".mirrax-deleted"


# Orbax managers with an asynchronous save that nobody has waited for yet (held strongly, so
# a save outlives a dropped CheckpointManager), and whether the exit hook is registered.
_IN_FLIGHT: set = set()
_EXIT_HOOK: list = []


def _wait_for_all_in_flight() -> None:
    while _IN_FLIGHT:
        _IN_FLIGHT.pop().wait_until_finished()


def _delete_leftover(path: str, settle_s: float = 10.0) -> None:
    """Deletes a failed or killed save's temporary directory. After a save that failed in this
    process (e.g. out of space), Orbax's writer threads for its other items may still be
    creating files there, so rmtree can meet a directory that refills (ENOTEMPTY) or an entry
    already gone (ENOENT): retried until it settles, bounded by `settle_s` seconds."""
    deadline = time.monotonic() + settle_s
    while True:
        try:
            atomic_dirs.delete_if_exists(path)
            return
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.ENOENT) or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _register_exit_hook() -> None:
    """Waits for in-flight saves at exit BEFORE concurrent.futures shuts its executors down
    (Orbax's writer thread still needs them; `atexit` runs too late: "cannot schedule new
    futures after shutdown"). threading's hooks run newest first, so registering after
    concurrent.futures was imported puts this one ahead of its shutdown."""
    if _EXIT_HOOK:
        return
    _compat.register_before_executor_shutdown(_wait_for_all_in_flight)
    _EXIT_HOOK.append(True)


class CheckpointManager:
    """Numbered checkpoints in one directory, as `tf.train.CheckpointManager`, on Orbax's.

    Checkpoint number n is written to `directory/n` by Orbax (to a temporary directory renamed
    when complete), and only the newest `max_to_keep` are kept (None keeps all), plus, with
    `keep_checkpoint_every_n_hours`, checkpoints at least that far apart in time. A dropped
    checkpoint is first renamed into `directory/.mirrax-deleted` (one atomic step, after the
    new one is committed), then deleted, so a kill at any moment leaves the newest committed
    checkpoint restorable. Saving a number that exists replaces it atomically (as
    `Checkpoint.save`). Directories that are not complete checkpoints (an empty numbered
    folder, an unfinished save) are skipped by `checkpoints` and `latest_checkpoint` with a
    log line, and moved aside (renamed `<n>.mirrax-incomplete`) by the next `save`.

    Args:
      checkpoint: the `mirrax.Checkpoint` to save and restore.
      directory: where the numbered checkpoints live (created if missing).
      max_to_keep: how many checkpoints to keep, newest first (an int >= 1); None keeps every one.
      keep_checkpoint_every_n_hours: hours (float); also keep, beyond `max_to_keep`, the oldest
        kept checkpoint and each one committed at least this long after the previous one so
        kept (Orbax's `keep_time_interval`, which counts whole seconds: under 1/3600 hours
        every checkpoint is kept). Unlike TF's, the oldest checkpoint is always kept.
      checkpoint_interval: with it (an int >= 0), `save(checkpoint_number=n)` writes only when
        n is at least this far past the last saved number (TF's rule); other calls return None.
      init_fn: called by `restore_or_initialize` when there is no checkpoint yet.
      async_save: if True, `save` returns once the state is copied, while the arrays are
        written in the background by Orbax's asynchronous checkpointer; the next `save`,
        `wait_until_finished`, `restore_or_initialize`, `checkpoints`, `latest_checkpoint`
        and process exit wait for it. The saved values are those at the time of `save`.

    Raises:
      InvalidArgumentTypeError / InvalidArgumentError: an argument of the wrong type or out of
        range (e.g. `max_to_keep=0`, `'3'` or `2.5`; a negative `checkpoint_interval`).
      ExistingPathError: `directory` is a regular file.

    Multi-worker (TF's tutorial pattern): every process constructs the manager and calls
    `save`. When the processes pass different directories (the chief `ckpt`, the others
    `workertemp_<i>/ckpt`), the chief's directory holds the checkpoints; each other process's
    directory gets a stub naming it (so deleting it, as the tutorials do, deletes nothing of
    the chief's), and its `checkpoints` / `latest_checkpoint` / `restore_or_initialize` read the
    chief's. Constructing the manager is then collective (the processes agree on the chief's
    directory), as Orbax's own manager already is.
    """

    def __init__(
        self,
        checkpoint: Checkpoint,
        directory,
        max_to_keep: int | None = 5,
        keep_checkpoint_every_n_hours: float | None = None,
        checkpoint_interval: int | None = None,
        init_fn=None,
        async_save: bool = False,
    ):
        owner = "CheckpointManager"
        if not isinstance(checkpoint, Checkpoint):
            raise errors.InvalidArgumentTypeError(
                f"CheckpointManager manages a mirrax.Checkpoint; received "
                f"{type(checkpoint).__name__}. Pass mirrax.Checkpoint(model=..., ...)."
            )
        max_to_keep = argument_checks.count(owner, "max_to_keep", max_to_keep, 1, allow_none=True)
        if keep_checkpoint_every_n_hours is not None:
            if isinstance(keep_checkpoint_every_n_hours, bool) or not isinstance(
                keep_checkpoint_every_n_hours, (int, float, np.integer, np.floating)
            ):
                raise errors.InvalidArgumentTypeError(
                    "CheckpointManager: keep_checkpoint_every_n_hours must be a number of hours "
                    f"or None; received {keep_checkpoint_every_n_hours!r} of type "
                    f"{type(keep_checkpoint_every_n_hours).__name__}."
                )
            if not keep_checkpoint_every_n_hours > 0 or not np.isfinite(keep_checkpoint_every_n_hours):
                raise errors.InvalidArgumentError(
                    "keep_checkpoint_every_n_hours must be a positive number of hours or None; "
                    f"received {keep_checkpoint_every_n_hours}."
                )
        checkpoint_interval = argument_checks.count(
            owner, "checkpoint_interval", checkpoint_interval, 0, allow_none=True
        )
        if init_fn is not None and not callable(init_fn):
            raise errors.InvalidArgumentTypeError(
                f"CheckpointManager: init_fn must be a function or None; received {init_fn!r}."
            )
        if not isinstance(async_save, (bool, np.bool_)):
            raise errors.InvalidArgumentTypeError(
                f"CheckpointManager: async_save must be True or False; received {async_save!r}."
            )
        self.checkpoint = checkpoint
        self.directory = checked_everywhere(lambda: atomic_dirs.checked_path(directory, owner), owner)
        # Where the checkpoints live: the chief's directory, on every process (workers.py).
        self._shared = chief_path(self.directory, owner, lambda own: refuse_non_directory(own, owner))
        self.max_to_keep = max_to_keep
        self.keep_checkpoint_every_n_hours = keep_checkpoint_every_n_hours
        self.checkpoint_interval = checkpoint_interval
        self.async_save = bool(async_save)
        self._init_fn = init_fn
        # The directory's writer lock (writer_lock.py), taken by the first save, held until
        # close() or until this manager is dropped.
        self._writer_lock: list | None = None
        self._saving: int | None = None  # the save in flight: number, bytes
        self._saving_bytes = 0
        keep_time_interval = (
            None
            if keep_checkpoint_every_n_hours is None
            else datetime.timedelta(hours=float(keep_checkpoint_every_n_hours))
        )
        with quiet_orbax():
            self._manager = ocp.CheckpointManager(
                self._shared,
                options=ocp.CheckpointManagerOptions(
                    max_to_keep=max_to_keep,
                    keep_time_interval=keep_time_interval,
                    # Always Orbax's asynchronous writer (its default); a synchronous save waits
                    # for it at once, which keeps one write path for both modes.
                    enable_async_checkpointing=True,
                    create=True,
                    # A dropped checkpoint leaves the directory listing in one rename.
                    todelete_subdir=_DELETED_SUBDIR,
                ),
            )

    def wait_until_finished(self) -> None:
        """Blocks until an asynchronous save in flight is committed (returns at once if none).

        Raises:
          CheckpointWriteError: the save in flight ran out of space (disk, quota or file size
            limit); the checkpoints committed before it are unchanged.
        """
        try:
            with quiet_orbax():
                self._manager.wait_until_finished()
        except Exception as e:
            _IN_FLIGHT.discard(self._manager)
            self._raise_if_out_of_space(e)
            raise
        _IN_FLIGHT.discard(self._manager)
        # Only the writer tidies: another process's manager over the same directory (a reader)
        # must not delete what the writer's Orbax is moving there.
        if jax.process_index() == 0 and self._writer_lock is not None:
            atomic_dirs.delete_if_exists(os.path.join(self._shared, _DELETED_SUBDIR))

    def _raise_if_out_of_space(self, error: BaseException) -> None:
        if space.is_out_of_space(error):
            assert self._saving is not None  # called while a save is in flight
            # The partial files are the next save's to remove (_tidy), once Orbax is done.
            raise space.write_error(
                "CheckpointManager.save", self._path(self._saving), error, self._saving_bytes
            ) from None

    def close(self) -> None:
        """Waits for a save in flight, then gives back the directory's writer lock, so another
        process may save there (mirrax's; TF's manager has no close, Orbax's has). A later
        `save` takes the lock again."""
        self.wait_until_finished()
        if self._writer_lock is not None:
            writer_lock.release(self._writer_lock)
            self._writer_lock = None

    def _path(self, number: int) -> str:
        return os.path.join(self._shared, str(number))

    def _complete_numbers(self) -> list:
        """Numbers of the complete checkpoints, oldest first; the others logged and skipped."""
        self.wait_until_finished()
        with quiet_orbax():
            self._manager.reload()
            numbers = sorted(self._manager.all_steps())
        complete = []
        for number in numbers:
            if is_complete(self._path(number)):
                complete.append(number)
            else:
                _LOG.warning(
                    "mirrax: skipping %s: not a complete checkpoint (no %s).",
                    self._path(number),
                    METADATA_FILE,
                )
        return complete

    @property
    def checkpoints(self) -> list:
        """Paths of the kept complete checkpoints, oldest first (waits for a save in flight)."""
        return [self._path(n) for n in self._complete_numbers()]

    @property
    def latest_checkpoint(self) -> str | None:
        """Path of the newest complete checkpoint, or None when there is none (waits for a save
        in flight). Never a directory that is not a complete checkpoint."""
        numbers = self._complete_numbers()
        return self._path(numbers[-1]) if numbers else None

    def _tidy(self) -> None:
        """Before a save (none in flight): moves aside numbered directories that are not
        checkpoints (Orbax would count them as kept ones) and removes killed saves' leftovers."""
        if jax.process_index() == 0 and os.path.isdir(self._shared):
            atomic_dirs.delete_if_exists(os.path.join(self._shared, _DELETED_SUBDIR))
            for name in os.listdir(self._shared):
                full = os.path.join(self._shared, name)
                if ocp.path.step.TMP_DIR_SUFFIX in name or name.endswith(atomic_dirs.DELETING_SUFFIX):
                    _delete_leftover(full)
                elif name.isdigit() and os.path.isdir(full) and not is_complete(full):
                    aside = full + ".mirrax-incomplete"
                    atomic_dirs.delete_if_exists(aside)
                    _LOG.warning("mirrax: %s is not a complete checkpoint; renamed it %s.", full, aside)
                    atomic_dirs.rename(full, aside)
        atomic_dirs.barrier(f"mirrax_manager_tidy:{self._shared}")
        with quiet_orbax():
            self._manager.reload()

    def save(self, checkpoint_number: int | None = None) -> str | None:
        """Writes checkpoint number `checkpoint_number` (default: the checkpoint's save_counter
        after this save, as TF's), drops the oldest beyond `max_to_keep`, returns its path.

        Returns None when `checkpoint_interval` says it is too soon. With `async_save`, first
        waits for the previous save, then returns while this one is written. A number that
        exists is replaced atomically.

        The first save takes the directory's writer lock (`<directory>.mirrax-writer`, held
        until `close()` or until this manager is dropped; the chief's in a multi-worker job),
        so a second process cannot save there meanwhile.

        Raises:
          InvalidArgumentTypeError / InvalidArgumentError: `checkpoint_number` is not an int
            >= 0 (e.g. -1, 2.5, '3').
          LockedCheckpointError: another process holds the directory (the message names its
            pid and host); nothing was written.
          CheckpointWriteError: no space left (disk, quota or file size limit); the earlier
            checkpoints are unchanged and `save_counter` is as before the call.
        """
        checkpoint_number = argument_checks.count(
            "CheckpointManager.save", "checkpoint_number", checkpoint_number, 0, allow_none=True
        )
        if self._writer_lock is None:
            os.makedirs(self._shared, exist_ok=True)
            self._writer_lock = writer_lock.take(
                self._shared + writer_lock.SUFFIX, "CheckpointManager.save", self._shared
            )
            # `release` empties the token, so after close() this finalizer has nothing to do.
            weakref.finalize(self, writer_lock.release, self._writer_lock)
        self.wait_until_finished()
        self._tidy()
        last = self._manager.latest_step()
        if checkpoint_number is not None and self.checkpoint_interval is not None and last is not None:
            if checkpoint_number - last < self.checkpoint_interval:
                return None
        ckpt = self.checkpoint
        ckpt.save_counter += 1
        number = ckpt.save_counter if checkpoint_number is None else checkpoint_number
        path = self._path(number)
        save_args = orbax_save_args(ckpt)
        self._saving, self._saving_bytes = number, space.save_bytes(save_args)
        if number in self._manager.all_steps():
            # Orbax refuses an existing step; replace it as Checkpoint.save does.
            try:
                atomic_dirs.replace_atomically(
                    path,
                    lambda target: write_checkpoint(target, save_args, "CheckpointManager.save"),
                    is_complete,
                )
            except BaseException:
                ckpt.save_counter -= 1
                raise
            with quiet_orbax():
                self._manager.reload()
            self._stub()
            return path
        try:
            with quiet_orbax():
                self._manager.save(number, args=save_args, force=True)
            if not self.async_save:
                self.wait_until_finished()
        except Exception as e:
            ckpt.save_counter -= 1  # nothing was saved (as Checkpoint.save)
            if not isinstance(e, errors.CheckpointWriteError):
                self._raise_if_out_of_space(e)
            raise
        self._stub()
        if self.async_save:
            # Orbax registers no exit hook; without one a save in flight at exit is lost.
            _register_exit_hook()
            _IN_FLIGHT.add(self._manager)
        return path

    def _stub(self) -> None:
        """A non-chief worker with its own directory (TF's `workertemp_<i>`, which the
        tutorials delete after each save) gets a stub there, never the checkpoints."""
        if self._shared != self.directory:
            write_stub(self.directory, self._shared)

    def restore_or_initialize(self) -> str | None:
        """Restores the latest checkpoint and returns its path; with none, calls `init_fn`
        (if given) and returns None, as TF's."""
        latest = self.latest_checkpoint
        if latest is not None:
            self.checkpoint.restore(latest)
            return latest
        if self._init_fn is not None:
            self._init_fn()
        return None
