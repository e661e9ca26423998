"""Bad inputs of ParameterServerStrategy that are refused before any Ray task starts: the
partitioners, the resolvers, the cluster and the coordinator's strategy."""

import json

import numpy as np
from flax import nnx

import mirrax
from mirrax import errors
from tests.bad_inputs.case import Case

_P = mirrax.partitioners
_NO_PS = json.dumps(
    {
        "cluster": {"chief": ["localhost:2222"], "worker": ["localhost:2223"]},
        "task": {"type": "chief", "index": 0},
    }
)

_AS_WORKER = json.dumps(
    {
        "cluster": {"worker": ["localhost:2223"], "ps": ["localhost:2224"]},
        "task": {"type": "worker", "index": 0},
    }
)

CASES = [
    Case(
        "FixedShardsPartitioner(0)",
        lambda env: _P.FixedShardsPartitioner(0),
        errors.InvalidArgumentError,
        ("num_shards must be a positive int", "received 0"),
    ),
    Case(
        "MinSizePartitioner(min_shard_bytes=0)",
        lambda env: _P.MinSizePartitioner(min_shard_bytes=0),
        errors.InvalidArgumentError,
        ("min_shard_bytes must be a positive int", "received 0"),
    ),
    Case(
        "MaxSizePartitioner(max_shard_bytes=-1)",
        lambda env: _P.MaxSizePartitioner(max_shard_bytes=-1),
        errors.InvalidArgumentError,
        ("max_shard_bytes must be a positive int", "received -1"),
    ),
    Case(
        "MaxSizePartitioner(8, max_shards=0)",
        lambda env: _P.MaxSizePartitioner(8, max_shards=0),
        errors.InvalidArgumentError,
        ("max_shards must be a positive int or None", "received 0"),
    ),
    Case(
        "a partitioner asked for axis 1 of a vector",
        lambda env: _P.FixedShardsPartitioner(2)((4,), np.float32, axis=1),
        errors.InvalidArgumentError,
        ("shape (4,) along axis 1", "[0, 1)"),
    ),
    Case(
        "RayClusterResolver(num_workers=0)",
        lambda env: mirrax.RayClusterResolver(num_workers=0, num_ps=1),
        errors.InvalidArgumentError,
        ("num_workers must be >= 1", "received num_workers=0"),
    ),
    Case(
        "RayClusterResolver(num_ps=1.5)",
        lambda env: mirrax.RayClusterResolver(num_workers=1, num_ps=1.5),
        errors.InvalidArgumentTypeError,
        ("num_ps must be an int", "received float 1.5"),
    ),
    Case(
        "RayClusterResolver(num_gpus_per_worker=nan)",
        lambda env: mirrax.RayClusterResolver(1, 1, num_gpus_per_worker=float("nan")),
        errors.InvalidArgumentError,
        ("num_gpus_per_worker must be a finite number >= 0", "received nan"),
    ),
    Case(
        "RayClusterResolver(address=6379)",
        lambda env: mirrax.RayClusterResolver(1, 1, address=6379),
        errors.InvalidArgumentTypeError,
        ("address must be None, 'auto' or 'host:port'", "received 6379"),
    ),
    Case(
        "RayClusterResolver(worker_env={'XLA_FLAGS': 5})",
        lambda env: mirrax.RayClusterResolver(1, 1, worker_env={"XLA_FLAGS": 5}),
        errors.InvalidArgumentTypeError,
        ("worker_env maps variable names to strings", "'XLA_FLAGS': 5", "as strings"),
    ),
    Case(
        "ParameterServerStrategy('localhost:6379')",
        lambda env: mirrax.ParameterServerStrategy("localhost:6379"),
        errors.InvalidArgumentTypeError,
        ("cluster_resolver must be a mirrax.RayClusterResolver", "received str"),
    ),
    Case(
        "ParameterServerStrategy(variable_partitioner=2)",
        lambda env: mirrax.ParameterServerStrategy(mirrax.RayClusterResolver(1, 1), 2),
        errors.InvalidArgumentTypeError,
        ("variable_partitioner must be None or a partitioner", "received int", "FixedShardsPartitioner(2)"),
    ),
    Case(
        "TF_CONFIG without ps tasks",
        lambda env: mirrax.ParameterServerStrategy(mirrax.TFConfigClusterResolver(tf_config=_NO_PS)),
        errors.InvalidArgumentError,
        ("has no 'ps' tasks", "needs 'ps' and 'worker' jobs"),
    ),
    Case(
        "TF_CONFIG naming this process worker:0",
        lambda env: mirrax.ParameterServerStrategy(mirrax.TFConfigClusterResolver(tf_config=_AS_WORKER)),
        errors.InvalidArgumentError,
        ("says this process is worker:0", "made only by the coordinator", "only as the chief"),
    ),
    Case(
        "ClusterCoordinator(MirroredStrategy())",
        lambda env: mirrax.ClusterCoordinator(env.strategy),
        errors.InvalidArgumentTypeError,
        ("must be a mirrax.ParameterServerStrategy", "received MirroredStrategy", "strategy.run directly"),
    ),
    # Issue 27 item 8: the two strategies read the same (as two ParameterServerStrategy of
    # one layout do); the message tells them apart.
    Case(
        "compile under another strategy of the same repr",
        lambda env: _compile_under_twin(env),
        errors.MixedStrategyError,
        (
            "made under the scope of MirroredStrategy(",
            "(at 0x",
            "another MirroredStrategy(",
            "Compile it under the strategy",
        ),
    ),
]


def _compile_under_twin(env):
    devices = [d.split("device:")[-1].lower() for d in env.strategy.extended.worker_devices]
    with env.strategy.scope():
        model = mirrax.Model(nnx.Linear(1, 1, rngs=nnx.Rngs(0)))
    with mirrax.MirroredStrategy(devices).scope():
        model.compile("sgd", "mse")
