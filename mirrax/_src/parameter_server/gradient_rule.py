"""`ParameterServerStrategy(update="gradients")`, TF's update rule: a worker's
`optimizer.update(model, grads)` records the gradients instead of applying them, the worker
pushes them, and each parameter server runs the optimizer's optax update on the parameters it
holds, with the optimizer state it holds then (as TF's servers apply gradients with their slot
variables).

The three sides of the rule, side by side:
- the coordinator finds each held `nnx.Optimizer`'s group (`groups_of`): the model it was
  made for (`watch_optimizers` records it when the optimizer is made), the model's parameters
  it updates, the state leaves that mirror each parameter (Adam's moments: laid out with their
  parameter, same servers, same rows) and the scalar state (counts, hyperparameters, `step`:
  one copy on each server of the group);
- a worker tags each held Variable with its leaf index and gives each group's optimizer
  gradient sums (`Recorder`); `optimizer.update` adds to them;
- a parameter server applies a group's gradients to its slice (`ServerOptimizer`).

A function that calls `optimizer.update` k times pushes the k gradients' sum and k; the server
applies k updates with their mean (exactly TF's for SGD and k = 1; with k > 1 the k steps all
read the parameters pulled at the function's start). A transformation that reduces across
parameters (`clip_by_global_norm`) sees one server's slice, as in TF.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from mirrax import errors
from mirrax._src.distribute import _compat
from mirrax._src.distribute.run.arguments import is_variable

GRADIENTS = "gradients"
DIFFERENCES = "differences"
RULES = (DIFFERENCES, GRADIENTS)
_TAG = "mirrax_leaf"

# Each nnx.Optimizer made since the first strategy with update="gradients" -> its model.
_models: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@functools.cache
def watch_optimizers() -> None:
    """Records the model of every `nnx.Optimizer` made from now on (once per process)."""
    original = nnx.Optimizer.__init__

    @functools.wraps(original)
    def __init__(self, model, *args, **kwargs):
        original(self, model, *args, **kwargs)
        try:
            _models[self] = weakref.ref(model)
        except TypeError:  # a model that takes no weak reference: found as not watched
            pass

    nnx.Optimizer.__init__ = __init__  # type: ignore[method-assign]


def _rel(path) -> tuple:
    keys = tuple(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)
    return keys[:-1] if keys and keys[-1] == "value" else keys


@dataclasses.dataclass(frozen=True)
class Group:
    """One held optimizer under the gradient rule (leaf indices of the joint held state).

    Attributes:
      tx: its optax transformation.
      params: the parameters it updates, in its model's state order.
      mirrored: (state leaf, parameter leaf, prefix): a state leaf that mirrors a parameter
        (its path in the optimizer state is `prefix` + the parameter's path in the model).
      scalars: (state leaf, prefix) of the state that mirrors no parameter (scalars).
      step: the leaf of `optimizer.step`.
    """

    tx: Any
    params: tuple
    mirrored: tuple
    scalars: tuple
    step: int

    @property
    def state(self) -> tuple:
        """Every state leaf of the group: mirrored, scalar, step."""
        return tuple(j for j, _, _ in self.mirrored) + tuple(j for j, _ in self.scalars) + (self.step,)


def _key(i: int) -> str:
    return f"p{i}"


def groups_of(roots: tuple, leaves: list, paths: list) -> list[Group]:
    """The group of every `nnx.Optimizer` the held `roots` reach (their joint state's
    `leaves`, named `paths` in warnings) whose update the servers can apply.

    The others' state travels as differences, as under update="differences": an optimizer
    whose model is not held (yet: it forms its group when it is), and, with a
    `RuntimeWarning` saying why, one made before the strategy (its model is not known) or
    whose state does not mirror its model's parameters (`optax.lbfgs`'s memory).
    """
    index = {id(leaf): i for i, leaf in enumerate(leaves)}

    def leaf_of(variable) -> int:
        return index[id(_compat.raw_value(variable))]

    found, seen = [], set()
    for _, node in nnx.iter_graph(roots):
        if not isinstance(node, nnx.Optimizer) or id(node) in seen:
            continue
        seen.add(id(node))
        ref = _models.get(node)
        model = ref() if ref is not None else None
        where = paths[leaf_of(node.step)].rsplit(".step", 1)[0]
        if model is None:
            _fall_back(
                where,
                "was made before the strategy, so the model it updates is not known. Make it "
                "after the strategy (under strategy.scope(), as TF makes it)",
            )
            continue
        state = nnx.to_flat_state(nnx.state(model, node.wrt))
        if any(id(_compat.raw_value(variable)) not in index for _, variable in state):
            continue  # its model is not held yet
        group = _group(node, [(_rel(path), leaf_of(v)) for path, v in state], leaves, leaf_of)
        if isinstance(group, str):
            _fall_back(where, group)
        else:
            found.append(group)
    return found


def _fall_back(where: str, why: str) -> None:
    warnings.warn(
        f"ParameterServerStrategy(update='gradients'): the nnx.Optimizer {where} {why}; its "
        "updates travel as differences (the worker computes them with the state it pulled), "
        "as under update='differences'.",
        RuntimeWarning,
        stacklevel=2,
    )


def _group(optimizer, params: list, leaves: list, leaf_of) -> Group | str:
    """The optimizer's group, or why the servers cannot apply its update."""
    by_path = dict(params)
    shapes = {_key(i): jax.ShapeDtypeStruct(np.shape(leaves[i]), leaves[i].dtype) for _, i in params}
    try:
        template = jax.eval_shape(optimizer.tx.init, shapes)
    except Exception as e:  # noqa: BLE001 - e.g. a mask given as a tree of the model's paths
        return (
            f"has a transformation that cannot start on a slice of its parameters ({type(e).__name__}: {e})"
        )
    prefixes = set()
    scalar_paths = set()
    for path, _ in jax.tree_util.tree_flatten_with_path(template)[0]:
        rel = _rel(path)
        if rel and rel[-1] in {_key(i) for _, i in params}:
            prefixes.add(rel[:-1])
        else:
            scalar_paths.add(rel)
    mirrored, scalars = [], []
    for path, variable in nnx.to_flat_state(nnx.state(optimizer.opt_state)):
        if not jax.tree.leaves(_compat.raw_value(variable)):
            continue  # no array (optax.masked's MaskedNode): nothing to hold
        rel = _rel(path)
        match = next(
            (
                (by_path[rel[len(p) :]], p)
                for p in prefixes
                if rel[: len(p)] == p and rel[len(p) :] in by_path
            ),
            None,
        )
        if match is not None and np.shape(_compat.raw_value(variable)) == np.shape(leaves[match[0]]):
            mirrored.append((leaf_of(variable), match[0], match[1]))
        elif rel in scalar_paths and np.ndim(_compat.raw_value(variable)) == 0:
            scalars.append((leaf_of(variable), rel))
        else:
            return (
                f"has state ({'.'.join(rel)}) that neither mirrors one of its model's parameters "
                "nor is a scalar, so no parameter server can hold its part of it"
            )
    return Group(
        optimizer.tx, tuple(i for _, i in params), tuple(mirrored), tuple(scalars), leaf_of(optimizer.step)
    )


# -- a parameter server's side -------------------------------------------------------------------


class ServerOptimizer:
    """One group's update on one parameter server: its slice of the parameters (keys
    `(leaf, shard)` of the server's values), the mirrored state beside each, and its copy of
    the scalars.

    Args:
      tx: the optax transformation.
      params: the parameter keys on this server.
      mirrored: {parameter key: [(prefix, state key), ...]}.
      scalars: [(prefix, state key), ...]; step: the key of `optimizer.step`.
    """

    def __init__(self, tx, params: list, mirrored: dict, scalars: list, step):
        self._params = list(params)
        self._step = step
        names = {key: _key(n) for n, key in enumerate(self._params)}
        self._names = [names[key] for key in self._params]
        by_path = {prefix + (names[p],): key for p, pairs in mirrored.items() for prefix, key in pairs}
        by_path.update({prefix: key for prefix, key in scalars})
        self._tx = tx
        self._template_def = None
        self._sources: list = []
        self._by_path = by_path
        self._update = jax.jit(self._one_update)

    def _one_update(self, grads, state, params):
        updates, state = self._tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    def _sources_for(self, values: dict) -> None:
        shapes = {
            name: jax.ShapeDtypeStruct(values[key].shape, values[key].dtype)
            for name, key in zip(self._names, self._params)
        }
        template = jax.eval_shape(self._tx.init, shapes)
        with_paths, self._template_def = jax.tree_util.tree_flatten_with_path(template)
        self._sources = [self._by_path[_rel(path)] for path, _ in with_paths]

    def apply(self, values: dict, gradient_sums: dict, count: int) -> None:
        """Applies `count` updates with the mean of `gradient_sums` ({parameter key: sum of
        `count` gradients}) to `values` (the server's dict), in place."""
        if self._template_def is None:
            self._sources_for(values)
        params = {name: values[key] for name, key in zip(self._names, self._params)}
        grads = {
            name: np.asarray(gradient_sums[key]) / np.asarray(count, gradient_sums[key].dtype)
            for name, key in zip(self._names, self._params)
        }
        state = jax.tree.unflatten(self._template_def, [values[key] for key in self._sources])
        for _ in range(count):
            params, state = self._update(grads, state, params)
        for name, key in zip(self._names, self._params):
            values[key] = np.array(params[name])
        for key, leaf in zip(self._sources, jax.tree.leaves(state)):
            values[key] = np.array(leaf)
        values[self._step] = values[self._step] + np.asarray(count, values[self._step].dtype)


# -- a worker's side --------------------------------------------------------------------------------


class GradientSum(nnx.OptState):
    """A worker's sum of the gradients its optimizer's `update` received during one function
    (an `OptState`, so a float16 step skipped for overflow rolls it back too)."""


def tag(state) -> None:
    """Marks each Variable of `state` (the held objects' joint state) with the index of its
    first leaf; a Variable that holds no array (optax.masked's `MaskedNode`) is counted as
    none, so the Variables after it keep their own index."""
    position = 0
    for variable in jax.tree.leaves(state, is_leaf=is_variable):
        count = len(jax.tree.leaves(_compat.raw_value(variable)))
        if count:
            variable.set_metadata(**{_TAG: position})
        position += count


def assigned_owned(state_leaves: list, groups: list, paths: list) -> str | None:
    """The path of the first state leaf the servers own (a mirrored one, never pulled: the
    worker's copy is zeros) that a scheduled function assigned, or None."""
    for group in groups:
        for j, _, _ in group.mirrored:
            if np.any(np.asarray(jax.device_get(state_leaves[j]))):
                return paths[j]
    return None


def attach(roots: tuple, groups: list, leaves: list) -> list:
    """Gives each group's optimizer (found by its step's tag) zeroed gradient sums for its
    parameters, and makes `nnx.Optimizer.update` record into them (in this process); returns
    the (optimizer, group) pairs, for `collect` (no walk of the graph per function)."""
    _record_updates()
    by_step = {g.step: g for g in groups}
    found = []
    for _, node in nnx.iter_graph(roots):
        if isinstance(node, nnx.Optimizer):
            group = by_step.get(node.step.get_metadata().get(_TAG))
            if group is not None:
                found.append((node, groups.index(group)))
                sums = {
                    _key(i): GradientSum(jnp.zeros(np.shape(leaves[i]), leaves[i].dtype))
                    for i in group.params
                }
                # Attributes of the worker's copy only (flax's Optimizer declares no such field).
                node.mirrax_gradients = nnx.data(sums)  # type: ignore[attr-defined]
                node.mirrax_updates = GradientSum(jnp.zeros((), jnp.int32))  # type: ignore[attr-defined]
    return found


def collect(recorders: list, groups: list) -> dict:
    """{group index: (updates recorded, {parameter leaf: host gradient sum})} of the groups
    whose optimizer (`recorders`: `attach`'s pairs) recorded any during the function; their
    sums are zeroed."""
    out = {}
    for node, position in recorders:
        count = int(node.mirrax_updates[...])
        if count == 0:
            continue
        group = groups[position]
        totals = [node.mirrax_gradients[_key(i)] for i in group.params]
        out[position] = (count, dict(zip(group.params, jax.device_get([t[...] for t in totals]))))
        # Zeroed by one compiled call (an eager zeros per leaf cost as much as the rest of the
        # push); new arrays each time, since a step may donate the old ones.
        zeros = _zeros_like([t[...] for t in totals] + [node.mirrax_updates[...]])
        for total, zero in zip(totals + [node.mirrax_updates], zeros):
            total.set_value(zero)
    return out


@jax.jit
def _zeros_like(arrays: list) -> list:
    return [jnp.zeros_like(a) for a in arrays]


@functools.cache
def _record_updates() -> None:
    original = nnx.Optimizer.update

    @functools.wraps(original)
    def update(self, model, grads, /, **kwargs):
        sums = getattr(self, "mirrax_gradients", None)
        if sums is None:
            return original(self, model, grads, **kwargs)
        if kwargs:
            raise errors.UnsupportedArgumentError(
                "optimizer.update(model, grads, **kwargs) under ParameterServerStrategy("
                f"update='gradients'): the parameter servers run the optax update without "
                f"{sorted(kwargs)}. Use update='differences' for a transformation that takes them."
            )
        given = dict(nnx.to_flat_state(nnx.state(grads, self.wrt)))
        for path, variable in nnx.to_flat_state(nnx.state(model, self.wrt)):
            total = sums.get(_key(variable.get_metadata().get(_TAG, -1)))
            if total is None or path not in given:
                raise errors.InvalidArgumentError(
                    "optimizer.update(model, grads) under ParameterServerStrategy(update="
                    f"'gradients'): {'.'.join(map(str, path))} is not a parameter of the model "
                    "this optimizer was made for, or grads has no gradient for it. Pass the "
                    "optimizer's own model and its gradients."
                )
            gradient = given[path]
            gradient = gradient.get_value() if isinstance(gradient, nnx.Variable) else gradient
            total.set_value(total[...] + jnp.asarray(gradient, total[...].dtype))
        self.mirrax_updates.set_value(self.mirrax_updates[...] + 1)
        self.step.set_value(self.step[...] + 1)
        return None

    nnx.Optimizer.update = update  # type: ignore[method-assign]
