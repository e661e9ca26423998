"""The checks of `Model`'s arguments before any step: counts, flags, fractions, metric log
names, class and sample weights (`compile`'s arguments: outputs.py), and one abstract run of
the module and loss on the first example (`check_fits_model`), so a bad call is a named
mirrax error, not a failure inside the compiled step."""

from __future__ import annotations

import math

import jax
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from mirrax import errors
from mirrax._src import argument_checks
from mirrax._src.distribute import host_tensors, scan_carry
from mirrax._src.distribute.replica_context import ReplicaContext, replica_context_scope
from mirrax._src.training import mixed_precision
from mirrax._src.training import steps as steps_lib


def python_numbers(x) -> bool:
    """Whether x looks like examples given as nested Python lists of numbers (X.tolist())."""
    if not isinstance(x, list) or not x:
        return False
    first = x[0]
    if isinstance(first, list) and first:
        first = first[0]
    return isinstance(first, (int, float, list)) and not isinstance(first, bool)


def check_fit_counts(epochs, initial_epoch, verbose, shuffle):
    """fit's (epochs, initial_epoch, verbose, shuffle), checked and normalized.

    Raises:
      InvalidArgumentTypeError / InvalidArgumentError: a bad count or flag, or initial_epoch
        not below epochs.
    """
    epochs = argument_checks.count("fit", "epochs", epochs)
    initial_epoch = argument_checks.count("fit", "initial_epoch", initial_epoch, minimum=0)
    if initial_epoch >= epochs:
        raise errors.InvalidArgumentError(
            f"fit: initial_epoch={initial_epoch} is not below epochs={epochs}, so no epoch would "
            "train. As Keras, epochs is the index to stop at, not a count: to train n more "
            f"epochs from epoch {initial_epoch}, pass epochs={initial_epoch} + n."
        )
    if shuffle == "batch":
        raise errors.UnsupportedArgumentError(
            "fit: shuffle='batch' (tf.keras 2's chunked shuffle for HDF5) is not supported; "
            "pass shuffle=True (every epoch reshuffles the arrays) or False."
        )
    return (
        epochs,
        initial_epoch,
        argument_checks.progress_verbose("fit", verbose),
        argument_checks.flag("fit", "shuffle", shuffle),
    )


def metric_names(plain, weighted) -> list:
    """Log names of the metrics then the weighted metrics, as Keras 3's
    `CompileMetrics.result` (keras/src/trainers/compile_utils.py): a name already taken gets
    `_1`, `_2`, ... in order (`[AUC(), AUC(curve="PR")]` log "auc" and "auc_1", "accuracy"
    twice "accuracy" and "accuracy_1"); a weighted metric whose name is taken is logged as
    "weighted_<name>" (then "weighted_<name>_1", ...). A user's `name=` is kept as given.
    Unlike Keras, a suffixed name that is itself taken (a metric named "auc_1" before two
    AUC()) counts on ("auc_2"), where Keras's dict silently keeps one of the two."""
    counters: dict = {}
    names: list = []

    def unique(name):
        if name not in counters and name not in names:
            counters[name] = 1
            return name
        index = counters.get(name, 1)
        while f"{name}_{index}" in names:
            index += 1
        counters[name] = index + 1
        return f"{name}_{index}"

    names.extend(unique(m.name) for m in plain)
    for metric in weighted:
        taken = metric.name in counters or metric.name in names
        names.append(unique(f"weighted_{metric.name}" if taken else metric.name))
    return names


def check_class_weight(class_weight, sample_weight):
    """{int class: float weight}, as Keras's class_weight (int keys only)."""
    if class_weight is None:
        return None
    if sample_weight is not None:
        raise errors.InvalidArgumentError(
            "fit: class_weight and sample_weight were both given; as Keras, pass one of them "
            "(multiply the class weights into sample_weight to combine them)."
        )
    if not hasattr(class_weight, "items"):
        raise errors.InvalidArgumentTypeError(
            "fit: class_weight must be a dict {class index: weight}; received "
            f"{type(class_weight).__name__} {class_weight!r}. Pass e.g. {{0: 1.0, 1: 5.0}}."
        )
    table = {}
    for key, weight in class_weight.items():
        # Only ints: int('1'), int(1.5) and True would silently name another class.
        if isinstance(key, (bool, np.bool_)) or not isinstance(key, (int, np.integer)) or key < 0:
            raise errors.InvalidArgumentTypeError(
                f"fit: class_weight keys must be class indices (ints >= 0); received the key "
                f"{key!r} of type {type(key).__name__}. Write e.g. {{0: 1.0, 1: 5.0}}."
            )
        index = int(key)
        if (
            isinstance(weight, bool)
            or not isinstance(weight, (int, float, np.number))
            or not math.isfinite(float(weight))
            or weight < 0
        ):
            raise errors.InvalidArgumentError(
                f"fit: class_weight[{key!r}] must be a finite float >= 0; received {weight!r}."
            )
        table[index] = float(weight)
    return table


def check_sample_weight(what: str, sample_weight, n: int, name: str = "sample_weight"):
    """`sample_weight` as float32 of shape (n,), one weight per example; `name` names it in
    the errors (`sample_weight[1]`: one output's weights).

    Raises:
      InvalidArgumentError: another shape, or a weight that is NaN or infinite.
    """
    sample_weight = np.asarray(to_numpy(sample_weight), np.float32)
    if sample_weight.shape != (n,):
        each = "" if name == "sample_weight" else " for each output"
        raise errors.InvalidArgumentError(
            f"{what}: {name} must hold one weight per example, shape ({n},); received "
            f"shape {sample_weight.shape}. Pass a 1-D array of length {n}{each}."
        )
    if not np.isfinite(sample_weight).all():
        raise errors.InvalidArgumentError(
            f"{what}: {name} holds NaN or infinite values (first at index "
            f"{int(np.argmin(np.isfinite(sample_weight)))}), which would make the loss NaN."
        )
    return sample_weight


def host_array(leaf):
    """A leaf as NumPy (tf.Tensor and torch.Tensor have `.numpy()`)."""
    return np.asarray(to_numpy(leaf))


def to_numpy(leaf):
    """A tf / torch tensor as NumPy (a torch tensor detached and on the host first; torch's
    bfloat16 and float8 as JAX's dtypes of those names: host_tensors.to_numpy)."""
    return host_tensors.to_numpy(leaf)


def _shapes(tree) -> str:
    leaves = jax.tree.leaves(tree)
    if len(leaves) == 1 and not isinstance(tree, dict):
        return f"{tuple(np.shape(leaves[0]))} ({_dtype(leaves[0])})"
    return str(jax.tree.map(lambda a: tuple(np.shape(a)), tree))


def _dtype(leaf):
    return leaf.dtype if hasattr(leaf, "dtype") else np.asarray(leaf).dtype


def _first_line(error) -> str:
    text = str(error).strip()
    return text.splitlines()[0].rstrip(".") if text else "(no message)"


def _first_layer_hint(module) -> str:
    """What the module's first Linear / Conv layer takes, to name the expected input."""
    for path, node in nnx.iter_graph(module):
        if isinstance(node, (nnx.Linear, nnx.Conv, nnx.LinearGeneral)):
            where = ".".join(map(str, path)) or "the module"
            return (
                f" The module's first {type(node).__name__} ({where}) takes inputs whose "
                f"last axis is {node.in_features}."
            )
    return ""


# Errors of the module's code, whatever the input: raised as they are, not as an input error.
_NOT_ABOUT_THE_INPUT = (
    NameError,
    NotImplementedError,
    RecursionError,
    jax.errors.JAXTypeError,
    jax.errors.JAXIndexError,
)


def _abstract_forward(module, x1, policy, strategy):
    """The module's output shapes on `x1`, traced as the step traces it: inside `shard_map`
    over the strategy's mesh, under a replica context, so collectives over
    `mirrax.REPLICA_AXIS` (synchronized BatchNorm) are bound. Every input enters replicated,
    so each replica sees `x1` itself and nothing varies (vma checks are the step's)."""
    graphdef, state = nnx.split(module)
    found = {}

    def one_replica(state, x):
        with replica_context_scope(ReplicaContext(strategy)), scan_carry.varying_carries():
            y = steps_lib.forward(nnx.merge(graphdef, state), x, policy)
        found["y_pred"] = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), y)
        return ()

    jax.eval_shape(
        jax.shard_map(one_replica, mesh=strategy.mesh, in_specs=(P(), P()), out_specs=()), state, x1
    )
    return found["y_pred"]


def check_fits_model(model, checked: dict, x, y, what: str, strategy):
    """Runs the module (and the loss) abstractly on the first example of a batch.

    So shapes or dtypes that do not fit give one named error before any step, instead of a
    jax / flax error from inside the compiled step. The module is traced inside the
    strategy's replica mesh, as the step is (`_abstract_forward`). Returns the model's output
    shapes (`jax.ShapeDtypeStruct`s).

    Raises:
      IncompatibleInputError: the module cannot take x, or the loss cannot compare y with the
        module's output. An error of the module's own code that no input causes (a NameError,
        a tracer used as a Python bool) propagates unchanged.
    """

    def one(a):
        a = host_array(a) if not isinstance(a, (jax.Array, jax.ShapeDtypeStruct)) else a
        return jax.ShapeDtypeStruct((1,) + tuple(a.shape[1:]), a.dtype)

    x1 = jax.tree.map(one, x)
    y1 = None if y is None else jax.tree.map(one, y)
    policy = getattr(model, "dtype_policy", None) or mixed_precision.Policy("float32")
    # One abstract run per input signature (fit called once per epoch checks once).
    key = (
        jax.tree.structure((x1, y1)),
        tuple((a.shape, str(a.dtype)) for a in jax.tree.leaves((x1, y1))),
        policy.name,
        id(model.loss),
    )
    if key in checked:
        return checked[key]
    try:
        y_pred = _abstract_forward(model.module, x1, policy, strategy)
    except (errors.MirraxError, *_NOT_ABOUT_THE_INPUT):
        raise  # the module's own fault (an unbound axis, Python control flow on a tracer)
    except Exception as error:  # the user's module cannot take this input
        detail = _first_line(error)
        raise errors.IncompatibleInputError(
            f"{what}: the model cannot take x of shape {_shapes(x)}: {type(error).__name__}: "
            f"{detail}.{_first_layer_hint(model.module)} Give x the shape the module expects "
            "(batch first), or change the module's input size."
        ) from error
    if y is None or model.loss is None:
        checked[key] = y_pred
        return y_pred
    split = getattr(model.loss, "split_for_check", None)  # a several-output loss
    try:
        parts = split(y1, y_pred, y) if split else [("", model.loss, y1, y_pred, y)]
    except errors.IncompatibleInputError as error:
        raise errors.IncompatibleInputError(f"{what}: {error}") from None
    for output, loss, y1, y_pred_part, y in parts:
        _check_loss(what + output, loss, y1, y_pred_part, y, bool(output))
    checked[key] = y_pred
    return y_pred


def _check_loss(what, loss, y1, y_pred, y, several: bool) -> None:
    """`loss.per_example` run abstractly on one example (`what` names the output if
    `several`; then a loss's ValueError is an IncompatibleInputError naming it)."""
    try:
        per_example = jax.eval_shape(loss.per_example, y1, y_pred)
    except errors.IncompatibleInputError as error:
        if several:  # name the output
            raise errors.IncompatibleInputError(f"{what}: {_first_line(error)}.") from None
        raise
    except errors.MirraxError:
        raise
    except ValueError as error:
        if several or "does not fit" in str(error) or "expected" in str(error):
            detail = f"{_first_line(error)}." if several else str(error)
            raise errors.IncompatibleInputError(f"{what}: {detail}") from error
        raise
    except Exception as error:
        detail = _first_line(error)
        raise errors.IncompatibleInputError(
            f"{what}: the loss cannot compare y of shape {_shapes(y)} with the model's output "
            f"of shape {_shapes(y_pred)}: {type(error).__name__}: {detail}. Give y the shape "
            "the loss expects for this output."
        ) from error
    if tuple(getattr(per_example, "shape", ())[:1]) != (1,):
        raise errors.IncompatibleInputError(
            f"{what}: the loss must give one value per example (shape (batch,)); for a batch of "
            f"1 it gave shape {tuple(per_example.shape)} (y {_shapes(y)}, output "
            f"{_shapes(y_pred)}). Return one loss per example from the loss function."
        )
