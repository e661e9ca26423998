"""ModelCheckpoint and BackupAndRestore driven by a real `Model.fit` (issue 4, tests 4-6).

The model is a 2 -> 1 linear layer trained with Adam on 5 examples and `shuffle=False`, so a
run is deterministic and a resumed run can be compared with an uninterrupted one; Adam's
moments make the comparison fail if the optimizer state were not restored. `iterations` is
`model.optimizer.iterations`, the number of optimizer steps applied.
"""

import os
import re
import warnings

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import mirrax
from mirrax.callbacks import BackupAndRestore, Callback, LambdaCallback, ModelCheckpoint
from tests.conftest import mirrored

X = np.arange(10, dtype=np.float32).reshape(5, 2) / 10.0
Y = X @ np.array([[1.0], [-2.0]], np.float32) + 0.5


def make_model(replicas: int = 1) -> mirrax.Model:
    with mirrored(replicas).scope():
        model = mirrax.Model(nnx.Linear(2, 1, rngs=nnx.Rngs(0)))
        model.compile(optax.adam(0.05), loss="mse")
    return model


def weights(model) -> list:
    return [np.asarray(w) for w in model.get_weights()]


class Interrupted(Exception):
    pass


class InterruptAt(Callback):
    """Raises `Interrupted` at the start of epoch `epoch` (or of its batch `batch`)."""

    def __init__(self, epoch: int, batch=None):
        super().__init__()
        self.epoch, self.batch = epoch, batch

    def on_epoch_begin(self, epoch, logs=None):
        self.current = epoch
        if epoch == self.epoch and self.batch is None:
            raise Interrupted

    def on_train_batch_begin(self, batch, logs=None):
        if self.current == self.epoch and batch == self.batch:
            raise Interrupted


class Recorder(Callback):
    """Records iterations and weights at train begin, and every (epoch, batch) trained."""

    def on_train_begin(self, logs=None):
        self.start_iterations = self.model.optimizer.iterations
        self.start_weights = weights(self.model)
        self.batches = []

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        self.batches.append((self.epoch, batch))


def fit(model, callbacks, batch_size=1, **kwargs):
    return model.fit(
        X, Y, batch_size=batch_size, epochs=10, shuffle=False, verbose=0, callbacks=callbacks, **kwargs
    )


def epoch_end_weights(model, into: dict):
    return LambdaCallback(on_epoch_end=lambda epoch, logs: into.__setitem__(epoch, weights(model)))


# -- BackupAndRestore --------------------------------------------------------------------------


@pytest.mark.slow
def test_backup_and_restore_resumes_after_the_last_completed_epoch(tmp_path):
    backup = str(tmp_path / "backup")
    reference = make_model()
    fit(reference, [])
    # Uninterrupted: 10 epochs x 5 steps (5 examples, batch 1) = 50 iterations.
    assert reference.optimizer.iterations == 50

    model = make_model()
    saved = {}
    with pytest.raises(Interrupted):
        fit(model, [BackupAndRestore(backup), epoch_end_weights(model, saved), InterruptAt(4)])
    # Epochs 0..3 ran: 4 x 5 = 20 iterations, backed up at the end of epoch index 3.
    assert model.optimizer.iterations == 20
    assert os.path.isdir(backup)

    resumed = make_model()  # a fresh process: initial weights, no optimizer state
    recorder = Recorder()
    history = fit(resumed, [BackupAndRestore(backup), recorder])
    assert recorder.start_iterations == 20
    for got, want in zip(recorder.start_weights, saved[3]):
        np.testing.assert_array_equal(got, want)
    # Epoch indices 4..9 ran: 6 epochs, 6 x 5 = 30 more steps, 20 + 30 = 50 iterations. The
    # history is the uninterrupted run's, epochs 0..3 restored from the backup (Keras 3's
    # History holds only the epochs the resumed fit ran: docs/training.md lists it).
    assert history.epoch == list(range(10))
    assert len(history.history["loss"]) == 10
    assert resumed.optimizer.iterations == 50
    for got, want in zip(weights(resumed), weights(reference)):
        np.testing.assert_allclose(got, want, atol=1e-6)
    # Success deletes the backup, so a third fit starts afresh and runs all 10 epochs.
    assert not os.path.exists(backup)
    third = make_model()
    history = fit(third, [BackupAndRestore(backup)])
    assert len(history.history["loss"]) == 10
    assert third.optimizer.iterations == 50


@pytest.mark.slow
def test_backup_and_restore_resumes_mid_epoch(tmp_path, capsys):
    backup = str(tmp_path / "backup")
    reference = make_model()
    fit(reference, [])

    model = make_model()
    with pytest.raises(Interrupted):
        fit(model, [BackupAndRestore(backup, save_freq=2), InterruptAt(2, batch=3)])
    # Epochs 0, 1 (10 steps) and batches 0..2 of epoch 2: 13 iterations. Backups every 2
    # batches, counted across epochs: the last after batch 12 = epoch 2, batches 0 and 1.
    assert model.optimizer.iterations == 13

    resumed = make_model()
    recorder = Recorder()
    capsys.readouterr()
    history = resumed.fit(
        X,
        Y,
        batch_size=1,
        epochs=10,
        shuffle=False,
        verbose=1,
        callbacks=[BackupAndRestore(backup, save_freq=2), recorder],
    )
    assert recorder.start_iterations == 12
    # Resumes at epoch 2, batch 2: 3 batches left in epoch 2, then 7 epochs x 5 = 35; 38 steps.
    assert recorder.batches[0] == (2, 2)
    assert len(recorder.batches) == 38
    assert resumed.optimizer.iterations == 12 + 38 == 50
    # Epochs 0 and 1 come from the backup's history: the uninterrupted run's record.
    assert history.epoch == list(range(10))
    for got, want in zip(weights(resumed), weights(reference)):
        np.testing.assert_allclose(got, want, atol=1e-6)
    # The bar counts steps within the epoch: every count is at most 5 (the partial epoch
    # ends at 5/5, never 13/5).
    counts = re.findall(r"^\s*(\d+)/(\d+) \[", capsys.readouterr().out, re.MULTILINE)
    assert len(counts) == 8
    assert all(int(step) <= int(target) == 5 for step, target in counts)
    assert not os.path.exists(backup)


@pytest.mark.slow
def test_backup_and_restore_under_two_replicas(tmp_path):
    backup = str(tmp_path / "backup")
    replicas = 2
    # Global batch 2 on 5 examples: ceil(5 / 2) = 3 steps per epoch (the last holds 1 example,
    # split 1|0 over the 2 replicas).
    steps = -(-5 // 2)
    reference = make_model(replicas)
    fit(reference, [], batch_size=2)
    assert reference.optimizer.iterations == 10 * steps == 30

    model = make_model(replicas)
    with pytest.raises(Interrupted):
        fit(model, [BackupAndRestore(backup), InterruptAt(4)], batch_size=2)

    resumed = make_model(replicas)
    recorder = Recorder()
    history = fit(resumed, [BackupAndRestore(backup), recorder], batch_size=2)
    # Epoch indices 0..3 done: 4 x 3 = 12 at restart; 6 more epochs: 12 + 6 x 3 = 30.
    assert recorder.start_iterations == 4 * steps == 12
    assert resumed.optimizer.iterations == 30
    assert len(history.history["loss"]) == 4 + 6  # 4 epochs restored with the backup, 6 run
    for got, want in zip(weights(resumed), weights(reference)):
        np.testing.assert_allclose(got, want, atol=1e-6)


def test_backup_and_restore_rejects_a_bad_save_freq(tmp_path):
    with pytest.raises(ValueError, match="save_freq"):
        BackupAndRestore(str(tmp_path), save_freq="batch")
    with pytest.raises(ValueError, match="save_freq"):
        BackupAndRestore(str(tmp_path), save_freq=0)


@pytest.mark.slow
def test_backup_is_kept_when_delete_checkpoint_is_false(tmp_path):
    backup = str(tmp_path / "backup")
    model = make_model()
    model.fit(
        X,
        Y,
        batch_size=1,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[BackupAndRestore(backup, delete_checkpoint=False)],
    )
    # A later fit to epochs=3 resumes after epoch index 1 (2 x 5 = 10 iterations): one epoch.
    again = make_model()
    history = again.fit(
        X,
        Y,
        batch_size=1,
        epochs=3,
        shuffle=False,
        verbose=0,
        callbacks=[BackupAndRestore(backup, delete_checkpoint=False)],
    )
    assert history.epoch == [0, 1, 2]  # epochs 0 and 1 restored with the backup, 2 run
    assert again.optimizer.iterations == 15


# -- ModelCheckpoint ---------------------------------------------------------------------------


def test_model_checkpoint_formats_the_filepath(tmp_path):
    model = make_model()
    pattern = str(tmp_path / "w.{epoch:02d}-{loss:.2f}")
    history = model.fit(
        X,
        Y,
        batch_size=1,
        epochs=3,
        shuffle=False,
        verbose=0,
        callbacks=[ModelCheckpoint(pattern, save_weights_only=True)],
    )
    # Epoch numbers in names are 1-based, as Keras: 01, 02, 03.
    expected = {f"w.{e + 1:02d}-{loss:.2f}" for e, loss in enumerate(history.history["loss"])}
    assert set(os.listdir(tmp_path)) == expected
    assert len(expected) == 3


def test_model_checkpoint_every_n_batches_names_epoch_and_batch(tmp_path):
    model = make_model()
    model.fit(
        X,
        Y,
        batch_size=1,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[ModelCheckpoint(str(tmp_path / "{epoch}-{batch}"), save_freq=2, save_weights_only=True)],
    )
    # 5 batches per epoch, a save every 2 counted across epochs: after batches 2, 4 (epoch 1),
    # 6 = epoch 2 batch 1, 8 = epoch 2 batch 3, 10 = epoch 2 batch 5 (1-based numbers).
    assert sorted(os.listdir(tmp_path)) == ["1-2", "1-4", "2-1", "2-3", "2-5"]


@pytest.mark.slow
def test_model_checkpoint_save_best_only_keeps_improving_epochs(tmp_path):
    model = make_model()
    scores = [3.0, 1.0, 2.0, 0.5, 0.7]
    inject = LambdaCallback(on_epoch_end=lambda epoch, logs: logs.update(score=scores[epoch]))
    checkpoint = ModelCheckpoint(
        str(tmp_path / "best.{epoch}"),
        monitor="score",
        mode="min",
        save_best_only=True,
        save_weights_only=True,
    )
    model.fit(X, Y, batch_size=1, epochs=5, shuffle=False, verbose=0, callbacks=[inject, checkpoint])
    # 3.0 beats +inf, 1.0 < 3.0, 2.0 no, 0.5 < 1.0, 0.7 no: epochs 1, 2 and 4 (1-based).
    assert sorted(os.listdir(tmp_path)) == ["best.1", "best.2", "best.4"]
    assert checkpoint.best == 0.5

    threshold = ModelCheckpoint(
        str(tmp_path / "t.{epoch}"),
        monitor="score",
        mode="min",
        save_best_only=True,
        save_weights_only=True,
        initial_value_threshold=0.9,
    )
    make_model().fit(X, Y, batch_size=1, epochs=5, shuffle=False, verbose=0, callbacks=[inject, threshold])
    # Only 0.5 beats the threshold 0.9: epoch 4.
    assert [n for n in os.listdir(tmp_path) if n.startswith("t.")] == ["t.4"]


def test_model_checkpoint_auto_mode_needs_a_known_direction(tmp_path):
    # "score" is logged by the LambdaCallback, but its direction is unknown.
    inject = LambdaCallback(on_epoch_end=lambda epoch, logs: logs.update(score=1.0))
    with pytest.raises(ValueError, match="mode='max'"):
        make_model().fit(
            X,
            Y,
            batch_size=1,
            epochs=1,
            verbose=0,
            callbacks=[inject, ModelCheckpoint(str(tmp_path / "m"), monitor="score", save_best_only=True)],
        )


def test_model_checkpoint_missing_format_field_names_it(tmp_path):
    with pytest.raises(KeyError, match="val_loss"):
        make_model().fit(
            X,
            Y,
            batch_size=1,
            epochs=1,
            verbose=0,
            callbacks=[ModelCheckpoint(str(tmp_path / "{val_loss:.2f}"))],
        )


@pytest.mark.slow
def test_model_checkpoint_saves_restore(tmp_path):
    model = make_model()
    model.fit(
        X,
        Y,
        batch_size=1,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[
            ModelCheckpoint(str(tmp_path / "weights"), save_weights_only=True),
            ModelCheckpoint(str(tmp_path / "full")),
        ],
    )
    fresh = make_model()
    fresh.load_weights(str(tmp_path / "weights"))
    for got, want in zip(weights(fresh), weights(model)):
        np.testing.assert_array_equal(got, want)
    # The full checkpoint also holds the optimizer state: 2 epochs x 5 steps = 10 iterations.
    full = make_model()
    mirrax.Checkpoint(model=full).restore(str(tmp_path / "full")).assert_existing_objects_matched()
    assert full.optimizer.iterations == 10
    for got, want in zip(weights(full), weights(model)):
        np.testing.assert_array_equal(got, want)


# -- models with Dropout, BatchNorm and nnx.Rngs (issue 11, defects 1 and 8) --------------------

from tests.test_checkpoint import RngNet, assert_same_state  # noqa: E402


def make_rng_model(seed: int = 0, legacy: bool = False, replicas: int = 1) -> mirrax.Model:
    with mirrored(replicas).scope():
        model = mirrax.Model(RngNet(seed, legacy))
        model.compile(optax.adam(0.05), loss="mse")
    return model


@pytest.mark.slow
@pytest.mark.parametrize("legacy", [False, True], ids=["typed_keys", "legacy_keys"])
def test_model_checkpoint_output_of_a_dropout_model_restores(tmp_path, legacy):
    model = make_rng_model(0, legacy)
    model.fit(
        X,
        Y,
        batch_size=1,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[
            ModelCheckpoint(str(tmp_path / "weights"), save_weights_only=True),
            ModelCheckpoint(str(tmp_path / "full")),
            ModelCheckpoint(str(tmp_path / "best"), monitor="loss", save_best_only=True),
        ],
    )
    for name in ("weights", "full"):
        fresh = make_rng_model(1, legacy)
        # load_weights reads save_weights_only output and the module of a full checkpoint.
        fresh.load_weights(str(tmp_path / name))
        assert_same_state(fresh.module, model.module)
    # save_best_only over a fixed path: whichever epoch was best, it restores completely.
    mirrax.Checkpoint(model=make_rng_model(1, legacy)).restore(str(tmp_path / "best")).assert_consumed()
    full = make_rng_model(1, legacy)
    mirrax.Checkpoint(model=full).restore(str(tmp_path / "full")).assert_consumed()
    assert full.optimizer.iterations == 10  # 2 epochs x 5 steps
    assert_same_state(full.module, model.module)


@pytest.mark.slow
@pytest.mark.parametrize("legacy", [False, True], ids=["typed_keys", "legacy_keys"])
def test_backup_and_restore_resumes_a_dropout_model_exactly(tmp_path, legacy):
    backup = str(tmp_path / "backup")
    reference = make_rng_model(0, legacy)
    fit(reference, [])
    model = make_rng_model(0, legacy)
    with pytest.raises(Interrupted):
        fit(model, [BackupAndRestore(backup), InterruptAt(4)])
    resumed = make_rng_model(5, legacy)  # other weights and keys: only the restore can fix them
    started = []
    run_epochs = LambdaCallback(on_epoch_begin=lambda epoch, logs: started.append(epoch))
    history = fit(resumed, [BackupAndRestore(backup), run_epochs])
    assert started == [4, 5, 6, 7, 8, 9] and history.epoch == list(range(10))
    # The dropout masks of epochs 4..9 come from the restored key and count, so the resumed
    # run ends where the uninterrupted one does: the PRNG state bit for bit, the weights to
    # float tolerance (the resumed run's steps are compiled afresh).
    state, want = rng_state_only(resumed), rng_state_only(reference)
    assert state.keys() == want.keys()
    for key in state:
        np.testing.assert_array_equal(state[key], want[key], err_msg=key)
    params = lambda m: jax.tree.leaves(nnx.state(m.module, nnx.Param))  # noqa: E731
    for got, want in zip(params(resumed), params(reference), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6)


def rng_state_only(model) -> dict:
    from tests.test_checkpoint import rng_state

    return {k: v for k, v in rng_state(model.module).items() if "rngs" in k or "key" in k}


@pytest.mark.slow
def test_backup_falls_back_to_the_previous_backup_when_the_newest_is_damaged(tmp_path, caplog):
    backup = tmp_path / "backup"
    model = make_model()
    with pytest.raises(Interrupted):
        fit(model, [BackupAndRestore(str(backup)), InterruptAt(4)])
    # Backups after epochs 3 and 4 are kept (numbered by save count: 3 and 4).
    assert sorted(os.listdir(backup)) == ["3", "4"]
    (backup / "4" / "_CHECKPOINT_METADATA").unlink()  # the newest is damaged
    resumed = make_model()
    recorder = Recorder()
    with caplog.at_level("WARNING", logger="mirrax"):
        history = fit(resumed, [BackupAndRestore(str(backup)), recorder])
    assert recorder.batches[0] == (3, 0)  # resumed from the backup after epoch index 2
    assert history.epoch == list(range(10))  # epochs 0..2 from that backup's history
    assert "skipping" in caplog.text


def test_a_file_where_the_backup_directory_should_be_is_refused(tmp_path):
    (tmp_path / "backup").write_text("x")
    with pytest.raises(mirrax.errors.ExistingPathError, match="is a file"):
        BackupAndRestore(str(tmp_path / "backup"))


def test_model_checkpoint_onto_a_regular_file_refuses_and_keeps_the_file(tmp_path):
    (tmp_path / "best").write_text("precious")
    with pytest.raises(mirrax.errors.ExistingPathError, match="is a file"):
        make_model().fit(
            X,
            Y,
            batch_size=1,
            epochs=1,
            verbose=0,
            callbacks=[ModelCheckpoint(str(tmp_path / "best"), save_weights_only=True)],
        )
    assert (tmp_path / "best").read_text() == "precious"


def test_save_best_only_on_a_monitor_fit_will_not_log_is_refused_before_any_step(tmp_path):
    # The default monitor is val_loss; without validation data nothing would ever be saved
    # (Keras warns at every epoch end). Refused at the start of fit, listing the logged keys.
    model = make_model()
    best = ModelCheckpoint(str(tmp_path / "best"), save_best_only=True)
    with pytest.raises(
        mirrax.errors.InvalidArgumentError,
        match=r"ModelCheckpoint: monitor='val_loss' is not among the logs of this "
        r"fit, which hold: loss\. .*validation_data",
    ):
        model.fit(X, Y, batch_size=1, epochs=2, verbose=0, callbacks=[best])
    assert model.optimizer.iterations == 0 and not os.listdir(tmp_path)
    # With validation data it saves.
    model.fit(X, Y, batch_size=1, epochs=1, verbose=0, validation_data=(X, Y), callbacks=[best])
    assert os.listdir(tmp_path) == ["best"]


@pytest.mark.slow
def test_a_mid_epoch_backup_past_the_new_epochs_end_restarts_that_epoch(tmp_path):
    # Backed up after batch 4 of 5 (batch_size 1 over X's 5 examples, save_freq=4); resumed
    # with batch_size 5, one batch per epoch: batch 5 of epoch 1 does not exist, so the epoch
    # restarts at its first batch (it used to run no step and log loss 0.0, which EarlyStopping
    # took for the best epoch).
    class Stop(mirrax.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 3:
                raise Interrupted()

    backup = str(tmp_path / "backup")
    with pytest.raises(Interrupted):
        make_model().fit(
            X,
            Y,
            batch_size=1,
            epochs=2,
            shuffle=False,
            verbose=0,
            callbacks=[BackupAndRestore(backup, save_freq=4), Stop()],
        )
    model = make_model()
    with pytest.warns(UserWarning, match="resumes epoch 1 at batch 5, but this input has 1 batch"):
        history = model.fit(
            X,
            Y,
            batch_size=5,
            epochs=2,
            shuffle=False,
            verbose=0,
            callbacks=[BackupAndRestore(backup, save_freq=4)],
        )
    # 4 steps before the interruption, then 1 + 1 after it.
    assert model.optimizer.iterations == 6
    assert len(history.history["loss"]) == 2 and all(v > 0 for v in history.history["loss"])


def test_model_checkpoint_into_a_directory_that_cannot_be_made_is_refused_before_any_step(tmp_path):
    # "blocker" is a regular file, so the directory blocker/ckpt cannot be created: refused at
    # the start of fit (not after an epoch of training), naming the path and the OS's reason.
    (tmp_path / "blocker").write_text("x")
    model = make_model()
    path = str(tmp_path / "blocker" / "ckpt" / "weights.{epoch:02d}")
    with pytest.raises(
        mirrax.errors.CheckpointWriteError,
        match=r"ModelCheckpoint: cannot write the saves of filepath=.*blocker/ckpt/"
        r"weights\.\{epoch:02d\}': the directory .*blocker/ckpt' cannot be "
        r"created or written \((NotADirectoryError|FileExistsError)",
    ):
        model.fit(
            X, Y, batch_size=1, epochs=2, verbose=0, callbacks=[ModelCheckpoint(path, save_weights_only=True)]
        )
    assert model.optimizer.iterations == 0
    assert (tmp_path / "blocker").read_text() == "x"
    assert os.listdir(tmp_path) == ["blocker"]  # no probe file left behind


def test_a_restarted_job_without_a_backup_is_warned_about(tmp_path, monkeypatch):
    # A worker of attempt 2 of `mirrax launch --max-restarts` whose backup_dir is empty (e.g. a
    # node-local path): training from the beginning would repeat every epoch without a word.
    monkeypatch.setenv("MIRRAX_LAUNCH_RESTART_COUNT", "1")
    backup = str(tmp_path / "backup")
    with pytest.warns(UserWarning, match=r"this is restart 1 of the job .* holds no backup"):
        history = fit(make_model(), [BackupAndRestore(backup)])
    assert history.epoch == list(range(10))  # trained from the beginning
    monkeypatch.setenv("MIRRAX_LAUNCH_RESTART_COUNT", "0")  # the first attempt: no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make_model().fit(X, Y, batch_size=1, epochs=1, verbose=0, callbacks=[BackupAndRestore(backup)])


def test_a_shuffled_fit_resumed_mid_epoch_sees_the_batches_and_logs_of_the_uninterrupted_one(tmp_path):
    # fit(shuffle=True): each epoch's order comes from the model's shuffle_rng (seeded at
    # compile). The backup after epoch index 2's batch 1 (global batch 12 of save_freq=2)
    # holds the RNG's state from before epoch 2's permutation, so the resumed fit draws the
    # same order for epoch 2 and the same ones after it, and its metrics go on from batch 2.
    def shuffled(model, callbacks):
        return model.fit(X, Y, batch_size=1, epochs=5, shuffle=True, verbose=0, callbacks=callbacks)

    reference = make_model()
    reference_history = shuffled(reference, [])
    backup = str(tmp_path / "backup")
    with pytest.raises(Interrupted):
        shuffled(make_model(), [BackupAndRestore(backup, save_freq=2), InterruptAt(2, batch=3)])
    resumed = make_model()
    history = shuffled(resumed, [BackupAndRestore(backup, save_freq=2)])
    assert resumed.optimizer.iterations == 25
    # To float rounding (1e-6): one process, but the resumed run's steps are other compiled
    # calls (a first step through strategy.run's path); with another order the losses and
    # weights differ at the second decimal (Adam at 0.05 on 5 examples).
    np.testing.assert_allclose(history.history["loss"], reference_history.history["loss"], rtol=1e-6)
    for got, want in zip(weights(resumed), weights(reference)):
        np.testing.assert_allclose(got, want, atol=1e-6)
    # The RNG goes on from where the uninterrupted one is: the next fit shuffles alike.
    assert resumed.shuffle_rng.bit_generator.state == reference.shuffle_rng.bit_generator.state
