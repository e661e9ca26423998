"""`BackupAndRestore`: resume an interrupted `fit` where its last backup left off (Keras 3).

The backup is a `mirrax.CheckpointManager` directory (Orbax, atomic, newest one kept) holding a
`mirrax.Checkpoint` of the model (module and optimizer state, so `optimizer.iterations` too),
the loss tracker's and metrics' state, the fit record (the history so far and the shuffling
RNG's state, as JSON bytes: Orbax stores arrays) and the resume point: the epoch index and the
number of that epoch's batches already done. So a resumed fit sees the batches, and logs and
returns what the uninterrupted one would.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import warnings

import numpy as np

from mirrax import errors
from mirrax._src import argument_checks, launch_progress
from mirrax._src.checkpointing.checkpoint import Checkpoint
from mirrax._src.checkpointing.manager import CheckpointManager
from mirrax._src.training.callbacks._chief import is_chief
from mirrax._src.training.callbacks.callback import Callback, overrides_batch_hooks

_LOG = logging.getLogger("mirrax")
# The fit record before the first save, and the restore target of a backup without one.
_EMPTY_RECORD = np.frombuffer(b"{}", np.uint8)


def check_save_freq(save_freq, owner: str):
    """`save_freq` if it is "epoch" or a positive int (as Keras 3), else a mirrax error."""
    if isinstance(save_freq, str) and save_freq == "epoch":
        return save_freq
    if save_freq is False:
        raise errors.UnsupportedArgumentError(
            f"{owner}: save_freq=False (Keras's preemption checkpointing) is not supported; "
            "pass save_freq='epoch' or a positive int."
        )
    if isinstance(save_freq, int) and not isinstance(save_freq, bool) and save_freq > 0:
        return save_freq
    error = (
        errors.InvalidArgumentError
        if isinstance(save_freq, (int, str)) and not isinstance(save_freq, bool)
        else errors.InvalidArgumentTypeError
    )
    raise error(
        f"{owner}: unrecognized save_freq: {save_freq!r}. Expected save_freq='epoch' (save at "
        "the end of every epoch) or a positive int (save every that many batches)."
    )


def _record_bytes(path: str) -> int:
    """The size of the fit record's JSON in the backup at `path`; 0 in a backup without one
    (written before mirrax backed up the history and the shuffling RNG)."""
    size = Checkpoint(record_bytes=0)
    try:
        size.restore(path)
    except errors.IncompatibleCheckpointError:  # no `record_bytes` item
        return 0
    return size.record_bytes


def remove_directory(path: str) -> None:
    """Deletes a directory after renaming it aside in one step, so a kill during the deletion
    never leaves a half-deleted directory under its name."""
    doomed = path + ".mirrax-deleting"
    if os.path.lexists(doomed):
        shutil.rmtree(doomed)
    os.rename(path, doomed)
    shutil.rmtree(doomed)


class BatchCounter:
    """Counts training batches across epochs and says when `every` more have run.

    `fit` reports `on_train_batch_end(batch)` with the index of the LAST batch of a group
    (`steps_per_execution > 1`), so the count is the index difference, not one per call.
    """

    def __init__(self, every: int):
        self.every = every
        self.since_save = 0
        self.last_batch = -1

    def start_epoch(self, first_batch: int = 0) -> None:
        self.last_batch = first_batch - 1

    def due(self, batch: int) -> bool:
        self.since_save += batch - self.last_batch
        self.last_batch = batch
        if self.since_save >= self.every:
            self.since_save = 0
            return True
        return False


class BackupAndRestore(Callback):
    """Backs up training and resumes it after an interruption, as `keras.callbacks.BackupAndRestore`.

    At the start of `fit`, if `backup_dir` holds a backup, the model's module and optimizer
    state (weights, optimizer slots, `optimizer.iterations`) are restored from it, and `fit`
    continues from the saved point: the epoch after the last completed one, or, for a backup
    taken mid-epoch (`save_freq` an int), that epoch, skipping the batches it had already
    done (the progress bar counts on from there). `initial_epoch` is then ignored. A backup is
    written at the end of every epoch (`save_freq="epoch"`) or after every `save_freq`
    batches, counted across epochs. When `fit` ends without an exception (also when stopped
    by `EarlyStopping`), the backup directory is deleted if `delete_checkpoint`, so the next
    `fit` starts afresh.

    Example: with 5 batches per epoch and `epochs=10`, a run killed during epoch index 4
    (after the epoch-end backup of epoch index 3, `iterations` 20) resumes at epoch index 4
    with `iterations` 20 and runs the remaining 6 epochs (30 steps).

    A resumed run reproduces the uninterrupted one exactly when the batches it sees are the
    same: arrays with `shuffle=False`, or a dataset that yields the same batches in every
    epoch. The shuffling RNG and metric states are not backed up (metrics restart at the
    resume point, as Keras's restart at each epoch).

    Every backup is atomic (a `mirrax.CheckpointManager`: Orbax commits each by rename), and
    the previous backup is kept until the next one is committed, so a kill at any moment
    leaves one restorable. As Keras's, if the newest backup cannot be read (a damaged file),
    the previous one is restored instead (with a log line). Every process calls the save
    (Orbax lets process 0 write the files); only process 0 deletes the directory.

    Args:
      backup_dir: directory for the backup (created when needed); give each concurrent run
        its own.
      save_freq: "epoch" or a positive int (back up every that many batches).
      delete_checkpoint: delete `backup_dir` when training ends without an exception.

    Raises:
      InvalidArgumentError: `backup_dir` is empty, or `save_freq` is neither "epoch" nor a
        positive int.
      InvalidArgumentTypeError: `backup_dir` is not a path, or `delete_checkpoint` not a bool.
      UnsupportedArgumentError: `save_freq=False` (Keras's preemption checkpointing).
      ExistingPathError: `backup_dir` is a regular file.
    """

    def __init__(self, backup_dir, save_freq="epoch", delete_checkpoint: bool = True):
        super().__init__()
        if not isinstance(backup_dir, (str, os.PathLike)):
            raise errors.InvalidArgumentTypeError(
                f"BackupAndRestore: backup_dir must be a directory path (str or os.PathLike); "
                f"received {backup_dir!r} of type {type(backup_dir).__name__}."
            )
        if not os.fspath(backup_dir):
            raise errors.InvalidArgumentError(
                f"BackupAndRestore: backup_dir must be a directory path; received {backup_dir!r}."
            )
        self.backup_dir = os.path.abspath(os.fspath(backup_dir))
        if os.path.lexists(self.backup_dir) and not os.path.isdir(self.backup_dir):
            raise errors.ExistingPathError(
                f"BackupAndRestore: backup_dir {self.backup_dir} is a file; pass a directory "
                "path (created when needed) that nothing else uses."
            )
        self.save_freq = check_save_freq(save_freq, "BackupAndRestore")
        self.delete_checkpoint = argument_checks.flag(
            "BackupAndRestore", "delete_checkpoint", delete_checkpoint
        )
        self._checkpoint: Checkpoint | None = None
        self._manager: CheckpointManager | None = None
        self._counter: BatchCounter | None = None
        self._resume = (0, 0)
        self._restored = False
        self._epoch = 0
        self._at_epoch_end = False
        self._history: dict | None = None  # restored, set into model.history at the first epoch
        self._epoch_rng: dict | None = None  # the shuffling RNG's state when the epoch began

    def on_train_begin(self, logs: dict | None = None) -> None:
        """Restores the backup, if there is one, and tells `fit` where to resume."""
        metrics = {f"metrics_{i}": obj for i, obj in enumerate(self.model.metrics_state.values())}
        self._checkpoint = checkpoint = Checkpoint(
            model=self.model, epoch=0, step=0, record_bytes=0, record=_EMPTY_RECORD, **metrics
        )
        # Two kept: the previous backup stays until the next one is committed, and is the
        # fallback when the newest cannot be read (as Keras's `_latest.weights.h5`).
        self._manager = manager = CheckpointManager(checkpoint, self.backup_dir, max_to_keep=2)
        self._counter = BatchCounter(self.save_freq) if self.save_freq != "epoch" else None
        self._resume = (0, 0)
        self._restored = False
        self._history = None
        self._at_epoch_end = False
        backups = manager.checkpoints
        if not backups and launch_progress.restart_count() > 0:
            warnings.warn(
                f"BackupAndRestore: this is restart {launch_progress.restart_count()} of the job "
                f"(mirrax launch --max-restarts), but {self.backup_dir} holds no backup, so fit "
                "starts from the beginning. If an earlier attempt saved one, this is not the "
                "directory it wrote: give every worker the same backup_dir, on a filesystem "
                "all nodes share.",
                stacklevel=2,
            )
        for i, path in enumerate(reversed(backups)):
            try:
                record_bytes = _record_bytes(path)  # a restore target has the stored shape
                checkpoint.record = np.zeros(max(record_bytes, _EMPTY_RECORD.size), np.uint8)
                checkpoint.restore(path)
            except errors.IncompatibleCheckpointError as error:
                raise errors.IncompatibleCheckpointError(
                    f"BackupAndRestore: the backup in {self.backup_dir} was written by another "
                    f"model or compile: {error} Pass a backup_dir of this run's own, or delete "
                    f"{self.backup_dir} to train from the beginning."
                ) from None
            except errors.InvalidCheckpointError as error:
                if i + 1 == len(backups):
                    raise
                _LOG.warning(
                    "mirrax: BackupAndRestore could not read the backup %s (%s); restoring the previous one.",
                    path,
                    error,
                )
                continue
            self._resume = (checkpoint.epoch, checkpoint.step)
            self._restored = True
            record = json.loads(bytes(checkpoint.record)) if record_bytes else {}
            self._history = record.get("history")
            rng = self.model.shuffle_rng
            if record.get("shuffle_rng") is not None and rng is not None:
                rng.bit_generator.state = record["shuffle_rng"]
            break

    def resume_point(self):
        """The restored backup's (epoch, step), or None when there was none."""
        return self._resume if self._restored else None

    def needs_batch_logs(self, hook: str) -> bool:
        return False  # backups are taken by batch count, not from the logs

    def needs_model_between_batches(self, kind: str) -> bool:
        # Batch-level backups read the model; epoch-level ones only count batches.
        return (kind == "train" and self.save_freq != "epoch") or overrides_batch_hooks(
            self, kind, BackupAndRestore
        )

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._epoch = epoch
        history = getattr(self.model, "history", None)
        if self._history is not None and history is not None:
            # After History.on_train_begin (the last callback), which starts its epoch list.
            history.history, history.epoch = self._history["history"], self._history["epoch"]
        self._history = None
        # Before this epoch's pass draws its permutation: a backup taken during the epoch
        # restores this state, so the resumed pass draws the same order.
        rng = self.model.shuffle_rng
        self._epoch_rng = None if rng is None else rng.bit_generator.state
        if self._counter is not None:
            resumed_epoch, resumed_step = self._resume
            self._counter.start_epoch(resumed_step if epoch == resumed_epoch else 0)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        """Backs up after every `save_freq` batches (int `save_freq` only)."""
        if self._counter is not None and self._counter.due(batch):
            if batch + 1 == self.params.get("steps"):
                # The epoch's last batch: backed up at the epoch's end, with its logs (and
                # validation) in the history, resuming at the next epoch.
                self._at_epoch_end = True
            else:
                self._save(self._epoch, batch + 1)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        """Backs up with the next epoch as the resume point (`save_freq="epoch"`, or a batch
        backup that fell on the epoch's last batch)."""
        if self.save_freq == "epoch" or self._at_epoch_end:
            self._at_epoch_end = False
            self._save(epoch + 1, 0, (epoch, logs or {}))

    def on_train_end(self, logs: dict | None = None) -> None:
        """Deletes the backup (`delete_checkpoint`): training finished."""
        self._manager = None
        if self.delete_checkpoint and is_chief() and os.path.isdir(self.backup_dir):
            remove_directory(self.backup_dir)

    def _save(self, epoch: int, step: int, ended: tuple | None = None) -> None:
        """Backs up with (epoch, step) as the resume point; `ended`: (index, logs) of the epoch
        that just ended, which History (the last callback) has not recorded yet."""
        assert self._checkpoint is not None and self._manager is not None  # between train begin and end
        self._checkpoint.epoch = epoch
        self._checkpoint.step = step
        history = getattr(self.model, "history", None)
        record: dict = {}
        if history is not None:
            logged = {key: list(values) for key, values in history.history.items()}
            record["history"] = {"history": logged, "epoch": list(history.epoch)}
            if ended is not None:
                record["history"]["epoch"].append(ended[0])
                for key, value in ended[1].items():
                    logged.setdefault(key, []).append(value)
        # Mid-epoch: the state before the epoch's permutation; at its end: the state now, before
        # the next epoch's.
        rng = self.model.shuffle_rng
        record["shuffle_rng"] = (
            self._epoch_rng if step else (None if rng is None else rng.bit_generator.state)
        )
        data = json.dumps(record, default=float).encode()
        self._checkpoint.record = np.frombuffer(data, np.uint8)
        self._checkpoint.record_bytes = len(data)
        self._manager.save()
