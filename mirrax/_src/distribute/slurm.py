"""`SlurmClusterResolver`: the multi-worker cluster of a SLURM job, read from its environment
variables (SLURM_JOB_NODELIST, SLURM_TASKS_PER_NODE, SLURM_PROCID, ...), as TF's resolver of that
name; with the expansion of SLURM's compact host lists.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from mirrax import errors
from mirrax._src.distribute.cluster import ClusterResolver, ClusterSpec, check_rpc_layer


def expand_hostlist(hostlist: str) -> list[str]:
    """SLURM's compact host list to host names.

    "node[01-03,07],gpu5" -> node01, node02, node03, node07, gpu5.

    Zero padding of a range is kept; several bracket groups in one name expand as a product.
    """
    names, depth, start = [], 0, 0
    for i, char in enumerate(hostlist + ","):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        elif char == "," and depth == 0:
            if hostlist[start:i].strip():
                names.extend(_expand_name(hostlist[start:i].strip(), hostlist))
            start = i + 1
        if depth < 0 or depth > 1:
            break
    if depth != 0:
        raise errors.InvalidArgumentError(
            f"SLURM node list has unbalanced or nested brackets; received {hostlist!r}. Expected "
            "a form such as 'node[01-03,07],gpu5'."
        )
    return names


def _expand_name(name: str, hostlist: str) -> list[str]:
    match = re.fullmatch(r"([^\[\]]*)\[([^\[\]]*)\](.*)", name)
    if match is None:
        return [name]
    prefix, ranges, rest = match.groups()
    heads: list[str] = []
    for item in ranges.split(","):
        bounds = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", item)
        if bounds is None or (bounds[2] is not None and int(bounds[2]) < int(bounds[1])):
            raise errors.InvalidArgumentError(
                f"SLURM node list has a malformed range {item!r} in {hostlist!r}. Expected "
                "numbers or increasing ranges such as '01-03,07'."
            )
        low, high = bounds[1], bounds[2] or bounds[1]
        width = len(low)
        heads.extend(f"{prefix}{n:0{width}d}" for n in range(int(low), int(high) + 1))
    return [head + tail for head in heads for tail in _expand_name(rest, hostlist)]


def _expand_tasks_per_node(spec: str) -> list[int]:
    """SLURM's "2(x3),1" -> [2, 2, 2, 1]."""
    counts = []
    for item in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if match is None:
            raise errors.InvalidArgumentError(
                f"SLURM tasks-per-node value is malformed; received {spec!r}. Expected a form "
                "such as '2(x3),1'."
            )
        counts.extend([int(match[1])] * int(match[2] or 1))
    return counts


class SlurmClusterResolver(ClusterResolver):
    """A resolver from SLURM's variables, as `tf.distribute.cluster_resolver.SlurmClusterResolver`.

    Every SLURM task is a "worker"; task SLURM_PROCID is this one and task 0 is the chief.
    Tasks are laid out over the nodes of SLURM_STEP_NODELIST (else SLURM_JOB_NODELIST) in
    blocks, SLURM's default: SLURM_STEP_TASKS_PER_NODE (else SLURM_TASKS_PER_NODE) when set,
    else SLURM_NTASKS split evenly. The k-th task on a node listens on `port + k`.

    Args:
      port: the first port on each node.
      rpc_layer: e.g. "grpc"; only prefixes `master()`.
      environ: the variables to read; None reads `os.environ`.

    Raises:
      ValueError: a SLURM variable is missing or malformed, or the tasks do not fit the nodes.
    """

    def __init__(
        self, port: int = 8888, rpc_layer: str | None = None, environ: Mapping[str, str] | None = None
    ):
        env = os.environ if environ is None else environ
        if not isinstance(env, Mapping):
            raise errors.InvalidArgumentTypeError(
                "SlurmClusterResolver: environ must be None (os.environ) or a mapping of "
                f"variable names to strings; received {type(environ).__name__}."
            )
        check_rpc_layer("SlurmClusterResolver", rpc_layer)
        if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
            raise errors.InvalidArgumentError(
                f"SlurmClusterResolver: port must be an int in 1..65535; received {port!r}."
            )
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
        missing = [name for name in ("SLURM_PROCID", "SLURM_NTASKS") if not env.get(name)]
        if not nodelist:
            missing.append("SLURM_STEP_NODELIST or SLURM_JOB_NODELIST")
        if missing:
            raise errors.InvalidArgumentError(
                f"SlurmClusterResolver: SLURM variables {missing} are not set. Start the program "
                "with `srun`, or use TFConfigClusterResolver / SimpleClusterResolver."
            )
        procid_text, ntasks_text = env["SLURM_PROCID"], env["SLURM_NTASKS"]
        if not (procid_text.isdigit() and ntasks_text.isdigit() and int(ntasks_text) >= 1):
            raise errors.InvalidArgumentError(
                f"SlurmClusterResolver: SLURM_PROCID and SLURM_NTASKS must be integers (NTASKS "
                f">= 1); received SLURM_PROCID={procid_text!r}, SLURM_NTASKS={ntasks_text!r}."
            )
        procid, ntasks = int(procid_text), int(ntasks_text)
        assert nodelist  # else `missing` named it
        nodes = expand_hostlist(nodelist)
        per_node_spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
        if per_node_spec:
            per_node = _expand_tasks_per_node(per_node_spec)
        elif ntasks % len(nodes) == 0:
            per_node = [ntasks // len(nodes)] * len(nodes)
        else:
            per_node = []
        if len(per_node) != len(nodes) or sum(per_node) != ntasks:
            raise errors.InvalidArgumentError(
                f"SlurmClusterResolver: {ntasks} tasks do not fit the {len(nodes)} nodes {nodes} "
                f"(tasks per node received: {per_node_spec!r}). Use --ntasks-per-node, or set "
                "SLURM_TASKS_PER_NODE such as '2(x3)'."
            )
        addresses = [f"{node}:{port + k}" for node, count in zip(nodes, per_node) for k in range(count)]
        if port + max(per_node) - 1 > 65535:
            raise errors.InvalidArgumentError(
                f"SlurmClusterResolver: ports {port}..{port + max(per_node) - 1} go past 65535; "
                "pass a lower port."
            )
        self._cluster = ClusterSpec({"worker": addresses})
        self.task_type = "worker"
        self.task_id = procid
        self.rpc_layer = rpc_layer
        self._validate("SlurmClusterResolver")
