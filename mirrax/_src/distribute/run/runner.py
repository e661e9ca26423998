"""The per-strategy runner of `strategy.run`: its caches, its in-flight queue, one call's path.

A call is sorted into slots (arguments.py), its NNX objects' Variables are found (nodes.py,
skipping the flatten when the same objects come back unchanged), the program for its structure
is found or compiled (program.py), the state is placed and, where nobody else holds it, donated,
and the step's new state is written back into the caller's Variables, so mutation looks in
place as in TF.

Donation and aliases (bound_state.py): an array someone else also references is copied for the
step instead of donated, so every array a user holds stays valid and keeps its value. An
array placed on the replicas for a step is a fresh copy, never sharing the buffers of the
array it came from. Not seen: a per-device piece taken with `addressable_data(i)` or
`addressable_shards[i].data` shares its parent's buffer without referencing the parent, so
it is deleted with it (as in plain JAX); copy it (`np.asarray`) to keep it.
"""

from __future__ import annotations

import collections
import warnings

import jax
import numpy as np
from flax import nnx

from mirrax import errors
from mirrax._src.distribute import _compat
from mirrax._src.distribute.replica_context import current_replica_context
from mirrax._src.distribute.run import arguments, bound_state, captures, tracing
from mirrax._src.distribute.run import nodes as nodes_lib
from mirrax._src.distribute.run import program as prog
from mirrax._src.distribute.run.arguments import StaticSlot, is_variable
from mirrax._src.distribute.run.placement import place
from mirrax._src.distribute.values import Mirrored, PerReplica

_CACHE_SIZE = 256
_MEMO_SIZE = 16  # programs remembered per set of NNX objects
_RETRACE_WARNING_AT = 6
# The node state of objects a `mirrax.function` trace made: never cached (they live one trace).
_UNCACHED = nodes_lib.NodeState((), None, None)
# XLA:CPU runs a multi-device program's all-reduce as a rendezvous of host threads; with about
# 100 such steps queued it deadlocks and aborts the process. On CPU, wait for the oldest step
# once this many are in flight (accelerators queue steps on their own streams and need no cap).
CPU_MAX_IN_FLIGHT = 4


class LRU:
    """A dict of at most `size` entries that drops the least recently used."""

    def __init__(self, size: int = _CACHE_SIZE):
        self._size = size
        self._entries: collections.OrderedDict = collections.OrderedDict()

    def get(self, key):
        value = self._entries.get(key)
        if value is not None:
            self._entries.move_to_end(key)
        return value

    def put(self, key, value) -> None:
        self._entries[key] = value
        self._entries.move_to_end(key)
        if len(self._entries) > self._size:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()


class Runner:
    """Runs, lowers and caches the programs of one strategy's `run` calls."""

    def __init__(self, strategy):
        self._strategy = strategy
        self._programs = LRU()
        self._nodes = nodes_lib.NodeCache()
        self._example_counts = LRU()  # int -> replicated int32 scalar
        self._compile_counts: dict = {}
        devices = strategy.extended.replica_devices.devices
        self._in_flight: collections.deque | None = (
            collections.deque() if len(devices) > 1 and devices[0].platform == "cpu" else None
        )

    @property
    def strategy(self):
        """The strategy whose `run` this runner implements."""
        return self._strategy

    def clear(self) -> None:
        """Drops the compiled programs and cached device values (`clear_session`)."""
        self._programs.clear()
        self._nodes.clear()
        self._example_counts.clear()
        self._compile_counts.clear()
        captures.clear()

    def run(self, fn, args, kwargs):
        """Implements `Strategy.run` (validated there)."""
        trace = tracing.current()
        if trace is not None:
            return self._run_traced(trace, fn, args, kwargs)
        program, binding, call, state_leaves, batch_info, written = self.prepare(fn, args, kwargs)
        if program.sums_padding and not program.padding_warned and call.shortest is not None:
            warn_if_padded(program, call)
        if program.donates:
            state_leaves = bound_state.protect_aliases(binding, state_leaves, written)
        new_state, outputs = program.compiled(state_leaves, call.dynamic, batch_info)
        del state_leaves
        return self.finish(program, binding, call, new_state, outputs)

    def _run_traced(self, trace, fn, args, kwargs):
        """`run` inside a `mirrax.function` trace: the step's program is inlined into the
        function's, on the trace's values; its new state goes into the trace's objects."""
        trace.used(self._strategy)
        program, binding, call, state_leaves, batch_info, _ = self.prepare(fn, args, kwargs, traced=True)
        carried = [isinstance(x, jax.core.Tracer) for x in state_leaves]
        if not all(carried):
            raise errors.CapturedStateError(
                f"mirrax.function: {trace.name} calls strategy.run with "
                f"{arguments.fn_name(call.fn)}, which reaches NNX objects that {trace.name} does "
                "not carry (its arguments, closure and globals, followed three calls deep, are "
                "what it carries); their updates would be lost. Pass those objects to "
                f"{trace.name} as arguments, or capture them directly (a closure variable or "
                "global holding them)."
            )
        if program.sums_padding and not program.padding_warned and call.shortest is not None:
            warn_if_padded(program, call)
        new_state, outputs = program.step(state_leaves, call.dynamic, batch_info)
        return self.finish(program, binding, call, new_state, outputs, traced=True)

    def lower(self, fn, args, kwargs):
        """Implements `Strategy.experimental_lower` (validated there): the program `run` would
        execute, lowered on the arguments it would give it; nothing runs, nothing is written."""
        program, _, call, state_leaves, batch_info, _ = self.prepare(fn, args, kwargs)
        return program.compiled.lower(state_leaves, call.dynamic, batch_info)

    # -- one call -----------------------------------------------------------------------------

    def prepare(self, fn, args, kwargs, traced=False):
        """Sorts the arguments, finds (or compiles) the program, gathers the state arrays
        (`traced`: inside a `mirrax.function` trace, where they are the trace's values).

        Returns (program, binding, call, state leaves, batch info, whether the state leaves
        are the arrays the last step wrote back).
        """
        if current_replica_context() is not None:
            raise errors.ReplicaContextError(
                "strategy.run was called inside a function that strategy.run is already "
                "running; nested run is not supported. Call the inner function directly: it "
                "already runs once per replica."
            )
        strategy = self._strategy
        call = arguments.classify(strategy, fn, args, kwargs, traced)
        batch_info = self.batch_inputs(call)
        mask_key = None if batch_info is None else batch_info[1] is not None

        captured = captures.lookup(call.fn, call.fn_node)
        if captured.nodes:
            captured_at = _add_captured(call, captured)
        else:
            captured_at = ()
        if captured.key is not None:
            call.fn_key = captured.key
        node_state = _UNCACHED if traced else self._nodes.lookup(call.nodes)
        call_key = (call.fn_key, call.treedef, call.slots, mask_key, captured_at)
        program = binding = bound = None
        if node_state.key is not None:
            bound = node_state.memo.get(call_key)
            if bound is not None:
                program, binding = bound
            else:
                key = (call_key, node_state.key)
                program = self._programs.get(key)
                if program is not None and program.order is not None:
                    variables = node_state.variables
                    binding = bound_state.Binding([variables[i] for i in program.order], strategy)
        if binding is None:
            graphdef, state = nnx.split(tuple(call.nodes))
            state_def = jax.tree.structure(state)
            live = jax.tree.leaves(state, is_leaf=is_variable)
            if node_state.key is None:
                key = (call_key, graphdef, state_def)
                program = self._programs.get(key)
            binding = bound_state.Binding(live, strategy)
        if traced:
            state_leaves, written = jax.tree.leaves(list(map(_compat.raw_value, binding.live))), False
        else:
            state_leaves, written = bound_state.state_leaves(
                strategy, binding, call.names, call.nodes, node_state.memo
            )
        if program is None:
            program = self._compile(
                call,
                key,
                graphdef,
                state_def,
                binding,
                node_state,
                state_leaves,
                batch_info,
                captured,
                captured_at,
            )
        if node_state.key is not None and bound is None:
            memo = node_state.memo
            if len(memo) >= _MEMO_SIZE:
                memo.clear()
            memo[call_key] = (program, binding)
        return program, binding, call, state_leaves, batch_info, written

    def batch_inputs(self, call):
        """Places the call's plain arrays (in `call.dynamic`) and returns its batch info: None,
        or (the batch mask, the step's int32 count of real examples over all replicas or
        None). The mask enters sharded and the count replicated, so `compute_average_loss`
        needs no cross-replica sum."""
        strategy = self._strategy
        for position, index in call.array_positions:
            call.dynamic[position] = place(strategy, call.dynamic[position], call.names, index)
        if call.mask is None:
            return None
        return (call.mask, None if call.lengths is None else self._example_count(call.lengths))

    def _compile(
        self,
        call,
        key,
        graphdef,
        state_def,
        binding,
        node_state,
        state_leaves,
        batch_info,
        captured,
        captured_at,
    ):
        strategy = self._strategy
        captures.check_static_holders(call.slots, call.names)
        self._warn_on_retracing(call)
        captured_names = {index: f"{name} (captured)" for index, name in zip(captured_at, captured.names)}
        node_names = tuple(
            captured_names.get(i) or call.names.of_node(node) for i, node in enumerate(call.nodes)
        )
        spec = prog.Spec(
            strategy,
            call.fn,
            call.fn_node,
            call.treedef,
            call.slots,
            graphdef,
            state_def,
            node_names,
            binding.specs,
            captured_at,
        )
        program = prog.compile_program(spec, state_leaves, call.dynamic, batch_info)
        if node_state.key is not None and state_def.num_leaves == len(binding.live):
            index = {id(v): i for i, v in enumerate(node_state.variables)}
            program.order = tuple(index[id(v)] for v in binding.live)
        self._programs.put(key, program)
        return program

    def finish(self, program, binding, call, new_state, outputs, traced=False):
        """Writes the step's new state into the caller's objects and wraps the outputs."""
        if program.same_state:  # a flat list: its first leaf, without a flatten
            first = new_state[0] if new_state else (outputs[0] if outputs else None)
        else:
            first = next(iter(jax.tree.leaves((new_state, outputs))), None)
        if not traced:  # in a mirrax.function's trace, the new state goes into its copies
            if isinstance(first, jax.core.Tracer):
                # Called inside an outer jax.jit / nnx.jit with the NNX objects captured by the
                # jitted function (so no argument was traced): the new state exists only inside
                # that trace, and writing it back into the caller's objects would fail in flax.
                raise arguments.inside_transformation("the step's result")
            self.bound_in_flight(new_state, outputs)
        live = binding.live
        if program.same_state and len(live) == len(new_state) and live:
            _compat.set_raw_values(live, new_state)
            binding.written = new_state
        elif call.nodes:
            if program.same_state:  # flat leaves, but some Variable holds a pytree of them
                new_state = jax.tree.unflatten(program.state_def, new_state)
            nnx.update(tuple(call.nodes), new_state)
            binding.written = None
        return self.wrap(program, call, outputs)

    def wrap(self, program, call, outputs):
        """The step's output arrays as the function's structure of distributed values: a
        `PerReplica` (with the call's batch mask and lengths) where they vary across replicas,
        else a `Mirrored`."""
        strategy = self._strategy
        mask, lengths = call.mask, call.lengths
        wrapped = [
            PerReplica(strategy, x, mask=mask, lengths=lengths) if varying else Mirrored(strategy, x)
            for x, varying in zip(outputs, program.out_varying)
        ]
        return jax.tree.unflatten(program.out_treedef, wrapped)

    # -- caches and queues --------------------------------------------------------------------

    @property
    def caps_in_flight(self) -> bool:
        """Whether steps wait once `CPU_MAX_IN_FLIGHT` are queued (a multi-device CPU mesh)."""
        return self._in_flight is not None

    def bound_in_flight(self, new_state, outputs) -> None:
        """On a multi-device CPU mesh, waits for the oldest step once too many are queued."""
        queue_ = self._in_flight
        if queue_ is None:
            return
        token = outputs[0] if outputs else next(iter(jax.tree.leaves(new_state)), None)
        if token is None:
            return
        queue_.append(token)
        if len(queue_) > CPU_MAX_IN_FLIGHT:
            jax.block_until_ready(queue_.popleft())

    def _example_count(self, lengths) -> jax.Array:
        """The int32 total of `lengths` (every replica's real rows), replicated; cached."""
        total = int(sum(lengths))
        count = self._example_counts.get(total)
        if count is None:
            replicated = self._strategy.extended.replica_devices.replicated
            count = jax.make_array_from_callback((), replicated, lambda _: np.asarray(total, np.int32))
            self._example_counts.put(total, count)
        return count

    def _warn_on_retracing(self, call) -> None:
        """Warns, as tf.function does, when one function keeps being compiled anew."""
        if tracing.current() is not None:  # the mirrax.function counts its own compiles
            return
        counts = self._compile_counts
        key = _retrace_key(call.fn)
        counts[key] = counts.get(key, 0) + 1
        if counts[key] == _RETRACE_WARNING_AT:
            statics = [repr(slot.value) for slot in call.slots if isinstance(slot, StaticSlot)]
            warnings.warn(
                f"strategy.run has compiled {arguments.fn_name(call.fn)} {_RETRACE_WARNING_AT} "
                "times. Each new input shape, structure or Python value (compile-time constant) "
                "makes a new program; this call's Python values: "
                f"{', '.join(statics) or 'none'}. Pass values that change every step as arrays "
                "(jnp.int32(step)) and keep batch shapes fixed. A function defined anew for "
                "every call (inside the loop or the step) shares one program only while what "
                "it captures is the same (NNX objects, Python constants by value, other "
                "objects such as arrays by identity): define it once, outside, or pass "
                "the changing values in args.",
                stacklevel=5,
            )


def _add_captured(call, captured) -> tuple:
    """Appends the NNX objects `call.fn` captures to `call.nodes` (those also passed in args
    are carried once); returns each captured object's index there, in `captured` order."""
    nodes = call.nodes
    index = {id(node): i for i, node in enumerate(nodes)}
    at = []
    for node in captured.nodes:
        i = index.get(id(node))
        if i is None:
            i = index[id(node)] = len(nodes)
            nodes.append(node)
        at.append(i)
    return tuple(at)


def _retrace_key(fn):
    """What the retrace warning counts compiles by. A user's function: its code, so one made
    anew for every call (defined inside the loop or the step) counts as one however its
    captures change (captured NNX objects of one structure share a program: they compile
    once). mirrax's own steps (one per compiled Model): their code and what their closure
    holds, so two models' steps do not count together."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return fn
    if captures.user_function(fn):
        return code
    captured: list[int | None] = []
    for cell in fn.__closure__ or ():
        try:
            captured.append(id(cell.cell_contents))
        except ValueError:  # an empty cell
            captured.append(None)
    return (code, tuple(captured))


def warn_if_padded(program, call) -> None:
    """Warns, once per program and before it runs, when a step that never reads the batch mask
    is given a batch with padding rows (docs/design.md, "Input")."""
    # The rows of THIS call's batch: one program serves batches of several static sizes (jax.jit
    # retraces it per shape), so the first trace's size is not this batch's.
    rows = program.batch_rows if call.mask is None else call.mask.shape[-1]
    lengths = call.shortest
    if min(lengths) == rows:
        return
    program.padding_warned = True
    name = arguments.fn_name(call.fn)
    replicas = len(lengths)
    warnings.warn(
        errors.PaddedBatchWarning(
            f"strategy.run: {name} runs on a partial batch of {sum(lengths)} examples over "
            f"{replicas} replicas (per replica {list(lengths)}), padded to {rows} rows per "
            "replica with copies of a real example so that every replica has the same shape; "
            f"{name} never reads the batch mask, so its sums and means over the batch (e.g. "
            "jnp.sum(loss) / GLOBAL_BATCH_SIZE, a metric's update) and its state updates count "
            "the padding rows. Fix: compute the loss with mirrax.compute_average_loss("
            "per_example_loss, global_batch_size=...) (mirrax's losses and metrics also drop "
            "the padding), or mask a hand-written reduction with "
            "mirrax.get_replica_context().batch_mask, e.g. jnp.sum(jnp.where(mask, loss, 0.0)); "
            "or drop the partial batch (drop_remainder=True). Max, min, any and per-example "
            "outputs are exact with padding; when the step only uses those, silence this with "
            "warnings.filterwarnings('ignore', category=mirrax.PaddedBatchWarning)."
        ),
        stacklevel=4,
    )
