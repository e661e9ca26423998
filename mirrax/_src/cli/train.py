"""`mirrax train`: TensorFlow's "custom training with tf.distribute.Strategy" tutorial on mirrax.

The tutorial's program with TF's names swapped for mirrax's: a MirroredStrategy, the model and
optimizer built under `strategy.scope()`, a distributed dataset, a `train_step` run on every
replica by `strategy.run` with its loss scaled by `mirrax.compute_average_loss`, and the
replicas' results combined with `strategy.reduce`. The CNN is the one of TF's CNN tutorial
(three 3x3 convolutions, two max-pools, two dense layers), with "SAME" padding so it fits both
the 8x8 digits and 32x32 CIFAR-10 images.
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import mirrax
from mirrax import errors
from mirrax._src.data.cifar10 import load_cifar10
from mirrax._src.data.digits import load_digits

NUM_CLASSES = 10


class TutorialCNN(nnx.Module):
    """The CNN of TensorFlow's CNN tutorial, in Flax NNX, with "SAME" padding.

    Conv 32 3x3 relu -> max pool 2 -> Conv 64 3x3 relu -> max pool 2 -> Conv 64 3x3 relu ->
    flatten -> Dense 64 relu -> Dense `num_classes` (logits).

    Args:
      image_shape: (height, width, channels) of the input images, e.g. (8, 8, 1) or (32, 32, 3);
        height and width must be multiples of 4 (two 2x2 max-pools).
      num_classes: number of outputs.
      rngs: `nnx.Rngs` for the initial weights.
    """

    def __init__(self, image_shape, num_classes: int = NUM_CLASSES, *, rngs: nnx.Rngs):
        height, width, channels = image_shape
        self.conv1 = nnx.Conv(channels, 32, (3, 3), padding="SAME", rngs=rngs)
        self.conv2 = nnx.Conv(32, 64, (3, 3), padding="SAME", rngs=rngs)
        self.conv3 = nnx.Conv(64, 64, (3, 3), padding="SAME", rngs=rngs)
        self.dense1 = nnx.Linear((height // 4) * (width // 4) * 64, 64, rngs=rngs)
        self.dense2 = nnx.Linear(64, num_classes, rngs=rngs)

    def __call__(self, x):
        """Logits, float32 of shape (batch, num_classes), for images (batch, h, w, c)."""
        x = nnx.max_pool(nnx.relu(self.conv1(x)), (2, 2), strides=(2, 2))
        x = nnx.max_pool(nnx.relu(self.conv2(x)), (2, 2), strides=(2, 2))
        x = nnx.relu(self.conv3(x))
        x = x.reshape((x.shape[0], -1))
        return self.dense2(nnx.relu(self.dense1(x)))


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
        (images[order[start : start + global_batch_size]],
         labels[order[start : start + global_batch_size]])
        for start in range(0, n, global_batch_size)
    ]


def train(args, out=None) -> dict:
    """Trains the tutorial CNN with a MirroredStrategy and a custom training loop.

    Each epoch reshuffles the training set with a NumPy RNG seeded by `args.seed` (so the
    order does not depend on the number of replicas), splits it into global batches of
    `batch_per_replica * num_replicas_in_sync` examples (the last one partial; mirrax pads and
    masks it), trains on every batch, then evaluates on the test set. One line per epoch goes
    to `out`, then the final test accuracy.

    Reported numbers: `loss` is the mean per-example training loss over the epoch's examples
    (each batch's global mean loss weighted by its size, so the partial batch is not
    over-weighted; TF's tutorial divides by the number of batches instead); `accuracy` the
    share of training examples classified correctly during the epoch (with the weights of
    that moment); `test_loss` / `test_accuracy` the same on the test set after the epoch;
    `images/s` the training images of the epoch divided by the wall time of its training loop
    (the first epoch includes compilation).

    Args:
      args: an `argparse.Namespace` from `mirrax train`'s parser (`build_parser` in
        mirrax._src.cli.main), or any object with the attributes data, data_dir, epochs,
        batch_per_replica, replicas (None for every device), seed and lr.
      out: a text stream for the progress lines, or None for sys.stdout.

    Returns:
      A dict: "history" (a dict of lists, one float per epoch: "loss", "accuracy",
      "test_loss", "test_accuracy", "images_per_second"), "model" (the trained `TutorialCNN`),
      "strategy", "global_batch_size" (int) and "test_size" (number of test images).

    Raises:
      InvalidDeviceError: `args.replicas` exceeds the number of devices.
      MissingDatasetError: `args.data == "cifar10"` and the files are not in `args.data_dir`.
    """
    out = sys.stdout if out is None else out
    (x_train, y_train), (x_test, y_test) = _load(args.data, args.data_dir)
    strategy = _make_strategy(args.replicas)
    global_batch_size = args.batch_per_replica * strategy.num_replicas_in_sync

    with strategy.scope():
        model = TutorialCNN(x_train.shape[1:], rngs=nnx.Rngs(args.seed))
        optimizer = nnx.Optimizer(model, optax.adam(args.lr), wrt=nnx.Param)

    test_batches = global_batches(x_test, y_test, global_batch_size)
    test_dataset = strategy.experimental_distribute_dataset(test_batches)
    rng = np.random.default_rng(args.seed)
    history = {key: [] for key in ("loss", "accuracy", "test_loss", "test_accuracy",
                                   "images_per_second")}
    print(
        f"{strategy!r}: global batch {global_batch_size} ({args.batch_per_replica} per "
        f"replica); {args.data}: {len(x_train)} training, {len(x_test)} test images",
        file=out,
        flush=True,
    )
    for epoch in range(args.epochs):
        batches = global_batches(x_train, y_train, global_batch_size, rng.permutation(len(x_train)))
        start = time.perf_counter()
        loss, accuracy = _epoch(
            strategy, train_step, (model, optimizer),
            strategy.experimental_distribute_dataset(batches), [len(b[1]) for b in batches],
        )
        seconds = time.perf_counter() - start
        test_loss, test_accuracy = _epoch(
            strategy, test_step, (model,), test_dataset, [len(b[1]) for b in test_batches]
        )
        for key, value in (("loss", loss), ("accuracy", accuracy), ("test_loss", test_loss),
                           ("test_accuracy", test_accuracy),
                           ("images_per_second", len(x_train) / seconds)):
            history[key].append(value)
        print(
            f"Epoch {epoch + 1}/{args.epochs} - loss: {loss:.4f} - accuracy: {accuracy:.4f} - "
            f"test_loss: {test_loss:.4f} - test_accuracy: {test_accuracy:.4f} - "
            f"{len(x_train) / seconds:.0f} images/s",
            file=out,
            flush=True,
        )
    if history["test_accuracy"]:
        print(f"Test accuracy: {history['test_accuracy'][-1]:.4f}", file=out, flush=True)
    return {
        "history": history,
        "model": model,
        "strategy": strategy,
        "global_batch_size": global_batch_size,
        "test_size": len(x_test),
    }


def _epoch(strategy, step, state: tuple, dataset, sizes: list) -> tuple:
    """Runs `step` on every batch of `dataset`; returns (mean loss, accuracy) over the examples.

    `sizes` are the global batch sizes in order (to weight each batch's mean loss). Results
    stay on the devices until the end, so the host does not wait for each step.
    """
    losses, corrects = [], []
    for batch in dataset:
        loss, correct = strategy.run(step, args=state + (batch,))
        losses.append(strategy.reduce("sum", loss))
        corrects.append(strategy.reduce("sum", correct))
    losses = np.asarray(jax.device_get(losses), np.float64)
    total = sum(sizes)
    mean_loss = float(np.dot(losses, np.asarray(sizes, np.float64)) / total)
    return mean_loss, float(np.sum(jax.device_get(corrects)) / total)


def _load(data: str, data_dir):
    if data == "digits":
        return load_digits()
    if data == "cifar10":
        return load_cifar10(data_dir)
    raise ValueError(f"--data must be 'digits' or 'cifar10'; received {data!r}.")


def _make_strategy(replicas):
    if replicas is None:
        return mirrax.MirroredStrategy()
    devices = jax.local_devices()
    if replicas > len(devices):
        names = ", ".join(f"{d.platform}:{i}" for i, d in enumerate(devices))
        raise errors.InvalidDeviceError(
            f"--replicas {replicas} asks for more replicas than this process has devices "
            f"({len(devices)}: {names}). Use --replicas {len(devices)} or fewer, or more CPU "
            f"devices with --cpu-devices {replicas}."
        )
    return mirrax.MirroredStrategy(devices[:replicas])
