"""The benchmarks' workloads and the hand-written train step they measure mirrax against.

`overhead.py` (strategy.run) and `fit_overhead.py` (Model.fit) both compare mirrax with the
same floor: `nnx.split((model, optimizer))` once, then `jax.jit(jax.shard_map(step, ...))` on
the flat list of state arrays and a device-resident sharded batch. This module holds that
step, the step `overhead.py` gives `strategy.run`, the two models (the tutorial CNN and a tiny
MLP), the loss every variant shares and the timing loop with its cap on steps in flight.

It imports JAX at the top: import it only after `overhead.configure_jax_environment`, because
the fake CPU device count is fixed when JAX starts.
"""

from __future__ import annotations

import collections
import time

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import mirrax
from mirrax.examples.keras_fit import TutorialCNN

MLP_FEATURES = 32
NUM_CLASSES = 10


def CNN(rngs: nnx.Rngs):
    """The TF tutorial CNN (examples/keras_fit.py); input (batch, 28, 28, 1), logits (batch, 10)."""
    return TutorialCNN((28, 28, 1), rngs=rngs)


class MLP(nnx.Module):
    """Two dense layers; input (batch, MLP_FEATURES) float32, output (batch, 10) logits."""

    def __init__(self, rngs: nnx.Rngs):
        self.dense1 = nnx.Linear(MLP_FEATURES, 64, rngs=rngs)
        self.dense2 = nnx.Linear(64, NUM_CLASSES, rngs=rngs)

    def __call__(self, x):
        return self.dense2(nnx.relu(self.dense1(x)))


class MLP256(nnx.Module):
    """An MLP 784-256-256-10 (relu); input (batch, 784) float32, output (batch, 10) logits."""

    def __init__(self, rngs: nnx.Rngs):
        self.dense1 = nnx.Linear(784, 256, rngs=rngs)
        self.dense2 = nnx.Linear(256, 256, rngs=rngs)
        self.dense3 = nnx.Linear(256, NUM_CLASSES, rngs=rngs)

    def __call__(self, x):
        return self.dense3(nnx.relu(self.dense2(nnx.relu(self.dense1(x)))))


def random_batch(x_shape: tuple, global_batch: int, seed: int = 0):
    """One global batch: x (global_batch, *x_shape) float32 normal, y (global_batch,) int32."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((global_batch,) + x_shape).astype(np.float32)
    y = rng.integers(0, NUM_CLASSES, size=(global_batch,)).astype(np.int32)
    return x, y


def update(model, optimizer, x, y, reduce_loss, packed=False):
    """The train step every variant shares; `reduce_loss` maps per-example losses to a scalar.

    With `packed`, gradients come from `mirrax.value_and_grad` (one packed all-reduce).
    """

    def loss_fn(model):
        per_example = optax.softmax_cross_entropy_with_integer_labels(model(x), y)
        return reduce_loss(per_example)

    grad_fn = mirrax.value_and_grad if packed else nnx.value_and_grad
    loss, grads = grad_fn(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def strategy_run_step(global_batch: int, packed: bool = False):
    """`overhead.py`'s train step for `strategy.run(step, args=(model, optimizer, batch))`.

    `batch` is (images, labels) or (images, labels, sample_weight), a replica's shard; the
    weights are ignored. The loss is `compute_average_loss` with `global_batch` given, so the
    step's only cross-replica sum is the gradients'. Returns this replica's loss share.
    """
    def train_step(model, optimizer, batch):
        images, labels = batch[0], batch[1]
        return update(
            model,
            optimizer,
            images,
            labels,
            lambda l: mirrax.compute_average_loss(l, global_batch_size=global_batch),
            packed,
        )

    return train_step


def mirrax_state(devices, module_cls, x, y):
    """What a mirrax user builds: `MirroredStrategy(devices)`, the model and
    `nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)` under its scope, and the global
    batch (x, y) as one placed `PerReplica` batch from `experimental_distribute_dataset`.

    Returns (strategy, model, optimizer, batch).
    """
    strategy = mirrax.MirroredStrategy(devices)
    with strategy.scope():
        model = module_cls(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    iterator = iter(strategy.experimental_distribute_dataset((x, y)))
    batch = next(iterator)
    iterator.close()
    return strategy, model, optimizer, batch


def make_handwritten(module_cls, x, y, global_batch, devices, donate=True):
    """The floor: one `jax.jit(jax.shard_map(...))` call per step on pre-placed arrays.

    Args:
      module_cls: builds the model from `nnx.Rngs(0)`.
      x, y: one GLOBAL batch (NumPy), placed on `devices` once and reused every step.
      global_batch: the loss is `sum / global_batch` (as `compute_average_loss`).
      devices: the replicas (one mesh axis "replica").
      donate: donate the state buffers to the step (`donate_argnums=0`).

    Returns:
      (step, block, loss_of): `step()` runs one step and returns the per-replica losses
      (replicas,); `block(out)` waits for them and the whole state; `loss_of(out)` is the
      global loss as a Python float.
    """
    mesh = jax.sharding.Mesh(np.array(devices), ("replica",))
    model = module_cls(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))
    leaves, state_def = jax.tree.flatten(state)
    replicated = NamedSharding(mesh, P())
    sharded = NamedSharding(mesh, P("replica"))
    holder = {"state": jax.device_put(leaves, replicated)}
    x_dev, y_dev = jax.device_put(x, sharded), jax.device_put(y, sharded)

    def per_replica(leaves, x, y):
        model, optimizer = nnx.merge(graphdef, jax.tree.unflatten(state_def, leaves))
        loss = update(model, optimizer, x, y, lambda l: l.sum() / global_batch)
        return jax.tree.leaves(nnx.state((model, optimizer))), loss[None]

    compiled = jax.jit(
        jax.shard_map(
            per_replica,
            mesh=mesh,
            in_specs=(P(), P("replica"), P("replica")),
            out_specs=(P(), P("replica")),
        ),
        donate_argnums=0 if donate else (),
    )

    def step():
        holder["state"], loss = compiled(holder["state"], x_dev, y_dev)
        return loss

    def block(out):
        jax.block_until_ready((out, holder["state"]))

    def loss_of(out):
        return float(out.sum())

    return step, block, loss_of


def run_steps(step, block, steps: int, max_in_flight: int) -> float:
    """Runs `steps` steps; returns the seconds spent inside the `step()` calls (host time)."""
    # At most `max_in_flight` steps are dispatched ahead of the one that finished: XLA:CPU
    # deadlocks in the all-reduce rendezvous when ~100 multi-device steps are queued.
    in_flight = collections.deque()
    host = 0.0
    for _ in range(steps):
        start = time.perf_counter()
        out = step()
        host += time.perf_counter() - start
        in_flight.append(out)
        while len(in_flight) > max_in_flight:
            last = in_flight.popleft()
            jax.block_until_ready(last)
    block(in_flight[-1] if in_flight else last)
    return host
