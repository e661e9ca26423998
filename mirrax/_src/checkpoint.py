"""`mirrax.Checkpoint` and `mirrax.CheckpointManager`: tf.train's checkpoint API on Orbax.

A checkpoint is an Orbax composite checkpoint directory with one item per tracked part (an NNX
module's state, an optimizer's state, a metric's state, a step counter). mirrax writes no
format of its own: Orbax writes every array once (whatever the replica count), to a temporary
directory that it renames when complete, so a reader never sees a half-written checkpoint.
Overwriting a checkpoint is atomic too (atomic_dirs.py): the new one is written beside the old
one and swapped in by rename, so a kill at any moment leaves the old or the new one restorable.
Restoring reads each array straight onto the CURRENT placement of the object it restores into,
so a checkpoint written under 4 replicas restores under 1, 2 or 8, or `OneDeviceStrategy`.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import json
import logging
import os
import sys
import threading
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from mirrax import errors
from mirrax._src import atomic_dirs

_LOG = logging.getLogger("mirrax")

# Item holding `Checkpoint.save_counter` (TF's name); `read` leaves it alone, as TF's does.
_SAVE_COUNTER = "save_counter"

# Orbax's file that a complete checkpoint directory holds (written before its commit rename).
_METADATA_FILE = "_CHECKPOINT_METADATA"
# Where CheckpointManager's Orbax manager renames a checkpoint it drops (max_to_keep), so the
# checkpoint vanishes from the directory in one rename; mirrax then deletes it from there.
_DELETED_SUBDIR = ".mirrax-deleted"

# Orbax's absl warnings that mirrax's own checks make redundant (each is either a condition
# mirrax reports as an error with the fix, or one it cleans up before Orbax sees it).
_QUIET_ORBAX_MESSAGES = (
    "Metadata file does not exist",  # a directory that is no checkpoint: mirrax raises
    "Attempted to create temporary directory",  # a killed save's leftover: mirrax removes it
    'Item "%s" was found in the checkpoint, but could not',  # items a restore leaves unread
    "Failed to get item metadata from directory",  # damaged metadata: mirrax raises
    "Waiting for previous save to complete took",  # mirrax waits on purpose
    "Failed to json parse Metadata file",  # damaged metadata (an ERROR line): mirrax raises
)


class _OrbaxNoiseFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_QUIET_ORBAX_MESSAGES)


_NOISE_FILTER = _OrbaxNoiseFilter()


@contextlib.contextmanager
def _quiet_orbax():
    """Drops the known, redundant Orbax warnings for the duration of one mirrax call.

    Also installs (once) the filter of `_ignore_closed_loop_callbacks` before Orbax starts any
    read: a failure can end Orbax's event loop while other reads are in flight at any stage
    (reading the item metadata, or the arrays), and their callbacks report right away.
    """
    _ignore_closed_loop_callbacks()
    logger = logging.getLogger("absl")
    logger.addFilter(_NOISE_FILTER)
    try:
        yield
    finally:
        logger.removeFilter(_NOISE_FILTER)


_UNRAISABLE_FILTER: list = []


def _is_closed_loop_callback(unraisable) -> bool:
    error, tb = unraisable.exc_value, unraisable.exc_traceback
    code = getattr(unraisable.object, "cr_code", None)  # an abandoned Orbax read coroutine
    if code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename:
        return True
    if not (isinstance(error, RuntimeError) and str(error) == "Event loop is closed"):
        return False
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    # Raised by asyncio itself (BaseEventLoop._check_closed), not by user code.
    return (tb is not None and tb.tb_frame.f_code.co_name == "_check_closed"
            and tb.tb_frame.f_code.co_filename.endswith(os.path.join("asyncio", "base_events.py")))


class _UnretrievedReadFilter(logging.Filter):
    """Drops asyncio's "Future (or Task) exception was never retrieved" for failed TensorStore
    reads."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not (str(record.msg).startswith(("Future exception was never retrieved",
                                                "Task exception was never retrieved"))
                    and error is not None and "tensorstore_spec" in str(error))


def _ignore_closed_loop_callbacks() -> None:
    """Drops the "Event loop is closed" tracebacks that follow a failed Orbax read.

    When one TensorStore read fails (a truncated file), Orbax's `asyncio.run` ends and closes
    its event loop while the other reads are still in flight; each of those later calls back
    into the closed loop (`loop.call_soon_threadsafe`) from a TensorStore thread, which reports
    the RuntimeError through `sys.unraisablehook` with no object, so Python prints a bare
    "Traceback ... RuntimeError: Event loop is closed" (no "Exception ignored" line; and, when
    an abandoned read coroutine of Orbax's is collected, "Exception ignored in: <coroutine
    ...>"), after or even before mirrax has raised its clear error. The hook (installed once,
    by `_quiet_orbax` before Orbax's first call, chained to the current one) drops exactly
    those: a RuntimeError "Event loop is closed" raised inside asyncio's `_check_closed`, or
    an unraisable whose object is an Orbax coroutine. Everything else goes to the previous
    hook.

    It used to be installed only after a failed array read, so the tracebacks of that first
    failure's in-flight reads, and of every failed metadata read, got through (measured: in
    each of 3 fresh processes doing 10 failed restores of a checkpoint whose files were all
    truncated to 10 bytes, 38 to 74 lines of traceback).
    """
    if _UNRAISABLE_FILTER:
        return
    # The sibling reads' futures and tasks, failed too and never awaited, are logged by asyncio
    # when collected ("Future/Task exception was never retrieved", with TensorStore's error).
    logging.getLogger("asyncio").addFilter(_UnretrievedReadFilter())
    previous = sys.unraisablehook

    def hook(unraisable):
        if not _is_closed_loop_callback(unraisable):
            previous(unraisable)

    sys.unraisablehook = hook
    _UNRAISABLE_FILTER.append(hook)


def _refuse_non_directory(path: str, what: str) -> None:
    if os.path.lexists(path) and not os.path.isdir(path):
        raise errors.ExistingPathError(
            f"{what}: {path} is a file, not a checkpoint directory; mirrax does not replace "
            "it. Save to another path, or delete the file first."
        )


def _looks_like_checkpoint(path: str) -> bool:
    """Whether a directory is (or was meant to be) an Orbax checkpoint, complete or damaged."""
    names = os.listdir(path)
    if not names or _METADATA_FILE in names or "commit_success.txt" in names:
        return True
    return any(os.path.isfile(os.path.join(path, n, "_METADATA")) for n in names)


def _refuse_to_replace(path: str, what: str) -> None:
    """A save replaces the whole directory at `path`: never a file, nor a directory of other
    things (Orbax's `force=True` deleted whatever was there, e.g. the working directory for
    `save('')`)."""
    _refuse_non_directory(path, what)
    if os.path.isdir(path) and not _looks_like_checkpoint(path):
        found = sorted(os.listdir(path))
        raise errors.ExistingPathError(
            f"{what}: {path} is a directory that holds no checkpoint (found {found[:10]}); a "
            "save replaces the whole directory, so mirrax refuses. Save to a new or empty "
            "directory, e.g. a subdirectory of it."
        )


def _is_complete(path: str) -> bool:
    """Whether `path` looks like a committed Orbax checkpoint (cheap: no array is read)."""
    return os.path.isfile(os.path.join(path, _METADATA_FILE))


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


def _protocol_part(item: str, obj) -> _Part:
    """An object that names its own state (`checkpoint_state()`, `restore_checkpoint_state(state)`,
    and optionally `check_restorable()`, called before any restore): a data iterator's position."""
    return _Part(item, obj.checkpoint_state, obj.restore_checkpoint_state,
                 getattr(obj, "check_restorable", None))


def _parts(owner: Checkpoint, name: str, obj) -> list:
    """The stored parts of `obj` tracked as `name`.

    mirrax's checkpoint protocol, for objects that are not NNX objects or plain values: an
    object with `checkpoint_children()` (a `mirrax.Model`: {"module": ..., "optimizer": ...})
    is stored as its children, each under f"{name}.{key}"; an object with `checkpoint_state()`
    and `restore_checkpoint_state(state)` (a `DistributedIterator`: its position) stores that
    dict of arrays.
    """
    children = getattr(obj, "checkpoint_children", None)
    if callable(children):
        return [part for key, child in children().items()
                for part in _parts(owner, f"{name}.{key}", child)]
    if isinstance(obj, nnx.Variable):
        return [_Part(name, lambda: {"value": obj.get_value()},
                      lambda restored: obj.set_value(restored["value"]))]
    if isinstance(obj, nnx.Pytree):
        return [_nnx_part(name, obj)]
    if callable(getattr(obj, "checkpoint_state", None)):
        return [_protocol_part(name, obj)]
    if isinstance(obj, (bool, int, float, np.ndarray, np.generic, jax.Array)):
        return [_value_part(name, owner, name)]
    raise errors.InvalidArgumentTypeError(
        f"Checkpoint cannot track {name}={type(obj).__name__}; it tracks nnx.Module, "
        "nnx.Optimizer, mirrax metrics (nnx.Pytree), nnx.Variable, mirrax.Model, a "
        "DistributedIterator (its position), and plain numbers or arrays (step counters)."
    )


def _is_key(leaf) -> bool:
    return hasattr(leaf, "dtype") and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)


def _storable(tree):
    """The tree as Orbax stores it: each typed PRNG key array (`jax.random.key`, the keys of
    `nnx.Rngs`) as its raw uint32 key data, so the shapes a restore compares are the stored
    ones; a legacy uint32 key (`jax.random.PRNGKey`) is a plain array already."""
    return jax.tree.map(lambda a: jax.random.key_data(a) if _is_key(a) else a, tree)


def _unstorable(restored, current):
    """Re-wraps restored key data as typed keys of the implementation the target holds now."""
    return jax.tree.map(
        lambda now, new: jax.random.wrap_key_data(new, impl=jax.random.key_impl(now))
        if _is_key(now) else new,
        current, restored)


def _mismatches(current: dict, stored: dict) -> list:
    """Human-readable differences between a part's storable state and the stored metadata."""
    flat_now = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(current)[0]}
    flat_old = {
        jax.tree_util.keystr(k): v
        for k, v in jax.tree_util.tree_flatten_with_path(
            stored, is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype"))[0]
    }
    out = []
    for key in sorted(set(flat_now) | set(flat_old)):
        if key not in flat_old:
            out.append(f"{key} is missing from the checkpoint")
        elif key not in flat_now:
            out.append(f"{key} is in the checkpoint but not in the model")
        elif not hasattr(flat_old[key], "shape"):
            out.append(f"{key} is stored as {type(flat_old[key]).__name__}, not an array")
        elif tuple(flat_now[key].shape) != tuple(flat_old[key].shape):
            out.append(f"{key} has shape {tuple(flat_old[key].shape)} in the checkpoint, "
                       f"{tuple(flat_now[key].shape)} in the model")
        elif np.dtype(flat_now[key].dtype) != np.dtype(flat_old[key].dtype):
            out.append(f"{key} has dtype {flat_old[key].dtype} in the checkpoint, "
                       f"{flat_now[key].dtype} in the model")
    return out


def _abstract(tree):
    """The restore target: each leaf's shape and dtype, placed where the leaf lives now."""

    def leaf(a):
        if isinstance(a, jax.Array):
            return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
        return np.asarray(a)  # a host value restores as a NumPy array

    return jax.tree.map(leaf, tree)


def _as_arrays(tree):
    """Leaves as arrays, typed PRNG keys as their key data (what Orbax writes and reads)."""
    return _storable(jax.tree.map(lambda a: a if isinstance(a, jax.Array) else np.asarray(a), tree))


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
    if ocp.path.step.TMP_DIR_SUFFIX in os.path.basename(path):
        raise errors.InvalidCheckpointError(
            f"{what}: {path} is an unfinished save (Orbax's temporary directory: the "
            "save was interrupted before it was committed). Restore an earlier checkpoint "
            "(CheckpointManager.checkpoints lists the complete ones)."
        )
    if not _is_complete(path):
        found = sorted(os.listdir(path))
        raise errors.InvalidCheckpointError(
            f"{what}: {path} is not a complete mirrax checkpoint: it has no {_METADATA_FILE} "
            f"(found {found or 'an empty directory'}). Restore a directory written by "
            "Checkpoint.save or Model.save_weights (CheckpointManager.checkpoints lists the "
            "complete ones)."
        )
    _check_listed_items(path, what)
    try:
        with _quiet_orbax():
            names = [n for n in os.listdir(path) if os.path.isdir(os.path.join(path, n))]
            metadata = _checkpointer(names).metadata(path)
        items = metadata.item_metadata
        names = list(items.keys()) if items is not None else []
        stored = {name: items[name].tree for name in names if items[name] is not None}
    except (FileNotFoundError, ValueError, KeyError, AttributeError, TypeError, OSError) as e:
        raise errors.InvalidCheckpointError(
            f"{what}: {path} is not a readable mirrax checkpoint (empty, truncated, "
            f"or written by something else): {type(e).__name__}: {e}. "
            "Restore an earlier checkpoint (CheckpointManager.checkpoints lists them)."
        ) from e
    if not stored:
        raise errors.InvalidCheckpointError(
            f"{what}: {path} holds no readable checkpoint items (its item metadata is "
            "missing or damaged). Restore an earlier checkpoint."
        )
    return stored


def _check_listed_items(path: str, what: str) -> None:
    """Every item Orbax's metadata lists must be a directory (a file or nothing there means the
    checkpoint is damaged; without this a restore would report the item as merely absent)."""
    try:
        with open(os.path.join(path, _METADATA_FILE)) as f:
            listed = json.load(f).get("item_handlers") or {}
    except (OSError, ValueError, AttributeError):
        return  # unreadable metadata: Orbax's reader below reports it
    damaged = sorted(n for n in listed if not os.path.isdir(os.path.join(path, n)))
    if damaged:
        raise errors.InvalidCheckpointError(
            f"{what}: the checkpoint at {path} is damaged: its metadata lists the items "
            f"{damaged}, which are missing or not directories. Restore an earlier checkpoint "
            "(CheckpointManager.checkpoints lists them)."
        )


def _restore_parts(path: str, what: str, parts: list, stored: dict, counter: bool) -> dict:
    """Reads the stored items of `parts` into them (all or nothing); returns what was read.

    Raises IncompatibleCheckpointError before changing anything if a part does not fit, and
    InvalidCheckpointError if an array file cannot be read.
    """
    problems = []
    for part in parts:
        for line in _mismatches(_as_arrays(part.get()), stored[part.item]):
            problems.append(f"{part.item}{line}")
    if problems:
        raise errors.IncompatibleCheckpointError(
            f"{what}: the checkpoint at {path} does not fit the tracked objects; "
            + "; ".join(problems[:20])
            + (f"; and {len(problems) - 20} more" if len(problems) > 20 else "")
            + ". Restore a checkpoint saved from objects with the same structure and dtypes."
        )
    for part in parts:
        if part.check is not None:
            part.check()
    targets = {part.item: ocp.args.StandardRestore(_abstract(_as_arrays(part.get()))) for part in parts}
    if counter:
        targets[_SAVE_COUNTER] = ocp.args.StandardRestore({"value": np.asarray(0, np.int64)})
    if not targets:
        return {}
    try:
        with _quiet_orbax():
            restored = _checkpointer(list(targets)).restore(path, ocp.args.Composite(**targets))
    except Exception as e:  # Orbax wraps TensorStore's read errors in a bare Exception
        _ignore_closed_loop_callbacks()
        raise errors.InvalidCheckpointError(
            f"{what}: could not read the arrays of the checkpoint at {path}; "
            f"a data file is truncated or corrupt ({_root_cause(e)}). Nothing was changed. "
            "Restore an earlier checkpoint (CheckpointManager.checkpoints lists them)."
        ) from e
    # Parts with a check first: their set can still fail (an iterator fast-forwarding past the
    # end of its dataset), and must fail before any other object is changed.
    for part in sorted(parts, key=lambda part: part.check is None):
        part.set(_unstorable(restored[part.item], part.get()))
    return restored


def _write_checkpoint(target: str, save_args) -> None:
    """One Orbax composite save to the fresh directory `target` (committed by Orbax's rename)."""
    with _quiet_orbax():
        ocp.Checkpointer(ocp.CompositeCheckpointHandler()).save(target, save_args, force=True)


# -- Model.save_weights / Model.load_weights (model.py delegates here) ---------------------------


def save_weights(model, filepath, overwrite: bool = True) -> None:
    """`Model.save_weights`: the module's variables as a `Checkpoint(weights=model.module)`."""
    path = atomic_dirs.checked_path(filepath, "save_weights")
    if not isinstance(overwrite, (bool, np.bool_)):
        raise errors.InvalidArgumentTypeError(
            f"save_weights: overwrite must be True or False; received {overwrite!r}."
        )
    _refuse_to_replace(path, "save_weights")
    if os.path.exists(path) and not overwrite:
        raise errors.ExistingPathError(
            f"save_weights: {path} exists; pass overwrite=True to replace it."
        )
    Checkpoint(weights=model.module).save(path)


def load_weights(model, filepath) -> None:
    """`Model.load_weights`: from `save_weights`'s output, or the module of a full checkpoint
    (`Checkpoint(model=model)`, `ModelCheckpoint`'s default), as Keras's from a full save."""
    path = atomic_dirs.resolve(
        atomic_dirs.checked_path(filepath, "load_weights"), "load_weights", _is_complete,
        missing=f"load_weights: no weights directory at {os.path.abspath(os.fspath(filepath))}; "
                "write one with model.save_weights(path).")
    stored = _stored_items(path, "load_weights")
    modules = sorted(n for n in stored if n.endswith(".module"))
    if "weights" in stored:
        item = "weights"
    elif len(modules) == 1:
        item = modules[0]
    else:
        items = sorted(set(stored) - {_SAVE_COUNTER}) or sorted(stored)
        name = modules[0].rsplit(".", 1)[0] if modules else items[0]
        raise errors.IncompatibleCheckpointError(
            f"load_weights: the checkpoint at {path} holds no single model's weights (its "
            f"items: {items}); load_weights reads what model.save_weights or "
            f"Checkpoint(model=model) wrote. Restore it with "
            f"mirrax.Checkpoint({name}=<the object saved>).restore({path!r})."
        )
    _restore_parts(path, "load_weights", [_nnx_part(item, model.module)], stored, counter=False)


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
            hint = (" It holds 'weights' (Model.save_weights's output): read it with "
                    "model.load_weights(path)." if "weights" in self.unused_in_checkpoint else "")
            raise AssertionError(
                f"The checkpoint at {self.path} has nothing for {self.not_in_checkpoint}; "
                "they kept their current values. Restore from a checkpoint that tracked them "
                f"under the same names.{hint}"
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
            raise errors.InvalidArgumentError(
                f"Checkpoint cannot track a name that starts with '_': {name!r}; rename it, "
                "e.g. Checkpoint(model=...) (names starting with '_' are the Checkpoint's own).")
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

        Atomic, also when replacing: Orbax writes the new checkpoint to a temporary directory
        beside `path` and renames it when complete, then mirrax swaps it in by rename, so a
        kill at any moment leaves the old or the new checkpoint restorable from `path`. In a
        multi-process run every process calls `save`; Orbax lets process 0 write.

        Returns:
          The absolute path written.

        Raises:
          ExistingPathError: `path` is a regular file, or a non-empty directory that is no
            checkpoint (neither is ever replaced).
          InvalidArgumentTypeError: `path` is not a str or os.PathLike.
        """
        path = atomic_dirs.checked_path(path, "Checkpoint.save")
        _refuse_to_replace(path, "Checkpoint.save")
        self.save_counter += 1
        save_args = self._save_args()
        atomic_dirs.replace_atomically(
            path, lambda target: _write_checkpoint(target, save_args), _is_complete)
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
        matched item fits. PRNG state (`nnx.Rngs` keys and counts, typed or legacy keys) is
        restored exactly. If a save was killed while replacing `path` (between its two
        renames), the complete checkpoint left beside it is read instead (logged).

        Raises:
          MissingCheckpointError (a FileNotFoundError): no directory at `path`.
          InvalidCheckpointError (a ValueError): the directory is not a complete, readable
            checkpoint (no metadata, an unfinished save, a truncated data file), or `path` is
            a file.
          IncompatibleCheckpointError (a ValueError): a tracked object's structure, shapes or
            dtypes differ from the stored ones (the message lists each path with its stored
            and current shape or dtype); or no tracked name is in the checkpoint at all (a
            partial match is TF's status instead).
          ValueError: a tracked `DistributedIterator` has already handed out batches.
        """
        return self._restore(path, "restore", with_counter=True)

    def read(self, path) -> CheckpointLoadStatus:
        """As `restore`, but leaves `save_counter` alone (TF's `read` for `write`'s files)."""
        return self._restore(path, "read", with_counter=False)

    def _restore(self, path, what: str, with_counter: bool) -> CheckpointLoadStatus:
        what = f"Checkpoint.{what}"
        path = atomic_dirs.resolve(atomic_dirs.checked_path(path, what), what, _is_complete)
        stored = _stored_items(path, what)
        parts = self._all_parts()
        matched = [part for part in parts if part.item in stored]
        items = sorted(set(stored) - {_SAVE_COUNTER})
        if parts and items and not matched:
            # TF returns a status that asserts later; a restore that changes nothing is never
            # what was meant, so it is refused while nothing has been touched.
            hint = (" It holds 'weights', Model.save_weights's output: read it with "
                    "model.load_weights(path), or track the module as weights=model.module."
                    if "weights" in items else
                    " A mirrax.Model saved as NAME is stored as NAME.module (and NAME.optimizer): "
                    "track a mirrax.Model under NAME to restore it." if any(
                        i.endswith(".module") for i in items) else "")
            raise errors.IncompatibleCheckpointError(
                f"{what}: nothing this Checkpoint tracks ({sorted(p.item for p in parts)}) is in "
                f"the checkpoint at {path}, which holds {items}; nothing was restored. Track the "
                f"objects under the names they were saved with.{hint}"
            )
        counter = with_counter and _SAVE_COUNTER in stored
        restored = _restore_parts(path, what, matched, stored, counter)
        if counter:
            self.save_counter = int(np.asarray(restored[_SAVE_COUNTER]["value"]))
        tracked = {part.item for part in parts}
        return CheckpointLoadStatus(
            path,
            unused_in_checkpoint=sorted(set(stored) - tracked - {_SAVE_COUNTER}),
            not_in_checkpoint=sorted(tracked - set(stored)),
        )


def _check_count(value, name: str, owner: str, minimum: int, allow_none: bool = True):
    """`value` if it is an int >= minimum (or None where allowed), else a clear error."""
    if value is None and allow_none:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise errors.InvalidArgumentTypeError(
            f"{owner}: {name} must be an int{' or None' if allow_none else ''}; received "
            f"{value!r} of type {type(value).__name__}. Pass e.g. {name}={max(minimum, 3)}."
        )
    if value < minimum:
        raise errors.InvalidArgumentError(
            f"{owner}: {name} must be >= {minimum}{' or None' if allow_none else ''}; "
            f"received {value}."
        )
    return int(value)


class CheckpointManager:
    """Numbered checkpoints in one directory, as `tf.train.CheckpointManager`, on Orbax's.

    Checkpoint number n is written to `directory/n` by Orbax (to a temporary directory renamed
    when complete), and only the newest `max_to_keep` are kept (None keeps all), plus, with
    `keep_checkpoint_every_n_hours`, checkpoints at least that far apart in time. A dropped
    checkpoint is first renamed into `directory/.mirrax-deleted` (one atomic step, after the
    new one is committed), then deleted, so a kill at any moment leaves the newest committed
    checkpoint restorable. Saving a number that exists replaces it atomically (as
    `Checkpoint.save`). Directories that are not complete checkpoints (an empty numbered
    folder, an unfinished save) are skipped by `checkpoints` and `latest_checkpoint` with a
    log line, and moved aside (renamed `<n>.mirrax-incomplete`) by the next `save`.

    Args:
      checkpoint: the `mirrax.Checkpoint` to save and restore.
      directory: where the numbered checkpoints live (created if missing).
      max_to_keep: how many checkpoints to keep, newest first (an int >= 1); None keeps every one.
      keep_checkpoint_every_n_hours: hours (float); also keep, beyond `max_to_keep`, the oldest
        kept checkpoint and each one committed at least this long after the previous one so
        kept (Orbax's `keep_time_interval`, which counts whole seconds: under 1/3600 hours
        every checkpoint is kept). Unlike TF's, the oldest checkpoint is always kept.
      checkpoint_interval: with it (an int >= 0), `save(checkpoint_number=n)` writes only when
        n is at least this far past the last saved number (TF's rule); other calls return None.
      init_fn: called by `restore_or_initialize` when there is no checkpoint yet.
      async_save: if True, `save` returns once the state is copied, while the arrays are
        written in the background by Orbax's asynchronous checkpointer; the next `save`,
        `wait_until_finished`, `restore_or_initialize`, `checkpoints`, `latest_checkpoint`
        and process exit wait for it. The saved values are those at the time of `save`.

    Raises:
      InvalidArgumentTypeError / InvalidArgumentError: an argument of the wrong type or out of
        range (e.g. `max_to_keep=0`, `'3'` or `2.5`; a negative `checkpoint_interval`).
      ExistingPathError: `directory` is a regular file.
    """

    def __init__(self, checkpoint: Checkpoint, directory, max_to_keep: int | None = 5,
                 keep_checkpoint_every_n_hours: float | None = None,
                 checkpoint_interval: int | None = None, init_fn=None, async_save: bool = False):
        owner = "CheckpointManager"
        if not isinstance(checkpoint, Checkpoint):
            raise errors.InvalidArgumentTypeError(
                f"CheckpointManager manages a mirrax.Checkpoint; received "
                f"{type(checkpoint).__name__}. Pass mirrax.Checkpoint(model=..., ...)."
            )
        max_to_keep = _check_count(max_to_keep, "max_to_keep", owner, 1)
        if keep_checkpoint_every_n_hours is not None:
            if isinstance(keep_checkpoint_every_n_hours, bool) or not isinstance(
                    keep_checkpoint_every_n_hours, (int, float, np.integer, np.floating)):
                raise errors.InvalidArgumentTypeError(
                    "CheckpointManager: keep_checkpoint_every_n_hours must be a number of hours "
                    f"or None; received {keep_checkpoint_every_n_hours!r} of type "
                    f"{type(keep_checkpoint_every_n_hours).__name__}."
                )
            if not keep_checkpoint_every_n_hours > 0 or not np.isfinite(keep_checkpoint_every_n_hours):
                raise errors.InvalidArgumentError(
                    "keep_checkpoint_every_n_hours must be a positive number of hours or None; "
                    f"received {keep_checkpoint_every_n_hours}."
                )
        checkpoint_interval = _check_count(checkpoint_interval, "checkpoint_interval", owner, 0)
        if init_fn is not None and not callable(init_fn):
            raise errors.InvalidArgumentTypeError(
                f"CheckpointManager: init_fn must be a function or None; received {init_fn!r}."
            )
        if not isinstance(async_save, (bool, np.bool_)):
            raise errors.InvalidArgumentTypeError(
                f"CheckpointManager: async_save must be True or False; received {async_save!r}."
            )
        self.checkpoint = checkpoint
        self.directory = atomic_dirs.checked_path(directory, owner)
        _refuse_non_directory(self.directory, owner)
        self.max_to_keep = max_to_keep
        self.keep_checkpoint_every_n_hours = keep_checkpoint_every_n_hours
        self.checkpoint_interval = checkpoint_interval
        self.async_save = bool(async_save)
        self._init_fn = init_fn
        keep_time_interval = (
            None if keep_checkpoint_every_n_hours is None
            else datetime.timedelta(hours=float(keep_checkpoint_every_n_hours))
        )
        with _quiet_orbax():
            self._manager = ocp.CheckpointManager(
                self.directory,
                options=ocp.CheckpointManagerOptions(
                    max_to_keep=max_to_keep,
                    keep_time_interval=keep_time_interval,
                    # Always Orbax's asynchronous writer (its default); a synchronous save waits
                    # for it at once, which keeps one write path for both modes.
                    enable_async_checkpointing=True,
                    create=True,
                    # A dropped checkpoint leaves the directory listing in one rename.
                    todelete_subdir=_DELETED_SUBDIR,
                ),
            )

    def wait_until_finished(self) -> None:
        """Blocks until an asynchronous save in flight is committed (returns at once if none)."""
        with _quiet_orbax():
            self._manager.wait_until_finished()
        _IN_FLIGHT.discard(self._manager)
        if jax.process_index() == 0:
            atomic_dirs.delete_if_exists(os.path.join(self.directory, _DELETED_SUBDIR))

    def _path(self, number: int) -> str:
        return os.path.join(self.directory, str(number))

    def _complete_numbers(self) -> list:
        """Numbers of the complete checkpoints, oldest first; the others logged and skipped."""
        self.wait_until_finished()
        with _quiet_orbax():
            self._manager.reload()
            numbers = sorted(self._manager.all_steps())
        complete = []
        for number in numbers:
            if _is_complete(self._path(number)):
                complete.append(number)
            else:
                _LOG.warning("mirrax: skipping %s: not a complete checkpoint (no %s).",
                             self._path(number), _METADATA_FILE)
        return complete

    @property
    def checkpoints(self) -> list:
        """Paths of the kept complete checkpoints, oldest first (waits for a save in flight)."""
        return [self._path(n) for n in self._complete_numbers()]

    @property
    def latest_checkpoint(self) -> str | None:
        """Path of the newest complete checkpoint, or None when there is none (waits for a save
        in flight). Never a directory that is not a complete checkpoint."""
        numbers = self._complete_numbers()
        return self._path(numbers[-1]) if numbers else None

    def _tidy(self) -> None:
        """Before a save (none in flight): moves aside numbered directories that are not
        checkpoints (Orbax would count them as kept ones) and removes killed saves' leftovers."""
        if jax.process_index() == 0 and os.path.isdir(self.directory):
            atomic_dirs.delete_if_exists(os.path.join(self.directory, _DELETED_SUBDIR))
            for name in os.listdir(self.directory):
                full = os.path.join(self.directory, name)
                if ocp.path.step.TMP_DIR_SUFFIX in name or name.endswith(atomic_dirs.DELETING_SUFFIX):
                    atomic_dirs.delete(full)
                elif name.isdigit() and os.path.isdir(full) and not _is_complete(full):
                    aside = full + ".mirrax-incomplete"
                    atomic_dirs.delete_if_exists(aside)
                    _LOG.warning("mirrax: %s is not a complete checkpoint; renamed it %s.",
                                 full, aside)
                    atomic_dirs.rename(full, aside)
        atomic_dirs.barrier(f"mirrax_manager_tidy:{self.directory}")
        with _quiet_orbax():
            self._manager.reload()

    def save(self, checkpoint_number: int | None = None) -> str | None:
        """Writes checkpoint number `checkpoint_number` (default: the checkpoint's save_counter
        after this save, as TF's), drops the oldest beyond `max_to_keep`, returns its path.

        Returns None when `checkpoint_interval` says it is too soon. With `async_save`, first
        waits for the previous save, then returns while this one is written. A number that
        exists is replaced atomically.

        Raises:
          InvalidArgumentTypeError / InvalidArgumentError: `checkpoint_number` is not an int
            >= 0 (e.g. -1, 2.5, '3').
        """
        checkpoint_number = _check_count(
            checkpoint_number, "checkpoint_number", "CheckpointManager.save", 0)
        self.wait_until_finished()
        self._tidy()
        last = self._manager.latest_step()
        if checkpoint_number is not None and self.checkpoint_interval is not None and last is not None:
            if checkpoint_number - last < self.checkpoint_interval:
                return None
        ckpt = self.checkpoint
        ckpt.save_counter += 1
        number = ckpt.save_counter if checkpoint_number is None else checkpoint_number
        path = self._path(number)
        if number in self._manager.all_steps():
            # Orbax refuses an existing step; replace it as Checkpoint.save does.
            save_args = ckpt._save_args()
            atomic_dirs.replace_atomically(
                path, lambda target: _write_checkpoint(target, save_args), _is_complete)
            with _quiet_orbax():
                self._manager.reload()
            return path
        with _quiet_orbax():
            self._manager.save(number, args=ckpt._save_args(), force=True)
        if self.async_save:
            # Orbax registers no exit hook; without one a save in flight at exit is lost.
            _register_exit_hook()
            _IN_FLIGHT.add(self._manager)
        else:
            self.wait_until_finished()
        return path

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
