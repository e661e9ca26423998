"""What `Model.compile` builds (model.py keeps its signature and documentation): Keras objects
translated, the arguments checked, the strategy chosen, the optimizer, loss, metrics and dtype
policy resolved, and the compiled step functions with their state."""

from __future__ import annotations

import dataclasses
from typing import Any

import optax

from mirrax._src import argument_checks
from mirrax._src.distribute import invariant
from mirrax._src.training import (
    keras_objects,
    metric_registry,
    mixed_precision,
    step_binding,
    strategy_checks,
)
from mirrax._src.training import optimizer as optimizers
from mirrax._src.training import outputs as outputs_lib
from mirrax._src.training import steps as steps_lib


@dataclasses.dataclass
class Compiled:
    """What one `compile` call gives the model: its attributes after the call."""

    strategy: Any
    steps_per_execution: int
    gradient_accumulation_steps: int
    optimizer: Any
    loss: Any
    metrics: list
    dtype_policy: Any
    compiled: Any


def configure(
    model,
    module,
    scope_strategy,
    binding,
    optimizer,
    loss,
    loss_weights,
    metrics,
    weighted_metrics,
    run_eagerly,
    steps_per_execution,
    jit_compile,
    auto_scale_loss,
    gradient_accumulation_steps,
) -> Compiled:
    """`Model.compile`'s work for `model` (its `module`, the strategy it was made under or None,
    its `StepBinding`); the arguments as `Model.compile` takes them, errors as it documents."""
    loss, optimizer, metrics, weighted_metrics = keras_objects.from_keras(
        loss, optimizer, metrics, weighted_metrics
    )
    outputs_lib.check_compile_args(
        loss, loss_weights, metrics, weighted_metrics, run_eagerly, jit_compile, auto_scale_loss
    )
    loss, loss_scale, outputs = outputs_lib.resolve(module, loss, loss_weights)
    steps_per_execution = argument_checks.count("compile", "steps_per_execution", steps_per_execution)
    gradient_accumulation_steps = argument_checks.count(
        "compile", "gradient_accumulation_steps", gradient_accumulation_steps
    )
    strategy = strategy_checks.compile_strategy(scope_strategy)
    if strategy.replica_invariant:
        invariant.check_no_sync_batch_norm((module,), "compile")
    policy = mixed_precision.global_policy()
    strategy_checks.check_sharded_optimizer(
        strategy, steps_per_execution, policy.uses_loss_scaling and auto_scale_loss
    )
    tx = optimizers.resolve_optimizer(optimizer)
    if gradient_accumulation_steps > 1:
        # optax's accumulator: the mean of k micro-batch gradients, applied every k-th step.
        tx = optax.MultiSteps(tx, every_k_schedule=gradient_accumulation_steps)
    handle = optimizers.make_handle(module, tx, strategy)
    built_metrics, names, weighted_flags, where = outputs_lib.build_metrics(
        loss, outputs, metrics, weighted_metrics
    )
    compiled = steps_lib.compiled_state(
        loss,
        loss_scale,
        policy,
        metric_registry.checked_scalar(names, built_metrics),
        weighted_flags,
        policy.uses_loss_scaling and auto_scale_loss,
        strategy.replica_invariant,
        outputs,
        where,
    )
    # New step functions at every compile: they key strategy.run's program cache, so a
    # recompiled model (another loss, policy or metrics) never reuses an old program.
    compiled.train_fn = step_binding.bound_step(model, binding, "train_step")
    compiled.test_fn = step_binding.bound_step(model, binding, "test_step")
    compiled.predict_fn = step_binding.bound_step(model, binding, "predict_step")
    handle.dynamic_scale = compiled.dynamic_scale
    return Compiled(
        strategy,
        steps_per_execution,
        gradient_accumulation_steps,
        handle,
        loss,
        built_metrics,
        policy,
        compiled,
    )
