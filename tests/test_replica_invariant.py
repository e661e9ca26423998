"""Replica-invariant mode (`replica_invariant=True, micro_batches=8`): the same bits on 1 to 8 replicas.

Bitwise claims (`np.array_equal`, identical loss histories) are what the mode guarantees: each
micro-batch is computed at the same shapes, every float sum over micro-batches follows one
pairwise tree, and randomness is keyed by the global micro-batch index (docs/design.md,
"Replica invariance"). The strategies compared: OneDeviceStrategy (1 replica) and
MirroredStrategy over 2, 4 and 8 fake CPU devices.
"""

import json
import os
import re
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import mirrax
from mirrax import errors
from mirrax._src.distribute import exact_sums
from tests.multiworker import harness

# The replica counts that can differ under the mode's fixed tree over 8 micro-batches: 1 (the
# whole tree inside one replica, no collective), 2 (the tree's lower levels inside each replica,
# its top across the replicas) and 8 (every level across replicas, one micro-batch each). 4 is
# another split of the same tree between inside and across, as 2 is, so it is not run.
REPLICAS = (1, 2, 8)
_TRAIN = mirrax.data.load_digits()[0]


def digits_data(n: int):
    """The first `n` training digits: images (n, 8, 8, 1) float32 and labels (n,) int32."""
    return _TRAIN[0][:n], _TRAIN[1][:n]


def _invariant(replicas: int, micro_batches: int = 8):
    if replicas == 1:
        return mirrax.OneDeviceStrategy("cpu:0", replica_invariant=True, micro_batches=micro_batches)
    return mirrax.MirroredStrategy(
        jax.devices()[:replicas], replica_invariant=True, micro_batches=micro_batches
    )


class CNN(nnx.Module):
    """The tutorial's CNN, small: conv -> relu -> dropout -> dense, for 8x8 digits."""

    def __init__(self, rngs):
        self.conv = nnx.Conv(1, 8, (3, 3), rngs=rngs)
        self.dropout = nnx.Dropout(0.3, rngs=rngs)
        self.dense = nnx.Linear(8 * 64, 10, rngs=rngs)

    def __call__(self, x):
        x = self.dropout(nnx.relu(self.conv(x)))
        return self.dense(x.reshape(x.shape[0], -1))


def _params(module) -> list:
    return [np.asarray(p) for p in jax.tree.leaves(nnx.state(module, nnx.Param))]


def _assert_same_bits(results: dict):
    """Every entry equals the first one's, bit for bit (histories, weights, outputs)."""
    (first, reference), *rest = results.items()
    for name, result in rest:
        for key, value in reference.items():
            if isinstance(value, list) and value and isinstance(value[0], np.ndarray):
                assert len(result[key]) == len(value)
                for mine, theirs in zip(result[key], value):
                    assert np.array_equal(mine, theirs), (name, key, first)
            elif isinstance(value, np.ndarray):
                assert np.array_equal(result[key], value), (name, key, first)
            else:
                assert result[key] == value, (name, key, first)


def _fit_run(strategy, **compile_kwargs):
    # 300 digits: 240 train (3 batches of 64 and a partial one of 48), 60 validation.
    x, y = digits_data(300)
    with strategy.scope():
        model = mirrax.Model(CNN(nnx.Rngs(0, dropout=1)))
        model.compile(
            optimizer="adam",
            loss=mirrax.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
            **compile_kwargs,
        )
    history = model.fit(x, y, batch_size=64, epochs=2, validation_split=0.2, shuffle=True, verbose=0)
    evaluation = model.evaluate(x[:72], y[:72], batch_size=32, verbose=0, return_dict=True)
    predictions = model.predict(x[:40], batch_size=32, verbose=0)
    return {
        "history": history.history,
        "weights": model.get_weights(),
        "evaluate": evaluation,
        "predictions": predictions,
    }


@pytest.mark.slow
def test_fit_evaluate_predict_are_the_same_bits_on_1_2_and_8_replicas():
    results = {r: _fit_run(_invariant(r)) for r in REPLICAS}
    # 240 training examples a pass: the partial last batch (48 of 64) counts its 48.
    assert len(results[1]["history"]["loss"]) == 2
    assert np.shape(results[1]["predictions"]) == (40, 10)
    _assert_same_bits(results)


@pytest.mark.slow
def test_steps_per_execution_composes_with_the_mode():
    # Two steps per call in fit, its validation, evaluate (batches 32, 32 | 8) and predict
    # (32 and the partial 8 in one call).
    _assert_same_bits({r: _fit_run(_invariant(r), steps_per_execution=2) for r in (1, 4)})


@pytest.mark.slow
def test_gradient_accumulation_composes_with_the_mode():
    # optax.MultiSteps divides (a running mean of gradients): with XLA's algebraic simplifier
    # on, one replica rewrote those divisions unlike two; the mode turns it off on CPU.
    _assert_same_bits(
        {r: _fit_run(_invariant(r), steps_per_execution=2, gradient_accumulation_steps=2) for r in (1, 8)}
    )


@pytest.mark.slow
def test_a_loss_on_probabilities_is_the_same_bits_on_1_and_2_replicas():
    # Keras's default cross-entropy takes probabilities and renormalizes them (y / sum(y)):
    # the division chain XLA's simplifier rewrote differently on one device than on two.
    x, y = digits_data(128)
    results = {}
    for r in (1, 2):
        with _invariant(r).scope():
            model = mirrax.Model(CNN(nnx.Rngs(0, dropout=1)))
            model.compile("adam", "sparse_categorical_crossentropy")
        history = model.fit(x, y, batch_size=64, epochs=1, verbose=0)
        results[r] = {"history": history.history, "weights": model.get_weights()}
    _assert_same_bits(results)


def _custom_loop(strategy, global_batch=64):
    x, y = digits_data(300)  # 4 batches of 64 and a partial one of 44
    with strategy.scope():
        model = CNN(nnx.Rngs(0, dropout=1))
        optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    def loss_fn(model, batch):
        images, labels = batch
        per_example = optax.softmax_cross_entropy_with_integer_labels(model(images), labels)
        return mirrax.compute_average_loss(per_example, global_batch_size=global_batch)

    def step(model, optimizer, batch):
        loss, grads = mirrax.value_and_grad(loss_fn)(model, batch)
        optimizer.update(model, grads)
        return loss

    dataset = strategy.experimental_distribute_dataset(
        [(x[i : i + global_batch], y[i : i + global_batch]) for i in range(0, 300, global_batch)]
    )
    losses = [
        np.asarray(strategy.reduce("sum", strategy.run(step, args=(model, optimizer, b)))) for b in dataset
    ]
    return {"losses": losses, "params": _params(model)}


@pytest.mark.slow
def test_custom_loop_is_the_same_bits_on_1_2_and_8_replicas():
    results = {r: _custom_loop(_invariant(r)) for r in REPLICAS}
    assert len(results[1]["losses"]) == 5
    _assert_same_bits(results)


@pytest.mark.slow
def test_default_mode_agrees_with_the_mode_to_float_rounding_only():
    # Same data, same split of the partial batch aside: the default mode sums each replica's
    # whole shard at once, so its first step agrees with the mode's to rounding (float32,
    # about 1e-6 relative), not bit for bit; dropout masks differ (keyed by replica id there).
    strategy = mirrax.MirroredStrategy(jax.devices()[:1])
    x, y = digits_data(64)

    def first_loss(strategy):
        with strategy.scope():
            model = CNN(nnx.Rngs(0, dropout=1))
        model.eval()  # no dropout: the same function in both modes

        def loss(model, batch):
            per_example = optax.softmax_cross_entropy_with_integer_labels(model(batch[0]), batch[1])
            return mirrax.compute_average_loss(per_example)

        batch = next(iter(strategy.experimental_distribute_dataset([(x, y)])))
        value = strategy.run(lambda m, b: mirrax.value_and_grad(loss)(m, b)[0], args=(model, batch))
        return float(strategy.reduce("sum", value))

    default, exact = first_loss(strategy), first_loss(_invariant(1))
    assert abs(default - exact) <= 1e-6 * abs(default)


@pytest.mark.slow
def test_checkpoint_and_resume_in_the_mode_equals_an_uninterrupted_run(tmp_path):
    x, y = digits_data(256)

    def trained(epochs_before_restart):
        strategy = _invariant(4)
        with strategy.scope():
            model = mirrax.Model(CNN(nnx.Rngs(0, dropout=1)))
            model.compile(
                optimizer="adam", loss=mirrax.losses.SparseCategoricalCrossentropy(from_logits=True)
            )
        callbacks = [mirrax.callbacks.BackupAndRestore(str(tmp_path / "backup"))]
        if epochs_before_restart is None:
            return model.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0), model
        model.fit(
            x,
            y,
            batch_size=64,
            epochs=epochs_before_restart,
            shuffle=False,
            verbose=0,
            callbacks=[_KeepBackup(callbacks[0])],
        )
        strategy = _invariant(2)  # resumed on another replica count
        with strategy.scope():
            resumed = mirrax.Model(CNN(nnx.Rngs(0, dropout=1)))
            resumed.compile(
                optimizer="adam", loss=mirrax.losses.SparseCategoricalCrossentropy(from_logits=True)
            )
        return resumed.fit(
            x, y, batch_size=64, epochs=2, shuffle=False, verbose=0, callbacks=callbacks
        ), resumed

    straight_history, straight = trained(None)
    resumed_history, resumed = trained(1)
    assert resumed_history.history["loss"][-1] == straight_history.history["loss"][-1]
    for a, b in zip(resumed.get_weights(), straight.get_weights()):
        assert np.array_equal(a, b)


class _KeepBackup(mirrax.callbacks.Callback):
    """BackupAndRestore that keeps its backup at the end of training (as a crash would)."""

    def __init__(self, backup):
        super().__init__()
        self.backup = backup

    def set_model(self, model):
        super().set_model(model)
        self.backup.set_model(model)

    def on_train_begin(self, logs=None):
        self.backup.on_train_begin(logs)

    def on_epoch_end(self, epoch, logs=None):
        self.backup.on_epoch_end(epoch, logs)


# -- the tree sum itself ------------------------------------------------------------------------


@pytest.mark.slow
def test_all_reduce_and_reduce_follow_the_pairwise_tree():
    # Values chosen so that the order of float32 additions shows. With e = 2^-24: 1 + e rounds
    # to 1 (a tie, to even), e + e = 2^-23 is exact and 1 + 2^-23 is representable. Eight
    # values, one per micro-batch: the tree ((v0+v1)+(v2+v3)) + ((v4+v5)+(v6+v7)) is
    # (1 + 2^-23) + (1 + 2^-23) = 2 + 2^-22, while adding left to right rounds every e away: 2.
    e = np.float32(2.0**-24)
    values = np.array([1, e, e, e, 1, e, e, e], np.float32)
    tree = ((values[0] + values[1]) + (values[2] + values[3])) + (
        (values[4] + values[5]) + (values[6] + values[7])
    )
    left_to_right = np.float32(0)
    for v in values:
        left_to_right = left_to_right + v
    assert tree == np.float32(2 + 2.0**-22) and left_to_right == np.float32(2.0)
    sums = {}
    for r in REPLICAS:
        strategy = _invariant(r)
        batch = next(iter(strategy.experimental_distribute_dataset([values[:, None]])))

        def step(b):
            ctx = mirrax.get_replica_context()
            local = b[:, 0]  # this replica's 8 / r values
            # The replica's own pairwise sum over its micro-batches, then across replicas.
            return ctx.all_reduce("sum", exact_sums.pairwise_sum(local.reshape(-1, 1))[0])

        out = strategy.run(step, args=(batch,))
        sums[r] = (
            np.asarray(strategy.experimental_local_results(out)[0]),
            np.asarray(strategy.reduce("sum", batch, axis=0))[0],
        )
    assert all(np.array_equal(s, (tree, tree)) for s in sums.values()), sums


# -- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "micro_batches, message",
    [
        (
            6,
            "micro_batches must be a power of two (1, 2, 4, 8, 16, ...), so that one pairwise "
            "summation tree covers it at every replica count; received 6. Use 4 or 8.",
        ),
        (
            0,
            "micro_batches must be a power of two (1, 2, 4, 8, 16, ...), so that one pairwise "
            "summation tree covers it at every replica count; received 0. Use a power of two >= 1, "
            "e.g. 8 (the default).",
        ),
    ],
)
def test_micro_batches_not_a_power_of_two_is_refused(micro_batches, message):
    with pytest.raises(errors.InvalidArgumentError, match=re.escape(message)):
        mirrax.MirroredStrategy(jax.devices()[:2], replica_invariant=True, micro_batches=micro_batches)


def test_wrong_types_are_refused():
    with pytest.raises(
        errors.InvalidArgumentTypeError,
        match=re.escape("replica_invariant must be True or False; received str 'yes'"),
    ):
        mirrax.MirroredStrategy(jax.devices()[:2], replica_invariant="yes")
    with pytest.raises(
        errors.InvalidArgumentTypeError,
        match=re.escape(
            "micro_batches must be an int, a power of two (1, 2, 4, 8, 16, ...); received 8.0 of type float"
        ),
    ):
        mirrax.OneDeviceStrategy("cpu:0", replica_invariant=True, micro_batches=8.0)


def test_a_replica_count_that_does_not_divide_micro_batches_is_refused():
    with pytest.raises(
        errors.InvalidArgumentError,
        match=re.escape(
            "MirroredStrategy: replica_invariant=True cuts every global batch into "
            "micro_batches=8 micro-batches held in equal runs by the replicas, but 3 replicas "
            "do not divide 8. Use a replica count that divides it (1, 2, 4, 8; e.g. "
            "devices=jax.local_devices()[:2]), 3 is not a power of two, so it divides no "
            "micro_batches; use 2 or 4 devices."
        ),
    ):
        mirrax.MirroredStrategy(jax.devices()[:3], replica_invariant=True)
    with pytest.raises(
        errors.InvalidArgumentError,
        match=re.escape(
            "but 8 replicas do not divide 4. Use a replica count that divides it (1, 2, 4; e.g. "
            "devices=jax.local_devices()[:4]), or micro_batches=8 (or another power of two >= "
            "8)."
        ),
    ):
        mirrax.MirroredStrategy(jax.devices()[:8], replica_invariant=True, micro_batches=4)


def test_a_global_batch_that_micro_batches_does_not_divide_is_refused():
    strategy = _invariant(2)
    dataset = strategy.experimental_distribute_dataset([np.zeros((60, 1), np.float32)])
    with pytest.raises(
        errors.InvalidBatchError,
        match=re.escape(
            "experimental_distribute_dataset: replica_invariant=True cuts every global batch "
            "into micro_batches=8 equal micro-batches, but the first global batch has 60 "
            "examples, which 8 does not divide. Use a global batch size that is a multiple of "
            "8 (e.g. 56 or 64)"
        ),
    ):
        next(iter(dataset))
    x, y = digits_data(100)
    with strategy.scope():
        model = mirrax.Model(CNN(nnx.Rngs(0, dropout=1)))
        model.compile("adam", mirrax.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(errors.InvalidBatchError, match="the first global batch has 20 examples"):
        model.fit(x, y, batch_size=20, verbose=0)


def test_a_batch_larger_than_the_first_is_refused():
    strategy = _invariant(2)
    dataset = strategy.experimental_distribute_dataset(
        [np.zeros((16, 1), np.float32), np.zeros((32, 1), np.float32)]
    )
    iterator = iter(dataset)
    next(iterator)
    with pytest.raises(
        errors.InvalidBatchError,
        match=re.escape(
            "a global batch of 32 examples is larger than the first batch (16), which fixed "
            "the micro-batch size at 2"
        ),
    ):
        next(iterator)


def test_a_loss_that_reads_the_batch_from_a_closure_is_refused():
    strategy = _invariant(2)
    x, y = digits_data(16)
    with strategy.scope():
        model = CNN(nnx.Rngs(0, dropout=1))
    batch = next(iter(strategy.experimental_distribute_dataset([(x, y)])))

    def step(model, batch):
        loss = lambda m: m(batch[0]).sum()  # noqa: E731  (the batch from the closure)
        return mirrax.value_and_grad(loss)(model)[0]

    with pytest.raises(
        errors.InvalidBatchError,
        match=re.escape(
            "the arguments after the module hold no array (a loss that reads the batch from a "
            "closure cannot be split)"
        ),
    ):
        strategy.run(step, args=(model, batch))


def test_synchronized_batch_norm_is_refused_and_all_reduce_dtype_too():
    strategy = _invariant(2)
    x = np.ones((16, 3), np.float32)

    class Net(nnx.Module):
        def __init__(self):
            self.norm = nnx.BatchNorm(3, axis_name=mirrax.REPLICA_AXIS, rngs=nnx.Rngs(0))

        def __call__(self, x):
            return self.norm(x)

    net = Net()
    batch = next(iter(strategy.experimental_distribute_dataset([x])))
    with pytest.raises(
        errors.UnsupportedArgumentError,
        match=re.escape("BatchNorm norm synchronizes its statistics over the replicas (axis_name='replica')"),
    ):
        strategy.run(lambda m, b: mirrax.value_and_grad(lambda m, b: m(b).sum())(m, b)[0], args=(net, batch))
    with pytest.raises(
        errors.UnsupportedArgumentError, match="all_reduce_dtype is not supported with replica_invariant=True"
    ):
        strategy.run(
            lambda m, b: mirrax.value_and_grad(lambda m, b: m(b).sum(), all_reduce_dtype="bfloat16")(m, b)[0],
            args=(net, batch),
        )


# -- several processes ------------------------------------------------------------------------------


@pytest.mark.subprocess
def test_launch_2x2_equals_one_process_with_4_devices_and_4_processes_with_1(tmp_path):
    # `mirrax launch --nproc 2 --cpu-devices 2` (Gloo on loopback) against the harness's
    # 1 process x 4 devices and 4 processes x 1 device: the same bits everywhere.
    out = tmp_path / "launch2x2"
    out.mkdir()
    env = dict(os.environ, PYTHONPATH=str(harness.ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("XLA_FLAGS", None)
    env.pop("TF_CONFIG", None)
    launched = subprocess.run(
        [
            sys.executable,
            "-m",
            "mirrax._src.cli.main",
            "launch",
            "--nproc",
            "2",
            "--cpu-devices",
            "2",
            "--",
            sys.executable,
            "-m",
            "tests.multiworker.scenarios",
            "invariant",
            str(out),
            "auto",
        ],
        cwd=harness.ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert launched.returncode == 0, launched.stdout[-3000:] + launched.stderr[-3000:]
    two_by_two = [json.loads((out / f"{i}.json").read_text()) for i in range(2)]
    one_by_four = harness.run("invariant", tmp_path / "1x4", num_workers=1, cpu_devices=4)
    four_by_one = harness.run("invariant", tmp_path / "4x1", num_workers=4, cpu_devices=1)
    reports = two_by_two + one_by_four + four_by_one
    assert [r["layout"] for r in reports] == [[2, 2]] * 2 + [[1, 4]] + [[4, 1]] * 4
    reference = {k: v for k, v in one_by_four[0].items() if k not in ("layout", "launch_rank")}
    # 100 examples in batches of 32: 4 steps of the custom loop (the last of 4 examples).
    assert len(reference["custom_losses"]) == 4
    for report in reports:
        assert {k: v for k, v in report.items() if k not in ("layout", "launch_rank")} == reference


def test_a_batch_that_is_the_same_on_every_replica_is_refused():
    strategy = _invariant(2)
    x, y = digits_data(16)
    with strategy.scope():
        model = CNN(nnx.Rngs(0, dropout=1))

    def step(model, images):
        return mirrax.value_and_grad(lambda m, b: m(b).sum())(model, images)[0]

    with pytest.raises(
        errors.InvalidBatchError,
        match=re.escape(
            "an array of shape (16, 8, 8, 1) after the module is the same on every replica (it "
            "was passed to strategy.run as a plain array, not a distributed batch)"
        ),
    ):
        strategy.run(step, args=(model, x))


class BatchNormNet(nnx.Module):
    """dense -> BatchNorm (per micro-batch in this mode) -> relu -> dropout -> dense."""

    def __init__(self, rngs):
        self.dense1 = nnx.Linear(64, 32, rngs=rngs)
        self.norm = nnx.BatchNorm(32, rngs=rngs)
        self.dropout = nnx.Dropout(0.2, rngs=rngs)
        self.dense2 = nnx.Linear(32, 10, rngs=rngs)

    def __call__(self, x):
        x = x.reshape(x.shape[0], -1)
        return self.dense2(self.dropout(nnx.relu(self.norm(self.dense1(x)))))


@pytest.mark.slow
def test_batch_norm_statistics_are_the_same_bits_on_every_replica_count():
    # Running mean and variance are the mean over the 8 micro-batches of their updates, in the
    # tree; a partial last batch (232 = 3 x 64 + 40) normalizes its padded micro-batches too.
    x, y = digits_data(232)
    results = {}
    for r in REPLICAS:
        strategy = _invariant(r)
        with strategy.scope():
            model = mirrax.Model(BatchNormNet(nnx.Rngs(0, dropout=1)))
            model.compile("adam", mirrax.losses.SparseCategoricalCrossentropy(from_logits=True))
        history = model.fit(x, y, batch_size=64, epochs=2, verbose=0)
        stats = [np.asarray(v) for v in jax.tree.leaves(nnx.state(model.module, nnx.BatchStat))]
        results[r] = {"history": history.history, "weights": model.get_weights(), "batch_stats": stats}
    assert not np.array_equal(results[1]["batch_stats"][0], np.zeros(32, np.float32))
    _assert_same_bits(results)


@pytest.mark.slow
def test_a_metric_updated_outside_the_loss_counts_every_replica_once():
    # Each replica updates the metric with its own shard (outside mirrax.value_and_grad), so
    # its total and its count are both summed over the replicas, as TF: the accuracy is the
    # fraction of the 64 examples predicted right, an exact ratio of integers.
    x, y = digits_data(64)
    reference = None
    for r in REPLICAS:
        strategy = _invariant(r)
        with strategy.scope():
            model = CNN(nnx.Rngs(0, dropout=1))
            accuracy = nnx.metrics.Accuracy()
        model.eval()

        def loss_fn(model, batch):
            logits = model(batch[0])
            per_example = optax.softmax_cross_entropy_with_integer_labels(logits, batch[1])
            return mirrax.compute_average_loss(per_example), logits

        def step(model, accuracy, batch):
            (_, logits), _ = mirrax.value_and_grad(loss_fn, has_aux=True)(model, batch)
            accuracy.update(logits=logits, labels=batch[1])

        batch = next(iter(strategy.experimental_distribute_dataset([(x, y)])))
        strategy.run(step, args=(model, accuracy, batch))
        if reference is None:
            logits = np.asarray(model(x))
            reference = np.float32((logits.argmax(-1) == y).sum()) / np.float32(64)
        assert float(accuracy.compute()) == reference, r


@pytest.mark.slow
def test_a_metric_passed_to_the_loss_is_combined_over_micro_batches_bit_for_bit():
    x, y = digits_data(64)
    results = {}
    for r in REPLICAS:
        strategy = _invariant(r)
        with strategy.scope():
            model = CNN(nnx.Rngs(0, dropout=1))
            optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
            mean_loss = nnx.metrics.Average()

        def loss_fn(model, mean_loss, batch):
            per_example = optax.softmax_cross_entropy_with_integer_labels(model(batch[0]), batch[1])
            mean_loss.update(values=per_example)
            return mirrax.compute_average_loss(per_example)

        def step(model, optimizer, mean_loss, batch):
            _, grads = mirrax.value_and_grad(loss_fn)(model, mean_loss, batch)
            optimizer.update(model, grads)

        batch = next(iter(strategy.experimental_distribute_dataset([(x, y)])))
        strategy.run(step, args=(model, optimizer, mean_loss, batch))
        results[r] = {"mean_loss": np.asarray(mean_loss.compute()), "params": _params(model)}
    assert int(nnx.state(mean_loss)["count"][...]) == 64
    _assert_same_bits(results)


def test_gradients_taken_without_mirrax_value_and_grad_warn():
    strategy = _invariant(2)
    x, y = digits_data(16)
    with strategy.scope():
        model = CNN(nnx.Rngs(0, dropout=1))
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    batch = next(iter(strategy.experimental_distribute_dataset([(x, y)])))

    def step(model, optimizer, batch):
        def loss_fn(model):
            per_example = optax.softmax_cross_entropy_with_integer_labels(model(batch[0]), batch[1])
            return mirrax.compute_average_loss(per_example)

        _, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)

    with pytest.warns(
        UserWarning,
        match=re.escape(
            "changed parameters on a strategy with replica_invariant=True without computing "
            "gradients through mirrax.value_and_grad(loss_fn)(model, batch)"
        ),
    ):
        strategy.run(step, args=(model, optimizer, batch))


def test_synchronized_batch_norm_is_refused_at_compile_and_per_replica_datasets_warn():
    strategy = _invariant(2)

    class Net(nnx.Module):
        def __init__(self):
            self.norm = nnx.BatchNorm(3, axis_name=mirrax.REPLICA_AXIS, rngs=nnx.Rngs(0))

        def __call__(self, x):
            return self.norm(x)

    with strategy.scope():
        model = mirrax.Model(Net())
    with pytest.raises(
        errors.UnsupportedArgumentError,
        match=re.escape("compile: BatchNorm norm synchronizes its statistics"),
    ):
        model.compile("adam", "mse")
    with pytest.warns(
        UserWarning,
        match=re.escape(
            "distribute_datasets_from_function on a strategy with replica_invariant=True: its "
            "batches are per replica"
        ),
    ):
        strategy.distribute_datasets_from_function(lambda ctx: [np.zeros((4, 3), np.float32)])
