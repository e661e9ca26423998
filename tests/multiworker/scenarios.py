"""Programs that the multi-worker tests run in every worker process (one per training task).

Run as `python -m tests.multiworker.scenarios NAME OUT_DIR TASK_INDEX [ARGS...]` with
`TF_CONFIG` set (or unset: one process); each writes OUT_DIR/<TASK_INDEX>.json. The same
program, run as one process over all the devices, is the reference the tests compare with.
"""

from __future__ import annotations

import json
import pathlib
import sys

import numpy as np

from tests.multiworker import broadcast, restarts


def _write(out_dir, index, result) -> None:
    path = pathlib.Path(out_dir) / f"{index}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(path)


def make_strategy(timeout_seconds=None, **options):
    import os

    import mirrax

    timeout_seconds = timeout_seconds or float(os.environ.get("MIRRAX_TEST_TIMEOUT", 0)) or None
    return mirrax.MultiWorkerMirroredStrategy(
        communication_options=mirrax.CommunicationOptions(timeout_seconds=timeout_seconds), **options
    )


def facts(out_dir, index):
    """Test 1: what the strategy says about the cluster and the input pipelines."""
    strategy = make_strategy()
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
        **_outside_the_scope(batches),
    }


def _outside_the_scope(batches) -> dict:
    """Issue 26: outside every scope each worker runs alone on its own device (TF's default
    strategy); a strategy with no replica on some process is refused on every process."""
    import jax
    from flax import nnx

    import mirrax

    default = mirrax.get_strategy()
    contexts = []
    default.distribute_datasets_from_function(
        lambda ctx: contexts.append(ctx) or [np.zeros((8, 1), np.float32)]
    )
    rows = [
        int(np.asarray(local).shape[0])
        for batch in default.experimental_distribute_dataset([batches[:48]])
        for local in default.experimental_local_results(batch)
    ]
    module = nnx.Linear(1, 1, rngs=nnx.Rngs(0))
    module.kernel[...] = np.full((1, 1), 2.0, np.float32)
    module.bias[...] = np.ones((1,), np.float32)
    predicted = mirrax.Model(module).predict(batches[:6], batch_size=4, verbose=0)
    # The devices of processes 0 and 1 only: the last process has no replica to feed.
    partial = mirrax.MirroredStrategy(devices=[d for d in jax.devices() if d.process_index < 2])
    try:
        next(iter(partial.experimental_distribute_dataset([batches[:12]])))
        refused = None
    except Exception as e:  # the test checks the type's name and the message
        refused = f"{type(e).__name__}: {e}"
    return {
        "default_worker_devices": list(default.extended.worker_devices),
        "default_pipelines": (contexts[0].num_input_pipelines, contexts[0].input_pipeline_id),
        "default_rows": rows,
        "predicted": np.asarray(predicted)[:, 0].tolist(),
        "no_replica_refused": refused,
    }


def mlp_problem(n=36):
    rng = np.random.default_rng(0)
    w1 = (rng.standard_normal((4, 3)) * 0.5).astype(np.float32)
    w2 = (rng.standard_normal((3, 2)) * 0.5).astype(np.float32)
    x = rng.standard_normal((n, 4)).astype(np.float32)
    y = rng.integers(0, 2, n).astype(np.int32)
    return w1, w2, x, y


def mlp(w1, w2):
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


def _Joined(inner):
    """`inner` called on its inputs given as a list, joined along the last axis."""
    import jax.numpy as jnp
    from flax import nnx

    class Joined(nnx.Module):
        def __init__(self):
            self.inner = inner

        def __call__(self, x):
            return self.inner(jnp.concatenate(list(x), axis=-1))

    return Joined()


def weights_of(module) -> list:
    return [np.asarray(module.l1.kernel[...]).tolist(), np.asarray(module.l2.kernel[...]).tolist()]


def fit(out_dir, index):
    """Test 2: Model.fit / evaluate / predict and a custom training loop, 36 examples, global
    batch 8 (a partial last batch of 4), shuffled with the same seed on every worker."""
    strategy = make_strategy()
    import optax
    from flax import nnx

    import mirrax

    w1, w2, x, y = mlp_problem()
    with strategy.scope():
        model = mirrax.Model(mlp(w1, w2))
        model.compile(
            optax.adam(0.05),
            mirrax.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    history = model.fit(
        x, y, batch_size=8, epochs=3, shuffle=True, verbose=0, validation_data=(x[:10], y[:10])
    )
    evaluation = model.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)
    predictions = model.predict(x[:13], batch_size=8, verbose=0)
    # The same MLP given x as a list of two column blocks (several inputs) that it joins.
    with strategy.scope():
        joined = mirrax.Model(_Joined(mlp(w1, w2)))
        joined.compile(optax.adam(0.05), mirrax.losses.SparseCategoricalCrossentropy(from_logits=True))
    blocks = [x[:, :1], x[:, 1:]]
    joined_history = joined.fit(
        blocks,
        y,
        batch_size=8,
        epochs=3,
        shuffle=True,
        verbose=0,
        validation_data=([b[:10] for b in blocks], y[:10]),
    )

    with strategy.scope():
        module = mlp(w1, w2)
        optimizer = nnx.Optimizer(module, optax.sgd(0.1), wrt=nnx.Param)
    dataset = strategy.experimental_distribute_dataset(
        [(x[i : i + 8], y[i : i + 8]) for i in range(0, 36, 8)]
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
        "weights": weights_of(model.module),
        "evaluate": evaluation,
        "predictions": np.asarray(predictions).tolist(),
        "joined_history": joined_history.history,
        "joined_weights": weights_of(joined.module.inner),
        "joined_predictions": np.asarray(
            joined.predict([b[:13] for b in blocks], batch_size=8, verbose=0)
        ).tolist(),
        "custom_losses": losses,
        "custom_weights": weights_of(module),
    }


def sharded(out_dir, index):
    """Optimizer state sharded over every replica of every worker: Model.fit and a custom loop
    (mirrax.value_and_grad) with Adam, 32 examples in global batches of 8; the moments'
    layout."""
    strategy = make_strategy(shard_optimizer_state=True)
    import jax
    import optax
    from flax import nnx

    import mirrax

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(4, 8, rngs=rngs)  # (4, 8), (8,), (8, 2): split by 4
            self.l2 = nnx.Linear(8, 2, rngs=rngs)  # (2,): kept whole

        def __call__(self, x):
            return self.l2(jax.nn.relu(self.l1(x)))

    _, _, x, y = mlp_problem(32)
    with strategy.scope():
        model = mirrax.Model(Net(nnx.Rngs(0)))
        model.compile(optax.adam(0.05), mirrax.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)

    with strategy.scope():
        module = Net(nnx.Rngs(1))
        optimizer = nnx.Optimizer(module, optax.adam(0.05), wrt=nnx.Param)
    dataset = strategy.experimental_distribute_dataset(
        [(x[i : i + 8], y[i : i + 8]) for i in range(0, 32, 8)]
    )

    def step(module, optimizer, batch):
        def loss_fn(module, xb, yb):
            per_example = optax.softmax_cross_entropy_with_integer_labels(module(xb), yb)
            return mirrax.compute_average_loss(per_example)

        loss, grads = mirrax.value_and_grad(loss_fn)(module, *batch)
        optimizer.update(module, grads)
        return loss

    losses = []
    for _ in range(2):
        for batch in dataset:
            losses.append(
                float(strategy.reduce("sum", strategy.run(step, args=(module, optimizer, batch)), axis=None))
            )
    mu = optimizer.opt_state[0].mu["l1"]["kernel"].get_value()
    return {
        "history": history.history,
        "weights": [np.asarray(w).tolist() for w in model.get_weights()],
        "custom_losses": losses,
        "custom_weights": [np.asarray(a).tolist() for a in jax.tree.leaves(nnx.state(module))],
        "mu_spec": list(mu.sharding.spec),
        "mu_local_rows": [s.data.shape[0] for s in mu.addressable_shards],
    }


def invariant(out_dir, index):
    """Test 3 of replica invariance: fit (a CNN with Dropout, Adam, a partial last batch and
    validation data) and a custom loop with mirrax.value_and_grad, in replica-invariant mode.
    Weights are reported as CRC-32s of their bytes, so equal reports mean equal bits."""
    import os
    import zlib

    import jax
    import optax
    from flax import nnx

    import mirrax

    strategy = mirrax.MultiWorkerMirroredStrategy(replica_invariant=True, micro_batches=8)
    (x, y), _ = mirrax.data.load_digits()
    x, y = x[:100], y[:100]  # batches of 32: 3 full and a partial one of 4

    class CNN(nnx.Module):
        def __init__(self, rngs):
            self.conv = nnx.Conv(1, 4, (3, 3), rngs=rngs)
            self.dropout = nnx.Dropout(0.25, rngs=rngs)
            self.dense = nnx.Linear(4 * 64, 10, rngs=rngs)

        def __call__(self, x):
            x = self.dropout(nnx.relu(self.conv(x)))
            return self.dense(x.reshape(x.shape[0], -1))

    def crcs(module):
        return [zlib.crc32(np.asarray(p).tobytes()) for p in jax.tree.leaves(nnx.state(module, nnx.Param))]

    loss = mirrax.losses.SparseCategoricalCrossentropy(from_logits=True)
    with strategy.scope():
        model = mirrax.Model(CNN(nnx.Rngs(0, dropout=1)))
        model.compile("adam", loss, metrics=["accuracy"])
    history = model.fit(
        x, y, batch_size=32, epochs=2, shuffle=True, verbose=0, validation_data=(x[:40], y[:40])
    )
    predictions = model.predict(x[:24], batch_size=16, verbose=0)

    with strategy.scope():
        module = CNN(nnx.Rngs(0, dropout=1))
        optimizer = nnx.Optimizer(module, optax.adam(1e-2), wrt=nnx.Param)

    def loss_fn(module, batch):
        per_example = optax.softmax_cross_entropy_with_integer_labels(module(batch[0]), batch[1])
        return mirrax.compute_average_loss(per_example, global_batch_size=32)

    def step(module, optimizer, batch):
        value, grads = mirrax.value_and_grad(loss_fn)(module, batch)
        optimizer.update(module, grads)
        return value

    dataset = strategy.experimental_distribute_dataset(
        [(x[i : i + 32], y[i : i + 32]) for i in range(0, 100, 32)]
    )
    losses = [float(strategy.reduce("sum", strategy.run(step, args=(module, optimizer, b)))) for b in dataset]
    return {
        "layout": [jax.process_count(), len(jax.local_devices())],
        "launch_rank": os.environ.get("MIRRAX_LAUNCH_RANK"),
        "history": history.history,
        "weights": crcs(model.module),
        "predictions": zlib.crc32(np.asarray(predictions).tobytes()),
        "custom_losses": losses,
        "custom_weights": crcs(module),
    }


def autoshard(out_dir, index):
    """Test 3: 2 workers x 1 replica, global batch 4, 12 examples (0..11), no shuffling."""
    strategy = make_strategy()
    import mirrax

    out = pathlib.Path(out_dir)
    if index == 0:
        for name, values in (("a", range(0, 6)), ("b", range(6, 12)), ("all", range(12))):
            np.save(out / f"{name}.npy", np.asarray(values, np.int32))
    strategy.run(lambda: None)  # a collective: worker 0 has written the files
    read = lambda path: np.load(path)  # noqa: E731
    two_files = mirrax.data.FileDataset([out / "a.npy", out / "b.npy"], read, batch_size=4)
    one_file = mirrax.data.FileDataset([out / "all.npy"], read, batch_size=4)

    def steps(dataset, policy):
        options = mirrax.InputOptions(experimental_auto_shard_policy=policy)
        return [
            np.asarray(strategy.experimental_local_results(b)[0]).tolist()
            for b in strategy.experimental_distribute_dataset(dataset, options)
        ]

    result = {
        "FILE": steps(two_files, "FILE"),
        "AUTO_two_files": steps(two_files, "AUTO"),
        "DATA": steps(one_file, "DATA"),
        "AUTO_one_file": steps(one_file, "AUTO"),
        "OFF": steps(one_file, "OFF"),
        "numpy_batches_DATA": steps([np.arange(i, i + 4) for i in range(0, 12, 4)], "DATA"),
    }
    try:
        steps(one_file, "FILE")
    except ValueError as e:
        result["FILE_one_file_error"] = str(e)
    per_worker = strategy.distribute_datasets_from_function(
        lambda ctx: [
            np.arange(20 * ctx.input_pipeline_id + i, 20 * ctx.input_pipeline_id + i + 4)
            for i in range(0, 20, 4)
        ]
    )
    result["from_function"] = [
        np.asarray(strategy.experimental_local_results(b)[0]).tolist() for b in per_worker
    ]
    return result


def uneven(out_dir, index):
    """Test 4: worker 0 has 5 batches of 4 examples (ids 0..19), worker 1 has 3 (ids 100..111)."""
    strategy = make_strategy()
    import jax.numpy as jnp
    from flax import nnx

    import mirrax

    counts = [5, 3]
    start = [0, 100]

    def per_worker(ctx):
        i = ctx.input_pipeline_id
        ids = np.arange(start[i], start[i] + 4 * counts[i], dtype=np.float32)
        return [(ids[j : j + 4, None], ids[j : j + 4]) for j in range(0, len(ids), 4)]

    dataset = strategy.distribute_datasets_from_function(per_worker)
    steps, gathered, totals = 0, [], []
    for x, _ in dataset:
        steps += 1
        out = strategy.run(lambda x: x[:, 0], args=(x,))
        gathered.extend(np.asarray(strategy.gather(out, axis=0)).tolist())
        totals.append(float(strategy.reduce("sum", out, axis=0)))

    class Scale(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones(()))

        def __call__(self, x):
            return x[:, 0] * self.w

    with strategy.scope():
        model = mirrax.Model(Scale())
        model.compile("sgd", "mse")
    # MSE against 0 is the mean of x**2 over the examples the evaluation saw.
    zeros = strategy.distribute_datasets_from_function(
        lambda ctx: [(x, np.zeros_like(y)) for x, y in per_worker(ctx)]
    )
    mse = model.evaluate(zeros, verbose=0)
    return {"steps": steps, "gathered": gathered, "totals": totals, "evaluate_mse": mse}


def compiled_mlp(strategy, lr=0.05):
    import optax

    import mirrax

    w1, w2, x, y = mlp_problem()
    with strategy.scope():
        model = mirrax.Model(mlp(w1, w2))
        model.compile(
            optax.adam(lr),
            mirrax.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    return model, x, y


def chief_writes(out_dir, index):
    """Test 7: ModelCheckpoint + save_weights over 3 processes, 2 epochs, progress printed."""
    strategy = make_strategy()
    import mirrax

    model, x, y = compiled_mlp(strategy)
    ckpt = pathlib.Path(out_dir) / "ckpt"
    model.fit(
        x,
        y,
        batch_size=12,
        epochs=2,
        verbose=2,
        callbacks=[
            mirrax.callbacks.ModelCheckpoint(
                str(ckpt / "epoch{epoch:02d}"), save_weights_only=True, verbose=1
            )
        ],
    )
    model.save_weights(str(ckpt / "final"))
    return {"weights": weights_of(model.module)}


def killed(out_dir, index, phase):
    """Tests 5 and 6: fit 4 epochs of 5 steps with BackupAndRestore; in phase "kill" worker 1
    kills itself (SIGKILL) after batch 3 of epoch 3. Phase "default": the same with the default
    CommunicationOptions (worker 1 dies after the first epoch)."""
    import os
    import signal

    strategy = make_strategy(timeout_seconds=None if phase in ("default", "raise") else 15)
    import mirrax

    model, x, y = compiled_mlp(strategy)
    out = pathlib.Path(out_dir)
    seen = []

    def on_batch_end(batch, logs):
        seen.append((epoch_now[0], batch))
        (out / f"progress{index}").write_text(f"{epoch_now[0]} {batch}")
        if (
            phase in ("kill", "default")
            and index == 1
            and (epoch_now[0], batch) == ((2, 2) if phase == "kill" else (1, 0))
        ):
            os.kill(os.getpid(), signal.SIGKILL)
        if phase == "raise" and index == 1 and (epoch_now[0], batch) == (1, 0):
            raise RuntimeError("worker 1 fails on purpose")

    epoch_now = [None]
    callbacks = [
        mirrax.callbacks.LambdaCallback(
            on_epoch_begin=lambda epoch, logs: epoch_now.__setitem__(0, epoch),
            on_train_batch_end=on_batch_end,
        ),
    ]
    if phase != "plain":
        callbacks.insert(0, mirrax.callbacks.BackupAndRestore(str(out / "backup")))
    epochs = 40 if phase in ("default", "raise") else 4
    model.fit(x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0, callbacks=callbacks)
    return {"weights": weights_of(model.module), "seen": seen}


def decisions(out_dir, index):
    """Test 8: EarlyStopping and ReduceLROnPlateau on the all-reduced logs; each worker's own
    data (from distribute_datasets_from_function) would lead it to other decisions."""
    strategy = make_strategy()
    import optax

    import mirrax

    model, _, _ = compiled_mlp(strategy)
    with strategy.scope():
        model.compile(
            optax.inject_hyperparams(optax.sgd)(learning_rate=3.0),
            mirrax.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    rng = np.random.default_rng(10 + index)

    def per_worker(ctx):
        x = rng.standard_normal((24, 4)).astype(np.float32) * (1 + 3 * ctx.input_pipeline_id)
        y = rng.integers(0, 2, 24).astype(np.int32)
        return [(x[i : i + 4], y[i : i + 4]) for i in range(0, 24, 4)]

    dataset = strategy.distribute_datasets_from_function(per_worker)
    stopper = mirrax.callbacks.EarlyStopping(monitor="loss", patience=1)
    rates = []
    history = model.fit(
        dataset,
        epochs=12,
        verbose=0,
        callbacks=[
            stopper,
            mirrax.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0, min_delta=0.0),
            mirrax.callbacks.LambdaCallback(
                on_epoch_end=lambda epoch, logs: rates.append(
                    float(np.asarray(model.optimizer.learning_rate))
                )
            ),
        ],
    )
    return {"loss": history.history["loss"], "stopped_epoch": stopper.stopped_epoch, "rates": rates}


def divergent(out_dir, index, mode):
    """Programs that differ between the workers; each must fail on EVERY worker, not hang."""
    strategy = make_strategy()
    ones = [np.ones((4, 2), np.float32)] * 3
    if mode == "order":
        # Worker 0 creates A then B, worker 1 B then A; both read "A" first.
        a = strategy.experimental_distribute_dataset(ones)
        b = strategy.experimental_distribute_dataset([np.zeros((4, 2), np.float32)] * 3)
        first = a if index == 0 else b
        for _ in first:
            pass
    elif mode == "dtype":
        dtype = np.float32 if index == 0 else np.int32
        for _ in strategy.distribute_datasets_from_function(lambda ctx: [np.ones((4, 2), dtype)] * 2):
            pass
    elif mode == "data":
        # AutoShardPolicy.DATA with 5 global batches on worker 0 and 3 on worker 1.
        for _ in strategy.experimental_distribute_dataset(ones[:1] * (5 if index == 0 else 3)):
            pass
    elif mode == "values":
        # AutoShardPolicy.DATA with batches of one shape but other values on worker 1 (e.g.
        # each worker shuffled with its own seed): before, each trained on its part of a mix.
        data = ones if index == 0 else [np.zeros((4, 2), np.float32)] * 3
        for _ in strategy.experimental_distribute_dataset(data):
            pass
    elif mode == "sigterm":
        model, x, y = compiled_mlp(strategy)
        (pathlib.Path(out_dir) / f"ready{index}").write_text("")
        model.fit(x, y, batch_size=8, epochs=10_000, verbose=0)
    return {}


# The data set of the loaders scenario: example i has x = 2**i, so a mean over examples tells
# which were counted (1023 / 10 = 102.3 when each of 0..9 counts once), and y = 0.
LOADER_EXAMPLES = 10
LOADER_BATCH = 4


def loader_examples():
    """(x, y, hf): x of shape (LOADER_EXAMPLES, 1) float32 with x[i] = 2**i, y zeros, and the
    same as a Hugging Face Dataset {"x", "y"} in NumPy format."""
    import datasets

    x = (2.0 ** np.arange(LOADER_EXAMPLES)).astype(np.float32)[:, None]
    y = np.zeros(LOADER_EXAMPLES, np.float32)
    return x, y, datasets.Dataset.from_dict({"x": x, "y": y}).with_format("numpy")


def loader_inputs():
    """{name: (a function making a fresh input of the LOADER_EXAMPLES examples in global batches
    of LOADER_BATCH, its kind)} for every loader a user brings: "pairs" inputs yield (x, y)
    batches (for fit), "dicts" ones Hugging Face dicts {"x", "y"} (for distributing only)."""
    import grain
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    x, y, hf = loader_examples()
    tensors = TensorDataset(torch.from_numpy(x), torch.from_numpy(y))

    class Source:  # a Grain data source: random access to the examples
        def __len__(self):
            return LOADER_EXAMPLES

        def __getitem__(self, i):
            return x[i], y[i]

    grain_map = grain.MapDataset.source(Source()).batch(LOADER_BATCH)
    return {
        "torch": (lambda: DataLoader(tensors, batch_size=LOADER_BATCH), "pairs"),
        "torch_shuffled": (
            lambda: DataLoader(
                tensors, batch_size=LOADER_BATCH, shuffle=True, generator=torch.Generator().manual_seed(0)
            ),
            "pairs",
        ),
        "hf_iter": (lambda: hf.iter(batch_size=LOADER_BATCH), "dicts"),
        "hf_batch": (lambda: hf.batch(LOADER_BATCH), "dicts"),
        "hf_grain": (
            lambda: grain.MapDataset.source(hf).map(lambda b: (b["x"], b["y"])).batch(LOADER_BATCH),
            "pairs",
        ),
        "grain_map": (lambda: grain_map, "pairs"),
        "grain_iter": (lambda: grain_map.to_iter_dataset(), "pairs"),
        "grain_loader": (
            lambda: grain.DataLoader(
                data_source=Source(),
                operations=[grain.transforms.Batch(LOADER_BATCH)],
                sampler=grain.samplers.IndexSampler(LOADER_EXAMPLES, shuffle=False, num_epochs=1),
                worker_count=0,
            ),
            "pairs",
        ),
        "generator": (
            lambda: (
                (x[i : i + LOADER_BATCH], y[i : i + LOADER_BATCH])
                for i in range(0, LOADER_EXAMPLES, LOADER_BATCH)
            ),
            "pairs",
        ),
    }


def loader_runs(strategy) -> dict:
    """What `strategy` makes of every loader of `loader_inputs`: the examples (their ids) each
    local replica gets per step, two passes, and fit / evaluate / predict; per-worker inputs
    made by distribute_datasets_from_function; the steps fit's callbacks are told."""
    import grain
    import jax
    import jax.numpy as jnp
    import torch
    from flax import nnx
    from torch.utils.data import DataLoader, Subset, TensorDataset

    import mirrax

    def ids_per_step(dist):
        steps = []
        for batch in dist:
            xs = batch["x"] if isinstance(batch, dict) else batch[0]
            steps.append(
                [
                    np.log2(np.asarray(v)[:, 0]).astype(int).tolist()
                    for v in strategy.experimental_local_results(xs)
                ]
            )
        return steps

    class Identity(nnx.Module):  # the loss is x itself: a mean of x over the examples
        def __init__(self):
            self.w = nnx.Param(jnp.zeros(()))

        def __call__(self, x):
            return x + 0.0 * self.w[...]

    class Steps(mirrax.callbacks.Callback):
        """Keeps the steps per epoch fit tells its callbacks (the progress bar's total)."""

        def on_train_begin(self, logs=None):
            self.steps = self.params["steps"]

    with strategy.scope():
        model = mirrax.Model(Identity())
        model.compile("sgd", loss=lambda y, y_pred: y_pred[:, 0])
    result = {}
    for name, (make, kind) in loader_inputs().items():
        dist = strategy.experimental_distribute_dataset(make())
        passes = 1 if name in ("generator", "hf_iter") else 2
        out = {"steps": [ids_per_step(dist) for _ in range(passes)]}
        if kind == "pairs":
            told = Steps()
            epochs = 1 if name == "generator" else 2  # a generator is one pass (Keras)
            out["fit"] = model.fit(make(), epochs=epochs, verbose=0, callbacks=[told]).history["loss"]
            out["fit_steps"] = told.steps
            out["evaluate"] = model.evaluate(make(), verbose=0)
            out["predict"] = np.log2(model.predict(make(), verbose=0)[:, 0]).astype(int).tolist()
        result[name] = out

    # Per-worker inputs, each worker its own examples, in per-replica batches.
    x, y, hf = loader_examples()

    def torch_fn(ctx):
        rows = range(ctx.input_pipeline_id, LOADER_EXAMPLES, ctx.num_input_pipelines)
        return DataLoader(
            Subset(TensorDataset(torch.from_numpy(x), torch.from_numpy(y)), list(rows)),
            batch_size=ctx.get_per_replica_batch_size(LOADER_BATCH),
        )

    def hf_fn(ctx):
        shard = hf.shard(num_shards=ctx.num_input_pipelines, index=ctx.input_pipeline_id, contiguous=True)
        return shard.iter(batch_size=ctx.get_per_replica_batch_size(LOADER_BATCH))

    def grain_fn(ctx):
        return (
            grain.MapDataset.range(LOADER_EXAMPLES)[ctx.input_pipeline_id :: ctx.num_input_pipelines]
            .map(lambda i: (x[i], y[i]))
            .batch(ctx.get_per_replica_batch_size(LOADER_BATCH))
        )

    for name, fn in (("torch", torch_fn), ("hf", hf_fn), ("grain", grain_fn)):
        result[f"from_function_{name}"] = ids_per_step(strategy.distribute_datasets_from_function(fn))
    result["from_function_evaluate"] = model.evaluate(
        strategy.distribute_datasets_from_function(grain_fn), verbose=0
    )
    if jax.process_count() > 1:
        # Each worker shuffles with its own (unseeded) generator: AutoShardPolicy.DATA needs
        # the same batches on every worker, and says so.
        torch.manual_seed(jax.process_index())
        unseeded = DataLoader(TensorDataset(torch.from_numpy(x)), batch_size=LOADER_BATCH, shuffle=True)
        try:
            ids_per_step(strategy.experimental_distribute_dataset(unseeded))
        except mirrax.errors.DivergentWorkersError as error:
            result["unseeded_shuffle_error"] = str(error)
    return result


def loaders(out_dir, index):
    """tests/test_data_loaders.py: `loader_runs` on every worker (2 workers x 2 devices)."""
    return loader_runs(make_strategy())


def keras_save(out_dir, index):
    """Model.save of a Keras model on 2 workers, in TF's pattern (the chief writes
    OUT_DIR/m.keras, the other worker is given workertemp_1/m.keras): only the chief's file is
    written, and after save every worker reads it back with its own predictions."""
    import os

    os.environ.setdefault("KERAS_BACKEND", "jax")
    strategy = make_strategy()
    import keras

    import mirrax

    keras.utils.set_random_seed(0)
    w1, w2, x, y = mlp_problem()
    with strategy.scope():
        model = mirrax.Model(
            keras.Sequential(
                [keras.Input((x.shape[1],)), keras.layers.Dense(8), keras.layers.Dense(int(y.max()) + 1)]
            )
        )
        model.compile(
            keras.optimizers.Adam(0.05), keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        )
    model.fit(x, y, batch_size=12, epochs=1, verbose=0)
    chief_path = pathlib.Path(out_dir) / "m.keras"
    path = chief_path if index == 0 else pathlib.Path(out_dir) / f"workertemp_{index}" / "m.keras"
    model.save(path)
    with strategy.scope():
        loaded = mirrax.models.load_model(chief_path, compile=False)
    return {
        "same_predictions": bool(np.array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))),
        "wrote_own_path": path.exists() and path != chief_path,
    }


from tests.multiworker.checkpoints_tf import checkpoints_tf  # noqa: E402
from tests.multiworker.files_procs import SCENARIOS as _FILES_PROCS  # noqa: E402

SCENARIOS = {
    "checkpoints_tf": checkpoints_tf,
    "autoshard": autoshard,
    "divergent": divergent,
    "chief_writes": chief_writes,
    "decisions": decisions,
    "facts": facts,
    "fit": fit,
    "invariant": invariant,
    "keras_save": keras_save,
    "killed": killed,
    "loaders": loaders,
    "sharded": sharded,
    "uneven": uneven,
    **broadcast.SCENARIOS,
    **restarts.SCENARIOS,
    **_FILES_PROCS,
}


def main(argv) -> None:
    import os

    name, out_dir = argv[0], argv[1]
    # "auto": the index `mirrax launch` gives the worker.
    index = int(os.environ["MIRRAX_LAUNCH_RANK"] if argv[2] == "auto" else argv[2])
    result = SCENARIOS[name](out_dir, index, *argv[3:])
    _write(out_dir, index, result)


if __name__ == "__main__":
    main(sys.argv[1:])
