"""`mirrax.Checkpoint` and `mirrax.CheckpointManager`: tf.train's checkpoint API on Orbax.

A checkpoint is an Orbax composite checkpoint directory with one item per tracked part (an NNX
module's state, an optimizer's state, a metric's state, a step counter). mirrax writes no
format of its own: Orbax writes every array once (whatever the replica count), to a temporary
directory that it renames when complete, so a reader never sees a half-written checkpoint.
Restoring reads each array straight onto the CURRENT placement of the object it restores into,
so a checkpoint written under 4 replicas restores under 1, 2 or 8, or `OneDeviceStrategy`.
"""

from __future__ import annotations

import atexit
import datetime
import os
import threading
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from mirrax._src.distribute.input import DistributedIterator
from mirrax._src.training.model import Model, _mismatches

# Item holding `Checkpoint.save_counter` (TF's name); `read` leaves it alone, as TF's does.
_SAVE_COUNTER = "save_counter"


class _Part:
    """One Orbax item: how to read a tracked object's state and how to write it back."""

    def __init__(self, item: str, get, set_, check=None):
        self.item = item
        self.get = get  # () -> pytree of arrays (the current state, on its current placement)
        self.set = set_  # (restored pytree) -> None
        self.check = check  # () -> None; raises ValueError if the object cannot take a restore


def _str_keys(tree):
    """Orbax stores dict keys as strings; NNX's pure dicts index sequences with ints."""
    if isinstance(tree, dict):
        return {str(k): _str_keys(v) for k, v in tree.items()}
    return tree


def _nnx_part(item: str, obj) -> _Part:
    def set_(restored):
        state = nnx.state(obj)
        nnx.replace_by_pure_dict(state, nnx.restore_int_paths(restored))
        nnx.update(obj, state)

    return _Part(item, lambda: _str_keys(nnx.to_pure_dict(nnx.state(obj))), set_)


def _value_part(item: str, owner: Checkpoint, name: str) -> _Part:
    """A plain value (a Python int or float, an array): restoring rebinds `owner.<name>`."""

    def get():
        return {"value": owner._objects[name]}

    def set_(restored):
        old = owner._objects[name]
        new = restored["value"]
        if isinstance(old, (bool, int, float)):
            new = type(old)(np.asarray(new).item())
        owner._objects[name] = new

    return _Part(item, get, set_)


def _iterator_part(item: str, iterator: DistributedIterator) -> _Part:
    """A data iterator's position: the batches handed to the caller (prefetched ones are not
    counted). Restoring re-reads that many batches from a fresh iterator and discards them."""
    return _Part(
        item,
        lambda: {"position": np.asarray(iterator._handed, np.int64)},
        lambda restored: iterator._skip_to(int(np.asarray(restored["position"]))),
        iterator._check_fresh,
    )


def _parts(owner: Checkpoint, name: str, obj) -> list:
    if isinstance(obj, Model):
        parts = [_nnx_part(f"{name}.module", obj.module)]
        if obj.optimizer is not None:
            parts.append(_nnx_part(f"{name}.optimizer", obj.optimizer.nnx_optimizer))
        return parts
    if isinstance(obj, nnx.Variable):
        return [_Part(name, lambda: {"value": obj.get_value()},
                      lambda restored: obj.set_value(restored["value"]))]
    if isinstance(obj, nnx.Pytree):
        return [_nnx_part(name, obj)]
    if isinstance(obj, DistributedIterator):
        return [_iterator_part(name, obj)]
    if isinstance(obj, (bool, int, float, np.ndarray, np.generic, jax.Array)):
        return [_value_part(name, owner, name)]
    raise TypeError(
        f"Checkpoint cannot track {name}={type(obj).__name__}; it tracks nnx.Module, "
        "nnx.Optimizer, mirrax metrics (nnx.Pytree), nnx.Variable, mirrax.Model, a "
        "DistributedIterator (its position), and plain numbers or arrays (step counters)."
    )


def _abstract(tree):
    """The restore target: each leaf's shape and dtype, placed where the leaf lives now."""

    def leaf(a):
        if isinstance(a, jax.Array):
            return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
        return np.asarray(a)  # a host value restores as a NumPy array

    return jax.tree.map(leaf, tree)


def _as_arrays(tree):
    return jax.tree.map(lambda a: a if isinstance(a, jax.Array) else np.asarray(a), tree)


# Orbax managers with an asynchronous save that nobody has waited for yet (held strongly, so
# a save outlives a dropped CheckpointManager), and whether the exit hook is registered.
_IN_FLIGHT: set = set()
_EXIT_HOOK: list = []


def _wait_for_all_in_flight() -> None:
    while _IN_FLIGHT:
        _IN_FLIGHT.pop().wait_until_finished()


def _register_exit_hook() -> None:
    """Waits for in-flight saves at exit BEFORE concurrent.futures shuts its executors down
    (Orbax's writer thread still needs them; `atexit` runs too late: "cannot schedule new
    futures after shutdown"). threading's hooks run newest first, so registering after
    concurrent.futures was imported puts this one ahead of its shutdown."""
    if _EXIT_HOOK:
        return
    register = getattr(threading, "_register_atexit", atexit.register)
    register(_wait_for_all_in_flight)
    _EXIT_HOOK.append(True)


def _checkpointer(names) -> ocp.Checkpointer:
    """A composite Orbax checkpointer that reads every named item as a standard pytree item."""
    return ocp.Checkpointer(
        ocp.CompositeCheckpointHandler(**{n: ocp.StandardCheckpointHandler() for n in names})
    )


def _stored_items(path: str, what: str) -> dict:
    """The checkpoint's item name -> tree metadata, with clear errors for a bad directory."""
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"Checkpoint.{what}: no checkpoint directory at {path}; write one with "
            "Checkpoint.save(path) or CheckpointManager.save()."
        )
    if ocp.path.step.TMP_DIR_SUFFIX in os.path.basename(path):
        raise ValueError(
            f"Checkpoint.{what}: {path} is an unfinished save (Orbax's temporary directory: the "
            "save was interrupted before it was committed). Restore an earlier checkpoint "
            "(CheckpointManager.checkpoints lists the complete ones)."
        )
    try:
        names = [n for n in os.listdir(path) if os.path.isdir(os.path.join(path, n))]
        metadata = _checkpointer(names).metadata(path)
        items = metadata.item_metadata
        names = list(items.keys()) if items is not None else []
        stored = {name: items[name].tree for name in names if items[name] is not None}
    except (FileNotFoundError, ValueError, KeyError, AttributeError, TypeError, OSError) as e:
        raise ValueError(
            f"Checkpoint.{what}: {path} is not a readable mirrax checkpoint (empty, truncated, "
            f"or written by something else, e.g. Model.save_weights): {type(e).__name__}: {e}. "
            "Restore an earlier checkpoint (CheckpointManager.checkpoints lists them)."
        ) from e
    if not stored:
        raise ValueError(
            f"Checkpoint.{what}: {path} holds no checkpoint items (empty or truncated "
            "directory, or written by Model.save_weights, which Model.load_weights reads)."
        )
    return stored


def _root_cause(error: BaseException) -> str:
    """The innermost error's first line: TensorStore's own words (file, byte range), without
    the pages of TensorStore spec that Orbax's wrapper adds."""
    seen = set()
    while id(error) not in seen and (error.__cause__ or error.__context__) is not None:
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    lines = str(error).strip().splitlines() or [""]
    return f"{type(error).__name__}: {lines[0][:500]}"


class CheckpointLoadStatus:
    """What a restore matched, as the status `tf.train.Checkpoint.restore` returns.

    Attributes:
      unused_in_checkpoint: item names stored in the checkpoint that no tracked object took.
      not_in_checkpoint: tracked items (`name` or `name.module` / `name.optimizer` for a
        `Model`) that the checkpoint does not hold; they keep their current values.
    """

    def __init__(self, path: str, unused_in_checkpoint: list, not_in_checkpoint: list):
        self.path = path
        self.unused_in_checkpoint = unused_in_checkpoint
        self.not_in_checkpoint = not_in_checkpoint

    def assert_consumed(self) -> CheckpointLoadStatus:
        """Raises AssertionError unless every tracked object and every stored item matched."""
        self.assert_existing_objects_matched()
        if self.unused_in_checkpoint:
            raise AssertionError(
                f"The checkpoint at {self.path} holds items that nothing tracked took: "
                f"{self.unused_in_checkpoint}. Track them in the Checkpoint, or call "
                "expect_partial() if leaving them out is intended."
            )
        return self

    def assert_existing_objects_matched(self) -> CheckpointLoadStatus:
        """Raises AssertionError if a tracked object found nothing in the checkpoint."""
        if self.not_in_checkpoint:
            raise AssertionError(
                f"The checkpoint at {self.path} has nothing for {self.not_in_checkpoint}; "
                "they kept their current values. Restore from a checkpoint that tracked them "
                "under the same names."
            )
        return self

    def expect_partial(self) -> CheckpointLoadStatus:
        """Accepts a partial match (as TF's; mirrax warns about nothing, so this only returns)."""
        return self


class Checkpoint:
    """Saves and restores training state, as `tf.train.Checkpoint`, written by Orbax.

    Tracked objects are passed by keyword: `nnx.Module`s, `nnx.Optimizer`s, mirrax metrics
    (any `nnx.Pytree`), `nnx.Variable`s, `mirrax.Model`s (their module and, once compiled,
    their optimizer state) and plain numbers or arrays such as a step counter (restoring
    rebinds the attribute: `ckpt.step`). Tracked objects are attributes: `ckpt.model`.
    A `DistributedIterator` is tracked by its position (batches handed out, not prefetched);
    restoring into a fresh iterator over the same dataset re-reads and discards that many
    batches, so the source must be deterministic (a shuffling source seeded alike).

    Each array is written once (not once per replica), so the size does not depend on the
    replica count. Restoring places every array where the target object's array lives NOW,
    so a checkpoint saved under any strategy restores under any other. Loading never executes
    code from the checkpoint: Orbax stores arrays (TensorStore) and JSON metadata, not pickle.

    Example:
      ckpt = mirrax.Checkpoint(model=model, optimizer=optimizer, step=0)
      ckpt.save("/tmp/ckpt")
      ckpt.restore("/tmp/ckpt").assert_consumed()

    Attributes:
      save_counter: number of `save` calls (restored by `restore`, not by `read`), as TF's.
    """

    def __init__(self, **objects: Any):
        object.__setattr__(self, "_objects", {})
        object.__setattr__(self, "save_counter", 0)
        for name, obj in objects.items():
            setattr(self, name, obj)

    def __setattr__(self, name, value):
        if name.startswith("_") or name == _SAVE_COUNTER:
            if name == _SAVE_COUNTER:
                object.__setattr__(self, name, value)
                return
            raise ValueError(f"Checkpoint cannot track a name that starts with '_': {name!r}.")
        _parts(self, name, value)  # validates the kind
        self._objects[name] = value

    def __getattr__(self, name):
        objects = self.__dict__.get("_objects", {})
        if name in objects:
            return objects[name]
        raise AttributeError(f"Checkpoint tracks no object named {name!r}; it tracks {sorted(objects)}.")

    def _all_parts(self) -> list:
        return [part for name, obj in self._objects.items() for part in _parts(self, name, obj)]

    def save(self, path) -> str:
        """Writes every tracked object to the directory `path` (replaced if it exists).

        Atomic: Orbax writes to a temporary directory and renames it when complete. In a
        multi-process run every process calls `save`; Orbax lets process 0 write.

        Returns:
          The absolute path written.
        """
        path = os.path.abspath(os.fspath(path))
        self.save_counter += 1
        checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
        checkpointer.save(path, self._save_args(), force=True)
        return path

    def _save_args(self) -> ocp.args.Composite:
        items = {part.item: ocp.args.StandardSave(_as_arrays(part.get())) for part in self._all_parts()}
        counter = np.asarray(self.save_counter, np.int64)
        items[_SAVE_COUNTER] = ocp.args.StandardSave({"value": counter})
        return ocp.args.Composite(**items)

    def restore(self, path) -> CheckpointLoadStatus:
        """Reads the checkpoint at `path` into the tracked objects, placed where they are now.

        A tracked object whose name is not in the checkpoint keeps its values, and a stored
        item nothing tracks is left unread; the returned status reports both
        (`assert_consumed()`, `expect_partial()`), as TF's. Nothing is changed unless every
        matched item fits.

        Raises:
          FileNotFoundError: no directory at `path`.
          ValueError: the directory is not a readable checkpoint; or a tracked object's
            structure, shapes or dtypes differ from the stored ones (the message lists each
            path with its stored and current shape or dtype); or a tracked
            `DistributedIterator` has already handed out batches (restore into a fresh one).
        """
        return self._restore(path, "restore", with_counter=True)

    def read(self, path) -> CheckpointLoadStatus:
        """As `restore`, but leaves `save_counter` alone (TF's `read` for `write`'s files)."""
        return self._restore(path, "read", with_counter=False)

    def _restore(self, path, what: str, with_counter: bool) -> CheckpointLoadStatus:
        path = os.path.abspath(os.fspath(path))
        stored = _stored_items(path, what)
        parts = self._all_parts()
        matched = [part for part in parts if part.item in stored]
        problems = []
        for part in matched:
            for line in _mismatches(_as_arrays(part.get()), stored[part.item]):
                problems.append(f"{part.item}{line}")
        if problems:
            raise ValueError(
                f"Checkpoint.{what}: the checkpoint at {path} does not fit the tracked objects; "
                + "; ".join(problems[:20])
                + (f"; and {len(problems) - 20} more" if len(problems) > 20 else "")
                + ". Restore a checkpoint saved from objects with the same structure and dtypes."
            )
        for part in matched:
            if part.check is not None:
                part.check()
        targets = {part.item: ocp.args.StandardRestore(_abstract(_as_arrays(part.get()))) for part in matched}
        if with_counter and _SAVE_COUNTER in stored:
            targets[_SAVE_COUNTER] = ocp.args.StandardRestore({"value": np.asarray(0, np.int64)})
        if targets:
            try:
                restored = _checkpointer(list(targets)).restore(path, ocp.args.Composite(**targets))
            except Exception as e:  # Orbax wraps TensorStore's read errors in a bare Exception
                raise ValueError(
                    f"Checkpoint.{what}: could not read the arrays of the checkpoint at {path}; "
                    f"a data file is truncated or corrupt ({_root_cause(e)}). Nothing was changed. "
                    "Restore an earlier checkpoint (CheckpointManager.checkpoints lists them)."
                ) from e
            for part in matched:
                part.set(restored[part.item])
            if with_counter and _SAVE_COUNTER in stored:
                self.save_counter = int(np.asarray(restored[_SAVE_COUNTER]["value"]))
        tracked = {part.item for part in parts}
        return CheckpointLoadStatus(
            path,
            unused_in_checkpoint=sorted(set(stored) - tracked - {_SAVE_COUNTER}),
            not_in_checkpoint=sorted(tracked - set(stored)),
        )


class CheckpointManager:
    """Numbered checkpoints in one directory, as `tf.train.CheckpointManager`, on Orbax's.

    Checkpoint number n is written to `directory/n` by `checkpoint.save`'s machinery (atomic),
    and only the newest `max_to_keep` are kept (None keeps all), plus, with
    `keep_checkpoint_every_n_hours`, checkpoints at least that far apart in time.

    Args:
      checkpoint: the `mirrax.Checkpoint` to save and restore.
      directory: where the numbered checkpoints live (created if missing).
      max_to_keep: how many checkpoints to keep, newest first; None keeps every one.
      keep_checkpoint_every_n_hours: hours (float); also keep, beyond `max_to_keep`, the oldest
        kept checkpoint and each one committed at least this long after the previous one so
        kept (Orbax's `keep_time_interval`, which counts whole seconds: under 1/3600 hours
        every checkpoint is kept). Unlike TF's, the oldest checkpoint is always kept.
      checkpoint_interval: with it, `save(checkpoint_number=n)` writes only when n is at least
        this far past the last saved number (TF's rule); other calls return None.
      init_fn: called by `restore_or_initialize` when there is no checkpoint yet.
      async_save: if True, `save` returns once the state is copied, while the arrays are
        written in the background by Orbax's asynchronous checkpointer; the next `save`,
        `wait_until_finished`, `restore_or_initialize`, `checkpoints`, `latest_checkpoint`
        and process exit wait for it. The saved values are those at the time of `save`.
    """

    def __init__(self, checkpoint: Checkpoint, directory, max_to_keep: int | None = 5,
                 keep_checkpoint_every_n_hours: float | None = None,
                 checkpoint_interval: int | None = None, init_fn=None, async_save: bool = False):
        if not isinstance(checkpoint, Checkpoint):
            raise TypeError(
                f"CheckpointManager manages a mirrax.Checkpoint; received {type(checkpoint).__name__}."
            )
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"max_to_keep must be a positive int or None; received {max_to_keep}.")
        if keep_checkpoint_every_n_hours is not None and not keep_checkpoint_every_n_hours > 0:
            raise ValueError(
                "keep_checkpoint_every_n_hours must be a positive number of hours or None; "
                f"received {keep_checkpoint_every_n_hours}."
            )
        self.checkpoint = checkpoint
        self.directory = os.path.abspath(os.fspath(directory))
        self.max_to_keep = max_to_keep
        self.keep_checkpoint_every_n_hours = keep_checkpoint_every_n_hours
        self.checkpoint_interval = checkpoint_interval
        self.async_save = bool(async_save)
        self._init_fn = init_fn
        keep_time_interval = (
            None if keep_checkpoint_every_n_hours is None
            else datetime.timedelta(hours=keep_checkpoint_every_n_hours)
        )
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep,
                keep_time_interval=keep_time_interval,
                # Always Orbax's asynchronous writer (its default); a synchronous save waits
                # for it at once, which keeps one write path for both modes.
                enable_async_checkpointing=True,
                create=True,
            ),
        )

    def wait_until_finished(self) -> None:
        """Blocks until an asynchronous save in flight is committed (returns at once if none)."""
        self._manager.wait_until_finished()
        _IN_FLIGHT.discard(self._manager)

    def _path(self, number: int) -> str:
        return os.path.join(self.directory, str(number))

    @property
    def checkpoints(self) -> list:
        """Paths of the kept checkpoints, oldest first (waits for a save in flight)."""
        # Reloading while a save is in flight would drop it from Orbax's bookkeeping.
        self.wait_until_finished()
        self._manager.reload()
        return [self._path(n) for n in sorted(self._manager.all_steps())]

    @property
    def latest_checkpoint(self) -> str | None:
        """Path of the newest complete checkpoint, or None when there is none (waits for a save
        in flight)."""
        self.wait_until_finished()
        self._manager.reload()
        number = self._manager.latest_step()
        return None if number is None else self._path(number)

    def save(self, checkpoint_number: int | None = None) -> str | None:
        """Writes checkpoint number `checkpoint_number` (default: the checkpoint's save_counter
        after this save, as TF's), drops the oldest beyond `max_to_keep`, returns its path.

        Returns None when `checkpoint_interval` says it is too soon. With `async_save`, first
        waits for the previous save, then returns while this one is written.
        """
        self.wait_until_finished()
        self._manager.reload()
        last = self._manager.latest_step()
        if checkpoint_number is not None and self.checkpoint_interval is not None and last is not None:
            if int(checkpoint_number) - last < self.checkpoint_interval:
                return None
        ckpt = self.checkpoint
        ckpt.save_counter += 1
        number = ckpt.save_counter if checkpoint_number is None else int(checkpoint_number)
        self._manager.save(number, args=ckpt._save_args(), force=True)
        if self.async_save:
            # Orbax registers no exit hook; without one a save in flight at exit is lost.
            _register_exit_hook()
            _IN_FLIGHT.add(self._manager)
        else:
            self._manager.wait_until_finished()
        return self._path(number)

    def restore_or_initialize(self) -> str | None:
        """Restores the latest checkpoint and returns its path; with none, calls `init_fn`
        (if given) and returns None, as TF's."""
        latest = self.latest_checkpoint
        if latest is not None:
            self.checkpoint.restore(latest)
            return latest
        if self._init_fn is not None:
            self._init_fn()
        return None
