"""`mirrax.export` / `mirrax.load_exported`: a serving artifact that runs without the model's code.

The artifact is a directory of three files:

- `forward.jax_export`: the forward function serialized with `jax.export` (StableHLO plus its
  calling convention), taking `(weights, x)` where `weights` is a list of arrays;
- `weights.npz`: those arrays, `weights_0`, `weights_1`, ... (NumPy's format, read with
  `allow_pickle=False`: loading never runs code from the file);
- `metadata.json`: the format version, the platforms the program was lowered for, and the
  input and output signatures (batch dimension `null`).

Weights travel as arguments rather than as constants baked into the program: the program stays
small whatever the model size (StableHLO's protobuf cannot exceed 2 GiB), and the weights stay
readable with plain NumPy.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import zipfile
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mirrax import errors
from mirrax._src import atomic_dirs

FORMAT = "mirrax.export"
FORMAT_VERSION = 1
PROGRAM_FILE = "forward.jax_export"
WEIGHTS_FILE = "weights.npz"
METADATA_FILE = "metadata.json"
# An artifact made on a CPU-only machine should also serve on a GPU.
DEFAULT_PLATFORMS = ("cpu", "cuda")


MissingExportError = errors.MissingExportError
InvalidExportError = errors.InvalidExportError
InvalidExportInputError = errors.InvalidExportInputError
# Platforms `jax.export` lowers for.
KNOWN_PLATFORMS = ("cpu", "cuda", "rocm", "tpu")


def export(model_or_fn, path, input_signature, *, platforms=None) -> None:
    """Writes a serving artifact of the forward pass into the directory `path`.

    The forward pass is traced once with a symbolic batch dimension "b", lowered with
    `jax.export` for `platforms` and written with its weights (see this module's docstring for
    the files). Modules are put in eval mode (`module.eval()`) first, so dropout is off and
    batch norm uses its running statistics. A `mirrax.Model` is exported as `model.predict`
    computes (its dtype policy: compute dtype inside, floating outputs in float32). The weights
    are host copies, so the artifact is bound to no device or mesh: export a model trained on 8
    replicas and serve it on one device. Only process 0 writes in a multi-process run.

    Args:
      model_or_fn: a `mirrax.Model`, an `nnx.Module`, or a pure function `fn(x)` (no weights).
      path: the directory to write (created if missing; an earlier export there is replaced).
      input_signature: a `jax.ShapeDtypeStruct` or a pytree (tuples, lists, dicts) of them, the
        shape of ONE call's input. A leading dimension of None or -1 means "any batch size"
        and becomes the symbolic dimension "b", shared by every leaf, e.g.
        `jax.ShapeDtypeStruct((None, 8, 8, 1), jnp.float32)` for images (batch, 8, 8, 1).
      platforms: the platforms to lower for; default ("cpu", "cuda") plus the current one. If
        lowering for all of them fails (e.g. a CUDA-only kernel is missing on a CPU machine),
        the program is lowered for the current platform only; `metadata.json` records which.

    Atomic, also when replacing an earlier artifact: the files are written into a new
    directory beside `path`, which is then swapped in by rename, so a kill at any moment
    leaves the old or the new artifact loadable from `path`.

    Raises:
      InvalidArgumentTypeError (a TypeError): `model_or_fn` is none of the three, or
        `input_signature` holds no leaf or a leaf that is not a `jax.ShapeDtypeStruct`.
      InvalidArgumentError (a ValueError): a non-leading dimension is None or negative, or
        `platforms` names an unknown platform.
      ExistingPathError (a FileExistsError): `path` is a file, or a non-empty directory that
        holds no mirrax export (export replaces the whole directory).
    """
    forward, weights = _forward_and_weights(model_or_fn)
    specs = _symbolic_specs(input_signature)
    weight_specs = [jax.ShapeDtypeStruct(w.shape, w.dtype) for w in weights]
    requested = _checked_platforms(platforms) if platforms is not None else _default_platforms()
    try:
        exported = jax.export.export(jax.jit(forward), platforms=requested)(weight_specs, specs)
        fallback = None
    except Exception as error:  # noqa: BLE001 - any lowering failure falls back the same way
        current = _current_platform()
        if requested == [current]:
            raise
        exported = jax.export.export(jax.jit(forward), platforms=[current])(weight_specs, specs)
        fallback = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
    metadata = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "jax_version": jax.__version__,
        "platforms": list(exported.platforms),
        "requested_platforms": requested,
        "platform_fallback_reason": fallback,
        "input_signature": _describe(input_signature),
        "output_signature": _describe(
            jax.tree.unflatten(exported.out_tree, list(exported.out_avals))),
        "num_weights": len(weights),
    }
    path = _checked_export_path(path)
    if jax.process_index() == 0:
        _refuse_foreign_directory(path)

    def write(target: str) -> None:
        # The files go into a fresh directory renamed to `target` once all three are complete,
        # so `target` is complete or absent (what the atomic replace needs).
        partial = target + ".partial"
        if os.path.lexists(partial):
            shutil.rmtree(partial)
        os.makedirs(partial)
        _write_file(os.path.join(partial, WEIGHTS_FILE),
                    lambda f: np.savez(f, **{f"weights_{i}": w for i, w in enumerate(weights)}))
        _write_file(os.path.join(partial, PROGRAM_FILE), lambda f: f.write(exported.serialize()))
        _write_file(os.path.join(partial, METADATA_FILE),
                    lambda f: f.write(json.dumps(metadata, indent=2).encode()))
        os.rename(partial, target)

    if jax.process_index() != 0:
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    atomic_dirs.replace_atomically(path, write, complete=_is_complete_artifact,
                                       collective=False)


class ExportedModel:
    """The callable `load_exported` returns: `exported(x)` runs the serialized forward pass.

    Attributes:
      input_signature: the pytree of `jax.ShapeDtypeStruct` the export was made with; the
        batch dimension is the symbolic dimension "b".
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
        self.input_signature = jax.tree.unflatten(
            exported.in_tree.children()[0].children()[1],
            [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in exported.in_avals[len(weights):]],
        )

    def __call__(self, x):
        """The forward pass's output for `x`, a pytree of arrays matching `input_signature`.

        Raises:
          InvalidExportInputError: `x` differs from the signature in structure, rank, a
            non-batch dimension, dtype, or the leaves' batch sizes differ.
        """
        self._check(x)
        return self._call(self._weights, x)

    def _check(self, x):
        expected = self.input_signature
        want = f"expected {_signature_text(expected)}"
        try:
            leaves = jax.tree.leaves(jax.tree.map(lambda _, v: v, expected, x))
        except (ValueError, TypeError):
            raise InvalidExportInputError(
                f"exported model at {self.path}: the input's structure "
                f"{jax.tree.structure(x)} does not match the signature's; {want}."
            ) from None
        batch_sizes = set()
        for spec, value in zip(jax.tree.leaves(expected), leaves):
            shape, dtype = tuple(np.shape(value)), _dtype_of(value)
            dims = _dims(spec)
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
        if len(batch_sizes) > 1:
            raise InvalidExportInputError(
                f"exported model at {self.path}: the inputs' batch sizes differ "
                f"({sorted(batch_sizes)}); every leaf shares one batch dimension; {want}."
            )

    def __repr__(self):
        return (f"ExportedModel({self.path!r}, input_signature="
                f"{_signature_text(self.input_signature)}, platforms={self.platforms})")


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
        path = atomic_dirs.resolve(path, "load_exported", complete=_is_complete_artifact)
    except errors.MissingCheckpointError:
        raise MissingExportError(
            f"load_exported: no directory at {path}; write one with "
            "mirrax.export(model, path, input_signature)."
        ) from None
    missing = [name for name in (PROGRAM_FILE, WEIGHTS_FILE, METADATA_FILE)
               if not os.path.isfile(os.path.join(path, name))]
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
    if (metadata.get("format") != FORMAT or not isinstance(version, int)
            or version > FORMAT_VERSION):
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
            tuple(a.shape) != w.shape or np.dtype(a.dtype) != w.dtype
            for a, w in zip(exported.in_avals, weights)):
        raise InvalidExportError(
            f"load_exported: the weights in {weights_path} do not fit the program in "
            f"{program_path} (files from different exports?). {fix}"
        )
    return ExportedModel(exported, weights, metadata, path)


# -- helpers -------------------------------------------------------------------------------------


def _forward_and_weights(model_or_fn):
    """(forward(weights, x), weights): a pure function and the host arrays it takes."""
    from mirrax._src.training import mixed_precision
    from mirrax._src.training.model import Model, _forward

    if isinstance(model_or_fn, Model):
        module = model_or_fn.module
        policy = getattr(model_or_fn, "dtype_policy", None) or mixed_precision.Policy("float32")
    elif isinstance(model_or_fn, nnx.Module):
        module, policy = model_or_fn, mixed_precision.Policy("float32")
    elif callable(model_or_fn):
        fn = model_or_fn
        return (lambda weights, x: fn(x)), []
    else:
        raise errors.InvalidArgumentTypeError(
            "export: model_or_fn must be a mirrax.Model, an nnx.Module or a function fn(x); "
            f"received {type(model_or_fn).__name__}."
        )
    module.eval()
    graphdef, state = nnx.split(module)
    leaves, treedef = jax.tree.flatten(state)
    # PRNG keys cannot go into an .npz; their raw uint32 data can, re-wrapped inside the program.
    key_impls = [jax.random.key_impl(a) if _is_key(a) else None for a in leaves]
    weights = [_host_copy(jax.random.key_data(a) if impl else a)
               for a, impl in zip(leaves, key_impls)]

    def forward(weights, x):
        values = [jax.random.wrap_key_data(w, impl=impl) if impl else w
                  for w, impl in zip(weights, key_impls)]
        return _forward(nnx.merge(graphdef, jax.tree.unflatten(treedef, values)), x, policy)

    return forward, weights


def _is_key(array) -> bool:
    return jnp.issubdtype(array.dtype, jax.dtypes.prng_key)


def _host_copy(array) -> np.ndarray:
    """A NumPy copy of a possibly replicated or multi-host array."""
    if isinstance(array, jax.Array) and not array.is_fully_addressable:
        if array.is_fully_replicated:
            return np.asarray(array.addressable_data(0))
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(array, tiled=True))
    return np.asarray(array)


def _checked_platforms(platforms) -> list:
    if isinstance(platforms, str):
        platforms = [platforms]  # platforms="cpu" means ("cpu",), not ("c", "p", "u")
    try:
        requested = list(platforms)
    except TypeError:
        raise errors.InvalidArgumentTypeError(
            f"export: platforms must be a list of platform names, e.g. ['cpu', 'cuda']; "
            f"received {platforms!r}."
        ) from None
    unknown = [p for p in requested if not isinstance(p, str) or p.lower() not in KNOWN_PLATFORMS]
    if unknown or not requested:
        raise errors.InvalidArgumentError(
            f"export: platforms must name one or more of {list(KNOWN_PLATFORMS)}; received "
            f"{platforms!r}" + (f" ({unknown} unknown)" if unknown else " (empty)") + "."
        )
    return [p.lower() for p in requested]


def _symbolic_specs(input_signature):
    """The signature with each None/-1 leading dimension replaced by the one symbol "b"."""
    (batch,) = jax.export.symbolic_shape("b")
    if not jax.tree.leaves(input_signature):
        raise errors.InvalidArgumentTypeError(
            "export: input_signature must be a jax.ShapeDtypeStruct or a pytree of them, e.g. "
            f"jax.ShapeDtypeStruct((None, 8, 8, 1), jnp.float32); received {input_signature!r}, "
            "which holds none."
        )

    def convert(spec):
        if not isinstance(spec, jax.ShapeDtypeStruct):
            raise errors.InvalidArgumentTypeError(
                "export: input_signature must be a jax.ShapeDtypeStruct or a pytree of them, "
                f"e.g. jax.ShapeDtypeStruct((None, 8, 8, 1), jnp.float32); received a leaf "
                f"{spec!r} of type {type(spec).__name__}."
            )
        shape = tuple(spec.shape)
        for i, dim in enumerate(shape):
            if isinstance(dim, int) and dim < -1:
                raise errors.InvalidArgumentError(
                    f"export: the signature {spec} has {dim} at dimension {i}; a dimension is a "
                    "size >= 0, or None / -1 (leading dimension only) for any batch size."
                )
            if _dims(spec)[i] is None and i != 0:
                raise errors.InvalidArgumentError(
                    f"export: only the leading (batch) dimension may be None or -1; the "
                    f"signature {spec} has {dim} at dimension {i}."
                )
        if shape and _dims(spec)[0] is None:
            shape = (batch,) + shape[1:]
        return jax.ShapeDtypeStruct(shape, spec.dtype)

    return jax.tree.map(convert, input_signature)


def _dims(spec) -> tuple:
    """The spec's shape with every symbolic, None or negative dimension as None."""
    return tuple(d if isinstance(d, int) and d >= 0 else None for d in spec.shape)


def _describe(specs) -> Any:
    """A JSON-able pytree of {"shape": [...], "dtype": "..."}, the batch dimension null."""
    return jax.tree.map(lambda s: {"shape": list(_dims(s)), "dtype": str(s.dtype)}, specs)


def _signature_text(specs) -> str:
    text = lambda s: f"{s.dtype}{list(_dims(s))}"  # noqa: E731
    return text(specs) if isinstance(specs, jax.ShapeDtypeStruct) else str(
        jax.tree.map(text, specs))


def _dtype_of(value) -> np.dtype:
    return np.dtype(value.dtype) if hasattr(value, "dtype") else np.asarray(value).dtype


def _current_platform() -> str:
    return jax.export.default_export_platform()


def _default_platforms() -> list:
    current = _current_platform()
    return list(DEFAULT_PLATFORMS) + ([current] if current not in DEFAULT_PLATFORMS else [])


def _write_file(path: str, write) -> None:
    with open(path, "wb") as f:
        write(f)


def _is_complete_artifact(path: str) -> bool:
    return all(os.path.isfile(os.path.join(path, n)) for n in (PROGRAM_FILE, WEIGHTS_FILE, METADATA_FILE))


def _checked_export_path(path) -> str:
    path = atomic_dirs.checked_path(path, "export")
    if os.path.lexists(path) and not os.path.isdir(path):
        raise errors.ExistingPathError(
            f"export: {path} is a file, not an artifact directory; mirrax does not replace it. "
            "Export to another path, or delete the file first."
        )
    return path


def _refuse_foreign_directory(path: str) -> None:
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
