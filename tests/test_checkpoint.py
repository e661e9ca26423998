"""mirrax.Checkpoint / CheckpointManager: save once under any strategy, restore under any other."""

import os

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import mirrax
from tests.conftest import mirrored, named_strategy
from tests.test_run import MLP, mlp_data, sgd_step


def _make(strategy, w1, w2):
    with strategy.scope():
        model = MLP(w1, w2)
        optimizer = nnx.Optimizer(model, optax.adam(0.01), wrt=nnx.Param)
    return model, optimizer


def _train(strategy, model, optimizer, steps):
    _, _, x, y = mlp_data()
    batch = next(iter(strategy.experimental_distribute_dataset((x, y))))
    for _ in range(steps):
        strategy.run(sgd_step, args=(model, optimizer, batch))


def _leaves(*objects):
    return [np.asarray(a) for obj in objects for a in jax.tree.leaves(nnx.state(obj))]


def _dir_bytes(path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


@pytest.mark.slow
def test_adam_state_saved_under_4_replicas_restores_exactly_under_1_2_8_and_one_device(tmp_path):
    w1, w2, _, _ = mlp_data()
    four = mirrored(4)
    model, optimizer = _make(four, w1, w2)
    _train(four, model, optimizer, steps=3)
    path = mirrax.Checkpoint(model=model, optimizer=optimizer, step=3).write(tmp_path / "ckpt")
    saved = _leaves(model, optimizer)
    _train(four, model, optimizer, steps=1)
    after_step_4 = _leaves(model)

    for name in ("Mirrored1CPU", "Mirrored2CPU", "Mirrored8CPU", "OneDevice"):
        strategy = named_strategy(name)
        # Different initial weights, so only the restore can make them equal.
        model2, optimizer2 = _make(strategy, np.zeros_like(w1), np.ones_like(w2))
        _train(strategy, model2, optimizer2, steps=1)  # its state now lives on its replicas
        placements = [a.sharding for a in jax.tree.leaves(nnx.state((model2, optimizer2)))]
        ckpt = mirrax.Checkpoint(model=model2, optimizer=optimizer2, step=0)
        ckpt.restore(path).assert_consumed()

        assert ckpt.step == 3
        assert int(optimizer2.step[...]) == 3  # not 1: the restore replaced it
        assert int(optimizer2.opt_state[0].count[...]) == 3  # Adam's bias-correction count
        for got, want in zip(_leaves(model2, optimizer2), saved, strict=True):
            np.testing.assert_array_equal(got, want)  # weights, mu, nu: bit for bit
        for a, placement in zip(jax.tree.leaves(nnx.state((model2, optimizer2))), placements):
            assert a.sharding == placement, name  # on the target strategy's devices
            assert len(a.sharding.device_set) == strategy.num_replicas_in_sync

        _train(strategy, model2, optimizer2, steps=1)
        for got, want in zip(_leaves(model2), after_step_4, strict=True):
            np.testing.assert_allclose(got, want, atol=1e-6)


@pytest.mark.slow
def test_checkpoint_size_does_not_grow_with_replicas(tmp_path):
    # 256 x 256 float32 kernel + 256 bias = 263,168 bytes of state; written once per replica,
    # 8 replicas would take about 2.1 MB.
    sizes = {}
    for replicas in (1, 8):
        with mirrored(replicas).scope():
            layer = nnx.Linear(256, 256, rngs=nnx.Rngs(0))
        mirrax.Checkpoint(layer=layer).write(tmp_path / str(replicas))
        sizes[replicas] = _dir_bytes(tmp_path / str(replicas))
    assert abs(sizes[8] - sizes[1]) < 4096, sizes  # metadata noise only
    assert sizes[1] < 2 * 263_168, sizes


@pytest.mark.slow
def test_model_step_counter_and_metric_round_trip_and_save_counter(tmp_path):
    with mirrored(2).scope():
        model = mirrax.Model(nnx.Linear(3, 1, rngs=nnx.Rngs(0)))
        model.compile(optimizer="adam", loss="mse")
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    y = np.ones((4, 1), np.float32)
    model.fit(x, y, batch_size=2, epochs=1, verbose=0)
    metric = mirrax.metrics.Mean()
    metric.update_state(np.array([1.0, 2.0, 6.0], np.float32))
    ckpt = mirrax.Checkpoint(model=model, metric=metric, epoch=7)
    path = ckpt.save(tmp_path / "c")
    assert ckpt.save_counter == 1
    saved = _leaves(model.module, model.optimizer.nnx_optimizer)

    with mirrored(1).scope():
        fresh = mirrax.Model(nnx.Linear(3, 1, rngs=nnx.Rngs(5)))
        fresh.compile(optimizer="adam", loss="mse")
    fresh_metric = mirrax.metrics.Mean()
    restored = mirrax.Checkpoint(model=fresh, metric=fresh_metric, epoch=0)
    restored.restore(path).assert_consumed()
    assert restored.epoch == 7 and restored.save_counter == 1
    assert fresh.optimizer.iterations == 2  # 4 examples / batch 2
    assert float(fresh_metric.result()) == pytest.approx(3.0)  # (1 + 2 + 6) / 3
    for got, want in zip(_leaves(fresh.module, fresh.optimizer.nnx_optimizer), saved, strict=True):
        np.testing.assert_array_equal(got, want)

    # read() restores the objects but not save_counter; a partial match is reported.
    weights_only = mirrax.Checkpoint(model=mirrax.Model(nnx.Linear(3, 1, rngs=nnx.Rngs(9))))
    status = weights_only.read(path)
    assert weights_only.save_counter == 0
    np.testing.assert_array_equal(np.asarray(weights_only.model.module.kernel[...]), saved[1])
    with pytest.raises(AssertionError, match=r"model.optimizer"):
        status.assert_consumed()
    status.expect_partial()


def test_mismatched_structure_lists_paths_and_shapes(tmp_path):
    path = mirrax.Checkpoint(net=nnx.Linear(4, 3, rngs=nnx.Rngs(0))).write(tmp_path / "c")
    other = nnx.Linear(4, 5, use_bias=False, rngs=nnx.Rngs(0))
    kernel = np.asarray(other.kernel[...])
    with pytest.raises(ValueError) as info:
        mirrax.Checkpoint(net=other).restore(path)
    message = str(info.value)
    assert "net['kernel'] has shape (4, 3) in the checkpoint, (4, 5) in the model" in message
    assert "net['bias'] is in the checkpoint but not in the model" in message
    np.testing.assert_array_equal(np.asarray(other.kernel[...]), kernel)  # left untouched


def test_dtype_difference_is_named(tmp_path):
    path = mirrax.Checkpoint(net=nnx.Linear(2, 2, rngs=nnx.Rngs(0))).write(tmp_path / "c")
    half = nnx.Linear(2, 2, param_dtype=np.float16, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"net\['kernel'\] has dtype float32 in the checkpoint, float16"):
        mirrax.Checkpoint(net=half).restore(path)


def test_missing_and_empty_directories(tmp_path):
    ckpt = mirrax.Checkpoint(net=nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
    with pytest.raises(mirrax.errors.MissingCheckpointError, match="no checkpoint directory"):
        ckpt.restore(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(
        mirrax.errors.InvalidCheckpointError,
        match="not a complete mirrax checkpoint: it has no _CHECKPOINT_METADATA "
        r"\(found an empty directory\)",
    ):
        ckpt.restore(tmp_path / "empty")


def test_untrackable_object_is_refused():
    with pytest.raises(TypeError, match="cannot track data=str"):
        mirrax.Checkpoint(data="hello")


def test_manager_keeps_max_to_keep_and_points_to_newest(tmp_path):
    counter = nnx.Variable(np.zeros((), np.float32))
    ckpt = mirrax.Checkpoint(counter=counter)
    manager = mirrax.CheckpointManager(ckpt, tmp_path / "run", max_to_keep=2)
    assert manager.latest_checkpoint is None
    for i in range(1, 5):
        counter[...] = np.float32(i)
        assert manager.save() == str(tmp_path / "run" / str(i))  # numbered by save_counter
    assert manager.checkpoints == [str(tmp_path / "run" / "3"), str(tmp_path / "run" / "4")]
    assert sorted(os.listdir(tmp_path / "run")) == ["3", "4"]
    assert manager.latest_checkpoint == str(tmp_path / "run" / "4")

    counter[...] = np.float32(0)
    fresh = mirrax.Checkpoint(counter=counter)
    again = mirrax.CheckpointManager(fresh, tmp_path / "run", max_to_keep=2)
    assert again.restore_or_initialize() == str(tmp_path / "run" / "4")
    assert float(counter[...]) == 4.0 and fresh.save_counter == 4


def test_manager_interval_and_initialize(tmp_path):
    called = []
    ckpt = mirrax.Checkpoint(step=0)
    manager = mirrax.CheckpointManager(
        ckpt, tmp_path / "run", checkpoint_interval=10, init_fn=lambda: called.append(1)
    )
    assert manager.restore_or_initialize() is None and called == [1]
    assert manager.save(checkpoint_number=10) is not None
    assert manager.save(checkpoint_number=15) is None  # 15 - 10 < 10
    assert manager.save(checkpoint_number=20) == str(tmp_path / "run" / "20")


# -- PRNG and batch-norm state (issue 11, defect 1) ---------------------------------------------


class RngNet(nnx.Module):
    """Dropout, BatchNorm and an `nnx.Rngs` with three streams, plus a bare key variable: the
    state a restore must bring back exactly (typed keys, stored as their key data, and each
    stream's count). `legacy` builds the keys with `jax.random.PRNGKey` (uint32 arrays; nnx
    wraps those it is given, the bare variable stays a uint32 array)."""

    def __init__(self, seed: int, legacy: bool = False, width: int = 4):
        key = jax.random.PRNGKey if legacy else jax.random.key
        rngs = nnx.Rngs(params=key(seed), dropout=key(seed + 100), noise=key(seed + 200))
        self.linear = nnx.Linear(2, width, rngs=rngs)
        self.bn = nnx.BatchNorm(width, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.head = nnx.Linear(width, 1, rngs=rngs)
        self.rngs = rngs
        self.raw_key = nnx.Variable(key(seed + 300))

    def __call__(self, x):
        # Draws from the "noise" stream (advancing its count) without changing the output.
        x = x + 0.0 * jax.random.normal(self.rngs.noise(), x.shape)
        return self.head(self.drop(self.bn(self.linear(x))))


def rng_state(module) -> dict:
    """Every leaf of the module's state as NumPy, typed keys as their key data."""
    flat = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(module)))[0]
    return {
        jax.tree_util.keystr(k): np.asarray(
            jax.random.key_data(v) if jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key) else v
        )
        for k, v in flat
    }


def assert_same_state(a, b):
    sa, sb = rng_state(a), rng_state(b)
    assert sorted(sa) == sorted(sb)
    for key in sa:
        np.testing.assert_array_equal(sa[key], sb[key], err_msg=key)  # bit for bit


RNG_X = np.linspace(-1.0, 1.0, 16, dtype=np.float32).reshape(8, 2)


def used_rng_net(seed: int, legacy: bool) -> RngNet:
    """A net after two training-mode calls: counts 2, batch statistics moved off 0 / 1."""
    net = RngNet(seed, legacy)
    net.train()
    net(RNG_X)
    net(RNG_X)
    return net


@pytest.mark.slow
@pytest.mark.parametrize("legacy", [False, True], ids=["typed_keys", "legacy_keys"])
@pytest.mark.parametrize("how", ["restore", "read"])
def test_dropout_batchnorm_and_rngs_state_restores_exactly(tmp_path, legacy, how):
    saved = used_rng_net(0, legacy)
    path = mirrax.Checkpoint(net=saved).write(tmp_path / "ckpt")
    target = RngNet(1, legacy)  # other weights, other keys, counts 0
    getattr(mirrax.Checkpoint(net=target), how)(path).assert_consumed()
    assert_same_state(target, saved)
    counts = rng_state(target)
    # Two calls: each drew once from "noise" and once from the dropout stream.
    assert int(counts["['rngs']['noise']['count']"]) == 2
    assert int(counts["['drop']['rngs']['count']"]) == 2
    # The next training-mode call draws the same dropout mask and the same noise.
    saved.train()
    target.train()
    np.testing.assert_array_equal(np.asarray(target(RNG_X)), np.asarray(saved(RNG_X)))


def test_typed_key_values_and_variables_restore_exactly(tmp_path):
    key, var = jax.random.key(7), nnx.Variable(jax.random.key(8))
    path = mirrax.Checkpoint(key=key, var=var).write(tmp_path / "ckpt")
    ckpt = mirrax.Checkpoint(key=jax.random.key(0), var=nnx.Variable(jax.random.key(0)))
    ckpt.restore(path).assert_consumed()
    assert jax.dtypes.issubdtype(ckpt.key.dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(jax.random.key_data(ckpt.key), jax.random.key_data(key))
    np.testing.assert_array_equal(jax.random.key_data(ckpt.var[...]), jax.random.key_data(var[...]))


def test_rng_state_saved_under_4_replicas_restores_under_one_device(tmp_path):
    with mirrored(4).scope():
        saved = used_rng_net(0, legacy=False)
    path = mirrax.Checkpoint(net=saved).write(tmp_path / "ckpt")
    with named_strategy("OneDevice").scope():
        target = RngNet(1)
    mirrax.Checkpoint(net=target).restore(path).assert_consumed()
    assert_same_state(target, saved)


@pytest.mark.parametrize("legacy", [False, True], ids=["typed_keys", "legacy_keys"])
def test_save_weights_and_load_weights_keep_rng_and_batchnorm_state(tmp_path, legacy):
    saved = used_rng_net(0, legacy)
    mirrax.Model(saved).save_weights(tmp_path / "w")
    target = RngNet(1, legacy)
    mirrax.Model(target).load_weights(tmp_path / "w")
    assert_same_state(target, saved)


# -- load_weights on a full checkpoint (issue 11, defect 8) -------------------------------------


def test_load_weights_reads_the_module_of_a_full_checkpoint(tmp_path):
    saved = mirrax.Model(used_rng_net(0, legacy=False))
    saved.compile(optax.adam(0.1), loss="mse")
    path = mirrax.Checkpoint(model=saved).write(tmp_path / "full")  # model.module, model.optimizer
    target = mirrax.Model(RngNet(1))
    target.load_weights(path)  # was: AssertionError "... has nothing for ['weights']"
    assert_same_state(target.module, saved.module)


@pytest.mark.slow
def test_load_weights_names_the_restoring_call_for_a_checkpoint_without_a_model(tmp_path):
    path = mirrax.Checkpoint(net=RngNet(0), step=3).write(tmp_path / "other")
    with pytest.raises(
        mirrax.errors.IncompatibleCheckpointError,
        match=r"holds no single model's weights \(its items: \['net', "
        r"'step'\]\).*mirrax\.Checkpoint\(net=<the object saved>\)"
        r"\.restore\(",
    ):
        mirrax.Model(RngNet(1)).load_weights(path)
    with pytest.raises(
        mirrax.errors.IncompatibleCheckpointError,
        match=r"weights\['linear'\]\['kernel'\] has shape \(2, 4\) in the "
        r"checkpoint, \(2, 8\) in the model",
    ):
        mirrax.Model(RngNet(0)).save_weights(tmp_path / "w")
        mirrax.Model(RngNet(1, width=8)).load_weights(tmp_path / "w")


def test_a_save_never_replaces_a_file_or_a_directory_of_other_things(tmp_path, monkeypatch):
    (tmp_path / "notes.txt").write_text("keep")
    monkeypatch.chdir(tmp_path)
    # Before: abspath('') is the working directory, and Orbax's force=True deleted it.
    with pytest.raises(mirrax.errors.InvalidArgumentError, match="the path is empty"):
        mirrax.Checkpoint(step=0).write("")
    with pytest.raises(mirrax.errors.ExistingPathError, match="holds no checkpoint"):
        mirrax.Checkpoint(step=0).write(tmp_path)
    with pytest.raises(mirrax.errors.ExistingPathError, match="is a file"):
        mirrax.Model(RngNet(0)).save_weights(tmp_path / "notes.txt")
    assert (tmp_path / "notes.txt").read_text() == "keep"
    # An empty directory, or a damaged checkpoint, is replaced.
    (tmp_path / "empty").mkdir()
    mirrax.Checkpoint(step=0).write(tmp_path / "empty")
    path = mirrax.Checkpoint(step=1).write(tmp_path / "damaged")
    os.remove(os.path.join(path, "_CHECKPOINT_METADATA"))
    mirrax.Checkpoint(step=2).write(path)
    ckpt = mirrax.Checkpoint(step=0)
    ckpt.restore(path)
    assert ckpt.step == 2


def test_a_restore_that_matches_nothing_is_refused_and_changes_nothing(tmp_path):
    w1, w2, _, _ = mlp_data()
    strategy = mirrored(2)
    with strategy.scope():
        saved = mirrax.Model(MLP(w1, w2))
        target = mirrax.Model(MLP(w1 * 0.0, w2 * 0.0))
    saved.save_weights(tmp_path / "w")  # the item 'weights'
    ckpt = mirrax.Checkpoint(model=target)  # tracks 'model.module'
    with pytest.raises(
        mirrax.errors.IncompatibleCheckpointError,
        match=r"nothing this Checkpoint tracks \(\['model.module'\]\) is in the "
        r"checkpoint at .*, which holds \['weights'\]; nothing was restored.*"
        r"model.load_weights\(path\)",
    ):
        ckpt.restore(tmp_path / "w")
    assert ckpt.save_counter == 0
    assert all((leaf == 0).all() for leaf in _leaves(target.module))
    # A partial match is TF's status, unchanged: restored parts, the rest reported.
    mirrax.Checkpoint(weights=target.module, step=3).restore(tmp_path / "w")
    np.testing.assert_array_equal(np.asarray(target.module.l1.kernel[...]), w1)
