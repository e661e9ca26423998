"""Multi-worker saves in TF's pattern: every worker saves, the chief's path holds the checkpoint.

TF's tutorials (multi_worker_with_ctl / multi_worker_with_keras: `write_filepath`) give the chief
`ckpt` and every other worker `workertemp_<i>/ckpt`, which the worker deletes after the save.
Orbax writes one checkpoint collectively (its barriers are named after the path), so the
processes agree on the chief's path through jax.distributed's key-value store, write it together,
and a worker whose own path differs gets a stub there: a directory holding only a note that names
the chief's checkpoint. Deleting the stub deletes nothing of the chief's; restoring it is refused
with the chief's path. Host-local arrays (state no step has touched) are written as the chief's
values: Orbax refuses a host-local jax.Array in a multi-host save, and writes a NumPy array from
the primary host (process 0, the chief) only.
"""

from __future__ import annotations

import itertools
import os

import jax
import numpy as np

from mirrax import errors
from mirrax._src.distribute import multihost

# The note a non-chief worker's path holds (the whole content of its stub directory).
STUB_FILE = "MIRRAX_CHIEF_CHECKPOINT.txt"

# Exchanges are named by a count every process advances alike (saves are collective).
_EXCHANGES = itertools.count()


def chief_path(path: str | None, what: str, check, refused: Exception | None = None) -> str:
    """The path every process writes for a save whose own path is `path` (absolute): the chief's
    (process 0's) in a multi-process run, `path` itself in one process. Collective.

    `check(path)` raises a MirraxError when this process may not save to its path; in a
    multi-process run a refusal on any process is raised on every process (none is left
    waiting in Orbax's barrier, or at this exchange, for a peer that refused). `refused` is a
    MirraxError this process already has for its arguments (a bad prefix or path type, found
    before there is a path; `path` is then None): it is published as a refusal the same way,
    then raised (see `checked_everywhere`).
    """
    if jax.process_count() == 1:
        if refused is not None:
            raise refused
        assert path is not None  # None comes with `refused` only
        check(path)
        return path
    own_error = refused
    if own_error is None:
        try:
            check(path)
        except errors.MirraxError as e:
            own_error = e
    refusal = None if own_error is None else f"{type(own_error).__name__}: {own_error}"
    name = f"checkpoint_path/{next(_EXCHANGES)}"
    # The keys stay in the store (about 100 bytes a save): no point is known where every peer
    # has read them (a refusal skips Orbax's barrier), and deleting one early strands a peer.
    answers = multihost.exchange(name, [path, refusal])
    if own_error is not None:
        raise own_error
    for process, (_, other) in enumerate(answers):
        if other is not None:
            raise errors.InvalidArgumentError(
                f"{what}: worker process {process} refused its save, so no worker saved: {other}"
            )
    chief = answers[0][0]
    for process, (own, _) in enumerate(answers):
        if own != chief and os.path.commonpath([own, chief]) in (own, chief):
            raise errors.InvalidArgumentError(
                f"{what}: worker process {process} saves to {own}, which contains or lies inside "
                f"the chief's checkpoint path {chief}; deleting that worker's copy would delete "
                "the chief's. Give non-chief workers a path beside the chief's, e.g. "
                "os.path.join(os.path.dirname(path), f'workertemp_{task_id}', "
                "os.path.basename(path)) (TF's write_filepath), or the chief's path itself."
            )
    return chief


def checked_everywhere(validate, what: str):
    """`validate()` (this process's checks of a save's arguments, before its path exists); a
    MirraxError it raises is raised on every process of a multi-process run, through the same
    exchange as `chief_path`'s, so a bad argument on one worker never leaves the others waiting
    at the path exchange."""
    try:
        return validate()
    except errors.MirraxError as e:
        chief_path(None, what, None, refused=e)
        raise  # not reached: chief_path raises `e`


def is_stub(path: str) -> bool:
    """Whether `path` is a non-chief worker's stub (a directory holding only the note)."""
    return os.path.isfile(os.path.join(path, STUB_FILE))


def write_stub(path: str, chief: str) -> None:
    """Makes `path` a stub naming the chief's checkpoint `chief` (replacing an older stub)."""
    os.makedirs(path, exist_ok=True)
    tmp = os.path.join(path, STUB_FILE + ".tmp")
    with open(tmp, "w") as f:
        f.write(
            f"This worker (process {jax.process_index()}) is not the chief. The checkpoint "
            f"it saved together with the other workers is at:\n{chief}\n"
        )
    os.replace(tmp, os.path.join(path, STUB_FILE))


def refuse_stub(path: str, what: str) -> None:
    """InvalidCheckpointError for reading a stub, naming the chief's checkpoint."""
    if not is_stub(path):
        return
    with open(os.path.join(path, STUB_FILE)) as f:
        chief = f.read().strip().splitlines()[-1]
    raise errors.InvalidCheckpointError(
        f"{what}: {path} is a non-chief worker's stub, not a checkpoint; the checkpoint saved "
        f"with it is the chief's, at {chief}. Restore that path on every worker, e.g. "
        "mirrax.train.latest_checkpoint(<the chief's directory>) as TF's tutorials do."
    )


def for_save(tree):
    """`tree` with each host-local jax.Array as a NumPy array in a multi-process run (the chief's
    values are the ones written); unchanged in one process."""
    if jax.process_count() == 1:
        return tree
    return jax.tree.map(
        lambda a: np.asarray(a) if isinstance(a, jax.Array) and a.is_fully_addressable else a, tree
    )
