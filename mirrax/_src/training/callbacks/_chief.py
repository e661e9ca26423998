"""Which process writes files in a multi-process run: the chief, process 0 (as tf.keras)."""

from __future__ import annotations

import jax


def is_chief() -> bool:
    """True in process 0 of a multi-process run, and always in a single-process one.

    Every process runs the same callbacks on the same (all-reduced) values, so files written by
    callbacks (CSV logs, TensorBoard events) come from the chief only; the other processes
    would write the same content into the same paths.
    """
    return jax.process_index() == 0
