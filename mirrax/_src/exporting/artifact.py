"""The serving artifact on disk: its three files, its format version, and which directories an
export may replace.

An artifact is a directory of three files:

- `forward.jax_export`: the forward function serialized with `jax.export` (StableHLO plus its
  calling convention), taking `(weights, x)` where `weights` is a list of arrays and `x` the
  input (the tuple of positional inputs when the signature was a list or tuple);
- `weights.npz`: those arrays, `weights_0`, `weights_1`, ... (NumPy's format, read with
  `allow_pickle=False`: loading never runs code from the file);
- `metadata.json`: the format version, the platforms the program was lowered for, the input
  and output signatures (batch dimension `null`), and whether the inputs are positional.

Weights travel as arguments rather than as constants baked into the program: the program stays
small whatever the model size (StableHLO's protobuf cannot exceed 2 GiB), and the weights stay
readable with plain NumPy.
"""

from __future__ import annotations

import os

from mirrax import errors
from mirrax._src import atomic_dirs

FORMAT = "mirrax.export"
# Version 2 adds positional inputs (a list or tuple input_signature); an artifact with one
# input is still written as version 1, so an older mirrax keeps reading it.
FORMAT_VERSION = 2
SINGLE_INPUT_VERSION = 1
PROGRAM_FILE = "forward.jax_export"
WEIGHTS_FILE = "weights.npz"
METADATA_FILE = "metadata.json"


def is_complete_artifact(path: str) -> bool:
    """Whether the directory `path` holds all three files (what a reader may load)."""
    return all(os.path.isfile(os.path.join(path, n)) for n in (PROGRAM_FILE, WEIGHTS_FILE, METADATA_FILE))


def checked_export_path(path) -> str:
    """`path` as an absolute str; ExistingPathError if it is a file (never replaced)."""
    path = atomic_dirs.checked_path(path, "export")
    if os.path.lexists(path) and not os.path.isdir(path):
        raise errors.ExistingPathError(
            f"export: {path} is a file, not an artifact directory; mirrax does not replace it. "
            "Export to another path, or delete the file first."
        )
    return path


def refuse_foreign_directory(path: str) -> None:
    """An existing directory is replaced only if it is (or was meant to be) an artifact."""
    if not os.path.isdir(path):
        return
    names = set(os.listdir(path))
    if names and not names & {PROGRAM_FILE, WEIGHTS_FILE, METADATA_FILE}:
        raise errors.ExistingPathError(
            f"export: {path} is a directory that holds no mirrax export (found "
            f"{sorted(names)[:10]}); export replaces the whole directory, so it refuses to. "
            "Export to a new or empty directory."
        )
