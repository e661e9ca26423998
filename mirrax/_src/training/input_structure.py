"""Structured examples for `Model.fit` / `evaluate` / `predict`: when a list / tuple x is the
model's several inputs rather than a sequence of batches, labels as one array or one per output
(a list / tuple / dict of arrays), and sample weights likewise, with the checks of each.

The rule for a list / tuple x (docs/training.md, "Inputs"): it is SEVERAL INPUTS when every
item is an array (NumPy, JAX, tf or torch tensor; not a tuple) with at least one dimension, all
items have the same first-axis length, and either y or batch_size is given, or the model is a
Keras model with len(keras_model.inputs) == len(x) > 1. Otherwise it is a sequence of batches.
"""

from __future__ import annotations

import jax
import numpy as np

from mirrax import errors
from mirrax._src.distribute import batching
from mirrax._src.training import arguments as checks


def _array_items(x) -> bool:
    """Whether `x` is a non-empty list / tuple (not a namedtuple: a pytree with named fields)
    whose items are all arrays of rank >= 1."""
    return (
        isinstance(x, (list, tuple))
        and not hasattr(x, "_fields")
        and bool(x)
        and all(
            batching.is_array(item)
            and not isinstance(item, (list, tuple))
            and len(getattr(item, "shape", ())) >= 1
            for item in x
        )
    )


def is_array_list(x) -> bool:
    """Whether `x` is a list / tuple of arrays of rank >= 1 that all hold the same number of
    examples (what several inputs, or per-output labels, look like)."""
    return _array_items(x) and len({int(item.shape[0]) for item in x}) == 1


def keras_input_count(model) -> int | None:
    """The number of inputs of a Keras functional model wrapped in `model`; None for an NNX
    module or a Keras model without `inputs` (a subclassed one)."""
    keras_model = getattr(getattr(model, "module", None), "keras_model", None)
    try:
        inputs = getattr(keras_model, "inputs", None)
    except (AttributeError, ValueError):  # a subclassed model not called on symbolic inputs
        return None
    return len(inputs) if isinstance(inputs, (list, tuple)) else None


def keras_output_names(model) -> list | None:
    """A wrapped Keras functional model's `output_names`; None when it has none."""
    keras_model = getattr(getattr(model, "module", None), "keras_model", None)
    try:
        names = getattr(keras_model, "output_names", None)
    except (AttributeError, ValueError):
        return None
    return list(names) if names else None


def reads_as_inputs(x, y, batch_size, model) -> bool:
    """Whether a list / tuple `x` is the model's several inputs (the module docstring's rule)."""
    if not is_array_list(x):
        return False
    return y is not None or batch_size is not None or (keras_input_count(model) or 0) == len(x) > 1


def as_arrays(x):
    """A list / tuple of arrays of rank >= 1 with tf / torch tensors as NumPy (the same
    container type); anything else unchanged."""
    if not _array_items(x) or all(isinstance(item, (np.ndarray, jax.Array)) for item in x):
        return x
    return type(x)(checks.to_numpy(item) for item in x)


def check_input_lengths(what: str, x, y, batch_size) -> None:
    """Refuses a list / tuple of arrays given with y or batch_size whose items differ in length:
    as several inputs, every input must hold the same examples.

    Raises:
      InvalidArgumentError: naming each item's length.
    """
    if not _array_items(x) or (y is None and batch_size is None) or is_array_list(x):
        return
    lengths = ", ".join(f"x[{i}]: {int(item.shape[0])}" for i, item in enumerate(x))
    raise errors.InvalidArgumentError(
        f"{what}: x is a {type(x).__name__} of {len(x)} arrays of different lengths ({lengths}) "
        f"given with {'y' if y is not None else 'batch_size'}; as the model's {len(x)} inputs "
        "every array must hold the same examples along axis 0. Give each input one row per "
        "example."
    )


def ambiguity_hint(what: str, x) -> str:
    """The other reading of a list x of equal-length arrays read as batches, for the error of a
    first batch that does not fit the model ("" for any other x)."""
    if not is_array_list(x) or len(x) < 2:
        return ""
    k = len(x)
    return (
        f"{what}: x is a {type(x).__name__} of {k} arrays, read as {k} batches; to pass "
        f"them as the model's {k} inputs, pass batch_size=... (or y, or x as a dict of "
        "arrays keyed by input). A list x is a sequence of batches when neither y nor "
        "batch_size is given (and the model is not a Keras model of as many inputs). "
    )


def _leaves_with_names(name: str, tree) -> list:
    """(name, leaf) of each leaf of `tree`, named as `name[1]`, `name['b']`, or `name`."""
    found = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [(name + jax.tree_util.keystr(path), leaf) for path, leaf in found]


def labels(y, n: int):
    """`y` as the loss takes it: a list / tuple of arrays of `n` rows each (one per output)
    kept, with tf / torch tensors as NumPy; any other list (Python numbers, one label or one
    row per example) as one NumPy array, as Keras accepts labels as a Python list."""
    if isinstance(y, (list, tuple)):
        if _array_items(y) and (len(y) != n or is_array_list(y) and int(y[0].shape[0]) == n):
            return as_arrays(y)
        return np.asarray(y)
    return y


def check_lengths(what: str, n: int, **trees) -> None:
    """Refuses a leaf of y or sample_weight (or of x) whose first axis is not `n` examples.

    Raises:
      InvalidArgumentError: naming the leaf, its length and `n`.
    """
    for name, tree in trees.items():
        if tree is None:
            continue
        for leaf_name, leaf in _leaves_with_names(name, tree):
            length = len(leaf) if np.ndim(leaf) else 0
            if length != n:
                raise errors.InvalidArgumentError(
                    f"{what}: x has {n} examples but {leaf_name} has {length}; they must have "
                    "the same length along axis 0."
                )


def output_names(model, y) -> list | None:
    """The names a dict sample_weight may use: a dict y's keys, else a Keras functional
    model's `output_names`, else "output_1", ... for a list / tuple y; None when unknown."""
    if isinstance(y, dict):
        return list(y)
    names = keras_output_names(model)
    if names is not None:
        return names
    if isinstance(y, (list, tuple)):
        return [f"output_{i + 1}" for i in range(len(y))]
    return None


def sample_weights(what: str, sample_weight, n: int, y=None, model=None):
    """`sample_weight` as float32: one (n,) array (shared by every output), or a list / tuple /
    dict of (n,) arrays, one per output (kept as that structure).

    Raises:
      InvalidArgumentError: an array not of shape (n,) or not finite, a list of another
        length than y's, a dict with a key that is not an output.
    """
    if not isinstance(sample_weight, (list, tuple, dict)) or not is_weights_tree(sample_weight):
        return checks.check_sample_weight(what, sample_weight, n)
    names = output_names(model, y)
    if isinstance(sample_weight, dict):
        unknown = [key for key in sample_weight if names is not None and key not in names]
        if unknown:
            raise errors.InvalidArgumentError(
                f"{what}: sample_weight has the key {unknown[0]!r}, which is not an output of "
                f"the model; its outputs are {names}. Key the weights by output name."
            )
    else:
        count = len(y) if isinstance(y, (list, tuple)) else len(names) if names else None
        if count is not None and len(sample_weight) != count:
            raise errors.InvalidArgumentError(
                f"{what}: sample_weight is a {type(sample_weight).__name__} of "
                f"{len(sample_weight)} arrays but the model has {count} outputs; give one "
                "(n,) array per output, in output order (or one array shared by all)."
            )
    if isinstance(sample_weight, dict):
        return {
            key: _one_weight(what, f"sample_weight[{key!r}]", value, n)
            for key, value in sample_weight.items()
        }
    return type(sample_weight)(
        _one_weight(what, f"sample_weight[{i}]", value, n) for i, value in enumerate(sample_weight)
    )


def weights_tree(sample_weight):
    """`sample_weight` as the tree whose leaves' lengths are checked: a list / tuple / dict of
    arrays as it is, anything else (a Python list of numbers) as one NumPy array."""
    if isinstance(sample_weight, (list, tuple, dict)) and is_weights_tree(sample_weight):
        return sample_weight
    return np.asarray(sample_weight)


def is_weights_tree(value) -> bool:
    """Whether a list / tuple / dict sample_weight holds arrays (one per output) rather than
    being one weight per example as a Python list of numbers."""
    items = list(value.values()) if isinstance(value, dict) else list(value)
    return bool(items) and all(batching.is_array(item) and np.ndim(item) >= 1 for item in items)


def _one_weight(what: str, name: str, value, n: int) -> np.ndarray:
    return checks.check_sample_weight(what, value, n, name=name)
