"""The worker program of the restart tests (test_multi_worker_restarts.py): fit in
replica-invariant mode with BackupAndRestore, killed on purpose at chosen moments of chosen
attempts of `mirrax launch --max-restarts` (MIRRAX_LAUNCH_RESTART_COUNT), reporting what an
uninterrupted run must equal bit for bit: weights, history, predictions."""

from __future__ import annotations

import os
import pathlib
import signal
import sys

import numpy as np

EPOCHS = 4
# 32 examples in global batches of 8: 4 steps an epoch; a backup every 2 steps.
EXAMPLES, BATCH, SAVE_FREQ = 32, 8, 2
# Attempt -> (where, worker, epoch index, batch index) at which that worker SIGKILLs itself:
# "step": in that batch's end hook, its step dispatched, the next backup not taken;
# "backup": while the backup after that batch is written, as soon as Orbax's asynchronous save
#   has started (only the chief, worker 0, writes);
# "epoch": at the start of that epoch, after the previous one ended (between epochs);
# "exit": sys.exit(3) where "step" kills.
KILLS = {
    "three": {0: ("step", 1, 1, 2), 1: ("backup", 0, 2, 1), 2: ("epoch", 1, 3, 0)},
    "once": {0: ("step", 1, 1, 2)},
    "twice": {0: ("step", 1, 1, 2), 1: ("step", 1, 2, 1)},
    "chief_once": {0: ("step", 0, 1, 2)},
    "exit_once": {0: ("exit", 1, 1, 2)},
    "plain": {},
}


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def restarted(out_dir, index, plan):
    import mirrax
    from tests.multiworker.scenarios import compiled_mlp, make_strategy

    strategy = make_strategy(replica_invariant=True, micro_batches=4)
    model, x, y = compiled_mlp(strategy)
    x, y = x[:EXAMPLES], y[:EXAMPLES]
    attempt = int(os.environ.get("MIRRAX_LAUNCH_RESTART_COUNT", "0"))
    where, worker, kill_epoch, kill_batch = KILLS[plan].get(attempt, (None, None, -1, -1))
    dies = index == worker
    epoch_now = [0]
    seen = []
    if dies and where == "backup":
        import orbax.checkpoint as ocp

        write = ocp.CheckpointManager.save

        def save(self, *args, **kwargs):
            started = write(self, *args, **kwargs)  # asynchronous: the files are being written
            if seen[-1] == [kill_epoch, kill_batch]:
                _die()
            return started

        ocp.CheckpointManager.save = save

    def on_epoch_begin(epoch, logs):
        epoch_now[0] = epoch
        if dies and where == "epoch" and epoch == kill_epoch:
            _die()

    def on_batch_end(batch, logs):
        seen.append([epoch_now[0], batch])
        if dies and (epoch_now[0], batch) == (kill_epoch, kill_batch):
            if where == "step":
                _die()
            if where == "exit":
                sys.exit(3)

    backup = mirrax.callbacks.BackupAndRestore(str(pathlib.Path(out_dir) / "backup"), save_freq=SAVE_FREQ)
    killer = mirrax.callbacks.LambdaCallback(on_epoch_begin=on_epoch_begin, on_train_batch_end=on_batch_end)
    history = model.fit(
        x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=True, verbose=0, callbacks=[killer, backup]
    )
    predictions = model.predict(x[:BATCH], batch_size=BATCH, verbose=0)
    params = [np.asarray(model.module.l1.kernel[...]), np.asarray(model.module.l2.kernel[...])]
    return {
        "attempt": attempt,
        "seen": seen,
        "weights": [p.tolist() for p in params],
        "history": history.history,
        "epochs": history.epoch,
        "predictions": np.asarray(predictions).tolist(),
    }


SCENARIOS = {"restarted": restarted}
