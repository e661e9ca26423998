"""`mirrax.train.latest_checkpoint` and `checkpoints_iterator`, and the `checkpoint` state file
that `Checkpoint.save` writes beside its numbered checkpoints, as tf.train's.

TF's `Checkpoint.save(prefix)` records its newest save in `<dir>/checkpoint` (a text proto:
`model_checkpoint_path: "ckpt-2"`); `latest_checkpoint(dir)` reads it, and returns None when there
is none. The file is replaced atomically (written beside, then renamed) AFTER the checkpoint is
committed, so it never names a half-written checkpoint. `CheckpointManager` keeps Orbax's layout
(`<dir>/<n>`) and writes no state file; `latest_checkpoint` of such a directory is its newest
complete numbered checkpoint.
"""

from __future__ import annotations

import os
import re
import time

import jax

from mirrax import errors
from mirrax._src import atomic_dirs
from mirrax._src.checkpointing.directory import is_complete

# TF's name for the state file (tf.train.latest_checkpoint's default latest_filename).
STATE_FILE = "checkpoint"

_MODEL_PATH = re.compile(r'^model_checkpoint_path:\s*"((?:[^"\\]|\\.)*)"\s*$', re.MULTILINE)


def _quote(path: str) -> str:
    return path.replace("\\", "\\\\").replace('"', '\\"')


def update_state(save_dir: str, path: str) -> None:
    """Records `path` (a committed checkpoint in `save_dir`) as the newest, as TF's
    `Checkpoint.save` does (all_model_checkpoint_paths holds only it). Process 0 writes."""
    if jax.process_index() != 0:
        return
    relative = os.path.relpath(path, save_dir)
    text = f'model_checkpoint_path: "{_quote(relative)}"\nall_model_checkpoint_paths: "{_quote(relative)}"\n'
    target = os.path.join(save_dir, STATE_FILE)
    tmp = target + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    atomic_dirs.rename(tmp, target)


def _checked_dir(checkpoint_dir, what: str) -> str:
    if not isinstance(checkpoint_dir, (str, os.PathLike)):
        raise errors.InvalidArgumentTypeError(
            f"{what}: checkpoint_dir must be a str or os.PathLike; received {checkpoint_dir!r} "
            f"of type {type(checkpoint_dir).__name__}. Pass the directory the checkpoints are "
            "saved in, e.g. '/tmp/ckpt'."
        )
    path = atomic_dirs.checked_path(checkpoint_dir, what)
    if os.path.lexists(path) and not os.path.isdir(path):
        raise errors.InvalidArgumentError(
            f"{what}: {path} is a file, not a directory of checkpoints. Pass the directory "
            "(e.g. os.path.dirname of the path Checkpoint.save returned)."
        )
    return path


def latest_checkpoint(checkpoint_dir) -> str | None:
    """The newest complete checkpoint in `checkpoint_dir`, as `tf.train.latest_checkpoint`.

    The path the `checkpoint` state file names (written by `Checkpoint.save`: `<dir>/ckpt-3`);
    without one, the newest complete checkpoint of a `CheckpointManager` in that directory
    (`<dir>/3`); None when there is neither, or the recorded one is not complete, as TF's.

    Returns:
      An absolute path, or None.

    Raises:
      InvalidArgumentTypeError: `checkpoint_dir` is not a str or os.PathLike.
      InvalidArgumentError: `checkpoint_dir` is a file (TF returns None; a file here is a
        mistake worth naming).
    """
    path = _checked_dir(checkpoint_dir, "latest_checkpoint")
    if not os.path.isdir(path):
        return None
    state = os.path.join(path, STATE_FILE)
    if os.path.isfile(state):
        with open(state) as f:
            found = _MODEL_PATH.search(f.read())
        if found is None:
            return None
        recorded = re.sub(r"\\(.)", r"\1", found.group(1))
        full = os.path.normpath(os.path.join(path, recorded))
        return full if os.path.isdir(full) and is_complete(full) else None
    numbers = sorted(int(n) for n in os.listdir(path) if n.isdigit() and is_complete(os.path.join(path, n)))
    return os.path.join(path, str(numbers[-1])) if numbers else None


def _check_seconds(value, name: str, allow_none: bool):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise errors.InvalidArgumentError(
            f"checkpoints_iterator: {name} must be a number of seconds >= 0"
            f"{' or None' if allow_none else ''}; received {value!r}."
        )
    return float(value)


def wait_for_new_checkpoint(
    checkpoint_dir, last_checkpoint=None, seconds_to_sleep: float = 1, timeout: float | None = None
) -> str | None:
    """Waits until `latest_checkpoint(checkpoint_dir)` differs from `last_checkpoint`, as
    `tf.train.wait_for_new_checkpoint`; None once `timeout` seconds have passed."""
    stop = None if timeout is None else time.time() + timeout
    while True:
        path = latest_checkpoint(checkpoint_dir)
        if path is not None and path != last_checkpoint:
            return path
        if stop is not None and time.time() + seconds_to_sleep > stop:
            return None
        time.sleep(seconds_to_sleep)


def checkpoints_iterator(
    checkpoint_dir, min_interval_secs: float = 0, timeout: float | None = None, timeout_fn=None
):
    """Yields each new checkpoint path in `checkpoint_dir`, as `tf.train.checkpoints_iterator`.

    Polls `latest_checkpoint` once a second. After a yield, waits until `min_interval_secs`
    have passed since it (so checkpoints written meanwhile but superseded are skipped). When no
    new checkpoint appears within `timeout` seconds: stops if `timeout_fn` is None, else calls
    it and stops if it returns True, else keeps waiting (TF's rule).

    Raises:
      InvalidArgumentTypeError / InvalidArgumentError: as `latest_checkpoint`, at the first
        poll; a negative or non-numeric `min_interval_secs` / `timeout`; `timeout_fn` not
        callable.
    """
    _checked_dir(checkpoint_dir, "checkpoints_iterator")
    min_interval_secs = _check_seconds(min_interval_secs, "min_interval_secs", False)
    timeout = _check_seconds(timeout, "timeout", True)
    if timeout_fn is not None and not callable(timeout_fn):
        raise errors.InvalidArgumentTypeError(
            f"checkpoints_iterator: timeout_fn must be a function or None; received {timeout_fn!r}."
        )
    return _iterate(checkpoint_dir, min_interval_secs, timeout, timeout_fn)


def _iterate(checkpoint_dir, min_interval_secs, timeout, timeout_fn):
    path = None
    while True:
        new = wait_for_new_checkpoint(checkpoint_dir, path, timeout=timeout)
        if new is None:
            if timeout_fn is None or timeout_fn():
                return
            continue
        start = time.time()
        path = new
        yield path
        remaining = start + min_interval_secs - time.time()
        if remaining > 0:
            time.sleep(remaining)
