"""Where a worker of `mirrax launch` is in `fit`, for the launcher to name when the worker dies.

The launcher creates one small file per worker and names it in the worker's
`MIRRAX_LAUNCH_PROGRESS`; `fit` writes (epoch, step) there before each step, through a memory
map (a store, no system call: about 1 µs a step), and clears it when it returns. The launcher
reads the file once the worker is gone, so no read races a write. Standard library only: the
launcher never imports JAX.
"""

from __future__ import annotations

import mmap
import os
import struct

ENV = "MIRRAX_LAUNCH_PROGRESS"
RESTART_COUNT_ENV = "MIRRAX_LAUNCH_RESTART_COUNT"
# Two little-endian int64s: the epoch (1-based, as Keras prints it; 0 outside fit) and the step
# of that epoch that was started (1-based; 0 at the epoch's start, before its first step).
_FORMAT = struct.Struct("<qq")
SIZE = _FORMAT.size


def create(path: str) -> None:
    """Writes `path` as the file of a worker that has not reached `fit` yet."""
    with open(path, "wb") as f:
        f.write(bytes(SIZE))


def read(path: str) -> tuple[int, int] | None:
    """(epoch, step), both 1-based, the worker was running when it stopped; None when it was
    not in `fit` (or the file is missing or short)."""
    try:
        with open(path, "rb") as f:
            data = f.read(SIZE)
    except OSError:
        return None
    if len(data) < SIZE:
        return None
    epoch, step = _FORMAT.unpack(data)
    return (epoch, step) if epoch > 0 else None


def restart_count() -> int:
    """How many times `mirrax launch --max-restarts` restarted this worker's group before this
    attempt (its `MIRRAX_LAUNCH_RESTART_COUNT`); 0 when not launched by it."""
    text = os.environ.get(RESTART_COUNT_ENV, "")
    return int(text) if text.isdigit() else 0


def describe(position: tuple[int, int] | None) -> str:
    """The words after a failed worker's cause: " at epoch E, step S", or " at the start of
    epoch E" before its first step; "" for an unknown position."""
    if position is None:
        return ""
    epoch, step = position
    return f" at the start of epoch {epoch}" if step == 0 else f" at epoch {epoch}, step {step}"


class Progress:
    """The writing side, in a worker: `mark` before each step, `clear` when fit returns."""

    def __init__(self, path: str):
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), SIZE)

    @classmethod
    def from_environment(cls) -> Progress | None:
        """The progress file `mirrax launch` named for this process, or None (not launched by
        it, or a file that cannot be opened: the launcher then names no position)."""
        path = os.environ.get(ENV)
        if not path:
            return None
        try:
            return cls(path)
        except (OSError, ValueError):
            return None

    def mark(self, epoch: int, step: int) -> None:
        """Records that step `step` (0-based; -1: the epoch's start) of epoch index `epoch`
        (0-based) starts."""
        _FORMAT.pack_into(self._map, 0, epoch + 1, step + 1)

    def clear(self) -> None:
        """Records that the worker is no longer in `fit`."""
        _FORMAT.pack_into(self._map, 0, 0, 0)
