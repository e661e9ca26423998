"""Bundled and standard data sets for examples and tests: `load_digits`, `load_cifar10`.

Both return NumPy arrays ready for `strategy.experimental_distribute_dataset` after batching:
images float32 of shape (N, height, width, channels) in [0, 1], labels int32 of shape (N,).
"""

from mirrax._src.data.cifar10 import load_cifar10 as load_cifar10
from mirrax._src.data.digits import load_digits as load_digits

__all__ = ["load_cifar10", "load_digits"]
