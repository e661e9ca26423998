"""CIFAR-10 read from its own "python version" files, with a pickle loader that cannot run code.

The files (https://www.cs.toronto.edu/~kriz/cifar.html, "CIFAR-10 python version") are Python
pickles: each batch is a dict of bytes keys -> values, where b"data" is a uint8 NumPy array of
shape (N, 3072) (1024 red, then 1024 green, then 1024 blue values of a 32x32 image, row-major)
and b"labels" a list of N ints in 0..9. `pickle.load` would execute whatever a file names, so
the files are read with `RestrictedUnpickler`, which builds only NumPy arrays, lists, dicts,
bytes, str and numbers, and refuses every other global.
"""

from __future__ import annotations

import codecs
import io
import os
import pickle
import tarfile

import numpy as np

from mirrax import errors
from mirrax._src.distribute import _compat

CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar.html"
ARCHIVE_NAME = "cifar-10-python.tar.gz"
FOLDER_NAME = "cifar-10-batches-py"
TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_FILES = ("test_batch",)
IMAGE_SHAPE = (32, 32, 3)
NUM_CLASSES = 10


def _reconstruct(subtype, shape, dtype):
    """`numpy.core.multiarray._reconstruct`, limited to plain `np.ndarray`s."""
    if subtype is not np.ndarray:
        raise pickle.UnpicklingError(
            f"refused to reconstruct an array of type {subtype!r}: only numpy.ndarray is allowed "
            "in a CIFAR-10 batch."
        )
    return _compat.numpy_reconstruct(subtype, shape, dtype)


def _dtype(*args):
    """`numpy.dtype`, refusing object dtypes (whose elements would be arbitrary pickles)."""
    dtype = np.dtype(*args)
    if dtype.hasobject:
        raise pickle.UnpicklingError(
            f"refused the NumPy dtype {dtype!r}: it holds Python objects; a CIFAR-10 batch holds "
            "only numeric arrays."
        )
    return dtype


def _latin1_encode(text, encoding="utf-8"):
    """`_codecs.encode`, only as Python 3 protocol-2 pickles use it: bytes saved as latin-1 text."""
    if not isinstance(text, str) or str(encoding).lower().replace("-", "") != "latin1":
        raise pickle.UnpicklingError(
            f"refused _codecs.encode({type(text).__name__}, {encoding!r}): only the "
            "(str, 'latin1') form that pickle uses for bytes is allowed."
        )
    return codecs.encode(text, "latin1")  # codecs.encode is _codecs.encode


# The only globals a CIFAR-10 batch may name. Python 2 pickles (the published files) name
# numpy.core.multiarray; ones written by NumPy >= 2 name numpy._core.multiarray.
_ALLOWED_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): _dtype,
    ("_codecs", "encode"): _latin1_encode,
}


class RestrictedUnpickler(pickle.Unpickler):
    """A `pickle.Unpickler` that builds only NumPy arrays and plain Python data, never code.

    Every global the pickle names is refused except NumPy's array reconstruction
    (`numpy.core.multiarray._reconstruct` / `numpy._core.multiarray._reconstruct`,
    `numpy.ndarray`, `numpy.dtype` without object dtypes) and `_codecs.encode(text, "latin1")`,
    which Python 3 protocol-2 pickles use to store bytes. Dicts, lists, tuples, bytes, str,
    ints, floats, bools and None need no globals. Persistent ids are refused too (the base
    class's default).

    Raises (from `load`):
      pickle.UnpicklingError: the pickle names any other global; the message names it.
    """

    def find_class(self, module: str, name: str):
        """Returns an allowed global; refuses every other one (see the class docstring).

        Raises:
          pickle.UnpicklingError: `module.name` is not one of the allowed globals.
        """
        allowed = _ALLOWED_GLOBALS.get((module, name))
        if allowed is None:
            raise pickle.UnpicklingError(
                f"refused to load the global {module}.{name}: a CIFAR-10 batch holds only NumPy "
                "arrays, lists, dicts, bytes, str and ints, and loading anything else could run "
                "code. This file is not a CIFAR-10 batch (or has been tampered with); do not "
                f"load it with pickle.load. Get the data set from {CIFAR10_URL} "
                '("CIFAR-10 python version").'
            )
        return allowed


def restricted_load(file):
    """Loads one pickle from a binary file object with `RestrictedUnpickler`.

    Strings written by Python 2 (the published CIFAR-10 files) come back as bytes
    (`encoding="bytes"`, as the data set's own instructions load them).

    Raises:
      pickle.UnpicklingError: the pickle names a global that is not allowed.
    """
    return RestrictedUnpickler(file, encoding="bytes").load()


def load_cifar10(path):
    """CIFAR-10's 50000 training and 10000 test images, read from the "python version" files.

    Reads data_batch_1 .. data_batch_5 (train, in that order) and test_batch (test), from the
    first of these that exists:
      1. `path` itself, when it is the `cifar-10-python.tar.gz` archive (read in memory, never
         extracted);
      2. `path`, when it is a folder holding the batch files (the extracted
         `cifar-10-batches-py`);
      3. `path/cifar-10-batches-py/`;
      4. `path/cifar-10-python.tar.gz`.
    The files are unpickled with `RestrictedUnpickler`, which cannot run code.

    Args:
      path: a folder or the archive, as a str or `os.PathLike`.

    Returns:
      ((x_train, y_train), (x_test, y_test)): images as float32 arrays of shape (N, 32, 32, 3)
      (height, width, RGB) with values in [0, 1] (pixel / 255); labels as int32 arrays of shape
      (N,) with values 0..9. N is the total over the batch files (50000 and 10000 for the
      published data set).

    Raises:
      MissingDatasetError (a FileNotFoundError): none of the places above holds all the files;
        the message names the folder, the files looked for, and where to get them.
      pickle.UnpicklingError: a file names a global that a CIFAR-10 batch never needs.
      ValueError: a file unpickles to something that is not a CIFAR-10 batch, or the archive is
        not a readable .tar.gz.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise errors.InvalidArgumentTypeError(
            f"load_cifar10: path must be a folder or the cifar-10-python.tar.gz archive, as a str "
            f"or os.PathLike; received {path!r} of type {type(path).__name__}. Write e.g. "
            "load_cifar10('~/.mirrax/datasets')."
        )
    path = os.path.expanduser(os.fspath(path))
    batches = _find_source(path).read_all()
    train = [_to_arrays(name, batches[name]) for name in TRAIN_FILES]
    test = [_to_arrays(name, batches[name]) for name in TEST_FILES]
    return _concatenate(train), _concatenate(test)


class _Folder:
    def __init__(self, folder: str, names: tuple):
        self.folder = folder
        self.names = names

    def read_all(self) -> dict:
        batches = {}
        for name in self.names:
            with open(os.path.join(self.folder, name), "rb") as f:
                batches[name] = restricted_load(f)
        return batches


class _Archive:
    def __init__(self, archive: str, members: dict):
        self.archive = archive
        self.members = members  # batch file name -> member name in the archive

    def read_all(self) -> dict:
        # One pass over the archive: a .tar.gz can only be read from its start.
        wanted = {member: name for name, member in self.members.items()}
        batches = {}
        with tarfile.open(self.archive, "r:*") as tar:
            for member in tar:
                if member.name in wanted:
                    data = tar.extractfile(member).read()
                    batches[wanted[member.name]] = restricted_load(io.BytesIO(data))
        return batches


def _find_source(path: str):
    needed = TRAIN_FILES + TEST_FILES
    if os.path.isfile(path):
        return _open_archive(path, needed)
    folders = [path, os.path.join(path, FOLDER_NAME)]
    for folder in folders:
        if all(os.path.isfile(os.path.join(folder, name)) for name in needed):
            return _Folder(folder, needed)
    archive = os.path.join(path, ARCHIVE_NAME)
    if os.path.isfile(archive):
        return _open_archive(archive, needed)
    found = [
        os.path.join(folder, name)
        for folder in folders
        for name in needed
        if os.path.isfile(os.path.join(folder, name))
    ]
    partial = f" Found only: {', '.join(found)}." if found else ""
    raise errors.MissingDatasetError(
        f"CIFAR-10 not found in {path!r}{' (no such folder)' if not os.path.isdir(path) else ''}: "
        f"looked for the batch files {', '.join(needed)} in {folders[0]!r} and in "
        f"{folders[1]!r}, and for the archive {archive!r}.{partial} Download "
        f'"CIFAR-10 python version" ({ARCHIVE_NAME}) from {CIFAR10_URL} and put the archive, or '
        f"the {FOLDER_NAME} folder extracted from it, in that folder (or pass the archive's "
        "path)."
    )


def _open_archive(archive: str, needed: tuple) -> _Archive:
    try:
        with tarfile.open(archive, "r:*") as tar:
            files = [m for m in tar.getmembers() if m.isfile()]
    except (tarfile.TarError, OSError, EOFError) as e:
        raise errors.InvalidArgumentError(
            f"Cannot read {archive!r} as a tar archive ({e}). Expected {ARCHIVE_NAME}, the "
            f'"CIFAR-10 python version" from {CIFAR10_URL}; download it again if it is '
            "truncated."
        ) from e
    by_name = {}
    for member in files:
        base = member.name.rsplit("/", 1)[-1]
        # Prefer the archive's own layout (cifar-10-batches-py/<name>) over stray copies.
        if base in needed and (base not in by_name or member.name == f"{FOLDER_NAME}/{base}"):
            by_name[base] = member.name
    missing = [name for name in needed if name not in by_name]
    if missing:
        raise errors.MissingDatasetError(
            f"The archive {archive!r} lacks the CIFAR-10 batch files {', '.join(missing)} "
            f"(looked for {FOLDER_NAME}/<name> for each of {', '.join(needed)}). Download "
            f'"CIFAR-10 python version" ({ARCHIVE_NAME}) from {CIFAR10_URL}.'
        )
    return _Archive(archive, by_name)


def _to_arrays(name: str, batch):
    """(images float32 (N, 32, 32, 3) in [0, 1], labels int32 (N,)) from one unpickled batch."""
    if not isinstance(batch, dict) or b"data" not in batch or b"labels" not in batch:
        keys = sorted(batch) if isinstance(batch, dict) else None
        raise errors.InvalidArgumentError(
            f"CIFAR-10 file {name!r} is not a batch: expected a dict with the keys b'data' and "
            f"b'labels'; received a {type(batch).__name__}"
            f"{f' with keys {keys}' if keys is not None else ''}. Use the files of "
            f'"CIFAR-10 python version" from {CIFAR10_URL}.'
        )
    data, labels = batch[b"data"], batch[b"labels"]
    pixels = int(np.prod(IMAGE_SHAPE))
    if (
        not isinstance(data, np.ndarray)
        or data.dtype != np.uint8
        or data.ndim != 2
        or (data.shape[1] != pixels)
    ):
        got = (
            f"{data.dtype} array of shape {data.shape}"
            if isinstance(data, np.ndarray)
            else (type(data).__name__)
        )
        raise errors.InvalidArgumentError(
            f"CIFAR-10 file {name!r}: b'data' must be a uint8 array of shape (N, {pixels}); received a {got}."
        )
    labels = np.asarray(labels)
    if (
        labels.shape != (data.shape[0],)
        or not np.issubdtype(labels.dtype, np.integer)
        or (labels.size and not 0 <= labels.min() <= labels.max() < NUM_CLASSES)
    ):
        raise errors.InvalidArgumentError(
            f"CIFAR-10 file {name!r}: b'labels' must hold {data.shape[0]} ints in "
            f"0..{NUM_CLASSES - 1} (one per image); received {labels.dtype} values of shape "
            f"{labels.shape}."
        )
    # Stored channel-major (all red, all green, all blue); models expect height, width, channel.
    images = data.reshape((-1, 3, 32, 32)).transpose(0, 2, 3, 1)
    return images.astype(np.float32) / np.float32(255.0), labels.astype(np.int32)


def _concatenate(parts):
    return (
        np.concatenate([images for images, _ in parts]),
        np.concatenate([labels for _, labels in parts]),
    )
