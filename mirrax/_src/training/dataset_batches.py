"""The batches of a user's dataset for `Model.fit` / `evaluate` / `predict`: a first look at
the source, each batch as (x, y, sample_weight) (or (x,)), the errors, with the fix, for what
loaders give instead (dict batches, single examples, a map-style dataset), and the passes over
a dataset (`NormalizedBatches`) and a Keras `PyDataset` (`PyDatasetPass`)."""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Iterable

import jax
import numpy as np

from mirrax import errors
from mirrax._src.distribute import batching
from mirrax._src.distribute import input as input_lib
from mirrax._src.training import arguments as checks
from mirrax._src.training import input_structure
from mirrax._src.training import losses as losses_lib


def class_weights_of(y, table) -> np.ndarray:
    """Per-example weights of labels `y` (ints, or one-hot / probabilities: argmax), as Keras.

    Raises:
      InvalidArgumentError: `y` holds several outputs' labels (Keras 3 refuses that too).
    """
    if (
        isinstance(y, dict)
        or isinstance(y, (list, tuple))
        and y
        and all(batching.is_array(item) and np.ndim(item) >= 1 for item in y)
    ):
        raise errors.InvalidArgumentError(
            f"fit: class_weight is only supported for a model with one output; y is a "
            f"{type(y).__name__} of {len(y)} label arrays. Pass per-output sample_weight "
            "instead (e.g. the class weights looked up for each output's labels)."
        )
    y = np.asarray(y)
    if y.ndim > 1:
        y = np.argmax(y, axis=-1) if y.shape[-1] != 1 else np.squeeze(y, axis=-1)
    if y.ndim != 1:
        raise errors.InvalidArgumentError(
            f"fit: class_weight needs one label per example; received labels of shape {y.shape}."
        )
    y = np.round(y).astype(np.int64)
    return np.array([table.get(int(label), 1.0) for label in y], np.float32)


def check_source(what: str, x):
    """Refuses an x that can be no input at all (before anything is read from it)."""
    if x is None:
        raise errors.InvalidArgumentError(
            f"{what}: x is required (arrays, an iterable of batches, or a distributed dataset)."
        )
    if inspect.isgeneratorfunction(x) or (callable(x) and not hasattr(x, "__iter__")):
        name = getattr(x, "__name__", type(x).__name__)
        raise errors.InvalidArgumentTypeError(
            f"{what}: x is the function {name!r}, not its batches; call it: pass {name}() "
            "(a generator of (x, y) batches), as Keras takes a generator."
        )
    hint = input_lib.not_batches_hint(x)
    if isinstance(x, (str, bytes)) or hint or not (hasattr(x, "__iter__") or hasattr(x, "as_numpy_iterator")):
        raise errors.InvalidArgumentTypeError(
            f"{what}: x must be NumPy/JAX arrays (or a dict of them), an iterable of batches "
            f"(list, generator, torch DataLoader, Grain loader, tf.data) or a distributed "
            f"dataset; received {type(x).__name__} {x!r:.80}.{hint}"
        )


def _text_leaf(value):
    """The first string of `value` (a str / bytes leaf, or a NumPy string or object array of
    strings, as tf.string tensors give), or None. Only lists, tuples and dicts are looked into
    (never a loader or an iterator)."""
    for leaf in jax.tree.leaves(value, is_leaf=lambda v: not isinstance(v, (list, tuple, dict))):
        if isinstance(leaf, (str, bytes)):
            return leaf
        if (
            isinstance(leaf, np.ndarray)
            and leaf.size
            and (
                leaf.dtype.kind in "US" or (leaf.dtype.kind == "O" and isinstance(leaf.flat[0], (str, bytes)))
            )
        ):
            return np.asarray(leaf.flat[0]).item()
    return None


def check_not_text(what: str, name: str, value) -> None:
    """Refuses strings given as `name` ("x", "y" or a batch), before any other check of it.
    A bare string (a file name given as x) is left to `check_source`.

    Raises:
      InvalidArgumentTypeError: `value` holds text, which no JAX array holds.
    """
    text = None if isinstance(value, (str, bytes)) else _text_leaf(value)
    if text is None:
        return
    fix = (
        "Map the labels to class indices first, e.g. classes, y = np.unique(y, return_inverse=True)."
        if name == "y"
        else "Turn the text into numbers first (token ids from a tokenizer, e.g. "
        "keras.layers.TextVectorization adapted on the text and applied to it before fit), "
        "and pass those arrays."
    )
    raise errors.InvalidArgumentTypeError(
        f"{what}: {name} holds strings (e.g. {text!r:.40}); strings are not numeric inputs: "
        f"a JAX model computes on numbers. {fix}"
    )


def check_not_input_list(what: str, x, y, batch_size) -> None:
    """Refuses a list / tuple x given with labels or a batch size that is not the model's
    several inputs (`input_structure.reads_as_inputs`): examples as Python numbers, or arrays
    of different lengths. Checked before the batch size, so the first error names the fix.

    Raises:
      InvalidArgumentError: as above, naming the arrays to pass instead.
    """
    if not isinstance(x, (list, tuple)) or not x or (y is None and batch_size is None):
        return
    if checks.python_numbers(x):
        raise errors.InvalidArgumentError(
            f"{what}: x holds Python numbers (e.g. from X.tolist()): pass the examples as "
            "arrays, np.asarray(x) and np.asarray(y) (a list x of arrays is the model's inputs "
            "or a sequence of batches)."
        )
    input_structure.check_input_lengths(what, x, y, batch_size)


# Keys that name the labels in a dict batch (Hugging Face's "label", ...), for the hint that
# turns such a batch into (x, y).
_LABEL_KEYS = ("label", "labels", "y", "target", "targets")


def _as_tuple_hints(keys) -> tuple[str, str]:
    """For a dict batch with `keys`: the (x, y) tuple to make of a batch `b`, and the arrays
    to pass instead for a Hugging Face dataset `ds` with those columns."""
    keys = list(keys)
    label = next((k for k in keys if str(k).lower() in _LABEL_KEYS), None)
    inputs = [k for k in keys if k != label]
    if label is None or not inputs:
        return ("(b['<inputs>'], b['<labels>'])", "fit(ds['<inputs>'][:], ds['<labels>'][:], batch_size=B)")
    if len(inputs) == 1:
        return (
            f"(b[{inputs[0]!r}], b[{label!r}])",
            f"fit(ds[{inputs[0]!r}][:], ds[{label!r}][:], batch_size=B)",
        )
    x = "{" + ", ".join(f"{k!r}: b[{k!r}]" for k in inputs) + "}"
    arrays = "{" + ", ".join(f"{k!r}: ds[{k!r}][:]" for k in inputs) + "}"
    return f"({x}, b[{label!r}])", f"fit({arrays}, ds[{label!r}][:], batch_size=B)"


def is_py_dataset(x) -> bool:
    """Whether `x` is a `keras.utils.PyDataset` (`keras.utils.Sequence` is its alias), asked of
    its classes' names so that Keras is not imported."""
    return any(c.__name__ == "PyDataset" and c.__module__.startswith("keras.") for c in type(x).__mro__)


def not_x_y_error(batch, where: str = "each batch of a dataset") -> errors.InvalidBatchError:
    """The error for a fit/evaluate batch that is not (x, y) or (x, y, sample_weight).

    A dict batch (Hugging Face rows, a DataLoader over them) gets the tuple to make of it,
    written with its own keys.
    """
    message = f"fit/evaluate: {where} must be a tuple or list (x, y) or (x, y, sample_weight); received a "
    if isinstance(batch, dict):
        as_tuple, as_arrays_ = _as_tuple_hints(batch)
        return errors.InvalidBatchError(
            f"{message}dict with keys {list(batch)}. As in Keras, a dict batch is x alone, "
            "with no labels to train or evaluate on (Hugging Face rows, and DataLoader batches "
            f"of them, are such dicts). Make each batch a tuple, e.g. {as_tuple}: with Grain, "
            f"dataset.map(lambda b: {as_tuple}); with a torch Dataset, return the tuple from "
            f"__getitem__; for a Hugging Face Dataset, pass its columns as arrays, {as_arrays_}."
        )
    size = f" of {len(batch)}" if isinstance(batch, (tuple, list)) else ""
    return errors.InvalidBatchError(
        f"{message}{type(batch).__name__}{size}. For a multi-input model, make x a dict of arrays."
    )


def _scalar_leaf(element):
    """The path (e.g. "['label']") and value of an array leaf of `element` without a batch
    axis (a 0-d NumPy, JAX, torch or tf value), or None."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(element)[0]:
        if hasattr(leaf, "shape") and len(leaf.shape) == 0:
            return jax.tree_util.keystr(path), leaf
    return None


def check_batched(what: str, source, element) -> None:
    """Refuses a first `element` of `source` that is one example, not a batch.

    Raises:
      InvalidBatchError: a leaf of `element` has no batch axis (a Hugging Face Dataset, an
        unbatched Grain or tf.data pipeline iterated directly); the message says how to batch.
    """
    scalar = _scalar_leaf(element)
    if scalar is None:
        return
    path, value = scalar
    fix = batching.UNBATCHED_HINT
    kind = type(source)
    if kind.__module__.split(".")[0] == "datasets" and kind.__name__ == "Dataset":
        as_tuple, as_arrays_ = _as_tuple_hints(element if isinstance(element, dict) else {})
        fix = (
            "For a Hugging Face Dataset, pass its columns as arrays (shuffled each epoch, "
            f"sized, split between workers like any arrays): {as_arrays_}; or batches of "
            f"(x, y): grain.MapDataset.source(ds).map(lambda b: {as_tuple}).batch(B)."
        )
    raise errors.InvalidBatchError(
        f"{what}: x ({kind.__name__}) yields single examples, not batches: its first element's "
        f"leaf {path or 'x'} is a scalar ({value!r:.40}), with no batch axis. {fix}"
    )


def normalize_batch(batch, inputs_only: bool, class_weight=None):
    """A user batch as a tuple (x, y[, sample_weight]) (or (x,) for predict), as Keras unpacks.

    Lists count as tuples (a torch DataLoader's default collate yields [x, y]).
    """
    if inputs_only:
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        return (jax.tree.map(checks.to_numpy, x),)
    if not isinstance(batch, (tuple, list)) or len(batch) not in (2, 3):
        raise not_x_y_error(batch)
    if class_weight is not None:
        if len(batch) == 3:
            raise errors.InvalidArgumentError(
                "fit: class_weight was given but the dataset's batches carry sample weights; "
                "as Keras, pass one of them."
            )
    x, y = jax.tree.map(checks.to_numpy, (batch[0], batch[1]))
    if class_weight is not None:
        return (x, y, class_weights_of(checks.host_array(y), class_weight))
    if len(batch) == 2:
        return (x, y)
    weights = batch[2]
    if not isinstance(weights, (list, tuple, dict)) or not input_structure.is_weights_tree(weights):
        return (x, y, np.asarray(checks.host_array(weights), np.float32))
    return (x, y, jax.tree.map(lambda w: np.asarray(checks.host_array(w), np.float32), weights))


class NormalizedBatches:
    """Batches of a user dataset as (x, y, sample_weight) (or (x,) for predict); with
    `num_classes`, each batch's sparse labels are checked on the host (a min and a max)."""

    def __init__(self, source, inputs_only, class_weight=None, num_classes=None):
        self.source, self.inputs_only, self.class_weight = source, inputs_only, class_weight
        self.num_classes = num_classes

    def __iter__(self):
        items = self.source.as_numpy_iterator() if hasattr(self.source, "as_numpy_iterator") else self.source
        for index, batch in enumerate(items):
            batch = normalize_batch(batch, self.inputs_only, self.class_weight)
            if self.num_classes is not None:
                try:
                    losses_lib.SparseCategoricalCrossentropy.check_labels(
                        checks.host_array(batch[1]), self.num_classes
                    )
                except errors.InvalidLabelError as error:
                    raise errors.InvalidLabelError(f"batch {index + 1} of the dataset: {error}") from None
            yield batch


class PyDatasetPass:
    """One pass over a `keras.utils.PyDataset`, as Keras 3's PyDatasetAdapter: batches by index,
    0 .. num_batches - 1, or a permutation of them when `fit(shuffle=True)` (drawn from the
    compiled model's RNG, seeded at compile, where Keras draws from Python's `random`); the
    dataset's `on_epoch_begin()` before and `on_epoch_end()` after. Batches are read in the
    caller's thread: the PyDataset's `workers`, `use_multiprocessing` and `max_queue_size` are
    accepted and not used. `num_batches` None is an endless dataset (needs steps_per_epoch)."""

    def __init__(self, dataset, rng):
        self.dataset, self.rng = dataset, rng  # rng: the permutations' NumPy Generator, or None

    def __iter__(self):
        dataset = self.dataset
        count = dataset.num_batches
        order: Iterable
        if count is None:
            order = itertools.count()
        else:
            order = self.rng.permutation(count) if self.rng is not None else range(count)
        dataset.on_epoch_begin()
        try:
            for index in order:
                yield dataset[int(index)]
        finally:
            dataset.on_epoch_end()
