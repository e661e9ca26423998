"""`mirrax.function`: a whole distributed step compiled into one program, as `tf.function` does.

    @mirrax.function
    def distributed_step(batch):
        losses = strategy.run(step, args=(batch,))
        return strategy.reduce("sum", losses, axis=None)

The function is traced once per argument structure into ONE `jax.jit` program: every
`strategy.run` inside it adds its step (the same `shard_map` body `strategy.run` compiles on its
own, tracing.py), followed by the reduce and any arithmetic around them, so a call is one
dispatch. The NNX objects the function reaches (its arguments, and through captures.py its
closure, globals and helpers three calls deep, as `strategy.run` finds them) are carried as the
program's flat state: split once, passed in (donated where nothing else holds them, as
bound_state.py decides), and their new values written straight back into the caller's Variables
after the call, so mutation looks in place. The strategy is the one the arguments' distributed
values belong to, else the one the function's `strategy.run` calls use (learned by a first,
abstract trace), else the current one.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import types
import warnings
import weakref
from typing import Any

import flax.errors
import jax
from flax import nnx

from mirrax import errors
from mirrax._src.distribute import _compat, invariant
from mirrax._src.distribute.current import get_strategy
from mirrax._src.distribute.iterator import DistributedIterator
from mirrax._src.distribute.replica_context import current_replica_context
from mirrax._src.distribute.run import arguments, bound_state, captures, rebuild, tracing
from mirrax._src.distribute.run import function_inputs as inputs
from mirrax._src.distribute.run import nodes as nodes_lib
from mirrax._src.distribute.run.arguments import (
    LazyNames,
    fn_name,
    is_argument_leaf,
    is_variable,
)
from mirrax._src.distribute.run.placement import place
from mirrax._src.distribute.run.runner import CPU_MAX_IN_FLIGHT, LRU

_CACHE_SIZE = 64
_MEMO_SIZE = 16
_RETRACE_WARNING_AT = 6
_CONSTANTS = (type(None), bool, int, float, complex, str, bytes)
_MAX_TRACES = 34


@dataclasses.dataclass(eq=False)
class _Program:
    compiled: Any
    same_state: bool
    donates: bool
    state_def: Any
    order: tuple | None = None


class _Call:
    """One call's arguments, sorted: its NNX objects, its program inputs and its cache key."""

    __slots__ = ("treedef", "slots", "nodes", "dynamic", "names", "strategy", "key", "captured_at")

    def __init__(
        self, treedef, slots: tuple, nodes: list, dynamic: list, names, strategy, captured_at: tuple, key
    ):
        self.treedef, self.slots, self.nodes, self.dynamic = treedef, slots, nodes, dynamic
        self.names, self.strategy, self.captured_at, self.key = names, strategy, captured_at, key


def function(func=None, **options):
    """Compiles `func`, a function that calls `strategy.run` / `reduce`, into one program, as
    `tf.function` does for a distributed step.

    Usable as `@mirrax.function` or `mirrax.function(fn)`. The first call with an argument
    structure traces `func` (Python side effects run then, as in `tf.function`) and compiles
    one program holding every `strategy.run` step it calls, the reductions and the arithmetic
    around them; later calls with the same structure run that program: one dispatch per call.
    Arguments are sorted as `strategy.run` sorts them: NNX objects (their state enters the
    program and is written back after it, so updates look in place), distributed values
    (`PerReplica` batches, `Mirrored`), arrays (replicated), and hashable Python values
    (compile-time constants: a new value compiles a new program). NNX objects the function
    reaches through its closure, globals, helper functions (three calls deep) or a method's
    `self` are carried the same way.

    Args:
      func: the function. It may return arrays, distributed values (`strategy.run`'s results),
        Python numbers, or pytrees of them.
      **options: `tf.function`'s keyword arguments: `jit_compile` (None or True: always
        compiled by XLA), `reduce_retracing` and `autograph` (accepted, no effect: shapes are
        static and Python control flow runs at trace time). Others are refused.

    Returns:
      A callable with `func`'s signature, returning `func`'s output structure with arrays as
      `jax.Array`s, `strategy.run` results as `PerReplica` / `Mirrored`.

    Raises:
      TypeError: `func` is not callable, or an option TF's `tf.function` takes that mirrax
        does not (`input_signature`, `jit_compile=False`, ...).
    """
    _check_options(options)
    if func is None:
        return lambda f: function(f, **options)
    if not callable(func):
        raise errors.InvalidArgumentTypeError(
            f"mirrax.function: func must be callable; received {func!r} of type "
            f"{type(func).__name__}. Decorate the function: @mirrax.function def step(batch): ..."
        )
    return Function(func)


def _check_options(options: dict) -> None:
    for name, value in options.items():
        if name == "jit_compile" and value in (None, True):
            continue
        if name in ("reduce_retracing", "autograph") and isinstance(value, bool):
            continue
        if name == "jit_compile":
            raise errors.InvalidArgumentError(
                f"mirrax.function: jit_compile must be None or True; received {value!r}. Every "
                "mirrax.function is compiled by XLA; to run the step eagerly, call the function "
                "undecorated (strategy.run alone compiles each step)."
            )
        raise errors.InvalidArgumentTypeError(
            f"mirrax.function: option {name}={value!r} is not supported (tf.function's "
            "input_signature, experimental_* and the like have no counterpart: a program is "
            "compiled per argument structure, shapes and dtypes). Accepted: jit_compile "
            "(None or True), reduce_retracing and autograph (bool, no effect)."
        )


class Function:
    """What `mirrax.function` returns: a function compiled, per argument structure, into one
    program with its NNX objects carried as flat state (see the module docstring)."""

    def __init__(self, fn):
        functools.update_wrapper(self, fn)
        self._fn = fn
        self._name = fn_name(fn)
        self._programs = LRU(_CACHE_SIZE)
        self._nodes = nodes_lib.NodeCache()
        self._strategy = None  # the strategy the last trace's strategy.run calls used
        self._compiles = 0
        self._in_flight: collections.deque = collections.deque()
        self._bound: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # Per (argument structure, Python values): batches a call takes from each iterator
        # argument (by leaf index), as its trace calls next() on it.
        self._pulls: dict = {}
        self._pull_key = None

    def __get__(self, obj, objtype=None):
        if obj is None:
            return self
        try:
            bound = self._bound.get(obj)
        except TypeError:  # not weakly referenceable: bound anew (its programs are not kept)
            return Function(types.MethodType(self._fn, obj))
        if bound is None:
            bound = self._bound[obj] = Function(types.MethodType(self._fn, obj))
        return bound

    def __call__(self, *args, **kwargs):
        if tracing.current() is not None or current_replica_context() is not None:
            # Inside another mirrax.function's trace or a strategy.run step: part of that program.
            return self._fn(*args, **kwargs)
        call, program, binding, state_leaves, written = self._prepare(args, kwargs)
        if program.donates:
            state_leaves = bound_state.protect_aliases(binding, state_leaves, written)
        new_state, outputs = program.compiled(state_leaves, call.dynamic)
        del state_leaves
        if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((outputs, new_state))[:1]):
            # Called inside jax.jit / nnx.jit with nothing traced passed in: the new state exists
            # only in that trace; written back, it would leave tracers in the caller's Variables.
            raise errors.ReplicaContextError(
                f"mirrax.function: {self._name} was called inside jax.jit, nnx.jit or another JAX "
                "transformation. A mirrax.function is already one compiled program: call it "
                "outside them (the NNX objects are unchanged)."
            )
        self._write_back(call, program, binding, new_state)
        self._bound_in_flight(call.strategy, new_state, outputs)
        return jax.tree.map(inputs.restored, outputs, is_leaf=inputs.is_out)

    def lower(self, *args, **kwargs):
        """The program a call with these arguments would run, as a `jax.stages.Lowered` (for its
        HLO, cost and memory), as `strategy.experimental_lower`; nothing runs, nothing is
        written. As tf.function's `get_concrete_function` (mirrax's own form)."""
        call, program, _, state_leaves, _ = self._prepare(args, kwargs)
        return program.compiled.lower(state_leaves, call.dynamic)

    # -- one call -----------------------------------------------------------------------------

    def _prepare(self, args, kwargs):
        taken: dict = {}  # iterator leaf index -> the batches taken from it for this call
        for _ in range(_MAX_TRACES):
            try:
                prepared = self._try_prepare(args, kwargs, taken)
            except inputs.NeedsBatch as e:  # the trace calls next() once more: take one more batch
                pulls = self._pulls.setdefault(self._pull_key, {})
                pulls[e.index] = pulls.get(e.index, 0) + 1
                continue
            if prepared is not None:
                return prepared
        raise errors.InvalidArgumentError(
            f"mirrax.function: tracing {self._name} did not settle after {_MAX_TRACES} traces "
            "(it calls next() on an iterator argument more than "
            f"{_MAX_TRACES - 2} times, or its strategy.run calls change strategy between "
            "traces). Take fewer batches per call, and call strategy.run of one strategy."
        )

    def _try_prepare(self, args, kwargs, taken: dict):
        """One attempt: None when the trace found its strategy.run calls use another strategy
        than the state was placed for (the next attempt places it there)."""
        call = self._classify(args, kwargs, taken)
        strategy = call.strategy
        node_state = self._nodes.lookup(call.nodes)
        program = binding = bound = None
        key: tuple = ()
        if node_state.key is not None:
            bound = node_state.memo.get(call.key)
            if bound is not None:
                program, binding = bound
            else:
                key = (call.key, node_state.key)
                program = self._programs.get(key)
                if program is not None and program.order is not None:
                    binding = bound_state.Binding([node_state.variables[i] for i in program.order], strategy)
        if binding is None:
            graphdef, state = nnx.split(tuple(call.nodes))
            state_def = jax.tree.structure(state)
            if node_state.key is None:
                key = (call.key, graphdef, state_def)
                program = self._programs.get(key)
            binding = bound_state.Binding(jax.tree.leaves(state, is_leaf=is_variable), strategy)
        state_leaves, written = bound_state.state_leaves(
            strategy, binding, call.names, call.nodes, node_state.memo
        )
        if program is None:
            program = self._compile(call, graphdef, state_def, binding, node_state, state_leaves)
            if program is None:
                return None
            self._programs.put(key, program)
        if node_state.key is not None and bound is None:
            memo = node_state.memo
            if len(memo) >= _MEMO_SIZE:
                memo.clear()
            memo[call.key] = (program, binding)
        return call, program, binding, state_leaves, written

    def _classify(self, args, kwargs, taken: dict) -> _Call:
        """Sorts the call's arguments. Each iterator among them gives the number of batches
        the function's trace takes from it (learned per argument structure and Python
        values); they enter as the program's inputs (`taken` keeps them across attempts)."""
        structure = (None, tuple(args), dict(kwargs))
        leaves, treedef = jax.tree.flatten(structure, is_leaf=is_argument_leaf)
        sorter = inputs.Sorter(self._name, LazyNames(structure))
        slots = []
        iterators = [i for i, leaf in enumerate(leaves) if isinstance(leaf, DistributedIterator)]
        if iterators:
            self._pull_key = (treedef, tuple(x for x in leaves if isinstance(x, _CONSTANTS)))
            pulls = self._pulls.get(self._pull_key, {})
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, DistributedIterator):
                batches = taken.setdefault(i, [])
                while len(batches) < pulls.get(i, 0):
                    batches.append(next(leaf))  # StopIteration at the end of the data, as TF's OutOfRange
                slots.append(inputs.IteratorSlot(i, tuple(sorter.batch(batch, i) for batch in batches)))
            else:
                slots.append(sorter.leaf(leaf, i))
        names = sorter.names
        captures.check_static_holders(slots, names, "mirrax.function")
        captured = captures.lookup(self._fn, None)
        nodes, node_index = sorter.nodes, sorter.node_index
        captured_at = []
        for node in captured.nodes:
            index = node_index.get(id(node))
            if index is None:
                index = node_index[id(node)] = len(nodes)
                nodes.append(node)
            captured_at.append(index)
        strategy = sorter.strategy or self._strategy or get_strategy()
        dynamic = sorter.dynamic
        for position, i in sorter.arrays:
            dynamic[position] = place(strategy, dynamic[position], names, i)
        slot_tuple, at = tuple(slots), tuple(captured_at)
        key = (captured.key, treedef, slot_tuple, at, strategy)
        return _Call(treedef, slot_tuple, nodes, dynamic, names, strategy, at, key)

    def _compile(self, call, graphdef, state_def, binding, node_state, state_leaves):
        """Traces the function (abstractly first), then builds its program; None when its
        `strategy.run` calls use another strategy than the state was placed for."""
        fn, name, strategy = self._fn, self._name, call.strategy
        slots, treedef, captured_at = call.slots, call.treedef, call.captured_at
        found: dict = {}

        def body(state_leaves, dynamic):
            copies = nnx.merge(graphdef, jax.tree.unflatten(state_def, state_leaves))
            leaves = inputs.rebuilt(slots, copies, dynamic)[0]
            found["iterators"] = [x for x in leaves if isinstance(x, inputs.TracedIterator)]
            _, args, kwargs = jax.tree.unflatten(treedef, leaves)
            target = fn
            if captured_at:  # the function reaching the traced copies instead of the caller's
                target = rebuild.substitute(fn, None, tuple(copies[i] for i in captured_at))
            trace = tracing.Trace(name)
            try:
                with tracing.tracing(trace):
                    outputs = target(*args, **kwargs)
            except arguments.CONCRETE_VALUE_ERRORS as e:
                raise arguments.traced_value("mirrax.function", name, e) from e
            except flax.errors.TraceContextError as e:
                raise errors.CapturedStateError(
                    f"mirrax.function: {name} mutates an NNX object it reaches by a path mirrax "
                    "does not carry (an attribute of an attribute of a plain object, or a helper "
                    "more than three calls deep); the update would be lost. Pass the object to "
                    f"{name} as an argument, or capture it directly. (flax said: {e})"
                ) from e
            found["strategies"] = trace.strategies
            _, new_state = nnx.split(copies)
            found["same_state"] = same = jax.tree.structure(new_state) == state_def
            return (jax.tree.leaves(new_state) if same else new_state), inputs.encoded(outputs, name)

        abstract = jax.eval_shape(body, state_leaves, call.dynamic)
        for iterator in found["iterators"]:
            if not iterator.exhausted():
                raise errors.InvalidArgumentError(
                    f"mirrax.function: {name} took fewer batches from its iterator argument "
                    f"{call.names[iterator.index]} than its first trace with these arguments "
                    "did; the batches taken for it would be dropped. Call next() the same "
                    "number of times at every call with the same arguments."
                )
        used = found["strategies"]
        if len(used) > 1:
            raise errors.MixedStrategyError(
                f"mirrax.function: {name} calls strategy.run of {len(used)} different strategies "
                f"({', '.join(type(s).__name__ for s in used)}); one function's program runs on "
                "one strategy's devices. Split it into one mirrax.function per strategy."
            )
        if used and used[0] is not strategy:
            self._strategy = used[0]
            return None
        self._compiles += 1
        if self._compiles == _RETRACE_WARNING_AT:
            warnings.warn(
                f"mirrax.function has compiled {name} {_RETRACE_WARNING_AT} times. Each new "
                "argument structure, Python value (compile-time constant) or partial batch "
                "makes a new program: pass values that change every call as arrays "
                "(jnp.int32(step)).",
                stacklevel=5,
            )
        same_state = found["same_state"]
        donates = (
            same_state
            and bool(state_leaves)
            and [(x.shape, x.dtype) for x in abstract[0]]
            == [(jax.numpy.shape(x), jax.numpy.result_type(x)) for x in state_leaves]
        )
        compiled = jax.jit(
            body,
            donate_argnums=(0,) if donates else (),
            compiler_options=invariant.compiler_options(strategy),
        )
        program = _Program(compiled, same_state, donates, state_def)
        if node_state.key is not None and state_def.num_leaves == len(binding.live):
            index = {id(v): i for i, v in enumerate(node_state.variables)}
            program.order = tuple(index[id(v)] for v in binding.live)
        return program

    @staticmethod
    def _write_back(call, program, binding, new_state) -> None:
        live = binding.live
        if program.same_state and len(live) == len(new_state) and live:
            _compat.set_raw_values(live, new_state)
            binding.written = new_state
            return
        binding.written = None
        if call.nodes:
            if program.same_state:
                new_state = jax.tree.unflatten(program.state_def, new_state)
            nnx.update(tuple(call.nodes), new_state)

    def _bound_in_flight(self, strategy, new_state, outputs) -> None:
        devices = strategy.extended.replica_devices.devices
        if len(devices) < 2 or devices[0].platform != "cpu":
            return
        token = next(iter(jax.tree.leaves((outputs, new_state))), None)
        if token is None:
            return
        self._in_flight.append(token)
        if len(self._in_flight) > CPU_MAX_IN_FLIGHT:
            jax.block_until_ready(self._in_flight.popleft())
