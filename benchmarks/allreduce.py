"""Bare Gloo all-reduce of a gradient-sized vector: JAX (XLA:CPU) against PyTorch, 2 processes.

One all-reduce of the MLP 784-1024-1024-10's gradient (1,863,690 values) between two processes
with nothing else in the program (the floor under `multi_worker`'s 2-worker step), in float32,
bfloat16 and float16. JAX: `jax.distributed` with Gloo, one CPU device and one intra-op thread
per process, `jax.jit(jax.shard_map(psum))` (the dtype it reduces in read from the HLO).
PyTorch: `torch.distributed` Gloo, `dist.all_reduce` in place, one thread, from `--torch-python`
(default: this interpreter or `.venv-peers/bin/python`, if one imports torch; else skipped).
Placements "pinned" (a core per process) and "unpinned". Long-lived pairs
(`_harness/workers.py`), windows of `--calls` all-reduces (each waited for), `--repeats` rounds in
rotation. Columns: median wall ms per all-reduce (the slower process), median CPU ms (all
threads, mean of the pair), JAX / PyTorch.

Usage:
  python -m benchmarks.allreduce                      # ~2 minutes
  python -m benchmarks.allreduce --calls 10 --repeats 9 --json out.json
  python -m benchmarks.allreduce --torch-python .venv-peers/bin/python
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import statistics
import subprocess
import sys

from benchmarks._harness import env, hlo, workers

ELEMENTS = 1_863_690  # the MLP 784-1024-1024-10's parameters (multi_worker)
DTYPES = ("float32", "bfloat16", "float16")
PLACEMENTS = ("pinned", "unpinned")


def _parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Bare Gloo all-reduce between 2 processes: JAX (XLA:CPU) vs PyTorch."
    )
    parser.add_argument(
        "--elements",
        type=int,
        default=ELEMENTS,
        help=f"values per all-reduce ({ELEMENTS:,}, the MLP's gradient)",
    )
    parser.add_argument("--calls", type=int, default=20, help="all-reduces per window (20)")
    parser.add_argument("--repeats", type=int, default=7, help="windows per case (7)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed calls per case (5)")
    parser.add_argument(
        "--placements", default=",".join(PLACEMENTS), help="comma-separated subset of pinned,unpinned"
    )
    parser.add_argument("--torch-python", help="interpreter with torch (default: see above)")
    parser.add_argument("--json", metavar="PATH", help="also write the results to PATH as JSON")
    parser.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)  # framework rank port core n
    args = parser.parse_args(argv)
    if min(args.calls, args.repeats, args.elements) < 1 or args.warmup < 0:
        parser.error("--calls, --repeats and --elements must be >= 1, --warmup >= 0")
    args.placements = env.names_option(parser, "--placements", args.placements, PLACEMENTS)
    if not args.placements:
        parser.error("--placements: choose from pinned,unpinned")
    return args


def _jax_worker(rank: int, port: int, elements: int) -> tuple:
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=rank)
    mesh = Mesh(np.array(jax.devices()), ("replica",))
    psum = jax.jit(
        jax.shard_map(
            lambda x: jax.lax.psum(x[0], "replica"), mesh=mesh, in_specs=P("replica"), out_specs=P()
        )
    )
    calls, info = {}, {"jax": jax.__version__}
    for dtype in DTYPES:
        local = np.ones((1, elements), dtype=jax.numpy.dtype(dtype))
        x = jax.make_array_from_single_device_arrays(
            (2, elements), NamedSharding(mesh, P("replica")), [jax.device_put(local, jax.local_devices()[0])]
        )
        out = jax.block_until_ready(psum(x))
        assert float(np.asarray(out.addressable_data(0))[0]) == 2.0, "the sum is wrong"
        # The element types of the compiled all-reduces, e.g. ['f32'].
        arrays = hlo.all_reduces(psum.lower(x).compile().as_text())
        info[dtype] = {"hlo_all_reduce": [element for op in arrays for element, _ in op]}
        calls[dtype] = lambda x=x: jax.block_until_ready(psum(x))
    return {"info": info}, calls


def _torch_worker(rank: int, port: int, elements: int) -> tuple:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    calls = {}
    for dtype in DTYPES:
        t = torch.ones(elements, dtype=getattr(torch, dtype))
        dist.all_reduce(t)
        assert float(t[0]) == 2.0, "the sum is wrong"
        calls[dtype] = lambda t=t: dist.all_reduce(t)  # in place: sums grow, time does not
    return {"info": {"torch": torch.__version__, **{dtype: {} for dtype in DTYPES}}}, calls


def _worker_main(args) -> None:
    """A worker of a pair; its builder returns ({"info": ...}, {dtype: one all-reduce call})."""
    framework, rank, port, core, elements = args.worker
    build = {"jax": _jax_worker, "torch": _torch_worker}[framework]
    workers.serve(
        functools.partial(build, int(rank), int(port), int(elements)),
        lambda calls, command: workers.timed(calls[command["task"]], command["steps"]),
        core=None if core == "any" else int(core),
    )


def _torch_python(args) -> str | None:
    candidates = (
        [args.torch_python]
        if args.torch_python
        else [sys.executable, str(env.ROOT / ".venv-peers" / "bin" / "python")]
    )
    return next(
        (
            python
            for python in candidates
            if os.path.exists(python)
            and subprocess.run([python, "-c", "import torch.distributed"], capture_output=True).returncode
            == 0
        ),
        None,
    )


def _measure(args) -> dict:
    pythons = {"jax": sys.executable, "torch": _torch_python(args)}
    if pythons["torch"] is None:
        env.log("allreduce: no interpreter with torch (give --torch-python): PyTorch skipped")
    frameworks = [fw for fw, python in pythons.items() if python]
    with workers.Pool("allreduce") as pool:
        groups = {}  # "placement | framework": two workers talking over loopback Gloo
        for placement, fw in itertools.product(args.placements, frameworks):
            port = workers.free_port()
            groups[f"{placement} | {fw}"] = [
                pool.start(
                    env.module_command(
                        __spec__.name,
                        "--worker",
                        fw,
                        rank,
                        port,
                        rank if placement == "pinned" else "any",
                        args.elements,
                        python=pythons[fw],
                    ),
                    f"{fw} {placement} rank {rank}",
                    workers.environment(),
                )
                for rank in range(2)
            ]
        ready = pool.ready()
        info = {name: ready[group[0]]["info"] for name, group in groups.items()}
        samples = pool.windows(
            groups, [(g, dtype) for g in groups for dtype in DTYPES], args.calls, args.repeats, args.warmup
        )
    rows = []
    for placement, fw, dtype in itertools.product(args.placements, frameworks, DTYPES):
        group = f"{placement} | {fw}"
        wall, cpu = (samples[unit][f"{group} | {dtype}"] for unit in ("ms", "cpu_ms"))
        rows.append(
            {
                "placement": placement,
                "framework": fw,
                "dtype": dtype,
                "bytes": args.elements * (4 if dtype == "float32" else 2),
                "hlo_all_reduce_dtypes": info[group][dtype].get("hlo_all_reduce"),
                "wall_ms": statistics.median(wall),
                "cpu_ms": statistics.median(cpu),
                "wall_ms_windows": wall,
                "cpu_ms_windows": cpu,
            }
        )
    return {"rows": rows, "info": info, "torch_python": pythons["torch"]}


def _table(rows: list) -> str:
    by = {(r["placement"], r["framework"], r["dtype"]): r for r in rows}
    cells = []
    for r in (r for r in rows if r["framework"] == "jax"):
        t = by.get((r["placement"], "torch", r["dtype"]))  # None: PyTorch skipped
        cells.append(
            [
                r["placement"],
                r["dtype"],
                workers.fmt(r["bytes"] / 2**20),
                workers.fmt(r["wall_ms"]),
                workers.fmt(t and t["wall_ms"]),
                workers.fmt(t and r["wall_ms"] / t["wall_ms"]),
                workers.fmt(r["cpu_ms"]),
                workers.fmt(t and t["cpu_ms"]),
                ", ".join(r["hlo_all_reduce_dtypes"] or []) or "n/a",
            ]
        )
    return "\n".join(
        env.markdown_table(
            [
                "placement",
                "dtype",
                "MiB",
                "JAX ms (wall)",
                "PyTorch ms (wall)",
                "JAX / PyTorch (wall)",
                "JAX CPU ms",
                "PyTorch CPU ms",
                "JAX all-reduce in the HLO",
            ],
            cells,
            ["l", "l"] + ["r"] * 6 + ["l"],
        )
    )


def main(argv=None) -> None:
    args = _parse_args(argv)
    env.check_json_path(args.json)
    if args.worker:
        return _worker_main(args)
    began = workers.begin("allreduce", pinned="pinned" in args.placements)
    result = _measure(args)
    print(_table(result["rows"]))
    workers.finish(
        began,
        f"{args.repeats} windows of {args.calls} all-reduces of {args.elements:,} values per case",
        args.json,
        {"elements": args.elements, "calls": args.calls, "repeats": args.repeats, **result},
    )


if __name__ == "__main__":
    try:
        main()
    except workers.WorkerFailedError as error:
        sys.exit(f"allreduce: {error}")
