"""A save killed part-way, a truncated data file, a planted pickle: what a restore then sees.

The kill is deterministic: the child process blocks itself at a chosen point inside the save
(Orbax's or mirrax's) and says so on stdout, and only then does the test SIGKILL it (no
sleeps, no races). Every kind of save (Checkpoint.save, save_weights, ModelCheckpoint,
BackupAndRestore, CheckpointManager, export) is killed at every moment of its replace.
"""

import os
import pickle
import select
import signal
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mirrax

pytestmark = [pytest.mark.subprocess, pytest.mark.xdist_group("checkpoint_atomic")]

# 8 arrays x 2**19 float32 = 16 MiB. The size only has to make a save more than one write;
# where the kill lands is fixed by the child blocking itself, not by how long writing takes.
_ARRAYS, _SIZE = 8, 2**19
_TMP = ".orbax-checkpoint-tmp"  # Orbax's suffix for a save in progress (orbax.checkpoint.path.step)
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _values(sign: float) -> dict:
    # Array i holds sign * (arange + 1e6 * i): every element differs, so a mix of two saves shows.
    return {f"w{i}": sign * (np.arange(_SIZE, dtype=np.float32) + 1e6 * i) for i in range(_ARRAYS)}


def _tracked(values: dict) -> dict:
    # jax.Arrays, as a model's state is (NumPy leaves take Orbax's NumPy handler instead).
    return {name: nnx.Variable(jnp.asarray(v)) for name, v in values.items()}


# The child: saves step 2 (values negated) into the manager directory, but first hooks Orbax so
# that the save stops at KILL_POINT, prints BLOCKED and waits to be killed:
#   "arrays":   after the first array of the step has been handed to TensorStore, before the
#               next (the serializer jax_array_handlers calls for each array);
#   "finalize": every array and all metadata written, just before Orbax writes
#               commit_success.txt and renames the temporary directory (the commit).
_CHILD = textwrap.dedent(
    """
    import os, sys, threading
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    sys.path.insert(0, {repo!r})
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from orbax.checkpoint._src.path import atomicity
    from orbax.checkpoint._src.serialization import serialization
    import mirrax

    printed, lock = [], threading.Lock()

    def block():
        with lock:  # several writer threads may get here; one line only
            if not printed:
                printed.append(1)
                print("BLOCKED", flush=True)
        threading.Event().wait()  # until SIGKILL

    kill_point = sys.argv[2]
    if kill_point == "arrays":
        original, calls = serialization.async_serialize_from_host, []
        async def serialize(*args, **kwargs):
            calls.append(1)
            if len(calls) > 1:
                block()
            return await original(*args, **kwargs)
        serialization.async_serialize_from_host = serialize
    else:
        async def finalize(self, *args, **kwargs):
            block()
        atomicity.AtomicRenameTemporaryPath.finalize = finalize

    values = {{f"w{{i}}": -(np.arange({size}, dtype=np.float32) + 1e6 * i) for i in range({n})}}
    ckpt = mirrax.Checkpoint(**{{k: nnx.Variable(jnp.asarray(v)) for k, v in values.items()}})
    manager = mirrax.CheckpointManager(ckpt, sys.argv[1])
    manager.save(checkpoint_number=2)
    print("SAVED", flush=True)  # never reached: the test fails if it is
    """
)


def _run_child_until_blocked(directory, kill_point: str, log) -> None:
    script = _CHILD.format(repo=_REPO, size=_SIZE, n=_ARRAYS)
    with open(log, "w") as err:  # stderr to a file: a full pipe would stall the child
        child = subprocess.Popen(
            [sys.executable, "-c", script, str(directory), kill_point],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
    try:
        # A generous bound only so that a broken hook fails the test instead of hanging it.
        ready, _, _ = select.select([child.stdout], [], [], 240)
        line = child.stdout.readline() if ready else ""
        if line.strip() != "BLOCKED":
            child.kill()
            raise AssertionError(f"child did not block in the save: {line!r}\n{open(log).read()}")
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait()
        child.stdout.close()
    assert child.returncode == -signal.SIGKILL


@pytest.mark.parametrize("kill_point", ["arrays", "finalize"])
def test_save_killed_part_way_leaves_previous_checkpoint_latest_and_intact(tmp_path, kill_point):
    directory = tmp_path / "run"
    step_1 = _values(1.0)
    manager = mirrax.CheckpointManager(mirrax.Checkpoint(**_tracked(step_1)), directory)
    manager.save(checkpoint_number=1)
    manager.close()  # the directory's writer lock, for the child (one writer at a time)

    _run_child_until_blocked(directory, kill_point, tmp_path / "child.log")

    # The kill landed inside the save: its temporary directory is there, step 2 is not.
    names = sorted(os.listdir(directory))
    assert "2" not in names and any(n.startswith("2" + _TMP) for n in names), names
    tmp_dir = directory / next(n for n in names if n.startswith("2" + _TMP))
    assert not (tmp_dir / "commit_success.txt").exists()  # Orbax writes it only when committing

    targets = _tracked({k: np.zeros_like(v) for k, v in step_1.items()})
    fresh = mirrax.Checkpoint(**targets)
    again = mirrax.CheckpointManager(fresh, directory)
    assert again.latest_checkpoint == str(directory / "1")
    assert again.checkpoints == [str(directory / "1")]
    assert again.restore_or_initialize() == str(directory / "1")
    assert fresh.save_counter == 1
    for name, want in step_1.items():
        np.testing.assert_array_equal(np.asarray(targets[name][...]), want)  # bit for bit

    # Pointed at the half-written directory by hand, restore refuses and names the fix; with
    # "finalize" every array in it is complete, so only its name tells it apart.
    with pytest.raises(ValueError, match=r"unfinished save .* Restore an earlier checkpoint"):
        fresh.restore(tmp_dir)
    for name, want in step_1.items():
        np.testing.assert_array_equal(np.asarray(targets[name][...]), want)  # untouched

    # Training resumes: saving step 2 again replaces the leftover temporary directory.
    assert again.save(checkpoint_number=2) == str(directory / "2")
    assert sorted(os.listdir(directory)) == ["1", "2"]


def _saved_checkpoint(tmp_path):
    values = np.arange(100_000, dtype=np.float32)  # 400,000 bytes: the largest file is its data
    path = mirrax.Checkpoint(w=nnx.Variable(jnp.asarray(values))).write(tmp_path / "ckpt")
    files = [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    data_file = max(files, key=os.path.getsize)
    assert f"{os.sep}d{os.sep}" in data_file, data_file  # an OCDBT data file of item "w"
    return path, data_file


def test_truncated_data_file_is_a_clear_error_naming_the_file_and_the_fix(tmp_path):
    path, data_file = _saved_checkpoint(tmp_path)
    size = os.path.getsize(data_file)
    os.truncate(data_file, size // 2)
    target = nnx.Variable(jnp.full(100_000, 7.0, jnp.float32))
    with pytest.raises(ValueError) as info:
        mirrax.Checkpoint(w=target).restore(path)
    message = str(info.value)
    assert f"checkpoint at {path}" in message
    assert "truncated or corrupt" in message
    assert f"{os.path.join(path, 'w')}" in message  # TensorStore's words: which item's files
    assert f"value of size {size // 2}" in message  # ... and how many bytes it found
    assert "Restore an earlier checkpoint" in message
    assert "TensorStore({" not in message  # not Orbax's pages of TensorStore spec
    np.testing.assert_array_equal(np.asarray(target[...]), 7.0)  # nothing was changed


class _Plant:
    """A pickle that, if ever unpickled, creates the file `sentinel` (a stand-in for any code)."""

    def __init__(self, sentinel):
        self.sentinel = str(sentinel)

    def __reduce__(self):
        return (open, (self.sentinel, "w"))


@pytest.mark.parametrize("replaced", ["data file", "_METADATA"])
def test_a_pickle_planted_in_a_checkpoint_is_never_unpickled(tmp_path, replaced):
    path, data_file = _saved_checkpoint(tmp_path)
    # The payload works: unpickling it does create its sentinel (so the check below can fail).
    probe = tmp_path / "probe"
    pickle.loads(pickle.dumps(_Plant(probe))).close()
    assert probe.exists()

    sentinel = tmp_path / "sentinel"
    victim = data_file if replaced == "data file" else os.path.join(path, "w", "_METADATA")
    with open(victim, "wb") as f:
        f.write(pickle.dumps(_Plant(sentinel)))
    target = nnx.Variable(jnp.full(100_000, 7.0, jnp.float32))
    with pytest.raises(ValueError, match=r"Restore an earlier checkpoint"):
        mirrax.Checkpoint(w=target).restore(path)
    assert not sentinel.exists()  # Orbax reads JSON and TensorStore chunks, never pickle
    np.testing.assert_array_equal(np.asarray(target[...]), 7.0)


# -- A kill at any moment of any kind of save (issue 11, defect 2) ------------------------------
#
# Each case: the test writes the OLD state with one kind of save, then a child process writes
# the NEW state with the same kind onto the same path, blocking itself at one moment of it;
# the test SIGKILLs it there and reads the path back the way a user would. The state is a
# ~100 MB model (8 arrays x 3.2M float32 = 102.4 MB) with BatchNorm, Dropout and nnx.Rngs
# (a typed and a legacy key), so the PRNG state is part of what must survive.

_BIG_ARRAYS, _BIG_SIZE = 8, 3_200_000
_X = np.linspace(-1.0, 1.0, 8, dtype=np.float32).reshape(4, 2)


class KillNet(nnx.Module):
    """Eight large arrays (`sign * (arange + i)`) and the PRNG / batch-norm state of `seed`."""

    def __init__(self, sign: float, seed: int, size: int = _BIG_SIZE):
        for i in range(_BIG_ARRAYS):
            setattr(self, f"w{i}", nnx.Param(jnp.asarray(sign * (np.arange(size, dtype=np.float32) + i))))
        rngs = nnx.Rngs(params=jax.random.key(seed), dropout=jax.random.PRNGKey(seed + 1))
        self.bn = nnx.BatchNorm(2, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.rngs = rngs
        if sign:
            self.train()
            self(sign * _X)  # batch statistics of sign * X; the dropout stream's count 1

    def __call__(self, x):
        return self.drop(self.bn(x)) + self.w0[None, :2]


def kill_state(module) -> list:
    """The module's state leaves in `nnx.state` order, keys as key data (as export stores them)."""
    return [
        np.asarray(jax.random.key_data(a) if jnp.issubdtype(a.dtype, jax.dtypes.prng_key) else a)
        for a in jax.tree.leaves(nnx.state(module))
    ]


KILL_KINDS = [
    "checkpoint",
    "save_weights",
    "model_checkpoint_best_weights",
    "model_checkpoint_full",
    "export",
    "manager",
    "backup",
]


def kill_save(kind: str, work: str, module) -> None:
    """One save of `module` of the given kind onto `work/target` (the parent and child share it)."""
    from mirrax.callbacks import BackupAndRestore, ModelCheckpoint

    path = os.path.join(work, "target")
    if kind == "checkpoint":
        mirrax.Checkpoint(model=module).write(path)
    elif kind == "save_weights":
        mirrax.Model(module).save_weights(path, overwrite=True)
    elif kind.startswith("model_checkpoint"):
        best = kind == "model_checkpoint_best_weights"
        callback = ModelCheckpoint(
            path, monitor="loss", mode="min", save_best_only=best, save_weights_only=best
        )
        callback.set_model(mirrax.Model(module))
        callback.on_train_begin()
        callback.on_epoch_end(0, {"loss": 1.0})
    elif kind == "export":
        mirrax.export(module, path, jax.ShapeDtypeStruct((-1, 2), jnp.float32), platforms=["cpu"])
    elif kind == "manager":
        # As a resumed run: restore (so the save counter goes on: number n + 1), then save.
        target = KillNet(0.0, seed=9)
        manager = mirrax.CheckpointManager(mirrax.Checkpoint(model=target), path, max_to_keep=1)
        manager.restore_or_initialize()
        nnx.update(target, nnx.state(module))
        manager.save()
    elif kind == "backup":
        # The callback restores the last backup into the model it is given; the state to back
        # up is copied in afterwards (as training would have changed it).
        model = mirrax.Model(KillNet(0.0, seed=9))
        callback = BackupAndRestore(path)
        callback.set_model(model)
        callback.on_train_begin()
        nnx.update(model.module, nnx.state(module))
        callback.on_epoch_end(0)
    else:
        raise AssertionError(kind)


def kill_read(kind: str, work: str) -> list:
    """Reads `work/target` back as a user would; the state read (see `kill_state`)."""
    from mirrax.callbacks import BackupAndRestore

    path = os.path.join(work, "target")
    target = KillNet(0.0, seed=9)  # zeros and other keys: only a restore can change them
    if kind == "checkpoint":
        mirrax.Checkpoint(model=target).restore(path).assert_consumed()
    elif kind in ("save_weights", "model_checkpoint_best_weights"):
        mirrax.Model(target).load_weights(path)
    elif kind == "model_checkpoint_full":
        mirrax.Checkpoint(model=mirrax.Model(target)).restore(path).assert_consumed()
    elif kind == "export":
        exported = mirrax.load_exported(path)  # follows an interrupted replace to the artifact
        with np.load(os.path.join(exported.path, "weights.npz")) as npz:
            return [npz[f"weights_{i}"] for i in range(len(npz.files))]
    elif kind == "manager":
        restored = mirrax.CheckpointManager(mirrax.Checkpoint(model=target), path).restore_or_initialize()
        assert restored is not None, "no checkpoint left to restore"
    elif kind == "backup":
        callback = BackupAndRestore(path)
        callback.set_model(mirrax.Model(target))
        callback.on_train_begin()
    return kill_state(target)


# The moments (hooks the child sets on itself before saving):
#   arrays:    one array handed to TensorStore, the next not yet (export: weights.npz written,
#              the program not yet);
#   finalize:  everything written, just before the commit rename (Orbax's, or export's);
#   exchanged: the new directory swapped in by renameat2(RENAME_EXCHANGE), the old one
#              (now beside it) not yet deleted;
#   between:   no exchange (as on a filesystem without it): the old directory renamed aside,
#              the new one not yet renamed in, so `path` is missing;
#   deleting:  the old directory (renamed aside) half deleted;
#   dropped:   (managers) the checkpoint beyond max_to_keep renamed into .mirrax-deleted.
_REPLACE_MOMENTS = ["arrays", "finalize", "exchanged", "between", "deleting"]
_MANAGER_MOMENTS = ["arrays", "finalize", "dropped", "deleting"]
_COMMITTED = {"exchanged", "between", "deleting", "dropped"}  # the new state is restorable

# The children are forked from one server process that has imported jax, flax, orbax and
# mirrax once (it never starts a JAX backend, so forking it is safe): each child costs only
# its own save. Protocol on the server's stdin/stdout: "work kind moment" in; the child prints
# "BLOCKED <pid>" (or "SAVED" if no hook fired), then the server "EXIT <wait status>".
_FORK_SERVER = textwrap.dedent(
    """
    import os, sys, threading
    os.environ["JAX_PLATFORMS"] = "cpu"
    sys.path.insert(0, {repo!r})
    from orbax.checkpoint._src.path import atomicity
    from orbax.checkpoint._src.serialization import serialization
    from mirrax._src import atomic_dirs as ad
    from mirrax._src.checkpointing import manager as ck
    from mirrax._src.exporting import export as ex
    from tests import test_checkpoint_atomic as t

    def child(work, kind, moment):
        printed, lock = [], threading.Lock()

        def block():
            with lock:  # several writer threads may get here; one line only
                if not printed:
                    printed.append(1)
                    print("BLOCKED", os.getpid(), flush=True)
            threading.Event().wait()  # until SIGKILL

        if moment == "arrays" and kind == "export":
            original_write = ex._write_file
            def write_file(path, write):
                original_write(path, write)
                if path.endswith(ex.WEIGHTS_FILE):
                    block()
            ex._write_file = write_file
        elif moment == "arrays":
            original, calls = serialization.async_serialize_from_host, []
            async def serialize(*args, **kwargs):
                calls.append(1)
                if len(calls) > 1:
                    block()
                return await original(*args, **kwargs)
            serialization.async_serialize_from_host = serialize
        elif moment == "finalize" and kind == "export":
            original_rename = os.rename
            def rename(src, dst, *args, **kwargs):
                if str(src).endswith(".partial"):
                    block()
                return original_rename(src, dst, *args, **kwargs)
            os.rename = rename
        elif moment == "finalize":
            async def finalize(self, *args, **kwargs):
                block()
            atomicity.AtomicRenameTemporaryPath.finalize = finalize
        elif moment == "exchanged":
            original_exchange = ad.exchange
            def exchange(a, b):
                if not original_exchange(a, b):
                    print("NO EXCHANGE ON THIS FILESYSTEM", flush=True)
                    sys.exit(3)
                block()
            ad.exchange = exchange
        elif moment == "between":
            ad.exchange = lambda a, b: False
            original_rename = ad.rename
            def rename(src, dst):
                original_rename(src, dst)
                if dst.endswith(ad.OLD_SUFFIX):
                    block()
            ad.rename = rename
        elif moment == "deleting":
            original_delete = ad.delete
            def delete(path):
                files = sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs)
                for name in files[: len(files) // 2]:
                    os.remove(name)
                if files:
                    block()
                original_delete(path)
            ad.delete = delete
        elif moment == "dropped":
            original_delete_if_exists = ad.delete_if_exists
            def delete_if_exists(path):
                if path.endswith(ck._DELETED_SUBDIR) and os.path.isdir(path) and os.listdir(path):
                    block()
                original_delete_if_exists(path)
            ad.delete_if_exists = delete_if_exists
        t.kill_save(kind, work, t.KillNet(-1.0, seed=1))
        print("SAVED", flush=True)  # never reached: the test fails if it is

    print("READY", flush=True)
    for line in sys.stdin:
        work, kind, moment = line.split()
        pid = os.fork()
        if pid == 0:
            try:
                child(work, kind, moment)
            finally:
                sys.stdout.flush()
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        print("EXIT", status, flush=True)
    """
)


class _ForkServer:
    def __init__(self, log):
        self.log = open(log, "w")  # stderr to a file: a full pipe would stall the server
        self.process = subprocess.Popen(
            [sys.executable, "-c", _FORK_SERVER.format(repo=_REPO)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )
        assert self._line() == "READY", open(log).read()

    def _line(self) -> str:
        # A generous bound only so that a broken hook fails the test instead of hanging it.
        ready, _, _ = select.select([self.process.stdout], [], [], 240)
        return self.process.stdout.readline().strip() if ready else ""

    def kill_child_at(self, work, kind: str, moment: str) -> None:
        self.process.stdin.write(f"{work} {kind} {moment}\n")
        self.process.stdin.flush()
        line = self._line()
        if not line.startswith("BLOCKED "):
            raise AssertionError(
                f"child did not block at {moment}: {line!r}\n{open(self.log.name).read()[-3000:]}"
            )
        os.kill(int(line.split()[1]), signal.SIGKILL)
        status = self._line()
        assert status.startswith("EXIT "), status
        status = int(status.split()[1])
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status

    def close(self):
        self.process.stdin.close()
        self.process.wait(timeout=60)
        self.log.close()


@pytest.fixture(scope="module")
def fork_server(tmp_path_factory):
    server = _ForkServer(tmp_path_factory.mktemp("fork_server") / "server.log")
    yield server
    server.close()


@pytest.fixture(scope="module")
def old_and_new():
    """The old state (written by the test) and the new one (by the killed child), as
    `kill_state` lists them, and the old module."""
    old = KillNet(1.0, seed=0)
    new = kill_state(KillNet(-1.0, seed=1))
    return old, kill_state(old), new


def _moments(kind: str) -> list:
    if kind in ("manager", "backup"):
        return _MANAGER_MOMENTS
    # save_weights and ModelCheckpoint replace through Checkpoint.save's code: the exchange is
    # killed once there (and once for export's), the other moments for every kind.
    return [m for m in _REPLACE_MOMENTS if m != "exchanged" or kind in ("checkpoint", "export")]


_KILL_CASES = [(kind, moment) for kind in KILL_KINDS for moment in _moments(kind)]


@pytest.mark.parametrize("kind, moment", _KILL_CASES, ids=[f"{k}-{m}" for k, m in _KILL_CASES])
def test_a_save_killed_at_any_moment_leaves_the_old_or_the_new_state_restorable(
    tmp_path, fork_server, old_and_new, kind, moment
):
    old_module, old, new = old_and_new
    work = tmp_path / "work"
    work.mkdir()
    kill_save(kind, str(work), old_module)
    if kind == "backup":
        kill_save(kind, str(work), old_module)  # two kept: the child's save drops the first
    fork_server.kill_child_at(work, kind, moment)

    got = kill_read(kind, str(work))
    # Once the new state is committed it is what a restore finds; before, the old one.
    want = new if moment in _COMMITTED else old
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(g, w, err_msg=f"leaf {i}")  # bit for bit

    if moment in ("arrays", "exchanged"):
        return  # leftovers like those of "finalize" / "deleting", checked there
    # The next save completes or clears whatever the kill left; nothing stays beside it.
    kill_save(kind, str(work), old_module)
    assert sorted(os.listdir(work)) == ["target"]
    if kind in ("manager", "backup"):
        assert all(n.isdigit() for n in os.listdir(work / "target")), os.listdir(work / "target")
