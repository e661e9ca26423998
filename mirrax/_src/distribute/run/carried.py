"""Steps over the same NNX objects with their state carried flat between steps, as Keras's JAX
trainer runs `fit`: the state is split once, each step runs on the arrays the last one returned
(donated), and the objects' Variables are written only when someone is about to read or change
them (docs/design.md, "Carried state in fit, evaluate and predict").

A stretch of carried steps starts with one call through `strategy.run`'s own path (the NNX
graph found and checked, the state placed, an array someone else holds copied instead of
donated: bound_state.py). Each later step of the stretch sorts only its arguments (so a batch
of another structure is seen) and calls the same program on the carried arrays: no graph check,
no state gathering, no write-back. `release()` writes the carried arrays into the Variables and
ends the stretch; the next step starts a new one, so whatever user code did in between (set
weights, swap a layer, change the learning rate) is found as `strategy.run` finds it.

Between a stretch's first step and `release()` the Variables hold the arrays the first step was
given, which it consumed: only the loop that owns the stretch runs in that time, and it
releases before any callback, log, checkpoint or exception reaches the objects.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax

from mirrax._src.distribute import _compat
from mirrax._src.distribute.run import arguments, bound_state
from mirrax._src.distribute.run import runner as runner_lib


class CarriedSteps:
    """`strategy.run(fn, args=objects + inputs)` step after step, the objects' state carried.

    Args:
      runner: the strategy's `Runner`.
      objects: the NNX objects (or None placeholders) every step takes before its batch.

    `run` returns what `strategy.run` would; `release` must be called before anything else
    reads or changes the objects (it is idempotent and cheap when nothing is carried).
    """

    __slots__ = (
        "_runner",
        "_objects",
        "_carry",
        "_program",
        "_binding",
        "_key",
        "_carried",
        "_held",
        "_queued",
    )

    def __init__(self, runner: runner_lib.Runner, objects: tuple, carry: bool = True):
        self._runner = runner
        self._objects = tuple(objects)
        # False: every step is strategy.run's (written back at once), for loops that release
        # after every step anyway (a callback's batch hook needs the model).
        self._carry = carry
        self._held: tuple = ()  # ids of the arrays the Variables held when the stretch began
        self._program: Any = None  # the stretch's Program, Binding and call key
        self._binding: Any = None
        self._key: Any = None
        self._carried: list | None = None
        self._queued = 0  # steps dispatched since the last wait (`_bound_in_flight`)

    @property
    def objects(self) -> tuple:
        """The NNX objects (or None placeholders) every step takes before its batch."""
        return self._objects

    @property
    def strategy(self):
        """The strategy the steps run on."""
        return self._runner.strategy

    @property
    def carrying(self) -> bool:
        """Whether the objects' Variables are behind the carried state (`release` writes it)."""
        return self._carried is not None

    def run(self, fn, *inputs):
        """One step, `fn(*objects, *inputs)` on every replica (the inputs: its batch, or its
        batches and their masks); its outputs as `strategy.run`'s.

        Raises:
          As `strategy.run`.
        """
        runner = self._runner
        args = self._objects + inputs
        if not self._carry:
            return runner.run(fn, args, {})
        if self._carried is not None:
            call = arguments.classify(runner.strategy, fn, args, {})
            if (fn, call.treedef, call.slots, call.mask is None, call.lengths is None) == self._key:
                return self._step(call)
            self.release()  # another function or batch structure: strategy.run's path finds it
        program, binding, call, state_leaves, batch_info, written = runner.prepare(fn, args, {})
        if program.sums_padding and not program.padding_warned and call.shortest is not None:
            runner_lib.warn_if_padded(program, call)
        if program.donates:
            state_leaves = bound_state.protect_aliases(binding, state_leaves, written)
        new_state, outputs = program.compiled(state_leaves, call.dynamic, batch_info)
        del state_leaves
        live = binding.live
        carries = program.same_state and live and len(live) == len(new_state)
        if not carries or isinstance(new_state[0], jax.core.Tracer):
            # State a Variable holds as a pytree of arrays, or a call inside an outer jax.jit:
            # strategy.run's own write-back handles (or refuses) them.
            return runner.finish(program, binding, call, new_state, outputs)
        self._program, self._binding, self._carried = program, binding, new_state
        self._held = tuple(map(id, map(_compat.raw_value, live)))
        self._key = (fn, call.treedef, call.slots, call.mask is None, call.lengths is None)
        self._bound_in_flight(new_state, outputs)
        return runner.wrap(program, call, outputs)

    def _step(self, call):
        runner, program = self._runner, self._program
        batch_info = runner.batch_inputs(call)
        if program.sums_padding and not program.padding_warned and call.shortest is not None:
            runner_lib.warn_if_padded(program, call)
        # Raised before it ran, the step leaves the carried arrays as they were (release writes
        # them: the last completed step's values).
        new_state, outputs = program.compiled(self._carried, call.dynamic, batch_info)
        self._carried = new_state
        self._bound_in_flight(new_state, outputs)
        return runner.wrap(program, call, outputs)

    def _bound_in_flight(self, new_state, outputs) -> None:
        """The runner's cap on queued steps (a multi-device CPU mesh). A step's outputs can be
        waited on later; its state cannot (the next step consumes it), so without outputs the
        newest state is waited on once the cap's worth of steps is queued."""
        runner = self._runner
        if outputs:
            runner.bound_in_flight((), outputs)
        elif runner.caps_in_flight:
            self._queued += 1
            if self._queued >= runner_lib.CPU_MAX_IN_FLIGHT:
                jax.block_until_ready(new_state)
                self._queued = 0

    def release(self) -> None:
        """Writes the carried state into the objects' Variables and ends the stretch: they hold
        the last completed step's values, as after `strategy.run`."""
        carried = self._carried
        if carried is None:
            return
        binding = self._binding
        assert binding is not None  # set with the carried state
        live = binding.live
        if tuple(map(id, map(_compat.raw_value, live))) != self._held:
            warnings.warn(
                "The model's variables were assigned while fit / evaluate / predict carried its "
                "state between steps (from the input pipeline, another thread, a signal handler, "
                "or a callback whose needs_model_between_batches() returned False); the "
                "training overwrote the assignment. Change the model in a callback's batch hook "
                "(on_train_batch_begin / _end), which sees and keeps the last step's values.",
                stacklevel=2,
            )
        if any(isinstance(x, jax.Array) and x.is_deleted() for x in carried):
            warnings.warn(
                "A step was interrupted while it ran (KeyboardInterrupt or a signal during its "
                "dispatch, or an error raised by the device): it had consumed the model's state, "
                "so the model's variables hold no values now. Restore them from a checkpoint "
                "(BackupAndRestore, ModelCheckpoint) before using the model.",
                stacklevel=2,
            )
        _compat.set_raw_values(live, carried)
        binding.written = carried
        self._carried = self._program = self._binding = self._key = None
        self._held = ()
