"""The module's weights for `Model`: the Keras-ordered list `get_weights` / `set_weights` use,
and the table `summary` prints."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mirrax import errors
from mirrax._src.training import arguments as checks


def module_weights(module) -> list:
    """(path, variable) of every variable but PRNG state, in `nnx.state`'s order."""
    return list(nnx.to_flat_state(nnx.state(module, nnx.Not(nnx.RngState))))


def set_weights(module, weights) -> None:
    """`Model.set_weights` on `module` (its docs and errors there)."""
    named = module_weights(module)
    variables = [v for _, v in named]
    if isinstance(weights, (str, bytes, dict)) or not hasattr(weights, "__len__"):
        raise errors.InvalidArgumentTypeError(
            f"set_weights: weights must be a list of arrays (as model.get_weights() "
            f"returns); received {type(weights).__name__} {weights!r:.60}."
        )
    if len(weights) != len(variables):
        raise errors.InvalidArgumentError(
            f"set_weights: the model has {len(variables)} variables but {len(weights)} "
            "arrays were given; pass a list from model.get_weights()."
        )
    paths = [".".join(map(str, path)) for path, _ in named]
    for index, (variable, value) in enumerate(zip(variables, weights)):
        old = variable.get_value()
        if tuple(np.shape(value)) != tuple(old.shape):
            raise errors.InvalidArgumentError(
                f"set_weights: weights[{index}] has shape {np.shape(value)}, but the "
                f"variable {paths[index]} has shape {old.shape}; pass the arrays in "
                "model.get_weights()'s order and shapes."
            )
        variable.set_value(jax.device_put(jnp.asarray(value, old.dtype), old.sharding))


def print_summary(module, line_length, positions, print_fn, expand_nested, show_trainable,
                  layer_range) -> None:
    """`Model.summary` of `module` (its arguments, docs and errors there)."""
    if print_fn is not None and not callable(print_fn):
        raise errors.InvalidArgumentTypeError(
            f"summary: print_fn must be a function of one str (e.g. print); received "
            f"{type(print_fn).__name__} {print_fn!r}."
        )
    for name, value in (("positions", positions), ("layer_range", layer_range)):
        if value is not None:
            raise errors.UnsupportedArgumentError(
                f"summary: {name}={value!r} is not supported (the table lists variables, "
                "not layers, in fixed columns); leave it None."
            )
    checks.check_bool("summary", "expand_nested", expand_nested)
    show_trainable = checks.check_bool("summary", "show_trainable", show_trainable)
    line_length = checks.check_count("summary", "line_length", line_length, minimum=40,
                               allow_none=True)
    print_fn = print_fn or print
    rows, total = [], 0
    for path, variable in nnx.to_flat_state(nnx.state(module)):
        value = variable.get_value()
        size = int(np.prod(np.shape(value)))
        total += size
        rows.append((".".join(map(str, path)), type(variable).__name__, str(np.shape(value)), size,
                     "yes" if isinstance(variable, nnx.Param) else "no"))
    # The fixed columns take 40 characters (11 + 17 + 10 + separators), 10 more with
    # show_trainable.
    fixed = 40 + (10 if show_trainable else 0)
    width = max([len(r[0]) for r in rows] + [8, (line_length or 0) - fixed])
    extra = f" {'Trainable':>9}" if show_trainable else ""
    print_fn(f'Model: "{type(module).__name__}"')
    print_fn(f"{'Variable':<{width}}  {'Type':<10} {'Shape':<16} {'Count':>10}{extra}")
    for name, kind, shape, size, trainable in rows:
        extra = f" {trainable:>9}" if show_trainable else ""
        print_fn(f"{name:<{width}}  {kind:<10} {shape:<16} {size:>10,}{extra}")
    print_fn(f"Total: {total:,} values")
