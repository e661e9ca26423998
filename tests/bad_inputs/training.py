"""Bad inputs of Keras-style training: Model.compile / fit / evaluate / predict / get_weights /
set_weights / summary, the callbacks, mirrax.losses, mirrax.metrics and mixed precision.

Every case fails before the first compiled step (most before any tracing), so the cases that
depend on the strategy run on all of them cheaply.
"""

import numpy as np
import optax
from flax import nnx

import mirrax
from mirrax import callbacks, errors
from tests.bad_inputs.case import Case

_RNG = np.random.default_rng(0)
X = _RNG.standard_normal((16, 4)).astype(np.float32)
Y = _RNG.integers(0, 2, 16).astype(np.int32)


class _MLP(nnx.Module):
    def __init__(self):
        self.l1 = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
        self.l2 = nnx.Linear(3, 2, rngs=nnx.Rngs(1))

    def __call__(self, x):
        return self.l2(nnx.relu(self.l1(x)))


def _model(env, optimizer="sgd", **compile_kwargs):
    with env.strategy.scope():
        model = mirrax.Model(_MLP())
        model.compile(
            optimizer,
            mirrax.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
            **compile_kwargs,
        )
    return model


def _compile(env, strategy=None, **kwargs):
    with (strategy or env.strategy).scope():
        model = mirrax.Model(_MLP())
        kwargs.setdefault("loss", "sparse_categorical_crossentropy")
        model.compile(**kwargs)


def _fit(env, *args, **kwargs):
    kwargs.setdefault("verbose", 0)
    return _model(env).fit(*args, **kwargs)


def _batches():
    for start in range(0, 16, 8):
        yield X[start : start + 8], Y[start : start + 8]


def _empty():
    return
    yield


class _PairMetric(mirrax.metrics.Mean):
    """A user's metric whose result() is a vector of 2, which the logs cannot hold."""

    def result(self):
        return np.stack([super().result()] * 2)


def _fixed_rate_fit(env, callback):
    _model(env, optimizer=optax.adam(1e-3)).fit(X, Y, verbose=0, callbacks=[callback])


S = True  # each_strategy: the check runs before the first step whatever the strategy

CASES = [
    # -- Model and compile ----------------------------------------------------------------------
    Case(
        "Model(a function instead of a module)",
        lambda env: mirrax.Model(lambda x: x),
        errors.InvalidArgumentTypeError,
        ("nnx.Module", "function", "mirrax.Model(MyNet"),
    ),
    Case(
        "fit before compile",
        lambda env: mirrax.Model(_MLP()).fit(X, Y, verbose=0),
        errors.NotCompiledError,
        ("not compiled", "model.compile("),
    ),
    Case(
        "compile(optimizer='adamax')",
        lambda env: _compile(env, optimizer="adamax"),
        errors.InvalidIdentifierError,
        ("'adamax'", "adam, adamw, rmsprop, sgd"),
    ),
    Case(
        "compile(optimizer=0.01)",
        lambda env: _compile(env, optimizer=0.01),
        errors.InvalidArgumentTypeError,
        ("optimizer must be", "float 0.01", "'adam'"),
    ),
    Case(
        "compile(optimizer=chain(adam, reduce_on_plateau)), which needs the loss",
        lambda env: _compile(env, optimizer=optax.chain(optax.adam(1e-3), optax.contrib.reduce_on_plateau())),
        errors.UnsupportedArgumentError,
        (
            "needs 'value'",
            "fit does not pass",
            "ReduceLROnPlateau callback",
            "optimizer.update(model, grads, value=",
        ),
        S,
    ),
    Case(
        "compile(optimizer=optax.lookahead(...))",
        lambda env: _compile(env, optimizer=optax.lookahead(optax.adam(1e-3), 2, 0.5)),
        errors.UnsupportedArgumentError,
        ("optax.lookahead", "LookaheadParams", "Use the fast optimizer alone"),
        S,
    ),
    Case(
        "compile(optimizer=optax.sm3) with shard_optimizer_state=True",
        lambda env: _compile(
            env,
            strategy=mirrax.MirroredStrategy(["cpu:0", "cpu:1"], shard_optimizer_state=True),
            optimizer=optax.sm3(1e-2),
        ),
        errors.UnsupportedArgumentError,
        ("ScaleBySM3State", "nested lists or tuples", "shard_optimizer_state=False"),
    ),
    Case(
        "compile without a loss",
        lambda env: _compile(env, loss=None),
        errors.InvalidArgumentError,
        ("loss is required", "sparse_categorical_crossentropy"),
    ),
    Case(
        "compile(loss='msee')",
        lambda env: _compile(env, loss="msee"),
        errors.InvalidIdentifierError,
        ("'msee'", "mean_squared_error"),
    ),
    Case(
        "compile(loss={'out': None})",
        lambda env: _compile(env, loss={"out": None}),
        errors.InvalidArgumentError,
        ("loss is required", "{'out': None}", "one loss per output"),
    ),
    Case(
        "compile(metrics='accuracy') not a list",
        lambda env: _compile(env, metrics="accuracy"),
        errors.InvalidArgumentTypeError,
        ("metrics must be a list", "'accuracy'", "metrics=['accuracy']"),
    ),
    Case(
        "compile(metrics=['acurracy'])",
        lambda env: _compile(env, metrics=["acurracy"]),
        errors.InvalidIdentifierError,
        ("'acurracy'", "accuracy"),
    ),
    Case(
        "compile(loss_weights=[1.0, 2.0]) for one output",
        lambda env: _compile(env, loss_weights=[1.0, 2.0]),
        errors.InvalidArgumentError,
        ("loss_weights is a list of 2", "1 output(s)", "one entry"),
    ),
    Case(
        "compile(loss_weights='2')",
        lambda env: _compile(env, loss_weights="2"),
        errors.InvalidArgumentTypeError,
        ("loss_weights must be a float", "'2'"),
    ),
    Case(
        "compile(run_eagerly=True)",
        lambda env: _compile(env, run_eagerly=True),
        errors.UnsupportedArgumentError,
        ("run_eagerly=True", "jax.disable_jit()"),
    ),
    Case(
        "compile(jit_compile=False)",
        lambda env: _compile(env, jit_compile=False),
        errors.UnsupportedArgumentError,
        ("jit_compile=False", "'auto' or True"),
    ),
    Case(
        "compile(steps_per_execution=0)",
        lambda env: _compile(env, steps_per_execution=0),
        errors.InvalidArgumentError,
        ("steps_per_execution must be >= 1", "=0"),
    ),
    Case(
        "compile(gradient_accumulation_steps=2.0)",
        lambda env: _compile(env, gradient_accumulation_steps=2.0),
        errors.InvalidArgumentTypeError,
        ("gradient_accumulation_steps must be an int", "float 2.0", "gradient_accumulation_steps=2"),
    ),
    Case(
        "compile under another strategy than the model's",
        lambda env: _compile_elsewhere(env),
        errors.MixedStrategyError,
        ("made under the scope of", "Compile it under the strategy"),
    ),
    # -- fit: counts and flags ------------------------------------------------------------------
    Case(
        "fit(epochs='3')",
        lambda env: _fit(env, X, Y, epochs="3"),
        errors.InvalidArgumentTypeError,
        ("epochs must be an int", "str '3'", ">= 1"),
        S,
    ),
    Case(
        "fit(epochs=0)",
        lambda env: _fit(env, X, Y, epochs=0),
        errors.InvalidArgumentError,
        ("epochs must be >= 1", "epochs=0"),
        S,
    ),
    Case(
        "fit(initial_epoch=3, epochs=3)",
        lambda env: _fit(env, X, Y, initial_epoch=3, epochs=3),
        errors.InvalidArgumentError,
        ("initial_epoch=3 is not below epochs=3", "epochs=3 + n"),
        S,
    ),
    Case(
        "fit(batch_size=2.5)",
        lambda env: _fit(env, X, Y, batch_size=2.5),
        errors.InvalidArgumentTypeError,
        ("batch_size must be an int", "float 2.5"),
        S,
    ),
    Case(
        "fit(batch_size=0)",
        lambda env: _fit(env, X, Y, batch_size=0),
        errors.InvalidArgumentError,
        ("batch_size must be >= 1", "batch_size=0"),
        S,
    ),
    Case(
        "fit(steps_per_epoch=-1)",
        lambda env: _fit(env, X, Y, steps_per_epoch=-1),
        errors.InvalidArgumentError,
        ("steps_per_epoch must be >= 1", "=-1", "None"),
        S,
    ),
    Case(
        "fit(steps_per_epoch beyond the data)",
        lambda env: _fit(env, X, Y, batch_size=8, steps_per_epoch=3),
        errors.InvalidArgumentError,
        ("steps_per_epoch=3", "holds 2 batch(es)", "steps_per_epoch <= 2"),
        S,
    ),
    Case(
        "fit(validation_freq=0)",
        lambda env: _fit(env, X, Y, validation_data=(X, Y), validation_freq=0),
        errors.InvalidArgumentError,
        ("validation_freq must be >= 1", "validation_freq=0"),
        S,
    ),
    Case(
        "fit(validation_steps=1.5)",
        lambda env: _fit(env, X, Y, validation_steps=1.5),
        errors.InvalidArgumentTypeError,
        ("validation_steps must be an int", "1.5"),
        S,
    ),
    Case(
        "fit(validation_split=1.5)",
        lambda env: _fit(env, X, Y, validation_split=1.5),
        errors.InvalidArgumentError,
        ("validation_split must be in [0, 1)", "1.5", "0.2"),
        S,
    ),
    Case(
        "fit(validation_split='0.2')",
        lambda env: _fit(env, X, Y, validation_split="0.2"),
        errors.InvalidArgumentTypeError,
        ("validation_split must be a float", "'0.2'"),
        S,
    ),
    Case(
        "fit(validation_split) leaving no training example",
        lambda env: _fit(env, X[:2], Y[:2], validation_split=0.6),
        errors.InvalidArgumentError,
        ("validation_split=0.6 of 2 examples", "no training example"),
        S,
    ),
    Case(
        "fit(validation_split) with a dataset",
        lambda env: _fit(env, _batches(), validation_split=0.2),
        errors.InvalidArgumentError,
        ("validation_split is only supported for NumPy", "validation_data="),
        S,
    ),
    Case(
        "fit(verbose='loud')",
        lambda env: _fit(env, X, Y, verbose="loud"),
        errors.InvalidArgumentError,
        ("verbose must be 'auto', 0", "'loud'"),
        S,
    ),
    Case(
        "fit(shuffle='yes')",
        lambda env: _fit(env, X, Y, shuffle="yes"),
        errors.InvalidArgumentTypeError,
        ("shuffle must be True or False", "'yes'"),
        S,
    ),
    Case(
        "fit(shuffle='batch')",
        lambda env: _fit(env, X, Y, shuffle="batch"),
        errors.UnsupportedArgumentError,
        ("shuffle='batch'", "shuffle=True"),
    ),
    Case(
        "fit(validation_batch_size) without validation data",
        lambda env: _fit(env, X, Y, validation_batch_size=4),
        errors.InvalidArgumentError,
        ("validation_batch_size=4", "validation_data="),
        S,
    ),
    Case(
        "fit(validation_steps) without validation data (Keras ignores it)",
        lambda env: _fit(env, X, Y, validation_steps=2),
        errors.InvalidArgumentError,
        ("validation_steps=2 was given without validation data", "validation_data="),
        S,
    ),
    Case(
        "fit(validation_batch_size=0): the argument named",
        lambda env: _fit(env, X, Y, validation_split=0.5, validation_batch_size=0),
        errors.InvalidArgumentError,
        ("fit: validation_batch_size must be >= 1", "received validation_batch_size=0"),
        S,
    ),
    # -- fit: the data --------------------------------------------------------------------------
    Case("fit(x=None)", lambda env: _fit(env), errors.InvalidArgumentError, ("x is required",), S),
    Case(
        "fit(a generator function, not called)",
        lambda env: _fit(env, _batches),
        errors.InvalidArgumentTypeError,
        ("x is the function '_batches'", "pass _batches()"),
        S,
    ),
    Case(
        "fit(x='data.npz')",
        lambda env: _fit(env, "data.npz"),
        errors.InvalidArgumentTypeError,
        ("x must be NumPy/JAX arrays", "str 'data.npz'"),
        S,
    ),
    Case(
        "fit(x=42)",
        lambda env: _fit(env, 42),
        errors.InvalidArgumentTypeError,
        ("x must be NumPy/JAX arrays", "int 42"),
        S,
    ),
    Case(
        "fit([])",
        lambda env: _fit(env, []),
        errors.EmptyDatasetError,
        ("empty list", "nothing to train on"),
        S,
    ),
    Case(
        "fit(an empty generator)",
        lambda env: _fit(env, _empty()),
        errors.EmptyDatasetError,
        ("yielded no batch", "at least one batch"),
        S,
    ),
    Case(
        "fit(arrays with 0 examples)",
        lambda env: _fit(env, X[:0], Y[:0]),
        errors.EmptyDatasetError,
        ("x has 0 examples", "(0, 4)"),
        S,
    ),
    Case(
        "fit(an empty distributed dataset)",
        lambda env: _fit(env, env.strategy.experimental_distribute_dataset(_empty())),
        errors.EmptyDatasetError,
        ("DistributedDataset", "yielded no batch in the first epoch"),
        S,
    ),
    Case(
        "evaluate([])",
        lambda env: _model(env).evaluate([], verbose=0),
        errors.EmptyDatasetError,
        ("empty list",),
        S,
    ),
    Case(
        "predict(an empty generator)",
        lambda env: _model(env).predict(_empty(), verbose=0),
        errors.EmptyDatasetError,
        ("yielded no batch",),
        S,
    ),
    Case(
        "fit without y for arrays",
        lambda env: _fit(env, X),
        errors.InvalidArgumentError,
        ("y is required",),
        S,
    ),
    Case(
        "fit(y of another length)",
        lambda env: _fit(env, X, Y[:10]),
        errors.InvalidArgumentError,
        ("x has 16 examples but y has 10",),
        S,
    ),
    Case(
        "fit(sample_weight of another length)",
        lambda env: _fit(env, X, Y, sample_weight=np.ones(3)),
        errors.InvalidArgumentError,
        ("x has 16 examples but sample_weight has 3",),
        S,
    ),
    Case(
        "fit(sample_weight of shape (16, 2))",
        lambda env: _fit(env, X, Y, sample_weight=np.ones((16, 2))),
        errors.InvalidArgumentError,
        ("one weight per example, shape (16,)", "(16, 2)"),
        S,
    ),
    Case(
        "fit(sample_weight with NaN)",
        lambda env: _fit(env, X, Y, sample_weight=np.where(np.arange(16) == 3, np.nan, 1.0)),
        errors.InvalidArgumentError,
        ("NaN or infinite", "index 3"),
        S,
    ),
    Case(
        "fit(y=...) with a dataset",
        lambda env: _fit(env, _batches(), Y),
        errors.InvalidArgumentError,
        ("y must be None when x is a dataset", "ndarray"),
        S,
    ),
    Case(
        "fit(batch_size=...) with a dataset",
        lambda env: _fit(env, [(X, Y)], batch_size=8),
        errors.InvalidArgumentError,
        ("batch_size=8 was given with a list", "Remove batch_size"),
        S,
    ),
    Case(
        "fit(sample_weight=...) with a dataset",
        lambda env: _fit(env, [(X, Y)], sample_weight=np.ones(16)),
        errors.InvalidArgumentError,
        ("sample_weight must be None when x is a dataset", "Put it in the batches"),
        S,
    ),
    Case(
        "fit(a dataset of dicts, not (x, y))",
        lambda env: _fit(env, [{"x": X, "y": Y}]),
        errors.InvalidBatchError,
        ("must be a tuple or list (x, y)", "received a dict"),
        S,
    ),
    Case(
        "fit(x of the wrong width)",
        lambda env: _fit(env, np.zeros((16, 5), np.float32), Y),
        errors.IncompatibleInputError,
        ("cannot take x of shape (16, 5)", "Linear (l1) takes inputs whose last axis is 4"),
        S,
    ),
    Case(
        "fit(a dict x for a module that takes an array)",
        lambda env: _fit(env, {"a": X}, Y),
        errors.IncompatibleInputError,
        ("cannot take x of shape {'a': (16, 4)}", "Give x the shape the module expects"),
        S,
    ),
    Case(
        "fit(generator batches of the wrong width)",
        lambda env: _fit(env, iter([(np.zeros((8, 5), np.float32), Y[:8])])),
        errors.IncompatibleInputError,
        ("cannot take x of shape (8, 5)", "last axis is 4"),
        S,
    ),
    Case(
        "evaluate(one-hot y with a sparse loss)",
        lambda env: _model(env).evaluate(X, np.eye(2, dtype=np.int32)[Y], verbose=0),
        errors.IncompatibleInputError,
        ("y_true of shape (1, 2)", "CategoricalCrossentropy"),
        S,
    ),
    Case(
        "fit(sparse labels out of range)",
        lambda env: _fit(env, X, np.full(16, 7, np.int32)),
        errors.InvalidLabelError,
        ("[0, 2)", "7"),
        S,
    ),
    Case(
        "fit(dataset batches with sample weights of shape (8, 2))",
        lambda env: _fit(env, [(X[:8], Y[:8], np.ones((8, 2)))]),
        errors.InvalidArgumentError,
        ("(the first batch)", "shape (8,)", "(8, 2)"),
        S,
    ),
    Case(
        "fit(text as x, with batch_size)",
        lambda env: _fit(env, ["a cat", "a dog"] * 8, Y, batch_size=8),
        errors.InvalidArgumentTypeError,
        ("x holds strings", "'a cat'", "strings are not numeric inputs", "TextVectorization"),
        S,
    ),
    Case(
        "fit(x as a NumPy array of strings)",
        lambda env: _fit(env, np.array(["a cat", "a dog"] * 8), Y),
        errors.InvalidArgumentTypeError,
        ("x holds strings", "'a cat'", "strings are not numeric inputs"),
        S,
    ),
    Case(
        "fit(labels as strings)",
        lambda env: _fit(env, X, ["cat", "dog"] * 8),
        errors.InvalidArgumentTypeError,
        ("y holds strings", "'cat'", "np.unique(y, return_inverse=True)"),
        S,
    ),
    Case(
        "fit([xa, xb], y, batch_size=8) (two inputs to a one-input model)",
        lambda env: _fit(env, [X, X[:, :3]], Y, batch_size=8),
        errors.IncompatibleInputError,
        ("fit: the model cannot take x of shape [(16, 4), (16, 3)]",),
        S,
    ),
    Case(
        "fit(dataset batches with labels out of range)",
        lambda env: _fit(env, [(X[:8], np.full(8, 5, np.int32))]),
        errors.InvalidLabelError,
        ("[0, 2)", "5"),
        S,
    ),
    Case(
        "summary(layer_range=...)",
        lambda env: _model(env).summary(layer_range=["l1", "l2"]),
        errors.UnsupportedArgumentError,
        ("layer_range=['l1', 'l2']", "leave it None"),
    ),
    Case(
        "fit(validation_data=(x,)) without labels",
        lambda env: _fit(env, X, Y, validation_data=(X,)),
        errors.InvalidArgumentError,
        ("(x_val, y_val)", "tuple of 1"),
        S,
    ),
    Case(
        "fit(class_weight='balanced')",
        lambda env: _fit(env, X, Y, class_weight="balanced"),
        errors.InvalidArgumentTypeError,
        ("class_weight must be a dict", "'balanced'", "{0: 1.0, 1: 5.0}"),
    ),
    Case(
        "MeanSquaredError(reduction='auto') (tf.keras's, refused by Keras 3 too)",
        lambda env: mirrax.losses.MeanSquaredError(reduction="auto"),
        errors.UnsupportedArgumentError,
        ("reduction='auto'", "'sum_over_batch_size'", "None / 'none'", "mirrax.compute_average_loss"),
    ),
    Case(
        "SparseCategoricalCrossentropy(ignore_class=-1) (a Keras argument)",
        lambda env: mirrax.losses.SparseCategoricalCrossentropy(ignore_class=-1),
        errors.UnsupportedArgumentError,
        ("ignore_class=-1", "sample_weight"),
    ),
    Case(
        "fit(class_weight with a fractional key)",
        lambda env: _fit(env, X, Y, class_weight={1.5: 2.0}),
        errors.InvalidArgumentTypeError,
        ("keys must be class indices (ints >= 0)", "1.5", "{0: 1.0, 1: 5.0}"),
    ),
    Case(
        "fit(class_weight with a string key)",
        lambda env: _fit(env, X, Y, class_weight={"1": 2.0}),
        errors.InvalidArgumentTypeError,
        ("keys must be class indices", "'1'", "str"),
    ),
    Case(
        "fit(class_weight with a bool key)",
        lambda env: _fit(env, X, Y, class_weight={True: 2.0}),
        errors.InvalidArgumentTypeError,
        ("keys must be class indices", "True", "bool"),
    ),
    Case(
        "fit(class_weight with a negative weight)",
        lambda env: _fit(env, X, Y, class_weight={0: 1.0, 1: -2.0}),
        errors.InvalidArgumentError,
        ("class_weight[1]", "-2.0", ">= 0"),
    ),
    Case(
        "fit(class_weight and sample_weight)",
        lambda env: _fit(env, X, Y, class_weight={0: 1.0}, sample_weight=np.ones(16)),
        errors.InvalidArgumentError,
        ("class_weight and sample_weight were both given",),
    ),
    Case(
        "fit(callbacks=EarlyStopping class, not an instance)",
        lambda env: _fit(env, X, Y, callbacks=[callbacks.EarlyStopping]),
        errors.InvalidArgumentTypeError,
        ("Callback instances", "type"),
    ),
    Case(
        "fit(callbacks='early_stopping')",
        lambda env: _fit(env, X, Y, callbacks="early_stopping"),
        errors.InvalidArgumentTypeError,
        ("callbacks must be a list", "'early_stopping'"),
    ),
    # -- evaluate / predict ---------------------------------------------------------------------
    Case(
        "evaluate(steps=0)",
        lambda env: _model(env).evaluate(X, Y, steps=0, verbose=0),
        errors.InvalidArgumentError,
        ("steps must be >= 1", "steps=0"),
        S,
    ),
    Case(
        "evaluate(return_dict='yes')",
        lambda env: _model(env).evaluate(X, Y, return_dict="yes", verbose=0),
        errors.InvalidArgumentTypeError,
        ("return_dict must be True or False", "'yes'"),
    ),
    Case(
        "predict(batch_size=-3)",
        lambda env: _model(env).predict(X, batch_size=-3, verbose=0),
        errors.InvalidArgumentError,
        ("batch_size must be >= 1", "-3"),
        S,
    ),
    Case(
        "predict(verbose=3)",
        lambda env: _model(env).predict(X, verbose=3),
        errors.InvalidArgumentError,
        ("verbose must be", "3"),
    ),
    Case(
        "train_on_batch(a list of batches)",
        lambda env: _model(env).train_on_batch([(X, Y)]),
        errors.InvalidArgumentTypeError,
        ("holding one batch", "list", "fit()"),
    ),
    Case(
        "train_on_batch(class_weight and sample_weight)",
        lambda env: _model(env).train_on_batch(X, Y, sample_weight=np.ones(16), class_weight={0: 2.0}),
        errors.InvalidArgumentError,
        ("class_weight and sample_weight were both given",),
    ),
    Case(
        "reset_metrics before compile",
        lambda env: mirrax.Model(_MLP()).reset_metrics(),
        errors.NotCompiledError,
        ("not compiled",),
    ),
    # -- weights and summary --------------------------------------------------------------------
    Case(
        "set_weights(None)",
        lambda env: _model(env).set_weights(None),
        errors.InvalidArgumentTypeError,
        ("list of arrays", "NoneType"),
    ),
    Case(
        "set_weights(too few arrays)",
        lambda env: _model(env).set_weights([np.zeros(3)]),
        errors.InvalidArgumentError,
        ("the model has 4 variables but 1 arrays", "model.get_weights()"),
    ),
    Case(
        "set_weights(a transposed kernel)",
        lambda env: _set_transposed(env),
        errors.InvalidArgumentError,
        ("has shape (3, 4)", "(4, 3)", "l1.kernel"),
    ),
    Case(
        "summary(print_fn=3)",
        lambda env: _model(env).summary(print_fn=3),
        errors.InvalidArgumentTypeError,
        ("print_fn must be a function", "int 3"),
    ),
    Case(
        "optimizer.learning_rate = -1",
        lambda env: _set_rate(env, -1.0),
        errors.InvalidArgumentError,
        ("learning_rate must be a finite float >= 0", "-1.0"),
    ),
    # -- callbacks ------------------------------------------------------------------------------
    Case(
        "ReduceLROnPlateau with optax.adam(1e-3)",
        lambda env: _fixed_rate_fit(env, callbacks.ReduceLROnPlateau(monitor="loss")),
        errors.FixedLearningRateError,
        ("ReduceLROnPlateau changes the learning rate", "'adam'", "optax.inject_hyperparams(optax.adam)"),
        S,
    ),
    Case(
        "LearningRateScheduler with optax.adam(1e-3)",
        lambda env: _fixed_rate_fit(env, callbacks.LearningRateScheduler(lambda e, lr: lr)),
        errors.FixedLearningRateError,
        ("LearningRateScheduler changes the learning rate", "inject_hyperparams"),
        S,
    ),
    Case(
        "EarlyStopping(monitor='val_los') misspelt",
        lambda env: _fit(
            env, X, Y, validation_data=(X, Y), callbacks=[callbacks.EarlyStopping(monitor="val_los")]
        ),
        errors.InvalidArgumentError,
        ("monitor='val_los' is not among the logs", "val_loss, val_accuracy"),
        S,
    ),
    Case(
        "EarlyStopping(monitor='val_loss') without validation data",
        lambda env: _fit(env, X, Y, callbacks=[callbacks.EarlyStopping()]),
        errors.InvalidArgumentError,
        ("monitor='val_loss'", "loss, accuracy", "validation_data or validation_split"),
        S,
    ),
    Case(
        "ReduceLROnPlateau(monitor='acc') misspelt",
        lambda env: _fit(env, X, Y, callbacks=[callbacks.ReduceLROnPlateau(monitor="acc")]),
        errors.InvalidArgumentError,
        ("monitor='acc' is not among the logs", "accuracy"),
    ),
    Case(
        "EarlyStopping(patience=-1)",
        lambda env: callbacks.EarlyStopping(patience=-1),
        errors.InvalidArgumentError,
        ("patience must be >= 0", "patience=-1"),
    ),
    Case(
        "EarlyStopping(patience='2')",
        lambda env: callbacks.EarlyStopping(patience="2"),
        errors.InvalidArgumentTypeError,
        ("patience must be an int", "str '2'"),
    ),
    Case(
        "EarlyStopping(monitor=None)",
        lambda env: callbacks.EarlyStopping(monitor=None),
        errors.InvalidArgumentTypeError,
        ("monitor must be the name", "None"),
    ),
    Case(
        "EarlyStopping(baseline='0.9')",
        lambda env: callbacks.EarlyStopping(baseline="0.9"),
        errors.InvalidArgumentTypeError,
        ("baseline must be a number or None", "'0.9'"),
    ),
    Case(
        "EarlyStopping(start_from_epoch=-2)",
        lambda env: callbacks.EarlyStopping(start_from_epoch=-2),
        errors.InvalidArgumentError,
        ("start_from_epoch must be >= 0", "-2"),
    ),
    Case(
        "ReduceLROnPlateau(factor=1.5)",
        lambda env: callbacks.ReduceLROnPlateau(factor=1.5),
        errors.InvalidArgumentError,
        ("factor >= 1.0", "factor=1.5", "factor=0.5"),
    ),
    Case(
        "ReduceLROnPlateau(factor=-0.5)",
        lambda env: callbacks.ReduceLROnPlateau(factor=-0.5),
        errors.InvalidArgumentError,
        ("< 0", "factor=-0.5"),
    ),
    Case(
        "ReduceLROnPlateau(factor='half')",
        lambda env: callbacks.ReduceLROnPlateau(factor="half"),
        errors.InvalidArgumentTypeError,
        ("factor must be a number", "'half'"),
    ),
    Case(
        "ReduceLROnPlateau(min_lr=-1e-3)",
        lambda env: callbacks.ReduceLROnPlateau(min_lr=-1e-3),
        errors.InvalidArgumentError,
        ("min_lr must be >= 0.0", "-0.001"),
    ),
    Case(
        "ReduceLROnPlateau(epsilon=1e-4), tf.keras 1's name",
        lambda env: callbacks.ReduceLROnPlateau(epsilon=1e-4),
        errors.UnsupportedArgumentError,
        ("'epsilon'", "pass min_delta="),
    ),
    Case(
        "fit([x1, x2], y) with inputs of different lengths",
        lambda env: _fit(env, [X, X[:9]], Y),
        errors.InvalidArgumentError,
        ("x is a list of 2 arrays of different lengths (x[0]: 16, x[1]: 9) given with y",),
        S,
    ),
    Case(
        "ReduceLROnPlateau(cooldown=1.5)",
        lambda env: callbacks.ReduceLROnPlateau(cooldown=1.5),
        errors.InvalidArgumentTypeError,
        ("cooldown must be an int", "1.5"),
    ),
    Case(
        "LearningRateScheduler(0.01)",
        lambda env: callbacks.LearningRateScheduler(0.01),
        errors.InvalidArgumentTypeError,
        ("schedule(epoch, lr)", "float 0.01"),
    ),
    Case(
        "LearningRateScheduler returning a string",
        lambda env: _scheduled(env, lambda epoch, lr: "0.1"),
        errors.InvalidArgumentError,
        ("must return a float learning rate", "str '0.1'"),
    ),
    Case(
        "TerminateOnNaN(raise_error='yes')",
        lambda env: callbacks.TerminateOnNaN(raise_error="yes"),
        errors.InvalidArgumentTypeError,
        ("raise_error must be True or False", "'yes'"),
    ),
    Case(
        "CSVLogger(separator='; ')",
        lambda env: callbacks.CSVLogger("log.csv", separator="; "),
        errors.InvalidArgumentError,
        ("separator must be one character", "'; '"),
    ),
    Case(
        "CSVLogger(filename=None)",
        lambda env: callbacks.CSVLogger(None),
        errors.InvalidArgumentTypeError,
        ("filename must be a path", "None"),
    ),
    Case(
        "CSVLogger into a missing folder",
        lambda env: _fit(env, X, Y, callbacks=[callbacks.CSVLogger(env.tmp_path / "missing" / "log.csv")]),
        errors.MissingFolderError,
        ("does not exist", "os.makedirs"),
    ),
    Case(
        "TensorBoard(update_freq=0)",
        lambda env: callbacks.TensorBoard(update_freq=0),
        errors.InvalidArgumentError,
        ("update_freq must be 'epoch', 'batch'", "update_freq=0"),
    ),
    Case(
        "TensorBoard(write_images=True)",
        lambda env: callbacks.TensorBoard(write_images=True),
        errors.UnsupportedArgumentError,
        ("write_images=True", "histogram_freq"),
    ),
    Case(
        "LambdaCallback(on_epoch_end='print')",
        lambda env: callbacks.LambdaCallback(on_epoch_end="print"),
        errors.InvalidArgumentTypeError,
        ("on_epoch_end must be a function", "'print'"),
    ),
    Case(
        "LambdaCallback(on_epoch_ends=...) misspelt hook",
        lambda env: callbacks.LambdaCallback(on_epoch_ends=print),
        errors.InvalidArgumentTypeError,
        ("'on_epoch_ends'", "The hooks are"),
    ),
    # -- losses, metrics, mixed precision -------------------------------------------------------
    Case(
        "losses.get('crossentropy')",
        lambda env: mirrax.losses.get("crossentropy"),
        errors.InvalidIdentifierError,
        ("'crossentropy'", "sparse_categorical_crossentropy"),
    ),
    Case(
        "SparseCategoricalCrossentropy(from_logits='yes')",
        lambda env: mirrax.losses.SparseCategoricalCrossentropy(from_logits="yes"),
        errors.InvalidArgumentTypeError,
        ("from_logits must be True or False", "'yes'"),
    ),
    Case(
        "CategoricalCrossentropy(label_smoothing=2)",
        lambda env: mirrax.losses.CategoricalCrossentropy(label_smoothing=2.0),
        errors.InvalidArgumentError,
        ("label_smoothing must be a float in [0, 1]", "2.0"),
    ),
    Case(
        "Huber(delta='1')",
        lambda env: mirrax.losses.Huber(delta="1"),
        errors.InvalidArgumentTypeError,
        ("delta must be a float", "'1'"),
    ),
    Case(
        "LossFunctionWrapper(3)",
        lambda env: mirrax.losses.LossFunctionWrapper(3),
        errors.InvalidArgumentTypeError,
        ("needs a function fn(y_true, y_pred)", "int 3"),
    ),
    Case(
        "a loss on targets of another shape",
        lambda env: mirrax.losses.MeanSquaredError().per_example(np.zeros(4), np.zeros(3)),
        errors.IncompatibleInputError,
        ("y_true of shape (4,)", "y_pred of shape (3,)"),
    ),
    Case(
        "Recall(top_k=0)",
        lambda env: mirrax.metrics.Recall(top_k=0),
        errors.InvalidArgumentError,
        ("top_k must be >= 1", "top_k=0"),
    ),
    Case(
        "Precision(class_id=-1)",
        lambda env: mirrax.metrics.Precision(class_id=-1),
        errors.InvalidArgumentError,
        ("class_id must be >= 0", "class_id=-1"),
    ),
    Case(
        "Precision(thresholds='a')",
        lambda env: mirrax.metrics.Precision(thresholds="a"),
        errors.InvalidArgumentError,
        ("thresholds must be a float", "'a'"),
    ),
    Case(
        "compile(metrics=[a metric whose result() has shape (2,)])",
        lambda env: _compile(env, optimizer="sgd", metrics=[_PairMetric(name="pair")]),
        errors.InvalidArgumentError,
        ("'pair' (_PairMetric)", "shape (2,)", "Return a scalar"),
    ),
    Case(
        "AUC(num_thresholds=1)",
        lambda env: mirrax.metrics.AUC(num_thresholds=1),
        errors.InvalidArgumentError,
        ("num_thresholds must be an integer > 1", "1"),
    ),
    Case(
        "BinaryAccuracy(threshold='x')",
        lambda env: mirrax.metrics.BinaryAccuracy(threshold="x"),
        errors.InvalidArgumentTypeError,
        ("threshold must be a float", "'x'", "0.0 for logits"),
    ),
    Case(
        "MeanMetricWrapper(3)",
        lambda env: mirrax.metrics.MeanMetricWrapper(3),
        errors.InvalidArgumentTypeError,
        ("needs a function", "int 3"),
    ),
    Case(
        "metrics.get('acurracy')",
        lambda env: mirrax.metrics.get("acurracy"),
        errors.InvalidIdentifierError,
        ("'acurracy'", "accuracy"),
    ),
    Case(
        "set_global_policy('mixed_float17')",
        lambda env: mirrax.mixed_precision.set_global_policy("mixed_float17"),
        errors.InvalidIdentifierError,
        ("'mixed_float17'", "mixed_float16, mixed_bfloat16"),
    ),
    Case(
        "set_global_policy(16)",
        lambda env: mirrax.mixed_precision.set_global_policy(16),
        errors.InvalidArgumentTypeError,
        ("named by a str", "int 16", "'mixed_bfloat16'"),
    ),
]


def _compile_elsewhere(env):
    other = mirrax.MirroredStrategy(["cpu:2", "cpu:3"])
    with other.scope():
        model = mirrax.Model(_MLP())
    with env.strategy.scope():
        model.compile("sgd", "sparse_categorical_crossentropy")


def _set_transposed(env):
    model = _model(env)
    weights = model.get_weights()
    order = [path for path, _ in nnx.to_flat_state(nnx.state(model.module))]
    index = [".".join(map(str, p)) for p in order].index("l1.kernel")
    weights[index] = weights[index].T
    model.set_weights(weights)


def _set_rate(env, rate):
    _model(env, optimizer="adam").optimizer.learning_rate = rate


def _scheduled(env, schedule):
    _model(env).fit(X, Y, verbose=0, callbacks=[callbacks.LearningRateScheduler(schedule)])
