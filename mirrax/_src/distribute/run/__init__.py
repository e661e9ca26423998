"""`strategy.run`: one user function, compiled once into ONE `jax.jit(jax.shard_map(...))` program.

The rooms: `arguments` sorts a call's arguments into the program's slots; `nodes` finds the NNX
objects' Variables (and skips that walk when the same objects come back unchanged); `program`
builds the compiled step (the per-replica body and the aggregation of the new state);
`captures` finds the NNX objects a step captures (closure, globals, `self`) and keys the
program by the function's code and what it captures, `rebuild` gives the traced body a copy of
the step reaching the program's objects instead; `placement` puts inputs
on the replicas; `runner` ties one call together and owns a strategy's caches.
"""
