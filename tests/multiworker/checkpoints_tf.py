"""Multi-worker checkpoints in TF's tutorial pattern (multi_worker_with_ctl / _keras), run by
tests/test_checkpoint_tf_api.py: the chief writes `ckpt`, worker i `workertemp_i/ckpt` and
deletes it after each save; a save of state no step has touched; the resume path (restore on
every worker from `latest_checkpoint(checkpoint_dir)`, no steps left, save again).
"""

from __future__ import annotations

import os
import pathlib
import shutil


def _is_chief(task_type, task_id):
    # The tutorial's rule (a cluster without a 'chief' job: worker 0 is the chief).
    return task_type == "chief" or (task_type == "worker" and task_id == 0)


def _write_filepath(filepath, task_type, task_id):
    """TF's tutorial `write_filepath`: the chief's path, or `<dir>/workertemp_<i>/<base>`."""
    dirpath, base = os.path.dirname(filepath), os.path.basename(filepath)
    if not _is_chief(task_type, task_id):
        dirpath = os.path.join(dirpath, "workertemp_" + str(task_id))
        os.makedirs(dirpath, exist_ok=True)
    return os.path.join(dirpath, base)


def _listing(path) -> list:
    return sorted(os.listdir(path)) if os.path.isdir(path) else []


def checkpoints_tf(out_dir, index):
    """2 workers x 2 devices; `marker` holds each worker's index, saved before any step."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from jax.experimental import multihost_utils

    import mirrax
    from tests.multiworker.scenarios import compiled_mlp, make_strategy, mlp, mlp_problem, weights_of

    strategy = make_strategy()
    resolver = strategy.cluster_resolver
    task_type, task_id = resolver.task_type, resolver.task_id
    out = pathlib.Path(out_dir)
    checkpoint_dir = str(out / "ckpt")
    result = {"chief": _is_chief(task_type, task_id)}

    model, x, y = compiled_mlp(strategy)
    epoch = nnx.Variable(jnp.asarray(0))
    marker = nnx.Variable(jnp.asarray(float(index)))  # each worker's own value, never touched
    checkpoint = mirrax.train.Checkpoint(model=model, epoch=epoch, marker=marker)
    write_dir = _write_filepath(checkpoint_dir, task_type, task_id)
    manager = mirrax.train.CheckpointManager(checkpoint, directory=write_dir, max_to_keep=1)
    result["latest_before"] = mirrax.train.latest_checkpoint(checkpoint_dir)

    # Item 4: a save before any step (host-local state), then the tutorial's cleanup.
    result["untouched_path"] = manager.save()
    result["own_dir_after_save"] = _listing(write_dir)
    if not _is_chief(task_type, task_id):
        shutil.rmtree(write_dir)
    multihost_utils.sync_global_devices("checkpoints_tf:cleaned")
    result["chief_dir_after_cleanup"] = _listing(checkpoint_dir)
    probe = nnx.Variable(jnp.asarray(-1.0))
    mirrax.train.Checkpoint(marker=probe).restore(
        mirrax.train.latest_checkpoint(checkpoint_dir)
    ).expect_partial()
    result["untouched_marker"] = float(probe[...])

    # Two epochs, a save after each, cleanup after each (the tutorial's loop).
    while int(epoch[...]) < 2:
        model.fit(x, y, batch_size=12, epochs=1, verbose=0)
        epoch[...] = epoch[...] + 1
        manager.save()
        if not _is_chief(task_type, task_id):
            shutil.rmtree(write_dir)
    result["trained"] = weights_of(model.module)
    result["chief_dir_after_training"] = _listing(checkpoint_dir)
    result["latest_after_training"] = mirrax.train.latest_checkpoint(checkpoint_dir)

    # The resume path: a fresh process's objects, restored on every worker, nothing left, save.
    w1, w2, _, _ = mlp_problem()
    with strategy.scope():
        fresh = mirrax.Model(mlp(np.zeros_like(w1), np.zeros_like(w2)))
    fresh_epoch = nnx.Variable(jnp.asarray(0))
    resumed = mirrax.train.Checkpoint(model=fresh, epoch=fresh_epoch)
    latest = mirrax.train.latest_checkpoint(checkpoint_dir)
    resumed.restore(latest).expect_partial()
    result["restored"] = weights_of(fresh.module)
    result["restored_epoch"] = int(fresh_epoch[...])
    resumed_manager = mirrax.train.CheckpointManager(resumed, directory=write_dir, max_to_keep=1)
    while int(fresh_epoch[...]) < 2:  # no epochs left
        fresh_epoch[...] = fresh_epoch[...] + 1
    result["resumed_path"] = resumed_manager.save()
    if not _is_chief(task_type, task_id):
        result["stub_refused"] = _refused(lambda: resumed.restore(write_dir))
        shutil.rmtree(write_dir)

    # Checkpoint.save(prefix) through write_filepath, as multi_worker_with_keras saves a model.
    prefix = _write_filepath(os.path.join(str(out / "saved"), "ckpt"), task_type, task_id)
    result["prefix_path"] = mirrax.train.Checkpoint(model=fresh.module).save(prefix)
    result["saved_latest"] = mirrax.train.latest_checkpoint(str(out / "saved"))
    result["saved_own_latest"] = mirrax.train.latest_checkpoint(os.path.dirname(prefix))

    # A worker path inside the chief's is refused on every worker, before anything is written.
    inside = str(out / "inside") if index == 0 else str(out / "inside" / "mine")
    result["inside_refused"] = _refused(lambda: mirrax.train.Checkpoint(step=1).write(inside))
    # A refusal on one worker (the chief's path is a file) is raised on every worker.
    if index == 0:
        (out / "a_file").write_text("keep")
    result["file_refused"] = _refused(
        lambda: mirrax.train.Checkpoint(step=1).write(str(out / ("a_file" if index == 0 else f"own{index}")))
    )
    # A bad prefix on worker 1 only (a directory, refused before there is a path): the chief
    # gets the refusal at the path exchange instead of waiting there for an hour.
    bad_prefix = str(out / "saved") + "/" if index == 1 else str(out / "saved2" / "ckpt")
    result["prefix_refused"] = _refused(lambda: mirrax.train.Checkpoint(step=1).save(bad_prefix))
    # Orbax's barriers still line up afterwards: one more save on every worker.
    result["after_refusal"] = mirrax.train.Checkpoint(step=2).write(
        _write_filepath(str(out / "after" / "ckpt"), task_type, task_id)
    )
    return result


def _refused(fn) -> str | None:
    try:
        fn()
    except Exception as e:  # the test checks the type's name and the message
        return f"{type(e).__name__}: {e}"
    return None
