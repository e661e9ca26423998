"""`mirrax.export` / `mirrax.load_exported`: a serving artifact that runs without the model's code.

The artifact is a directory of three files:

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

import json
import os
import shutil
import struct
import zipfile
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from mirrax import errors
from mirrax._src import atomic_dirs
from mirrax._src.training import mixed_precision
from mirrax._src.training.model import Model
from mirrax._src.training.steps import forward as _forward

FORMAT = "mirrax.export"
# Version 2 adds positional inputs (a list or tuple input_signature); an artifact with one
# input is still written as version 1, so an older mirrax keeps reading it.
FORMAT_VERSION = 2
SINGLE_INPUT_VERSION = 1
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
      input_signature: what ONE call takes, as `tf.function`'s `input_signature`:
        - a `jax.ShapeDtypeStruct`, or a dict (or namedtuple, or other non-list pytree) of
          them: the model's one input `x`; the artifact is called `exported(x)`;
        - a list or tuple: one entry per POSITIONAL argument, as TF's
          `input_signature=[tf.TensorSpec(...)]`. `[spec]` is called `exported(x)`, `[spec_a,
          spec_b]` is called `exported(a, b)` and runs `model(a, b)`; an entry may itself be
          a pytree (a tuple input `x = (a, b)` is written `[(spec_a, spec_b)]`).
        A leading dimension of None or -1 means "any batch size" and becomes the symbolic
        dimension "b", shared by every leaf, e.g.
        `jax.ShapeDtypeStruct((None, 8, 8, 1), jnp.float32)` for images (batch, 8, 8, 1).
      platforms: the platforms to lower for; default ("cpu", "cuda") plus the current one. If
        lowering for all of them fails (e.g. a CUDA-only kernel is missing on a CPU machine),
        the program is lowered for the current platform only; `metadata.json` records which.

    Atomic, also when replacing an earlier artifact: the files are written into a new
    directory beside `path`, which is then swapped in by rename, so a kill at any moment
    leaves the old or the new artifact loadable from `path`. The forward pass is traced before
    anything is written: a signature the model cannot take leaves `path` as it was.

    Raises:
      InvalidArgumentTypeError (a TypeError): `model_or_fn` is none of the three, or
        `input_signature` holds no leaf or a leaf that is not a `jax.ShapeDtypeStruct`.
      InvalidArgumentError (a ValueError): a non-leading dimension is None or negative, or
        `platforms` names an unknown platform.
      IncompatibleInputError (a ValueError): the forward pass fails when traced with
        `input_signature` (e.g. 9 features for a first layer of 8); names the signature and
        the model's error (chained as the cause).
      ExistingPathError (a FileExistsError): `path` is a file, or a non-empty directory that
        holds no mirrax export (export replaces the whole directory).
    """
    positional = _is_positional(input_signature)
    forward, weights = _forward_and_weights(model_or_fn, positional)
    specs = _symbolic_specs(input_signature)
    if positional:
        specs = tuple(specs)  # the program's one argument after the weights: the inputs
    weight_specs = [jax.ShapeDtypeStruct(w.shape, w.dtype) for w in weights]
    requested = _checked_platforms(platforms) if platforms is not None else _default_platforms()
    _check_traces(forward, weight_specs, specs, input_signature, positional)
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
        "format_version": FORMAT_VERSION if positional else SINGLE_INPUT_VERSION,
        "jax_version": jax.__version__,
        "platforms": list(exported.platforms),
        "requested_platforms": requested,
        "platform_fallback_reason": fallback,
        "input_signature": _describe(input_signature),
        "positional": positional,
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
            [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in exported.in_avals[len(weights):]],
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
        want = f"expected {_signature_text(self.input_signature)}"
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
        want = f"expected {_signature_text(expected)}"
        treedef = jax.tree.structure(expected)
        try:
            values = treedef.flatten_up_to(x)
        except (ValueError, TypeError):
            raise InvalidExportInputError(
                f"exported model at {self.path}: the input's structure does not match the "
                f"signature's: received {_received_text(x)}; {want}."
            ) from None
        specs = jax.tree.leaves(expected)
        where = [""] * len(specs)
        if not isinstance(expected, jax.ShapeDtypeStruct):
            where = [_where(path, self.positional)
                     for path, _ in jax.tree_util.tree_flatten_with_path(expected)[0]]
        arrays, batch_sizes = [], set()
        for spec, value, at in zip(specs, values, where):
            value = self._array(value, spec, at, want)
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
                f"exported model at {self.path}: received {_received_text(value)} (a "
                f"{type(value).__name__}){at} where the signature expects one array "
                f"{_signature_text(spec)}; {want}. Pass the array itself, not wrapped in a "
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
            f"({value!r:.60}){at}; the signature expects an array {_signature_text(spec)}; "
            f"{want}. Pass a NumPy or JAX array (or a torch / tf tensor)."
        )

    def __repr__(self):
        return (f"ExportedModel({self.path!r}, input_signature="
                f"{_signature_text(self.input_signature)}, positional={self.positional}, "
                f"platforms={self.platforms})")


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


def _forward_and_weights(model_or_fn, positional: bool):
    """(forward(weights, x), weights): a pure function and the host arrays it takes.

    With `positional`, `x` is the tuple of positional inputs, passed as `model(*x)`.
    """
    if isinstance(model_or_fn, Model):
        module = model_or_fn.module
        policy = getattr(model_or_fn, "dtype_policy", None) or mixed_precision.Policy("float32")
    elif isinstance(model_or_fn, nnx.Module):
        module, policy = model_or_fn, mixed_precision.Policy("float32")
    elif callable(model_or_fn):
        fn = model_or_fn
        return (lambda weights, x: fn(*x) if positional else fn(x)), []
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
        module = nnx.merge(graphdef, jax.tree.unflatten(treedef, values))
        return _forward(_Positional(module) if positional else module, x, policy)

    return forward, weights


class _Positional(nnx.Module):
    """`inner` called with the tuple of positional inputs spread, `inner(*args)`: the one
    input `_forward` passes (and casts to the compute dtype) is that tuple."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, args):
        return self.inner(*args)


def _is_positional(input_signature) -> bool:
    """A list or tuple signature is the positional inputs, as tf.function's; a namedtuple
    is one input (a pytree with named fields)."""
    return isinstance(input_signature, (list, tuple)) and not hasattr(input_signature, "_fields")


def _check_traces(forward, weight_specs, specs, input_signature, positional: bool) -> None:
    """Traces the forward pass once with the signature; a failure is the signature's."""
    try:
        jax.eval_shape(forward, weight_specs, specs)
    except Exception as error:  # noqa: BLE001 - whatever the model raises, reported the same way
        line = str(error).strip().splitlines()[0][:400] if str(error).strip() else ""
        takes = (f"{len(input_signature)} positional input(s) (a list signature is one entry "
                 "per positional argument, as tf.function's; for one input x write [spec] "
                 "or spec)" if positional else "one input x")
        hint = ("; the model reads the batch size in Python code, so give the signature a "
                "fixed batch size" if "symbolic" in line.lower()
                or "inconclusive" in type(error).__name__.lower() else "")
        raise errors.IncompatibleInputError(
            f"export: the forward pass fails for input_signature {_signature_text(specs)} "
            f"({takes}): {type(error).__name__}: {line}{_origin(error)}{hint}. Give the "
            "shape and dtype of one call's input as the model takes it (e.g. the number of "
            "features its first layer expects). Nothing was written."
        ) from error


def _where(path, positional: bool) -> str:
    """" at positional input 1['a']" / " at ['a']": where a leaf sits in the inputs."""
    if positional:
        rest = jax.tree_util.keystr(tuple(path[1:]))
        return f" at positional input {path[0].idx}{rest}"
    return f" at {jax.tree_util.keystr(tuple(path))}"


# mirrax's own package directory (mirrax/), for telling library frames from the user's.
_MIRRAX_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _origin(error) -> str:
    """" (at file:line)": the innermost frame of the user's code that `error` passed through
    (outside jax, flax and mirrax), else the innermost outside jax; "" if none."""
    def package_dir(module):
        return os.path.dirname(os.path.abspath(module.__file__)) + os.sep

    jax_dirs = (package_dir(jax), os.path.join(os.path.dirname(package_dir(jax)), "jaxlib"))
    library_dirs = jax_dirs + (package_dir(flax), _MIRRAX_DIR)
    user = outside_jax = None
    tb = error.__traceback__
    while tb is not None:
        filename = os.path.abspath(tb.tb_frame.f_code.co_filename)
        if not filename.startswith(jax_dirs):
            outside_jax = tb
            if not filename.startswith(library_dirs):
                user = tb
        tb = tb.tb_next
    frame = user or outside_jax
    if frame is None:
        return ""
    return f" (at {frame.tb_frame.f_code.co_filename}:{frame.tb_lineno})"


def _is_key(array) -> bool:
    return jnp.issubdtype(array.dtype, jax.dtypes.prng_key)


def _host_copy(array) -> np.ndarray:
    """A NumPy copy of a possibly replicated or multi-host array."""
    if isinstance(array, jax.Array) and not array.is_fully_addressable:
        if array.is_fully_replicated:
            return np.asarray(array.addressable_data(0))
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


def _received_text(x) -> str:
    """What a call received, e.g. "[float32[4, 8]]" for a list holding one array."""
    def text(leaf):
        if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
            return f"{str(leaf.dtype).replace('torch.', '')}{list(leaf.shape)}"
        return f"{type(leaf).__name__} {leaf!r:.40}"

    if x is None or jax.tree_util.treedef_is_leaf(jax.tree.structure(x)):
        return text(x) if x is not None else "None"
    described = str(jax.tree.map(text, x))
    return described if len(described) <= 300 else described[:300] + " ..."


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
