"""Bundled and standard data sets for examples and tests: `load_digits`, `load_cifar10`; and
`FileDataset`, examples stored in files (shardable by file between workers).

Both return NumPy arrays ready for `strategy.experimental_distribute_dataset` after batching:
images float32 of shape (N, height, width, channels) in [0, 1], labels int32 of shape (N,).
"""

from mirrax._src.data.cifar10 import load_cifar10 as load_cifar10
from mirrax._src.data.digits import load_digits as load_digits
from mirrax._src.data.files import FileDataset as FileDataset

__all__ = ["FileDataset", "load_cifar10", "load_digits"]
