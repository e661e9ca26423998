"""The scaling report's result: one row per replica count, the table `str()` prints with the
assumptions under it, and its dict / JSON form; the plot lives in plot.py."""

from __future__ import annotations

import dataclasses
import json

from mirrax._src.report import plot as plot_lib
from mirrax._src.report.links import LinkModel

_MIB = 2**20


@dataclasses.dataclass(frozen=True)
class Memory:
    """What one device holds, in bytes, with the optimizer state sharded or not.

    Attributes:
      params_bytes: every `nnx.Param` (replicated: the same on every device).
      optimizer_state_bytes: the `nnx.Optimizer`s' state (`nnx.OptState`): all of it, or, when
        sharded, 1/N of each array that splits (docs/design.md, "Sharded optimizer state").
      other_state_bytes: every other variable (metrics, batch statistics, PRNG keys, the
        optimizer's step counter).
      batch_bytes: one replica's batch.
      argument_bytes: the compiled step's arguments (state and batch), one device's share,
        from `compiled.memory_analysis()`.
      temp_bytes: XLA's temporaries of the compiled step (activations, gradients, workspace,
        after buffer reuse), from `compiled.memory_analysis()`.
      peak_bytes: arguments + outputs - donated + temporaries of the compiled step.
      source: "compiled", "extrapolated from R" or "assumed" (as the row's program).
    """

    params_bytes: int
    optimizer_state_bytes: int
    other_state_bytes: int
    batch_bytes: int
    argument_bytes: int
    temp_bytes: int
    peak_bytes: int
    source: str


@dataclasses.dataclass(frozen=True)
class ScalingRow:
    """The report at one replica count N (weak scaling: N x the per-replica batch).

    Attributes:
      replicas: N.
      global_batch: N x the per-replica batch.
      source: where the collectives come from: "compiled" (the program at N replicas),
        "extrapolated from R" (the program at R < N, the largest this process could compile)
        or "assumed" (one local device: one all-reduce of the gradients assumed).
      collectives: {kind: (instructions, payload bytes)} of the step's program (payload = the
        whole arrays combined; a reduce-scatter's input).
      payload_bytes: their sum.
      gradient_bytes: bytes of every `nnx.Param`: one pass over the gradients, the minimum a
        data-parallel step must combine.
      sent_bytes: bytes one device sends per step on a ring (all-reduce 2(N-1)/N, reduce-
        scatter / all-gather / all-to-all (N-1)/N of the payload).
      minimum_sent_bytes: the same for one all-reduce of the gradients, 2(N-1)/N x gradients.
      memory: {"unsharded": Memory, "sharded": Memory or None (that step could not compile;
        the reason is in the report's assumptions)}.
      compute_ms: the predicted compute per step (the one-device step, or with shared cores
        the shared-core time).
      communication_ms: the predicted time of the step's collectives on the link.
      step_ms: the predicted step, compute + communication not overlapped.
      speedup: N x one-device step / step_ms (examples per second over one device's).
      efficiency: speedup / N.
    """

    replicas: int
    global_batch: int
    source: str
    collectives: dict
    payload_bytes: int
    gradient_bytes: int
    sent_bytes: float
    minimum_sent_bytes: float
    memory: dict
    compute_ms: float
    communication_ms: float
    step_ms: float
    speedup: float
    efficiency: float

    def to_dict(self) -> dict:
        row = dataclasses.asdict(self)
        row["collectives"] = {
            kind: {"instructions": n, "payload_bytes": b} for kind, (n, b) in self.collectives.items()
        }
        return row


@dataclasses.dataclass(frozen=True)
class ScalingReport:
    """What scaling a training step to 1, 2, 4 ... N replicas will cost, before paying for it.

    Made by `mirrax.experimental.scaling_report`. `str(report)` is the table with its
    assumptions; `report.to_dict()` / `report.to_json()` hold every number; `report.plot(path)`
    draws the predicted speedup against the ideal.

    Attributes:
      step: what was measured (e.g. "mirrax.Model(TutorialCNN) train step (fit's)").
      per_replica_batch: examples per replica per step (fixed: weak scaling).
      parameters: the number of values in every `nnx.Param`.
      gradient_bytes: their bytes.
      one_device_ms: the measured one-device step (median of warm windows), milliseconds.
      one_device_windows_ms: each window's milliseconds per step.
      cores_busy: CPU cores the one-device step kept busy (CPU time / wall time).
      device: the device kind it was measured on; local_devices: how many this process has.
      link: the `LinkModel` used (as a dict in `to_dict`).
      overlap: the share of communication assumed hidden behind compute, in [0, 1].
      shared_cores: the CPU cores the replicas were assumed to share, or None.
      shard_optimizer_state: whether collectives and times are those of the sharded step.
      rows: the `ScalingRow`s, one per replica count.
      assumptions: the model's assumptions, one sentence each (printed under the table).
    """

    step: str
    per_replica_batch: int
    parameters: int
    gradient_bytes: int
    one_device_ms: float
    one_device_windows_ms: tuple
    cores_busy: float
    device: str
    local_devices: int
    link: LinkModel
    overlap: float
    shared_cores: int | None
    shard_optimizer_state: bool
    rows: tuple
    assumptions: tuple

    def to_dict(self) -> dict:
        """Every number of the report as plain Python values (bytes, milliseconds)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields.update(
            rows=[row.to_dict() for row in self.rows],
            link=self.link.to_dict(),
            one_device_windows_ms=list(self.one_device_windows_ms),
            assumptions=list(self.assumptions),
        )
        return fields

    def to_json(self, indent: int | None = 2) -> str:
        """`to_dict()` as JSON text."""
        return json.dumps(self.to_dict(), indent=indent)

    def plot(self, path) -> None:
        """Writes the predicted speedup against replicas, with the ideal (N) line, to `path`
        (a str or os.PathLike) in the format its suffix names: .png, .svg or .pdf (as
        matplotlib's `savefig`).

        Raises:
          InvalidArgumentError: another suffix, or none (e.g. "out.txt").
          InvalidArgumentTypeError: `path` is not a str or os.PathLike.
          ExistingPathError: `path` is a folder. MissingFolderError: its folder does not exist.
          MissingDependencyError: matplotlib is not installed (`pip install mirrax[plot]`).
        """
        plot_lib.write_speedup(self, path)

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def lines(self) -> list:
        """The table and the assumptions under it, line by line."""
        sharded = "sharded" if self.shard_optimizer_state else "unsharded"
        header = [
            f"Scaling report: {self.step}",
            f"per-replica batch {self.per_replica_batch} (weak scaling: global batch = "
            f"{self.per_replica_batch} x replicas); {self.parameters:,} parameters, gradients "
            f"{self.gradient_bytes / _MIB:.2f} MiB; one-device step {self.one_device_ms:.3f} ms "
            f"measured on {self.device} ({self.cores_busy:.2f} cores busy); link "
            f"{self.link.describe()}; collectives and times of the {sharded} step.",
            "",
        ]
        columns = [
            "replicas",
            "global batch",
            "program",
            "collectives",
            "MiB combined",
            "MiB sent/device (min)",
            "params MiB",
            "opt state MiB (sharded)",
            "temp MiB (sharded)",
            "peak MiB (sharded)",
            "compute ms",
            "comm ms",
            "step ms",
            "speedup",
            "efficiency",
        ]
        table = [_cells(row) for row in self.rows]
        widths = [max(len(c), *(len(r[i]) for r in table)) for i, c in enumerate(columns)]
        rule = "  ".join("-" * w for w in widths)
        body = [
            "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
            for cells in [columns] + table
        ]
        notes = ["", "Assumptions:"] + [f"- {text}" for text in self.assumptions]
        return header + [body[0], rule] + body[1:] + notes


def _cells(row: ScalingRow) -> list:
    plain, split = row.memory["unsharded"], row.memory["sharded"]

    def both(field: str) -> str:
        other = "n/a" if split is None else f"{getattr(split, field) / _MIB:.2f}"
        return f"{getattr(plain, field) / _MIB:.2f} ({other})"

    ops = ", ".join(f"{n} {kind}" for kind, (n, _) in row.collectives.items()) or "none"
    ratio = f"{row.payload_bytes / row.gradient_bytes:.2f}x" if row.gradient_bytes else "n/a"
    return [
        str(row.replicas),
        str(row.global_batch),
        row.source,
        ops,
        f"{row.payload_bytes / _MIB:.2f} ({ratio})",
        f"{row.sent_bytes / _MIB:.2f} ({row.minimum_sent_bytes / _MIB:.2f})",
        f"{plain.params_bytes / _MIB:.2f}",
        both("optimizer_state_bytes"),
        both("temp_bytes"),
        both("peak_bytes"),
        f"{row.compute_ms:.3f}",
        f"{row.communication_ms:.3f}",
        f"{row.step_ms:.3f}",
        f"{row.speedup:.2f}",
        f"{row.efficiency:.2f}",
    ]
