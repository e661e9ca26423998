"""`Model`'s inputs into distributed batches: arrays (global batches, in order or shuffled),
datasets, generators and loaders (as (x, y, sample_weight)), with the checks each needs."""

from __future__ import annotations

import collections.abc
import itertools
import math
import warnings
from collections.abc import Generator, Iterator
from typing import Any

import jax
import numpy as np

from mirrax import errors
from mirrax._src import argument_checks
from mirrax._src.distribute import batching, input_options
from mirrax._src.distribute import input as input_lib
from mirrax._src.distribute.input import DistributedDataset, DistributedDatasetsFromFunction
from mirrax._src.distribute.values import PerReplica
from mirrax._src.training import arguments as checks
from mirrax._src.training import array_inputs, dataset_batches, input_structure
from mirrax._src.training import losses as losses_lib
from mirrax._src.training import outputs as outputs_lib


class ModelInput:
    """One input of fit/evaluate/predict, as a source of distributed (x, y, sample_weight) batches."""

    dataset: DistributedDataset | DistributedDatasetsFromFunction | None  # x, when distributed

    def __init__(
        self,
        model,
        strategy,
        x,
        y,
        sample_weight,
        batch_size,
        shuffle,
        what,
        inputs_only=False,
        class_weight=None,
        rng=None,
        checked=None,
    ):
        self.strategy = strategy
        self.shuffle = shuffle
        self.model = model
        self.rng = rng  # shuffles array inputs (the compiled model's, seeded at compile)
        self.checked = {} if checked is None else checked  # input signatures already run
        self.inputs_only = inputs_only
        self.class_weight = class_weight
        x, y, sample_weight = (array_inputs.as_arrays(v) for v in (x, y, sample_weight))
        self.one_shot = False
        self._pass: Generator | None = None
        self._what = what
        # Sparse labels of every dataset batch are checked on the host against this (set from
        # the first batch's model output), and every new batch signature runs abstractly
        # through the model before its step (`_fits`): a bad batch 5 is named, not a NaN loss
        # or a jax error from inside the compiled step.
        self.num_classes = None
        self._signatures: set = set()
        self.py_dataset: Any = None  # a keras.utils.PyDataset given as x: read by index (PyDatasetPass)
        if isinstance(x, input_lib.DatasetCreator):  # as Keras: distributed from the function
            x = strategy.distribute_datasets_from_function(x, options=x.input_options)
        if isinstance(x, (DistributedDataset, DistributedDatasetsFromFunction)):
            if y is not None or batch_size is not None or sample_weight is not None:
                raise errors.InvalidArgumentError(
                    f"{what}: x is a distributed dataset, which carries its own labels, weights "
                    "and batch size; do not pass y, sample_weight or batch_size."
                )
            if class_weight is not None:
                raise errors.UnsupportedArgumentError(
                    f"{what}: class_weight is not supported with a distributed dataset (its "
                    "batches are already split over the replicas); put the weights in the "
                    "batches as (x, y, sample_weight), or pass the undistributed dataset."
                )
            self.arrays = False
            self.dataset, self.steps = x, None
            return
        # Text first: otherwise a list of strings is refused as a dataset given a batch_size,
        # a string array as a shape the model cannot take.
        dataset_batches.check_not_text(what, "x", x)
        dataset_batches.check_not_text(what, "y", y)
        self.arrays = array_inputs.is_arrays(x) and (
            not isinstance(x, (list, tuple)) or input_structure.reads_as_inputs(x, y, batch_size, model)
        )
        if not self.arrays:
            self._init_dataset(x, y, sample_weight, batch_size, what)
            return
        n = array_inputs.num_examples(x)
        # Labels as a Python list, as Keras accepts them; a list of arrays: one per output.
        y = input_structure.labels(y, n)
        if y is None and not inputs_only:
            raise errors.InvalidArgumentError(f"{what}: y is required with array inputs (the labels).")
        lengths: dict = {"x": x} if isinstance(x, (list, tuple)) else {}
        if y is not None:
            lengths["y"] = y if isinstance(y, (list, tuple, dict)) else np.asarray(y)
        if sample_weight is not None:
            lengths["sample_weight"] = input_structure.weights_tree(sample_weight)
        input_structure.check_lengths(what, n, **lengths)
        if n == 0:
            raise errors.EmptyDatasetError(
                f"{what}: x has 0 examples (shape {jax.tree.leaves(x)[0].shape}); there is "
                "nothing to train on or evaluate. Check how the arrays were loaded or split."
            )
        self.batch_size = 32 if batch_size is None else argument_checks.count(what, "batch_size", batch_size)
        self.x, self.y = x, y
        if sample_weight is not None:
            sample_weight = input_structure.sample_weights(what, sample_weight, n, y, model)
        elif class_weight is not None:
            sample_weight = dataset_batches.class_weights_of(y, class_weight)
        self.sample_weight = sample_weight
        self.n = n
        self.steps = math.ceil(n / self.batch_size)
        self.dataset = None
        y_pred = checks.check_fits_model(model, self.checked, x, y, what, strategy)
        outputs_lib.check_labels(model.loss, y, y_pred)  # per output for several

    def _init_dataset(self, x, y, sample_weight, batch_size, what):
        dataset_batches.check_source(what, x)
        dataset_batches.check_not_input_list(what, x, y, batch_size)
        if batch_size is not None:
            raise errors.InvalidArgumentError(
                f"{what}: batch_size={batch_size} was given with a {type(x).__name__}, "
                "which is already batched. Remove batch_size (it applies to NumPy arrays "
                "only)."
            )
        for name, value in (("y", y), ("sample_weight", sample_weight)):
            if value is not None:
                raise errors.InvalidArgumentError(
                    f"{what}: {name} must be None when x is a dataset of (x, y[, sample_weight]) "
                    f"batches; received {name} of type {type(value).__name__}. Put it in the "
                    "batches."
                )
        self.dataset = None
        try:
            self.steps = len(x) if hasattr(x, "__len__") else None
        except TypeError:  # objects whose __len__ refuses (an unsized tf.data dataset)
            self.steps = None
        if self.steps == 0:
            raise errors.EmptyDatasetError(
                f"{what}: x is an empty {type(x).__name__} (0 batches); there is nothing to "
                "train on or evaluate (Keras refuses an empty input too)."
            )
        # A generator is consumed across epochs, as Keras does with steps_per_epoch. Asked of
        # the type, not by calling iter(): a loader's iter() may start worker processes.
        self.one_shot = isinstance(x, collections.abc.Iterator) and not hasattr(x, "as_numpy_iterator")
        missing = object()
        if self.one_shot:
            first = next(x, missing)
            if first is not missing:
                x = itertools.chain([first], x)
        else:
            items = x.as_numpy_iterator() if hasattr(x, "as_numpy_iterator") else x
            first = next(iter(items), missing)
        if first is missing:
            raise errors.EmptyDatasetError(
                f"{what}: x ({type(x).__name__}) yielded no batch; there is nothing to train on "
                "or evaluate. As Keras: a generator must yield at least one batch."
            )
        dataset_batches.check_batched(what, x, first)
        try:
            batch = dataset_batches.normalize_batch(first, self.inputs_only, self.class_weight)
            dataset_batches.check_not_text(what, "the first batch", batch)
            y_pred = checks.check_fits_model(
                self.model,
                self.checked,
                batch[0],
                None if self.inputs_only else batch[1],
                what,
                self.strategy,
            )
        except (errors.IncompatibleInputError, errors.InvalidBatchError) as error:
            hint = input_structure.ambiguity_hint(what, x)
            if not hint:
                raise
            detail = str(error).removeprefix(f"{what}: ")
            raise type(error)(f"{hint}The first batch does not fit: {detail}") from error
        if not self.inputs_only:
            rows = len(checks.host_array(jax.tree.leaves(batch[0])[0]))
            if len(batch) == 3:
                input_structure.sample_weights(
                    f"{what} (the first batch)", batch[2], rows, batch[1], self.model
                )
            if isinstance(self.model.loss, losses_lib.SparseCategoricalCrossentropy):
                self.num_classes = y_pred.shape[-1]
                losses_lib.SparseCategoricalCrossentropy.check_labels(
                    checks.host_array(batch[1]), self.num_classes
                )
        self.source = x
        self._stream: Iterator | None = None
        if dataset_batches.is_py_dataset(x):
            self.py_dataset = x

    def close(self):
        """Ends the pass kept open across epochs (its prefetching, if any)."""
        if self._pass is not None:
            self._pass.close()
            self._pass = None

    def epoch_batches(self, steps_per_epoch, prefetch=True, defer=False):
        """One training epoch's batches, as Keras's epoch iterator (`defer`: as `batches`).

        Without `steps_per_epoch`: one pass. With it: up to `steps_per_epoch` batches from the
        pass where the previous epoch stopped; a pass that ends within the epoch ends the epoch
        with Keras's warning, and the next epoch starts a new pass (reshuffled).
        """
        if steps_per_epoch is None or self.one_shot:
            yield from self.batches(steps_per_epoch, prefetch, defer)
            return
        count = 0
        for fresh in (self._pass is None, True):
            if fresh:
                self.close()
                self._pass = self.batches(None, prefetch, defer)
            assert self._pass is not None  # made here or by an earlier epoch
            count = 0
            for batch in self._pass:
                yield batch
                count += 1
                if count >= steps_per_epoch:
                    return
            if count or fresh:
                break
            # The previous epoch ended exactly at the end of a pass: start the next one.
        self._pass = None
        if count:
            warnings.warn(
                "Your input ran out of data; interrupting training. Make sure that your "
                "dataset or generator can generate at least `steps_per_epoch * epochs` "
                f"batches (this epoch got {count} of steps_per_epoch={steps_per_epoch}).",
                stacklevel=3,
            )

    def batches(self, steps=None, prefetch=True, defer=False):
        """Distributed batches for one epoch (or `steps` of them).

        `prefetch`: for array inputs in one process, make batches in a background thread (when
        the loop waits for every step, e.g. to read batch logs) or else in the caller's thread
        (steps are dispatched asynchronously, so the next batch is cut while the devices run).
        `defer`: array inputs in one process yield their full batches as `batching.HostBatch`es,
        for the caller to place (k at once: `steps_per_execution`).
        """
        if self.dataset is not None:
            iterator = iter(self.dataset)
        elif self.one_shot:
            yield from self._stream_batches(steps)
            return
        elif self.arrays:
            order = self.rng.permutation(self.n) if self.shuffle else None
            if jax.process_count() == 1:
                iterator = input_lib.DistributedIterator(
                    batching.place_host_batches(
                        self.strategy, _ArrayBatches(self, order), self.batch_size, self._what, defer
                    ),
                    input_options.InputOptions(experimental_fetch_to_device=prefetch),
                )
            else:
                iterator = iter(self.strategy.experimental_distribute_dataset(_ArrayBatches(self, order)))
        else:
            source = (
                self.source
                if self.py_dataset is None
                else dataset_batches.PyDatasetPass(self.py_dataset, self.rng if self.shuffle else None)
            )
            iterator = iter(
                self.strategy.experimental_distribute_dataset(
                    dataset_batches.NormalizedBatches(
                        source, self.inputs_only, self.class_weight, self.num_classes
                    )
                )
            )
        count = 0
        try:
            for batch in iterator:
                if steps is not None and count >= steps:
                    break
                if self.dataset is not None:
                    batch = self._step_input(batch)
                if not self.arrays:
                    self._fits(batch, count)
                yield batch
                count += 1
        finally:
            close = getattr(iterator, "close", None)
            if close is not None:
                close()

    def _step_input(self, batch):
        """A distributed dataset's batch as the steps take it, as Keras unpacks: for predict
        (x,), a bare or dict batch being x; for fit / evaluate (x, y[, sample_weight]).

        Raises:
          InvalidBatchError: a fit / evaluate batch that is not (x, y) or (x, y, sample_weight).
        """
        if self.inputs_only:
            return batch if isinstance(batch, (tuple, list)) else (batch,)
        if not isinstance(batch, (tuple, list)) or len(batch) not in (2, 3):
            raise dataset_batches.not_x_y_error(batch, "each batch of a distributed dataset")
        return batch

    def _fits(self, batch, index: int) -> None:
        """Runs a distributed batch abstractly through the model when its signature is new.

        Raises:
          IncompatibleInputError: the batch's shapes or dtypes do not fit the model or loss.
        """
        leaves, structure = jax.tree.flatten(batch)
        signature = (structure, tuple((leaf.shape[2:], leaf.dtype) for leaf in leaves))
        if signature in self._signatures:
            return

        def global_spec(value):  # a PerReplica's array is (replicas, rows, ...)
            leaf = jax.tree.leaves(value)[0]
            return jax.ShapeDtypeStruct((leaf.shape[0] * leaf.shape[1],) + tuple(leaf.shape[2:]), leaf.dtype)

        parts = jax.tree.map(global_spec, batch, is_leaf=lambda v: isinstance(v, PerReplica))
        what = f"{self._what} (batch {index + 1})"
        try:
            checks.check_fits_model(
                self.model,
                self.checked,
                parts[0],
                None if self.inputs_only else parts[1],
                what,
                self.strategy,
            )
        except errors.IncompatibleInputError as error:
            hint = input_structure.ambiguity_hint(self._what, getattr(self, "source", None))
            if not hint:
                raise
            raise errors.IncompatibleInputError(
                f"{hint}Batch {index + 1} does not fit: {str(error).removeprefix(what + ': ')}"
            ) from error
        self._signatures.add(signature)

    def _stream_batches(self, steps):
        """Up to `steps` batches from the one iterator over a generator, kept across epochs."""
        first_pass = self._stream is None
        if first_pass:
            self._stream = iter(
                self.strategy.experimental_distribute_dataset(
                    dataset_batches.NormalizedBatches(
                        self.source, self.inputs_only, self.class_weight, self.num_classes
                    )
                )
            )
        assert self._stream is not None  # made above, on the first pass
        count = 0
        for batch in self._stream:
            self._fits(batch, count)
            yield batch
            count += 1
            if steps is not None and count >= steps:
                return
        if count == 0 and not first_pass:
            raise errors.EmptyDatasetError(
                f"{self._what}: the generator given as x is exhausted: it yielded no batch for "
                "this epoch. A generator is read once across all epochs; make it endless and "
                "pass steps_per_epoch (as Keras), or pass a re-iterable dataset (a list of "
                "batches, a Grain dataset)."
            )


class _ArrayBatches:
    """Global batches cut from arrays in a given order (None: as stored): (x, y,
    sample_weight) or (x,).

    In stored order a batch is a slice (a view, no copy), so on CPU the placed batch may share
    the arrays' memory while its step runs: the arrays must not be modified during the pass
    (by a callback). A shuffled batch is a fresh copy.
    """

    def __init__(self, data: ModelInput, order):
        self.data, self.order = data, order

    def __iter__(self):
        d = self.data
        parts = (
            (d.x,) if d.inputs_only else (d.x, d.y, d.sample_weight)[: 2 if d.sample_weight is None else 3]
        )
        return array_inputs.global_batches(parts, d.batch_size, self.order)
