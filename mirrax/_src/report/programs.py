"""The step's compiled program at N replicas: lowered with `strategy.experimental_lower` on a
MirroredStrategy over N local devices (the program `strategy.run` would run), its collectives
read from the optimized HLO, its per-device memory from `compiled.memory_analysis()`. Beyond
the local devices, the same numbers extrapolated from the largest program compiled."""

from __future__ import annotations

import collections
import dataclasses

import jax

from mirrax import errors
from mirrax._src.distribute.mirrored import MirroredStrategy
from mirrax._src.report import hlo
from mirrax._src.report import subject as subject_lib


@dataclasses.dataclass(frozen=True)
class Program:
    """One compiled step (or its extrapolation) at `replicas` replicas.

    Attributes:
      replicas: the replica count N.
      sharded: compiled with `shard_optimizer_state=True`.
      source: "compiled", "extrapolated from R" (R replicas' program) or "assumed" (no
        multi-device program could be compiled: one all-reduce of the gradients assumed).
      collectives: ((kind, payload bytes, operands), ...), one entry per collective
        instruction of the optimized program; payload = the whole arrays combined (a
        reduce-scatter's input); operands = the arrays it combines (XLA's combiner merges
        many into one instruction).
      argument_bytes, output_bytes, alias_bytes, temp_bytes: one device's share, from
        `memory_analysis()` (bytes); aliased = donated buffers reused for outputs.
    """

    replicas: int
    sharded: bool
    source: str
    collectives: tuple
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int

    @property
    def peak_bytes(self) -> int:
        """arguments + outputs - aliased + temp: what one device holds at the step's peak."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

    def counts(self) -> dict:
        """{kind: (number of instructions, payload bytes)}, in first-seen order."""
        found: dict = collections.OrderedDict()
        for kind, payload, _ in self.collectives:
            count, total = found.get(kind, (0, 0))
            found[kind] = (count + 1, total + payload)
        return found


def strategy_for(devices, sharded: bool) -> MirroredStrategy:
    """The MirroredStrategy a program is compiled for (the one-device one also times the step,
    which then reuses the compiled program)."""
    return MirroredStrategy(list(devices), shard_optimizer_state=sharded)


# Programs the report only reads (never runs) are compiled without LLVM's code optimizations
# on CPU: the HLO XLA optimizes (its collectives, its buffer assignment, so memory_analysis)
# is the same text, and the compile takes about half the time (measured on the tutorial
# CNN's step: 2.8 s against 5.2 s). Accelerator backends compile as usual (not checked there).
READ_ONLY_CPU_OPTIONS = {"xla_backend_optimization_level": 0}


def compile_program(subject, strategy, read_only: bool = True) -> Program:
    """The step's program on `strategy` (a `strategy_for`), compiled, never run here
    (`read_only` False: compiled as `strategy.run` compiles it, since it will run).

    Raises:
      IncompatibleInputError: the step fails on the batch (shapes that do not fit the model);
        the step's own error is chained.
    """
    replicas = strategy.num_replicas_in_sync
    sharded = strategy.extended.shard_optimizer_state
    batch = subject_lib.distribute(strategy, subject.batch, replicas)
    try:
        lowered = strategy.experimental_lower(
            subject.fn, args=subject.objects + (batch,), kwargs=subject.kwargs
        )
    except errors.MirraxError:
        raise
    except Exception as error:  # the user's step: its own error is chained as the cause
        shapes = ", ".join(f"{a.dtype}{list(a.shape)}" for a in jax.tree.leaves(subject.batch))
        raise errors.IncompatibleInputError(
            f"{subject_lib.WHAT}: the step failed on the per-replica batch ({shapes}) at "
            f"{replicas} replica(s): {type(error).__name__}: {error}. Pass one per-replica batch "
            "that the step accepts, as strategy.run(fn, args=(*args, batch)) would receive "
            "it (for a mirrax.Model: (x, y) that fit accepts)."
        ) from error
    cheap = read_only and strategy.extended.replica_devices.devices[0].platform == "cpu"
    compiled = lowered.compile(compiler_options=READ_ONLY_CPU_OPTIONS if cheap else None)
    memory = compiled.memory_analysis()
    ops = hlo.collectives(compiled.as_text())
    return Program(
        replicas=replicas,
        sharded=sharded,
        source="compiled",
        collectives=tuple(
            (hlo.kind(op), hlo.payload_bytes(op, arrays, replicas), len(arrays)) for op, arrays in ops
        ),
        argument_bytes=int(memory.argument_size_in_bytes),
        output_bytes=int(memory.output_size_in_bytes),
        alias_bytes=int(memory.alias_size_in_bytes),
        temp_bytes=int(memory.temp_size_in_bytes),
    )


def extrapolate(program: Program, subject, replicas: int) -> Program:
    """`program` (compiled at fewer replicas) carried to `replicas`: the same collectives and
    payloads (data parallelism moves the gradients once, whatever N), the same temporaries;
    the sharded optimizer state recounted for `replicas`, in the arguments and the outputs
    (and in the aliased bytes when the step donates its state)."""
    change = subject.optimizer_state_bytes(replicas, program.sharded) - subject.optimizer_state_bytes(
        program.replicas, program.sharded
    )
    source = program.source if program.source == "assumed" else f"extrapolated from {program.replicas}"
    return dataclasses.replace(
        program,
        replicas=replicas,
        source=source,
        argument_bytes=program.argument_bytes + change,
        output_bytes=program.output_bytes + change,
        alias_bytes=program.alias_bytes + (change if program.alias_bytes else 0),
    )


def assumed(one_device: Program, subject, sharded: bool) -> Program:
    """With one local device no multi-device program exists: the collectives a data-parallel
    step has, one all-reduce of the gradients (with sharded state: a reduce-scatter of the
    gradients and an all-gather of the parameters), each of every parameter array as XLA's
    combiner makes it, on the one-device program's memory."""
    gradients, arrays = subject.params_bytes, subject.param_arrays
    ops = (
        (("reduce-scatter", gradients, arrays), ("all-gather", gradients, arrays))
        if sharded
        else (("all-reduce", gradients, arrays),)
    )
    return dataclasses.replace(one_device, sharded=sharded, source="assumed", collectives=ops)
