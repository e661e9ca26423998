"""The checks of a model's strategy before a call: the one-step calls refused under a
ParameterServerStrategy, the sharded optimizer's limits, the strategy `compile` picks and the
one each later call must run under (a model moved off a strategy that was shut down)."""

from __future__ import annotations

from mirrax import errors
from mirrax._src.distribute.current import get_strategy, has_strategy
from mirrax._src.parameter_server.strategy import ParameterServerStrategy, is_shut_down


def check_not_parameter_server(strategy, what: str) -> None:
    """Refuses a one-step call under a ParameterServerStrategy, whose steps run on workers.

    Raises:
      UnsupportedArgumentError: `strategy` is a ParameterServerStrategy.
    """
    if isinstance(strategy, ParameterServerStrategy):
        raise errors.UnsupportedArgumentError(
            f"Model.{what} is not supported under ParameterServerStrategy: its steps run on the "
            "workers, scheduled by fit / evaluate. Use fit(..., steps_per_epoch=1) or "
            "evaluate(x, y), or schedule your own step with mirrax.ClusterCoordinator."
        )


def check_sharded_optimizer(strategy, steps_per_execution: int, loss_scaling: bool) -> None:
    """Refuses what a strategy with `shard_optimizer_state=True` cannot run in `fit`: its
    optimizer update takes effect when the step function returns, so it cannot follow
    several steps in one program, nor be skipped on a step whose scaled gradients overflow.

    Raises:
      UnsupportedArgumentError: steps_per_execution > 1, or dynamic loss scaling.
    """
    if not strategy.extended.shard_optimizer_state or strategy.num_replicas_in_sync == 1:
        return  # one replica: nothing is split, nothing deferred
    if steps_per_execution > 1:
        raise errors.UnsupportedArgumentError(
            f"compile: steps_per_execution={steps_per_execution} is not supported on a strategy "
            "with shard_optimizer_state=True (the sharded update runs once per program). Use "
            "steps_per_execution=1, or shard_optimizer_state=False."
        )
    if loss_scaling:
        raise errors.UnsupportedArgumentError(
            "compile: the 'mixed_float16' policy's dynamic loss scaling is not supported on a "
            "strategy with shard_optimizer_state=True (a step whose gradients overflow cannot "
            "skip the sharded update). Use 'mixed_bfloat16' (no loss scaling), "
            "auto_scale_loss=False, or shard_optimizer_state=False."
        )


def _two(first, second) -> tuple[str, str]:
    """The reprs of two different strategies, told apart when they read the same."""
    a, b = repr(first), repr(second)
    if a == b:
        a, b = f"{a} (at {id(first):#x})", f"another {b} (at {id(second):#x})"
    return a, b


def _moved_after_shutdown(what: str, old) -> errors.MixedStrategyError:
    return errors.MixedStrategyError(
        f"{what}: this Model's strategy, {old!r}, was shut down (strategy.shutdown()). The "
        "model keeps its weights and may move to a new strategy: compile it under the new "
        "strategy's scope (with new_strategy.scope(): model.compile(...)), then call "
        f"{what.split(':')[0]} (docs/parameter_server.md, 'Failures')."
    )


def compile_strategy(scope_strategy):
    """The strategy of `Model.compile`: in scope now, else `scope_strategy` (the one in scope
    when the Model was made), else the default. A model whose strategy was shut down (a
    ParameterServerStrategy after `shutdown()`) moves to the strategy in scope.

    Raises:
      MixedStrategyError: another strategy is in scope than the one the Model was made in,
        or the Model's strategy was shut down and none is in scope.
    """
    if has_strategy():
        current = get_strategy()
        if scope_strategy is not None and current is not scope_strategy and not is_shut_down(scope_strategy):
            made, now = _two(scope_strategy, current)
            raise errors.MixedStrategyError(
                f"compile: this Model was made under the scope of {made} "
                f"but is compiled under the scope of {now}; a model belongs to one "
                "strategy (as in Keras). Compile it under the strategy it was made in, or "
                "build a new module and Model under the new strategy's scope."
            )
        return current
    if is_shut_down(scope_strategy):
        raise _moved_after_shutdown("compile", scope_strategy)
    return scope_strategy or get_strategy()


def check_model_scope(what: str, mine):
    """The strategy a call of the model runs on: its own, `mine` (as TF's "Mixing different
    tf.distribute.Strategy objects", another one in scope is refused; outside every scope the
    model's is used). When `mine` was shut down, the ParameterServerStrategy in scope (the
    recovery flow: a new strategy, the same model), which the model then belongs to.

    Raises:
      MixedStrategyError: another strategy is in scope; or `mine` was shut down and no other
        ParameterServerStrategy is in scope (the message says to compile under the new one).
    """
    current = get_strategy() if has_strategy() else None
    if is_shut_down(mine) and current is not mine:
        if isinstance(current, ParameterServerStrategy) and not is_shut_down(current):
            return current  # the compiled steps run on any parameter-server strategy
        raise _moved_after_shutdown(what, mine)
    if mine is not None and current is not None and current is not mine:
        owner, now = _two(mine, current)
        raise errors.MixedStrategyError(
            f"{what}: this Model belongs to {owner} but is called under the scope of "
            f"{now}; a model runs on the strategy it was compiled with. Call "
            "it outside that scope (or under its own), or build a new module and Model "
            "under the new strategy's scope."
        )
    return mine
