"""Compiled programs: strategy.run's train step lowered and compiled (never timed), and the
reading of XLA's HLO text (its collectives and their bytes, the ENTRY schedule). JAX-free at
import; `compile_train_step` imports JAX and `models` when called."""

from __future__ import annotations

import math
import re

PER_REPLICA_BATCH = 32
COLLECTIVES = ("all-reduce", "all-reduce-start", "reduce-scatter", "all-gather",
               "all-gather-start", "all-to-all", "collective-permute")
BYTES_PER_ELEMENT = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}
_ARRAY = re.compile(r"\b(" + "|".join(BYTES_PER_ELEMENT) + r")\[([0-9,]*)\]")
# `  [ROOT] %name = SHAPE opcode(operands), attributes`; SHAPE is an array or a (tuple, of, them).
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([a-z][a-z\-]*)\((.*)$")
_NAME = re.compile(r"%([\w.\-]+)")


def compile_train_step(devices, name: str, per_replica_batch: int, packed: bool = False,
                       **strategy_options) -> dict:
    """Runs one `strategy.run` train step of `models.WORKLOADS[name]` on a MirroredStrategy
    over `devices` (`models.mirrax_state`, `models.strategy_run_step`), then lowers it with
    `strategy.experimental_lower` on the same arguments and compiles it: the program
    strategy.run itself runs.

    `packed`: gradients from `mirrax.value_and_grad` instead of `nnx.value_and_grad`;
    `strategy_options` go to the strategy (e.g. shard_optimizer_state=True).

    Returns {"lowered", "compiled", "param_shapes" (list of shapes), "parameters" (int),
    "state_bytes" (params + optimizer state, all arrays of nnx.state), "device_state_bytes"
    (their shards on the first device), "batch_bytes" (one replica's share of the batch)}.
    """
    import jax
    import numpy as np
    from flax import nnx

    from benchmarks._harness import models

    builder, make_batch = models.WORKLOADS[name]
    global_batch = per_replica_batch * len(devices)
    x, y = make_batch(global_batch)
    strategy, model, optimizer, batch = models.mirrax_state(devices, builder, x, y,
                                                             **strategy_options)
    step = models.strategy_run_step(global_batch, packed)
    strategy.run(step, args=(model, optimizer, batch))
    lowered = strategy.experimental_lower(step, args=(model, optimizer, batch))
    params = jax.tree.leaves(nnx.state(model, nnx.Param))
    return {
        "lowered": lowered,
        "compiled": lowered.compile(),
        "param_shapes": [tuple(p.shape) for p in params],
        "parameters": int(sum(p.size for p in params)),
        "state_bytes": int(sum(np.asarray(a).nbytes
                               for a in jax.tree.leaves(nnx.state((model, optimizer))))),
        "device_state_bytes": int(sum(
            shard.data.nbytes for a in jax.tree.leaves(nnx.state((model, optimizer)))
            for shard in a.addressable_shards if shard.device == devices[0])),
        "batch_bytes": (x.nbytes + y.nbytes) // len(devices),
    }


def collectives(hlo_text: str) -> list:
    """[(opcode, [(dtype, dims), ...])] of every collective in an HLO module's text; the arrays
    are its result shape (a tuple's elements in order)."""
    found = []
    for line in hlo_text.splitlines():
        match = _INSTRUCTION.match(line)
        if match and match.group(3) in COLLECTIVES:
            arrays = [(dtype, tuple(int(d) for d in dims.split(",") if d))
                      for dtype, dims in _ARRAY.findall(match.group(2))]
            found.append((match.group(3), arrays))
    return found


def all_reduces(hlo_text: str) -> list:
    """The result arrays [(dtype, dims), ...] of each all-reduce (or all-reduce-start)."""
    return [arrays for opcode, arrays in collectives(hlo_text) if opcode.startswith("all-reduce")]


def nbytes(array) -> int:
    """Bytes of one (dtype, dims) array of `collectives`."""
    dtype, dims = array
    return math.prod(dims) * BYTES_PER_ELEMENT[dtype]


def describe(array) -> str:
    """A (dtype, dims) array as HLO writes it, e.g. "f32[1024,10]"."""
    dtype, dims = array
    return f"{dtype}[{','.join(map(str, dims))}]"


def entry_instructions(hlo_text: str) -> list:
    """[(name, opcode, [operand names])] of the ENTRY computation, in the printed order (the
    schedule order of a module with `is_scheduled=true`)."""
    lines, inside = [], False
    for line in hlo_text.splitlines():
        if line.startswith("ENTRY "):
            inside = True
        elif inside and line.startswith("}"):
            break
        elif inside and (match := _INSTRUCTION.match(line)):
            lines.append((match.group(1), match.group(3), match.group(4)))
    names = {name for name, _, _ in lines}
    # Operands and attributes both hold `%name`s; computations (calls=, to_apply=) are not
    # entry instructions, so keeping only entry names leaves the data operands.
    return [(name, opcode, [n for n in _NAME.findall(rest) if n in names and n != name])
            for name, opcode, rest in lines]


def ring_bytes(ops: list, replicas: int) -> dict:
    """Bytes each device sends per step in a ring implementation, by kind: an all-reduce of S
    bytes sends 2(R-1)/R S; a reduce-scatter of S bytes in (S/R out) and an all-gather of S/R
    in (S out) send (R-1)/R S each. `ops` as `collectives` returns them (result shapes)."""
    sent = {"all-reduce": 0.0, "reduce-scatter": 0.0, "all-gather": 0.0}
    for opcode, arrays in ops:
        kind = opcode.removesuffix("-start")
        if kind not in sent:
            continue
        size = sum(nbytes(a) for a in arrays)
        whole = size * replicas if kind == "reduce-scatter" else size
        sent[kind] += (2 if kind == "all-reduce" else 1) * (replicas - 1) / replicas * whole
    return sent
