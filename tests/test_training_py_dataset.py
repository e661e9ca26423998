"""keras.utils.PyDataset as fit / evaluate / predict x: batches by index, shuffled per epoch
by fit(shuffle=True) as Keras 3's PyDatasetAdapter, on_epoch_begin / on_epoch_end each pass."""

import keras
import numpy as np
import optax
from flax import nnx

import mirrax

N_BATCHES = 4


class _Recording(keras.utils.PyDataset):
    """4 batches of 2 examples; `log` records each index asked for, and "end" at on_epoch_end."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.log = []

    def __len__(self):
        return N_BATCHES

    def __getitem__(self, index):
        self.log.append(index)
        x = np.full((2, 3), index, np.float32)
        return x, np.array([index % 2, 1], np.int32)

    def on_epoch_end(self):
        self.log.append("end")


def _model():
    model = mirrax.Model(nnx.Linear(3, 2, rngs=nnx.Rngs(0)))
    model.compile(optax.sgd(0.01), mirrax.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _epochs(log):
    """The log after the first-batch check (index 0, read once when fit starts, as for any
    dataset), split at each "end"."""
    assert log[0] == 0
    passes, current = [], []
    for entry in log[1:]:
        if entry == "end":
            passes.append(current)
            current = []
        else:
            current.append(entry)
    assert current == []
    return passes


def test_fit_without_shuffle_reads_batches_in_order_each_epoch():
    data = _Recording()
    _model().fit(data, epochs=3, shuffle=False, verbose=0)
    assert _epochs(data.log) == [[0, 1, 2, 3]] * 3


def test_fit_with_shuffle_reads_a_new_permutation_each_epoch():
    data = _Recording(workers=2, use_multiprocessing=False, max_queue_size=4)  # accepted
    _model().fit(data, epochs=3, verbose=0)  # shuffle=True is fit's default, as Keras
    epochs = _epochs(data.log)
    assert len(epochs) == 3
    for order in epochs:
        assert sorted(order) == [0, 1, 2, 3]  # every batch exactly once per epoch
    # The orders come from the compiled model's NumPy RNG (default_rng(0), made at compile), so
    # they are the same in every run: [2, 0, 1, 3], [3, 2, 1, 0], [1, 3, 0, 2].
    assert epochs == [[2, 0, 1, 3], [3, 2, 1, 0], [1, 3, 0, 2]]
    again = _Recording()
    _model().fit(again, epochs=3, verbose=0)
    assert _epochs(again.log) == epochs  # a fixed seed: reproducible


def test_evaluate_and_predict_read_in_order_and_end_the_epoch():
    model = _model()
    data = _Recording()
    model.evaluate(data, verbose=0)
    assert _epochs(data.log) == [[0, 1, 2, 3]]
    data = _Recording()
    out = model.predict(data, verbose=0)
    assert _epochs(data.log) == [[0, 1, 2, 3]]
    assert out.shape == (8, 2)  # 4 batches of 2 rows
