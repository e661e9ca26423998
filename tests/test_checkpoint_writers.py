"""Files and processes: two processes saving to one place, a writer killed while it holds the
place, and a save that runs out of space.

A save takes an owner file (flock) in the manager's directory or beside the checkpoint path;
another process's save is refused with the owner's pid and host (mirrax.errors.
LockedCheckpointError), a killed owner's file is taken over. A write that runs out of space is
one CheckpointWriteError and the previous checkpoint restores bit-exact. The other process is
a child (`_CHILD`), driven line by line over stdin.
"""

import fcntl
import json
import logging
import os
import re
import select
import signal
import socket
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mirrax
from mirrax import errors
from tests.multiworker import harness

pytestmark = pytest.mark.subprocess

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The child owns `<dir>/run` (a CheckpointManager) and the prefix `<dir>/tf/ckpt`
# (Checkpoint.save). "save" saves step values + 1 (so checkpoint n holds arange(4) + n - 1);
# "block" starts a save that stops after handing its first array to TensorStore; EOF exits.
_CHILD = textwrap.dedent(
    """
    import os, sys, threading
    os.environ["JAX_PLATFORMS"] = "cpu"
    sys.path.insert(0, {repo!r})
    import jax.numpy as jnp
    from flax import nnx
    from orbax.checkpoint._src.serialization import serialization
    import mirrax

    step = nnx.Variable(jnp.arange(4.0))
    ckpt = mirrax.Checkpoint(step=step)
    manager = mirrax.CheckpointManager(ckpt, os.path.join(sys.argv[1], "run"), max_to_keep=None)
    ckpt.save(os.path.join(sys.argv[1], "tf", "ckpt"))
    ckpt.save_counter = 0
    print("SAVED", manager.save(), flush=True)
    for line in sys.stdin:
        if line.strip() == "block":
            original = serialization.async_serialize_from_host
            async def serialize(*args, **kwargs):
                result = await original(*args, **kwargs)
                print("BLOCKED", flush=True)
                threading.Event().wait()  # until SIGKILL
            serialization.async_serialize_from_host = serialize
        step[...] = step[...] + 1
        print("SAVED", manager.save(), flush=True)
    """
)


class _Child:
    def __init__(self, directory, log):
        self.log = open(log, "w")  # stderr to a file: a full pipe would stall the child
        self.process = subprocess.Popen(
            [sys.executable, "-c", _CHILD.format(repo=_REPO), str(directory)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )

    def line(self) -> str:
        # A generous bound only so that a broken child fails the test instead of hanging it.
        ready, _, _ = select.select([self.process.stdout], [], [], 240)
        line = self.process.stdout.readline().strip() if ready else ""
        if not line:
            self.process.kill()
            raise AssertionError(f"the child stopped: {open(self.log.name).read()[-3000:]}")
        return line

    def send(self, command: str) -> str:
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return self.line()

    def close(self) -> int:
        self.process.stdin.close()
        code = self.process.wait(120)
        self.process.stdout.close()
        self.log.close()
        return code


def _step_of(path) -> list:
    ckpt = mirrax.Checkpoint(step=nnx.Variable(jnp.zeros(4)))
    ckpt.restore(path)
    return np.asarray(ckpt.step.get_value()).tolist()


def test_a_second_process_saving_to_the_same_directory_is_refused_every_time(tmp_path):
    child = _Child(tmp_path, tmp_path / "child.log")
    try:
        assert child.line() == f"SAVED {tmp_path}/run/1"
        pid, host = child.process.pid, socket.gethostname()
        ckpt = mirrax.Checkpoint(step=nnx.Variable(jnp.zeros(4)))
        mine = mirrax.CheckpointManager(ckpt, tmp_path / "run")
        for n in (2, 3, 4):
            with pytest.raises(errors.LockedCheckpointError) as refused:
                mine.save()
            # The child saves on between our refusals: it is never disturbed.
            assert child.send("save") == f"SAVED {tmp_path}/run/{n}"
        message = str(refused.value)
        for fragment in (
            f"CheckpointManager.save: another process is writing to {tmp_path}/run",
            f"process {pid} on host {host!r} (CheckpointManager.save, since",
            "nothing was written",
            "Save to another path",
            "or call close() on its CheckpointManager",
            f"{tmp_path}/run.mirrax-writer",
        ):
            assert fragment in message, message
        with pytest.raises(errors.LockedCheckpointError, match=f"process {pid} on host"):
            mirrax.Checkpoint(step=nnx.Variable(jnp.zeros(4))).save(tmp_path / "tf" / "ckpt")
        # Reading while the other process writes is allowed.
        assert mine.latest_checkpoint == f"{tmp_path}/run/4"
    finally:
        assert child.close() == 0
    # The child exited: its owner files are gone and we may save, after resuming (TF's way).
    assert sorted(os.listdir(tmp_path / "run")) == ["1", "2", "3", "4"]
    assert not os.path.exists(tmp_path / "tf" / "ckpt.mirrax-writer")
    assert mine.restore_or_initialize() == f"{tmp_path}/run/4"
    assert mine.save() == f"{tmp_path}/run/5"
    # Nothing lost: the child's checkpoint n holds arange(4) + (n - 1); ours (5) restored 4's.
    for n in range(1, 5):
        assert _step_of(f"{tmp_path}/run/{n}") == [n - 1.0, n, n + 1.0, n + 2.0]
    assert _step_of(f"{tmp_path}/run/5") == [3.0, 4.0, 5.0, 6.0]


def test_a_writer_killed_during_a_save_leaves_a_lock_the_next_writer_takes_over(tmp_path, caplog):
    child = _Child(tmp_path, tmp_path / "child.log")
    try:
        assert child.line() == f"SAVED {tmp_path}/run/1"
        assert child.send("block") == "BLOCKED"  # checkpoint 2 half-written
        child.process.send_signal(signal.SIGKILL)
    finally:
        child.process.wait(60)
        child.process.stdout.close()
        child.log.close()
    lock = tmp_path / "run.mirrax-writer"
    assert json.loads(lock.read_text())["pid"] == child.process.pid  # stale, left behind
    ckpt = mirrax.Checkpoint(step=nnx.Variable(jnp.zeros(4)))
    manager = mirrax.CheckpointManager(ckpt, tmp_path / "run")
    assert manager.restore_or_initialize() == f"{tmp_path}/run/1"  # 2 was never committed
    with caplog.at_level(logging.WARNING, logger="mirrax"):
        assert manager.save() == f"{tmp_path}/run/2"
    assert f"took over {lock} from process {child.process.pid} on host" in caplog.text
    assert json.loads(lock.read_text())["pid"] == os.getpid()
    assert _step_of(f"{tmp_path}/run/1") == [0.0, 1.0, 2.0, 3.0]
    assert _step_of(f"{tmp_path}/run/2") == [0.0, 1.0, 2.0, 3.0]  # restored 1, saved again
    manager.close()
    assert not lock.exists()


def _hold_as_another_process(lock_path):
    """An flock on `lock_path` through its own open file (flock conflicts between open files,
    even in one process), with another process's owner record."""
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(
        fd,
        json.dumps(
            {
                "pid": 4242,
                "host": "trainer-7",
                "what": "Checkpoint.write",
                "since": "2026-12-02T20:00:00+00:00",
            }
        ).encode(),
    )
    return fd


def test_write_while_another_writes_is_refused_and_close_releases_the_directory(tmp_path):
    fd = _hold_as_another_process(tmp_path / "ckpt.mirrax-writer")
    try:
        with pytest.raises(
            errors.LockedCheckpointError,
            match="process 4242 on host 'trainer-7' \\(Checkpoint.write, since "
            "2026-12-02T20:00:00\\+00:00\\)",
        ):
            mirrax.Checkpoint(step=1).write(tmp_path / "ckpt")
    finally:
        os.close(fd)
    assert sorted(os.listdir(tmp_path)) == ["ckpt.mirrax-writer"]  # nothing written
    mirrax.Checkpoint(step=1).write(tmp_path / "ckpt")  # released: the next write goes ahead
    assert not (tmp_path / "ckpt.mirrax-writer").exists()  # a write holds it while it writes
    # Two managers of one process over one directory do not refuse each other; close() of
    # both gives the directory back to other processes.
    first = mirrax.CheckpointManager(mirrax.Checkpoint(step=1), tmp_path / "run")
    second = mirrax.CheckpointManager(mirrax.Checkpoint(step=2), tmp_path / "run")
    first.save()
    second.save(checkpoint_number=7)
    first.close()
    with pytest.raises(BlockingIOError):  # still held by `second`
        os.close(_hold_as_another_process(tmp_path / "run.mirrax-writer"))
    second.close()
    os.close(_hold_as_another_process(tmp_path / "run.mirrax-writer"))


# A process whose files may not grow past 20000 bytes (`ulimit -f`: how "File too large"
# arises, as on a full disk). It writes a checkpoint and a manager's checkpoint 1 unlimited,
# then tries both again with other values under the limit.
_FULL = textwrap.dedent(
    """
    import json, os, resource, signal, sys
    os.environ["JAX_PLATFORMS"] = "cpu"
    sys.path.insert(0, {repo!r})
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills the writer
    import jax.numpy as jnp
    from flax import nnx
    import mirrax

    out, errors = sys.argv[1], {{}}
    model = nnx.Linear(256, 256, rngs=nnx.Rngs(0))  # 256 * 256 * 4 + 256 * 4 = 263,168 bytes
    ckpt = mirrax.Checkpoint(model=model)
    ckpt.write(os.path.join(out, "c"))
    manager = mirrax.CheckpointManager(ckpt, os.path.join(out, "run"))
    manager.save()
    model.kernel[...] = model.kernel[...] + 1.0
    resource.setrlimit(resource.RLIMIT_FSIZE, (20000, resource.RLIM_INFINITY))
    for name, save in (("write", lambda: ckpt.write(os.path.join(out, "c"))),
                       ("manager", manager.save)):
        try:
            save()
        except mirrax.errors.CheckpointWriteError as e:
            errors[name] = [type(e).__name__, isinstance(e, OSError), str(e)]
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    errors["next"] = manager.save()  # the failed save took no number
    print(json.dumps(errors))
    """
)


def test_a_save_that_runs_out_of_space_is_one_clear_error_and_the_old_checkpoint_stays(tmp_path):
    # Without the suite's compilation cache: under the 20,000-byte file limit its writes fail too,
    # and with it (faster compiles) Orbax's metadata thread sometimes logs a traceback after the
    # partial directory is gone (1 run in 4 here; a race the closing note of issue 29 records).
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    done = subprocess.run(
        [sys.executable, "-c", _FULL.format(repo=_REPO), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]  # was ~115 lines of them
    caught = json.loads(done.stdout.strip().splitlines()[-1])
    assert caught["next"] == f"{tmp_path}/run/2"
    for name, path in (("write", f"{tmp_path}/c"), ("manager", f"{tmp_path}/run/2")):
        kind, is_os_error, message = caught[name]
        assert (kind, is_os_error) == ("CheckpointWriteError", True)
        for fragment in (
            f"could not write the checkpoint {path}: File too large",
            "It needs about 0.3 MB of arrays",  # 263,168 bytes
            "MB free on its filesystem",
            "the checkpoint that was there before is unchanged",
            "the next save first removes this one's partial files",
            "Free some space",
            "or save elsewhere",
        ):
            assert fragment in message, message
    # The checkpoints written before the limit restore bit-exact (the model's initial values).
    initial = nnx.Linear(256, 256, rngs=nnx.Rngs(0))
    assert mirrax.train.latest_checkpoint(tmp_path / "run") == f"{tmp_path}/run/2"
    for path in (tmp_path / "c", tmp_path / "run" / "1"):
        restored = mirrax.Checkpoint(model=nnx.Linear(256, 256, rngs=nnx.Rngs(1)))
        restored.restore(path)
        assert np.array_equal(np.asarray(restored.model.kernel[...]), np.asarray(initial.kernel[...]))
    # The next saves (unlimited) remove the partial files; the locks were released.
    assert sorted(os.listdir(tmp_path / "run")) == ["1", "2"]
    mirrax.Checkpoint(model=initial).write(tmp_path / "c")
    assert sorted(os.listdir(tmp_path)) == ["c", "run"]


def test_a_second_multi_worker_strategy_trains_and_saves_and_the_chief_holds_the_lock(tmp_path):
    # One launch (2 workers x 2 devices, tests/multiworker/files_procs.py): two strategies one
    # after the other in each process, each fit / a distributed dataset pass / a manager save.
    chief, worker = harness.run(
        "second_strategy",
        tmp_path,
        num_workers=2,
        cpu_devices=2,
        timeout=300,
        env={"MIRRAX_TEST_TIMEOUT": "60"},
    )
    for name in ("first", "second"):
        a, b = chief[name], worker[name]
        assert a["path"] == b["path"] == f"{tmp_path}/{name}/1"
        assert a["loss"] == b["loss"] and a["weights"] == b["weights"]
        assert a["seen"] + b["seen"] == 32  # 4 batches of 8, each example on one worker
        # The job's lock is the chief's (process 0), released by close().
        assert a["lock_owner"] == chief["pid"] and a["lock_released"] is True
        assert b["lock_owner"] is None
    # The same program and data: the second strategy trains exactly as the first.
    assert chief["second"]["loss"] == chief["first"]["loss"]
    assert chief["second"]["weights"] == chief["first"]["weights"]


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs Linux's /proc")
def test_an_unwritable_path_is_named_not_its_owner_file():
    # Nothing can be created in /proc, even as root: the first file a save creates is the
    # owner file, whose raw FileNotFoundError named '/proc/ck.mirrax-writer'.
    checkpoint = mirrax.Checkpoint(step=nnx.Variable(jnp.asarray(1)))
    for save, shown in (
        (
            lambda: checkpoint.write("/proc/ck"),
            "Checkpoint.write: cannot write /proc/ck: No such file or directory",
        ),
        (
            lambda: checkpoint.save("/proc/ck"),
            "Checkpoint.save: cannot write /proc/ck-<n>: No such file or directory",
        ),
    ):
        with pytest.raises(errors.CheckpointWriteError, match=re.escape(shown)):
            save()
    assert checkpoint.save_counter == 0  # the failed save took no number
