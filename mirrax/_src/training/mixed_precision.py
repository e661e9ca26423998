"""Mixed precision, as `keras.mixed_precision`: policies and dynamic loss scaling for float16.

A policy names the dtype of computation and of variables. Under "mixed_bfloat16" or
"mixed_float16", `Model` keeps every variable in float32, casts the parameters and the floating
inputs to the compute dtype for the forward pass (the gradients flow back to the float32
parameters through the cast), and computes the loss in float32. A layer built with
`dtype=jnp.float32` (e.g. the output layer) still computes in float32, because NNX layers
promote their inputs and parameters to their own `dtype`.

float16 has a small range, so "mixed_float16" adds dynamic loss scaling (Keras's
`LossScaleOptimizer` defaults): the loss is multiplied by a scale starting at 2**15; when any
gradient is not finite the step is skipped and the scale halved; after 2000 finite steps in a
row it doubles. Gradients are summed over the replicas before the check, so when one replica
overflows, every replica sees it, skips the same step and keeps the same scale.
"""

from __future__ import annotations

import sys
import threading

import jax
import jax.numpy as jnp
from flax import nnx

from mirrax import errors

_POLICIES = {
    "float32": ("float32", "float32"),
    "float16": ("float16", "float16"),
    "bfloat16": ("bfloat16", "bfloat16"),
    "mixed_float16": ("float16", "float32"),
    "mixed_bfloat16": ("bfloat16", "float32"),
}

INITIAL_SCALE = 2.0**15
GROWTH_INTERVAL = 2000


class Policy:
    """A dtype policy, as `keras.mixed_precision.Policy`.

    Args:
      name: "float32", "mixed_float16", "mixed_bfloat16" (also "float16", "bfloat16").

    Attributes:
      name: the policy's name.
      compute_dtype: dtype of the forward pass, as a string ("bfloat16").
      variable_dtype: dtype of the variables ("float32" for the mixed policies).

    Raises:
      InvalidIdentifierError (a ValueError): an unknown name (the message lists the known
        ones). InvalidArgumentTypeError: a name that is not a str.
    """

    name: str

    def __init__(self, name: str):
        if isinstance(name, Policy):
            name = name.name
        if not isinstance(name, str):
            raise errors.InvalidArgumentTypeError(
                f"A dtype policy is named by a str (or is a Policy); received "
                f"{type(name).__name__} {name!r}. Pass e.g. 'mixed_bfloat16'."
            )
        if name not in _POLICIES:
            raise errors.InvalidIdentifierError(
                f"Unknown dtype policy {name!r}; known policies: {', '.join(_POLICIES)}."
            )
        self.name = name
        self.compute_dtype, self.variable_dtype = _POLICIES[name]

    @property
    def uses_loss_scaling(self) -> bool:
        """True for "mixed_float16" and "float16" (dynamic loss scaling is applied)."""
        return self.compute_dtype == "float16"

    def __repr__(self) -> str:
        return f'<Policy "{self.name}">'

    def __eq__(self, other) -> bool:
        return isinstance(other, Policy) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)


_global = threading.local()


def set_global_policy(policy) -> None:
    """Sets the policy that `Model.compile` picks up, as `keras.mixed_precision.set_global_policy`.

    Args:
      policy: a `Policy`, a policy name, or None for "float32".

    When Keras is imported, Keras's global policy is set to the same name too: a Keras model
    built afterwards computes in that dtype (its layers read Keras's policy when they are
    made), which `Model.compile` of a Keras model requires.
    """
    _global.policy = Policy("float32" if policy is None else policy)
    keras = sys.modules.get("keras")
    if keras is not None:
        keras.mixed_precision.set_global_policy(_global.policy.name)


def global_policy() -> Policy:
    """The current global policy ("float32" unless `set_global_policy` changed it)."""
    return getattr(_global, "policy", None) or Policy("float32")


def cast_floating(tree, dtype):
    """Casts the float32 leaves of `tree` to `dtype` (other leaves unchanged)."""
    return jax.tree.map(
        lambda a: a.astype(dtype) if jnp.issubdtype(jnp.result_type(a), jnp.floating) else a, tree
    )


class LossScale(nnx.Pytree):
    """Dynamic loss scale state: the scale (float32) and the count of finite steps in a row."""

    def __init__(self):
        self.scale = nnx.Variable(jnp.float32(INITIAL_SCALE))
        self.good_steps = nnx.Variable(jnp.int32(0))

    def adjust(self, finite):
        """Halves the scale after a non-finite step; doubles it after GROWTH_INTERVAL finite ones."""
        good = jnp.where(finite, self.good_steps[...] + 1, 0)
        grow = good >= GROWTH_INTERVAL
        scale = self.scale[...]
        self.scale[...] = jnp.where(finite, jnp.where(grow, scale * 2.0, scale), scale / 2.0)
        self.good_steps[...] = jnp.where(grow, 0, good).astype(jnp.int32)
