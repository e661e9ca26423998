"""A save killed part-way, a truncated data file, a planted pickle: what a restore then sees.

The kill is deterministic: the child process blocks itself at a chosen point inside Orbax's
save and says so on stdout, and only then does the test SIGKILL it (no sleeps, no races).
"""

import os
import pickle
import select
import signal
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mirrax

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
            stdout=subprocess.PIPE, stderr=err, text=True,
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
    path = mirrax.Checkpoint(w=nnx.Variable(jnp.asarray(values))).save(tmp_path / "ckpt")
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
