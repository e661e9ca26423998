"""mirrax.CheckpointManager: keeping checkpoints by age (keep_checkpoint_every_n_hours) and
asynchronous saving (async_save)."""

import os
import re
import time

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mirrax


def _numbers(manager) -> list:
    return [int(os.path.basename(p)) for p in manager.checkpoints]


@pytest.mark.slow
def test_keep_checkpoint_every_n_hours_keeps_old_checkpoints_beyond_max_to_keep(tmp_path):
    # 1/3600 hours = 1 second (Orbax counts whole seconds). Saves 1 and 2 come at once, then
    # a 1.2 s pause, then saves 3, 4 and 5 at once (each save takes well under 1 s here).
    # After each save Orbax keeps the newest (max_to_keep=1), the oldest kept one, and each one
    # committed >= 1 s after the previous one so kept:
    #   save 2: 1 (oldest), 2 (newest)                  -> [1, 2]
    #   save 3: 2 is < 1 s after 1, so it goes; 3 is >= 1 s after 1 -> [1, 3]
    #   save 4: 4 is newest                             -> [1, 3, 4]
    #   save 5: 4 is < 1 s after 3, so it goes          -> [1, 3, 5]
    ckpt = mirrax.Checkpoint(step=0)
    manager = mirrax.CheckpointManager(
        ckpt, tmp_path / "run", max_to_keep=1, keep_checkpoint_every_n_hours=1 / 3600
    )
    manager.save()
    manager.save()
    assert _numbers(manager) == [1, 2]
    time.sleep(1.2)
    manager.save()
    assert _numbers(manager) == [1, 3]
    manager.save()
    manager.save()
    assert _numbers(manager) == [1, 3, 5]
    assert sorted(os.listdir(tmp_path / "run")) == ["1", "3", "5"]

    # Without it, max_to_keep=1 keeps only the newest.
    plain = mirrax.CheckpointManager(mirrax.Checkpoint(step=0), tmp_path / "plain", max_to_keep=1)
    for _ in range(3):
        plain.save()
    assert _numbers(plain) == [3]


def test_keep_checkpoint_every_n_hours_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match=r"keep_checkpoint_every_n_hours .* received 0"):
        mirrax.CheckpointManager(mirrax.Checkpoint(step=0), tmp_path, keep_checkpoint_every_n_hours=0)


def test_async_save_saves_the_values_at_the_time_of_save(tmp_path):
    weights = nnx.Variable(jnp.arange(4.0))  # 0, 1, 2, 3
    counts = np.array([10, 20], np.int64)  # a host array, changed in place below
    ckpt = mirrax.Checkpoint(weights=weights, counts=counts)
    manager = mirrax.CheckpointManager(ckpt, tmp_path / "run", async_save=True)

    path = manager.save()
    assert path == str(tmp_path / "run" / "1")
    # Change everything straight after save: the device array's buffer is freed and the host
    # array is overwritten in place. (Freed explicitly: a donation to jit is only a request,
    # which XLA may decline while another reference to the buffer is still live.)
    saved_buffer = weights.get_value()
    weights.set_value(saved_buffer * 100.0)
    saved_buffer.delete()
    assert saved_buffer.is_deleted()
    counts[:] = -1
    manager.wait_until_finished()
    assert manager.latest_checkpoint == path
    assert os.listdir(tmp_path / "run") == ["1"]  # committed: no temporary directory left

    restored_weights = nnx.Variable(jnp.zeros(4))
    restored = mirrax.Checkpoint(weights=restored_weights, counts=np.zeros(2, np.int64))
    restored.restore(path).assert_consumed()
    np.testing.assert_array_equal(np.asarray(restored_weights[...]), [0.0, 1.0, 2.0, 3.0])
    np.testing.assert_array_equal(restored.counts, [10, 20])
    assert restored.save_counter == 1


def test_async_save_waits_for_the_previous_save_and_restore_or_initialize_waits(tmp_path):
    state = nnx.Variable(jnp.zeros(256 * 1024))  # 1 MiB, so a write takes a moment
    ckpt = mirrax.Checkpoint(state=state)
    manager = mirrax.CheckpointManager(ckpt, tmp_path / "run", max_to_keep=5, async_save=True)
    manager.save()
    state[...] = jnp.ones(256 * 1024)
    manager.save()
    # The second save returned only after the first was committed.
    assert os.path.isdir(tmp_path / "run" / "1")  # renamed from its temporary name
    assert not any(n.startswith("1.") for n in os.listdir(tmp_path / "run"))

    fresh_state = nnx.Variable(jnp.full(256 * 1024, 7.0))
    fresh = mirrax.CheckpointManager(mirrax.Checkpoint(state=fresh_state), tmp_path / "run")
    # restore_or_initialize on the writing manager waits for save 2, then restores it.
    state[...] = jnp.zeros(256 * 1024)
    assert manager.restore_or_initialize() == str(tmp_path / "run" / "2")
    assert float(jnp.sum(state[...])) == 256 * 1024  # save 2 held ones
    assert fresh.restore_or_initialize() == str(tmp_path / "run" / "2")
    assert float(jnp.sum(fresh_state[...])) == 256 * 1024
    assert manager.checkpoints == [str(tmp_path / "run" / "1"), str(tmp_path / "run" / "2")]


_SAVE_THEN_EXIT = """
import sys
import jax.numpy as jnp
from flax import nnx
import mirrax
state = nnx.Variable(jnp.full(4 * 1024 * 1024, 3.0))  # 16 MiB: still writing when the script ends
mirrax.CheckpointManager(mirrax.Checkpoint(state=state), sys.argv[1], async_save=True).save()
"""


@pytest.mark.subprocess
def test_process_exit_waits_for_an_async_save(tmp_path):
    import subprocess
    import sys

    subprocess.run(
        [sys.executable, "-c", _SAVE_THEN_EXIT, str(tmp_path / "run")],
        check=True,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        timeout=120,
    )
    assert os.listdir(tmp_path / "run") == ["1"]  # committed, no temporary directory left
    state = nnx.Variable(jnp.zeros(4 * 1024 * 1024))
    mirrax.Checkpoint(state=state).restore(tmp_path / "run" / "1").assert_consumed()
    assert float(jnp.sum(state[...])) == 3.0 * 4 * 1024 * 1024


# -- PRNG / batch-norm state, damaged directories, arguments (issue 11) -------------------------

from tests.test_checkpoint import RngNet, assert_same_state, used_rng_net  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("legacy", [False, True], ids=["typed_keys", "legacy_keys"])
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_manager_restores_rng_and_batchnorm_state_exactly(tmp_path, legacy, async_save):
    saved = used_rng_net(0, legacy)
    manager = mirrax.CheckpointManager(mirrax.Checkpoint(net=saved), tmp_path / "run", async_save=async_save)
    manager.save()
    manager.wait_until_finished()  # another manager sees only committed checkpoints
    target = RngNet(1, legacy)
    again = mirrax.CheckpointManager(mirrax.Checkpoint(net=target), tmp_path / "run")
    assert again.restore_or_initialize() == str(tmp_path / "run" / "1")
    assert_same_state(target, saved)


def test_an_empty_numbered_folder_is_never_the_latest_checkpoint(tmp_path, caplog):
    counter = nnx.Variable(np.zeros((), np.float32))
    manager = mirrax.CheckpointManager(mirrax.Checkpoint(counter=counter), tmp_path / "run", max_to_keep=1)
    counter[...] = np.float32(1.0)
    manager.save()
    (tmp_path / "run" / "7").mkdir()  # empty: no checkpoint metadata, not restorable
    with caplog.at_level("WARNING", logger="mirrax"):
        assert manager.latest_checkpoint == str(tmp_path / "run" / "1")
    assert "skipping" in caplog.text and "not a complete checkpoint" in caplog.text
    assert manager.checkpoints == [str(tmp_path / "run" / "1")]
    # The next save moves it aside, so Orbax's max_to_keep=1 does not keep it as the newest
    # and delete the checkpoint just written (which would leave none restorable).
    counter[...] = np.float32(2.0)
    assert manager.save() == str(tmp_path / "run" / "2")
    assert sorted(os.listdir(tmp_path / "run")) == ["2", "7.mirrax-incomplete"]
    counter[...] = np.float32(0.0)
    assert mirrax.CheckpointManager(
        mirrax.Checkpoint(counter=counter), tmp_path / "run"
    ).restore_or_initialize() == str(tmp_path / "run" / "2")
    assert float(counter[...]) == 2.0


def test_saving_an_existing_number_replaces_it(tmp_path):
    counter = nnx.Variable(np.ones((), np.float32))
    manager = mirrax.CheckpointManager(mirrax.Checkpoint(counter=counter), tmp_path / "run")
    manager.save(checkpoint_number=3)
    counter[...] = np.float32(2.0)
    assert manager.save(checkpoint_number=3) == str(tmp_path / "run" / "3")  # Orbax refuses it
    assert manager.checkpoints == [str(tmp_path / "run" / "3")]
    counter[...] = np.float32(0.0)
    manager.restore_or_initialize()
    assert float(counter[...]) == 2.0


def test_dropped_checkpoints_leave_no_trace(tmp_path):
    manager = mirrax.CheckpointManager(mirrax.Checkpoint(step=0), tmp_path / "run", max_to_keep=2)
    for _ in range(4):
        manager.save()
    # Orbax renames each dropped one into .mirrax-deleted; mirrax deletes that after the save.
    assert sorted(os.listdir(tmp_path / "run")) == ["3", "4"]


@pytest.mark.parametrize(
    "kwargs, error, fragment",
    [
        (
            {"max_to_keep": 0},
            mirrax.errors.InvalidArgumentError,
            "max_to_keep must be >= 1 or None; received max_to_keep=0",
        ),
        (
            {"max_to_keep": "3"},
            mirrax.errors.InvalidArgumentTypeError,
            "max_to_keep must be an int or None; received str '3'",
        ),
        ({"max_to_keep": 2.5}, mirrax.errors.InvalidArgumentTypeError, "received float 2.5"),
        ({"max_to_keep": True}, mirrax.errors.InvalidArgumentTypeError, "received bool True"),
        ({"checkpoint_interval": -1}, mirrax.errors.InvalidArgumentError, "checkpoint_interval must be >= 0"),
        ({"keep_checkpoint_every_n_hours": "1"}, mirrax.errors.InvalidArgumentTypeError, "number of hours"),
        ({"init_fn": 3}, mirrax.errors.InvalidArgumentTypeError, "init_fn must be a function"),
        ({"async_save": "yes"}, mirrax.errors.InvalidArgumentTypeError, "async_save must be True or False"),
    ],
)
def test_manager_arguments_are_checked(tmp_path, kwargs, error, fragment):
    with pytest.raises(error, match=re.escape(fragment)):
        mirrax.CheckpointManager(mirrax.Checkpoint(step=0), tmp_path / "run", **kwargs)


@pytest.mark.parametrize(
    "number, error, fragment",
    [
        (
            -1,
            mirrax.errors.InvalidArgumentError,
            "checkpoint_number must be >= 0 or None; received checkpoint_number=-1",
        ),
        (2.0, mirrax.errors.InvalidArgumentTypeError, "received float 2.0"),
        ("2", mirrax.errors.InvalidArgumentTypeError, "received str '2'"),
    ],
)
def test_checkpoint_number_is_checked(tmp_path, number, error, fragment):
    manager = mirrax.CheckpointManager(mirrax.Checkpoint(step=0), tmp_path / "run")
    with pytest.raises(error, match=re.escape(fragment)):
        manager.save(checkpoint_number=number)
    assert manager.checkpoints == []  # nothing written


def test_a_file_where_the_directory_should_be_is_refused(tmp_path):
    (tmp_path / "run").write_text("not a directory")
    with pytest.raises(mirrax.errors.ExistingPathError, match="is a file"):
        mirrax.CheckpointManager(mirrax.Checkpoint(step=0), tmp_path / "run")
    assert (tmp_path / "run").read_text() == "not a directory"
