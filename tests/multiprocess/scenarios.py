"""Programs that the multi-worker tests run in every worker process (one per training task).

Run as `python -m tests.multiprocess.scenarios NAME OUT_DIR TASK_INDEX [ARGS...]` with
`TF_CONFIG` set (or unset: one process); each writes OUT_DIR/<TASK_INDEX>.json. The same
program, run as one process over all the devices, is the reference the tests compare with.
"""

from __future__ import annotations

import json
import pathlib
import sys

import numpy as np


def _write(out_dir, index, result) -> None:
    path = pathlib.Path(out_dir) / f"{index}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(path)


def _strategy(**kwargs):
    import mirrax

    return mirrax.MultiWorkerMirroredStrategy(**kwargs)


def facts(out_dir, index):
    """Test 1: what the strategy says about the cluster and the input pipelines."""
    strategy = _strategy()
    import jax

    import mirrax

    resolver = strategy.cluster_resolver
    seen = []
    batches = np.arange(96, dtype=np.float32).reshape(96, 1)
    for batch in strategy.experimental_distribute_dataset([batches[:48], batches[48:]]):
        for local in strategy.experimental_local_results(batch):
            seen.extend(np.asarray(local)[:, 0].tolist())
    contexts = []
    strategy.distribute_datasets_from_function(
        lambda ctx: contexts.append(ctx) or [np.zeros((8, 1), np.float32)]
    )
    ctx = contexts[0]
    return {
        "num_workers": resolver.num_workers,
        "task_type": strategy.extended.task_type,
        "task_id": strategy.extended.task_id,
        "worker_index": resolver.worker_index,
        "is_chief": resolver.is_chief,
        "should_checkpoint": strategy.extended.should_checkpoint,
        "num_replicas_in_sync": strategy.num_replicas_in_sync,
        "local_replicas": len(strategy.extended.worker_devices),
        "worker_devices": list(strategy.extended.worker_devices),
        "process_index": jax.process_index(),
        "num_input_pipelines": ctx.num_input_pipelines,
        "input_pipeline_id": ctx.input_pipeline_id,
        "per_replica_batch_48": ctx.get_per_replica_batch_size(48),
        "examples_seen": seen,
        "is_mirrax_strategy": isinstance(strategy, mirrax.Strategy),
    }


def _mlp_problem(n=36):
    rng = np.random.default_rng(0)
    w1 = (rng.standard_normal((4, 3)) * 0.5).astype(np.float32)
    w2 = (rng.standard_normal((3, 2)) * 0.5).astype(np.float32)
    x = rng.standard_normal((n, 4)).astype(np.float32)
    y = rng.integers(0, 2, n).astype(np.int32)
    return w1, w2, x, y


def _mlp(w1, w2):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self):
            self.l1 = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
            self.l2 = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
            self.l1.kernel[...] = jnp.asarray(w1)
            self.l2.kernel[...] = jnp.asarray(w2)

        def __call__(self, x):
            return self.l2(jax.nn.relu(self.l1(x)))

    return MLP()


def _weights(module) -> list:
    return [np.asarray(module.l1.kernel[...]).tolist(), np.asarray(module.l2.kernel[...]).tolist()]


def fit(out_dir, index):
    """Test 2: Model.fit / evaluate / predict and a custom training loop, 36 examples, global
    batch 8 (a partial last batch of 4), shuffled with the same seed on every worker."""
    strategy = _strategy()
    import optax
    from flax import nnx

    import mirrax

    w1, w2, x, y = _mlp_problem()
    with strategy.scope():
        model = mirrax.Model(_mlp(w1, w2))
        model.compile(optax.adam(0.05),
                      mirrax.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    history = model.fit(x, y, batch_size=8, epochs=3, shuffle=True, verbose=0,
                        validation_data=(x[:10], y[:10]))
    evaluation = model.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)
    predictions = model.predict(x[:13], batch_size=8, verbose=0)

    with strategy.scope():
        module = _mlp(w1, w2)
        optimizer = nnx.Optimizer(module, optax.sgd(0.1), wrt=nnx.Param)
    dataset = strategy.experimental_distribute_dataset(
        [(x[i:i + 8], y[i:i + 8]) for i in range(0, 36, 8)]
    )

    def step(module, optimizer, batch):
        xb, yb = batch

        def loss_fn(module):
            per_example = optax.softmax_cross_entropy_with_integer_labels(module(xb), yb)
            return mirrax.compute_average_loss(per_example)

        loss, grads = nnx.value_and_grad(loss_fn)(module)
        optimizer.update(module, grads)
        return loss

    losses = []
    for _ in range(2):
        for batch in dataset:
            per_replica = strategy.run(step, args=(module, optimizer, batch))
            losses.append(float(strategy.reduce("sum", per_replica, axis=None)))
    return {
        "history": history.history,
        "weights": _weights(model.module),
        "evaluate": evaluation,
        "predictions": np.asarray(predictions).tolist(),
        "custom_losses": losses,
        "custom_weights": _weights(module),
    }


SCENARIOS = {"facts": facts, "fit": fit}


def main(argv) -> None:
    name, out_dir, index = argv[0], argv[1], int(argv[2])
    result = SCENARIOS[name](out_dir, index, *argv[3:])
    _write(out_dir, index, result)


if __name__ == "__main__":
    main(sys.argv[1:])
