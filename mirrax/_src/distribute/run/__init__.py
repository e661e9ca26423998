"""`strategy.run`: one user function, compiled once into ONE `jax.jit(jax.shard_map(...))` program.

The rooms: `arguments` sorts a call's arguments into the program's slots; `nodes` finds the NNX
objects' Variables (and skips that walk when the same objects come back unchanged); `program`
builds the compiled step (the per-replica body and the aggregation of the new state);
`captures` refuses NNX state reached other than through the arguments; `placement` puts inputs
on the replicas; `runner` ties one call together and owns a strategy's caches.
"""
