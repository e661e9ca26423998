"""A checkpoint directory on disk: whether it is complete, whether a save may replace it, the
items it holds, and the one Orbax composite write.

Reading the item metadata checks the directory first, so a directory that is no checkpoint, an
unfinished save or damaged metadata is an InvalidCheckpointError saying which, before any array
is read.
"""

from __future__ import annotations

import json
import os

import orbax.checkpoint as ocp

from mirrax import errors
from mirrax._src.atomic_dirs import NEW_SUFFIX
from mirrax._src.checkpointing import space
from mirrax._src.checkpointing.orbax_quiet import quiet_orbax
from mirrax._src.checkpointing.workers import STUB_FILE, refuse_stub

# Item holding `Checkpoint.save_counter` (TF's name); `read` leaves it alone, as TF's does.
SAVE_COUNTER = "save_counter"

# Orbax's file that a complete checkpoint directory holds (written before its commit rename).
METADATA_FILE = "_CHECKPOINT_METADATA"


def refuse_non_directory(path: str, what: str) -> None:
    """ExistingPathError if `path` is a file: a checkpoint is a directory; a file is never
    replaced."""
    if os.path.lexists(path) and not os.path.isdir(path):
        raise errors.ExistingPathError(
            f"{what}: {path} is a file, not a checkpoint directory; mirrax does not replace "
            "it. Save to another path, or delete the file first."
        )


def _looks_like_checkpoint(path: str) -> bool:
    """Whether a directory is (or was meant to be) an Orbax checkpoint, complete or damaged."""
    names = os.listdir(path)
    if not names or METADATA_FILE in names or "commit_success.txt" in names or STUB_FILE in names:
        return True
    return any(os.path.isfile(os.path.join(path, n, "_METADATA")) for n in names)


def refuse_to_replace(path: str, what: str) -> None:
    """A save replaces the whole directory at `path`: never a file, nor a directory of other
    things (Orbax's `force=True` deleted whatever was there, e.g. the working directory for
    `save('')`)."""
    refuse_non_directory(path, what)
    if os.path.isdir(path) and not _looks_like_checkpoint(path):
        found = sorted(os.listdir(path))
        raise errors.ExistingPathError(
            f"{what}: {path} is a directory that holds no checkpoint (found {found[:10]}); a "
            "save replaces the whole directory, so mirrax refuses. Save to a new or empty "
            "directory, e.g. a subdirectory of it."
        )


def is_complete(path: str) -> bool:
    """Whether `path` looks like a committed Orbax checkpoint (cheap: no array is read)."""
    return os.path.isfile(os.path.join(path, METADATA_FILE))


def checkpointer(names) -> ocp.Checkpointer:
    """A composite Orbax checkpointer that reads every named item as a standard pytree item."""
    return ocp.Checkpointer(
        ocp.CompositeCheckpointHandler(**{n: ocp.StandardCheckpointHandler() for n in names})
    )


def stored_items(path: str, what: str) -> dict:
    """The checkpoint's item name -> tree metadata, with clear errors for a bad directory."""
    if ocp.path.step.TMP_DIR_SUFFIX in os.path.basename(path):
        raise errors.InvalidCheckpointError(
            f"{what}: {path} is an unfinished save (Orbax's temporary directory: the "
            "save was interrupted before it was committed). Restore an earlier checkpoint "
            "(CheckpointManager.checkpoints lists the complete ones)."
        )
    refuse_stub(path, what)
    if not is_complete(path):
        found = sorted(os.listdir(path))
        raise errors.InvalidCheckpointError(
            f"{what}: {path} is not a complete mirrax checkpoint: it has no {METADATA_FILE} "
            f"(found {found or 'an empty directory'}). Restore a directory written by "
            "Checkpoint.save or Model.save_weights (CheckpointManager.checkpoints lists the "
            "complete ones)."
        )
    _check_listed_items(path, what)
    try:
        with quiet_orbax():
            names = [n for n in os.listdir(path) if os.path.isdir(os.path.join(path, n))]
            metadata = checkpointer(names).metadata(path)
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
        with open(os.path.join(path, METADATA_FILE)) as f:
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


def write_checkpoint(target: str, save_args, what: str = "Checkpoint.write") -> None:
    """One Orbax composite save to the fresh directory `target` (committed by Orbax's rename).

    Raises:
      CheckpointWriteError: no space left (disk, quota or file size limit).
    """
    try:
        with quiet_orbax():
            ocp.Checkpointer(ocp.CompositeCheckpointHandler()).save(target, save_args, force=True)
    except Exception as e:
        if not space.is_out_of_space(e):
            raise
        shown = target[: -len(NEW_SUFFIX)] if target.endswith(NEW_SUFFIX) else target
        raise space.write_error(what, shown, e, space.save_bytes(save_args)) from None
