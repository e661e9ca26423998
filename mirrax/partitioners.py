"""How a ParameterServerStrategy cuts large variables into shards, as
`tf.distribute.experimental.partitioners`."""

from mirrax._src.parameter_server.partitioners import FixedShardsPartitioner as FixedShardsPartitioner
from mirrax._src.parameter_server.partitioners import MaxSizePartitioner as MaxSizePartitioner
from mirrax._src.parameter_server.partitioners import MinSizePartitioner as MinSizePartitioner
from mirrax._src.parameter_server.partitioners import Partitioner as Partitioner

__all__ = ["FixedShardsPartitioner", "MaxSizePartitioner", "MinSizePartitioner", "Partitioner"]
