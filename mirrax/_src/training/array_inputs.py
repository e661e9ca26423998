"""In-memory examples given to `Model`: other frameworks' tensors and pandas objects as NumPy,
which inputs are arrays (and how many examples they hold), their global batches (the one place
arrays are cut into batches, for every executor), and fit's validation data
(`validation_split`'s held-out tail, `validation_data` unpacked)."""

from __future__ import annotations

import jax
import numpy as np

from mirrax import errors
from mirrax._src.distribute import batching
from mirrax._src.training import arguments as checks
from mirrax._src.training import input_structure


def as_arrays(value):
    """A tensor of another framework (torch.Tensor, tf.Tensor: `.numpy()` and `.shape`), a
    pandas DataFrame or Series (`.to_numpy()`), or a dict or list / tuple of them, as NumPy,
    so fit(x_tensor, y_tensor) means what fit(x_array, y_array) does."""

    def convert(leaf):
        if type(leaf).__module__.split(".")[0] == "pandas" and hasattr(leaf, "to_numpy"):
            return leaf.to_numpy()  # a DataFrame or Series: its values, as Keras 3 takes them
        return checks.to_numpy(leaf) if hasattr(leaf, "shape") else leaf

    # Only a dict of tensors: another dict (a Hugging Face DatasetDict of splits) keeps its
    # type, for the error that names it.
    if isinstance(value, dict) and all(batching.is_array(leaf) for leaf in value.values()):
        return {key: convert(leaf) for key, leaf in value.items()}
    if isinstance(value, (list, tuple)):
        return input_structure.as_arrays(value)
    return convert(value)


def is_arrays(x) -> bool:
    """True for what may be in-memory examples: an array, a dict of arrays (a multi-input
    model's x), or a list / tuple of arrays of one length (several inputs, when
    `input_structure.reads_as_inputs` says so: `ModelInput` decides; otherwise a list or tuple
    is a dataset, a sequence of batches).
    """
    if isinstance(x, (np.ndarray, jax.Array)):
        return True
    if isinstance(x, (list, tuple)):
        return input_structure.is_array_list(x) and all(
            isinstance(item, (np.ndarray, jax.Array)) for item in x
        )
    return (
        isinstance(x, dict)
        and bool(x)
        and all(isinstance(leaf, (np.ndarray, jax.Array)) for leaf in jax.tree.leaves(x))
    )


def num_examples(x) -> int:
    """The number of examples in arrays `x`: the first leaf's first axis."""
    return len(jax.tree.leaves(x)[0])


def global_batches(parts: tuple, batch_size: int, order=None):
    """The global batches of `parts` (a tuple of array pytrees holding the same n examples, e.g.
    (x, y) or (x, y, sample_weight)): `batch_size` examples each, the last one short (as
    Keras), in stored order (`order` None: slices, views of the arrays, no copy) or in the
    order of the int array `order` (copies). Each batch is a tuple of `parts`' structure."""
    # Flattened once: a tree.map per batch cost more than the slicing (fit at batch 8).
    leaves, treedef = jax.tree.flatten(jax.tree.map(np.asarray, parts))
    n = len(leaves[0]) if leaves else 0
    for start in range(0, n, batch_size):
        index = slice(start, start + batch_size) if order is None else order[start : start + batch_size]
        yield jax.tree.unflatten(treedef, [a[index] for a in leaves])


def split_validation(x, y, sample_weight, fraction):
    """(x, y, sample_weight, (x_val, y_val, w_val)): the last `fraction` of the arrays held
    out, as Keras's `validation_split` (taken before shuffling).

    Raises:
      InvalidArgumentError: the split leaves no training or no validation example.
    """
    n = num_examples(x)
    cut = int(n * (1.0 - fraction))
    if cut == 0 or cut == n:
        raise errors.InvalidArgumentError(
            f"fit: validation_split={fraction} of {n} examples leaves "
            f"{'no training' if cut == 0 else 'no validation'} example; pass a fraction that "
            f"keeps at least one of each (e.g. {max(1, n // 5)}/{n} = {max(1, n // 5) / n:.2f})."
        )
    take = lambda tree, s: None if tree is None else jax.tree.map(lambda a: a[s], tree)  # noqa: E731
    head, tail = slice(0, cut), slice(cut, n)
    return (
        take(x, head),
        take(y, head),
        take(sample_weight, head),
        (take(x, tail), take(y, tail), take(sample_weight, tail)),
    )


def _validation_x(data) -> bool:
    """Whether `data[0]` is validation_data's x: an array or a dict of arrays; a list / tuple of
    arrays only in a tuple (x_val, y_val[, w]) whose y has as many examples (a list of batches
    [(x, y), (x, y)] stays a dataset)."""
    x = as_arrays(data[0])
    if not is_arrays(x):
        return False
    if not isinstance(x, (list, tuple)):
        return True
    y = as_arrays(data[1]) if len(data) > 1 else None
    leaves = jax.tree.leaves(y) if isinstance(data, tuple) and y is not None else []
    return bool(leaves) and np.ndim(leaves[0]) >= 1 and len(leaves[0]) == num_examples(x)


def unpack_validation(data):
    """`validation_data` as (x, y, sample_weight); a dataset as (data, None, None).

    Raises:
      InvalidArgumentError: arrays given as a tuple of another length than 2 or 3.
    """
    if isinstance(data, (tuple, list)) and len(data) in (2, 3) and _validation_x(data):
        return data[0], data[1], data[2] if len(data) == 3 else None
    if isinstance(data, (tuple, list)) and data and _validation_x(data):
        raise errors.InvalidArgumentError(
            f"fit: validation_data as arrays must be (x_val, y_val) or (x_val, y_val, "
            f"sample_weight); received a {type(data).__name__} of {len(data)}."
        )
    return data, None, None
