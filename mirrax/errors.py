"""The mirrax error hierarchy.

Every message says what happened, echoes the value received, and says how to fix it. Classes are
named `<Verb><Object>Error` where they describe one failure (flax's convention); each also
subclasses the builtin a Python user would try first (`ValueError`, `TypeError`,
`RuntimeError`), so `except ValueError` keeps working.
"""


class MirraxError(Exception):
    """Base class of every error mirrax raises on purpose."""


# -- arguments of any public function ------------------------------------------------------------


class InvalidArgumentError(MirraxError, ValueError):
    """An argument's value is out of range, or inconsistent with another argument."""


class InvalidArgumentTypeError(MirraxError, TypeError):
    """An argument is of a type the function does not take (e.g. `epochs='3'`)."""


class UnsupportedArgumentError(MirraxError, ValueError):
    """A Keras or TF argument mirrax does not support; the message names the alternative."""


# -- distribute ----------------------------------------------------------------------------------


class InvalidDeviceError(MirraxError, ValueError):
    """A device argument names no device of this process, or the device list is empty."""


class MixedStrategyError(MirraxError, ValueError):
    """A value or object that belongs to one strategy was used with another."""


class CapturedStateError(MirraxError, ValueError):
    """The function given to `strategy.run` reaches NNX state that cannot be carried into the
    program: held by a plain object passed in `args`, by an object that cannot be copied, or
    deeper than the capture walk looks (an attribute of an attribute)."""


class TracedValueError(MirraxError, TypeError):
    """A step made a Python decision (`if`, `while`, `int()`, `np.asarray`) on a value that exists
    only while its compiled program runs."""


class VaryingVariableError(MirraxError, ValueError):
    """A variable whose aggregation is NONE came out of `strategy.run` different on each replica."""


class InvalidBatchError(MirraxError, ValueError):
    """A batch handed to a distributed dataset cannot be split over the replicas."""


class ReplicaContextError(MirraxError, RuntimeError):
    """A replica-context-only function was called in cross-replica context, or the reverse."""


class StartedBackendError(MirraxError, RuntimeError):
    """A setting JAX reads when it starts (the CPU device count) was changed after it started."""


class DivergentWorkersError(MirraxError, RuntimeError):
    """The processes of a multi-worker run disagree (other datasets, data, or steps)."""


class UnresponsivePeerError(MirraxError, TimeoutError):
    """A process of a multi-worker run gave no answer at a host exchange within the timeout."""


class MissingDatasetError(MirraxError, FileNotFoundError):
    """The files of a data set that mirrax reads from disk (e.g. CIFAR-10) are not there."""


# -- training ------------------------------------------------------------------------------------


class NotCompiledError(MirraxError, RuntimeError):
    """`fit` / `evaluate` (or anything needing the optimizer) was called before `compile`."""


class EmptyDatasetError(MirraxError, ValueError):
    """An input of `fit` / `evaluate` / `predict` yields no batch (an empty list or generator)."""


class InvalidIdentifierError(MirraxError, ValueError):
    """A loss, metric or optimizer identifier (a string, or an object given to `get`) names nothing known."""


class InvalidLabelError(MirraxError, ValueError):
    """Labels outside the range the loss accepts (e.g. a sparse label >= the number of classes)."""


class IncompatibleInputError(MirraxError, ValueError):
    """Inputs whose shapes or dtypes do not fit the model, or labels that do not fit its output."""


class FixedLearningRateError(MirraxError, ValueError):
    """A callback reads or sets the learning rate, but the optimizer's rate is a fixed constant."""


class MissingFolderError(MirraxError, FileNotFoundError):
    """The folder a callback writes into (e.g. `CSVLogger`'s file's folder) does not exist."""


# -- checkpoints and export ----------------------------------------------------------------------


class MissingCheckpointError(MirraxError, FileNotFoundError):
    """No checkpoint (or weights) directory at the path given to restore / load."""


class InvalidCheckpointError(MirraxError, ValueError):
    """The path holds something that is not a complete, readable mirrax checkpoint."""


class IncompatibleCheckpointError(MirraxError, ValueError):
    """A checkpoint's structure, shapes or dtypes do not fit the objects restored into."""


class MissingExportError(MirraxError, FileNotFoundError):
    """`load_exported` found no artifact (or an incomplete one) at the path."""


class ExistingPathError(MirraxError, FileExistsError):
    """A save's path is taken: by a regular file, or (with `overwrite=False`) by an earlier save."""


class LockedCheckpointError(MirraxError, RuntimeError):
    """Another process is writing to the same checkpoint path or `CheckpointManager` directory
    (its owner file names its pid and host); two writers would overwrite and delete each
    other's checkpoints, so the save was refused and nothing was written."""


class CheckpointWriteError(MirraxError, OSError):
    """A checkpoint could not be written: for lack of space (the disk or a quota is full, or a
    file size limit was hit), or its path is not writable; the checkpoint that was there before
    is unchanged."""


class UnknownFilepathFieldError(MirraxError, KeyError):
    """`ModelCheckpoint`'s filepath names a `{field}` that the epoch's logs do not have."""

    def __str__(self):  # KeyError's str() would quote the whole message
        return str(self.args[0]) if self.args else ""


class InvalidExportError(MirraxError, ValueError):
    """The artifact at the path given to `load_exported` is damaged (unreadable metadata, program
    or weights)."""


class InvalidExportInputError(MirraxError, ValueError):
    """The input given to an exported model does not match its input signature."""


class MissingDependencyError(MirraxError, ImportError):
    """An optional package a feature needs is not installed (the message names the pip command)."""


class LostParameterServerError(MirraxError, RuntimeError):
    """A ParameterServerStrategy's parameter server died or stopped answering; its variables are
    gone, so training cannot go on: make a new strategy and restore the last checkpoint."""


class LostWorkersError(MirraxError, RuntimeError):
    """Every worker of a ParameterServerStrategy is gone and none came back within the timeout."""


class CancelledFunctionError(MirraxError, RuntimeError):
    """A scheduled function was cancelled before it ran, because an earlier one failed (as TF's
    `CancelledError` from `RemoteValue.fetch`)."""


class WorkerCrashError(MirraxError, RuntimeError):
    """A scheduled function was given up because the worker running it died every time it ran
    (ParameterServerStrategy: at-least-once, but at most three tries)."""


# -- warnings ------------------------------------------------------------------------------------


class PaddedBatchWarning(UserWarning):
    """A `strategy.run` step that never reads the batch mask was given a partial batch, whose
    padding rows its sums, means and state updates count (docs/design.md, "Input"). Make it an
    error with `warnings.simplefilter("error", mirrax.PaddedBatchWarning)`."""
