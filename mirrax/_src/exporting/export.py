"""`mirrax.export`: the forward pass traced with a symbolic batch size, lowered with
`jax.export` and written with its weights as a serving artifact (artifact.py has the files).

Modules are put in eval mode first and a `mirrax.Model` runs under its dtype policy, as
`predict` computes; the weights are host copies (PRNG keys as their key data), so the artifact
is bound to no device or mesh. A signature the model cannot take fails at tracing, before
anything is written.
"""

from __future__ import annotations

import json
import os
import shutil

import flax
import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from mirrax import errors
from mirrax._src import atomic_dirs
from mirrax._src.distribute import prng_keys
from mirrax._src.exporting import signature
from mirrax._src.exporting.artifact import (
    FORMAT,
    FORMAT_VERSION,
    METADATA_FILE,
    PROGRAM_FILE,
    SINGLE_INPUT_VERSION,
    WEIGHTS_FILE,
    checked_export_path,
    is_complete_artifact,
    refuse_foreign_directory,
)
from mirrax._src.training import input_structure, mixed_precision
from mirrax._src.training.model import Model
from mirrax._src.training.steps import forward as _forward

# An artifact made on a CPU-only machine should also serve on a GPU.
DEFAULT_PLATFORMS = ("cpu", "cuda")
# Platforms `jax.export` lowers for.
KNOWN_PLATFORMS = ("cpu", "cuda", "rocm", "tpu")


def export(model_or_fn, path, input_signature, *, platforms=None) -> None:
    """Writes a serving artifact of the forward pass into the directory `path`.

    The forward pass is traced once with a symbolic batch dimension "b", lowered with
    `jax.export` for `platforms` and written with its weights (three files: the program
    `forward.jax_export`, `weights.npz`, `metadata.json`). Modules are put in eval mode
    (`module.eval()`) first, so dropout is off and batch norm uses its running statistics.
    A `mirrax.Model` is exported as `model.predict` computes (its dtype policy: compute dtype
    inside, floating outputs in float32). The weights are host copies, so the artifact is bound
    to no device or mesh: export a model trained on 8 replicas and serve it on one device. Only
    process 0 writes in a multi-process run.

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
    positional = signature.is_positional(input_signature)
    forward, weights = _forward_and_weights(model_or_fn, positional)
    specs = signature.symbolic_specs(input_signature)
    if positional:
        specs = tuple(specs)  # the program's one argument after the weights: the inputs
    weight_specs = [jax.ShapeDtypeStruct(w.shape, w.dtype) for w in weights]
    requested = _checked_platforms(platforms) if platforms is not None else _default_platforms()
    inputs = input_structure.keras_input_count(model_or_fn)
    several = (
        f"; a Keras model with {inputs} inputs takes them as ONE list: write "
        f"input_signature=[[spec_1, ..., spec_{inputs}]] (or a dict keyed by input name)"
        if positional and inputs and inputs > 1 and len(input_signature) == inputs
        else ""
    )
    _check_traces(forward, weight_specs, specs, input_signature, positional, several)
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
        "input_signature": signature.describe(input_signature),
        "positional": positional,
        "output_signature": signature.describe(
            jax.tree.unflatten(exported.out_tree, list(exported.out_avals))
        ),
        "num_weights": len(weights),
    }
    path = checked_export_path(path)
    if jax.process_index() == 0:
        refuse_foreign_directory(path)

    def write(target: str) -> None:
        # The files go into a fresh directory renamed to `target` once all three are complete,
        # so `target` is complete or absent (what the atomic replace needs).
        partial = target + ".partial"
        if os.path.lexists(partial):
            shutil.rmtree(partial)
        os.makedirs(partial)
        _write_file(
            os.path.join(partial, WEIGHTS_FILE),
            lambda f: np.savez(f, **{f"weights_{i}": w for i, w in enumerate(weights)}),
        )
        _write_file(os.path.join(partial, PROGRAM_FILE), lambda f: f.write(exported.serialize()))
        _write_file(
            os.path.join(partial, METADATA_FILE), lambda f: f.write(json.dumps(metadata, indent=2).encode())
        )
        os.rename(partial, target)

    if jax.process_index() != 0:
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    atomic_dirs.replace_atomically(path, write, complete=is_complete_artifact, collective=False)


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
    data, key_impls = prng_keys.to_data(leaves)
    weights = [_host_copy(a) for a in data]

    def forward(weights, x):
        values = prng_keys.from_data(weights, key_impls)
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


def _check_traces(forward, weight_specs, specs, input_signature, positional: bool, several: str = "") -> None:
    """Traces the forward pass once with the signature; a failure is the signature's (`several`:
    how a multi-input Keras model's signature is written, when it was given spread out)."""
    try:
        jax.eval_shape(forward, weight_specs, specs)
    except Exception as error:  # noqa: BLE001 - whatever the model raises, reported the same way
        line = str(error).strip().splitlines()[0][:400] if str(error).strip() else ""
        takes = (
            f"{len(input_signature)} positional input(s) (a list signature is one entry "
            "per positional argument, as tf.function's; for one input x write [spec] "
            f"or spec){several}"
            if positional
            else "one input x"
        )
        hint = (
            "; the model reads the batch size in Python code, so give the signature a fixed batch size"
            if "symbolic" in line.lower() or "inconclusive" in type(error).__name__.lower()
            else ""
        )
        raise errors.IncompatibleInputError(
            f"export: the forward pass fails for input_signature {signature.text(specs)} "
            f"({takes}): {type(error).__name__}: {line}{_origin(error)}{hint}. Give the "
            "shape and dtype of one call's input as the model takes it (e.g. the number of "
            "features its first layer expects). Nothing was written."
        ) from error


# mirrax's own package directory (mirrax/, three levels above this file), for telling library
# frames from the user's.
_MIRRAX_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep


def _origin(error) -> str:
    """ " (at file:line)": the innermost frame of the user's code that `error` passed through
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


def _current_platform() -> str:
    return jax.export.default_export_platform()


def _default_platforms() -> list:
    current = _current_platform()
    return list(DEFAULT_PLATFORMS) + ([current] if current not in DEFAULT_PLATFORMS else [])


def _write_file(path: str, write) -> None:
    with open(path, "wb") as f:
        write(f)
