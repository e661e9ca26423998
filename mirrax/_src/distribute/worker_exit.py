"""`sys.exit(status)` with a failure status in a multi-worker job: the worker exits at once.

A normal exit would first wait in jax.distributed's shutdown barrier for the peers, which are
blocked in their next collective waiting for this worker: a hang of minutes (300 s), after
which the launcher blames whichever worker the coordination service aborted. `SystemExit`
never reaches `sys.excepthook` (multi_worker.py's exit-at-once hook), so `sys.exit` itself is
wrapped when the strategy joins the job; `sys.exit()` and `sys.exit(0)` exit as before.
"""

from __future__ import annotations

import os
import sys

import jax


def exit_at_once_on_failure(previous):
    """`sys.exit` for a worker of a multi-worker job: a status other than None and 0 (an int,
    or any other object, printed as Python prints it, status 1) flushes the streams and ends
    the process at once with that status; otherwise `previous(status)`."""

    def exit(status=None):  # noqa: A001  (it replaces sys.exit)
        if status is None or status == 0:
            previous(status)
            return
        code = status if isinstance(status, int) and not isinstance(status, bool) else 1
        if code == status:
            why = f"sys.exit({status})"
        else:
            print(status, file=sys.stderr)  # as Python prints a non-int status
            why = "sys.exit with a message"
        print(
            f"mirrax: worker {jax.process_index()} called {why}; exiting now with status {code}, so "
            "that no peer waits for it in jax.distributed's shutdown barrier.",
            file=sys.stderr,
            flush=True,
        )
        sys.stdout.flush()
        os._exit(code & 0xFF)

    return exit
