"""The peers' models: `models`' CNN, WideMLP (784-1024-1024-10) and Transformer, layer for
layer, in Keras 3 and PyTorch, and their random data (NumPy), for the worker processes that
load neither JAX nor mirrax.

JAX-free and mirrax-free: Keras comes in as an argument (any backend, or `tf.keras`), torch
is imported by `torch_model` (the driver processes have neither). Every model outputs logits
(batch, classes).
"""

from __future__ import annotations

import functools

WORKLOADS = ("cnn", "mlp", "transformer")
IMAGE_SHAPE = (28, 28, 1)  # the CNN's NHWC input; PyTorch's CNN takes NCHW
CLASSES = 10
MLP_SIZES = (784, 1024, 1024, CLASSES)
# `models.Transformer`'s keyword options as the peers use them: exact GELU and LayerNorm
# epsilon 1e-5 are Keras's and PyTorch's defaults.
TRANSFORMER = {
    "layers": 4,
    "d_model": 256,
    "heads": 4,
    "mlp": 1024,
    "sequence": 64,
    "vocabulary": 1000,
    "classes": CLASSES,
    "epsilon": 1e-5,
    "exact_gelu": True,
}


def random_data(workload: str, examples: int, seed: int):
    """x (examples, *input shape) float32 normal (the transformer: int32 token ids) and y
    (examples,) int32 labels, drawn in that order (as `models.random_batch`)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    if workload == "transformer":
        t = TRANSFORMER
        x = rng.integers(0, t["vocabulary"], size=(examples, t["sequence"])).astype(np.int32)
    else:
        shape = IMAGE_SHAPE if workload == "cnn" else MLP_SIZES[:1]
        x = rng.standard_normal((examples,) + shape).astype(np.float32)
    return x, rng.integers(0, CLASSES, size=(examples,)).astype(np.int32)


def keras_model(keras, workload: str):
    """`workload` as a Keras 3 model: the CNN takes (batch, 28, 28, 1) float32, the MLP
    (batch, 784) float32, the transformer (batch, 64) int32 tokens."""
    layers = keras.layers
    if workload == "cnn":
        return keras.Sequential(
            [
                keras.Input(IMAGE_SHAPE),
                layers.Conv2D(32, 3, activation="relu", padding="same"),
                layers.MaxPooling2D(2),
                layers.Conv2D(64, 3, activation="relu", padding="same"),
                layers.MaxPooling2D(2),
                layers.Conv2D(64, 3, activation="relu", padding="same"),
                layers.Flatten(),
                layers.Dense(64, activation="relu"),
                layers.Dense(CLASSES),
            ]
        )
    if workload == "mlp":
        return keras.Sequential(
            [keras.Input(MLP_SIZES[:1])]
            + [layers.Dense(n, activation="relu") for n in MLP_SIZES[1:-1]]
            + [layers.Dense(MLP_SIZES[-1])]
        )
    t = TRANSFORMER

    class PositionEmbedding(layers.Layer):
        def build(self, input_shape):
            self.position = self.add_weight(
                shape=(t["sequence"], t["d_model"]), initializer=keras.initializers.RandomNormal(0, 0.02)
            )

        def call(self, x):
            return x + self.position

    def norm():
        return layers.LayerNormalization(epsilon=t["epsilon"])

    tokens = keras.Input((t["sequence"],), dtype="int32")
    x = PositionEmbedding()(layers.Embedding(t["vocabulary"], t["d_model"])(tokens))
    for _ in range(t["layers"]):
        h = norm()(x)
        attention = layers.MultiHeadAttention(t["heads"], t["d_model"] // t["heads"])
        x = layers.Add()([x, attention(h, h)])
        h = layers.Dense(t["mlp"], activation="gelu")(norm()(x))  # Keras's gelu is exact
        x = layers.Add()([x, layers.Dense(t["d_model"])(h)])
    x = layers.GlobalAveragePooling1D()(norm()(x))
    return keras.Model(tokens, layers.Dense(t["classes"])(x))


def torch_model(workload: str, **transformer):
    """`workload` as a torch.nn.Module: the CNN takes NCHW images (batch, 1, 28, 28), the
    transformer int64 tokens (batch, sequence); `transformer` overrides TRANSFORMER's options
    (exact_gelu False: tanh GELU)."""
    import torch
    from torch import nn

    if workload == "cnn":
        return nn.Sequential(
            nn.Conv2d(IMAGE_SHAPE[-1], 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(64, 64, 3, padding=1),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(64 * (IMAGE_SHAPE[0] // 4) * (IMAGE_SHAPE[1] // 4), 64),
            nn.ReLU(),
            nn.Linear(64, CLASSES),
        )
    if workload == "mlp":
        hidden = [m for a, b in zip(MLP_SIZES[:-2], MLP_SIZES[1:-1]) for m in (nn.Linear(a, b), nn.ReLU())]
        return nn.Sequential(*hidden, nn.Linear(*MLP_SIZES[-2:]))
    t = {**TRANSFORMER, **transformer}
    gelu = "gelu" if t["exact_gelu"] else functools.partial(nn.functional.gelu, approximate="tanh")

    class Transformer(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(t["vocabulary"], t["d_model"])
            self.position = nn.Parameter(0.02 * torch.randn(t["sequence"], t["d_model"]))
            self.blocks = nn.ModuleList(
                nn.TransformerEncoderLayer(
                    t["d_model"],
                    t["heads"],
                    t["mlp"],
                    dropout=0.0,
                    activation=gelu,
                    layer_norm_eps=t["epsilon"],
                    batch_first=True,
                    norm_first=True,
                )
                for _ in range(t["layers"])
            )
            self.norm = nn.LayerNorm(t["d_model"], eps=t["epsilon"])
            self.head = nn.Linear(t["d_model"], t["classes"])

        def forward(self, tokens):
            x = self.embed(tokens) + self.position[: tokens.shape[1]]
            for block in self.blocks:
                x = block(x)
            return self.head(self.norm(x).mean(dim=1))

    return Transformer()
