"""Reduction and aggregation enums (`ReduceOp`, `VariableAggregation`, as tf.distribute's) and
the aggregation each NNX variable gets."""

from __future__ import annotations

import enum

from flax import nnx

from mirrax import errors


class ReduceOp(enum.Enum):
    """How values from the replicas are combined, as `tf.distribute.ReduceOp`.

    `SUM` adds the replicas' values; `MEAN` adds them and divides by the number of replicas (or,
    with `strategy.reduce(..., axis=k)`, by the number of valid elements along `k` over all
    replicas). Strings are accepted in any case: `"sum"`, `"Mean"`.
    """

    SUM = "SUM"
    MEAN = "MEAN"

    @staticmethod
    def from_variable_aggregation(aggregation: VariableAggregation) -> ReduceOp:
        """The reduction that `aggregation` implies, as TF's `ReduceOp.from_variable_aggregation`.

        Raises:
          ValueError: for `NONE` and `ONLY_FIRST_REPLICA`, which are not reductions.
        """
        aggregation = VariableAggregation.from_any(aggregation)
        if aggregation is VariableAggregation.SUM:
            return ReduceOp.SUM
        if aggregation is VariableAggregation.MEAN:
            return ReduceOp.MEAN
        raise errors.InvalidArgumentError(
            f"VariableAggregation.{aggregation.name} has no ReduceOp; only SUM and MEAN do."
        )

    @classmethod
    def from_any(cls, value, argument: str = "reduce_op") -> ReduceOp:
        """Returns the `ReduceOp` for a `ReduceOp` or a string in any case.

        Raises:
          ValueError: when `value` names no reduction; the message lists the valid ones.
        """
        return _member(cls, value, argument)


class VariableAggregation(enum.Enum):
    """How a variable's per-replica updates are combined, as `tf.VariableAggregation`.

    Applied by `strategy.run` when it writes NNX state back: a state leaf that comes out of the
    step different on each replica is combined by its aggregation. `NONE`: an error (the replicas
    must agree); `SUM`: the replicas' updates (new - old) are added to the old value; `MEAN`: the
    replicas' values are averaged; `ONLY_FIRST_REPLICA`: replica 0's value is kept.
    """

    NONE = "NONE"
    SUM = "SUM"
    MEAN = "MEAN"
    ONLY_FIRST_REPLICA = "ONLY_FIRST_REPLICA"

    @classmethod
    def from_any(cls, value, argument: str = "aggregation") -> VariableAggregation:
        """Returns the `VariableAggregation` for an enum member or a string in any case.

        Raises:
          ValueError: when `value` names no aggregation; the message lists the valid ones.
        """
        return _member(cls, value, argument)


def _member(cls, value, argument: str):
    if isinstance(value, cls):
        return value
    if isinstance(value, str) and value.upper() in cls.__members__:
        return cls[value.upper()]
    names = ", ".join(f"mirrax.{cls.__name__}.{name}" for name in cls.__members__)
    raise errors.InvalidArgumentError(
        f"{argument} must be one of {names}, or its name as a string in any case "
        f"(e.g. {next(iter(cls.__members__)).lower()!r}); received {value!r}."
    )


def aggregation_of(variable) -> VariableAggregation:
    """A variable's aggregation: its `aggregation` metadata, else the default for its type.

    Defaults (docs/design.md, "`strategy.run`"): `nnx.BatchStat` → MEAN; metric state
    (`nnx.metrics.MetricState`) → SUM; everything else (`nnx.Param`, optimizer state,
    counters) → NONE.
    """
    explicit = variable.get_metadata().get("aggregation")
    if explicit is not None:
        return VariableAggregation.from_any(explicit, "aggregation metadata")
    if isinstance(variable, nnx.BatchStat):
        return VariableAggregation.MEAN
    if isinstance(variable, nnx.metrics.MetricState):
        return VariableAggregation.SUM
    return VariableAggregation.NONE
