"""Timing: steps with a cap on how many run ahead, interleaved windows (so drift hits every
variant alike), medians of same-round ratios, a cProfile printout. JAX-free at import."""

from __future__ import annotations

import collections
import cProfile
import io
import pstats
import statistics
import sys
import threading
import time


def run_steps(step, block, steps: int, max_in_flight: int) -> float:
    """Runs `step()` `steps` times, then `block(last output)`; returns the seconds spent inside
    the `step()` calls (host time)."""
    import jax  # the caller has started JAX

    # At most `max_in_flight` steps are dispatched ahead of the one that finished: XLA:CPU
    # deadlocks in the all-reduce rendezvous when ~100 multi-device steps are queued.
    in_flight = collections.deque()
    host = 0.0
    last = None
    for _ in range(steps):
        start = time.perf_counter()
        out = step()
        host += time.perf_counter() - start
        in_flight.append(out)
        while len(in_flight) > max_in_flight:
            last = in_flight.popleft()
            jax.block_until_ready(last)
    block(in_flight[-1] if in_flight else last)
    return host


def interleave(windows: dict, repeats: int, order: str = "rotate") -> dict:
    """{name: [seconds of each round]} for `windows` {name: fn() -> seconds or None}.

    Each round runs every window once; `order` "rotate" shifts the order by one every round,
    "flip" reverses it every other round. A window returning None is timed from outside.
    """
    names = list(windows)
    samples = {name: [] for name in names}
    for r in range(repeats):
        if order == "rotate":
            shift = r % len(names)
            turn = names[shift:] + names[:shift]
        else:
            turn = names if r % 2 == 0 else names[::-1]
        for name in turn:
            start = time.perf_counter()
            inner = windows[name]()
            samples[name].append(inner if inner is not None else time.perf_counter() - start)
    return samples


def paired_ratio(samples: dict, key: str, reference) -> float:
    """The median over rounds of samples[key][i] / reference(i) (a key or a function of i)."""
    ref = (lambda i: samples[reference][i]) if isinstance(reference, str) else reference
    return statistics.median(a / ref(i) for i, a in enumerate(samples[key]))


def medians(samples: dict, scale: float = 1.0) -> dict:
    return {key: statistics.median(v) * scale for key, v in samples.items()}


def profile(run, title: str, limit: int = 30, threads: bool = False) -> None:
    """cProfile of `run()`, the top `limit` functions by own and cumulative time, on stderr;
    with `threads`, each thread `run` starts (an input prefetch thread) is profiled too."""
    started = []

    def profile_new_thread(*_):
        # Called once in each thread started from here on: hand it its own profiler.
        sys.setprofile(None)
        started.append(cProfile.Profile())
        started[-1].enable()

    profiler = cProfile.Profile()
    if threads:
        threading.setprofile(profile_new_thread)
    profiler.enable()
    try:
        run()
    finally:
        profiler.disable()
        threading.setprofile(None)
    time.sleep(0.5 if threads else 0)  # a prefetch thread sees its stop flag within 0.1 s
    reports = [(profiler, "tottime", ""), (profiler, "cumulative", "")]
    reports += [(p, "cumulative", " (a thread it started)") for p in started]
    for source, sort, where in reports:
        text = io.StringIO()
        pstats.Stats(source, stream=text).strip_dirs().sort_stats(sort).print_stats(limit)
        print(f"\n### cProfile of {title}{where}, sorted by {sort}\n", file=sys.stderr)
        print(text.getvalue(), file=sys.stderr, flush=True)
