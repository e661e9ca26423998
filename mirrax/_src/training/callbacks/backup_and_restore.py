"""`BackupAndRestore`: resume an interrupted `fit` where its last backup left off (Keras 3).

The backup is a `mirrax.CheckpointManager` directory (Orbax, atomic, newest one kept) holding a
`mirrax.Checkpoint` of the model (module and optimizer state, so `optimizer.iterations` too)
and the resume point: the epoch index and the number of that epoch's batches already done.
"""

from __future__ import annotations

import os
import shutil
from typing import Optional

from mirrax._src.training.callbacks._chief import is_chief
from mirrax._src.training.callbacks.callback import Callback


def check_save_freq(save_freq, owner: str):
    """`save_freq` if it is "epoch" or a positive int (as Keras 3), else ValueError."""
    if save_freq == "epoch":
        return save_freq
    if isinstance(save_freq, int) and not isinstance(save_freq, bool) and save_freq > 0:
        return save_freq
    raise ValueError(
        f"{owner}: unrecognized save_freq: {save_freq!r}. Expected save_freq='epoch' (save at "
        "the end of every epoch) or a positive int (save every that many batches)."
    )


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

    Every process calls the save (Orbax lets process 0 write the files); only process 0
    deletes the directory.

    Args:
      backup_dir: directory for the backup (created when needed); give each concurrent run
        its own.
      save_freq: "epoch" or a positive int (back up every that many batches).
      delete_checkpoint: delete `backup_dir` when training ends without an exception.

    Raises:
      ValueError: `backup_dir` is empty, or `save_freq` is neither "epoch" nor a positive int.
    """

    def __init__(self, backup_dir, save_freq="epoch", delete_checkpoint: bool = True):
        super().__init__()
        if not backup_dir:
            raise ValueError(
                f"BackupAndRestore: backup_dir must be a directory path; received {backup_dir!r}."
            )
        self.backup_dir = os.path.abspath(os.fspath(backup_dir))
        self.save_freq = check_save_freq(save_freq, "BackupAndRestore")
        self.delete_checkpoint = delete_checkpoint
        self._checkpoint = None
        self._manager = None
        self._counter: Optional[BatchCounter] = None
        self._resume = (0, 0)
        self._epoch = 0
        if self.save_freq != "epoch":
            # Bound per instance: `fit` reads the step's logs (waiting for it) only for
            # callbacks that have a batch hook, and epoch-level backups need none.
            self.on_train_batch_end = self._on_train_batch_end

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        """Restores the backup, if there is one, and tells `fit` where to resume."""
        from mirrax._src.checkpoint import Checkpoint, CheckpointManager

        self._checkpoint = Checkpoint(model=self.model, epoch=0, step=0)
        self._manager = CheckpointManager(self._checkpoint, self.backup_dir, max_to_keep=1)
        self._counter = BatchCounter(self.save_freq) if self.save_freq != "epoch" else None
        self._resume = (0, 0)
        latest = self._manager.latest_checkpoint
        if latest is not None:
            self._checkpoint.restore(latest)
            self._resume = (self._checkpoint.epoch, self._checkpoint.step)
            self.model._resume = self._resume

    def on_epoch_begin(self, epoch: int, logs: Optional[dict] = None) -> None:
        self._epoch = epoch
        if self._counter is not None:
            resumed_epoch, resumed_step = self._resume
            self._counter.start_epoch(resumed_step if epoch == resumed_epoch else 0)

    def _on_train_batch_end(self, batch: int, logs: Optional[dict] = None) -> None:
        """Backs up after every `save_freq` batches (int `save_freq` only)."""
        if self._counter.due(batch):
            epoch, step = self._epoch, batch + 1
            if step == self.params.get("steps"):
                # The epoch's last batch: resuming starts the next epoch.
                epoch, step = epoch + 1, 0
            self._save(epoch, step)

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        """Backs up with the next epoch as the resume point (`save_freq="epoch"`)."""
        if self.save_freq == "epoch":
            self._save(epoch + 1, 0)

    def on_train_end(self, logs: Optional[dict] = None) -> None:
        """Deletes the backup (`delete_checkpoint`): training finished."""
        self._manager = None
        if self.delete_checkpoint and is_chief() and os.path.isdir(self.backup_dir):
            shutil.rmtree(self.backup_dir)

    def _save(self, epoch: int, step: int) -> None:
        self._checkpoint.epoch = epoch
        self._checkpoint.step = step
        self._manager.save()
