"""Silences the output of Orbax that mirrax's own checks make redundant, for mirrax's calls only.

Orbax logs absl warnings about conditions that mirrax reports as errors with the fix (or cleans
up before Orbax sees them), and after a failed read its in-flight TensorStore callbacks print
"Event loop is closed" tracebacks. Every mirrax call into Orbax runs under `quiet_orbax`, so a
save or a restore prints none of that (tests/test_checkpoint_quiet.py).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import re
import sys
import time
import warnings

# Orbax's absl warnings that mirrax's own checks make redundant (each is either a condition
# mirrax reports as an error with the fix, or one it cleans up before Orbax sees it).
_QUIET_ORBAX_MESSAGES = (
    "Metadata file does not exist",  # a directory that is no checkpoint: mirrax raises
    "Attempted to create temporary directory",  # a killed save's leftover: mirrax removes it
    'Item "%s" was found in the checkpoint, but could not',  # items a restore leaves unread
    "Failed to get item metadata from directory",  # damaged metadata: mirrax raises
    "Waiting for previous save to complete took",  # mirrax waits on purpose
    "Failed to json parse Metadata file",  # damaged metadata (an ERROR line): mirrax raises
)


# Logged (with its traceback) by Orbax's writer threads for an error that is then raised to
# the caller anyway: a save that ran out of space printed the same error two or three times,
# about 115 lines (mirrax raises it once, as a CheckpointWriteError).
_RERAISED_IN_CALLER = (
    "_SignalingThread.run() raised an exception",
    "Commit callback in background save thread",
    "Save Finalize thread (%s) failed",
)


class _OrbaxNoiseFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        return not (
            message.startswith(_QUIET_ORBAX_MESSAGES)
            or any(words in message for words in _RERAISED_IN_CALLER)
        )


_NOISE_FILTER = _OrbaxNoiseFilter()


@contextlib.contextmanager
def quiet_orbax():
    """Drops the known, redundant Orbax warnings for the duration of one mirrax call.

    Also installs (once) the filter of `ignore_closed_loop_callbacks` before Orbax starts any
    read: a failure can end Orbax's event loop while other reads are in flight at any stage
    (reading the item metadata, or the arrays), and their callbacks report right away.
    """
    ignore_closed_loop_callbacks()
    logger = logging.getLogger("absl")
    logger.addFilter(_NOISE_FILTER)
    try:
        yield
    finally:
        logger.removeFilter(_NOISE_FILTER)


# The targets of saves that failed out of space, each until a monotonic deadline: Orbax's writer
# threads for the save's other items may still run after mirrax raised the error, and when the
# next save removes the partial files their late writes fail and are logged with a traceback
# (one run in four of tests/test_checkpoint_writers.py's out-of-space test).
_ABANDONED: dict = {}
_ABANDONED_FOR_S = 120.0


class _AbandonedSaveFilter(logging.Filter):
    """Drops ERROR records (and their tracebacks) about a save mirrax already reported failed."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not _ABANDONED or record.levelno < logging.ERROR:
            return True
        now = time.monotonic()
        for path, deadline in list(_ABANDONED.items()):
            if deadline < now:
                _ABANDONED.pop(path, None)
        text = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            text += str(record.exc_info[1])
        return not any(path in text for path in _ABANDONED)


_ABANDONED_FILTER = _AbandonedSaveFilter()


def abandon(target: str) -> None:
    """Silences, for the next two minutes, what Orbax's threads still log about the failed save to
    `target` (a path: the checkpoint directory it was writing); its error reached the caller."""
    # absl: the writer threads' errors; asyncio: their futures' errors, never retrieved.
    for logger in (logging.getLogger("absl"), logging.getLogger("asyncio")):
        if _ABANDONED_FILTER not in logger.filters:
            logger.addFilter(_ABANDONED_FILTER)
    _ABANDONED[os.fspath(target)] = time.monotonic() + _ABANDONED_FOR_S


_UNRAISABLE_FILTER: list = []


def _orbax_coroutine_names() -> set:
    """The qualified names of the coroutine functions and methods of the loaded Orbax modules
    (the names Python's "never awaited" warning gives)."""
    names = set()
    for name, module in list(sys.modules.items()):
        if not name.startswith("orbax.") or module is None:
            continue
        for value in list(vars(module).values()):
            for item in [value] + list(vars(value).values()) if isinstance(value, type) else [value]:
                if inspect.iscoroutinefunction(item) and getattr(item, "__module__", "").startswith("orbax."):
                    names.add(item.__qualname__)
    return names


def _is_closed_loop_callback(unraisable) -> bool:
    error, tb = unraisable.exc_value, unraisable.exc_traceback
    code = getattr(unraisable.object, "cr_code", None)  # an abandoned Orbax read coroutine
    if code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename:
        return True
    if not (isinstance(error, RuntimeError) and str(error) == "Event loop is closed"):
        return False
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    # Raised by asyncio itself (BaseEventLoop._check_closed), not by user code.
    return (
        tb is not None
        and tb.tb_frame.f_code.co_name == "_check_closed"
        and tb.tb_frame.f_code.co_filename.endswith(os.path.join("asyncio", "base_events.py"))
    )


class _UnretrievedReadFilter(logging.Filter):
    """Drops asyncio's "Future (or Task) exception was never retrieved" for failed TensorStore
    reads."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not (
            str(record.msg).startswith(
                ("Future exception was never retrieved", "Task exception was never retrieved")
            )
            and error is not None
            and "tensorstore_spec" in str(error)
        )


def ignore_closed_loop_callbacks() -> None:
    """Drops the "Event loop is closed" tracebacks that follow a failed Orbax read.

    When one TensorStore read fails (a truncated file), Orbax's `asyncio.run` ends and closes
    its event loop while the other reads are still in flight; each of those later calls back
    into the closed loop (`loop.call_soon_threadsafe`) from a TensorStore thread, which reports
    the RuntimeError through `sys.unraisablehook` with no object, so Python prints a bare
    "Traceback ... RuntimeError: Event loop is closed" (no "Exception ignored" line; and, when
    an abandoned read coroutine of Orbax's is collected, "Exception ignored in: <coroutine
    ...>"), after or even before mirrax has raised its clear error. The hook (installed once,
    by `quiet_orbax` before Orbax's first call, chained to the current one) drops exactly
    those: a RuntimeError "Event loop is closed" raised inside asyncio's `_check_closed`, or
    an unraisable whose object is an Orbax coroutine. Everything else goes to the previous
    hook. The RuntimeWarning "coroutine ... was never awaited" of an Orbax read coroutine
    collected unstarted is ignored too.

    It used to be installed only after a failed array read, so the tracebacks of that first
    failure's in-flight reads, and of every failed metadata read, got through (measured: in
    each of 3 fresh processes doing 10 failed restores of a checkpoint whose files were all
    truncated to 10 bytes, 38 to 74 lines of traceback).
    """
    if _UNRAISABLE_FILTER:
        return
    # The sibling reads' futures and tasks, failed too and never awaited, are logged by asyncio
    # when collected ("Future/Task exception was never retrieved", with TensorStore's error).
    logging.getLogger("asyncio").addFilter(_UnretrievedReadFilter())
    # A sibling read whose task had not started when the loop closed is collected unstarted:
    # Python warns "coroutine '<its qualified name>' was never awaited" (seen in CI runs of
    # tests/test_checkpoint_quiet.py for '_read_array_index_and_device_put' and
    # 'Store._get_array_metadatas'): ignored for the names of Orbax's own coroutines only.
    names = sorted(map(re.escape, _orbax_coroutine_names()))
    warnings.filterwarnings(
        "ignore", category=RuntimeWarning, message=f"coroutine '({'|'.join(names)})' was never awaited"
    )
    previous = sys.unraisablehook

    def hook(unraisable):
        if not _is_closed_loop_callback(unraisable):
            previous(unraisable)

    sys.unraisablehook = hook
    _UNRAISABLE_FILTER.append(hook)
