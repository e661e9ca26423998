"""Bare Gloo all-reduce of a gradient-sized vector: JAX (XLA:CPU) against PyTorch, 2 processes.

What one all-reduce of the MLP's gradient (784-1024-1024-10: 1,863,690 float32 values, 7.11
MiB) costs between two processes on this machine, with nothing else in the program: the floor
under the gradient all-reduce of `multi_worker.py`'s 2-worker step.

- JAX: plain `jax.distributed.initialize` on 127.0.0.1 with
  `jax_cpu_collectives_implementation="gloo"`, one CPU device per process
  (`--xla_force_host_platform_device_count=1`, `--xla_cpu_multi_thread_eigen=false`, as
  `multi_worker.py`), and `jax.jit(jax.shard_map(lambda x: jax.lax.psum(x[0], axis)))` over the
  2-device global mesh. No mirrax.
- PyTorch: `torch.distributed` with the Gloo backend (`init_process_group("gloo")`, TCP on
  127.0.0.1), `dist.all_reduce(tensor)` in place, `torch.set_num_threads(1)`. Taken from the
  interpreter given by `--torch-python` (default: this one if it imports torch, else
  `.venv-peers/bin/python`); skipped with a message when neither has torch.

Each framework sums float32, bfloat16 and float16 vectors of the same element count (so the
reduced-precision ones carry half the bytes). For JAX the dtype the compiled all-reduce really
uses is read from the optimized HLO: XLA:CPU promotes a bfloat16 all-reduce to float32 (a
convert before and after), and keeps float16.

Two placements: "pinned", each process on its own core (`os.sched_setaffinity`, as
`multi_worker.py`: every thread of the process, Gloo's I/O thread included, shares that core),
and "unpinned" (both cores for both processes).

Timing: long-lived process pairs; after a warm-up, the driver runs windows of `--calls`
all-reduces (each waited for: `jax.block_until_ready`; PyTorch's `all_reduce` returns when
done), rotating over every (placement, framework, dtype) case each round, for `--repeats`
rounds. Reported per case: the median wall ms per all-reduce (the slower process of the pair),
the median CPU ms per all-reduce (all threads, mean of the two processes: the work the
all-reduce costs a core, which other jobs on the machine barely change), and JAX / PyTorch.

Usage:
  python benchmarks/allreduce.py                      # ~2 minutes
  python benchmarks/allreduce.py --calls 10 --repeats 9 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import socket
import statistics
import subprocess
import sys
import threading
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import overhead  # noqa: E402  (JAX-free: imports JAX only inside)
from overhead import _processor_name  # noqa: E402

ELEMENTS = 1_863_690  # the MLP 784-1024-1024-10's parameters (multi_worker.py)
DTYPES = ("float32", "bfloat16", "float16")
PLACEMENTS = ("pinned", "unpinned")
REPLY = "@@ar "
STARTUP_TIMEOUT_S = 300
WINDOW_TIMEOUT_S = 300


def _parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Bare Gloo all-reduce between 2 processes: JAX (XLA:CPU) vs PyTorch.")
    parser.add_argument("--elements", type=int, default=ELEMENTS,
                        help=f"values per all-reduce ({ELEMENTS:,}, the MLP's gradient)")
    parser.add_argument("--calls", type=int, default=20, help="all-reduces per window (20)")
    parser.add_argument("--repeats", type=int, default=7, help="windows per case (7)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed calls per case (5)")
    parser.add_argument("--placements", default=",".join(PLACEMENTS),
                        help="comma-separated subset of pinned,unpinned")
    parser.add_argument("--torch-python", help="interpreter with torch (default: see above)")
    parser.add_argument("--json", metavar="PATH", help="also write the results to PATH as JSON")
    parser.add_argument("--worker", nargs=5, metavar=("FRAMEWORK", "RANK", "PORT", "CORE",
                                                      "ELEMENTS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if min(args.calls, args.repeats, args.elements) < 1 or args.warmup < 0:
        parser.error("--calls, --repeats and --elements must be >= 1, --warmup >= 0")
    args.placements = tuple(p for p in PLACEMENTS if p in args.placements.split(","))
    if not args.placements:
        parser.error("--placements: choose from pinned,unpinned")
    return args


# -- workers -------------------------------------------------------------------------------------


def _jax_worker(rank: int, port: int, elements: int) -> tuple:
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=rank)
    mesh = Mesh(np.array(jax.devices()), ("replica",))
    psum = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x[0], "replica"), mesh=mesh,
                                 in_specs=P("replica"), out_specs=P()))
    calls, info = {}, {"jax": jax.__version__}
    for dtype in DTYPES:
        local = np.ones((1, elements), dtype=jax.numpy.dtype(dtype))
        x = jax.make_array_from_single_device_arrays(
            (2, elements), NamedSharding(mesh, P("replica")),
            [jax.device_put(local, jax.local_devices()[0])])
        out = jax.block_until_ready(psum(x))
        assert float(np.asarray(out.addressable_data(0))[0]) == 2.0, "the sum is wrong"
        hlo = psum.lower(x).compile().as_text()
        info[dtype] = {"hlo_all_reduce": _all_reduce_dtypes(hlo)}
        calls[dtype] = lambda x=x: jax.block_until_ready(psum(x))
    return calls, info


def _all_reduce_dtypes(hlo_text: str) -> list:
    """The element types of the all-reduce ops of an optimized HLO module, e.g. ['f32']."""
    import re

    return re.findall(r"=\s*(\w+)\[[\d,]*\][^=]*?\sall-reduce(?:-start)?\(", hlo_text)


def _torch_worker(rank: int, port: int, elements: int) -> tuple:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    calls, info = {}, {"torch": torch.__version__}
    for dtype in DTYPES:
        t = torch.ones(elements, dtype=getattr(torch, dtype))
        check = t.clone()
        dist.all_reduce(check)
        assert float(check[0]) == 2.0, "the sum is wrong"
        calls[dtype] = lambda t=t: dist.all_reduce(t)  # in place: sums grow, time does not
        info[dtype] = {}
    return calls, info


def _worker_main(args) -> None:
    framework, rank, port, core, elements = args.worker
    if core != "any":
        os.sched_setaffinity(0, {int(core)})  # before any thread starts: all inherit it
    reply_to = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # JAX and Gloo print on stdout; keep the reply channel clean

    def reply(obj):
        reply_to.write(REPLY + json.dumps(obj) + "\n")
        reply_to.flush()

    build = {"jax": _jax_worker, "torch": _torch_worker}[framework]
    try:
        calls, info = build(int(rank), int(port), int(elements))
    except BaseException:
        reply({"error": traceback.format_exc()})
        os._exit(1)
    reply({"ready": True, "info": info})
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "quit":
            break
        call = calls[command["dtype"]]
        start, cpu = time.perf_counter(), time.process_time()
        for _ in range(command["calls"]):
            call()
        reply({"seconds": time.perf_counter() - start, "cpu_seconds": time.process_time() - cpu})
    reply({"bye": True})
    # Leave without the frameworks' shutdown handshakes (the peer may already be gone).
    os._exit(0)


# -- the driver ----------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Pair:
    """Two worker processes of one framework, talking over loopback Gloo."""

    def __init__(self, framework: str, python: str, placement: str, elements: int, log_dir: str):
        self.label = f"{framework} {placement}"
        self.replies: queue.Queue = queue.Queue()
        port = _free_port()
        env = dict(os.environ)
        env.update({
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": "--xla_force_host_platform_device_count=1 "
                         "--xla_cpu_multi_thread_eigen=false",
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
        })
        self.processes, self.logs = [], []
        for rank in range(2):
            log = os.path.join(log_dir, f"{framework}-{placement}-{rank}.log")
            self.logs.append(log)
            sink = open(log, "wb")
            process = subprocess.Popen(
                [python, os.path.abspath(__file__), "--worker", framework, str(rank), str(port),
                 str(rank) if placement == "pinned" else "any", str(elements)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=sink, text=True, env=env)
            sink.close()
            threading.Thread(target=self._read, args=(process,), daemon=True).start()
            self.processes.append(process)

    def _read(self, process):
        for line in process.stdout:
            if line.startswith(REPLY):
                self.replies.put((process, json.loads(line[len(REPLY):])))
        self.replies.put((process, None))

    def send(self, obj):
        for p in self.processes:
            p.stdin.write(json.dumps(obj) + "\n")
            p.stdin.flush()

    def receive(self, timeout: float) -> list:
        answers = {}
        deadline = time.monotonic() + timeout
        while len(answers) < 2:
            try:
                process, answer = self.replies.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.fail(f"no answer within {timeout} s")
            if answer is None or "error" in answer:
                self.fail("exited" if answer is None else answer["error"])
            answers[id(process)] = answer
        return [answers[id(p)] for p in self.processes]

    def fail(self, what: str):
        tails = []
        for log in self.logs:
            with open(log, errors="replace") as f:
                tails.append(f"--- {log}\n{f.read()[-3000:]}")
        raise SystemExit(f"allreduce.py: {self.label}: {what}\n" + "\n".join(tails))

    def close(self):
        for p in self.processes:
            if p.poll() is None:
                try:
                    p.stdin.write(json.dumps({"op": "quit"}) + "\n")
                    p.stdin.flush()
                    p.wait(30)
                except (OSError, subprocess.TimeoutExpired):
                    p.kill()
                    p.wait()


def _torch_python(args) -> str | None:
    candidates = [args.torch_python] if args.torch_python else [
        sys.executable,
        os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                     ".venv-peers", "bin", "python"),
    ]
    for python in candidates:
        if python and os.path.exists(python) and subprocess.run(
                [python, "-c", "import torch.distributed"], capture_output=True).returncode == 0:
            return python
    return None


def _measure(args, log_dir: str) -> dict:
    torch_python = _torch_python(args)
    if torch_python is None:
        print("allreduce.py: no interpreter with torch (give --torch-python): PyTorch skipped",
              file=sys.stderr)
    frameworks = [("jax", sys.executable)] + ([("torch", torch_python)] if torch_python else [])
    pairs = {(placement, fw): _Pair(fw, python, placement, args.elements, log_dir)
             for placement in args.placements for fw, python in frameworks}
    try:
        info = {f"{k[0]} | {k[1]}": pair.receive(STARTUP_TIMEOUT_S)[0]["info"]
                for k, pair in pairs.items()}
        cases = [(placement, fw, dtype) for (placement, fw) in pairs for dtype in DTYPES]

        def window(case, calls):
            pair = pairs[case[:2]]
            pair.send({"op": "window", "dtype": case[2], "calls": calls})
            answers = pair.receive(WINDOW_TIMEOUT_S)
            return (max(a["seconds"] for a in answers) / calls,
                    statistics.mean(a["cpu_seconds"] for a in answers) / calls)

        for case in cases:
            if args.warmup:
                window(case, args.warmup)
        wall = {case: [] for case in cases}
        cpu = {case: [] for case in cases}
        for r in range(args.repeats):
            order = cases[r % len(cases):] + cases[:r % len(cases)]
            for case in order:
                seconds, cpu_seconds = window(case, args.calls)
                wall[case].append(seconds * 1e3)
                cpu[case].append(cpu_seconds * 1e3)
    finally:
        for pair in pairs.values():
            pair.close()
    rows = []
    for case in cases:
        placement, fw, dtype = case
        hlo = info[f"{placement} | {fw}"][dtype].get("hlo_all_reduce")
        rows.append({
            "placement": placement, "framework": fw, "dtype": dtype,
            "bytes": args.elements * (4 if dtype == "float32" else 2),
            "hlo_all_reduce_dtypes": hlo,
            "wall_ms": statistics.median(wall[case]), "cpu_ms": statistics.median(cpu[case]),
            "wall_ms_windows": wall[case], "cpu_ms_windows": cpu[case],
        })
    return {"rows": rows, "info": info, "torch_python": torch_python}


def _table(rows: list) -> str:
    by = {(r["placement"], r["framework"], r["dtype"]): r for r in rows}
    lines = [
        "| placement | dtype | MiB | JAX ms (wall) | PyTorch ms (wall) | JAX / PyTorch (wall) "
        "| JAX CPU ms | PyTorch CPU ms | JAX all-reduce in the HLO |",
        "| --- | --- |" + " ---: |" * 6 + " --- |",
    ]
    for r in rows:
        if r["framework"] != "jax":
            continue
        t = by.get((r["placement"], "torch", r["dtype"]))

        def fmt(value):
            return "n/a" if value is None else f"{value:.2f}"

        lines.append(
            f"| {r['placement']} | {r['dtype']} | {r['bytes'] / 2**20:.2f} | {r['wall_ms']:.2f} "
            f"| {fmt(t and t['wall_ms'])} | {fmt(t and r['wall_ms'] / t['wall_ms'])} "
            f"| {r['cpu_ms']:.2f} | {fmt(t and t['cpu_ms'])} "
            f"| {', '.join(r['hlo_all_reduce_dtypes'] or []) or 'n/a'} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    args = _parse_args(argv)
    overhead.check_json_path(args.json)
    if args.worker:
        _worker_main(args)
        return
    if "pinned" in args.placements and len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("allreduce.py: pinned placement needs cores 0 and 1; this process may "
                         f"use {sorted(os.sched_getaffinity(0))}.")
    import tempfile

    began = time.perf_counter()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="mirrax-allreduce-") as log_dir:
        result = _measure(args, log_dir)
    print(_table(result["rows"]))
    total = time.perf_counter() - began
    load_after = os.getloadavg()[0]
    print(f"\n{args.repeats} windows of {args.calls} all-reduces of {args.elements:,} values per "
          f"case; total {total:.0f} s; load average {load_before:.2f} before, "
          f"{load_after:.2f} after", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({
                "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
                "elements": args.elements, "calls": args.calls, "repeats": args.repeats,
                "processor": _processor_name(), "host_cpus": os.cpu_count(),
                "python": platform.python_version(), "total_s": total,
                "load_average_before_after": [load_before, load_after], **result,
            }, f, indent=1)


if __name__ == "__main__":
    main()
