"""Time lost per restart of a multi-worker fit under `mirrax launch --max-restarts`, by phase.

A 2x2 job (2 workers x 2 CPU devices, Gloo on loopback) trains the tutorial CNN on the digits
with `BackupAndRestore(save_freq=5)`; in the first attempt worker 1 SIGKILLs itself at epoch 2,
step 8. Each worker stamps the wall clock (one machine, one clock) at its start, after importing
mirrax, after building the strategy (jax.distributed's start, every peer joined), after the
model's build, after the backup's restore (on_train_begin of a callback after
BackupAndRestore), and after the attempt's first step (its loss read: compiled and run). The
phases of the restart:

  detect+respawn: the kill -> the first restarted worker's start (the launcher's poll, SIGTERM
                  to the survivor and its exit, the new processes);
  import:         python and `import mirrax` (JAX);
  join:           MultiWorkerMirroredStrategy() (the coordination service, every peer);
  build:          the data loaded, the model built and compiled (`Model.compile`);
  restore:        fit's start to the backup restored (BackupAndRestore.on_train_begin);
  compile+step:   the first step (tracing, XLA compilation, one step);
  redone:         the steps trained again (after the last backup), at the uninterrupted pace.

Run with and without a persistent compilation cache (`JAX_COMPILATION_CACHE_DIR`, every entry
kept): attempt 1 then reads the programs attempt 0 compiled.

Usage:
  python -m benchmarks.restarts                 # ~2 minutes on 2 cores
  python -m benchmarks.restarts --repeats 3 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

KILL_AT = (1, 7)  # (epoch index, batch index) of attempt 0 where worker 1 dies
SAVE_FREQ = 5
PHASES = ("detect+respawn", "import", "join", "build", "restore", "compile+step", "redone")


def _stamp(out_dir: str, attempt: int, rank: int, event: str) -> None:
    with open(os.path.join(out_dir, f"events-{attempt}-{rank}.jsonl"), "a") as f:
        f.write(json.dumps({"event": event, "t": time.time()}) + "\n")


def _worker(out_dir: str) -> None:
    rank = int(os.environ["MIRRAX_LAUNCH_RANK"])
    attempt = int(os.environ["MIRRAX_LAUNCH_RESTART_COUNT"])
    _stamp(out_dir, attempt, rank, "start")
    import numpy as np
    from flax import nnx
    from mirrax.examples.keras_fit import TutorialCNN

    import mirrax

    _stamp(out_dir, attempt, rank, "imported")
    strategy = mirrax.MultiWorkerMirroredStrategy()
    _stamp(out_dir, attempt, rank, "strategy")
    (x, y), _ = mirrax.data.load_digits()
    x, y = x[:640].astype(np.float32), y[:640]
    with strategy.scope():
        model = mirrax.Model(TutorialCNN((8, 8, 1), 10, rngs=nnx.Rngs(0)))
        model.compile("adam", mirrax.losses.SparseCategoricalCrossentropy(from_logits=True))
    epoch_now, steps = [0], []

    def on_train_begin(logs):
        _stamp(out_dir, attempt, rank, "restored")

    def on_batch_end(batch, logs):
        float(logs["loss"])  # waits for the step
        steps.append(time.time())
        if len(steps) == 1:
            _stamp(out_dir, attempt, rank, "first_step")
        if attempt == 0 and rank == 1 and (epoch_now[0], batch) == KILL_AT:
            _stamp(out_dir, attempt, rank, "kill")
            os.kill(os.getpid(), 9)

    timer = mirrax.callbacks.LambdaCallback(
        on_train_begin=on_train_begin,
        on_epoch_begin=lambda epoch, logs: epoch_now.__setitem__(0, epoch),
        on_train_batch_end=on_batch_end,
    )
    backup = mirrax.callbacks.BackupAndRestore(os.path.join(out_dir, "backup"), save_freq=SAVE_FREQ)
    _stamp(out_dir, attempt, rank, "built")
    model.fit(x, y, batch_size=64, epochs=3, shuffle=False, verbose=0, callbacks=[backup, timer])
    pace = statistics.median(b - a for a, b in zip(steps[1:], steps[2:]))
    _stamp(out_dir, attempt, rank, f"pace {pace}")


def _events(out_dir: str, attempt: int) -> dict:
    events: dict = {}
    for rank in (0, 1):
        path = os.path.join(out_dir, f"events-{attempt}-{rank}.jsonl")
        for line in open(path):
            record = json.loads(line)
            events.setdefault(record["event"], []).append(record["t"])
    return events


def _one_job(cache: bool) -> dict:
    with tempfile.TemporaryDirectory(prefix="mirrax-restarts-") as out_dir:
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        env.pop("XLA_FLAGS", None)
        if cache:
            env.update(
                JAX_COMPILATION_CACHE_DIR=os.path.join(out_dir, "cache"),
                JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
            )
        launch = "mirrax._src.cli.main launch --nproc 2 --cpu-devices 2 --max-restarts 1 --restart-delay 0"
        command = [sys.executable, "-m", *launch.split(), "--", sys.executable, "-m", "benchmarks.restarts"]
        command += ["--worker", out_dir]
        done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
        if done.returncode != 0:
            raise RuntimeError(f"the job failed ({done.returncode}):\n{done.stderr[-3000:]}")
        first, second = _events(out_dir, 0), _events(out_dir, 1)
    pace = min(float(k.split()[1]) for k in second if k.startswith("pace"))
    # Steps since the last backup: the kill's global step minus the last multiple of SAVE_FREQ.
    steps_per_epoch = 640 // 64
    killed_step = KILL_AT[0] * steps_per_epoch + KILL_AT[1] + 1
    redone = killed_step - killed_step // SAVE_FREQ * SAVE_FREQ
    last = lambda name: max(second[name])  # noqa: E731  (the slower worker gates the job)
    return {
        "detect+respawn": min(second["start"]) - first["kill"][0],
        "import": last("imported") - min(second["start"]),
        "join": last("strategy") - last("imported"),
        "build": last("built") - last("strategy"),
        "restore": last("restored") - last("built"),
        "compile+step": last("first_step") - last("restored"),
        "redone": redone * pace,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2, help="jobs per configuration (2)")
    parser.add_argument("--json", metavar="PATH", help="also write the results to PATH as JSON")
    parser.add_argument("--worker", metavar="OUT_DIR", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args.worker)
        return
    results = {}
    for _ in range(args.repeats):  # interleaved: the two configurations alternate
        for cache in (False, True):
            results.setdefault(cache, []).append(_one_job(cache))
    rows = {
        cache: {phase: statistics.median(job[phase] for job in jobs) for phase in PHASES}
        for cache, jobs in results.items()
    }
    print("| phase | seconds, no cache | seconds, persistent compilation cache |")
    print("| --- | ---: | ---: |")
    for phase in PHASES + ("total",):
        values = [sum(rows[c].values()) if phase == "total" else rows[c][phase] for c in (False, True)]
        print(f"| {phase} | {values[0]:.2f} | {values[1]:.2f} |")
    print(
        f"\nmedians of {args.repeats} jobs per column; 2 workers x 2 CPU devices, {os.cpu_count()} host CPUs"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({str(k): v for k, v in results.items()}, f, indent=1)


if __name__ == "__main__":
    main()
