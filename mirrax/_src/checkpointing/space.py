"""A save that fails for lack of space becomes one clear `CheckpointWriteError`.

TensorStore reports a full disk, a full quota or a file size limit (`ulimit -f`) as Orbax's
`ValueError: OUT_OF_RANGE ... File too large` / `No space left on device`, after Orbax's
threads have logged the same error with its traceback (quiet_orbax drops those: the error
itself reaches the caller). The new checkpoint is written beside the old one and swapped in
only when complete, so the old one is unchanged. The failed write's partial files are left to
the next save, which removes them before it writes: removing them at once raced with Orbax's
writer threads still running (one in four runs logged their FileNotFoundError traceback).
"""

from __future__ import annotations

import errno
import os
import shutil

import jax
import numpy as np

from mirrax import errors
from mirrax._src.checkpointing import orbax_quiet

# The errno codes and TensorStore's words for "no room to write".
_CODES = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
_WORDS = ("No space left on device", "File too large", "Disk quota exceeded")


def is_out_of_space(error: BaseException) -> bool:
    """Whether `error` (or an error it wraps) says the disk, a quota or a size limit is full."""
    seen = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, OSError) and cause.errno in _CODES:
            return True
        if any(word in str(cause) for word in _WORDS):
            return True
        cause = cause.__cause__ or cause.__context__
    return False


def _megabytes(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


def save_bytes(save_args) -> int:
    """The bytes of the arrays in an Orbax composite save (what the checkpoint needs)."""
    return int(
        sum(
            np.prod(np.shape(a)) * np.dtype(a.dtype).itemsize
            for name in save_args.keys()
            for a in jax.tree.leaves(save_args[name].item)
            if hasattr(a, "dtype")
        )
    )


def write_error(what: str, target: str, error: BaseException, needed: int) -> errors.CheckpointWriteError:
    """The CheckpointWriteError for a save of `needed` bytes to `target` that ran out of space
    (what Orbax's threads still log about that save is silenced: `orbax_quiet.abandon`)."""
    orbax_quiet.abandon(target)
    parent = target
    while parent and not os.path.isdir(parent):
        parent = os.path.dirname(parent)
    try:
        free = f"{_megabytes(shutil.disk_usage(parent).free)} free on its filesystem"
    except OSError:
        free = "its filesystem's free space unknown"
    words = next((w for w in _WORDS if w in str(error)), None) or os.strerror(
        getattr(error, "errno", None) or errno.ENOSPC
    )
    return errors.CheckpointWriteError(
        f"{what}: could not write the checkpoint {target}: {words} (the disk or a quota is "
        f"full, or a file size limit such as `ulimit -f` was hit). It needs about "
        f"{_megabytes(needed)} of arrays; {free}. Nothing was replaced: the checkpoint that "
        "was there before is unchanged; the next save first removes this one's partial files. "
        "Free some space (e.g. keep fewer checkpoints: CheckpointManager(max_to_keep=...)) or "
        "save elsewhere, then save again."
    )
