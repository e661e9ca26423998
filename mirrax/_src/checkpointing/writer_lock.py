"""One writer per checkpoint path or `CheckpointManager` directory: an owner file held with flock.

Two processes saving to one place overwrite and delete each other's files (Orbax then fails deep
inside, or one's checkpoints silently replace the other's). A save first takes the owner file
(`<path>.mirrax-writer` beside a `Checkpoint` path or prefix, or beside a manager's directory:
Orbax's directory holds checkpoints only) with `flock(LOCK_EX | LOCK_NB)`; the file holds the
owner's pid, host and what it writes, so a refused writer is told who holds it. The kernel
releases an flock when its process dies, `kill -9` included, so a stale owner never blocks: the
next writer takes the file over (logged). The lock is per job: in a multi-worker run only the
chief (process 0) takes it, and a refusal is raised on every worker (none is left waiting in
Orbax's barriers). Within one process the lock is re-entrant (counted), so the process's own
objects never refuse each other.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import itertools
import json
import logging
import os
import socket

import jax

from mirrax import errors
from mirrax._src import launch_progress
from mirrax._src.distribute import multihost

_LOG = logging.getLogger("mirrax")

# The owner file's suffix: `<path>` + SUFFIX beside a Checkpoint path, prefix or manager directory.
SUFFIX = ".mirrax-writer"

# Lock path -> [file descriptor, holders in this process].
_HELD: dict = {}

# Collective takes are named by a count every process advances alike (saves are collective).
_EXCHANGES = itertools.count()

# Filesystems without flock (some network and FUSE mounts): saving goes on, unguarded.
_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


def _close_in_child() -> None:
    # A forked child (a data loader's worker) would keep the lock alive after this process
    # exits; closing its copies leaves the parent's lock as it is (flock counts descriptions).
    for fd, _ in _HELD.values():
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD.clear()


os.register_at_fork(after_in_child=_close_in_child)


def _read(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        return {}


def _describe(owner: dict) -> str:
    if not owner:
        return "a process that has not yet written its name (it is starting its save)"
    return (
        f"process {owner.get('pid')} on host {owner.get('host')!r} "
        f"({owner.get('what')}, since {owner.get('since')})"
    )


def _acquire(lock_path: str, what: str, target: str) -> str | None:
    """Takes `lock_path` for this process (re-entrant); the path, or None where the filesystem
    has no flock."""
    entry = _HELD.get(lock_path)
    if entry is not None:
        entry[1] += 1
        return lock_path
    while True:
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:  # the user's path cannot be written: name it, not the owner file
            raise errors.CheckpointWriteError(
                f"{what}: cannot write {target}: {e.strerror} (creating {lock_path}, the owner "
                "file beside it, failed). Save to a directory this process can write."
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            owner = _read(fd)
            os.close(fd)
            if e.errno in _UNSUPPORTED:
                _LOG.info(
                    "mirrax: %s: the filesystem has no flock; saving to %s without "
                    "guarding against a second writer.",
                    what,
                    target,
                )
                return None
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise errors.LockedCheckpointError(
                f"{what}: another process is writing to {target}: {_describe(owner)}. Two "
                "writers of one checkpoint path or manager directory overwrite and delete each "
                "other's checkpoints, so this save was refused and nothing was written. Save "
                "to another path (e.g. one directory per run), or end that process first (or "
                f"call close() on its CheckpointManager). Its owner file {lock_path} is "
                "released when it closes or exits, also when it is killed."
            ) from None
        # The owner may have released (and deleted) the file between our open and our flock.
        try:
            same = os.fstat(fd).st_ino == os.stat(lock_path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    stale = _read(fd)
    if stale:
        # A group restarted by `mirrax launch` takes over its earlier attempt's lock by design.
        (_LOG.info if launch_progress.restart_count() else _LOG.warning)(
            "mirrax: %s: took over %s from %s, which ended without releasing it (killed during a save?).",
            what,
            lock_path,
            _describe(stale),
        )
    mine = json.dumps(
        {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "what": what,
            "since": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        }
    )
    if os.fstat(fd).st_size:
        # Only a stale file is truncated: ext4 flushes a truncated-and-rewritten file on close
        # (auto_da_alloc), which made every take-and-release cost ~3 ms instead of ~0.1 ms.
        os.ftruncate(fd, 0)
    os.pwrite(fd, mine.encode(), 0)
    _HELD[lock_path] = [fd, 1]
    return lock_path


def take(lock_path: str, what: str, target: str) -> list:
    """Takes the writer lock `lock_path` for a save to `target`, for the whole job: process 0
    takes it, the others learn whether it could. Collective in a multi-process run.

    Returns:
      A token for `release` (on every process; empty where nothing was taken).

    Raises:
      LockedCheckpointError: another process holds it (on every process of the job).
      CheckpointWriteError: the owner file cannot be created (the path is not writable).
    """
    refusal, error = None, None
    held = None
    if jax.process_index() == 0:
        try:
            held = _acquire(lock_path, what, target)
        except (errors.LockedCheckpointError, errors.CheckpointWriteError) as e:
            refusal, error = (type(e).__name__, str(e)), e
    if jax.process_count() > 1:
        answers = multihost.exchange(f"checkpoint_lock/{next(_EXCHANGES)}", refusal)
        refusal = answers[0]
        if refusal is not None and error is None:
            kind, message = refusal
            error = getattr(errors, kind)(f"{what}: the chief (worker 0) refused: {message}")
    if error is not None:
        raise error
    return [held] if held else []


def release(token: list) -> None:
    """Gives back what `take` took (the owner file is deleted with the last holder)."""
    while token:
        lock_path = token.pop()
        entry = _HELD.get(lock_path)
        if entry is None:
            continue
        entry[1] -= 1
        if entry[1] == 0:
            del _HELD[lock_path]
            try:
                os.remove(lock_path)  # while still locked: no newcomer locks a doomed file
            except OSError:
                pass
            os.close(entry[0])
