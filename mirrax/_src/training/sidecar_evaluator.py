"""`mirrax.SidecarEvaluator`: evaluates each new checkpoint a training job writes, as
`tf.keras.utils.SidecarEvaluator` (the parameter-server tutorial's evaluator task).

Semantics from Keras 2's keras/distribute/sidecar_evaluator.py: watch `checkpoint_dir` with
`checkpoints_iterator` (30 s timeout, then keep waiting with a log line), restore the model from
each new checkpoint (`expect_partial`: the optimizer is not needed), `model.evaluate(data,
steps=steps, callbacks=callbacks, verbose=2)`, log the metrics, and stop after the checkpoint
whose path ends in `-<max_evaluations>` (or `/<max_evaluations>`: a `CheckpointManager`'s).
A checkpoint that cannot be read yet (the trainer racing its write) is logged and skipped, as
Keras retries on TF's read errors.
"""

from __future__ import annotations

import logging
import re

from mirrax import errors
from mirrax._src import argument_checks
from mirrax._src.checkpointing.checkpoint import Checkpoint
from mirrax._src.checkpointing.directory import SAVE_COUNTER, stored_items
from mirrax._src.checkpointing.state_file import checkpoints_iterator
from mirrax._src.training.model import Model

_LOG = logging.getLogger("mirrax")

# Keras's _CHECKPOINT_TIMEOUT_SEC: how long to wait for a new checkpoint before logging that
# none came (then the evaluator keeps waiting).
CHECKPOINT_TIMEOUT_SEC = 30

_NUMBER = re.compile(r"(\d+)$")


class SidecarEvaluator:
    """Evaluates `model` on `data` for each new checkpoint in `checkpoint_dir`, as
    `tf.keras.utils.SidecarEvaluator`.

    The training job saves `mirrax.Checkpoint(model=model, optimizer=...)` (a `mirrax.Model`,
    stored as `model.module`; or an NNX module as `model`) with `Checkpoint.save(prefix)` or a
    `CheckpointManager`; `Model.save_weights`'s layout (`weights`) is read too. Only the
    model's weights are read (Keras reads the optimizer's `iterations` too and refuses a
    checkpoint without it; mirrax does not need it).

    Args:
      model: a compiled `mirrax.Model` with the training model's structure (its loss and
        metrics are what `evaluate` reports).
      data: what `model.evaluate` takes as `x` (a dataset, arrays with labels, a generator).
      checkpoint_dir: the directory the training job saves its checkpoints in.
      steps: batches per evaluation (int >= 1), or None for a whole pass over `data`.
      max_evaluations: stop after evaluating the checkpoint numbered this (int >= 1; the k-th
        `save` writes `<prefix>-k`), or None to run until interrupted.
      callbacks: `mirrax.callbacks.Callback`s passed to each `evaluate`.

    Raises:
      InvalidArgumentTypeError / InvalidArgumentError: `model` is not a `mirrax.Model`, or
        `steps` / `max_evaluations` is not an int >= 1 or None, or `callbacks` is not a list.
    """

    def __init__(self, model, data, checkpoint_dir, steps=None, max_evaluations=None, callbacks=None):
        if not isinstance(model, Model):
            raise errors.InvalidArgumentTypeError(
                f"SidecarEvaluator evaluates a mirrax.Model; received {type(model).__name__}. "
                "Wrap it: mirrax.SidecarEvaluator(mirrax.Model(keras_model), ...), compiled with "
                "the training's loss and metrics."
            )
        for name, value in (("steps", steps), ("max_evaluations", max_evaluations)):
            argument_checks.count("SidecarEvaluator", name, value, allow_none=True)
        if callbacks is not None and not isinstance(callbacks, (list, tuple)):
            raise errors.InvalidArgumentTypeError(
                f"SidecarEvaluator: callbacks must be a list of Callbacks or None; received "
                f"{type(callbacks).__name__}."
            )
        self.model = model
        self.data = data
        self.checkpoint_dir = checkpoint_dir
        self.steps = steps
        self.max_evaluations = max_evaluations
        self.callbacks = list(callbacks or [])

    def _timeout_fn(self) -> bool:
        _LOG.info(
            "mirrax: SidecarEvaluator found no new checkpoint in %s after %s seconds; "
            "check that the training saves mirrax.Checkpoint(model=...) there with "
            "Checkpoint.save or a CheckpointManager. Still waiting.",
            self.checkpoint_dir,
            CHECKPOINT_TIMEOUT_SEC,
        )
        return False

    def _checkpoint_for(self, path: str) -> Checkpoint:
        """A Checkpoint reading only the model's weights, under the name they were saved as."""
        stored = stored_items(path, "SidecarEvaluator")
        for item in ("model.module", "model", "weights"):
            if item in stored:
                return Checkpoint(**{item: self.model.module})
        raise errors.IncompatibleCheckpointError(
            f"SidecarEvaluator: the checkpoint at {path} holds no model (its items: "
            f"{sorted(set(stored) - {SAVE_COUNTER})}). Save the training's model as "
            "mirrax.Checkpoint(model=model, optimizer=optimizer) (TF's layout for the "
            "SidecarEvaluator), or with model.save_weights."
        )

    def start(self) -> None:
        """Runs the evaluation loop until `max_evaluations` is reached (blocking), as Keras's.

        Raises:
          IncompatibleCheckpointError: a checkpoint holds no model, or one whose structure,
            shapes or dtypes differ from `model`'s.
          NotCompiledError: as `model.evaluate`.
        """
        for path in checkpoints_iterator(
            self.checkpoint_dir, timeout=CHECKPOINT_TIMEOUT_SEC, timeout_fn=self._timeout_fn
        ):
            try:
                self._checkpoint_for(path).restore(path).expect_partial()
            except (errors.InvalidCheckpointError, errors.MissingCheckpointError) as e:
                # The trainer may have replaced or dropped it meanwhile (max_to_keep): skip.
                _LOG.info(
                    "mirrax: SidecarEvaluator could not read the checkpoint at %s; "
                    "waiting for the next one. Error: %s: %s",
                    path,
                    type(e).__name__,
                    e,
                )
                continue
            _LOG.info("mirrax: evaluation starts: model weights loaded from %s", path)
            logs = self.model.evaluate(
                self.data, steps=self.steps, callbacks=self.callbacks, verbose=2, return_dict=True
            )
            _LOG.info(
                "mirrax: end of evaluation. Metrics: %s",
                " ".join(f"{name}={value}" for name, value in logs.items()),
            )
            number = _NUMBER.search(path)
            if self.max_evaluations and number and self.max_evaluations <= int(number.group(1)):
                _LOG.info("mirrax: last checkpoint evaluated. SidecarEvaluator stops.")
                return
