"""The coordinator's side of the variables a ParameterServerStrategy holds: which objects
are held, writing them to the parameter servers, reading them back into the coordinator's
objects, and the structure a worker needs to rebuild them.

An NNX object becomes held the first time a scheduled function uses it. Its values then
live on the parameter servers; the coordinator's object is a copy, refreshed by `join()`,
by a `Checkpoint` that saves it, and by `refresh()`. A value the user assigns on the
coordinator (a restored checkpoint, `nnx.update`, a new learning rate) is written to the
parameter servers before the next scheduled function is sent.
"""

from __future__ import annotations

import threading
import weakref

from mirrax import errors
from mirrax._src.parameter_server import gradient_rule, variables, wire
from mirrax._src.parameter_server.ray_calls import LostParameterServer, call_servers

# Seconds the coordinator waits for the parameter servers to answer a read or a write.
TIMEOUT_S = 60.0

# Every held object -> its store, so that a Checkpoint (which knows nothing of strategies)
# can refresh an object before saving it.
_stores: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def refresh_if_held(obj) -> None:
    """Reads `obj`'s current values from the parameter servers when a strategy holds it."""
    store = _stores.get(obj)
    if store is not None:
        store.refresh()


class VariableStore:
    """The objects one ParameterServerStrategy holds, seen from the coordinator: which they
    are, their layout over the parameter servers, and the reads and writes of their values.

    Args:
      parameter_servers: the servers' Ray actor handles.
      partitioner: the strategy's `variable_partitioner` (or None).
      lost: (reason) -> the `LostParameterServerError` to raise when a server is lost.
    """

    def __init__(self, parameter_servers: list, partitioner, lost, update: str = gradient_rule.DIFFERENCES):
        self._servers = parameter_servers
        self._holdings = variables.Holdings(len(parameter_servers), partitioner, update)
        self._lost = lost  # (message) -> LostParameterServerError, raised by the caller
        self._lock = threading.RLock()
        self._structure: bytes | None = None
        # After a shutdown or a lost server the objects are the coordinator's own again:
        # nothing more is read from or written to the servers.
        self._detached = False

    @property
    def version(self) -> int:
        return self._holdings.version

    @property
    def count(self) -> int:
        """The number of held objects."""
        return len(self._holdings.roots)

    def holds(self, obj) -> bool:
        return self._holdings.holds(obj)

    def index(self, obj) -> int:
        return self._holdings.index(obj)

    def structure(self) -> bytes:
        """(graphdef, treedef, layout) pickled, for a worker that has an older version."""
        with self._lock:
            if self._structure is None:
                h = self._holdings
                self._structure = wire.dumps((h.graphdef, h.treedef, h.layout))
            return self._structure

    def check_not_held_elsewhere(self, obj) -> None:
        """Refuses an object another (live) ParameterServerStrategy holds.

        Raises:
          MixedStrategyError: it is held by another strategy's parameter servers.
        """
        other = _stores.get(obj)
        if other is not None and other is not self and not other._detached:
            raise errors.MixedStrategyError(
                f"ClusterCoordinator.schedule: this {type(obj).__name__} is held by the "
                "parameter servers of another ParameterServerStrategy; one object can live on "
                "one strategy's servers only (their updates would be lost between them). Shut "
                "the other strategy down first (strategy.shutdown()), or use another object."
            )

    def detach(self) -> None:
        """Reads the servers' last values into the coordinator's objects (when they still
        answer), then leaves the objects to the coordinator (at shutdown)."""
        with self._lock:
            if not self._detached:
                try:
                    self.refresh()
                except errors.MirraxError:
                    pass  # a lost server, a changed structure: the objects keep their values
            self._detached = True

    def _call(self, method: str, per_server_args: list) -> list:
        try:
            return call_servers(self._servers, method, per_server_args, TIMEOUT_S)
        except LostParameterServer as e:
            self._detached = True
            raise self._lost(str(e)) from None

    def add(self, new_roots: list) -> None:
        """Holds `new_roots` too. The caller has waited for every scheduled function to
        finish, so the parameter servers' values are final while the layout changes."""
        with self._lock:
            if self._holdings.roots:
                self.refresh()
            per_server = self._holdings.relayout(list(new_roots))
            self._structure = None
            self._call("replace", [(values,) for values in per_server])
            layout = self._holdings.layout
            assert layout is not None  # relayout made it
            if layout.groups:  # update="gradients": each server applies its slice's updates
                txs = [group.tx for group in layout.groups]
                self._call("configure", [(txs, layout.server_groups(ps)) for ps in range(len(self._servers))])
            for root in new_roots:
                _stores[root] = self

    def write_assigned(self) -> None:
        """Writes the values the user replaced on the coordinator to the parameter servers, and
        takes a static attribute the user changed there (`model.eval()`) as a new structure for
        the workers.

        Raises:
          UnsupportedArgumentError: a held object's variables were added or removed.
        """
        with self._lock:
            if not self._holdings.roots or self._detached or self._holdings.unchanged():
                return
            assigned = self._holdings.assigned(self._holdings.current_leaves())
            if self._holdings.take_graphdef():
                self._structure = None  # the workers take the new graph with the next function
            if all(a is None for a in assigned):
                self._holdings.sync()
                return
            layout = self._holdings.layout
            assert layout is not None  # made with the first held object
            per_server = layout.split(assigned)
            self._call("assign", [(values,) for values in per_server])
            self._holdings.mark_seen()

    def refresh(self) -> None:
        """Reads every held value from the parameter servers into the coordinator's objects
        (after writing the values the user assigned there, which would be lost otherwise)."""
        with self._lock:
            if not self._holdings.roots or self._detached:
                return
            self.write_assigned()
            answers = self._call("pull", [()] * len(self._servers))
            layout = self._holdings.layout
            assert layout is not None  # made with the first held object
            leaves = layout.join([values for _, values in answers])
            self._holdings.write_back(leaves)

    def placement(self) -> dict:
        with self._lock:
            if not self._holdings.roots:
                return {}
            layout = self._holdings.layout
            assert layout is not None  # made with the first held object
            return layout.describe(self._holdings.paths)
