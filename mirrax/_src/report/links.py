"""The link model of the scaling report: what a collective costs on a link, the presets (NVLink,
PCIe, 100 Gb/s Ethernet) with where their numbers come from, and the step-time arithmetic.

A collective of P bytes (the whole array it combines) over N replicas costs, on a ring (the
algorithm NCCL and Gloo use for large messages, and NCCL's own cost model, src/graph/tuning.cc):

    all-reduce               base + 2(N-1) latency + 2(N-1)/N P / bandwidth
    reduce-scatter, all-gather, all-to-all
                             base +  (N-1) latency +  (N-1)/N P / bandwidth
    collective-permute       base +        latency +          P / bandwidth

`bandwidth` is what one device sends per second in one direction (GB/s, 1 GB = 1e9 bytes),
`latency` the cost of one ring step (µs), `base` a fixed cost per collective (µs; NCCL's
kernel launch and set-up). With base 0 this is the textbook ring formula.
"""

from __future__ import annotations

import dataclasses
import math

from mirrax import errors

_STEPS = {
    "all-reduce": lambda n: 2 * (n - 1),
    "reduce-scatter": lambda n: n - 1,
    "all-gather": lambda n: n - 1,
    "all-to-all": lambda n: n - 1,
    "collective-permute": lambda n: 1,
}
_WIRE = {
    "all-reduce": lambda n: 2 * (n - 1) / n,
    "reduce-scatter": lambda n: (n - 1) / n,
    "all-gather": lambda n: (n - 1) / n,
    "all-to-all": lambda n: (n - 1) / n,
    "collective-permute": lambda n: 1.0,
}


@dataclasses.dataclass(frozen=True)
class LinkModel:
    """A link between replicas, as the scaling report's cost model sees it.

    Attributes:
      name: a short name ("nvlink", "custom", ...).
      bandwidth_gbps: bytes one device sends per second in one direction, in GB/s (1e9 B/s).
      latency_us: the cost of one step of a ring collective, in microseconds (>= 0).
      base_latency_us: a fixed cost per collective operation, in microseconds (>= 0).
      source: where the numbers come from (printed under the report's table).
      calibrated: for a link measured on this machine ("local"): ((replicas, bandwidth_gbps,
        latency_us), ...) fitted at each replica count measured; a count not measured uses the
        largest one below it (or the smallest measured).
      per_operand: the latency is paid once per ARRAY of a combined collective instead of
        once per instruction: XLA:CPU's Gloo path (CPU processes) runs a combined all-reduce
        operand by operand (measured: the CNN's 10 gradient arrays took 36.6 ms as separate
        arrays and 4.2 ms as one concatenated vector, BENCHMARKS.md); NCCL groups them.
    """

    name: str
    bandwidth_gbps: float
    latency_us: float
    base_latency_us: float = 0.0
    source: str = ""
    calibrated: tuple = ()
    per_operand: bool = False

    def parameters(self, replicas: int) -> tuple:
        """(bandwidth GB/s, latency µs per step) that apply at `replicas`."""
        if not self.calibrated:
            return self.bandwidth_gbps, self.latency_us
        below = [fit for fit in self.calibrated if fit[0] <= replicas]
        fit = max(below) if below else min(self.calibrated)
        return fit[1], fit[2]

    def seconds(self, kind: str, payload_bytes: float, replicas: int, operands: int = 1) -> float:
        """The time of one collective instruction of `kind` ("all-reduce", "reduce-scatter",
        "all-gather", "all-to-all", "collective-permute") over `payload_bytes` (the whole
        arrays it combines, `operands` of them) on `replicas` replicas, in seconds; 0 on one
        replica (nothing moves)."""
        if replicas <= 1:
            return 0.0
        bandwidth, latency = self.parameters(replicas)
        steps = _STEPS[kind](replicas) * (operands if self.per_operand else 1)
        return (self.base_latency_us + steps * latency) * 1e-6 + _WIRE[kind](replicas) * payload_bytes / (
            bandwidth * 1e9
        )

    def describe(self) -> str:
        """One line: name, bandwidth and latencies (or how it was calibrated)."""
        if self.calibrated:
            fits = ", ".join(
                f"{n} replicas {b:.3g} GB/s and {lat:.3g} µs per step" for n, b, lat in self.calibrated
            )
            return f"{self.name} (measured: {fits})"
        base = f" + {self.base_latency_us:g} µs per collective" if self.base_latency_us else ""
        each = " of each array" if self.per_operand else ""
        return (
            f"{self.name} ({self.bandwidth_gbps:g} GB/s each way, {self.latency_us:g} µs "
            f"per ring step{each}{base})"
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# Line rates are nominal (what the link carries at best); NCCL's measured bus bandwidth is
# typically 75-90% of them, so predictions with a preset are optimistic by that much.
# Latencies: NCCL's cost model (src/graph/tuning.cc, ring algorithm, Simple protocol, the
# one it picks for megabyte gradients): 8.4 µs per collective, and per ring step 3.4 µs over
# NVLink, 5.7 µs over PCIe, 9.6 µs over the network.
PRESETS = {
    "nvlink": LinkModel(
        "nvlink",
        450.0,
        3.4,
        8.4,
        "NVLink 4 (H100/H200 SXM): 900 GB/s per GPU both ways = 450 GB/s each way (NVIDIA "
        "H200 datasheet); latencies from NCCL's cost model (ring, Simple protocol)",
    ),
    "pcie": LinkModel(
        "pcie",
        31.5,
        5.7,
        8.4,
        "PCIe 4.0 x16: 16 GT/s x 16 lanes x 128/130 / 8 bits = 31.5 GB/s each way (PCI-SIG "
        "PCIe 4.0); latencies from NCCL's cost model (ring, Simple protocol, PCI)",
    ),
    "ethernet-100g": LinkModel(
        "ethernet-100g",
        12.5,
        9.6,
        8.4,
        "100 Gb/s Ethernet: 100e9 / 8 = 12.5 GB/s each way (IEEE 802.3 line rate); latencies "
        "from NCCL's cost model (ring, Simple protocol, network)",
    ),
}
# Measured on this machine's own devices when the report runs (calibrate.local_link).
LOCAL = "local"
LINK_NAMES = (*PRESETS, LOCAL)


def resolve(link, bandwidth_gbps, latency_us, what: str):
    """The `LinkModel` of the report's arguments, or `LOCAL` (to be measured).

    Args:
      link: a preset name (`LINK_NAMES`, any case), a `LinkModel`, or None.
      bandwidth_gbps, latency_us: a user link (GB/s > 0, µs >= 0; latency defaults to 0);
        given with `link`, they replace that preset's numbers.
      what: the caller's name for messages.

    Raises:
      InvalidArgumentError: an unknown preset; a bandwidth <= 0, a negative latency, or a
        value that is not finite; a latency without a bandwidth and no link.
      InvalidArgumentTypeError: `link` neither a str, a LinkModel nor None; numbers not numbers.
    """
    if isinstance(link, LinkModel):
        base = link
    elif isinstance(link, str):
        name = link.strip().lower()
        if name not in LINK_NAMES:
            raise errors.InvalidArgumentError(
                f"{what}: unknown link {link!r}. Choose one of {', '.join(LINK_NAMES)}, or give "
                "your link's numbers as bandwidth_gbps= (GB/s each way) and latency_us= "
                "(µs per ring step)."
            )
        if name == LOCAL:
            if bandwidth_gbps is not None or latency_us is not None:
                raise errors.InvalidArgumentError(
                    f"{what}: link 'local' is measured on this machine, so it takes no "
                    f"bandwidth or latency; received bandwidth_gbps={bandwidth_gbps!r}, "
                    f"latency_us={latency_us!r}. Drop them, or pick another link."
                )
            return LOCAL
        base = PRESETS[name]
    elif link is None:
        if bandwidth_gbps is None:
            if latency_us is not None:
                raise errors.InvalidArgumentError(
                    f"{what}: latency_us={latency_us!r} was given without a bandwidth; a link "
                    "needs both. Add bandwidth_gbps= (GB/s each way), or pick a preset link."
                )
            return PRESETS["nvlink"]
        base = LinkModel("custom", 1.0, 0.0, 0.0, "given by the user")
    else:
        raise errors.InvalidArgumentTypeError(
            f"{what}: link must be a preset name ({', '.join(LINK_NAMES)}), a "
            f"mirrax.experimental.LinkModel or None; received {type(link).__name__}."
        )
    bandwidth = (
        base.bandwidth_gbps
        if bandwidth_gbps is None
        else _number(what, "bandwidth_gbps", bandwidth_gbps, "GB/s", positive=True)
    )
    latency = (
        base.latency_us
        if latency_us is None
        else _number(what, "latency_us", latency_us, "µs", positive=False)
    )
    if isinstance(link, LinkModel):
        _number(what, "the link's bandwidth_gbps", base.bandwidth_gbps, "GB/s", positive=True)
        _number(what, "the link's latency_us", base.latency_us, "µs", positive=False)
        _number(what, "the link's base_latency_us", base.base_latency_us, "µs", positive=False)
    if bandwidth_gbps is None and latency_us is None:
        return base
    source = base.source if base.name == "custom" else f"{base.name} with the numbers given by the user"
    return dataclasses.replace(
        base,
        name="custom" if link is None else f"{base.name} (edited)",
        bandwidth_gbps=bandwidth,
        latency_us=latency,
        source=source,
    )


def _number(what: str, name: str, value, unit: str, positive: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise errors.InvalidArgumentTypeError(
            f"{what}: {name} must be a number of {unit}; received {value!r} ({type(value).__name__})."
        )
    bad = value <= 0 if positive else value < 0
    if bad or not math.isfinite(value):
        bound = "> 0" if positive else ">= 0"
        raise errors.InvalidArgumentError(
            f"{what}: {name} must be a finite number {bound} ({unit}); received {value!r}. "
            f"Give the link's {'bandwidth each way' if positive else 'latency'} in {unit}, "
            f"e.g. {'25' if positive else '5'}."
        )
    return float(value)


def sent_bytes(kind: str, payload_bytes: float, replicas: int) -> float:
    """Bytes one device sends for one collective of `kind` over `payload_bytes` on a ring of
    `replicas` (none on one replica)."""
    return 0.0 if replicas <= 1 else _WIRE[kind](replicas) * payload_bytes


def step_seconds(compute_s: float, communication_s: float, overlap: float) -> float:
    """A step's time: compute plus the communication not hidden behind it. `overlap` is the
    share of the communication that runs during compute (0: none, after the backward pass, as
    XLA:CPU does; 1: all of it, as far as there is compute to hide it behind)."""
    return compute_s + communication_s - min(overlap * communication_s, compute_s)


def shared_compute_seconds(one_device_s: float, cores_busy: float, replicas: int, cores: int) -> float:
    """Compute time of `replicas` replicas that share `cores` CPU cores (fake CPU devices:
    threads of one process): the N replicas' CPU work, N x one_device_s x cores_busy (the
    cores the one-device step keeps busy), spread over the cores; never below one replica's."""
    return max(one_device_s, replicas * one_device_s * cores_busy / cores)
