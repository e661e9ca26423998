"""Compiled programs: strategy.run's train step lowered and compiled (never timed), and the
reading of XLA's HLO text (its collectives and their bytes, the ENTRY schedule), which is the
library's own (`mirrax._src.report.hlo`, what the scaling report reads programs with), passed
through here. JAX-free at import: the library's names and `compile_train_step` import mirrax
(so JAX) on first use, after `env.configure_jax_environment`."""

from __future__ import annotations

import importlib

PER_REPLICA_BATCH = 32
# The library's HLO reading, by name: `hlo.collectives(text)` here is
# `mirrax._src.report.hlo.collectives(text)`.
_LIBRARY = (
    "COLLECTIVES",
    "BYTES_PER_ELEMENT",
    "collectives",
    "all_reduces",
    "nbytes",
    "describe",
    "kind",
    "payload_bytes",
    "entry_instructions",
    "ring_bytes",
)


def __getattr__(name: str):
    # Importing the library module imports the mirrax package, hence JAX, whose JAX_PLATFORMS
    # is read at import: so only when a name is used, after the benchmark configured JAX.
    if name in _LIBRARY:
        return getattr(importlib.import_module("mirrax._src.report.hlo"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def compile_train_step(
    devices, name: str, per_replica_batch: int, packed: bool = False, **strategy_options
) -> dict:
    """Runs one `strategy.run` train step of `models.WORKLOADS[name]` on a MirroredStrategy
    over `devices` (`models.mirrax_state`, `models.strategy_run_step`), then lowers it with
    `strategy.experimental_lower` on the same arguments and compiles it: the program
    strategy.run itself runs.

    `packed`: gradients from `mirrax.value_and_grad` instead of `nnx.value_and_grad`;
    `strategy_options` go to the strategy (e.g. shard_optimizer_state=True).

    Returns {"lowered", "compiled", "param_shapes" (list of shapes), "parameters" (int),
    "state_bytes" (params + optimizer state, all arrays of nnx.state), "device_state_bytes"
    (their shards on the first device), "batch_bytes" (one replica's share of the batch)}.
    """
    import jax
    import numpy as np
    from flax import nnx

    from benchmarks._harness import models

    builder, make_batch = models.WORKLOADS[name]
    global_batch = per_replica_batch * len(devices)
    x, y = make_batch(global_batch)
    strategy, model, optimizer, batch = models.mirrax_state(devices, builder, x, y, **strategy_options)
    step = models.strategy_run_step(global_batch, packed)
    strategy.run(step, args=(model, optimizer, batch))
    lowered = strategy.experimental_lower(step, args=(model, optimizer, batch))
    params = jax.tree.leaves(nnx.state(model, nnx.Param))
    return {
        "lowered": lowered,
        "compiled": lowered.compile(),
        "param_shapes": [tuple(p.shape) for p in params],
        "parameters": int(sum(p.size for p in params)),
        "state_bytes": int(sum(np.asarray(a).nbytes for a in jax.tree.leaves(nnx.state((model, optimizer))))),
        "device_state_bytes": int(
            sum(
                shard.data.nbytes
                for a in jax.tree.leaves(nnx.state((model, optimizer)))
                for shard in a.addressable_shards
                if shard.device == devices[0]
            )
        ),
        "batch_bytes": (x.nbytes + y.nbytes) // len(devices),
    }
