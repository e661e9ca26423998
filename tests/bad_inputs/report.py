"""Bad inputs of the scaling report (`mirrax.experimental.scaling_report` and its plot); the
`mirrax report` command's bad arguments exit with status 2 (tests/test_scaling_report.py)."""

from __future__ import annotations

import functools

import numpy as np
import optax
from flax import nnx

import mirrax
from mirrax import errors
from tests.bad_inputs.case import Case
from tests.test_scaling_report import train_step as _step

_BATCH = (np.zeros((2, 3), np.float32), np.zeros(2, np.int32))


@functools.cache
def _report():
    """The report of a 3 -> 2 linear step at 1 replica (compiled once for the cases below)."""
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    return mirrax.experimental.scaling_report(
        _step, _BATCH, (model, optimizer), max_replicas=1, timing_windows=1
    )


CASES = [
    Case(
        "scaling_report(nnx.Linear(...)) (a bare module; was: 'Cannot concatenate arrays')",
        lambda env: mirrax.experimental.scaling_report(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), _BATCH),
        errors.InvalidArgumentTypeError,
        (
            "step_or_model is a bare model (Linear)",
            "Wrap it in a compiled mirrax.Model",
            "args=(module, optimizer)",
        ),
    ),
    Case(
        "report.plot('out.txt') (was: PNG bytes under that name)",
        lambda env: _report().plot(env.tmp_path / "out.txt"),
        errors.InvalidArgumentError,
        (".png, .svg, .pdf", "out.txt", "suffix '.txt'", "out.png"),
    ),
    Case(
        "report.plot('speedup') (no suffix)",
        lambda env: _report().plot(str(env.tmp_path / "speedup")),
        errors.InvalidArgumentError,
        ("(no suffix)", "speedup.png"),
    ),
]
