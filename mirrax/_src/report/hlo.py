"""Reading XLA's HLO text: the collectives of a compiled program and their bytes, and the ENTRY
computation in schedule order. Pure Python (no JAX), so it reads any program's `as_text()`;
the benchmarks' harness (benchmarks/_harness/hlo.py) reads programs with it too."""

from __future__ import annotations

import math
import re

COLLECTIVES = (
    "all-reduce",
    "all-reduce-start",
    "reduce-scatter",
    "all-gather",
    "all-gather-start",
    "all-to-all",
    "collective-permute",
    "collective-permute-start",
)
BYTES_PER_ELEMENT = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "f8e4m3fnuz": 1,
    "f8e5m2fnuz": 1,
    "f8e4m3b11fnuz": 1,
    "f8e4m3": 1,
    "f8e3m4": 1,
    "f8e8m0fnu": 1,
}
# Longest names first, so "f8e4m3fn" is not read as "f8e4m3".
_ARRAY = re.compile(r"\b(" + "|".join(sorted(BYTES_PER_ELEMENT, key=len, reverse=True)) + r")\[([0-9,]*)\]")
# Asynchronous starts return tuples: all-gather-start (operands..., outputs...), and
# collective-permute-start (operand, output, two u32 contexts); the outputs are the result.
# `  [ROOT] %name = SHAPE opcode(operands), attributes`; SHAPE is an array or a (tuple, of, them).
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([a-z][a-z\-]*)\((.*)$")
_NAME = re.compile(r"%([\w.\-]+)")


def collectives(hlo_text: str) -> list:
    """[(opcode, [(dtype, dims), ...])] of every collective in an HLO module's text; the arrays
    are its result shape (a tuple's elements in order)."""
    found = []
    for line in hlo_text.splitlines():
        match = _INSTRUCTION.match(line)
        if match and match.group(3) in COLLECTIVES:
            arrays = [
                (dtype, tuple(int(d) for d in dims.split(",") if d))
                for dtype, dims in _ARRAY.findall(match.group(2))
            ]
            if match.group(3) == "all-gather-start" and len(arrays) > 1:
                arrays = arrays[len(arrays) // 2 :]
            elif match.group(3) == "collective-permute-start" and len(arrays) > 1:
                arrays = arrays[1:2]
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


def kind(opcode: str) -> str:
    """The collective an opcode performs: "all-reduce-start" is an "all-reduce"."""
    return opcode.removesuffix("-start")


def payload_bytes(opcode: str, arrays: list, replicas: int) -> int:
    """Bytes of the whole array a collective combines: its result, except for a reduce-scatter,
    whose result is 1/`replicas` of the array it reduces."""
    size = sum(nbytes(a) for a in arrays)
    return size * replicas if kind(opcode) == "reduce-scatter" else size


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
    return [
        (name, opcode, [n for n in _NAME.findall(rest) if n in names and n != name])
        for name, opcode, rest in lines
    ]


def ring_bytes(ops: list, replicas: int) -> dict:
    """Bytes each device sends per step in a ring implementation, by kind: an all-reduce of S
    bytes sends 2(R-1)/R S; a reduce-scatter of S bytes in (S/R out) and an all-gather of S/R
    in (S out) send (R-1)/R S each. `ops` as `collectives` returns them (result shapes)."""
    sent = {"all-reduce": 0.0, "reduce-scatter": 0.0, "all-gather": 0.0}
    for opcode, arrays in ops:
        if kind(opcode) not in sent:
            continue
        whole = payload_bytes(opcode, arrays, replicas)
        sent[kind(opcode)] += (2 if kind(opcode) == "all-reduce" else 1) * (replicas - 1) / replicas * whole
    return sent
