"""What a Ray task process of this job wrote to its stderr before it died, read from the Ray
node's log files: a worker that crashes while it starts (a bad XLA flag, a failed import) is
restarted by Ray again and again, and without this the coordinator could only say that it did
not start in time.

Only this machine's logs are read (a local cluster, or the tasks of a remote one that run
here); elsewhere nothing is found and the caller says what it can without them.
"""

from __future__ import annotations

import glob
import os
import re

# Lines Ray itself writes at the top of a task process's stderr.
_RAY_HEADERS = (":job_id:", ":actor_name:", ":task_name:")
# The first lines of a crash that a message quotes.
QUOTED_LINES = 5
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def plain(text: str) -> str:
    """`text` without terminal colour codes (Ray colours what it writes)."""
    return _ANSI.sub("", text)


def _logs_dir() -> str | None:
    """The log directory of the newest Ray session of this machine, where Ray documents it
    (Ray has no public accessor for it): $RAY_TMPDIR or /tmp, then ray/session_latest/logs."""
    logs = os.path.join(os.environ.get("RAY_TMPDIR") or "/tmp", "ray", "session_latest", "logs")
    return logs if os.path.isdir(logs) else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def crashes_since(ray, since: float, exclude_pids=()) -> list[tuple[int, list[str]]]:
    """(pid, first lines of its stderr) of each process of this Ray job that started after
    `since` (a `time.time()`), has died, and wrote something to stderr; oldest first.

    `exclude_pids`: processes known not to be start-up crashes (tasks already answering)."""
    logs = _logs_dir()
    if logs is None:
        return []
    try:
        job = ray.get_runtime_context().get_job_id()
    except Exception:  # noqa: BLE001 - no job: nothing of ours to read
        return []
    found = []
    # Ray's log monitor moves the files of dead processes into old/.
    for path in glob.glob(os.path.join(logs, f"worker-*-{job}-*.err")) + glob.glob(
        os.path.join(logs, "old", f"worker-*-{job}-*.err")
    ):
        try:
            pid = int(path.rsplit("-", 1)[1].split(".", 1)[0])
            started = os.path.getmtime(path)
        except (ValueError, OSError):
            continue
        if started < since or pid in exclude_pids or _alive(pid):
            continue
        try:
            with open(path, errors="replace") as f:
                lines = [
                    plain(line).rstrip() for line in f if line.strip() and not line.startswith(_RAY_HEADERS)
                ]
        except OSError:
            continue
        if lines:
            found.append((started, pid, lines[:QUOTED_LINES]))
    return [(pid, lines) for _, pid, lines in sorted(found)]
