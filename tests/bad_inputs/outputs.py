"""Bad inputs of models with several inputs or outputs: compile's per-output losses, weights
and metrics, per-output labels and sample weights, and lists of input arrays. Each is refused
before the first step."""

import numpy as np
from flax import nnx

import mirrax
from mirrax import errors
from tests.bad_inputs.case import Case

_RNG = np.random.default_rng(0)
X = _RNG.standard_normal((16, 4)).astype(np.float32)
Y_REG = _RNG.standard_normal((16, 1)).astype(np.float32)
Y_CLS = _RNG.integers(0, 3, 16).astype(np.int32)
ONES = np.ones(16, np.float32)


class _TwoHeads(nnx.Module):
    """Returns a tuple: (batch, 1) regression and (batch, 3) logits (output_1, output_2)."""

    def __init__(self):
        self.reg = nnx.Linear(4, 1, rngs=nnx.Rngs(0))
        self.cls = nnx.Linear(4, 3, rngs=nnx.Rngs(1))

    def __call__(self, x):
        return self.reg(x), self.cls(x)


def _model(env, **compile_kwargs):
    compile_kwargs.setdefault("loss", ["mse", mirrax.losses.SparseCategoricalCrossentropy(from_logits=True)])
    with env.strategy.scope():
        model = mirrax.Model(_TwoHeads())
        model.compile("sgd", **compile_kwargs)
    return model


def _fit(env, x, y, compile_kwargs=None, **kwargs):
    return _model(env, **(compile_kwargs or {})).fit(x, y, verbose=0, **kwargs)


S = True  # each_strategy: the checks run before the first step whatever the strategy
_OUTPUTS = "['output_1', 'output_2']"

CASES = [
    Case(
        "compile(loss_weights=[1.0]) for two outputs",
        lambda env: _model(env, loss_weights=[1.0]),
        errors.InvalidArgumentError,
        ("loss_weights is a list of 1", f"2 output(s) {_OUTPUTS}", "one entry per output"),
    ),
    Case(
        "compile(loss_weights=0.5) for two outputs",
        lambda env: _model(env, loss_weights=0.5),
        errors.InvalidArgumentError,
        ("loss_weights=0.5 is one float", "one weight per output"),
    ),
    Case(
        "compile(loss_weights=['a', 1.0])",
        lambda env: _model(env, loss_weights=["a", 1.0]),
        errors.InvalidArgumentTypeError,
        ("loss_weights must be a float, or a list or dict of floats", "received str 'a'"),
    ),
    Case(
        "compile(metrics=['accuracy']) for two outputs",
        lambda env: _model(env, metrics=["accuracy"]),
        errors.InvalidArgumentError,
        (
            "metrics=['accuracy'] does not match the model's 2 outputs",
            "one entry per output",
            "metrics={'output_2': ['accuracy']}",
        ),
    ),
    Case(
        "compile(metrics={'out': ...}) naming no output",
        lambda env: _model(env, metrics={"out": ["accuracy"]}),
        errors.InvalidArgumentError,
        ("metrics={'out': ['accuracy']} does not match", "keyed by these names"),
    ),
    Case(
        "compile(loss={'a': ..., 'b': ...}) for a module returning a tuple",
        lambda env: _fit(env, X, {"a": Y_REG, "b": Y_CLS}, {"loss": {"a": "mse", "b": "mse"}}),
        errors.IncompatibleInputError,
        (
            "the model's output is a tuple of 2",
            "keyed by ['a', 'b']",
            "pass a list of losses in output order",
            "'output_1' ... 'output_2'",
        ),
        S,
    ),
    Case(
        "compile(loss=[3 losses]) for a module of 2 outputs",
        lambda env: _fit(env, X, [Y_REG, Y_CLS, Y_CLS], {"loss": ["mse"] * 3}),
        errors.IncompatibleInputError,
        ("the model's output is a tuple of 2, but the model has 3 outputs",),
        S,
    ),
    Case(
        "fit(class_weight=...) with two outputs",
        lambda env: _fit(env, X, [Y_REG, Y_CLS], class_weight={0: 1.0}),
        errors.UnsupportedArgumentError,
        (
            f"class_weight is not supported for a model of several outputs {_OUTPUTS}",
            "Pass sample_weight instead",
        ),
        S,
    ),
    Case(
        "fit(y=[3 label arrays]) for 2 outputs",
        lambda env: _fit(env, X, [Y_REG, Y_CLS, Y_CLS]),
        errors.IncompatibleInputError,
        ("y is a list of 3, but the model has 2 outputs",),
        S,
    ),
    Case(
        "fit(y=[y1, y2 of another length])",
        lambda env: _fit(env, X, [Y_REG, Y_CLS[:9]]),
        errors.InvalidArgumentError,
        ("x has 16 examples but y[1] has 9",),
        S,
    ),
    Case(
        "fit(sample_weight=[3 arrays]) for 2 outputs",
        lambda env: _fit(env, X, [Y_REG, Y_CLS], sample_weight=[ONES] * 3),
        errors.InvalidArgumentError,
        ("sample_weight is a list of 3 arrays but the model has 2 outputs", "one (n,) array per output"),
        S,
    ),
    Case(
        "fit(sample_weight=[w1, w2 of another length])",
        lambda env: _fit(env, X, [Y_REG, Y_CLS], sample_weight=[ONES, ONES[:9]]),
        errors.InvalidArgumentError,
        ("x has 16 examples but sample_weight[1] has 9",),
        S,
    ),
    Case(
        "fit(sample_weight={...}) with a key that is no output",
        lambda env: _fit(env, X, [Y_REG, Y_CLS], sample_weight={"output_1": ONES, "nope": ONES}),
        errors.InvalidArgumentError,
        ("sample_weight has the key 'nope', which is not an output", _OUTPUTS),
        S,
    ),
    Case(
        "fit(y=[..., labels >= 3 classes]) for the second output",
        lambda env: _fit(env, X, [Y_REG, Y_CLS + 3]),
        errors.InvalidLabelError,
        ("output 'output_2': sparse_categorical_crossentropy", "valid range [0, 3)"),
        S,
    ),
    Case(
        "fit(y=[targets of another shape, ...]) for the first output",
        lambda env: _fit(env, X, [Y_REG[:, :0], Y_CLS]),
        errors.IncompatibleInputError,
        ("fit (output 'output_1'): mean_squared_error", "(1, 0) does not match"),
        S,
    ),
    Case(
        "fit(x=[x1, x2 of another length])",
        lambda env: _fit(env, [X, X[:9]], [Y_REG, Y_CLS]),
        errors.InvalidArgumentError,
        (
            "x is a list of 2 arrays of different lengths (x[0]: 16, x[1]: 9)",
            "every array must hold the same examples",
        ),
        S,
    ),
]
