"""Bad inputs of checkpoints and export: Checkpoint, CheckpointManager, Model.save_weights /
load_weights, ModelCheckpoint, BackupAndRestore, export / load_exported, and damaged files."""

from __future__ import annotations

import fcntl
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import mirrax
from mirrax import errors
from mirrax.callbacks import BackupAndRestore, ModelCheckpoint
from tests.bad_inputs.case import Case

_SIG = jax.ShapeDtypeStruct((-1, 2), jnp.float32)


def _linear(strategy=None, width: int = 2, dtype=jnp.float32):
    if strategy is None:
        return nnx.Linear(2, width, rngs=nnx.Rngs(0), param_dtype=dtype)
    with strategy.scope():
        return nnx.Linear(2, width, rngs=nnx.Rngs(0), param_dtype=dtype)


def _saved(env, name: str = "ckpt", **objects) -> str:
    return mirrax.Checkpoint(**(objects or {"net": _linear()})).write(env.tmp_path / name)


def _file(env, name: str = "file") -> str:
    path = env.tmp_path / name
    path.write_text("a user's file")
    return str(path)


def _restore(env, path):
    return mirrax.Checkpoint(net=_linear()).restore(path)


def _damaged(env, damage) -> str:
    path = _saved(env, net=nnx.Linear(2, 300, rngs=nnx.Rngs(0)))
    damage(path)
    return path


def _truncate_largest(path):
    files = [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    largest = max(files, key=os.path.getsize)
    os.truncate(largest, os.path.getsize(largest) // 2)


def _manager(env, **kwargs):
    return mirrax.CheckpointManager(mirrax.Checkpoint(step=0), env.tmp_path / "run", **kwargs)


def _model(width: int = 2):
    return mirrax.Model(_linear(width=width))


def _fit_with_backup(env, width: int, epochs: int):
    """fit of a Linear(2, width) with BackupAndRestore(<tmp>/backup) keeping its backup."""
    model = _model(width)
    with env.strategy.scope():
        model.compile("sgd", "mse")
    x, y = np.ones((4, 2), np.float32), np.ones((4, width), np.float32)
    backup = BackupAndRestore(str(env.tmp_path / "backup"), delete_checkpoint=False)
    return model.fit(x, y, batch_size=2, epochs=epochs, verbose=0, callbacks=[backup])


def _backup_of_another_model(env):
    _fit_with_backup(env, width=2, epochs=1)
    return _fit_with_backup(env, width=3, epochs=2)  # the same backup_dir, another model


def _artifact(env, name: str = "artifact") -> str:
    path = env.tmp_path / name
    mirrax.export(lambda x: x * 2.0, path, _SIG, platforms=["cpu"])
    return path


def _write(path, data: bytes):
    with open(path, "wb") as f:
        f.write(data)


def _model_checkpoint_save(env, filepath, logs, **kwargs):
    callback = ModelCheckpoint(str(env.tmp_path / filepath), **kwargs)
    callback.set_model(_model())
    callback.on_train_begin()
    callback.on_epoch_end(0, logs)


def _while_another_writes(env, name: str, save):
    """`save(env)` while an flock through another open file holds `<tmp>/<name>.mirrax-writer`
    with another process's owner record (flock conflicts between open files, as between
    processes)."""
    fd = os.open(env.tmp_path / f"{name}.mirrax-writer", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(
            fd,
            json.dumps(
                {
                    "pid": 4242,
                    "host": "trainer-7",
                    "what": "Checkpoint.save",
                    "since": "2026-12-02T20:00:00+00:00",
                }
            ).encode(),
        )
        return save(env)
    finally:
        os.close(fd)


_ANOTHER_WRITER = (
    "another process is writing to",
    "process 4242 on host 'trainer-7'",
    "nothing was written",
    "Save to another path",
)

CASES = [
    Case(
        "Checkpoint.write to a path another process is writing (was: deep Orbax/OS errors)",
        lambda env: _while_another_writes(env, "ckpt", lambda env: _saved(env)),
        errors.LockedCheckpointError,
        _ANOTHER_WRITER,
    ),
    Case(
        "Checkpoint.save to a prefix another process saves to",
        lambda env: _while_another_writes(
            env, "ckpt", lambda env: mirrax.Checkpoint(step=0).save(env.tmp_path / "ckpt")
        ),
        errors.LockedCheckpointError,
        _ANOTHER_WRITER,
    ),
    Case(
        "CheckpointManager.save to a directory another process's manager saves to",
        lambda env: _while_another_writes(env, "run", lambda env: _manager(env).save()),
        errors.LockedCheckpointError,
        _ANOTHER_WRITER + ("call close() on its CheckpointManager",),
    ),
    # -- Checkpoint ------------------------------------------------------------------------------
    Case(
        "Checkpoint(data='hello'): an untrackable object",
        lambda env: mirrax.Checkpoint(data="hello"),
        errors.InvalidArgumentTypeError,
        ("cannot track data=str", "it tracks nnx.Module"),
    ),
    Case(
        "Checkpoint(_hidden=1): a name starting with '_'",
        lambda env: mirrax.Checkpoint(**{"_hidden": 1}),
        errors.InvalidArgumentError,
        ("starts with '_'", "'_hidden'", "rename it"),
    ),
    Case(
        "Checkpoint.write(123): a path that is not a path",
        lambda env: mirrax.Checkpoint(step=0).write(123),
        errors.InvalidArgumentTypeError,
        ("must be a str or os.PathLike", "received 123 of type int"),
    ),
    Case(
        "Checkpoint.write onto a directory of other files (was: deleted them)",
        lambda env: (
            (env.tmp_path / "home").mkdir(),
            _file(env, "home/notes.txt"),
            mirrax.Checkpoint(step=0).write(env.tmp_path / "home"),
        ),
        errors.ExistingPathError,
        ("is a directory that holds no checkpoint", "['notes.txt']", "Save to a new or empty directory"),
    ),
    Case(
        "Checkpoint.write(''): an empty path (was: replaced the working directory)",
        lambda env: mirrax.Checkpoint(step=0).write(""),
        errors.InvalidArgumentError,
        ("path is empty", "pass a directory path"),
    ),
    Case(
        "Checkpoint.write onto a regular file (was: replaced it)",
        lambda env: mirrax.Checkpoint(step=0).write(_file(env)),
        errors.ExistingPathError,
        ("is a file, not a checkpoint directory", "does not replace it", "Save to another path"),
    ),
    Case(
        "Checkpoint.restore where no tracked name is in the checkpoint",
        lambda env: mirrax.Checkpoint(model=_model()).restore(_saved(env)),
        errors.IncompatibleCheckpointError,
        ("(['model.module'])", "which holds ['net']", "nothing was restored", "under the names"),
    ),
    Case(
        "Checkpoint.restore from a missing directory",
        lambda env: _restore(env, env.tmp_path / "nowhere"),
        errors.MissingCheckpointError,
        ("no checkpoint directory at", "nowhere", "Checkpoint.write(path)"),
    ),
    Case(
        "Checkpoint.restore from an empty directory",
        lambda env: (env.tmp_path / "empty").mkdir() or _restore(env, env.tmp_path / "empty"),
        errors.InvalidCheckpointError,
        ("not a complete mirrax checkpoint", "found an empty directory", "Restore a directory written by"),
    ),
    Case(
        "Checkpoint.restore from a regular file",
        lambda env: _restore(env, _file(env)),
        errors.InvalidCheckpointError,
        ("is a file, not a checkpoint directory", "Pass the directory"),
    ),
    Case(
        "Checkpoint.restore from Orbax's unfinished temporary directory",
        lambda env: (
            (env.tmp_path / "c.orbax-checkpoint-tmp-1").mkdir()
            or _restore(env, env.tmp_path / "c.orbax-checkpoint-tmp-1")
        ),
        errors.InvalidCheckpointError,
        ("is an unfinished save", "Restore an earlier checkpoint"),
    ),
    Case(
        "Checkpoint.restore into a layer of another shape",
        lambda env: mirrax.Checkpoint(net=_linear(env.strategy, width=3)).restore(_saved(env)),
        errors.IncompatibleCheckpointError,
        (
            "net['kernel'] has shape (2, 2) in the checkpoint, (2, 3) in the model",
            "Restore a checkpoint saved from objects with the same structure",
        ),
        each_strategy=True,
    ),
    Case(
        "Checkpoint.restore into a layer of another dtype",
        lambda env: mirrax.Checkpoint(net=_linear(env.strategy, dtype=jnp.float16)).restore(_saved(env)),
        errors.IncompatibleCheckpointError,
        ("net['kernel'] has dtype float32 in the checkpoint, float16 in the model",),
        each_strategy=True,
    ),
    Case(
        "Checkpoint.restore of a truncated array file",
        lambda env: mirrax.Checkpoint(net=nnx.Linear(2, 300, rngs=nnx.Rngs(1))).restore(
            _damaged(env, _truncate_largest)
        ),
        errors.InvalidCheckpointError,
        ("truncated or corrupt", "Nothing was changed", "Restore an earlier checkpoint"),
    ),
    Case(
        "Checkpoint.restore with its metadata file deleted",
        lambda env: mirrax.Checkpoint(net=nnx.Linear(2, 300, rngs=nnx.Rngs(1))).restore(
            _damaged(env, lambda p: os.remove(os.path.join(p, "_CHECKPOINT_METADATA")))
        ),
        errors.InvalidCheckpointError,
        ("has no _CHECKPOINT_METADATA", "found ['commit_success.txt'"),
    ),
    Case(
        "Checkpoint.restore with an item's metadata replaced by garbage",
        lambda env: mirrax.Checkpoint(net=nnx.Linear(2, 300, rngs=nnx.Rngs(1))).restore(
            _damaged(env, lambda p: _write(os.path.join(p, "net", "_METADATA"), b"{not json"))
        ),
        errors.InvalidCheckpointError,
        ("Restore an earlier checkpoint",),
    ),
    Case(
        "Checkpoint.restore with an item's directory replaced by a file (was: reported absent)",
        lambda env: mirrax.Checkpoint(net=nnx.Linear(2, 300, rngs=nnx.Rngs(1))).restore(
            _damaged(
                env,
                lambda p: (
                    __import__("shutil").rmtree(os.path.join(p, "net")),
                    _write(os.path.join(p, "net"), b"x"),
                ),
            )
        ),
        errors.InvalidCheckpointError,
        (
            "is damaged",
            "lists the items ['net']",
            "missing or not directories",
            "Restore an earlier checkpoint",
        ),
    ),
    # -- CheckpointManager -----------------------------------------------------------------------
    Case(
        "CheckpointManager(model): not a Checkpoint",
        lambda env: mirrax.CheckpointManager(_linear(), env.tmp_path / "run"),
        errors.InvalidArgumentTypeError,
        ("manages a mirrax.Checkpoint; received Linear", "Pass mirrax.Checkpoint(model="),
    ),
    Case(
        "CheckpointManager(max_to_keep=0) (TF keeps none; Orbax would keep all)",
        lambda env: _manager(env, max_to_keep=0),
        errors.InvalidArgumentError,
        ("max_to_keep must be >= 1 or None", "received max_to_keep=0"),
    ),
    Case(
        "SidecarEvaluator(steps=1.5)",
        lambda env: mirrax.SidecarEvaluator(
            _model(), (np.zeros((4, 2), np.float32),), "/nonexistent", steps=1.5
        ),
        errors.InvalidArgumentTypeError,
        ("SidecarEvaluator: steps must be an int or None", "received float 1.5"),
    ),
    Case(
        "CheckpointManager(max_to_keep='3')",
        lambda env: _manager(env, max_to_keep="3"),
        errors.InvalidArgumentTypeError,
        ("max_to_keep must be an int or None", "received str '3'", "Pass a whole number >= 1"),
    ),
    Case(
        "CheckpointManager(max_to_keep=2.5)",
        lambda env: _manager(env, max_to_keep=2.5),
        errors.InvalidArgumentTypeError,
        ("max_to_keep must be an int", "received float 2.5"),
    ),
    Case(
        "CheckpointManager(checkpoint_interval=-1)",
        lambda env: _manager(env, checkpoint_interval=-1),
        errors.InvalidArgumentError,
        ("checkpoint_interval must be >= 0", "received checkpoint_interval=-1"),
    ),
    Case(
        "CheckpointManager(keep_checkpoint_every_n_hours=-1)",
        lambda env: _manager(env, keep_checkpoint_every_n_hours=-1),
        errors.InvalidArgumentError,
        ("keep_checkpoint_every_n_hours must be a positive number of hours", "received -1"),
    ),
    Case(
        "CheckpointManager(keep_checkpoint_every_n_hours='2')",
        lambda env: _manager(env, keep_checkpoint_every_n_hours="2"),
        errors.InvalidArgumentTypeError,
        ("must be a number of hours or None", "received '2' of type str"),
    ),
    Case(
        "CheckpointManager(init_fn=3): not callable",
        lambda env: _manager(env, init_fn=3),
        errors.InvalidArgumentTypeError,
        ("init_fn must be a function or None", "received 3"),
    ),
    Case(
        "CheckpointManager(async_save='yes')",
        lambda env: _manager(env, async_save="yes"),
        errors.InvalidArgumentTypeError,
        ("async_save must be True or False", "received 'yes'"),
    ),
    Case(
        "CheckpointManager(directory=<a regular file>)",
        lambda env: mirrax.CheckpointManager(mirrax.Checkpoint(step=0), _file(env)),
        errors.ExistingPathError,
        ("is a file", "does not replace it"),
    ),
    Case(
        "CheckpointManager.save(checkpoint_number=-1)",
        lambda env: _manager(env).save(checkpoint_number=-1),
        errors.InvalidArgumentError,
        ("checkpoint_number must be >= 0 or None", "received checkpoint_number=-1"),
    ),
    Case(
        "CheckpointManager.save(checkpoint_number=2.5)",
        lambda env: _manager(env).save(checkpoint_number=2.5),
        errors.InvalidArgumentTypeError,
        ("checkpoint_number must be an int or None", "received float 2.5"),
    ),
    # -- Model.save_weights / load_weights ------------------------------------------------------
    Case(
        "save_weights(overwrite=False) onto an existing save",
        lambda env: (
            _model().save_weights(env.tmp_path / "w"),
            _model().save_weights(env.tmp_path / "w", overwrite=False),
        ),
        errors.ExistingPathError,
        ("exists; pass overwrite=True to replace it",),
    ),
    Case(
        "save_weights(overwrite='no'): a string flag",
        lambda env: _model().save_weights(env.tmp_path / "w", overwrite="no"),
        errors.InvalidArgumentTypeError,
        ("overwrite must be True or False", "received 'no'"),
    ),
    Case(
        "save_weights onto a regular file (was: replaced it)",
        lambda env: _model().save_weights(_file(env)),
        errors.ExistingPathError,
        ("is a file, not a checkpoint directory", "delete the file first"),
    ),
    Case(
        "load_weights from a missing directory",
        lambda env: _model().load_weights(env.tmp_path / "nowhere"),
        errors.MissingCheckpointError,
        ("no weights directory at", "model.save_weights(path)"),
    ),
    Case(
        "load_weights from a checkpoint that holds no model",
        lambda env: _model().load_weights(_saved(env, step=np.int64(3), net=_linear())),
        errors.IncompatibleCheckpointError,
        (
            "holds no single model's weights",
            "['net', 'step']",
            "mirrax.Checkpoint(net=<the object saved>).restore(",
        ),
    ),
    Case(
        "load_weights into a model of another width",
        lambda env: (
            _model().save_weights(env.tmp_path / "w"),
            _model(width=5).load_weights(env.tmp_path / "w"),
        ),
        errors.IncompatibleCheckpointError,
        ("weights['kernel'] has shape (2, 2) in the checkpoint, (2, 5) in the model",),
    ),
    # -- ModelCheckpoint ------------------------------------------------------------------------
    Case(
        "ModelCheckpoint(filepath=None)",
        lambda env: ModelCheckpoint(None),
        errors.InvalidArgumentTypeError,
        ("filepath must be a non-empty path", "received None"),
    ),
    Case(
        "ModelCheckpoint(save_freq=0)",
        lambda env: ModelCheckpoint(str(env.tmp_path / "m"), save_freq=0),
        errors.InvalidArgumentError,
        ("unrecognized save_freq: 0", "save_freq='epoch'", "a positive int"),
    ),
    Case(
        "ModelCheckpoint(save_freq='batch')",
        lambda env: ModelCheckpoint(str(env.tmp_path / "m"), save_freq="batch"),
        errors.InvalidArgumentError,
        ("unrecognized save_freq: 'batch'",),
    ),
    Case(
        "ModelCheckpoint(save_freq=2.0)",
        lambda env: ModelCheckpoint(str(env.tmp_path / "m"), save_freq=2.0),
        errors.InvalidArgumentTypeError,
        ("unrecognized save_freq: 2.0",),
    ),
    Case(
        "ModelCheckpoint(save_best_only='True'): a string flag",
        lambda env: ModelCheckpoint(str(env.tmp_path / "m"), save_best_only="True"),
        errors.InvalidArgumentTypeError,
        ("save_best_only must be True or False", "received str 'True'"),
    ),
    Case(
        "ModelCheckpoint(monitor=3)",
        lambda env: ModelCheckpoint(str(env.tmp_path / "m"), monitor=3),
        errors.InvalidArgumentTypeError,
        ("monitor must be a log key", "received 3 of type int"),
    ),
    Case(
        "ModelCheckpoint(initial_value_threshold='0.5')",
        lambda env: ModelCheckpoint(str(env.tmp_path / "m"), initial_value_threshold="0.5"),
        errors.InvalidArgumentTypeError,
        ("initial_value_threshold must be a number or None", "received '0.5'"),
    ),
    Case(
        "ModelCheckpoint filepath naming a log key the logs lack",
        lambda env: _model_checkpoint_save(env, "m-{val_acc:.2f}", {"loss": 1.0}),
        errors.UnknownFilepathFieldError,
        ("Failed to format this callback filepath", "'val_acc'", "Available fields: ['epoch', 'loss']"),
    ),
    Case(
        "ModelCheckpoint(save_best_only, mode='auto') of a quantity of unknown direction",
        lambda env: _model_checkpoint_save(env, "m", {"foo": 1.0}, monitor="foo", save_best_only=True),
        errors.InvalidArgumentError,
        ("monitor='foo' with mode='auto'", "Pass mode='max'"),
    ),
    Case(
        "ModelCheckpoint into a directory under a regular file",
        lambda env: (
            _write(env.tmp_path / "file", b"x"),
            _model_checkpoint_save(env, "file/ckpt/m-{epoch}", {"loss": 1.0}),
        ),
        errors.CheckpointWriteError,
        (
            "ModelCheckpoint: cannot write the saves of filepath=",
            "cannot be created or written",
            "Pass a filepath in a writable directory",
        ),
    ),
    # -- BackupAndRestore -----------------------------------------------------------------------
    Case(
        "BackupAndRestore(backup_dir='')",
        lambda env: BackupAndRestore(""),
        errors.InvalidArgumentError,
        ("backup_dir must be a directory path", "received ''"),
    ),
    Case(
        "BackupAndRestore(backup_dir=None)",
        lambda env: BackupAndRestore(None),
        errors.InvalidArgumentTypeError,
        ("backup_dir must be a directory path (str or os.PathLike)", "received None"),
    ),
    Case(
        "BackupAndRestore(save_freq=False): Keras's preemption checkpointing",
        lambda env: BackupAndRestore(str(env.tmp_path / "b"), save_freq=False),
        errors.UnsupportedArgumentError,
        ("save_freq=False", "is not supported", "pass save_freq='epoch' or a positive int"),
    ),
    Case(
        "BackupAndRestore(save_freq=-2)",
        lambda env: BackupAndRestore(str(env.tmp_path / "b"), save_freq=-2),
        errors.InvalidArgumentError,
        ("unrecognized save_freq: -2",),
    ),
    Case(
        "BackupAndRestore(delete_checkpoint='yes')",
        lambda env: BackupAndRestore(str(env.tmp_path / "b"), delete_checkpoint="yes"),
        errors.InvalidArgumentTypeError,
        ("delete_checkpoint must be True or False", "received str 'yes'"),
    ),
    Case(
        "BackupAndRestore(backup_dir=<a regular file>)",
        lambda env: BackupAndRestore(_file(env)),
        errors.ExistingPathError,
        ("is a file", "pass a directory path"),
    ),
    Case(
        "fit resuming from a BackupAndRestore backup written by another model",
        _backup_of_another_model,
        errors.IncompatibleCheckpointError,
        (
            "BackupAndRestore: the backup in",
            "was written by another model or compile",
            "has shape (2,) in the checkpoint, (3,) in the model",
            "Pass a backup_dir of this run's own, or delete",
        ),
    ),
    # -- export / load_exported -----------------------------------------------------------------
    Case(
        "export(3, ...): not a model or function",
        lambda env: mirrax.export(3, env.tmp_path / "a", _SIG),
        errors.InvalidArgumentTypeError,
        ("model_or_fn must be a mirrax.Model, an nnx.Module or a function", "received int"),
    ),
    Case(
        "export with a NumPy array as the input_signature",
        lambda env: mirrax.export(lambda x: x, env.tmp_path / "a", np.zeros((4, 2), np.float32)),
        errors.InvalidArgumentTypeError,
        ("input_signature must be a jax.ShapeDtypeStruct", "jax.ShapeDtypeStruct((None, 8, 8, 1)"),
    ),
    Case(
        "export(input_signature=None)",
        lambda env: mirrax.export(lambda x: x, env.tmp_path / "a", None),
        errors.InvalidArgumentTypeError,
        ("received None, which holds none",),
    ),
    Case(
        "export with -1 at a non-leading dimension",
        lambda env: mirrax.export(
            lambda x: x, env.tmp_path / "a", jax.ShapeDtypeStruct((4, -1), jnp.float32)
        ),
        errors.InvalidArgumentError,
        ("only the leading (batch) dimension may be None or -1", "has -1 at dimension 1"),
    ),
    Case(
        "export with a dimension of -5 (was: taken as the batch dimension)",
        lambda env: mirrax.export(
            lambda x: x, env.tmp_path / "a", jax.ShapeDtypeStruct((-5, 2), jnp.float32)
        ),
        errors.InvalidArgumentError,
        ("has -5 at dimension 0", "a size >= 0, or None / -1"),
    ),
    Case(
        "export(platforms=['gpu']): an unknown platform",
        lambda env: mirrax.export(lambda x: x, env.tmp_path / "a", _SIG, platforms=["gpu"]),
        errors.InvalidArgumentError,
        ("platforms must name one or more of ['cpu', 'cuda', 'rocm', 'tpu']", "(['gpu'] unknown)"),
    ),
    Case(
        "export(platforms=3)",
        lambda env: mirrax.export(lambda x: x, env.tmp_path / "a", _SIG, platforms=3),
        errors.InvalidArgumentTypeError,
        ("platforms must be a list of platform names", "received 3"),
    ),
    Case(
        "export onto a regular file",
        lambda env: mirrax.export(lambda x: x, _file(env), _SIG),
        errors.ExistingPathError,
        ("is a file, not an artifact directory", "Export to another path"),
    ),
    Case(
        "export onto a directory of other files (would be replaced whole)",
        lambda env: (
            (env.tmp_path / "home").mkdir(),
            _file(env, "home/notes.txt"),
            mirrax.export(lambda x: x, env.tmp_path / "home", _SIG),
        ),
        errors.ExistingPathError,
        ("holds no mirrax export", "['notes.txt']", "Export to a new or empty directory"),
    ),
    Case(
        "load_exported from a missing directory",
        lambda env: mirrax.load_exported(env.tmp_path / "nowhere"),
        errors.MissingExportError,
        ("no directory at", "mirrax.export(model, path, input_signature)"),
    ),
    Case(
        "load_exported from an empty directory",
        lambda env: (env.tmp_path / "e").mkdir() or mirrax.load_exported(env.tmp_path / "e"),
        errors.MissingExportError,
        ("missing forward.jax_export, weights.npz, metadata.json", "found an empty directory"),
    ),
    Case(
        "load_exported with truncated metadata (was: JSONDecodeError)",
        lambda env: (
            _write(_artifact(env) / "metadata.json", b'{"format": "mirr'),
            mirrax.load_exported(env.tmp_path / "artifact"),
        ),
        errors.InvalidExportError,
        ("metadata.json is not valid JSON", "Re-export the model"),
    ),
    Case(
        "load_exported with a truncated program (was: struct.error / flatbuffers)",
        lambda env: (
            _write(_artifact(env) / "forward.jax_export", b"\x00\x01\x02"),
            mirrax.load_exported(env.tmp_path / "artifact"),
        ),
        errors.InvalidExportError,
        ("is not a readable serialized program", "Re-export the model"),
    ),
    Case(
        "load_exported with a damaged weights file",
        lambda env: (
            _write(_artifact(env) / "weights.npz", b"PK\x03\x04broken"),
            mirrax.load_exported(env.tmp_path / "artifact"),
        ),
        errors.InvalidExportError,
        ("weights.npz does not hold the artifact's 0 weight arrays",),
    ),
    Case(
        "load_exported of another format's metadata",
        lambda env: (
            _write(
                _artifact(env) / "metadata.json",
                json.dumps({"format": "other", "format_version": 1}).encode(),
            ),
            mirrax.load_exported(env.tmp_path / "artifact"),
        ),
        errors.InvalidExportError,
        ("holds format 'other' version 1", "Upgrade mirrax or re-export"),
    ),
    Case(
        "calling an exported model with the wrong feature size",
        lambda env: mirrax.load_exported(_artifact(env))(np.zeros((3, 5), np.float32)),
        errors.InvalidExportInputError,
        ("received an input of shape (3, 5)", "expected float32[None, 2]"),
    ),
    Case(
        "calling an exported model with a batch of 0 examples",
        lambda env: mirrax.load_exported(_artifact(env))(np.zeros((0, 2), np.float32)),
        errors.InvalidExportInputError,
        ("a batch of 0 examples", "Skip empty batches"),
    ),
    Case(
        "calling an exported model with float64 input",
        lambda env: mirrax.load_exported(_artifact(env))(np.zeros((3, 2), np.float64)),
        errors.InvalidExportInputError,
        ("dtype float64", "x.astype(np.float32)"),
    ),
    # -- export: list signatures, wrapped inputs, signatures the model cannot take (issue 11) --
    Case(
        "calling a list-signature artifact with [x] (was: output of shape (1, batch, ...))",
        lambda env: _positional_artifact(env)([np.zeros((3, 2), np.float32)]),
        errors.InvalidExportInputError,
        (
            "received ['float32[3, 2]'] (a list) at positional input 0",
            "expects one array float32[None, 2]",
            "Pass the array itself",
        ),
    ),
    Case(
        "calling a list-signature artifact with two arguments for one",
        lambda env: _positional_artifact(env)(np.zeros((3, 2), np.float32), np.zeros((3, 2), np.float32)),
        errors.InvalidExportInputError,
        ("takes 1 positional input(s)", "received 2"),
    ),
    Case(
        "calling an exported model with [x] (was: jax's raw pytree-structure ValueError)",
        lambda env: mirrax.load_exported(_artifact(env))([np.zeros((3, 2), np.float32)]),
        errors.InvalidExportInputError,
        (
            "received ['float32[3, 2]'] (a list)",
            "expects one array float32[None, 2]",
            "Pass the array itself",
        ),
    ),
    Case(
        "calling a one-input exported model with two arguments",
        lambda env: mirrax.load_exported(_artifact(env))(
            np.zeros((3, 2), np.float32), np.zeros((3, 2), np.float32)
        ),
        errors.InvalidExportInputError,
        ("takes one input x; received 2 arguments", "export with a list input_signature"),
    ),
    Case(
        "calling an exported model with a string",
        lambda env: mirrax.load_exported(_artifact(env))("abc"),
        errors.InvalidExportInputError,
        ("received a str ('abc')", "Pass a NumPy or JAX array"),
    ),
    Case(
        "export with 9 features for a layer of 2 (was: jax's raw dot_general TypeError)",
        lambda env: mirrax.export(_linear(), env.tmp_path / "a", jax.ShapeDtypeStruct((-1, 9), jnp.float32)),
        errors.IncompatibleInputError,
        (
            "input_signature float32[None, 9]",
            "dot_general",
            "Give the shape and dtype of one call's input",
            "Nothing was written",
        ),
    ),
    Case(
        "export with two positional specs for a module taking one",
        lambda env: mirrax.export(_linear(), env.tmp_path / "a", [_SIG, _SIG]),
        errors.IncompatibleInputError,
        ("2 positional input(s)", "for one input x write [spec] or spec"),
    ),
]


def _positional_artifact(env):
    path = env.tmp_path / "positional"
    mirrax.export(lambda x: x * 2.0, path, [_SIG], platforms=["cpu"])
    return mirrax.load_exported(path)
