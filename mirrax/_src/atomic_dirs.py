"""Directories replaced atomically: a save writes beside the old directory, then swaps it in.

Checkpoints (checkpointing/) and exported artifacts (exporting/) are directories that a kill at
any moment of a save must leave readable, old or new. `replace_atomically` writes the new one
beside the old (`<path>.mirrax-new`) and swaps the two in one step (Linux's renameat2
RENAME_EXCHANGE), or, where the filesystem cannot, by two renames; `resolve` finds the directory
to read even when a kill fell between those two renames; `remove_tree` renames a directory aside
before deleting it, so no half-deleted directory is left under a name a reader looks at.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import shutil
import sys

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from mirrax import errors

_LOG = logging.getLogger("mirrax")

# Names beside a directory `path` while it is being replaced: the committed new one, the old
# one renamed aside (only where an atomic exchange is not available), and a directory being
# deleted. `resolve` knows the first two.
NEW_SUFFIX = ".mirrax-new"
OLD_SUFFIX = ".mirrax-old"
DELETING_SUFFIX = ".mirrax-deleting"


def checked_path(path, what: str) -> str:
    """`path` (str, bytes or os.PathLike) as an absolute str path.

    Raises:
      InvalidArgumentTypeError: `path` is not a str or os.PathLike.
      InvalidArgumentError: `path` is empty (`''` would resolve to the working directory).
    """
    if not isinstance(path, (str, os.PathLike)):
        raise errors.InvalidArgumentTypeError(
            f"{what}: the path must be a str or os.PathLike; received {path!r} of type "
            f"{type(path).__name__}. Pass a directory path, e.g. '/tmp/ckpt'."
        )
    path = os.fspath(path)
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    if not path:
        raise errors.InvalidArgumentError(
            f"{what}: the path is empty (received {path!r}); pass a directory path, e.g. '/tmp/ckpt'."
        )
    return os.path.abspath(path)


def barrier(name: str) -> None:
    """Waits until every process reaches the barrier `name` (a no-op in one process), as
    jax.experimental.multihost_utils.sync_global_devices."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def exchange(a: str, b: str) -> bool:
    """Swaps two directories in one step (Linux renameat2 RENAME_EXCHANGE); False where the
    platform or filesystem cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):  # glibc before 2.28, or another libc
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    renameat2.restype = ctypes.c_int
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM, errno.EXDEV):
        return False
    raise OSError(code, os.strerror(code), a)


def rename(src: str, dst: str) -> None:
    """`os.rename`; one name for every rename of a replace, so the kill tests can stop a save
    between two renames (tests/test_checkpoint_atomic.py)."""
    os.rename(src, dst)


def remove_tree(path: str) -> None:
    """Deletes a directory: first renamed out of the way (one atomic step), so a kill during
    the deletion never leaves a half-deleted directory under a name a restore would read."""
    if not os.path.lexists(path):
        return
    doomed = path if path.endswith(DELETING_SUFFIX) else path + DELETING_SUFFIX
    if doomed != path:
        if os.path.lexists(doomed):
            delete(doomed)
        rename(path, doomed)
    delete(doomed)


def delete(path: str) -> None:
    """Deletes a file or a directory tree (a symlink itself, never its target).

    Raises:
      OSError: as `shutil.rmtree` / `os.remove` (e.g. FileNotFoundError if `path` is gone).
    """
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.remove(path)


def delete_if_exists(path: str) -> None:
    """`delete(path)` if anything (even a broken symlink) is at `path`."""
    if os.path.lexists(path):
        delete(path)


def leftovers(path: str) -> list:
    """Names beside `path` that an interrupted save may have left (never `path` itself)."""
    parent, base = os.path.split(path)
    try:
        names = os.listdir(parent)
    except FileNotFoundError:
        return []
    prefixes = (
        base + NEW_SUFFIX,
        base + OLD_SUFFIX,
        base + DELETING_SUFFIX,
        base + ocp.path.step.TMP_DIR_SUFFIX,
    )
    return [os.path.join(parent, n) for n in names if n.startswith(prefixes)]


def finish_interrupted_replace(path: str, complete) -> None:
    """Completes a replacement killed between its two renames, then removes the leftovers."""
    new, old = path + NEW_SUFFIX, path + OLD_SUFFIX
    if not os.path.lexists(path):
        for candidate in (new, old):
            if os.path.isdir(candidate) and complete(candidate):
                _LOG.warning(
                    "mirrax: %s was missing (a save was interrupted); restored %s in its place.",
                    path,
                    candidate,
                )
                rename(candidate, path)
                break
    for leftover in leftovers(path):
        delete(leftover)


def replace_atomically(path: str, write, complete, collective: bool = True) -> None:
    """Writes a directory at `path` with `write(target)`, replacing any old one atomically.

    `write(target)` must leave `target` complete or absent (Orbax commits by rename; export's
    writer does the same). The new directory is written beside the old one, then swapped in:
    with one exchange where the filesystem has it, else by renaming the old one aside and the
    new one in (a kill between the two leaves `path` missing; `resolve` then reads the new
    or the old one from beside it, and the next save completes the swap). With `collective`,
    every process calls this (Orbax writes from each) and only process 0 renames and deletes;
    without, only the calling process is involved (export, which only process 0 writes).
    """
    chief = jax.process_index() == 0 or not collective
    new, old = path + NEW_SUFFIX, path + OLD_SUFFIX
    if chief:
        finish_interrupted_replace(path, complete)
    if collective:
        barrier(f"mirrax_replace_prepare:{path}")
    write(new)
    if chief:
        if not os.path.isdir(path):
            rename(new, path)
        elif exchange(new, path):
            remove_tree(new)  # now the old checkpoint
        else:
            rename(path, old)
            rename(new, path)
            remove_tree(old)
    if collective:
        barrier(f"mirrax_replace_commit:{path}")


def resolve(path: str, what: str, complete, missing=None) -> str:
    """The directory to read for `path`: `path` itself, or, when a save was interrupted
    between its two renames, the complete new (else old) directory beside it (logged)."""
    if os.path.lexists(path) and not os.path.isdir(path):
        raise errors.InvalidCheckpointError(
            f"{what}: {path} is a file, not a checkpoint directory. Pass the directory that "
            "Checkpoint.save / Model.save_weights / mirrax.export wrote."
        )
    if os.path.isdir(path):
        return path
    for candidate in (path + NEW_SUFFIX, path + OLD_SUFFIX):
        if os.path.isdir(candidate) and complete(candidate):
            _LOG.warning(
                "mirrax: %s is missing (a save was interrupted while replacing it); reading %s instead.",
                path,
                candidate,
            )
            return candidate
    raise errors.MissingCheckpointError(
        missing
        or f"{what}: no checkpoint directory at {path}; write one with "
        "Checkpoint.write(path), Checkpoint.save(prefix) or CheckpointManager.save()."
    )
