"""Batch leaves of other frameworks (torch.Tensor, tf.Tensor) as NumPy arrays, including the
dtypes NumPy lacks but JAX has (bfloat16, float8: ml_dtypes' NumPy types), and which dtypes
count as numbers."""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

# torch dtypes whose `.numpy()` raises "unsupported ScalarType": the integer type of the same
# width to view their bits as, and the JAX (ml_dtypes) type those bits are.
_TORCH_BITCASTS = {
    "torch.bfloat16": ("int16", jnp.bfloat16),
    "torch.float8_e4m3fn": ("uint8", jnp.float8_e4m3fn),
    "torch.float8_e5m2": ("uint8", jnp.float8_e5m2),
    "torch.float8_e4m3fnuz": ("uint8", jnp.float8_e4m3fnuz),
    "torch.float8_e5m2fnuz": ("uint8", jnp.float8_e5m2fnuz),
}


def to_numpy(leaf):
    """A torch or tf tensor as a NumPy array; other leaves (NumPy, JAX, Python) unchanged.

    A torch tensor is detached and moved to the host first. A torch bfloat16 / float8 tensor,
    which torch cannot give to NumPy, comes back bit for bit as a NumPy array of the JAX dtype
    of that name (`jnp.bfloat16`, ...), through an integer view of the same width (no copy).
    """
    if isinstance(leaf, (np.ndarray, jax.Array)) or not hasattr(leaf, "numpy"):
        return leaf
    if hasattr(leaf, "detach") and hasattr(leaf, "cpu"):  # torch: grad-tracking or on a GPU
        leaf = leaf.detach().cpu()
        bitcast = _TORCH_BITCASTS.get(str(getattr(leaf, "dtype", "")))
        if bitcast is not None:
            # The tensor's own package is loaded: its integer dtype is read from there.
            torch = sys.modules[type(leaf).__module__.split(".")[0]]
            integer, dtype = bitcast
            return leaf.view(getattr(torch, integer)).numpy().view(dtype)
    return leaf.numpy()


def is_numeric(dtype) -> bool:
    """Whether arrays of `dtype` are numbers JAX computes with: bool, int, float, complex,
    and ml_dtypes' bfloat16 / float8 (NumPy kind 'V', so not told by `dtype.kind`)."""
    dtype = np.dtype(dtype)
    return dtype.kind in "biufc" or jnp.issubdtype(dtype, jnp.floating)
