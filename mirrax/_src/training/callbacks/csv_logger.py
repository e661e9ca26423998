"""`CSVLogger`: appends one row per epoch, with the epoch's logs, to a CSV file."""

from __future__ import annotations

import collections.abc
import csv
import os
from typing import IO

import numpy as np

from mirrax import errors
from mirrax._src import argument_checks
from mirrax._src.training.callbacks._chief import is_chief
from mirrax._src.training.callbacks.callback import Callback


def _cell(value):
    if isinstance(value, str):
        return value
    if isinstance(value, collections.abc.Iterable) and not (
        isinstance(value, np.ndarray) and value.ndim == 0
    ):
        return f'"[{", ".join(map(str, value))}]"'
    return value


class CSVLogger(Callback):
    """Streams epoch results to a CSV file, as `keras.callbacks.CSVLogger`.

    The first column is `epoch` (the 0-based index), then the log keys of the first epoch,
    sorted. When the first epoch has no `val_` key, a `val_` twin of every key is added after
    them (as Keras), so later validation fits the header; a key missing in an epoch is written
    as `NA`. The header is written once: not at all when appending to a non-empty file. Rows use
    the `csv` module's "excel" dialect with the given separator, as Keras, so lines end in
    `\\r\\n`. The file is flushed after every row and closed at the end of training.

    Only process 0 writes in a multi-process run (the processes log the same values; one
    writer keeps the file whole).

    Args:
      filename: path of the CSV file (str or `os.PathLike`); its folder must exist.
      separator: the field separator.
      append: True appends to an existing file (continuing a training); False overwrites it.
    """

    def __init__(self, filename, separator: str = ",", append: bool = False):
        super().__init__()
        if not isinstance(filename, (str, os.PathLike)):
            raise errors.InvalidArgumentTypeError(
                "CSVLogger: filename must be a path (str or os.PathLike); received "
                f"{type(filename).__name__} {filename!r}."
            )
        if not isinstance(separator, str) or len(separator) != 1:
            raise errors.InvalidArgumentError(
                f"CSVLogger: separator must be one character (the csv module's delimiter); "
                f"received {separator!r}. Pass e.g. ',' or ';' or '\\t'."
            )
        self.filename = os.fspath(filename)
        self.sep = separator
        self.append = argument_checks.flag("CSVLogger", "append", append)
        self.keys: list | None = None
        self.writer: csv.DictWriter | None = None
        self.csv_file: IO[str] | None = None
        self.append_header = True

    def on_train_begin(self, logs: dict | None = None) -> None:
        """Opens the file (truncating it unless `append`).

        Raises:
          MissingFolderError (a FileNotFoundError): the file's folder does not exist.
        """
        if not is_chief():
            return
        self.append_header = True
        if self.append:
            if os.path.exists(self.filename):
                with open(self.filename, newline="") as existing:
                    self.append_header = not existing.readline()
            mode = "a"
        else:
            mode = "w"
        if self.csv_file is not None and not self.csv_file.closed:
            self.csv_file.close()
        folder = os.path.dirname(os.path.abspath(self.filename))
        if not os.path.isdir(folder):
            raise errors.MissingFolderError(
                f"CSVLogger cannot write {self.filename!r}: the folder {folder!r} does not "
                "exist. Create it first (os.makedirs(folder, exist_ok=True)) or pass another "
                "filename."
            )
        self.csv_file = open(self.filename, mode, newline="")
        self.writer = None
        self.keys = None

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        """Writes the header (first epoch) and the epoch's row."""
        if self.csv_file is None:
            return
        logs = logs or {}
        if self.keys is None:
            self.keys = sorted(logs.keys())
            if self.keys and not any(key.startswith("val_") for key in self.keys):
                self.keys.extend(["val_" + key for key in self.keys])
        if self.writer is None:
            dialect = type("_Dialect", (csv.excel,), {"delimiter": self.sep})
            self.writer = csv.DictWriter(self.csv_file, fieldnames=["epoch"] + self.keys, dialect=dialect)
            if self.append_header:
                self.writer.writeheader()
        row = {"epoch": epoch}
        row.update((key, _cell(logs.get(key, "NA"))) for key in self.keys)
        self.writer.writerow(row)
        self.csv_file.flush()

    def on_train_end(self, logs: dict | None = None) -> None:
        """Closes the file."""
        if self.csv_file is not None and not self.csv_file.closed:
            self.csv_file.close()
        self.csv_file = None
        self.writer = None
