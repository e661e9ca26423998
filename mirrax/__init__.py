"""mirrax: the tf.distribute programming model on JAX.

Three changes turn a one-device training script into an N-device one: create a strategy,
build the model and optimizer under `strategy.scope()`, distribute the dataset.
"""

# First: defaults KERAS_BACKEND to jax before anything can import Keras (keras_backend.py).
from mirrax import callbacks as callbacks
from mirrax import data as data
from mirrax import errors as errors
from mirrax import experimental as experimental
from mirrax import losses as losses
from mirrax import metrics as metrics
from mirrax import mixed_precision as mixed_precision
from mirrax import models as models
from mirrax import partitioners as partitioners
from mirrax import train as train
from mirrax._src import keras_backend as _keras_backend  # noqa: F401
from mirrax._src.checkpointing.checkpoint import Checkpoint as Checkpoint
from mirrax._src.checkpointing.manager import CheckpointManager as CheckpointManager
from mirrax._src.checkpointing.restore import CheckpointLoadStatus as CheckpointLoadStatus
from mirrax._src.distribute.cluster import ClusterSpec as ClusterSpec
from mirrax._src.distribute.cluster import SimpleClusterResolver as SimpleClusterResolver
from mirrax._src.distribute.cluster import TFConfigClusterResolver as TFConfigClusterResolver
from mirrax._src.distribute.cpu_devices import set_cpu_device_count as set_cpu_device_count
from mirrax._src.distribute.current import get_replica_context as get_replica_context
from mirrax._src.distribute.current import get_strategy as get_strategy
from mirrax._src.distribute.current import has_strategy as has_strategy
from mirrax._src.distribute.current import in_cross_replica_context as in_cross_replica_context
from mirrax._src.distribute.gradients import value_and_grad as value_and_grad
from mirrax._src.distribute.input import DatasetCreator as DatasetCreator
from mirrax._src.distribute.input import DistributedDataset as DistributedDataset
from mirrax._src.distribute.input import DistributedIterator as DistributedIterator
from mirrax._src.distribute.input_options import AutoShardPolicy as AutoShardPolicy
from mirrax._src.distribute.input_options import InputContext as InputContext
from mirrax._src.distribute.input_options import InputOptions as InputOptions
from mirrax._src.distribute.input_options import ValueContext as ValueContext
from mirrax._src.distribute.losses import compute_average_loss as compute_average_loss
from mirrax._src.distribute.losses import scale_regularization_loss as scale_regularization_loss
from mirrax._src.distribute.mirrored import CrossDeviceOps as CrossDeviceOps
from mirrax._src.distribute.mirrored import HierarchicalCopyAllReduce as HierarchicalCopyAllReduce
from mirrax._src.distribute.mirrored import MirroredStrategy as MirroredStrategy
from mirrax._src.distribute.mirrored import NcclAllReduce as NcclAllReduce
from mirrax._src.distribute.mirrored import OneDeviceStrategy as OneDeviceStrategy
from mirrax._src.distribute.mirrored import ReductionToOneDevice as ReductionToOneDevice
from mirrax._src.distribute.multi_worker import (
    CommunicationImplementation as CommunicationImplementation,
)
from mirrax._src.distribute.multi_worker import CommunicationOptions as CommunicationOptions
from mirrax._src.distribute.multi_worker import (
    MultiWorkerMirroredStrategy as MultiWorkerMirroredStrategy,
)
from mirrax._src.distribute.reduce import ReduceOp as ReduceOp
from mirrax._src.distribute.reduce import VariableAggregation as VariableAggregation
from mirrax._src.distribute.replica_context import REPLICA_AXIS as REPLICA_AXIS
from mirrax._src.distribute.replica_context import ReplicaContext as ReplicaContext
from mirrax._src.distribute.run.function import function as function
from mirrax._src.distribute.slurm import SlurmClusterResolver as SlurmClusterResolver
from mirrax._src.distribute.strategy import Strategy as Strategy
from mirrax._src.distribute.strategy import StrategyExtended as StrategyExtended
from mirrax._src.distribute.strategy import clear_session as clear_session
from mirrax._src.distribute.tpu import TPUStrategy as TPUStrategy
from mirrax._src.distribute.values import Mirrored as Mirrored
from mirrax._src.distribute.values import PerReplica as PerReplica
from mirrax._src.exporting.export import export as export
from mirrax._src.exporting.load import load_exported as load_exported
from mirrax._src.parameter_server.cluster import RayClusterResolver as RayClusterResolver
from mirrax._src.parameter_server.coordinator import ClusterCoordinator as ClusterCoordinator
from mirrax._src.parameter_server.remote_values import PerWorkerDataset as PerWorkerDataset
from mirrax._src.parameter_server.remote_values import PerWorkerIterator as PerWorkerIterator
from mirrax._src.parameter_server.remote_values import RemoteValue as RemoteValue
from mirrax._src.parameter_server.strategy import (
    ParameterServerStrategy as ParameterServerStrategy,
)
from mirrax._src.training.keras_optimizer import KerasOptimizer as KerasOptimizer
from mirrax._src.training.model import Model as Model
from mirrax._src.training.sidecar_evaluator import SidecarEvaluator as SidecarEvaluator
from mirrax.errors import PaddedBatchWarning as PaddedBatchWarning

__version__ = "0.1.0"

__all__ = [
    "REPLICA_AXIS",
    "AutoShardPolicy",
    "Checkpoint",
    "CheckpointLoadStatus",
    "CheckpointManager",
    "ClusterCoordinator",
    "ClusterSpec",
    "CommunicationImplementation",
    "CommunicationOptions",
    "CrossDeviceOps",
    "DatasetCreator",
    "DistributedDataset",
    "DistributedIterator",
    "HierarchicalCopyAllReduce",
    "InputContext",
    "InputOptions",
    "KerasOptimizer",
    "Mirrored",
    "Model",
    "MirroredStrategy",
    "MultiWorkerMirroredStrategy",
    "NcclAllReduce",
    "OneDeviceStrategy",
    "PaddedBatchWarning",
    "ParameterServerStrategy",
    "PerWorkerDataset",
    "PerWorkerIterator",
    "PerReplica",
    "RayClusterResolver",
    "ReduceOp",
    "ReductionToOneDevice",
    "RemoteValue",
    "ReplicaContext",
    "SidecarEvaluator",
    "SimpleClusterResolver",
    "SlurmClusterResolver",
    "Strategy",
    "StrategyExtended",
    "TFConfigClusterResolver",
    "TPUStrategy",
    "ValueContext",
    "VariableAggregation",
    "compute_average_loss",
    "callbacks",
    "clear_session",
    "data",
    "errors",
    "experimental",
    "export",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
    "load_exported",
    "losses",
    "metrics",
    "mixed_precision",
    "models",
    "partitioners",
    "scale_regularization_loss",
    "set_cpu_device_count",
    "train",
    "value_and_grad",
]
