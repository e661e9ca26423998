"""The benchmarks' models and data, each defined once, and the two steps every comparison uses:
`strategy_run_step` (what a mirrax user passes to `strategy.run`) and `make_handwritten` (the
floor: `nnx.split` once, one donated `jax.jit(jax.shard_map(...))` call per step). `WORKLOADS`
names the three models (CNN, MLP 784-1024-1024-10, transformer) most benchmarks share, with
their data. Imports JAX at the top: import it after `env.configure_jax_environment`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from mirrax.examples.keras_fit import TutorialCNN

import mirrax

MLP_FEATURES = 32
NUM_CLASSES = 10
VOCABULARY = 1000
SEQUENCE_LENGTH = 64
RESNET_STAGES = ((3, 64), (4, 128), (6, 256), (3, 512))  # (bottlenecks, width); expansion 4


def CNN(rngs: nnx.Rngs, classes: int = NUM_CLASSES):
    """The TF tutorial CNN; input (batch, 28, 28, 1), logits (batch, classes)."""
    return TutorialCNN((28, 28, 1), classes, rngs=rngs)


class MLP(nnx.Module):
    """Two dense layers; input (batch, MLP_FEATURES) float32, output (batch, 10) logits."""

    def __init__(self, rngs: nnx.Rngs):
        self.dense1 = nnx.Linear(MLP_FEATURES, 64, rngs=rngs)
        self.dense2 = nnx.Linear(64, NUM_CLASSES, rngs=rngs)

    def __call__(self, x):
        return self.dense2(nnx.relu(self.dense1(x)))


class DenseStack(nnx.Module):
    """Dense layers of `sizes` (relu between); input (batch, sizes[0]), logits (batch, sizes[-1])."""

    def __init__(self, sizes, rngs: nnx.Rngs):
        self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in zip(sizes, sizes[1:])])

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = nnx.relu(layer(x))
        return self.layers[-1](x)


def MLP256(rngs: nnx.Rngs):
    """An MLP 784-256-256-10."""
    return DenseStack((784, 256, 256, NUM_CLASSES), rngs)


def WideMLP(rngs: nnx.Rngs):
    """An MLP 784-1024-1024-10."""
    return DenseStack((784, 1024, 1024, NUM_CLASSES), rngs)


class _EncoderBlock(nnx.Module):
    def __init__(self, d_model, heads, mlp, epsilon, exact_gelu, rngs):
        self.norm1 = nnx.LayerNorm(d_model, epsilon=epsilon, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(heads, d_model, decode=False, rngs=rngs)
        self.norm2 = nnx.LayerNorm(d_model, epsilon=epsilon, rngs=rngs)
        self.up = nnx.Linear(d_model, mlp, rngs=rngs)
        self.down = nnx.Linear(mlp, d_model, rngs=rngs)
        self.exact_gelu = exact_gelu

    def __call__(self, x):
        x = x + self.attention(self.norm1(x))
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x)), approximate=not self.exact_gelu))


class Transformer(nnx.Module):
    """A pre-LayerNorm encoder classifier: token and learned position embeddings, `layers`
    blocks of attention and a GELU MLP, LayerNorm, mean over the sequence, a dense head.
    Tokens (batch, sequence) int32 in [0, vocabulary), logits (batch, classes). `exact_gelu`
    and `epsilon` match the peers' defaults (Keras and PyTorch: erf GELU, 1e-5)."""

    def __init__(
        self,
        rngs: nnx.Rngs,
        *,
        layers=4,
        d_model=256,
        heads=4,
        mlp=1024,
        sequence=SEQUENCE_LENGTH,
        vocabulary=VOCABULARY,
        classes=NUM_CLASSES,
        epsilon=1e-6,
        exact_gelu=False,
    ):
        self.embed = nnx.Embed(vocabulary, d_model, rngs=rngs)
        self.position = nnx.Param(0.02 * jax.random.normal(rngs.params(), (sequence, d_model), jnp.float32))
        self.blocks = nnx.List(
            [_EncoderBlock(d_model, heads, mlp, epsilon, exact_gelu, rngs) for _ in range(layers)]
        )
        self.norm = nnx.LayerNorm(d_model, epsilon=epsilon, rngs=rngs)
        self.head = nnx.Linear(d_model, classes, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens) + self.position[...][: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(axis=1))


class _Bottleneck(nnx.Module):
    def __init__(self, cin, width, stride, conv, bn):
        self.conv1, self.bn1 = conv(cin, width, 1), bn(width)
        self.conv2, self.bn2 = conv(width, width, 3, stride), bn(width)
        self.conv3, self.bn3 = conv(width, 4 * width, 1), bn(4 * width)
        needed = stride != 1 or cin != 4 * width
        self.project = nnx.Sequential(conv(cin, 4 * width, 1, stride), bn(4 * width)) if needed else None

    def __call__(self, x):
        h = nnx.relu(self.bn1(self.conv1(x)))
        h = nnx.relu(self.bn2(self.conv2(h)))
        h = self.bn3(self.conv3(h))
        return nnx.relu(h + (x if self.project is None else self.project(x)))


class ResNet50(nnx.Module):
    """ResNet-50 v1.5: NHWC images (batch, H, W, 3) -> logits (batch, classes). BatchNorm
    epsilon 1e-5, momentum 0.9 (flax's convention; PyTorch's 0.1 is the same average)."""

    def __init__(self, rngs: nnx.Rngs, classes: int = 1000):
        def bn(features):
            return nnx.BatchNorm(features, epsilon=1e-5, momentum=0.9, rngs=rngs)

        def conv(cin, cout, k, stride=1):
            pad = (k - 1) // 2
            return nnx.Conv(
                cin,
                cout,
                (k, k),
                strides=(stride, stride),
                padding=((pad, pad), (pad, pad)),
                use_bias=False,
                rngs=rngs,
            )

        self.stem, self.stem_bn = conv(3, 64, 7, 2), bn(64)
        blocks, cin = [], 64
        for index, (count, width) in enumerate(RESNET_STAGES):
            for block in range(count):
                stride = 2 if block == 0 and index > 0 else 1
                blocks.append(_Bottleneck(cin, width, stride, conv, bn))
                cin = 4 * width
        self.blocks = nnx.List(blocks)
        self.head = nnx.Linear(cin, classes, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.stem_bn(self.stem(x)))
        x = nnx.max_pool(x, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(axis=(1, 2)))


def random_batch(x_shape: tuple, global_batch: int, seed: int = 0, classes: int = NUM_CLASSES):
    """One global batch: x (global_batch, *x_shape) float32 normal, y (global_batch,) int32."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((global_batch,) + tuple(x_shape)).astype(np.float32)
    y = rng.integers(0, classes, size=(global_batch,)).astype(np.int32)
    return x, y


def random_tokens(
    global_batch: int, sequence: int = SEQUENCE_LENGTH, seed: int = 0, classes: int = NUM_CLASSES
):
    """x (global_batch, sequence) int32 token ids in [0, VOCABULARY), y (global_batch,) int32."""
    rng = np.random.default_rng(seed)
    x = rng.integers(0, VOCABULARY, size=(global_batch, sequence)).astype(np.int32)
    y = rng.integers(0, classes, size=(global_batch,)).astype(np.int32)
    return x, y


# name -> (model builder from nnx.Rngs, global batch size -> (x, y) NumPy arrays)
WORKLOADS = {
    "CNN": (CNN, lambda n: random_batch((28, 28, 1), n)),
    "MLP 784-1024-1024-10": (WideMLP, lambda n: random_batch((784,), n)),
    "Transformer 4x256": (Transformer, random_tokens),
}


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
    """The train step for `strategy.run(step, args=(model, optimizer, batch))`.

    `batch` is (images, labels) or (images, labels, sample_weight), a replica's shard; the
    weights are ignored. The loss is `compute_average_loss` with `global_batch` given, so the
    step's only cross-replica sum is the gradients'. Returns this replica's loss share.
    """

    def train_step(model, optimizer, batch):
        return update(
            model,
            optimizer,
            batch[0],
            batch[1],
            lambda losses: mirrax.compute_average_loss(losses, global_batch_size=global_batch),
            packed,
        )

    return train_step


def mirrax_state(devices, module_cls, x, y, **strategy_options):
    """What a mirrax user builds: `MirroredStrategy(devices, **strategy_options)`, the model and
    `nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)` under its scope, and the global
    batch (x, y) as one placed `PerReplica` batch from `experimental_distribute_dataset`.

    Returns (strategy, model, optimizer, batch).
    """
    strategy = mirrax.MirroredStrategy(devices, **strategy_options)
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
    sharded = NamedSharding(mesh, P("replica"))
    holder = {"state": jax.device_put(leaves, NamedSharding(mesh, P()))}
    x_dev, y_dev = jax.device_put(x, sharded), jax.device_put(y, sharded)

    def per_replica(leaves, x, y):
        model, optimizer = nnx.merge(graphdef, jax.tree.unflatten(state_def, leaves))
        loss = update(model, optimizer, x, y, lambda losses: losses.sum() / global_batch)
        return jax.tree.leaves(nnx.state((model, optimizer))), loss[None]

    compiled = jax.jit(
        jax.shard_map(
            per_replica, mesh=mesh, in_specs=(P(), P("replica"), P("replica")), out_specs=(P(), P("replica"))
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
