"""Which strategy and replica context are current, as tf.distribute's module functions:
`get_strategy`, `has_strategy`, `in_cross_replica_context`, `get_replica_context`, and the
default strategy in effect outside every scope."""

from __future__ import annotations

import jax

from mirrax._src.distribute.replica_context import (
    ReplicaContext,
    current_replica_context,
    current_strategy_in_scope,
)
from mirrax._src.distribute.strategy import Strategy


class _DefaultStrategy(Strategy):
    """The strategy in effect outside every scope: one replica on this process's first device.

    In a multi-worker run each worker's default strategy is its own (TF's: a model built and
    trained outside every scope trains on each worker alone); `jax.devices()[0]` would be
    worker 0's device, which no other worker can feed.
    """

    def __init__(self):
        super().__init__([jax.local_devices()[0]])


_default: list = []


def default_strategy() -> Strategy:
    """The process-wide default strategy (created on first use, so importing mirrax is cheap)."""
    if not _default:
        _default.append(_DefaultStrategy())
    return _default[0]


def get_strategy() -> Strategy:
    """The current strategy, as `tf.distribute.get_strategy`.

    Inside `strategy.run` or `strategy.scope()` that strategy; otherwise the default strategy
    (one replica on this process's first device, so code written for strategies also runs
    without one; in a multi-worker run, on that worker alone).
    """
    ctx = current_replica_context()
    if ctx is not None:
        return ctx.strategy
    return current_strategy_in_scope() or default_strategy()


def has_strategy() -> bool:
    """True inside a (non-default) strategy's `scope()` or `run`, as `tf.distribute.has_strategy`."""
    return not isinstance(get_strategy(), _DefaultStrategy)


def in_cross_replica_context() -> bool:
    """True inside `strategy.scope()` but outside `strategy.run`, as TF's function of that name."""
    return current_replica_context() is None and current_strategy_in_scope() is not None


def get_replica_context() -> ReplicaContext | None:
    """The current `ReplicaContext`, as `tf.distribute.get_replica_context`.

    Inside `strategy.run`: the running replica's context. In cross-replica context (inside a
    scope, outside run): None. Outside every scope: the default strategy's replica context
    (one replica; its collectives return their input).
    """
    ctx = current_replica_context()
    if ctx is not None:
        return ctx
    if current_strategy_in_scope() is not None:
        return None
    return ReplicaContext(default_strategy(), traced=False)
