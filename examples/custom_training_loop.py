"""A custom training loop: TensorFlow's "Custom training with tf.distribute.Strategy" on mirrax.

The tutorial's program with TF's names swapped for mirrax's: a `MirroredStrategy`, the model
and optimizer built under `strategy.scope()`, a distributed dataset, a `train_step` run on
every replica by `strategy.run` with its loss scaled by `mirrax.compute_average_loss`, and the
replicas' results combined with `strategy.reduce`, the two compiled into one program by
`@mirrax.function` (TF's `@tf.function`). The model is the CNN of `keras_fit.py`; the
data are scikit-learn's bundled handwritten digits (no download).

    python examples/custom_training_loop.py --epochs 10

Without an accelerator, fake CPU devices give several replicas:

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python examples/custom_training_loop.py

`mirrax train --loop custom` runs this program's `train` with more options (CIFAR-10, the
replica count).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from mirrax.examples.keras_fit import TutorialCNN

import mirrax


def train_step(model, optimizer, batch):
    """One optimizer step on this replica's shard of a global batch (run by `strategy.run`).

    Args:
      model: the `TutorialCNN`, identical on every replica.
      optimizer: its `nnx.Optimizer`.
      batch: (images float32 (per_replica_batch, h, w, c), labels int32 (per_replica_batch,)).

    Returns:
      (loss, correct): this replica's share of the global-batch mean loss (the replicas' values
      SUM to it) and its number of correctly classified real examples (int32); padding rows of
      a partial batch count in neither.
    """
    images, labels = batch

    def loss_fn(model):
        logits = model(images)
        per_example_loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        return mirrax.compute_average_loss(per_example_loss), logits

    (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    # JAX sums the replicas' gradients (the parameters are the same on every replica), so this
    # applies the gradient of the global-batch mean loss, identically on every replica.
    optimizer.update(model, grads)
    return loss, count_correct(logits, labels)


def test_step(model, batch):
    """The loss share and correct count of this replica's shard, without training (see above)."""
    images, labels = batch
    logits = model(images)
    per_example_loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return mirrax.compute_average_loss(per_example_loss), count_correct(logits, labels)


def count_correct(logits, labels):
    """Number (int32 scalar) of real examples whose arg-max logit is the label."""
    correct = jnp.argmax(logits, axis=-1).astype(labels.dtype) == labels
    mask = mirrax.get_replica_context().batch_mask
    if mask is not None:
        correct = correct & mask
    return correct.sum(dtype=jnp.int32)


def global_batches(images, labels, global_batch_size: int, order=None) -> list:
    """(images, labels) batches of `global_batch_size` in `order`, the last one possibly short.

    Args:
      images, labels: arrays with the examples along axis 0.
      global_batch_size: examples per batch over all replicas.
      order: a permutation of the example indices (e.g. `rng.permutation(n)`), or None for
        the stored order.

    Returns:
      A list of ceil(n / global_batch_size) (images, labels) tuples of NumPy arrays.
    """
    n = len(images)
    order = np.arange(n) if order is None else order
    return [
        (images[order[start : start + global_batch_size]], labels[order[start : start + global_batch_size]])
        for start in range(0, n, global_batch_size)
    ]


def train(
    strategy,
    train_data,
    test_data,
    *,
    epochs: int = 10,
    batch_size_per_replica: int = 16,
    learning_rate: float = 1e-3,
    seed: int = 0,
):
    """Trains the CNN with a custom loop on every replica of `strategy`, testing every epoch.

    Each epoch reshuffles the training set with a NumPy RNG seeded by `seed` (so the order does
    not depend on the number of replicas), splits it into global batches of
    `batch_size_per_replica * num_replicas_in_sync` examples (the last one partial; mirrax pads
    and masks it), trains on every batch, then evaluates on the test set. One line per epoch
    goes to stdout, then `Test accuracy: 0.9xxx`.

    Reported numbers: `loss` is the mean per-example training loss over the epoch's examples
    (each batch's global mean loss weighted by its size, so the partial batch is not
    over-weighted; TF's tutorial divides by the number of batches instead); `accuracy` the
    share of training examples classified correctly during the epoch (with the weights of
    that moment); `test_loss` / `test_accuracy` the same on the test set after the epoch;
    `images/s` the training images of the epoch divided by the wall time of its training loop
    (the first epoch includes compilation).

    Args:
      strategy: the `mirrax.Strategy` to train with, e.g. `mirrax.MirroredStrategy()`.
      train_data: (images float32 (N, height, width, channels), labels int32 (N,) in 0..9).
      test_data: the test set, in the same form.
      epochs: number of epochs, >= 1.
      batch_size_per_replica: examples per replica per step; the global batch is this times
        `strategy.num_replicas_in_sync`.
      learning_rate: Adam's learning rate.
      seed: seed of the initial weights and of the shuffling.

    Returns:
      (model, history, test_accuracy): the trained `TutorialCNN`, a dict of lists with one
      float per epoch ("loss", "accuracy", "test_loss", "test_accuracy",
      "images_per_second"), and the last epoch's test accuracy (a float in [0, 1]).

    Raises:
      ValueError: `epochs` < 1.
    """
    if epochs < 1:
        raise ValueError(f"train: epochs must be >= 1; received {epochs!r}.")
    (x_train, y_train), (x_test, y_test) = train_data, test_data
    global_batch_size = batch_size_per_replica * strategy.num_replicas_in_sync
    with strategy.scope():
        model = TutorialCNN(x_train.shape[1:], rngs=nnx.Rngs(seed))
        optimizer = nnx.Optimizer(model, optax.adam(learning_rate), wrt=nnx.Param)

    # As TF's @tf.function: the run and the two reduces of a step are one compiled program
    # (the model and optimizer are carried from the closure, updated in place).
    @mirrax.function
    def distributed_train_step(batch):
        loss, correct = strategy.run(train_step, args=(model, optimizer, batch))
        return strategy.reduce("sum", loss, axis=None), strategy.reduce("sum", correct, axis=None)

    @mirrax.function
    def distributed_test_step(batch):
        loss, correct = strategy.run(test_step, args=(model, batch))
        return strategy.reduce("sum", loss, axis=None), strategy.reduce("sum", correct, axis=None)

    test_batches = global_batches(x_test, y_test, global_batch_size)
    test_dataset = strategy.experimental_distribute_dataset(test_batches)
    rng = np.random.default_rng(seed)
    history = {key: [] for key in ("loss", "accuracy", "test_loss", "test_accuracy", "images_per_second")}
    for epoch in range(epochs):
        batches = global_batches(x_train, y_train, global_batch_size, rng.permutation(len(x_train)))
        start = time.perf_counter()
        loss, accuracy = _epoch(
            distributed_train_step,
            strategy.experimental_distribute_dataset(batches),
            [len(b[1]) for b in batches],
        )
        seconds = time.perf_counter() - start
        test_loss, test_accuracy = _epoch(
            distributed_test_step, test_dataset, [len(b[1]) for b in test_batches]
        )
        for key, value in (
            ("loss", loss),
            ("accuracy", accuracy),
            ("test_loss", test_loss),
            ("test_accuracy", test_accuracy),
            ("images_per_second", len(x_train) / seconds),
        ):
            history[key].append(value)
        print(
            f"Epoch {epoch + 1}/{epochs} - loss: {loss:.4f} - accuracy: {accuracy:.4f} - "
            f"test_loss: {test_loss:.4f} - test_accuracy: {test_accuracy:.4f} - "
            f"{len(x_train) / seconds:.0f} images/s",
            flush=True,
        )
    print(f"Test accuracy: {history['test_accuracy'][-1]:.4f}", flush=True)
    return model, history, history["test_accuracy"][-1]


def _epoch(distributed_step, dataset, sizes: list) -> tuple:
    """Runs `distributed_step` on every batch of `dataset`; returns (mean loss, accuracy) over
    the examples.

    `distributed_step(batch)` returns the batch's global mean loss and its number of correct
    examples; `sizes` are the global batch sizes in order (to weight each batch's mean loss).
    Results stay on the devices until the end, so the host does not wait for each step.
    """
    losses, corrects = [], []
    for batch in dataset:
        loss, correct = distributed_step(batch)
        losses.append(loss)
        corrects.append(correct)
    losses = np.asarray(jax.device_get(losses), np.float64)
    total = sum(sizes)
    mean_loss = float(np.dot(losses, np.asarray(sizes, np.float64)) / total)
    return mean_loss, float(np.sum(jax.device_get(corrects)) / total)


def main(argv=None) -> None:
    """Trains on the digits over every device; `argv` as `sys.argv[1:]` (None reads it)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10, help="default 10")
    args = parser.parse_args(argv)

    strategy = mirrax.MirroredStrategy()
    print(f"Number of devices: {strategy.num_replicas_in_sync}")
    train(strategy, *mirrax.data.load_digits(), epochs=args.epochs)


if __name__ == "__main__":
    main()
