"""Replica-invariant mode: each global batch as `micro_batches` virtual replicas, summed in one fixed tree.

With `replica_invariant=True, micro_batches=M` a strategy computes as if it had M replicas of one
micro-batch each, whatever its real replica count R (a power of two that divides M). Replica r
holds the L = M / R consecutive micro-batches r*L .. r*L + L - 1 of the global batch. Three
things make the result the same bits at every R (docs/design.md, "Replica invariance"):

- Same shapes, same kernels: `micro_batch_call` runs the user's loss once per micro-batch
  (unrolled), so each micro-batch's forward and backward pass is the same computation at every
  R; on CPU the step is compiled without XLA's algebraic simplifier and fusion
  (`compiler_options`), whose rewrites depend on the program around that computation.
- One summation tree: a float sum over micro-batches is the balanced pairwise tree over the
  micro-batch index (exact_sums.py). A replica adds its L micro-batches' values pairwise
  (`pairwise_sum`), and `exact_psum` continues the same tree across replicas: an all-to-all
  gives replica j chunk j of every replica's partial sum, it adds them pairwise in replica
  order, and an all-gather hands the chunks to everyone. Every replica then holds the same bits,
  JAX types them as unvarying, and the bytes moved are a ring all-reduce's (2(R-1)/R of the
  vector per replica).
- Randomness keyed by the global micro-batch index r*L + l, not the replica id.

State that the loss changes (BatchNorm statistics, metric totals, RNG counts) is combined over
the M micro-batches by each variable's `VariableAggregation`, in the same tree, as `strategy.run`
combines it over real replicas.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mirrax import errors
from mirrax._src import argument_checks
from mirrax._src.distribute import _compat, exact_sums, prng_keys
from mirrax._src.distribute.reduce import VariableAggregation, aggregation_of
from mirrax._src.distribute.replica_context import REPLICA_AXIS, current_replica_context


def check_arguments(owner: str, replica_invariant, micro_batches) -> None:
    """Refuses a non-bool `replica_invariant` or a `micro_batches` that is not a power of two.

    Raises:
      InvalidArgumentTypeError: `replica_invariant` is not a bool, `micro_batches` not an int.
      InvalidArgumentError: `micro_batches` is not a power of two >= 1.
    """
    argument_checks.flag(owner, "replica_invariant", replica_invariant)
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, (int, np.integer)):
        raise errors.InvalidArgumentTypeError(
            f"{owner}: micro_batches must be an int, a power of two (1, 2, 4, 8, 16, ...); "
            f"received {micro_batches!r} of type {type(micro_batches).__name__}."
        )
    if micro_batches < 1 or micro_batches & (micro_batches - 1):
        below = 1 << max(int(micro_batches).bit_length() - 1, 0)
        fix = (
            f"Use {below} or {below * 2}"
            if micro_batches > 1
            else "Use a power of two >= 1, e.g. 8 (the default)"
        )
        raise errors.InvalidArgumentError(
            f"{owner}: micro_batches must be a power of two (1, 2, 4, 8, 16, ...), so that one "
            f"pairwise summation tree covers it at every replica count; received "
            f"{micro_batches}. {fix}."
        )


def check_replicas(owner: str, micro_batches: int, num_replicas: int) -> None:
    """Refuses a replica count that does not divide `micro_batches` (replica_invariant=True).

    Raises:
      InvalidArgumentError: `num_replicas` does not divide `micro_batches`.
    """
    if micro_batches % num_replicas == 0:
        return
    counts = ", ".join(str(1 << i) for i in range(micro_batches.bit_length()))
    fewer = 1 << (min(num_replicas, micro_batches).bit_length() - 1)
    if num_replicas & (num_replicas - 1) == 0:
        more = f"or micro_batches={num_replicas} (or another power of two >= {num_replicas})"
    else:
        more = (
            f"{num_replicas} is not a power of two, so it divides no micro_batches; "
            f"use {fewer} or {fewer * 2} devices"
        )
    raise errors.InvalidArgumentError(
        f"{owner}: replica_invariant=True cuts every global batch into micro_batches="
        f"{micro_batches} micro-batches held in equal runs by the replicas, but "
        f"{num_replicas} replicas do not divide {micro_batches}. Use a replica count that "
        f"divides it ({counts}; e.g. devices=jax.local_devices()[:{fewer}]), {more}."
    )


def check_global_batch(what: str, global_batch: int, micro_batches: int) -> None:
    """Refuses a global batch size that `micro_batches` does not divide.

    Raises:
      InvalidBatchError: `global_batch % micro_batches != 0`.
    """
    if global_batch % micro_batches:
        lower = global_batch // micro_batches * micro_batches
        upper = lower + micro_batches
        examples = f"{lower} or {upper}" if lower else f"{upper}"
        raise errors.InvalidBatchError(
            f"{what}: replica_invariant=True cuts every global batch into micro_batches="
            f"{micro_batches} equal micro-batches, but the first global batch has "
            f"{global_batch} examples, which {micro_batches} does not divide. Use a global batch "
            f"size that is a multiple of {micro_batches} (e.g. {examples}); a "
            "smaller last batch is fine (it is padded), or give the strategy another "
            "micro_batches."
        )


def compiler_options(strategy) -> dict | None:
    """XLA options for the step programs of `strategy`: in replica-invariant mode on CPU, XLA's
    algebraic simplifier and instruction fusion off.

    Each replica count is its own XLA program, and both passes decide by the program around
    the micro-batch's computation: the simplifier rewrites float expressions (a / (b / c)
    into a * c / b, and the like) by patterns, and a fusion computes a * b + c as one fused
    multiply-add when both ops land in it. With them on, a cross-entropy on probabilities,
    optax.MultiSteps and a BatchNorm running variance rounded differently on 1 or 8 replicas
    than on 2 (BENCHMARKS.md, "Replica-invariant mode", has the cost). Without them every
    operation is computed alone, in IEEE arithmetic, the same at every replica count.
    Other platforms: None (see docs/design.md, "Replica invariance", for GPU).
    """
    if not strategy.replica_invariant or strategy.mesh.devices.flat[0].platform != "cpu":
        return None
    return {"xla_disable_hlo_passes": "algsimp,fusion"}


# -- one loss per micro-batch ------------------------------------------------------------------


def active(ctx=None) -> bool:
    """True inside `strategy.run` of a strategy in replica-invariant mode."""
    ctx = current_replica_context() if ctx is None else ctx
    return ctx is not None and ctx.traced and ctx.strategy.replica_invariant


def micro_batch_call(
    fn: Callable,
    nodes: tuple,
    batch: tuple,
    differentiate: bool,
    has_aux: bool = False,
    what: str = "mirrax.value_and_grad",
):
    """Runs `fn(nodes, *batch)` once per local micro-batch; sums and aggregates in the fixed tree.

    Inside `strategy.run` in replica-invariant mode. `fn` returns a scalar value (or
    `(value, aux)` with `has_aux`); it may update the NNX state of `nodes` (BatchNorm
    statistics, metrics, RNG counts): each micro-batch starts from the same state and the
    updates are combined over all micro-batches by each variable's aggregation.

    Args:
      fn: `fn(nodes, *micro_batch)`.
      nodes: a tuple of NNX objects; the `nnx.Param`s of all of them are differentiated.
      batch: a tuple of pytrees whose array leaves have this replica's batch rows first
        (shape (rows, ...)); each is cut into L = micro_batches / replicas micro-batches of
        rows / L. Python scalars are passed to every micro-batch as they are.
      differentiate: also return the gradients of the value.

    Returns:
      `(value, aux, grads)`: `value`, this replica's share (the pairwise sum over its
      micro-batches; varying, as in default mode); `aux` with leaves of shape (rows / L, ...)
      joined back into (rows, ...) and other leaves stacked as (L, ...); `grads`, an
      `nnx.State` of the parameters' gradients summed over all M micro-batches (unvarying), or
      None without `differentiate`.

    Raises:
      UnsupportedArgumentError: a BatchNorm synchronizes over the replicas (`axis_name`).
      InvalidBatchError: an array of `batch` does not have the batch's rows first, or the rows
        do not split into the replica's micro-batches.
    """
    ctx = current_replica_context()
    assert ctx is not None  # called only while strategy.run traces a step
    strategy = ctx.strategy
    replicas = strategy.num_replicas_in_sync
    local = strategy.micro_batches // replicas
    check_no_sync_batch_norm(nodes, what)

    leaves, batch_def = jax.tree.flatten(batch)
    # Scalars (a temperature, a step count) are no batch: every micro-batch gets them as is.
    arrays = [
        i for i, leaf in enumerate(leaves) if isinstance(leaf, (jax.Array, np.ndarray)) and np.ndim(leaf) > 0
    ]
    mask = ctx.peek_batch_mask()  # the split only: the loss itself must read the mask
    if not arrays:
        raise errors.InvalidBatchError(
            f"{what}: replica_invariant=True splits the batch into micro-batches, but the "
            "arguments after the module hold no array (a loss that reads the batch from a "
            "closure cannot be split). Call it as value_and_grad(loss_fn)(model, batch) with "
            "loss_fn(model, batch) taking the batch as an argument."
        )
    rows = mask.shape[0] if mask is not None else leaves[arrays[0]].shape[0]
    if rows % local:
        raise errors.InvalidBatchError(
            f"{what}: this replica's batch has {rows} rows, which do not split into its {local} "
            f"micro-batches (micro_batches={strategy.micro_batches} over {replicas} replicas). "
            f"Use a global batch size that is a multiple of {strategy.micro_batches}."
        )
    for i in arrays:
        shape = np.shape(leaves[i])
        if REPLICA_AXIS not in _compat.varying_axes(jnp.asarray(leaves[i])):
            raise errors.InvalidBatchError(
                f"{what}: replica_invariant=True splits the batch into this replica's "
                f"micro-batches, but an array of shape {shape} after the module is the same on "
                "every replica (it was passed to strategy.run as a plain array, not a "
                "distributed batch). Pass the batch from strategy.experimental_distribute_dataset "
                "(or a PerReplica), so each replica holds its own rows."
            )
        if not shape or shape[0] != rows:
            raise errors.InvalidBatchError(
                f"{what}: replica_invariant=True splits every array argument after the module "
                f"along its first axis into micro-batches, but one has shape {shape} and the "
                f"batch has {rows} rows. Pass only the batch (arrays of shape ({rows}, ...)) "
                "after the module; reach other arrays through a closure."
            )
    size = rows // local
    micro_leaves = [jnp.reshape(leaves[i], (local, size) + np.shape(leaves[i])[1:]) for i in arrays]
    if mask is None:
        mask = jnp.ones((rows,), bool)
    count = ctx.example_count
    if count is None:
        count = jax.lax.psum(_compat.pvary(mask.sum(dtype=jnp.int32), REPLICA_AXIS), REPLICA_AXIS)
    masks = mask.reshape(local, size)

    # flax types nnx.split's result as a variadic tuple, which mypy will not unpack into names.
    graphdef, params, rest = nnx.split(nodes, nnx.Param, ...)  # type: ignore[misc]
    param_leaves, param_def = jax.tree.flatten(params)
    rest_leaves, rest_def = jax.tree.flatten(rest)
    rest_variables = _variable_of_each_leaf(rest)
    # Differentiate a varying view of the parameters: JAX then inserts no psum of its own,
    # and the gradients are summed below, in the tree.
    varying_params = [_compat.pvary(p, REPLICA_AXIS) for p in param_leaves]
    first_micro_batch = jax.lax.axis_index(REPLICA_AXIS) * local
    changed: list = []

    def one(p_leaves, r_leaves, micro, micro_mask, index):
        module = nnx.merge(
            graphdef, jax.tree.unflatten(param_def, p_leaves), jax.tree.unflatten(rest_def, r_leaves)
        )
        call_leaves = list(leaves)
        for i, x in zip(arrays, micro):
            call_leaves[i] = x
        with prng_keys.folded(module, first_micro_batch + index), ctx.micro_batch(micro_mask, count):
            out = fn(module, *jax.tree.unflatten(batch_def, call_leaves))
        value, aux = out if has_aux else (out, None)
        # flax types nnx.split's result as a variadic tuple, which mypy will not unpack into names.
        _, _, new_rest = nnx.split(module, nnx.Param, ...)  # type: ignore[misc]
        new_leaves, new_def = jax.tree.flatten(new_rest)
        # jaxlib ships PyTreeDef (jaxlib/_jax.so) without type stubs: mypy cannot type its methods.
        if new_def != rest_def:  # type: ignore[operator]
            raise errors.UnsupportedArgumentError(
                f"{what}: the loss function added or removed NNX variables, which "
                "replica_invariant=True cannot combine over micro-batches. Create every "
                "variable before training (in the module's __init__)."
            )
        if not changed:
            changed.append([i for i, (a, b) in enumerate(zip(new_leaves, r_leaves)) if a is not b])
        return jnp.asarray(value), (aux, [new_leaves[i] for i in changed[0]])

    def body(inputs, index):
        p_leaves, r_leaves, micro, micro_mask = inputs
        if differentiate:
            (value, (aux, new)), grads = jax.value_and_grad(one, has_aux=True)(
                p_leaves, r_leaves, micro, micro_mask, index
            )
        else:
            value, (aux, new) = one(p_leaves, r_leaves, micro, micro_mask, index)
            grads = None
        return value, aux, new, grads

    values, auxs, news, grads = _each_micro_batch(
        body, (varying_params, rest_leaves), (micro_leaves, masks), local
    )

    ctx.micro_batches_used = True
    if changed and changed[0]:
        final = list(rest_leaves)
        for position, i in enumerate(changed[0]):
            final[i] = _combine(rest_variables[i], rest_leaves[i], news[position], strategy.micro_batches)
            ctx.mark_combined(final[i])
        nnx.update(nodes, jax.tree.unflatten(rest_def, final))
    if differentiate:
        summed = exact_sums.exact_psum([exact_sums.pairwise_sum(g) for g in grads])
        grads = jax.tree.unflatten(param_def, summed)
    aux = jax.tree.map(
        lambda a: a.reshape((rows,) + a.shape[2:]) if a.ndim >= 2 and a.shape[1] == size else a, auxs
    )
    return exact_sums.pairwise_sum(values), aux, grads


def _each_micro_batch(body, shared, inputs, count: int):
    """`body((*shared, *inputs[i]), i)` for i in range(count), stacked along a new first axis.

    Unrolled, each micro-batch's arguments (the shared parameters and state included) and
    results behind an optimization barrier. XLA:CPU removes barriers before fusion, so there
    the isolation comes from compiling without fusion (`compiler_options`); the barriers keep
    other backends from sharing work across micro-batches. Not a `lax.scan`: XLA:CPU runs a
    loop body's convolutions and matrix products several times slower than straight-line
    code (the tutorial CNN's gradient on 2 x 16 images: 157 ms in a loop, 13.5 ms unrolled).
    """
    if count == 1:
        # A spare row, never computed: at one micro-batch per replica a[0] would be a reshape
        # of the input rather than a slice of it, and XLA then reads it in place, which rounded
        # BatchNorm's statistics differently than at other replica counts.
        inputs = jax.tree.map(lambda a: jnp.concatenate([a, jnp.zeros_like(a)]), inputs)
    outputs = []
    for i in range(count):
        arguments = exact_sums.barrier(tuple(shared) + jax.tree.map(lambda a, i=i: a[i], tuple(inputs)))
        outputs.append(exact_sums.barrier(body(arguments, i)))
    return jax.tree.map(lambda *parts: jnp.stack(parts), *outputs)


def _combine(variable, before, stacked, micro_batches: int):
    """One variable's new value from its L per-micro-batch values (stacked), over all micro-batches."""
    aggregation = aggregation_of(variable)
    if aggregation is VariableAggregation.SUM:
        return before + exact_sums.exact_psum(exact_sums.pairwise_sum(stacked - before[None]))
    if aggregation is VariableAggregation.MEAN:
        total = exact_sums.exact_psum(
            exact_sums.pairwise_sum(stacked.astype(jnp.result_type(stacked, jnp.float32)))
        )
        return (total / micro_batches).astype(stacked.dtype)
    if aggregation is VariableAggregation.ONLY_FIRST_REPLICA:
        return _compat.all_gather_invariant(stacked[0][None], REPLICA_AXIS)[0]
    # NONE: every micro-batch must agree; one that does not is varying, and strategy.run's
    # write-back names it.
    return stacked[0]


def _variable_of_each_leaf(state) -> list:
    """The nnx.Variable holding each leaf of `jax.tree.leaves(state)`, in that order."""
    variables = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    out = []
    for variable in variables:
        count = len(jax.tree.leaves(variable.get_value())) if isinstance(variable, nnx.Variable) else 1
        out.extend([variable] * count)
    return out


def check_no_sync_batch_norm(nodes, what: str) -> None:
    """Refuses a BatchNorm with `axis_name` among `nodes` (replica-invariant mode).

    Raises:
      UnsupportedArgumentError: naming the BatchNorm's path.
    """
    for path, node in nnx.iter_graph(nodes):
        if isinstance(node, nnx.BatchNorm) and getattr(node, "axis_name", None) is not None:
            name = ".".join(map(str, path[1:])) or type(node).__name__  # path[0]: the tuple slot
            raise errors.UnsupportedArgumentError(
                f"{what}: BatchNorm {name} synchronizes its statistics over the replicas "
                f"(axis_name={node.axis_name!r}), which replica_invariant=True cannot make the "
                "same at every replica count: each micro-batch is a virtual replica. Leave "
                "axis_name out: in this mode BatchNorm normalizes each micro-batch (as on "
                "micro_batches replicas without synchronization), and its running statistics "
                "are the mean over all micro-batches."
            )
