"""`Model.fit`'s arguments as one record, checked once and in one place before either executor
(this process, or the workers of a ParameterServerStrategy) sees them: counts, flags,
fractions, class weights, and the validation split of array inputs."""

from __future__ import annotations

import dataclasses
from typing import Any

from mirrax import errors
from mirrax._src import argument_checks
from mirrax._src.training import arguments as checks
from mirrax._src.training import array_inputs


@dataclasses.dataclass(frozen=True)
class FitArguments:
    """fit's arguments, as `keras.Model.fit` names them, after `checked`: counts as ints,
    `verbose` as 0/1/2, NumPy-convertible inputs as arrays, and `validation_split` already
    applied (the held-out arrays are `validation_data`; `validation_split` is then 0.0)."""

    x: Any
    y: Any
    batch_size: Any
    epochs: int
    verbose: int
    callbacks: Any
    validation_split: float
    validation_data: Any
    shuffle: bool
    class_weight: Any
    sample_weight: Any
    initial_epoch: int
    steps_per_epoch: int | None
    validation_steps: int | None
    validation_batch_size: Any
    validation_freq: int

    @classmethod
    def checked(cls, compiled, **arguments) -> FitArguments:
        """The record of `Model.fit(**arguments)` for a model compiled as `compiled`.

        Raises:
          InvalidArgumentTypeError / InvalidArgumentError: a count, flag or fraction of the
            wrong type or out of range; `validation_split` with a non-array x;
            `validation_batch_size` or `validation_steps` without validation data.
          UnsupportedArgumentError: class_weight with several outputs or with sample_weight
            (`class_weight_of`), shuffle='batch'.
        """
        a = dict(arguments)
        a["epochs"], a["initial_epoch"], a["verbose"], a["shuffle"] = checks.check_fit_counts(
            a["epochs"], a["initial_epoch"], a["verbose"], a["shuffle"]
        )
        for name in ("steps_per_epoch", "validation_steps", "validation_batch_size"):
            a[name] = argument_checks.count("fit", name, a[name], allow_none=True)
        a["validation_freq"] = argument_checks.count("fit", "validation_freq", a["validation_freq"])
        split = argument_checks.fraction("fit", "validation_split", a["validation_split"])
        a["class_weight"] = class_weight_of(compiled, "fit", a["class_weight"], a["sample_weight"])
        for name in ("x", "y", "sample_weight"):
            a[name] = array_inputs.as_arrays(a[name])
        if split and a["validation_data"] is None:
            if not array_inputs.is_arrays(a["x"]):
                raise errors.InvalidArgumentError(
                    "fit: validation_split is only supported for NumPy array inputs (it takes "
                    f"the last {split:.0%} of the arrays); received a "
                    f"{type(a['x']).__name__}. Pass validation_data= instead."
                )
            a["x"], a["y"], a["sample_weight"], a["validation_data"] = array_inputs.split_validation(
                a["x"], a["y"], a["sample_weight"], split
            )
        a["validation_split"] = 0.0
        for name in ("validation_batch_size", "validation_steps"):
            if a["validation_data"] is None and a[name] is not None:
                raise errors.InvalidArgumentError(
                    f"fit: {name}={a[name]!r} was given without validation data, so it would do "
                    "nothing; pass validation_data= or validation_split=, or drop it."
                )
        return cls(**a)

    def validation_arrays(self) -> tuple:
        """(x, y, sample_weight) of `validation_data`, NumPy-convertible ones as arrays."""
        return tuple(array_inputs.as_arrays(v) for v in array_inputs.unpack_validation(self.validation_data))

    def validation_batch(self):
        """The batch size of array validation data: `validation_batch_size`, else `batch_size`."""
        return self.validation_batch_size if self.validation_batch_size is not None else self.batch_size


def class_weight_of(compiled, what: str, class_weight, sample_weight):
    """`check_class_weight`'s table; refused for several outputs (as Keras 3).

    Raises:
      UnsupportedArgumentError: class_weight with several outputs.
    """
    if class_weight is not None and compiled.outputs is not None:
        raise errors.UnsupportedArgumentError(
            f"{what}: class_weight is not supported for a model of several outputs "
            f"{list(compiled.outputs.names)} (Keras 3 refuses it too: which output's labels "
            "would pick the weight?). Pass sample_weight instead: one array per output (a list "
            "or a dict by output name), e.g. the class weights of that output's labels."
        )
    return checks.check_class_weight(class_weight, sample_weight)
