"""A second MultiWorkerMirroredStrategy in one process, and the checkpoint writer lock of a job,
run by tests/test_checkpoint_writers.py under 2 workers x 2 devices.

Each strategy trains, iterates a distributed dataset and saves through a CheckpointManager;
the second one's host exchanges (input passes, broadcasts, checkpoint paths and locks) must not
meet the first one's keys, which stay in the coordination service's store. The job's writer
lock is taken by the chief only.
"""

from __future__ import annotations

import json
import os
import pathlib


def _one_strategy(out: pathlib.Path, name: str) -> dict:
    import jax
    import numpy as np

    import mirrax
    from tests.multiworker.scenarios import compiled_mlp, make_strategy

    strategy = make_strategy()
    model, x, y = compiled_mlp(strategy)
    history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    seen = 0
    for batch in strategy.experimental_distribute_dataset(
        [(x[i : i + 8], y[i : i + 8]) for i in range(0, 32, 8)]
    ):
        seen += sum(len(v) for v in strategy.experimental_local_results(batch[0]))
    manager = mirrax.CheckpointManager(mirrax.Checkpoint(model=model), out / name)
    path = manager.save()
    lock = out / f"{name}.mirrax-writer"
    # Only the chief reads it: the others' view may race with the chief's release.
    owner = json.loads(lock.read_text())["pid"] if jax.process_index() == 0 else None
    manager.close()
    return {
        "loss": history.history["loss"],
        "seen": seen,
        "path": path,
        "lock_owner": owner,
        "weights": [np.asarray(w).ravel().tolist() for w in model.get_weights()],
        "lock_released": not lock.exists() if jax.process_index() == 0 else None,
    }


def second_strategy(out_dir, index):
    import jax
    from jax.experimental import multihost_utils

    out = pathlib.Path(out_dir)
    first = _one_strategy(out, "first")
    second = _one_strategy(out, "second")
    multihost_utils.sync_global_devices("files_procs_done")
    return {"first": first, "second": second, "process": jax.process_index(), "pid": os.getpid()}


SCENARIOS = {"second_strategy": second_strategy}
