"""`mirrax.load_exported`: an artifact read back (checked file by file) as an `ExportedModel`,
which runs the serialized forward pass without the model's code, on any device count.

A call is checked against the signature the artifact was exported with (structure, rank,
non-batch dimensions, dtype, one batch size), so a wrong input is an InvalidExportInputError
that shows what was received and what is expected, not an XLA error.
"""

from __future__ import annotations

import json
import os
import struct
import zipfile

import jax
import numpy as np

from mirrax import errors
from mirrax._src import atomic_dirs
from mirrax._src.exporting import signature
from mirrax._src.exporting.artifact import (
    FORMAT,
    FORMAT_VERSION,
    METADATA_FILE,
    PROGRAM_FILE,
    WEIGHTS_FILE,
    is_complete_artifact,
)

MissingExportError = errors.MissingExportError
InvalidExportError = errors.InvalidExportError
InvalidExportInputError = errors.InvalidExportInputError


class ExportedModel:
    """The callable `load_exported` returns: `exported(x)` runs the serialized forward pass.

    Attributes:
      input_signature: the pytree of `jax.ShapeDtypeStruct` the export was made with; the
        batch dimension is the symbolic dimension "b". For positional inputs (a list or tuple
        signature), a tuple with one entry per argument.
      positional: whether the artifact takes positional inputs, `exported(a, b, ...)`, one per
        entry of `input_signature`; else it takes one input, `exported(x)`.
      platforms: the platforms the program can run on, e.g. ("cpu", "cuda").
      metadata: the contents of `metadata.json`.
    """

    def __init__(self, exported, weights: list, metadata: dict, path: str):
        self._exported = exported
        self._weights = weights
        self._call = jax.jit(exported.call)
        self.metadata = metadata
        self.path = path
        self.platforms = tuple(exported.platforms)
        self.positional = metadata.get("positional") is True
        self.input_signature = jax.tree.unflatten(
            exported.in_tree.children()[0].children()[1],
            [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in exported.in_avals[len(weights) :]],
        )

    def __call__(self, *inputs):
        """The forward pass's output for the inputs, arrays matching `input_signature`.

        Called `exported(x)` with one pytree `x` of the signature's structure, or, for an
        artifact exported with a list or tuple signature (`positional`), with one positional
        argument per entry: `exported(a, b)`. Leaves may be NumPy or JAX arrays, or torch
        tensors (copied to NumPy with `.detach().cpu().numpy()`, as mirrax's input pipeline
        does) or tf tensors (`.numpy()`).

        Raises:
          InvalidExportInputError (a ValueError): the number of inputs is wrong, or an input
            differs from the signature in structure (e.g. a list where one array is
            expected), rank, a non-batch dimension, dtype, or the leaves' batch sizes differ.
        """
        x = self._check(self._packed(inputs))
        return self._call(self._weights, x)

    def _packed(self, inputs: tuple):
        """The program's input: the tuple of positional inputs, or the one input."""
        want = f"expected {signature.text(self.input_signature)}"
        if self.positional:
            if len(inputs) != len(self.input_signature):
                raise InvalidExportInputError(
                    f"exported model at {self.path}: takes {len(self.input_signature)} "
                    f"positional input(s), one per entry of the list input_signature it was "
                    f"exported with; received {len(inputs)}; {want}."
                )
            return tuple(inputs)
        if len(inputs) != 1:
            raise InvalidExportInputError(
                f"exported model at {self.path}: takes one input x; received {len(inputs)} "
                f"arguments; {want}. Pass several arrays as one pytree of the signature's "
                "structure, or export with a list input_signature (one entry per positional "
                "argument) to call it with several."
            )
        return inputs[0]

    def _check(self, x):
        """`x` with every leaf as an array (torch / tf tensors converted), once it fits."""
        expected = self.input_signature
        want = f"expected {signature.text(expected)}"
        treedef = jax.tree.structure(expected)
        try:
            # jaxlib ships PyTreeDef (jaxlib/_jax.so) without type stubs: mypy cannot type its methods.
            values = treedef.flatten_up_to(x)  # type: ignore[attr-defined]
        except (ValueError, TypeError):
            raise InvalidExportInputError(
                f"exported model at {self.path}: the input's structure does not match the "
                f"signature's: received {signature.received_text(x)}; {want}."
            ) from None
        specs = jax.tree.leaves(expected)
        where = [""] * len(specs)
        if not isinstance(expected, jax.ShapeDtypeStruct):
            where = [
                signature.where(path, self.positional)
                for path, _ in jax.tree_util.tree_flatten_with_path(expected)[0]
            ]
        arrays, batch_sizes = [], set()
        for spec, value, at in zip(specs, values, where):
            value = self._array(value, spec, at, want)
            shape, dtype = tuple(np.shape(value)), signature.dtype_of(value)
            dims = signature.dims(spec)
            fits = len(shape) == len(dims) and all(
                want_dim is None or want_dim == got for want_dim, got in zip(dims, shape)
            )
            if not fits or dtype != spec.dtype:
                raise InvalidExportInputError(
                    f"exported model at {self.path}: received an input of shape {shape} and "
                    f"dtype {dtype}; {want} (None = any batch size). Reshape the input or "
                    f"cast it, e.g. x.astype(np.{spec.dtype})."
                )
            if shape and dims and dims[0] is None:
                batch_sizes.add(shape[0])
            arrays.append(value)
        if 0 in batch_sizes:
            raise InvalidExportInputError(
                f"exported model at {self.path}: received a batch of 0 examples; an exported "
                "model serves batches of 1 or more (jax.export's symbolic batch size is >= 1). "
                "Skip empty batches before calling it."
            )
        if len(batch_sizes) > 1:
            raise InvalidExportInputError(
                f"exported model at {self.path}: the inputs' batch sizes differ "
                f"({sorted(batch_sizes)}); every leaf shares one batch dimension; {want}."
            )
        return jax.tree.unflatten(treedef, arrays)

    def _array(self, value, spec, at: str, want: str):
        """One input leaf as an array, or InvalidExportInputError saying what it is."""
        if value is None or not jax.tree_util.treedef_is_leaf(jax.tree.structure(value)):
            raise InvalidExportInputError(
                f"exported model at {self.path}: received {signature.received_text(value)} (a "
                f"{type(value).__name__}){at} where the signature expects one array "
                f"{signature.text(spec)}; {want}. Pass the array itself, not wrapped in a "
                f"{type(value).__name__}."
            )
        if isinstance(value, (np.ndarray, np.generic, jax.Array)):
            return value
        try:
            if hasattr(value, "numpy"):  # torch.Tensor (maybe on a GPU, tracking grads), tf
                if hasattr(value, "detach") and hasattr(value, "cpu"):
                    value = value.detach().cpu()
                return np.asarray(value.numpy())
            if isinstance(value, (bool, int, float, complex)) or hasattr(value, "__array__"):
                return np.asarray(value)
        except (TypeError, ValueError, RuntimeError) as e:
            raise InvalidExportInputError(
                f"exported model at {self.path}: could not read the {type(value).__name__} "
                f"received{at} as an array ({type(e).__name__}: {e}); {want}. Convert it to "
                f"a NumPy array first, e.g. np.asarray(x, np.{spec.dtype})."
            ) from None
        raise InvalidExportInputError(
            f"exported model at {self.path}: received a {type(value).__name__} "
            f"({value!r:.60}){at}; the signature expects an array {signature.text(spec)}; "
            f"{want}. Pass a NumPy or JAX array (or a torch / tf tensor)."
        )

    def __repr__(self):
        return (
            f"ExportedModel({self.path!r}, input_signature="
            f"{signature.text(self.input_signature)}, positional={self.positional}, "
            f"platforms={self.platforms})"
        )


def load_exported(path) -> ExportedModel:
    """Loads an artifact written by `mirrax.export`; returns an `ExportedModel` to call.

    Needs neither the model's Python code nor any particular device count: the program runs on
    the default device of the current platform (one of those it was exported for). If an
    export was killed while replacing `path` (between its two renames), the complete artifact
    left beside it is loaded instead (logged).

    Raises:
      MissingExportError (a FileNotFoundError): `path` is not a directory, or lacks one of the
        artifact's files.
      InvalidExportError (a ValueError): a file is damaged (metadata not JSON, a truncated
        program or weights file), or the metadata names another format or a newer version.
    """
    path = atomic_dirs.checked_path(path, "load_exported")
    if os.path.lexists(path) and not os.path.isdir(path):
        raise MissingExportError(
            f"load_exported: {path} is a file, not an artifact directory; pass the directory "
            "that mirrax.export(model, path, input_signature) wrote."
        )
    try:
        path = atomic_dirs.resolve(path, "load_exported", complete=is_complete_artifact)
    except errors.MissingCheckpointError:
        raise MissingExportError(
            f"load_exported: no directory at {path}; write one with "
            "mirrax.export(model, path, input_signature)."
        ) from None
    missing = [
        name
        for name in (PROGRAM_FILE, WEIGHTS_FILE, METADATA_FILE)
        if not os.path.isfile(os.path.join(path, name))
    ]
    if missing:
        found = sorted(os.listdir(path))
        raise MissingExportError(
            f"load_exported: {path} is not a complete mirrax export: missing "
            f"{', '.join(missing)} (found {found or 'an empty directory'}). Write it with "
            "mirrax.export(model, path, input_signature)."
        )
    fix = "Re-export the model with mirrax.export(model, path, input_signature)."
    metadata_path = os.path.join(path, METADATA_FILE)
    try:
        with open(metadata_path, "rb") as f:
            metadata = json.loads(f.read())
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidExportError(
            f"load_exported: {metadata_path} is not valid JSON (damaged or truncated: "
            f"{type(e).__name__}: {e}). {fix}"
        ) from None
    if not isinstance(metadata, dict):
        raise InvalidExportError(
            f"load_exported: {metadata_path} holds a {type(metadata).__name__}, not the "
            f"artifact's metadata object. {fix}"
        )
    version = metadata.get("format_version", 0)
    if metadata.get("format") != FORMAT or not isinstance(version, int) or version > FORMAT_VERSION:
        raise InvalidExportError(
            f"load_exported: {path} holds format {metadata.get('format')!r} version "
            f"{metadata.get('format_version')!r}; this mirrax reads {FORMAT!r} up to version "
            f"{FORMAT_VERSION}. Upgrade mirrax or re-export."
        )
    num_weights = metadata.get("num_weights")
    if isinstance(num_weights, bool) or not isinstance(num_weights, int) or num_weights < 0:
        raise InvalidExportError(
            f"load_exported: {metadata_path} has num_weights={num_weights!r}; expected a count "
            f"(an int >= 0). {fix}"
        )
    program_path = os.path.join(path, PROGRAM_FILE)
    try:
        with open(program_path, "rb") as f:
            exported = jax.export.deserialize(bytearray(f.read()))
    except Exception as e:  # noqa: BLE001 - flatbuffers/struct/jax raise many kinds on bad bytes
        raise InvalidExportError(
            f"load_exported: {program_path} is not a readable serialized program (damaged or "
            f"truncated: {type(e).__name__}: {str(e)[:200]}). {fix}"
        ) from None
    weights_path = os.path.join(path, WEIGHTS_FILE)
    try:
        with np.load(weights_path, allow_pickle=False) as npz:
            weights = [npz[f"weights_{i}"] for i in range(num_weights)]
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, struct.error) as e:
        raise InvalidExportError(
            f"load_exported: {weights_path} does not hold the artifact's {num_weights} weight "
            f"arrays (damaged or truncated: {type(e).__name__}: {str(e)[:200]}). {fix}"
        ) from None
    if len(exported.in_avals) < num_weights or any(
        tuple(a.shape) != w.shape or np.dtype(a.dtype) != w.dtype for a, w in zip(exported.in_avals, weights)
    ):
        raise InvalidExportError(
            f"load_exported: the weights in {weights_path} do not fit the program in "
            f"{program_path} (files from different exports?). {fix}"
        )
    return ExportedModel(exported, weights, metadata, path)
