"""The mirrax error hierarchy.

Every message says what happened, echoes the value received, and says how to fix it. Classes are
named `<Verb><Object>Error` where they describe one failure (flax's convention); each also
subclasses the builtin a Python user would try first (`ValueError`, `TypeError`,
`RuntimeError`), so `except ValueError` keeps working.
"""

from __future__ import annotations


class MirraxError(Exception):
    """Base class of every error mirrax raises on purpose."""


class InvalidDeviceError(MirraxError, ValueError):
    """A device argument names no device of this process, or the device list is empty."""


class MixedStrategyError(MirraxError, ValueError):
    """A value or object that belongs to one strategy was used with another."""


class CapturedStateError(MirraxError, ValueError):
    """The function given to `strategy.run` captures NNX state instead of taking it in `args`."""


class VaryingVariableError(MirraxError, ValueError):
    """A variable whose aggregation is NONE came out of `strategy.run` different on each replica."""


class InvalidBatchError(MirraxError, ValueError):
    """A batch handed to a distributed dataset cannot be split over the replicas."""


class ReplicaContextError(MirraxError, RuntimeError):
    """A replica-context-only function was called in cross-replica context, or the reverse."""


class MissingDatasetError(MirraxError, FileNotFoundError):
    """The files of a data set that mirrax reads from disk (e.g. CIFAR-10) are not there."""


class InvalidIdentifierError(MirraxError, ValueError):
    """A loss, metric or optimizer identifier (a string, or an object given to `get`) names nothing known."""


class InvalidLabelError(MirraxError, ValueError):
    """Labels outside the range the loss accepts (e.g. a sparse label >= the number of classes)."""


class MissingExportError(MirraxError, FileNotFoundError):
    """`load_exported` found no artifact (or an incomplete one) at the path."""


class InvalidExportInputError(MirraxError, ValueError):
    """The input given to an exported model does not match its input signature."""
