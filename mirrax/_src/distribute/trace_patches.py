"""Attributes of other libraries replaced while a replica function is traced: one refcounted,
thread-safe install and restore, shared by `scan_carry` (jax.lax's loops) and `batch_stats`
(BatchNorm layers)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

_MISSING = object()


class TracePatches:
    """`active()` installs the `(owner, name, replacement)` triples `make()` lists when the
    first context opens and restores the originals when the last one closes (contexts nest,
    across threads too: the patched names are process-wide). `make` runs at each first
    install, so it may look at what is loaded then (Keras, say)."""

    def __init__(self, make: Callable[[], list]):
        self._make = make
        self._lock = threading.Lock()
        self._depth = 0
        self._installed: list = []

    @contextlib.contextmanager
    def active(self):
        with self._lock:
            self._depth += 1
            if self._depth == 1:
                for owner, name, replacement in self._make():
                    self._installed.append((owner, name, owner.__dict__.get(name, _MISSING)))
                    setattr(owner, name, replacement)
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0:
                    for owner, name, original in reversed(self._installed):
                        if original is _MISSING:
                            delattr(owner, name)
                        else:
                            setattr(owner, name, original)
                    self._installed.clear()
