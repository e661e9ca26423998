"""The arrays a `strategy.run` program (or a `mirrax.function`) is bound to: the caller's
Variables in the program's state order, the arrays the last step wrote back into them, and
which of them may be donated.

Donation and aliases: a state array that only its Variable (and mirrax) references is donated:
after the step it is deleted and the Variable holds the new value. An array that something else
also references (the user kept `w = model.kernel.value`, a callback kept the best weights, an
async checkpoint is reading it) is copied for the step instead, so every array a user holds
stays valid and keeps the value it had: the semantics of TF's `variable.read_value()`.
"""

from __future__ import annotations

import operator
import sys

import jax

from mirrax._src.distribute import _compat, sharded_optimizer
from mirrax._src.distribute.run.placement import place_state

# References to a state array that mirrax itself holds during the donation check; more means
# someone else holds it, so it is copied instead of donated. An array the last step wrote back:
# the Variable's slot, the list of arrays passed, the list of arrays written back, and
# `sys.getrefcount`'s argument. Any other array a Variable holds: the slot, the list passed,
# the argument. An array placed for this call: the list passed, the argument.
_WRITTEN_REFERENCES = 4
_HELD_REFERENCES = 3
_COPY_REFERENCES = 2


def copy_array(x):
    """A copy of `x` in new buffers on the same devices: a per-device transfer, not a program,
    so processes that copy different arrays (each holds its own references) stay in step."""
    if not isinstance(x, jax.Array):
        return x
    if x.is_fully_addressable:
        return jax.device_put(x, x.sharding, may_alias=False)
    # Several processes: copy this process's shards (device_put wants addressable devices).
    shards = [jax.device_put(shard.data, shard.device, may_alias=False) for shard in x.addressable_shards]
    return jax.make_array_from_single_device_arrays(x.shape, x.sharding, shards)


class Binding:
    """A program bound to one set of NNX objects: their Variables in the program's state
    order, and the arrays the last step wrote into them."""

    __slots__ = ("live", "written", "specs")

    def __init__(self, live, strategy):
        # A Variable whose value is an empty pytree carries no array, so it has no place among
        # the state leaves and nothing is written back into it: optax.masked and
        # multi_transform (optax.contrib.muon too) keep one, holding optax.MaskedNode, for
        # each parameter outside a group.
        self.live = [v for v in live if jax.tree.leaves(_compat.raw_value(v))]
        self.written = None
        # Per Variable, the PartitionSpec of its sharded optimizer state, or None.
        self.specs = sharded_optimizer.state_specs(strategy, live)


def state_leaves(strategy, binding, names, nodes, memo) -> tuple[list, bool]:
    """The state arrays to pass, and whether they are the ones this runner wrote back last
    step (passed as they are: their placement is known); others are placed."""
    raw = list(map(_compat.raw_value, binding.live))
    written = binding.written
    if written is not None and len(written) == len(raw) and all(map(operator.is_, raw, written)):
        return raw, True
    binding.written = None
    leaves = jax.tree.leaves(raw)
    specs = (
        binding.specs
        if binding.specs is not None and len(binding.specs) == len(leaves)
        else (None,) * len(leaves)
    )
    later = None
    if written is not None and jax.process_count() > 1 and len(written) == len(raw) == len(leaves):
        # Leaves that replaced what a step wrote, and that no other program over these
        # objects wrote since (fit's validation): assigned by the user between steps.
        steps = {id(x) for _, other in memo.values() if other.written is not None for x in other.written}
        later = [x is not w and id(x) not in steps for x, w in zip(raw, written)]
    return place_state(strategy, leaves, names, nodes, specs, later), False


def protect_aliases(binding, state_leaves, written: bool) -> list:
    """`state_leaves` with a copy in place of every array someone else also references
    (see the module docstring), so donating the list deletes only mirrax's own arrays."""
    live = binding.live
    if len(state_leaves) != len(live):  # values that are pytrees: nothing is donated
        return [copy_array(x) for x in state_leaves]
    counts = list(map(sys.getrefcount, state_leaves))
    if written and max(counts) <= _WRITTEN_REFERENCES:
        return state_leaves
    protected = None
    for i, (count, variable) in enumerate(zip(counts, live)):
        if written:
            expected = _WRITTEN_REFERENCES
        elif state_leaves[i] is _compat.raw_value(variable):
            expected = _HELD_REFERENCES
        else:
            expected = _COPY_REFERENCES
        if count > expected:
            if protected is None:
                protected = list(state_leaves)
            protected[i] = copy_array(state_leaves[i])
    return state_leaves if protected is None else protected
