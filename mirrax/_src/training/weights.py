"""The module's weights for `Model`: the Keras-ordered list `get_weights` / `set_weights` use,
with the names TensorBoard's histograms take, and what `summary` prints."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mirrax import errors
from mirrax._src import argument_checks
from mirrax._src.training import keras_models


def module_weights(module) -> list:
    """(name, variable) of every weight: for a Keras model, each of `keras_model.weights` named
    by its Keras path ("dense/kernel"), in `keras_model.get_weights()` order; for an NNX
    module, every variable but PRNG state named by its state path ("linear.kernel"), in
    `nnx.state`'s order."""
    if isinstance(module, keras_models.KerasModule):
        return module.weights()
    return [
        (".".join(map(str, path)), variable)
        for path, variable in nnx.to_flat_state(nnx.state(module, nnx.Not(nnx.RngState)))
    ]


def histogram_tags(module) -> list:
    """TensorBoard's tag for each weight's histogram, in `get_weights()` order: as Keras's own
    callback tags them for a Keras model (its path + "/histogram": "dense/kernel/histogram"),
    "weight_<i>/histogram" for an NNX module."""
    if isinstance(module, keras_models.KerasModule):
        return [f"{name.replace(':', '_')}/histogram" for name, _ in module.weights()]
    return [f"weight_{i}/histogram" for i in range(len(module_weights(module)))]


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
    paths = [name for name, _ in named]
    for index, (variable, value) in enumerate(zip(variables, weights)):
        old = variable.get_value()
        if tuple(np.shape(value)) != tuple(old.shape):
            raise errors.InvalidArgumentError(
                f"set_weights: weights[{index}] has shape {np.shape(value)}, but the "
                f"variable {paths[index]} has shape {old.shape}; pass the arrays in "
                "model.get_weights()'s order and shapes."
            )
        variable.set_value(jax.device_put(jnp.asarray(value, old.dtype), old.sharding))


def print_summary(
    module, line_length, positions, print_fn, expand_nested, show_trainable, layer_range
) -> None:
    """`Model.summary` of `module` (its arguments, docs and errors there)."""
    if print_fn is not None and not callable(print_fn):
        raise errors.InvalidArgumentTypeError(
            f"summary: print_fn must be a function of one str (e.g. print); received "
            f"{type(print_fn).__name__} {print_fn!r}."
        )
    keras_model = module.keras_model if isinstance(module, keras_models.KerasModule) else None
    if keras_model is not None and callable(getattr(keras_model, "summary", None)):
        # Keras's own table (layers, output shapes, parameter counts) with Keras's arguments.
        keras_model.summary(
            line_length=line_length,
            positions=positions,
            print_fn=print_fn,
            expand_nested=expand_nested,
            show_trainable=show_trainable,
            layer_range=layer_range,
        )
        return
    for name, value in (("positions", positions), ("layer_range", layer_range)):
        if value is not None:
            raise errors.UnsupportedArgumentError(
                f"summary: {name}={value!r} is not supported (the table lists variables, "
                "not layers, in fixed columns); leave it None."
            )
    argument_checks.flag("summary", "expand_nested", expand_nested)
    show_trainable = argument_checks.flag("summary", "show_trainable", show_trainable)
    line_length = argument_checks.count("summary", "line_length", line_length, minimum=40, allow_none=True)
    print_fn = print_fn or print
    rows, total = [], 0
    named = (
        module_weights(module)
        if keras_model is not None
        else [(".".join(map(str, path)), v) for path, v in nnx.to_flat_state(nnx.state(module))]
    )
    for name, variable in named:
        value = variable.get_value()
        size = int(np.prod(np.shape(value)))
        total += size
        rows.append(
            (
                name,
                type(variable).__name__,
                str(np.shape(value)),
                size,
                "yes" if isinstance(variable, nnx.Param) else "no",
            )
        )
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
