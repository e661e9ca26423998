"""All-reduce bytes of strategy.run's compiled train step (HLO) against one pass over the gradients.

Data parallelism must move each gradient across replicas once per step: for float32 that is
4 bytes x parameters, the minimum. This benchmark compiles (never times) the train step that
`strategy.run(train_step, args=(model, optimizer, batch))` builds, reads XLA's HLO text and
counts the cross-replica collectives in it:

- before optimization: `lowered.as_text(dialect="hlo")`, the program as JAX emits it (one
  `all-reduce` per gradient leaf, from the transpose of the implicit broadcast of each
  replicated parameter inside `shard_map`);
- after optimization: `lowered.compile().as_text()`, after XLA's all-reduce combiner, which
  packs many all-reduces into one with a tuple of operands.

For every collective (`all-reduce`, `all-reduce-start`, `reduce-scatter`, `all-gather`,
`all-gather-start`, `all-to-all`, `collective-permute`) the bytes of its result shape are summed
(tuples included; for an all-reduce the result has the operands' shapes). Each all-reduced
array is matched against the parameter shapes: one of each parameter's element count is a
gradient; rank-0 arrays are scalars (a loss or a metric psum); anything else is "other" and
is listed. Reported per workload and replica count: parameters, the minimum (4 x parameters),
the all-reduce bytes, their ratio to the minimum (target 1.00), the number of all-reduce ops
before and after the combiner, and the non-gradient all-reduced arrays.

The program is the one `strategy.run` itself compiled and runs: after one real step,
`strategy.experimental_lower` lowers it on the same arguments (nothing runs again).

Workloads, each trained with `nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)` by
`workloads.strategy_run_step` (`compute_average_loss` with the global batch size given, so the
loss needs no psum), per-replica batch 32:

- CNN: the TF tutorial CNN (`workloads.CNN`), 28x28x1 inputs;
- MLP: 784 -> 1024 relu -> 1024 relu -> 10;
- Transformer: a 4-layer pre-LayerNorm encoder, d_model 256, 4 heads, MLP 1024 (gelu),
  sequence length 64, vocabulary 1000, learned positions, mean pooling, a 10-class head.

`memory.py` imports the workloads and `compile_train_step` from here. Each replica count runs
in a fresh subprocess (`XLA_FLAGS=--xla_force_host_platform_device_count=N` is read when JAX
starts), as in `overhead.py`.

Usage:
  python benchmarks/communication.py                  # 2, 4 and 8 fake CPU devices
  python benchmarks/communication.py --devices 4      # one count, in this process
  python benchmarks/communication.py --json out.json  # also write the results as JSON
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
import time

import overhead

PER_REPLICA_BATCH = 32
SEQUENCE_LENGTH = 64
VOCABULARY = 1000
COLLECTIVES = (
    "all-reduce",
    "all-reduce-start",
    "reduce-scatter",
    "all-gather",
    "all-gather-start",
    "all-to-all",
    "collective-permute",
)
_BYTES_PER_ELEMENT = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}
_ARRAY = re.compile(r"\b(" + "|".join(_BYTES_PER_ELEMENT) + r")\[([0-9,]*)\]")
# `  [ROOT] %name = SHAPE opcode(operands), ...`; SHAPE is one array or a (tuple, of, arrays).
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s([a-z][a-z\-]*)\(")


# -- the workloads -------------------------------------------------------------------------------


def _nnx():
    from flax import nnx

    return nnx


def WideMLP(rngs):
    """784 -> 1024 relu -> 1024 relu -> 10; input (batch, 784) float32, logits (batch, 10)."""
    nnx = _nnx()

    class _WideMLP(nnx.Module):
        def __init__(self, rngs):
            self.dense1 = nnx.Linear(784, 1024, rngs=rngs)
            self.dense2 = nnx.Linear(1024, 1024, rngs=rngs)
            self.dense3 = nnx.Linear(1024, 10, rngs=rngs)

        def __call__(self, x):
            return self.dense3(nnx.relu(self.dense2(nnx.relu(self.dense1(x)))))

    return _WideMLP(rngs)


def Transformer(rngs, layers=4, d_model=256, heads=4, mlp=1024):
    """A pre-LayerNorm encoder classifier; tokens (batch, 64) int32 in [0, 1000), logits (batch, 10)."""
    nnx = _nnx()

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.norm1 = nnx.LayerNorm(d_model, rngs=rngs)
            self.attention = nnx.MultiHeadAttention(
                num_heads=heads, in_features=d_model, decode=False, rngs=rngs
            )
            self.norm2 = nnx.LayerNorm(d_model, rngs=rngs)
            self.mlp_in = nnx.Linear(d_model, mlp, rngs=rngs)
            self.mlp_out = nnx.Linear(mlp, d_model, rngs=rngs)

        def __call__(self, x):
            x = x + self.attention(self.norm1(x))
            return x + self.mlp_out(nnx.gelu(self.mlp_in(self.norm2(x))))

    class Encoder(nnx.Module):
        def __init__(self, rngs):
            self.tokens = nnx.Embed(VOCABULARY, d_model, rngs=rngs)
            self.positions = nnx.Embed(SEQUENCE_LENGTH, d_model, rngs=rngs)
            self.blocks = nnx.List([Block(rngs) for _ in range(layers)])
            self.norm = nnx.LayerNorm(d_model, rngs=rngs)
            self.head = nnx.Linear(d_model, 10, rngs=rngs)

        def __call__(self, tokens):
            import jax.numpy as jnp

            x = self.tokens(tokens) + self.positions(jnp.arange(tokens.shape[1]))
            for block in self.blocks:
                x = block(x)
            return self.head(self.norm(x).mean(axis=1))

    return Encoder(rngs)


def _images(global_batch):
    import workloads

    return workloads.random_batch((28, 28, 1), global_batch)


def _vectors(global_batch):
    import workloads

    return workloads.random_batch((784,), global_batch)


def _tokens(global_batch):
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.integers(0, VOCABULARY, size=(global_batch, SEQUENCE_LENGTH)).astype(np.int32)
    y = rng.integers(0, 10, size=(global_batch,)).astype(np.int32)
    return x, y


def _cnn(rngs):
    import workloads

    return workloads.CNN(rngs)


# name -> (model builder from nnx.Rngs, global batch size -> (x, y) NumPy arrays)
WORKLOADS = {
    "CNN": (_cnn, _images),
    "MLP 784-1024-1024-10": (WideMLP, _vectors),
    "Transformer 4x256": (Transformer, _tokens),
}


def compile_train_step(strategy, name: str, per_replica_batch: int) -> dict:
    """Runs one `strategy.run` train step of workload `name`, then lowers and compiles its program.

    Returns {"lowered", "compiled", "param_shapes" (list of shapes), "parameters" (int),
    "state_bytes" (bytes of params + optimizer state, all arrays of nnx.state)}.
    """
    import jax
    import numpy as np
    import optax
    from flax import nnx

    import workloads

    builder, make_batch = WORKLOADS[name]
    global_batch = per_replica_batch * strategy.num_replicas_in_sync
    with strategy.scope():
        model = builder(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    iterator = iter(strategy.experimental_distribute_dataset(make_batch(global_batch)))
    batch = next(iterator)
    iterator.close()
    step = workloads.strategy_run_step(global_batch)
    strategy.run(step, args=(model, optimizer, batch))
    lowered = strategy.experimental_lower(step, args=(model, optimizer, batch))
    state_leaves = jax.tree.leaves(nnx.state((model, optimizer)))
    dynamic = [leaf for value in batch for leaf in jax.tree.leaves(strategy.gather(value, 0))]
    params = jax.tree.leaves(nnx.state(model, nnx.Param))
    return {
        "lowered": lowered,
        "compiled": lowered.compile(),
        "param_shapes": [tuple(p.shape) for p in params],
        "parameters": int(sum(p.size for p in params)),
        "state_bytes": int(sum(np.asarray(x).nbytes for x in state_leaves)),
        "batch_bytes": int(sum(x.nbytes for x in dynamic)) // strategy.num_replicas_in_sync,
    }


# -- reading the HLO -----------------------------------------------------------------------------


def collectives(hlo_text: str) -> list:
    """[(opcode, [(dtype, dims), ...])] of every collective in an HLO module's text."""
    found = []
    for line in hlo_text.splitlines():
        match = _INSTRUCTION.match(line)
        if match and match.group(2) in COLLECTIVES:
            arrays = [
                (dtype, tuple(int(d) for d in dims.split(",") if d))
                for dtype, dims in _ARRAY.findall(match.group(1))
            ]
            found.append((match.group(2), arrays))
    return found


def _nbytes(array) -> int:
    dtype, dims = array
    size = 1
    for d in dims:
        size *= d
    return size * _BYTES_PER_ELEMENT[dtype]


def _describe(array) -> str:
    dtype, dims = array
    return f"{dtype}[{','.join(map(str, dims))}]"


def classify(ops: list, param_shapes: list) -> dict:
    """Splits the all-reduced arrays into gradients, scalars and other, with their bytes."""
    unmatched = collections.Counter(_size(s) for s in param_shapes)
    result = {"gradient_bytes": 0, "scalars": [], "other": [], "other_bytes": 0}
    for opcode, arrays in ops:
        if not opcode.startswith("all-reduce"):
            continue
        for array in arrays:
            size = _size(array[1])
            if array[1] == ():
                result["scalars"].append(_describe(array))
            elif unmatched[size] > 0 and array[0] == "f32":
                unmatched[size] -= 1
                result["gradient_bytes"] += _nbytes(array)
            else:
                result["other"].append(_describe(array))
                result["other_bytes"] += _nbytes(array)
    result["gradients_missing"] = sum(unmatched.values())
    return result


def _size(dims) -> int:
    size = 1
    for d in dims:
        size *= d
    return size


# -- one replica count, in this process ----------------------------------------------------------


def _measure(args, devices: int) -> dict:
    import jax

    import mirrax

    local = overhead.local_devices(args.platform, devices, "communication.py")
    rows = []
    for name in WORKLOADS:
        start = time.perf_counter()
        strategy = mirrax.MirroredStrategy(local)
        step = compile_train_step(strategy, name, args.per_replica_batch)
        before = collectives(step["lowered"].as_text(dialect="hlo"))
        after = collectives(step["compiled"].as_text())
        reduced = [op for op in after if op[0].startswith("all-reduce")]
        kinds = classify(after, step["param_shapes"])
        minimum = 4 * step["parameters"]
        allreduce_bytes = sum(_nbytes(a) for _, arrays in reduced for a in arrays)
        row = {
            "workload": name,
            "devices": devices,
            "per_replica_batch": args.per_replica_batch,
            "parameters": step["parameters"],
            "parameter_arrays": len(step["param_shapes"]),
            "minimum_bytes": minimum,
            "allreduce_bytes": allreduce_bytes,
            "ratio": allreduce_bytes / minimum,
            "allreduce_ops_before": sum(op[0].startswith("all-reduce") for op in before),
            "allreduce_ops_after": len(reduced),
            "allreduce_arrays_after": sum(len(arrays) for _, arrays in reduced),
            "other_collectives_after": sorted(
                collections.Counter(op[0] for op in after if not op[0].startswith("all-reduce"))
                .items()
            ),
            "other_collective_bytes": sum(
                _nbytes(a) for op, arrays in after if not op.startswith("all-reduce")
                for a in arrays
            ),
            "largest_allreduce_bytes": max(
                (sum(_nbytes(a) for a in arrays) for _, arrays in reduced), default=0
            ),
            **kinds,
            "seconds": time.perf_counter() - start,
        }
        print(
            f"  [{devices} {args.platform}] {name}: {row['allreduce_ops_before']} all-reduces "
            f"before, {row['allreduce_ops_after']} after, {allreduce_bytes:,} B "
            f"(x{row['ratio']:.4f} the minimum), {row['seconds']:.1f} s",
            file=sys.stderr,
            flush=True,
        )
        rows.append(row)
    env = overhead.environment(jax, local)
    env["date"] = time.strftime("%Y-%m-%d")
    return {"environment": env, "rows": rows}


# -- the table ----------------------------------------------------------------------------------


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def _markdown(results: list) -> str:
    lines = [
        "| workload | replicas | parameters | minimum (4 x params) MiB | all-reduce MiB | ratio "
        "| all-reduce ops before combiner | after | arrays after | non-gradient all-reduced "
        "| other collectives |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    rows = [row for result in results for row in result["rows"]]
    rows.sort(key=lambda r: (list(WORKLOADS).index(r["workload"]), r["devices"]))
    for row in rows:
        extra = row["scalars"] + row["other"]
        others = ", ".join(f"{n} {op}" for op, n in row["other_collectives_after"])
        lines.append(
            f"| {row['workload']} | {row['devices']} | {row['parameters']:,} "
            f"| {_mib(row['minimum_bytes'])} | {_mib(row['allreduce_bytes'])} "
            f"| {row['ratio']:.4f} | {row['allreduce_ops_before']} | {row['allreduce_ops_after']} "
            f"| {row['allreduce_arrays_after']} | {', '.join(extra) or 'none'} "
            f"| {others or 'none'} |"
        )
    env = results[0]["environment"]
    lines.append("")
    lines.append(
        f"{env['date']}; {overhead.environment_note(env)} Static analysis (compile only): "
        f"per-replica batch {rows[0]['per_replica_batch']}, Adam; bytes are the result shapes "
        "of the collectives in the optimized HLO (`compiled.as_text()`); ops before: "
        "`lowered.as_text(dialect='hlo')`."
    )
    return "\n".join(lines)


def _parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--devices",
        default="2,4,8",
        help="comma-separated replica counts; each runs in a fresh subprocess when more than one "
        "is given (default: 2,4,8)",
    )
    parser.add_argument("--platform", default="cpu", choices=["cpu", "gpu", "tpu"],
                        help="cpu uses N fake host devices; gpu/tpu the first N local accelerators")
    parser.add_argument("--per-replica-batch", type=int, default=PER_REPLICA_BATCH,
                        help=f"examples per replica (default {PER_REPLICA_BATCH})")
    parser.add_argument("--json", metavar="PATH", help="also write the results to PATH as JSON")
    args = parser.parse_args(argv)
    overhead.parse_device_counts(parser, args)
    return args


def main(argv=None) -> int:
    args = _parse_args(argv)
    child_argv = overhead.forward_arguments(args, ("platform", "per_replica_batch"), ())
    return overhead.run_benchmark(args, _measure, _markdown, child_argv, __file__)


if __name__ == "__main__":
    sys.exit(main())
