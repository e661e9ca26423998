"""The two kinds of Ray actor a ParameterServerStrategy starts: parameter servers, which
store shards of the variables and add the updates workers push, and workers, which run the
coordinator's scheduled functions on their own devices.

Both are plain classes here; `cluster.py` wraps them with `ray.remote` (so importing this file
needs no Ray cluster). A parameter server holds NumPy arrays only and never imports JAX.
"""

from __future__ import annotations

import os

import numpy as np


class ParameterServer:
    """One parameter server: a dict {(leaf, shard): array} and a count of the pushes applied.

    Ray runs one method at a time on an actor, so a push (all its adds) is atomic with
    respect to other pushes and pulls of this server.
    """

    def __init__(self, index: int):
        self.index = index
        self.values: dict = {}
        self.version = 0
        self.optimizers: dict = {}  # group -> its ServerOptimizer (update="gradients")

    def ping(self) -> int:
        return os.getpid()

    def replace(self, values: dict) -> None:
        """Takes a new layout's values (copies: arrays Ray hands over are read-only)."""
        self.values = {key: np.array(value) for key, value in values.items()}

    def assign(self, values: dict) -> None:
        for key, value in values.items():
            self.values[key] = np.array(value)

    def pull(self, keys=None) -> tuple[int, dict]:
        """(pushes applied, values): every value, or those of `keys` (a list of keys)."""
        if keys is None:
            return self.version, self.values
        return self.version, {key: self.values[key] for key in keys}

    def configure(self, txs: list, groups: list) -> None:
        """Takes the optimizers whose updates this server applies (update="gradients"): per
        group its optax transformation and what this server holds of it (None: nothing), as
        `Layout.server_groups` describes it. Imports JAX: only under that rule."""
        from mirrax._src.parameter_server import gradient_rule

        self.optimizers = {
            g: gradient_rule.ServerOptimizer(tx, *held)
            for g, (tx, held) in enumerate(zip(txs, groups))
            if held
        }

    def push(self, adds: dict, assigns: dict, gradients: dict | None = None) -> int:
        """Adds `adds`, stores `assigns`, and applies `gradients` ({group: (updates, {key: sum
        of their gradients})}) with the groups' optimizers; returns the number of pushes
        before this one."""
        for key, delta in adds.items():
            self.values[key] += delta
        for key, value in assigns.items():
            self.values[key] = np.array(value)
        for group, (count, sums) in (gradients or {}).items():
            self.optimizers[group].apply(self.values, sums, count)
        self.version += 1
        return self.version - 1


class Worker:
    """One worker: its local MirroredStrategy, its per-worker datasets and iterators, and a
    copy of the held NNX objects that each scheduled function starts from.

    Ray restarts a worker whose process dies by calling `__init__` again with the same
    arguments; the coordinator then attaches the parameter servers and creates its datasets
    again.
    """

    def __init__(self, index: int, num_workers: int):
        from mirrax._src.parameter_server import worker_side

        self.index = index
        self.state = worker_side.WorkerState(index, num_workers)

    def ping(self) -> int:
        return os.getpid()

    def attach(self, parameter_servers: list) -> int:
        """Takes the parameter servers' handles (after every start: a handle passed to
        `__init__` would have to outlive the actor for Ray to restart it)."""
        self.state.parameter_servers = list(parameter_servers)
        return os.getpid()

    def num_replicas(self) -> int:
        return self.state.strategy.num_replicas_in_sync

    def create_dataset(self, dataset_id: int, dataset_fn: bytes) -> None:
        self.state.create_dataset(dataset_id, dataset_fn)

    def run(self, payload: dict) -> tuple:
        """Runs one scheduled function: ("ok", pickled result, staleness, (bytes pulled,
        bytes pushed)), ("error", pickled error) for an error the function raised, ("lost",
        message) when a parameter server is lost, or ("restarted",) when this is a restarted
        process not yet attached (the function did not run)."""
        return self.state.run(payload)
