"""The one mesh axis of every strategy's mesh: its replicas."""

REPLICA_AXIS = "replica"
"""The name of the strategy mesh's only axis. Pass it as `nnx.BatchNorm(axis_name=REPLICA_AXIS)`
for batch statistics synchronized over all replicas, or to any `jax.lax` collective inside
`strategy.run`."""
