"""Input signatures of an export: the symbolic batch dimension, their checks, and how they are
written into metadata.json and into error messages.

A signature is what ONE call takes, as `tf.function`'s `input_signature`: a pytree of
`jax.ShapeDtypeStruct` whose leading dimension may be None or -1 ("any batch size", lowered as
the one symbolic dimension "b"); a list or tuple is one entry per positional argument.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from mirrax import errors


def is_positional(input_signature) -> bool:
    """A list or tuple signature is the positional inputs, as tf.function's; a namedtuple
    is one input (a pytree with named fields)."""
    return isinstance(input_signature, (list, tuple)) and not hasattr(input_signature, "_fields")


def symbolic_specs(input_signature):
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
            if dims(spec)[i] is None and i != 0:
                raise errors.InvalidArgumentError(
                    f"export: only the leading (batch) dimension may be None or -1; the "
                    f"signature {spec} has {dim} at dimension {i}."
                )
        if shape and dims(spec)[0] is None:
            shape = (batch,) + shape[1:]
        return jax.ShapeDtypeStruct(shape, spec.dtype)

    return jax.tree.map(convert, input_signature)


def dims(spec) -> tuple:
    """The spec's shape with every symbolic, None or negative dimension as None."""
    return tuple(d if isinstance(d, int) and d >= 0 else None for d in spec.shape)


def describe(specs) -> Any:
    """A JSON-able pytree of {"shape": [...], "dtype": "..."}, the batch dimension null."""
    return jax.tree.map(lambda s: {"shape": list(dims(s)), "dtype": str(s.dtype)}, specs)


def text(specs) -> str:
    """The signature as error messages show it, e.g. "float32[None, 8]" (None: any batch size)."""
    leaf_text = lambda s: f"{s.dtype}{list(dims(s))}"  # noqa: E731
    return (
        leaf_text(specs) if isinstance(specs, jax.ShapeDtypeStruct) else str(jax.tree.map(leaf_text, specs))
    )


def received_text(x) -> str:
    """What a call received, e.g. "[float32[4, 8]]" for a list holding one array."""

    def text(leaf):
        if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
            return f"{str(leaf.dtype).replace('torch.', '')}{list(leaf.shape)}"
        return f"{type(leaf).__name__} {leaf!r:.40}"

    if x is None or jax.tree_util.treedef_is_leaf(jax.tree.structure(x)):
        return text(x) if x is not None else "None"
    described = str(jax.tree.map(text, x))
    return described if len(described) <= 300 else described[:300] + " ..."


def where(path, positional: bool) -> str:
    """ " at positional input 1['a']" / " at ['a']": where a leaf sits in the inputs."""
    if positional:
        rest = jax.tree_util.keystr(tuple(path[1:]))
        return f" at positional input {path[0].idx}{rest}"
    return f" at {jax.tree_util.keystr(tuple(path))}"


def dtype_of(value) -> np.dtype:
    """The NumPy dtype of an input leaf (an array, a tensor or a Python scalar)."""
    return np.dtype(value.dtype) if hasattr(value, "dtype") else np.asarray(value).dtype
