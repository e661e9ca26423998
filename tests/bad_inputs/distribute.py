"""Bad inputs of the distribution runtime: strategies, run, reduce/gather, distributed input,
losses, replica context, cluster resolvers, communication options, mirrax.data and the device
count. Each is a mistake a tf.distribute user makes; none runs a compiled step."""

import json

import numpy as np
from flax import nnx

import mirrax
from mirrax import errors
from tests.bad_inputs.case import Case

_X = np.ones((8, 2), np.float32)


def _batch(env):
    """One distributed batch of 8 examples (no compiled program: a placement only)."""
    return next(iter(env.strategy.experimental_distribute_dataset(_X)))


def _inside_run(env, fn):
    """Calls `fn()` inside `strategy.run` (traced: the error comes before any program runs)."""
    return env.strategy.run(lambda x: fn() or x, args=(_batch(env),))


class _Trainer:
    def __init__(self):
        self.model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))


_TRAINER = _Trainer()


def _run_on_trainer(env):
    return env.strategy.run(lambda t, x: t.model(x), args=(_TRAINER, _batch(env)))


def _other_strategys_batch():
    other = mirrax.MirroredStrategy(["cpu:2", "cpu:3"])
    return next(iter(other.experimental_distribute_dataset(_X)))


def _tf_config(task):
    return json.dumps({"cluster": {"worker": ["a:2222", "b:2222"]}, "task": task})


CASES = [
    # -- strategies ------------------------------------------------------------------------
    Case(
        "MirroredStrategy(devices=4)",
        lambda env: mirrax.MirroredStrategy(4),
        errors.InvalidArgumentTypeError,
        ("devices must be None", "received 4 of type int", "jax.local_devices()[:N]"),
    ),
    Case(
        "MirroredStrategy(devices=['cpu:99'])",
        lambda env: mirrax.MirroredStrategy(["cpu:99"]),
        errors.InvalidDeviceError,
        ("'cpu:99' names no device", "this process has: cpu:0"),
    ),
    Case(
        "MirroredStrategy(devices=[])",
        lambda env: mirrax.MirroredStrategy([]),
        errors.InvalidDeviceError,
        ("devices=[] gives no replicas", "non-empty list"),
    ),
    Case(
        "MirroredStrategy(devices=['cpu:0', 'cpu:0'])",
        lambda env: mirrax.MirroredStrategy(["cpu:0", "cpu:0"]),
        errors.InvalidDeviceError,
        ("more than once", "['cpu:0', 'cpu:0']", "Remove the duplicates"),
    ),
    Case(
        "MirroredStrategy(cross_device_ops='nccl')",
        lambda env: mirrax.MirroredStrategy(cross_device_ops="nccl"),
        errors.InvalidArgumentTypeError,
        ("cross_device_ops must be", "received str", "NcclAllReduce()"),
    ),
    Case(
        "NcclAllReduce(num_packs=-1)",
        lambda env: mirrax.NcclAllReduce(num_packs=-1),
        errors.InvalidArgumentError,
        ("num_packs must be an int >= 0", "received -1", "leave it out"),
    ),
    Case(
        "HierarchicalCopyAllReduce(num_packs='2')",
        lambda env: mirrax.HierarchicalCopyAllReduce(num_packs="2"),
        errors.InvalidArgumentError,
        ("num_packs must be an int >= 0", "received '2'"),
    ),
    Case(
        "OneDeviceStrategy(['cpu:0', 'cpu:1'])",
        lambda env: mirrax.OneDeviceStrategy(["cpu:0", "cpu:1"]),
        errors.InvalidArgumentTypeError,
        ("must be ONE device", "['cpu:0', 'cpu:1']", "MirroredStrategy(devices)"),
    ),
    Case(
        "TPUStrategy() without TPUs",
        lambda env: mirrax.TPUStrategy(),
        errors.InvalidDeviceError,
        ("finds no TPU devices", "'cpu'", "MirroredStrategy()"),
    ),
    Case(
        "scope of another strategy inside a scope",
        lambda env: _in_scope(env, _enter_another_scope),
        errors.MixedStrategyError,
        ("inside the scope of", "Close the outer"),
        each_strategy=True,
    ),
    # -- run --------------------------------------------------------------------------------
    Case(
        "run(fn=3)",
        lambda env: env.strategy.run(3),
        errors.InvalidArgumentTypeError,
        ("fn must be callable", "received 3 of type int"),
        each_strategy=True,
    ),
    Case(
        "run(args=batch) without a tuple",
        lambda env: env.strategy.run(lambda x: x, args=_X),
        errors.InvalidArgumentTypeError,
        ("args must be a tuple or list", "received a ndarray", "args=(x,)"),
        each_strategy=True,
    ),
    Case(
        "run(kwargs=[...])",
        lambda env: env.strategy.run(lambda x: x, kwargs=[1]),
        errors.InvalidArgumentTypeError,
        ("kwargs must be a dict or None", "received a list"),
        each_strategy=True,
    ),
    Case(
        "run(args=(dist_dataset,)) instead of a batch",
        lambda env: env.strategy.run(lambda x: x, args=(env.strategy.experimental_distribute_dataset(_X),)),
        errors.InvalidArgumentTypeError,
        ("args[0] is a DistributedDataset, not a batch", "for batch in dist_dataset"),
        each_strategy=True,
    ),
    Case(
        "run on a plain object holding a module",
        _run_on_trainer,
        errors.CapturedStateError,
        ("args[0] is a _Trainer that holds NNX state", "args[0].model (Linear)", "args=(args[0].model"),
        each_strategy=True,
    ),
    Case(
        "run with a batch of another strategy",
        lambda env: mirrax.MirroredStrategy(["cpu:4", "cpu:5"]).run(lambda x: x, args=(_batch(env),)),
        errors.MixedStrategyError,
        (
            "args[0] is a PerReplica created by another strategy",
            "Distribute the dataset or values with the strategy",
        ),
        each_strategy=True,
    ),
    Case(
        "nested strategy.run",
        lambda env: _inside_run(env, lambda: env.strategy.run(lambda: None)),
        errors.ReplicaContextError,
        ("nested run is not supported", "Call the inner function directly"),
        each_strategy=True,
    ),
    Case(
        "clear_session() inside strategy.run",
        lambda env: _inside_run(env, mirrax.clear_session),
        errors.ReplicaContextError,
        ("clear_session() was called inside strategy.run", "Call it outside the step"),
    ),
    # -- reduce / gather / local results ---------------------------------------------------
    Case(
        "reduce('max', ...)",
        lambda env: env.strategy.reduce("max", _batch(env)),
        errors.InvalidArgumentError,
        ("reduce_op must be one of mirrax.ReduceOp.SUM", "received 'max'"),
        each_strategy=True,
    ),
    Case(
        "reduce(axis='0')",
        lambda env: env.strategy.reduce("sum", _batch(env), axis="0"),
        errors.InvalidArgumentTypeError,
        ("axis must be an int or None", "received '0' of type str"),
        each_strategy=True,
    ),
    Case(
        "reduce(axis=5) past the rank",
        lambda env: env.strategy.reduce("sum", _batch(env), axis=5),
        errors.InvalidArgumentError,
        ("axis 5 is out of range", "rank 2", "[-2, 2)"),
        each_strategy=True,
    ),
    Case(
        "reduce(value=None)",
        lambda env: env.strategy.reduce("mean", None),
        errors.InvalidArgumentError,
        ("value holds no array to reduce", "received None", "what strategy.run returned"),
        each_strategy=True,
    ),
    Case(
        "reduce('sum', plain array) over several replicas",
        lambda env: env.strategy.reduce("sum", np.ones(3)),
        errors.InvalidArgumentError,
        ("cannot SUM the plain (non-distributed) value", "over 2 replicas", "use MEAN"),
    ),
    Case(
        "reduce of a value from another strategy",
        lambda env: env.strategy.reduce("sum", _other_strategys_batch()),
        errors.MixedStrategyError,
        (
            "strategy.reduce: value is a PerReplica created by another strategy",
            "MirroredStrategy with 2 replicas",
            "Distribute the dataset or values with the strategy",
        ),
        each_strategy=True,
    ),
    Case(
        "gather(axis=None)",
        lambda env: env.strategy.gather(_batch(env), axis=None),
        errors.InvalidArgumentTypeError,
        ("gather: axis must be an int", "received None", "e.g. axis=0"),
        each_strategy=True,
    ),
    Case(
        "gather of a scalar",
        lambda env: env.strategy.gather(3.0, axis=0),
        errors.InvalidArgumentError,
        ("3.0 is a scalar", "no axis to concatenate", "x[None]"),
        each_strategy=True,
    ),
    # -- distributed input -----------------------------------------------------------------
    Case(
        "experimental_distribute_dataset(42)",
        lambda env: env.strategy.experimental_distribute_dataset(42),
        errors.InvalidArgumentTypeError,
        ("The dataset must be a tuple/dict of arrays", "received int (42)"),
        each_strategy=True,
    ),
    Case(
        "experimental_distribute_dataset(generator function, not called)",
        lambda env: env.strategy.experimental_distribute_dataset(_batches),
        errors.InvalidArgumentTypeError,
        ("received function", "_batches is a function", "experimental_distribute_dataset(_batches())"),
        each_strategy=True,
    ),
    Case(
        "experimental_distribute_dataset([])",
        lambda env: env.strategy.experimental_distribute_dataset([]),
        errors.EmptyDatasetError,
        ("The dataset is an empty list", "train on nothing", "Pass a list of batches"),
        each_strategy=True,
    ),
    Case(
        "experimental_distribute_dataset(options={...})",
        lambda env: env.strategy.experimental_distribute_dataset(_X, options={"x": 1}),
        errors.InvalidArgumentTypeError,
        ("options must be a mirrax.InputOptions or None", "received dict"),
        each_strategy=True,
    ),
    Case(
        "a batch of strings",
        lambda env: next(iter(env.strategy.experimental_distribute_dataset([(np.array(["a"] * 8), _X)]))),
        errors.InvalidBatchError,
        ("batch[0] has dtype <U1", "not numeric", "Encode text"),
        each_strategy=True,
    ),
    Case(
        "a batch whose leaves differ in length",
        lambda env: next(iter(env.strategy.experimental_distribute_dataset((_X, np.ones(7))))),
        errors.InvalidBatchError,
        ("different leading (batch) sizes", "batch[0]: 8, batch[1]: 7"),
        each_strategy=True,
    ),
    Case(
        "a scalar leaf in a batch",
        lambda env: next(iter(env.strategy.experimental_distribute_dataset([(_X, np.float32(1))]))),
        errors.InvalidBatchError,
        ("batch[1] is a scalar", "np.full(batch_size, value)"),
        each_strategy=True,
    ),
    Case(
        "distribute_datasets_from_function(fn without the context argument)",
        lambda env: env.strategy.distribute_datasets_from_function(lambda: [_X]),
        errors.InvalidArgumentTypeError,
        ("dataset_fn must take one argument, the InputContext", "signature ()", "def fn(ctx)"),
        each_strategy=True,
    ),
    Case(
        "distribute_datasets_from_function(a list)",
        lambda env: env.strategy.distribute_datasets_from_function([_X]),
        errors.InvalidArgumentTypeError,
        ("dataset_fn must be callable", "received list"),
        each_strategy=True,
    ),
    Case(
        "experimental_distribute_values_from_function(fn without the context argument)",
        lambda env: env.strategy.experimental_distribute_values_from_function(lambda: 1.0),
        errors.InvalidArgumentTypeError,
        ("value_fn must take one argument, the ValueContext", "def fn(ctx)"),
        each_strategy=True,
    ),
    Case(
        "InputOptions(experimental_per_replica_buffer_size=0)",
        lambda env: mirrax.InputOptions(experimental_per_replica_buffer_size=0),
        errors.InvalidArgumentError,
        ("experimental_per_replica_buffer_size must be an int >= 1", "received 0"),
    ),
    Case(
        "InputOptions(experimental_fetch_to_device='yes')",
        lambda env: mirrax.InputOptions(experimental_fetch_to_device="yes"),
        errors.InvalidArgumentTypeError,
        ("experimental_fetch_to_device must be True or False", "received 'yes'"),
    ),
    Case(
        "InputOptions(experimental_auto_shard_policy='FILES')",
        lambda env: mirrax.InputOptions(experimental_auto_shard_policy="FILES"),
        errors.InvalidArgumentError,
        ("must be one of ['AUTO', 'FILE', 'DATA', 'OFF']", "received 'FILES'"),
    ),
    Case(
        "InputOptions(experimental_place_dataset_on_device=True)",
        lambda env: mirrax.InputOptions(experimental_place_dataset_on_device=True),
        errors.UnsupportedArgumentError,
        ("experimental_place_dataset_on_device=True) is not supported", "experimental_fetch_to_device=True"),
    ),
    Case(
        "InputContext(input_pipeline_id=2 of 2)",
        lambda env: mirrax.InputContext(num_input_pipelines=2, input_pipeline_id=2),
        errors.InvalidArgumentError,
        ("input_pipeline_id must be in [0, num_input_pipelines) = [0, 2)", "received 2"),
    ),
    Case(
        "InputContext(num_replicas_in_sync=0)",
        lambda env: mirrax.InputContext(num_replicas_in_sync=0),
        errors.InvalidArgumentError,
        ("num_replicas_in_sync must be >= 1", "received num_replicas_in_sync=0"),
    ),
    Case(
        "get_per_replica_batch_size(0)",
        lambda env: mirrax.InputContext(1, 0, 2).get_per_replica_batch_size(0),
        errors.InvalidArgumentError,
        ("global_batch_size must be >= 1", "received global_batch_size=0"),
    ),
    Case(
        "get_per_replica_batch_size(64.0)",
        lambda env: mirrax.InputContext(1, 0, 2).get_per_replica_batch_size(64.0),
        errors.InvalidArgumentTypeError,
        ("global_batch_size must be an int", "received float 64.0", "global_batch_size=64"),
    ),
    Case(
        "get_per_replica_batch_size(5) over 2 replicas",
        lambda env: mirrax.InputContext(1, 0, 2).get_per_replica_batch_size(5),
        errors.InvalidArgumentError,
        ("5 is not divisible by num_replicas_in_sync 2", "e.g. 6"),
    ),
    # -- losses -----------------------------------------------------------------------------
    Case(
        "compute_average_loss(global_batch_size=2.5)",
        lambda env: mirrax.compute_average_loss(np.ones(4, np.float32), global_batch_size=2.5),
        errors.InvalidArgumentTypeError,
        ("global_batch_size must be an int", "received 2.5 of type float", "use // rather than /"),
    ),
    Case(
        "compute_average_loss(global_batch_size=0)",
        lambda env: mirrax.compute_average_loss(np.ones(4, np.float32), global_batch_size=0),
        errors.InvalidArgumentError,
        ("global_batch_size must be positive", "received 0"),
    ),
    Case(
        "compute_average_loss(a scalar loss)",
        lambda env: mirrax.compute_average_loss(np.float32(1.0), global_batch_size=4),
        errors.InvalidArgumentError,
        ("must have a leading batch axis", "received a scalar", "reduction=None"),
    ),
    Case(
        "compute_average_loss(a string)",
        lambda env: mirrax.compute_average_loss("loss", global_batch_size=4),
        errors.InvalidArgumentTypeError,
        ("per_example_loss must be an array of losses", "'loss' of type str"),
    ),
    Case(
        "compute_average_loss(sample_weight of another length)",
        lambda env: mirrax.compute_average_loss(
            np.ones(4, np.float32), sample_weight=np.ones(3), global_batch_size=4
        ),
        errors.InvalidArgumentError,
        ("sample_weight of shape (3,) does not fit", "shape (4,)"),
    ),
    Case(
        "compute_average_loss in cross-replica context without global_batch_size",
        lambda env: _in_scope(env, lambda: mirrax.compute_average_loss(np.ones(4, np.float32))),
        errors.ReplicaContextError,
        ("cross-replica context", "global_batch_size="),
        each_strategy=True,
    ),
    Case(
        "value_and_grad(3)",
        lambda env: mirrax.value_and_grad(3),
        errors.InvalidArgumentTypeError,
        ("fn must be a function fn(module, *args)", "received 3 of type int"),
    ),
    Case(
        "value_and_grad(all_reduce_dtype='int8')",
        lambda env: mirrax.value_and_grad(lambda m: 0.0, all_reduce_dtype="int8"),
        errors.InvalidArgumentTypeError,
        ("all_reduce_dtype must be None or a floating dtype", "received 'int8'"),
    ),
    # -- replica context --------------------------------------------------------------------
    Case(
        "all_reduce('max') in a step",
        lambda env: _inside_run(env, lambda: mirrax.get_replica_context().all_reduce("max", 1.0)),
        errors.InvalidArgumentError,
        ("reduce_op must be one of", "received 'max'"),
        each_strategy=True,
    ),
    Case(
        "all_gather(axis='0') in a step",
        lambda env: _inside_run(env, lambda: mirrax.get_replica_context().all_gather(np.ones(2), axis="0")),
        errors.InvalidArgumentTypeError,
        ("all_gather: axis must be an int", "received '0' of type str"),
        each_strategy=True,
    ),
    Case(
        "all_gather(axis=3) of a vector in a step",
        lambda env: _inside_run(env, lambda: mirrax.get_replica_context().all_gather(np.ones(2), axis=3)),
        errors.InvalidArgumentError,
        ("axis 3 is out of range for a value of shape (2,)", "[-1, 1)"),
        each_strategy=True,
    ),
    # -- multi-worker options and cluster resolvers -----------------------------------------
    Case(
        "CommunicationOptions(timeout_seconds=0)",
        lambda env: mirrax.CommunicationOptions(timeout_seconds=0),
        errors.InvalidArgumentError,
        ("timeout_seconds must be None or a number > 0", "received 0"),
    ),
    Case(
        "CommunicationOptions(implementation='gloo')",
        lambda env: mirrax.CommunicationOptions(implementation="gloo"),
        errors.InvalidArgumentError,
        ("implementation must be one of ['AUTO', 'RING', 'NCCL']", "received 'gloo'"),
    ),
    Case(
        "CommunicationOptions(bytes_per_pack=-1)",
        lambda env: mirrax.CommunicationOptions(bytes_per_pack=-1),
        errors.InvalidArgumentError,
        ("bytes_per_pack must be an int >= 0", "received -1", "leave it out"),
    ),
    Case(
        "MultiWorkerMirroredStrategy(communication_options='ring')",
        lambda env: mirrax.MultiWorkerMirroredStrategy(communication_options="ring"),
        errors.InvalidArgumentTypeError,
        ("communication_options must be a mirrax.CommunicationOptions", "received str"),
    ),
    Case(
        "ClusterSpec({'worker': 'host:2222'})",
        lambda env: mirrax.ClusterSpec({"worker": "host:2222"}),
        errors.InvalidArgumentError,
        ("job 'worker' must be a list of 'host:port' addresses", "received str 'host:2222'"),
    ),
    Case(
        "ClusterSpec with a port outside [1, 65535]",
        lambda env: mirrax.ClusterSpec({"worker": ["a:70000"]}),
        errors.InvalidArgumentError,
        ("'a:70000'", "[1, 65535]"),
    ),
    Case(
        "ClusterSpec with two tasks on one address",
        lambda env: mirrax.ClusterSpec({"worker": ["a:1", "a:1"]}),
        errors.InvalidArgumentError,
        ("worker:0 and worker:1 have the same address 'a:1'", "its own host:port"),
    ),
    Case(
        "SimpleClusterResolver(task_id='0')",
        lambda env: mirrax.SimpleClusterResolver({"worker": ["a:1"]}, task_type="worker", task_id="0"),
        errors.InvalidArgumentTypeError,
        ("the task index must be an int", "received '0' of type str", "task_id=0"),
    ),
    Case(
        "SimpleClusterResolver(task_id=3) of 2 workers",
        lambda env: mirrax.SimpleClusterResolver({"worker": ["a:1", "b:1"]}, task_type="worker", task_id=3),
        errors.InvalidArgumentError,
        ("task index 3 is out of range for job 'worker'", "[0, 1]"),
    ),
    Case(
        "SimpleClusterResolver(task_type='master')",
        lambda env: mirrax.SimpleClusterResolver({"worker": ["a:1"]}, task_type="master", task_id=0),
        errors.InvalidArgumentError,
        ("unknown task type 'master'", "['worker']"),
    ),
    Case(
        "TFConfigClusterResolver on TF_CONFIG that is not JSON",
        lambda env: mirrax.TFConfigClusterResolver(tf_config="{cluster: }"),
        errors.InvalidArgumentError,
        ("TF_CONFIG is not valid JSON", "received '{cluster: }'", '{"cluster": {"worker"'),
    ),
    Case(
        "TF_CONFIG with index '1' (a string)",
        lambda env: mirrax.TFConfigClusterResolver(tf_config=_tf_config({"type": "worker", "index": "1"})),
        errors.InvalidArgumentError,
        ("task 'index' must be an int such as 0", "received '1'"),
    ),
    Case(
        "SlurmClusterResolver(port='8888')",
        lambda env: mirrax.SlurmClusterResolver(port="8888", environ={}),
        errors.InvalidArgumentError,
        ("port must be an int in 1..65535", "received '8888'"),
    ),
    Case(
        "SlurmClusterResolver(environ=['SLURM_PROCID'])",
        lambda env: mirrax.SlurmClusterResolver(environ=["SLURM_PROCID"]),
        errors.InvalidArgumentTypeError,
        ("environ must be None (os.environ) or a mapping", "received list"),
    ),
    Case(
        "SlurmClusterResolver outside srun",
        lambda env: mirrax.SlurmClusterResolver(environ={}),
        errors.InvalidArgumentError,
        ("SLURM variables ['SLURM_PROCID', 'SLURM_NTASKS'", "Start the program with `srun`"),
    ),
    # -- mirrax.data --------------------------------------------------------------------------
    Case(
        "load_digits(test_fraction=20)",
        lambda env: mirrax.data.load_digits(20),
        errors.InvalidArgumentError,
        ("test_fraction must be a number strictly between 0 and 1", "received 20", "0.2"),
    ),
    Case(
        "load_digits(seed=-1)",
        lambda env: mirrax.data.load_digits(seed=-1),
        errors.InvalidArgumentError,
        ("seed must be an int in [0, 2**32)", "received -1", "seed=0"),
    ),
    Case(
        "load_cifar10(a missing folder)",
        lambda env: mirrax.data.load_cifar10(env.tmp_path / "nothing-here"),
        errors.MissingDatasetError,
        ("CIFAR-10 not found in", "nothing-here", "data_batch_1"),
    ),
    Case(
        "load_cifar10(3)",
        lambda env: mirrax.data.load_cifar10(3),
        errors.InvalidArgumentTypeError,
        ("path must be a folder or the cifar-10-python.tar.gz archive", "received 3 of type int"),
    ),
    Case(
        "FileDataset([])",
        lambda env: mirrax.data.FileDataset([], np.load, 8),
        errors.InvalidArgumentError,
        ("files is empty", "train on nothing", "check the glob pattern"),
    ),
    Case(
        "FileDataset('data.npy')",
        lambda env: mirrax.data.FileDataset("data.npy", np.load, 8),
        errors.InvalidArgumentTypeError,
        ("files must be a sequence of paths", "'data.npy'", "FileDataset(['data.npy'], ...)"),
    ),
    Case(
        "FileDataset(batch_size=0)",
        lambda env: mirrax.data.FileDataset(["a.npy"], np.load, 0),
        errors.InvalidArgumentError,
        ("batch_size must be an int >= 1", "received 0"),
    ),
    # -- the CPU device count ------------------------------------------------------------------
    Case(
        "set_cpu_device_count(4) after JAX started with 8",
        lambda env: mirrax.set_cpu_device_count(4),
        errors.StartedBackendError,
        (
            "JAX already started in this process with 8 CPU device(s)",
            "Restart the kernel",
            "set_cpu_device_count(4)",
        ),
    ),
    Case(
        "set_cpu_device_count(0)",
        lambda env: mirrax.set_cpu_device_count(0),
        errors.InvalidArgumentError,
        ("count must be >= 1", "received 0"),
    ),
    Case(
        "set_cpu_device_count('8')",
        lambda env: mirrax.set_cpu_device_count("8"),
        errors.InvalidArgumentTypeError,
        ("count must be an int >= 1", "received '8' of type str", "set_cpu_device_count(8)"),
    ),
]


def _batches():
    yield _X


def _in_scope(env, fn):
    with env.strategy.scope():
        return fn()


def _enter_another_scope():
    with mirrax.MirroredStrategy(["cpu:5", "cpu:6"]).scope():
        pass
