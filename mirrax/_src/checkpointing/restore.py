"""Reading a checkpoint into tracked parts, all or nothing, and the status a restore returns.

Every matched part is compared with the stored metadata (paths, shapes, dtypes) before any
array is read, so a checkpoint that does not fit changes nothing; arrays are read straight onto
each target array's current sharding.
"""

from __future__ import annotations

import jax
import numpy as np
import orbax.checkpoint as ocp

from mirrax import errors
from mirrax._src.checkpointing.directory import SAVE_COUNTER, checkpointer
from mirrax._src.checkpointing.orbax_quiet import ignore_closed_loop_callbacks, quiet_orbax
from mirrax._src.checkpointing.parts import abstract, as_arrays, flat_dict, renamed, unstorable


def _mismatches(current: dict, stored: dict) -> list:
    """Human-readable differences between a part's storable state and the stored metadata."""
    flat_now = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(current)[0]}
    flat_old = {
        jax.tree_util.keystr(k): v
        for k, v in jax.tree_util.tree_flatten_with_path(
            stored, is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype")
        )[0]
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
            out.append(
                f"{key} has shape {tuple(flat_old[key].shape)} in the checkpoint, "
                f"{tuple(flat_now[key].shape)} in the model"
            )
        elif np.dtype(flat_now[key].dtype) != np.dtype(flat_old[key].dtype):
            out.append(
                f"{key} has dtype {flat_old[key].dtype} in the checkpoint, {flat_now[key].dtype} in the model"
            )
    return out


def _stored_layout(part, stored: dict) -> tuple:
    """(the part's state laid out as the checkpoint `stored` ({item: tree}) holds it, the
    function that lays a restored tree out as the part's): the part's own paths, or, when only
    they do not fit, the paths its `aliases` name (a Keras model's variables keyed by position,
    or by the same model's earlier Keras names)."""
    current = as_arrays(part.get())
    alias = None
    if part.aliases is not None and _mismatches(current, stored[part.item]):
        alias = part.aliases(stored)
    if alias is None:
        return current, lambda restored: restored
    rename = {path: alias(path) for path in flat_dict(current)}
    rename = {new: old for new, old in rename.items() if old is not None}
    old = renamed(current, rename)
    if _mismatches(old, stored[part.item]):
        return current, lambda restored: restored
    back = {old_path: new for new, old_path in rename.items()}
    return old, lambda restored: renamed(restored, back)


def _keras_hint(part, lines: list) -> str:
    """Why a Keras model's variables may not be found, when some are not."""
    if part.aliases is None or not any(
        line.endswith(("is missing from the checkpoint", "is in the checkpoint but not in the model"))
        for line in lines
    ):
        return ""
    return (
        f" ({part.item} holds a Keras model's variables, keyed by their Keras paths, e.g. "
        "variables/dense/kernel; the same model built again in the process matches despite "
        "Keras's renumbered layer names, and a checkpoint keyed by position, variables/0, "
        "..., as mirrax wrote them before, restores only into the model that wrote it, the "
        "same layers in the same order: build that model, restore, then save again)"
    )


def restore_parts(path: str, what: str, parts: list, stored: dict, counter: bool) -> dict:
    """Reads the stored items of `parts` into them (all or nothing); returns what was read.

    Raises IncompatibleCheckpointError before changing anything if a part does not fit, and
    InvalidCheckpointError if an array file cannot be read.
    """
    problems, hints, layouts = [], "", {}
    for part in parts:
        layouts[part.item] = _stored_layout(part, stored)
        lines = _mismatches(layouts[part.item][0], stored[part.item])
        problems += [f"{part.item}{line}" for line in lines]
        hints += _keras_hint(part, lines)
    if problems:
        raise errors.IncompatibleCheckpointError(
            f"{what}: the checkpoint at {path} does not fit the tracked objects; "
            + "; ".join(problems[:20])
            + (f"; and {len(problems) - 20} more" if len(problems) > 20 else "")
            + ". Restore a checkpoint saved from objects with the same structure and dtypes"
            + hints
            + "."
        )
    for part in parts:
        if part.check is not None:
            part.check()
    targets = {part.item: ocp.args.StandardRestore(abstract(layouts[part.item][0])) for part in parts}
    if counter:
        targets[SAVE_COUNTER] = ocp.args.StandardRestore({"value": np.asarray(0, np.int64)})
    if not targets:
        return {}
    try:
        with quiet_orbax():
            restored = checkpointer(list(targets)).restore(path, ocp.args.Composite(**targets))
    except Exception as e:  # Orbax wraps TensorStore's read errors in a bare Exception
        ignore_closed_loop_callbacks()
        raise errors.InvalidCheckpointError(
            f"{what}: could not read the arrays of the checkpoint at {path}; "
            f"a data file is truncated or corrupt ({_root_cause(e)}). Nothing was changed. "
            "Restore an earlier checkpoint (CheckpointManager.checkpoints lists them)."
        ) from e
    # Parts with a check first: their set can still fail (an iterator fast-forwarding past the
    # end of its dataset), and must fail before any other object is changed.
    for part in sorted(parts, key=lambda part: part.check is None):
        part.set(unstorable(layouts[part.item][1](restored[part.item]), part.get()))
    return restored


def _root_cause(error: BaseException) -> str:
    """The innermost error's first line: TensorStore's own words (file, byte range), without
    the pages of TensorStore spec that Orbax's wrapper adds."""
    seen = set()
    while id(error) not in seen:
        inner = error.__cause__ or error.__context__
        if inner is None:
            break
        seen.add(id(error))
        error = inner
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
            hint = (
                " It holds 'weights' (Model.save_weights's output): read it with model.load_weights(path)."
                if "weights" in self.unused_in_checkpoint
                else ""
            )
            raise AssertionError(
                f"The checkpoint at {self.path} has nothing for {self.not_in_checkpoint}; "
                "they kept their current values. Restore from a checkpoint that tracked them "
                f"under the same names.{hint}"
            )
        return self

    def expect_partial(self) -> CheckpointLoadStatus:
        """Accepts a partial match (as TF's; mirrax warns about nothing, so this only returns)."""
        return self
