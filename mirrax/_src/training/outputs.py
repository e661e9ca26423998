"""Several outputs in `Model.compile`, as Keras 3's `CompileLoss` / `CompileMetrics`
(keras/src/trainers/compile_utils.py): the model's output names, `compile`'s checks (one loss,
a list or a dict of losses, per-output `loss_weights` and metrics), the per-output losses the
steps add up, the metrics of each output and their log names ("<output>_<metric>")."""

from __future__ import annotations

import math
import re

import numpy as np

from mirrax import errors
from mirrax._src import argument_checks
from mirrax._src.training import arguments as checks
from mirrax._src.training import keras_models, metric_registry
from mirrax._src.training import losses as losses_lib

_NUMBERED = re.compile(r"output_(\d+)")


def check_compile_args(
    loss, loss_weights, metrics, weighted_metrics, run_eagerly, jit_compile, auto_scale_loss
):
    """Refuses `compile` arguments mirrax does not support or that have the wrong type (as
    listed in docs/training.md); the per-output structure is checked by `resolve`.

    Raises:
      InvalidArgumentError / InvalidArgumentTypeError / UnsupportedArgumentError.
    """
    if loss is None or (
        isinstance(loss, (list, tuple, dict))
        and not any(v is not None for v in (loss.values() if isinstance(loss, dict) else loss))
    ):
        raise errors.InvalidArgumentError(
            "compile: loss is required (a Keras model's add_loss losses are added to it, but "
            f"they cannot replace it); received loss={loss!r}. Pass e.g. "
            "loss='sparse_categorical_crossentropy', or one loss per output."
        )
    for one in (
        loss.values() if isinstance(loss, dict) else loss if isinstance(loss, (list, tuple)) else [loss]
    ):
        if isinstance(one, losses_lib.Loss) and one.reduction != "sum_over_batch_size":
            raise errors.UnsupportedArgumentError(
                f"compile: the loss {one.name!r} has reduction={one.reduction!r}; compile reduces "
                "every loss as 'sum_over_batch_size' (the global mean). Pass the loss built "
                "with the default reduction (reduction=None is for custom loops, with "
                "mirrax.compute_average_loss)."
            )
    if loss_weights is not None:
        for weight in (
            loss_weights.values()
            if isinstance(loss_weights, dict)
            else loss_weights
            if isinstance(loss_weights, (list, tuple))
            else [loss_weights]
        ):
            if isinstance(weight, bool) or not isinstance(weight, (int, float, np.number)):
                raise errors.InvalidArgumentTypeError(
                    "compile: loss_weights must be a float, or a list or dict of floats (one "
                    f"per output); received {type(weight).__name__} {weight!r}."
                )
            if not math.isfinite(float(weight)):
                raise errors.InvalidArgumentError(
                    f"compile: loss_weights must be finite; received {loss_weights!r}."
                )
    for name, value in (("metrics", metrics), ("weighted_metrics", weighted_metrics)):
        if value is not None and not isinstance(value, (list, tuple, dict)):
            raise errors.InvalidArgumentTypeError(
                f"compile: {name} must be a list (or, for several outputs, a list with one entry "
                f"per output or a dict by output name); received {type(value).__name__} "
                f"{value!r}."
                + (f" Pass e.g. {name}=[{value!r}]." if isinstance(value, str) or callable(value) else "")
            )
    if argument_checks.flag("compile", "run_eagerly", run_eagerly):
        raise errors.UnsupportedArgumentError(
            "compile: run_eagerly=True is not supported: every step is one compiled program "
            "over the replicas. To debug a step, run it under `with jax.disable_jit():` or "
            "call the module eagerly on a batch."
        )
    if jit_compile is False:
        raise errors.UnsupportedArgumentError(
            "compile: jit_compile=False is not supported: steps are always compiled by XLA "
            "(pass 'auto' or True)."
        )
    if jit_compile not in ("auto", True):
        raise errors.InvalidArgumentError(
            f"compile: jit_compile must be 'auto' or True; received {jit_compile!r}."
        )
    argument_checks.flag("compile", "auto_scale_loss", auto_scale_loss)


def module_output_names(module):
    """The names of a Keras functional model's outputs when it has several (its
    `output_names`; a dict output's keys in Keras's order), else None."""
    if not isinstance(module, keras_models.KerasModule):
        return None
    keras_model = module.keras_model
    try:
        structure = keras_model.output
        names = list(keras_model.output_names)
    except (AttributeError, ValueError):  # a subclassed model: no symbolic outputs
        return None
    if isinstance(structure, dict):
        keys = list(structure)
        # Keras's order (CompileMetrics.build): output_names when they are the keys, else sorted.
        return (names if set(keys) == set(names) else sorted(keys)) if len(keys) > 1 else None
    return names if isinstance(structure, (list, tuple)) and len(names) > 1 else None


class Outputs:
    """The outputs of a several-output `compile`: their names (in output order), each one's
    loss (None: not trained) and weight. `split` picks each output's value of y, y_pred or
    sample_weight (a dict by name or a list / tuple in order, whatever the model returns)."""

    def __init__(self, names, losses, weights, dict_output: bool = False):
        self.names = tuple(names)
        self.dict_output = dict_output  # named by a loss dict's keys: the module returns a dict
        self.losses, self.weights = tuple(losses), tuple(weights)
        self.trained = tuple(i for i, loss in enumerate(self.losses) if loss is not None)

    @property
    def loss_log_names(self) -> list:
        """ "<output>_loss" of each output with a loss, when there are several (Keras 3)."""
        return [f"{self.names[i]}_loss" for i in self.trained] if len(self.trained) > 1 else []

    def split(self, value, what: str, shared: bool = False) -> list:
        """Each output's part of `value` (a dict by output name, or a list / tuple in output
        order; with `shared`, one value for every output).

        Raises:
          IncompatibleInputError: `value` does not match the outputs (the message names them).
        """
        names = list(self.names)
        if isinstance(value, dict):
            missing = [
                n for i, n in enumerate(names) if n not in value and not shared and self.losses[i] is not None
            ]
            unknown = [k for k in value if k not in names]
            if missing or unknown:
                raise errors.IncompatibleInputError(
                    f"{what} is a dict with the keys {list(value)}, but the model's outputs are "
                    f"{names}"
                    + (f" (no {what} for {missing})" if missing else "")
                    + (f" (unknown {unknown})" if unknown else "")
                    + ". Give one entry per output, keyed by these names."
                )
            return [value.get(n) for n in names]
        if isinstance(value, (list, tuple)):
            if self.dict_output and what == "the model's output":
                raise errors.IncompatibleInputError(
                    f"the model's output is a {type(value).__name__} of {len(value)}, but "
                    f"compile's losses are keyed by {names}, which name the keys of a dict "
                    "output. For a tuple output pass a list of losses in output order, or key "
                    f"them 'output_1' ... 'output_{len(value)}'."
                )
            if len(value) != len(names):
                raise errors.IncompatibleInputError(
                    f"{what} is a {type(value).__name__} of {len(value)}, but the model has "
                    f"{len(names)} outputs {names}. Give one entry per output, in this order "
                    "(or a dict keyed by these names)."
                )
            return list(value)
        if shared or value is None:
            return [value] * len(names)
        raise errors.IncompatibleInputError(
            f"{what} is a single {type(value).__name__}, but the model has {len(names)} outputs "
            f"{names}. Give a list with one entry per output, or a dict keyed by these names."
        )

    def per_output(self, y, y_pred, sample_weight) -> list:
        """Each trained output's per-example loss times its sample weight (UNWEIGHTED by
        `loss_weights`, as Keras logs "<output>_loss"), in `trained` order."""
        ys, preds = self.split(y, "y"), self.split(y_pred, "the model's output")
        weights = self.split(sample_weight, "sample_weight", shared=True)
        found = []
        for i in self.trained:
            value = self.losses[i].per_example(ys[i], preds[i])
            found.append(value if weights[i] is None else value * weights[i])
        return found

    def total(self, per_output: list):
        """sum_i weight_i * loss_i per example (the loss the gradients are taken of)."""
        return sum(self.weights[i] * value for i, value in zip(self.trained, per_output))


class MultiOutputLoss(losses_lib.Loss):
    """`Model.loss` of a several-output compile: `per_example(y, y_pred)` is the weighted sum
    of the outputs' losses; `outputs` is the `Outputs` the steps use."""

    def __init__(self, outputs: Outputs):
        super().__init__(name="multi_output_loss")
        self.outputs = outputs

    def per_example(self, y_true, y_pred):
        return self.outputs.total(self.outputs.per_output(y_true, y_pred, None))

    def split_for_check(self, y1, y_pred, y) -> list:
        """[(label, loss, y1 part, y_pred part, y part)] of each trained output, for the
        pre-flight check (`arguments.check_fits_model`)."""
        o = self.outputs
        parts = (o.split(y1, "y"), o.split(y_pred, "the model's output"), o.split(y, "y"))
        return [
            (f" (output {o.names[i]!r})", o.losses[i], parts[0][i], parts[1][i], parts[2][i])
            for i in o.trained
        ]

    def __repr__(self) -> str:
        return f"MultiOutputLoss({dict(zip(self.outputs.names, self.outputs.losses))})"


def _names_from_loss(loss) -> tuple:
    """The output names of an NNX module (or subclassed Keras model) from its losses: a list
    of n names "output_1".."output_n" (tf.keras 2's naming); a dict names them by its keys
    ("output_<i>" keys: in that order, for a tuple output; else sorted, as Keras orders a
    dict output's keys)."""
    if isinstance(loss, dict):
        keys = list(loss)
        numbered = [_NUMBERED.fullmatch(str(k)) for k in keys]
        if all(numbered) and sorted(int(m.group(1)) for m in numbered if m) == list(range(1, len(keys) + 1)):
            return tuple(f"output_{i}" for i in range(1, len(keys) + 1))
        return tuple(sorted(keys, key=str))
    return tuple(f"output_{i}" for i in range(1, len(loss) + 1))


def _per_output(what: str, value, names, default):
    """A list / dict of per-output values (`loss`, `loss_weights`) in output order."""
    if isinstance(value, dict):
        unknown = [k for k in value if k not in names]
        missing = [n for n in names if n not in value]
        if unknown or missing:
            # As Keras, which refuses loss_weights that do not match the losses.
            fix = (
                " (None skips an output)"
                if what == "loss"
                else " (1.0 for an output whose loss is not scaled)"
            )
            raise errors.InvalidArgumentError(
                f"compile: {what} is a dict with the keys {list(value)}, but the model's outputs "
                f"are {list(names)}"
                + (f" ({unknown} name no output)" if unknown else "")
                + (f" ({missing} have none)" if missing else "")
                + f". Key {what} by these output names{fix}."
            )
        return [value.get(n, default) for n in names]
    if isinstance(value, (list, tuple)):
        if len(value) != len(names):
            raise errors.InvalidArgumentError(
                f"compile: {what} is a {type(value).__name__} of {len(value)}, but the model has "
                f"{len(names)} output(s) {list(names)}. Give one entry per output, in this order "
                f"(None skips an output), or a dict keyed by these names."
            )
        return list(value)
    if what == "loss_weights":
        raise errors.InvalidArgumentError(
            f"compile: loss_weights={value!r} is one float, but the model has {len(names)} "
            f"outputs {list(names)}. Give a list with one weight per output, or a dict keyed "
            "by these names."
        )
    return [value] * len(names)  # one loss for every output, as Keras


def resolve(module, loss, loss_weights):
    """(compiled loss, loss scale, `Outputs` or None) of compile's `loss` and `loss_weights`:
    one output (the loss as given, the float weight) or several (a `MultiOutputLoss`).

    Raises:
      InvalidArgumentError: a dict key that names no output, a list of the wrong length, a
        float loss_weights for several outputs. InvalidIdentifierError: an unknown loss name.
    """
    names = module_output_names(module)
    dict_output = False
    if names is None and isinstance(loss, (list, tuple, dict)) and len(loss) > 1:
        names = _names_from_loss(loss)
        dict_output = isinstance(loss, dict) and names != tuple(
            f"output_{i}" for i in range(1, len(names) + 1)
        )
    if names is None:
        if isinstance(loss, (list, tuple, dict)):  # one output given as a list / dict of one
            loss = list(loss.values() if isinstance(loss, dict) else loss)[0]
        if isinstance(loss_weights, (list, tuple, dict)):
            if len(loss_weights) != 1:
                _per_output("loss_weights", loss_weights, ("output_1",), 1.0)
            loss_weights = list(loss_weights.values() if isinstance(loss_weights, dict) else loss_weights)[0]
        return losses_lib.get(loss), 1.0 if loss_weights is None else float(loss_weights), None
    per_loss = [losses_lib.get(each) for each in _per_output("loss", loss, names, None)]
    weights = (
        [1.0] * len(names)
        if loss_weights is None
        else [float(w) for w in _per_output("loss_weights", loss_weights, names, 1.0)]
    )
    outputs = Outputs(names, per_loss, weights, dict_output)
    return MultiOutputLoss(outputs), 1.0, outputs


def _entries(what: str, value, outputs: Outputs) -> list:
    """compile's `metrics` (or `weighted_metrics`) as one list of metrics per output."""
    names = list(outputs.names)
    if isinstance(value, dict) and set(value) <= set(names):
        per = [value.get(n) for n in names]
    elif isinstance(value, (list, tuple)) and len(value) == len(names):
        per = list(value)
    else:
        raise errors.InvalidArgumentError(
            f"compile: {what}={value!r} does not match the model's {len(names)} outputs "
            f"{names}: for several outputs pass a list with one entry per output (a metric, a "
            f"name, or a list of them; None for none), or a dict keyed by these names, e.g. "
            f"{what}={{{names[-1]!r}: ['accuracy']}}."
        )
    return [[] if e is None else list(e) if isinstance(e, (list, tuple)) else [e] for e in per]


def _flat(value) -> list:
    if isinstance(value, dict):
        value = list(value.values())
    if not isinstance(value, (list, tuple)):
        return [] if value is None else [value]
    return [m for entry in value for m in _flat(entry)]


def build_metrics(loss, outputs, metrics, weighted_metrics) -> tuple:
    """(metric objects, log names, weighted flags, output index of each metric or None) of
    compile's `metrics` and `weighted_metrics`; "accuracy" resolves by the output's loss."""
    if outputs is None:  # one output: every metric applies to it (a dict's values too, as Keras)
        plain = [metric_registry.get(m, loss=loss) for m in _flat(metrics)]
        weighted = [metric_registry.get(m, loss=loss) for m in _flat(weighted_metrics)]
        names = checks.metric_names(plain, weighted)
        return plain + weighted, names, (False,) * len(plain) + (True,) * len(weighted), (None,) * len(names)
    found, flags, where = [], [], []
    for uses_weights, (what, value) in enumerate(
        (("metrics", metrics), ("weighted_metrics", weighted_metrics))
    ):
        if not value:
            continue
        for index, entry in enumerate(_entries(what, value, outputs)):
            for m in entry:
                found.append(metric_registry.get(m, loss=outputs.losses[index]))
                flags.append(bool(uses_weights))
                where.append(index)
    return found, output_metric_names(found, flags, where, outputs.names), tuple(flags), tuple(where)


def output_metric_names(found, flags, where, names) -> list:
    """Keras 3's log names of several outputs' metrics (`CompileMetrics.result`):
    "<output>_<name>", a taken name gets "_1", "_2", ...; a weighted metric whose name is
    taken is "<output>_weighted_<name>" (then "_1", ...)."""
    counters: dict = {}
    result = []
    for metric, weighted, index in zip(found, flags, where):
        name = f"{names[index]}_{metric.name}"
        if name not in counters:
            counters[name] = 1
        elif weighted and f"{names[index]}_weighted_{metric.name}" not in counters:
            name = f"{names[index]}_weighted_{metric.name}"
            counters[name] = 1
        else:
            if weighted:
                name = f"{names[index]}_weighted_{metric.name}"
            counters[name] += 1
            name = f"{name}_{counters[name] - 1}"
        result.append(name)
    return result


def check_labels(loss, y, y_pred) -> None:
    """The host-side sparse-label check of array labels (`check_labels` of the
    SparseCategoricalCrossentropy losses), per output for a several-output loss, naming it.

    Raises:
      InvalidLabelError: labels out of range (for several outputs, the message names the output).
    """
    sparse = losses_lib.SparseCategoricalCrossentropy
    if y is None:
        return
    if isinstance(loss, sparse):
        sparse.check_labels(np.asarray(y), y_pred.shape[-1])
    if not isinstance(loss, MultiOutputLoss):
        return
    o = loss.outputs
    for name, one, labels, pred in zip(
        o.names, o.losses, o.split(y, "y"), o.split(y_pred, "the model's output")
    ):
        if isinstance(one, sparse) and labels is not None:
            try:
                sparse.check_labels(np.asarray(labels), pred.shape[-1])
            except errors.InvalidLabelError as error:
                raise errors.InvalidLabelError(f"output {name!r}: {error}") from None
