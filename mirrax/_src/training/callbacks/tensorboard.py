"""`TensorBoard`: writes training and validation scalars as event files, through tensorboardX."""

from __future__ import annotations

import itertools
import os
import time
import warnings

import jax
import numpy as np

from mirrax import errors
from mirrax._src.training import weights as weights_lib
from mirrax._src.training.callbacks._chief import is_chief
from mirrax._src.training.callbacks.callback import Callback, overrides_batch_hooks

# Event files are named by time and host; a per-process counter keeps two writers opened in
# the same second on the same folder (fit, then evaluate) from overwriting each other.
_writer_ids = itertools.count()


def _summary_writer(logdir: str):
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        raise ImportError(
            "mirrax.callbacks.TensorBoard writes event files with tensorboardX, which is not "
            "installed. Install it with `pip install tensorboardX` (TensorFlow is not needed)."
        ) from None
    return SummaryWriter(logdir, filename_suffix=f".{os.getpid()}.{next(_writer_ids)}")


def _profile_range(profile_batch) -> tuple:
    message = (
        "TensorBoard: profile_batch must be a non-negative integer (0 disables profiling), a "
        "pair (start, stop) of positive integers with start <= stop, or a string 'start,stop'; "
        f"received profile_batch={profile_batch!r}."
    )
    try:
        if isinstance(profile_batch, str):
            profile_batch = tuple(int(part) for part in profile_batch.split(","))
            if len(profile_batch) == 1:
                profile_batch = profile_batch[0]
        if isinstance(profile_batch, (int, np.integer)) and not isinstance(profile_batch, bool):
            start = stop = int(profile_batch)
        elif isinstance(profile_batch, (tuple, list)) and len(profile_batch) == 2:
            start, stop = (int(v) for v in profile_batch)
        else:
            raise ValueError(message)
    except (TypeError, ValueError):
        raise ValueError(message) from None
    if start < 0 or stop < start or (start == 0) != (stop == 0):
        raise ValueError(message)
    return start, stop


class TensorBoard(Callback):
    """Writes TensorBoard event files, as `keras.callbacks.TensorBoard` (through tensorboardX,
    no TensorFlow needed).

    Layout and tags are Keras's, so TensorBoard shows the same charts:

    - `log_dir/train`: at the end of each epoch, `epoch_<key>` for every training key of the
      epoch's logs (`epoch_loss`, `epoch_accuracy`, `epoch_learning_rate`), at step = the
      0-based epoch index. `epoch_learning_rate` is read from `model.optimizer.learning_rate`
      when the logs lack it. With `write_steps_per_second=True`, `epoch_steps_per_second` too
      (training steps of the epoch / seconds since the epoch began).
    - `log_dir/validation`: `epoch_<key>` for every `val_<key>` (the prefix removed, so
      `val_loss` is drawn next to `loss` in the `epoch_loss` chart). At the end of every
      evaluation (`on_test_end`), `evaluation_<key>_vs_iterations` at step = the number of
      training steps done so far.
    - `update_freq=N` (or `"batch"`, meaning 1): also `batch_<key>` in `log_dir/train` every N
      training steps, at step = the global step count (1-based, across epochs); with
      `write_steps_per_second`, `batch_steps_per_second`.
    - `histogram_freq=N`: every N epochs, a histogram of each array of `model.get_weights()`,
      tagged as Keras's callback tags it for a Keras model, `<Keras path>/histogram` (e.g.
      `dense/kernel/histogram`), and `weight_<i>/histogram` for an NNX module (i its index in
      `get_weights()` order).
    - `profile_batch=k` or `(start, stop)`: a JAX profiler trace (`jax.profiler`) of those
      global training steps (1-based), saved under `log_dir/train` for TensorBoard's profile
      plugin.

    Writers are created when first used, flushed after every epoch and closed at the end of
    training (or of an `evaluate` outside `fit`). Only process 0 writes in a multi-process run.

    Args:
      log_dir: folder for the event files (created if missing).
      histogram_freq: epochs between weight histograms; 0 disables them.
      write_graph: accepted for Keras compatibility; no graph is written (Keras 3 writes one
        only for Functional and Sequential models, which mirrax does not have).
      write_images: must be False (weights as images are not supported).
      write_steps_per_second: also log training steps per second.
      update_freq: "epoch", "batch" or a positive number of steps.
      profile_batch: steps to profile, see above; 0 disables profiling.
      embeddings_freq: must be 0 (the embedding projector is not supported).
      embeddings_metadata: must be None.

    Raises:
      InvalidArgumentError (a ValueError): an invalid `update_freq`, `histogram_freq` or
        `profile_batch`.
      UnsupportedArgumentError (a ValueError): `write_images` / `embeddings_freq` /
        `embeddings_metadata` set.
      ImportError: tensorboardX is not installed (raised when the first file is written).
    """

    def __init__(
        self,
        log_dir="logs",
        histogram_freq: int = 0,
        write_graph: bool = True,
        write_images: bool = False,
        write_steps_per_second: bool = False,
        update_freq="epoch",
        profile_batch=0,
        embeddings_freq: int = 0,
        embeddings_metadata=None,
    ):
        super().__init__()
        if update_freq == "batch":
            update_freq = 1
        if update_freq != "epoch" and not (
            isinstance(update_freq, (int, np.integer))
            and not isinstance(update_freq, bool)
            and update_freq > 0
        ):
            raise errors.InvalidArgumentError(
                "TensorBoard: update_freq must be 'epoch', 'batch' or a positive number of "
                f"steps; received update_freq={update_freq!r}."
            )
        if (
            isinstance(histogram_freq, bool)
            or not isinstance(histogram_freq, (int, np.integer))
            or histogram_freq < 0
        ):
            raise errors.InvalidArgumentError(
                "TensorBoard: histogram_freq must be a non-negative number of epochs (0 "
                f"disables histograms); received histogram_freq={histogram_freq!r}."
            )
        if write_images:
            raise errors.UnsupportedArgumentError(
                "TensorBoard: write_images=True is not supported by mirrax (weights are not "
                "written as images). Pass write_images=False; histogram_freq=N writes weight "
                "histograms."
            )
        if embeddings_freq or embeddings_metadata is not None:
            raise errors.UnsupportedArgumentError(
                "TensorBoard: the embedding projector is not supported by mirrax; received "
                f"embeddings_freq={embeddings_freq!r}, embeddings_metadata="
                f"{embeddings_metadata!r}. Leave them at 0 and None."
            )
        self.log_dir = os.fspath(log_dir)
        self.histogram_freq = int(histogram_freq)
        self.write_graph = write_graph
        self.write_images = write_images
        self.write_steps_per_second = write_steps_per_second
        self.update_freq = update_freq if update_freq == "epoch" else int(update_freq)
        self._start_batch, self._stop_batch = _profile_range(profile_batch)
        self._train_dir = os.path.join(self.log_dir, "train")
        self._val_dir = os.path.join(self.log_dir, "validation")
        self._writers: dict = {}
        self._in_training = False
        self._step = 0  # training steps done, across epochs
        self._steps_before_epoch = 0
        self._last_batch_write = 0
        self._epoch_start_time = 0.0
        self._batch_start_time = 0.0
        self._is_tracing = False

    # -- writers --------------------------------------------------------------------------------

    def _writer(self, name: str):
        if name not in self._writers:
            directory = self._train_dir if name == "train" else self._val_dir
            self._writers[name] = _summary_writer(directory)
        return self._writers[name]

    def _close_writers(self) -> None:
        for writer in self._writers.values():
            writer.close()
        self._writers = {}

    # -- hooks ----------------------------------------------------------------------------------

    def on_train_begin(self, logs: dict | None = None) -> None:
        """Resets the step count (the global step restarts at each `fit`, as Keras)."""
        self._in_training = True
        self._step = 0
        self._steps_before_epoch = 0
        self._last_batch_write = 0

    def on_train_end(self, logs: dict | None = None) -> None:
        """Stops a running profile and closes the writers."""
        self._in_training = False
        if self._is_tracing:
            self._stop_trace()
        self._close_writers()

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        """Notes the epoch's start (for steps per second)."""
        self._steps_before_epoch = self._step
        self._epoch_start_time = time.monotonic()

    def needs_model_between_batches(self, kind: str) -> bool:
        # Its batch hooks write the batch logs and start or stop the profiler.
        return overrides_batch_hooks(self, kind, TensorBoard)

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        """Starts the profiler at the first profiled step."""
        self._batch_start_time = time.monotonic()
        next_step = self._steps_before_epoch + batch + 1
        if self._start_batch and not self._is_tracing and self._start_batch <= next_step <= self._stop_batch:
            self._start_trace()

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        """Writes `batch_<key>` every `update_freq` steps; stops the profiler after its range."""
        self._step = self._steps_before_epoch + batch + 1
        if (
            self.update_freq != "epoch"
            and self._step // self.update_freq > self._last_batch_write // self.update_freq
        ):
            self._last_batch_write = self._step
            if is_chief():
                writer = self._writer("train")
                for name, value in (logs or {}).items():
                    if _is_scalar(value):
                        writer.add_scalar("batch_" + name, float(value), self._step)
                if self.write_steps_per_second:
                    seconds = time.monotonic() - self._batch_start_time
                    if seconds > 0:
                        writer.add_scalar("batch_steps_per_second", 1.0 / seconds, self._step)
        if self._is_tracing and self._step >= self._stop_batch:
            self._stop_trace()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        """Writes the epoch's training and validation scalars (and histograms when due)."""
        if not is_chief():
            return
        logs = logs or {}
        train_logs = {k: v for k, v in logs.items() if not k.startswith("val_")}
        val_logs = {k[len("val_") :]: v for k, v in logs.items() if k.startswith("val_")}
        if "learning_rate" not in train_logs:
            rate = _learning_rate_or_none(self.model)
            if rate is not None:
                train_logs["learning_rate"] = rate
        if self.write_steps_per_second:
            seconds = time.monotonic() - self._epoch_start_time
            steps = self._step - self._steps_before_epoch
            train_logs["steps_per_second"] = steps / seconds if seconds > 0 else 0.0
        for writer_name, values in (("train", train_logs), ("validation", val_logs)):
            scalars = {k: v for k, v in values.items() if _is_scalar(v)}
            if scalars:
                writer = self._writer(writer_name)
                for name, value in scalars.items():
                    writer.add_scalar("epoch_" + name, float(value), epoch)
        if self.histogram_freq and epoch % self.histogram_freq == 0:
            writer = self._writer("train")
            weights = self.model.get_weights()
            module = getattr(self.model, "module", None)
            tags = (
                weights_lib.histogram_tags(module)
                if module is not None
                else [f"weight_{i}/histogram" for i in range(len(weights))]
            )
            for tag, weight in zip(tags, weights):
                writer.add_histogram(tag, np.asarray(weight), epoch)
        for writer in self._writers.values():
            writer.flush()

    def on_test_end(self, logs: dict | None = None) -> None:
        """Writes `evaluation_<key>_vs_iterations` (step: training steps so far)."""
        if not is_chief():
            return
        scalars = {k: v for k, v in (logs or {}).items() if _is_scalar(v)}
        if scalars:
            writer = self._writer("validation")
            for name, value in scalars.items():
                writer.add_scalar(f"evaluation_{name}_vs_iterations", float(value), self._step)
            writer.flush()
        if not self._in_training:
            self._close_writers()

    # -- profiling ------------------------------------------------------------------------------

    def _start_trace(self) -> None:
        try:
            jax.profiler.start_trace(self._train_dir)
            self._is_tracing = True
        except Exception as error:  # a profiler failure must not stop training (as Keras)
            warnings.warn(f"TensorBoard: could not start the JAX profiler: {error}", stacklevel=3)

    def _stop_trace(self) -> None:
        try:
            jax.profiler.stop_trace()
        except Exception as error:
            warnings.warn(f"TensorBoard: could not stop the JAX profiler: {error}", stacklevel=3)
        finally:
            self._is_tracing = False


def _is_scalar(value) -> bool:
    if isinstance(value, (str, bytes, bool)):
        return False
    try:
        return np.ndim(value) == 0 and np.isreal(value)
    except Exception:
        return False


def _learning_rate_or_none(model) -> float | None:
    optimizer = getattr(model, "optimizer", None)
    try:
        rate = getattr(optimizer, "learning_rate", None)
        return None if rate is None else float(np.asarray(rate))
    except (TypeError, ValueError, AttributeError, LookupError):
        return None
