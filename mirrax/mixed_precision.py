"""Mixed precision policies, as `keras.mixed_precision`: `Policy`, `set_global_policy`, `global_policy`."""

from mirrax._src.training.mixed_precision import Policy as Policy
from mirrax._src.training.mixed_precision import global_policy as global_policy
from mirrax._src.training.mixed_precision import set_global_policy as set_global_policy

__all__ = ["Policy", "global_policy", "set_global_policy"]
