"""The input pipeline's options and contexts, as tf.distribute's: `InputOptions`,
`AutoShardPolicy`, `InputContext`, `ValueContext`, and the names that make the processes of a
multi-worker program agree on which dataset and which pass they are reading.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import itertools
import math

import numpy as np

from mirrax import errors
from mirrax._src import argument_checks


class AutoShardPolicy(enum.Enum):
    """How a multi-worker run splits a dataset between workers, as TF's enum of that name.

    AUTO: FILE when the dataset is a `mirrax.data.FileDataset` with at least as many files as
    workers, else DATA. FILE: worker i reads only files i, i + W, ... (W workers), in batches of
    global_batch / W. DATA: every worker reads every global batch and keeps its replicas' part
    (as one process with all the devices would split it). OFF: no sharding; every worker reads
    all the data, global_batch / W examples per step (so each example is seen W times per epoch).
    With one worker every policy reads the data once.
    """

    AUTO = "AUTO"
    FILE = "FILE"
    DATA = "DATA"
    OFF = "OFF"


@dataclasses.dataclass(frozen=True)
class InputOptions:
    """Options for distributed input, as `tf.distribute.InputOptions`.

    Attributes:
      experimental_fetch_to_device: move batches to the replicas' devices in a background
        thread ahead of use (True), or when the iterator is advanced (False).
      experimental_per_replica_buffer_size: how many batches the background thread keeps ready
        on the devices (an int >= 1; default 2).
      experimental_auto_shard_policy: an `AutoShardPolicy` (or its name): how
        `experimental_distribute_dataset` splits the data between workers (default AUTO).
        `distribute_datasets_from_function` never shards (its function shards, as in TF).
    """

    experimental_fetch_to_device: bool = True
    experimental_per_replica_buffer_size: int = 2
    experimental_auto_shard_policy: AutoShardPolicy = AutoShardPolicy.AUTO
    # TF's other options, accepted so TF programs run, refused when they ask for a behaviour
    # mirrax does not have.
    experimental_place_dataset_on_device: bool = False
    experimental_replication_mode: object = None

    def __post_init__(self):
        for name in ("experimental_fetch_to_device", "experimental_place_dataset_on_device"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise errors.InvalidArgumentTypeError(
                    f"InputOptions.{name} must be True or False; received "
                    f"{getattr(self, name)!r} of type {type(getattr(self, name)).__name__}."
                )
        if self.experimental_place_dataset_on_device:
            raise errors.UnsupportedArgumentError(
                "InputOptions(experimental_place_dataset_on_device=True) is not supported: "
                "mirrax's input pipeline runs on the host and a background thread moves each "
                "batch to the devices ahead of use. Use experimental_fetch_to_device=True (the "
                "default) instead."
            )
        mode = self.experimental_replication_mode
        if mode is not None and str(getattr(mode, "name", mode)).upper() != "PER_WORKER":
            raise errors.UnsupportedArgumentError(
                "InputOptions.experimental_replication_mode: only PER_WORKER (one input "
                f"pipeline per worker, TF's default) is supported; received {mode!r}. Leave it "
                "out."
            )
        policy = self.experimental_auto_shard_policy
        if isinstance(policy, str) and policy.upper() in AutoShardPolicy.__members__:
            object.__setattr__(self, "experimental_auto_shard_policy", AutoShardPolicy[policy.upper()])
        elif not isinstance(policy, AutoShardPolicy):
            raise errors.InvalidArgumentError(
                "InputOptions.experimental_auto_shard_policy must be one of "
                f"{[m.name for m in AutoShardPolicy]}; received {policy!r}."
            )
        size = self.experimental_per_replica_buffer_size
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise errors.InvalidArgumentError(
                f"InputOptions.experimental_per_replica_buffer_size must be an int >= 1; received {size!r}."
            )


class InputContext:
    """What an input pipeline needs to know to shard itself, as `tf.distribute.InputContext`.

    Attributes:
      num_input_pipelines: number of input pipelines (one per worker process).
      input_pipeline_id: this pipeline's index in [0, num_input_pipelines).
      num_replicas_in_sync: replicas over all workers.
    """

    def __init__(
        self, num_input_pipelines: int = 1, input_pipeline_id: int = 0, num_replicas_in_sync: int = 1
    ):
        for name, value, low in (
            ("num_input_pipelines", num_input_pipelines, 1),
            ("input_pipeline_id", input_pipeline_id, 0),
            ("num_replicas_in_sync", num_replicas_in_sync, 1),
        ):
            argument_checks.count("InputContext", name, value, low)
        if input_pipeline_id >= num_input_pipelines:
            raise errors.InvalidArgumentError(
                f"InputContext: input_pipeline_id must be in [0, num_input_pipelines) = [0, "
                f"{num_input_pipelines}); received {input_pipeline_id}."
            )
        self.num_input_pipelines = num_input_pipelines
        self.input_pipeline_id = input_pipeline_id
        self.num_replicas_in_sync = num_replicas_in_sync

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """`global_batch_size // num_replicas_in_sync` (examples per replica per step).

        Raises:
          ValueError: `global_batch_size` is not divisible by `num_replicas_in_sync`.
        """
        argument_checks.count("get_per_replica_batch_size", "global_batch_size", global_batch_size)
        if global_batch_size % self.num_replicas_in_sync:
            raise errors.InvalidArgumentError(
                f"The global_batch_size {global_batch_size} is not divisible by "
                f"num_replicas_in_sync {self.num_replicas_in_sync}. Use a multiple of "
                f"{self.num_replicas_in_sync}, e.g. "
                f"{math.ceil(global_batch_size / self.num_replicas_in_sync) * self.num_replicas_in_sync}."
            )
        return global_batch_size // self.num_replicas_in_sync

    def __repr__(self) -> str:
        return (
            f"InputContext(num_input_pipelines={self.num_input_pipelines}, input_pipeline_id="
            f"{self.input_pipeline_id}, num_replicas_in_sync={self.num_replicas_in_sync})"
        )


def check_one_argument(fn, what: str, argument: str) -> None:
    """Raises when `fn` cannot be called with one positional argument (`argument`).

    Checked before the call, so a TypeError raised inside `fn` is never mistaken for this.
    """
    try:
        inspect.signature(fn).bind(None)
    except TypeError:
        raise errors.InvalidArgumentTypeError(
            f"{what} must take one argument, the {argument}; received "
            f"{getattr(fn, '__name__', fn)!r} with signature {inspect.signature(fn)}. Define it "
            f"as def fn(ctx): ... (ctx is a mirrax.{argument})."
        ) from None
    except ValueError:  # no signature (a builtin): let the call decide
        pass


@dataclasses.dataclass(frozen=True)
class ValueContext:
    """The argument of `experimental_distribute_values_from_function`'s `value_fn`.

    As `tf.distribute.experimental.ValueContext`.
    """

    replica_id_in_sync_group: int = 0
    num_replicas_in_sync: int = 1


def check_options(options) -> InputOptions:
    """`options`, or the default `InputOptions()` for None.

    Raises:
      InvalidArgumentTypeError: not an `InputOptions`.
    """
    if options is None:
        return InputOptions()
    if not isinstance(options, InputOptions):
        raise errors.InvalidArgumentTypeError(
            f"options must be a mirrax.InputOptions or None; received {type(options).__name__}."
        )
    return options


class PipelineNames:
    """Names a strategy's distributed datasets, their passes and its distributed values the
    same on every process of an SPMD program (the keys of the processes' exchanges).

    Counted in the thread that builds or iterates them (the program's own order), so the names
    agree across processes; each exchange of a pass also carries its dataset's name, so
    processes that read different datasets at the same point disagree visibly instead of
    waiting on different names.
    """

    # Shared by every strategy of the process: two strategies of one multi-worker program
    # (e.g. a second one with shard_optimizer_state=True) must not reuse each other's keys.
    _datasets = itertools.count(1)
    _passes = itertools.count()
    _values = itertools.count(1)

    def __init__(self, shared: bool = True):
        # A strategy on one process's devices only (the default strategy of a multi-worker
        # run) exchanges nothing and may run on one worker alone (TF's `if is_chief:
        # model.evaluate(...)`): it counts on its own, so the shared counts stay alike on
        # every process.
        self._counters = (
            (PipelineNames._datasets, PipelineNames._passes, PipelineNames._values)
            if shared
            else (itertools.count(1), itertools.count(), itertools.count(1))
        )

    def dataset(self, kind: str) -> str:
        """A new dataset's name: f"{kind}#{n}"."""
        return f"{kind}#{next(self._counters[0])}"

    def next_pass(self) -> int:
        """The number of this pass over any distributed dataset of the process (0, 1, ...)."""
        return next(self._counters[1])

    def values(self) -> str:
        """A name for one `experimental_distribute_values_from_function` call."""
        return f"values/{next(self._counters[2])}"
