"""mirrax.function: a distributed step (strategy.run, reduce and the arithmetic around them)
compiled into one program, as tf.function compiles TF's `distributed_train_step`."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import mirrax
from tests.conftest import mirrored, named_strategy
from tests.test_run import MLP, mlp_data, sgd_step


def _linear(strategy, kernel=2.0):
    """y = kernel * x, bias 0, and SGD with learning rate 1/8 (a power of two: exact steps)."""
    with strategy.scope():
        model = nnx.Linear(1, 1, rngs=nnx.Rngs(0))
        model.kernel[...] = jnp.full((1, 1), kernel)
        model.bias[...] = jnp.zeros((1,))
        optimizer = nnx.Optimizer(model, optax.sgd(0.125), wrt=nnx.Param)
    return model, optimizer


def _squared_error_step(model, optimizer, batch):
    x, y = batch

    def loss_fn(model):
        return mirrax.compute_average_loss(((model(x) - y) ** 2)[:, 0])

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


@pytest.mark.parametrize("replicas", [0, 4])
def test_one_step_of_the_tutorials_distributed_train_step_by_hand(replicas):
    strategy = mirrored(replicas)
    model, optimizer = _linear(strategy)
    x = np.array([[1.0], [2.0], [3.0], [4.0]], np.float32)
    batch = next(iter(strategy.experimental_distribute_dataset((x, np.zeros((4, 1), np.float32)))))

    def train_step(inputs):  # captures model and optimizer, as TF's tutorial does
        return _squared_error_step(model, optimizer, inputs)

    @mirrax.function
    def distributed_train_step(dataset_inputs):
        per_replica_losses = strategy.run(train_step, args=(dataset_inputs,))
        return strategy.reduce(mirrax.ReduceOp.SUM, per_replica_losses, axis=None)

    loss = distributed_train_step(batch)
    # Errors 2x: squared 4, 16, 36, 64, mean 30. d/dkernel = mean(2 * 2x * x) = 30,
    # d/dbias = mean(2 * 2x) = 10; SGD at 1/8: kernel 2 - 30/8 = -1.75, bias -10/8 = -1.25.
    # Every intermediate is a small dyadic rational, so float32 holds each exactly.
    assert isinstance(loss, jax.Array) and float(loss) == 30.0
    assert float(model.kernel[0, 0]) == -1.75 and float(model.bias[0]) == -1.25
    assert int(optimizer.step[...]) == 1


@pytest.mark.parametrize("name", ["OneDevice", "Mirrored4CPU"])
def test_a_function_trains_as_run_and_reduce_do_and_compiles_once(name):
    strategy = named_strategy(name)
    w1, w2, x, y = mlp_data()
    batches = list(strategy.experimental_distribute_dataset((x, y)))
    with strategy.scope():
        model, ref_model = MLP(w1, w2), MLP(w1, w2)
        optimizer = nnx.Optimizer(model, optax.adam(0.01), wrt=nnx.Param)
        ref_optimizer = nnx.Optimizer(ref_model, optax.adam(0.01), wrt=nnx.Param)
    traces = []

    @mirrax.function
    def distributed_train_step(batch):
        traces.append(1)  # a Python side effect: runs when the function is traced, as in TF
        losses = strategy.run(sgd_step, args=(model, optimizer, batch))
        return strategy.reduce("sum", losses, axis=None) * 2.0

    for i in range(3):
        loss = distributed_train_step(batches[0])
        if i == 0:
            traced = len(traces)
        ref = strategy.reduce(
            "sum", strategy.run(sgd_step, args=(ref_model, ref_optimizer, batches[0])), axis=None
        )
        # One program instead of two: XLA may fuse the step's arithmetic with the reduce
        # differently, so float rounding may differ in the last places.
        np.testing.assert_allclose(float(loss), 2.0 * float(ref), rtol=1e-6)
    np.testing.assert_allclose(
        np.asarray(model.l1.kernel[...]), np.asarray(ref_model.l1.kernel[...]), rtol=1e-5
    )
    assert int(optimizer.step[...]) == 3
    # Traced at the first call (once, or twice where JAX does not reuse the abstract trace
    # for the program), never again.
    assert traced in (1, 2) and len(traces) == traced


def test_the_program_holds_the_run_and_the_reduce():
    strategy = mirrored(4)
    model, optimizer = _linear(strategy)
    batch = next(iter(strategy.experimental_distribute_dataset((np.ones((8, 1), np.float32),) * 2)))

    @mirrax.function
    def step(batch):
        losses = strategy.run(_squared_error_step, args=(model, optimizer, batch))
        return strategy.reduce("mean", losses, axis=None), losses

    lowered = step.lower(batch)
    text = lowered.as_text()
    assert "all_reduce" in text  # the gradients' sum over the replicas
    new_state, (mean, losses) = lowered.out_info
    assert mean.shape == () and losses.value.shape == (4,)  # the reduce is in the program
    # Nothing ran: the kernel is as built.
    assert float(model.kernel[0, 0]) == 2.0
    mean, losses = step(batch)
    assert isinstance(losses, mirrax.PerReplica) and len(losses.values) == 4
    # (2 - 1)^2 = 1 per example; each replica's share of the global mean is 2 / 8.
    assert float(mean) == 0.25 and [float(v) for v in losses.values] == [0.25] * 4


def test_explicit_arguments_and_captures_give_the_same_weights():
    strategy = mirrored(2)
    w1, w2, x, y = mlp_data()
    batch = next(iter(strategy.experimental_distribute_dataset((x, y))))
    with strategy.scope():
        a, b = MLP(w1, w2), MLP(w1, w2)
        opt_a = nnx.Optimizer(a, optax.sgd(0.1), wrt=nnx.Param)
        opt_b = nnx.Optimizer(b, optax.sgd(0.1), wrt=nnx.Param)

    @mirrax.function
    def with_arguments(model, optimizer, batch):
        return strategy.run(sgd_step, args=(model, optimizer, batch))

    @mirrax.function
    def with_captures(batch):
        return strategy.run(sgd_step, args=(b, opt_b, batch))

    for _ in range(2):
        with_arguments(a, opt_a, batch)
        with_captures(batch)
    # The same step program over the same state, one call structure each: the same bits.
    np.testing.assert_array_equal(np.asarray(a.l2.kernel[...]), np.asarray(b.l2.kernel[...]))


def test_an_iterator_argument_gives_one_batch_per_next():
    strategy = mirrored(2)
    x = np.arange(12, dtype=np.float32).reshape(12, 1)
    dataset = strategy.experimental_distribute_dataset(
        [(x[i : i + 4], x[i : i + 4] * 0) for i in range(0, 12, 4)]
    )
    seen = []

    def record(batch):
        return jnp.sum(batch[0])

    @mirrax.function
    def one(iterator):
        return strategy.reduce("sum", strategy.run(record, args=(next(iterator),)), axis=None)

    @mirrax.function
    def two(iterator):
        first = strategy.run(record, args=(next(iterator),))
        second = strategy.run(record, args=(iterator.get_next(),))
        return strategy.reduce("sum", first, axis=None), strategy.reduce("sum", second, axis=None)

    iterator = iter(dataset)
    for _ in range(3):
        seen.append(float(one(iterator)))
    # Batches 0-3, 4-7, 8-11: sums 6, 22, 38 (TF's next(iterator) inside a tf.function).
    assert seen == [6.0, 22.0, 38.0]
    with pytest.raises(StopIteration):
        one(iterator)
    iterator = iter(dataset)
    assert [float(v) for v in two(iterator)] == [6.0, 22.0]


def test_a_user_held_array_keeps_its_value_after_a_call():
    strategy = mirrored(2)
    model, optimizer = _linear(strategy)
    batch = next(iter(strategy.experimental_distribute_dataset((np.ones((4, 1), np.float32),) * 2)))
    held = model.kernel[...]

    @mirrax.function
    def step(batch):
        return strategy.run(_squared_error_step, args=(model, optimizer, batch))

    step(batch)
    step(batch)
    # Not donated (the user holds it): still readable, still 2. The model moved on: the
    # error is 2 - 1 = 1, the gradient 2 * 1 * x = 2 for kernel and bias, so kernel
    # 2 - 2/8 = 1.75, bias -0.25; then the error 1.5 - 1 = 0.5, kernel 1.75 - 1/8 = 1.625.
    assert float(held[0, 0]) == 2.0
    assert float(model.kernel[0, 0]) == 1.625


def test_a_method_is_compiled_once_per_instance():
    strategy = mirrored(2)
    batch = next(iter(strategy.experimental_distribute_dataset((np.ones((4, 1), np.float32),) * 2)))

    class Trainer:
        def __init__(self):
            self.model, self.optimizer = _linear(strategy)
            self.traces = []

        @mirrax.function
        def train(self, batch):
            self.traces.append(1)  # a list: the trace reaches `self` through a shallow copy
            return strategy.reduce(
                "sum", strategy.run(_squared_error_step, args=(self.model, self.optimizer, batch)), axis=None
            )

    trainer = Trainer()
    assert [float(trainer.train(batch)) for _ in range(2)] == [
        1.0,
        0.25,
    ]  # (2 - 1)^2, then (1.75 - 0.25 - 1)^2
    traced = len(trainer.traces)
    trainer.train(batch)
    assert traced in (1, 2) and len(trainer.traces) == traced


def test_a_step_with_batch_norm_and_dropout_matches_run():
    strategy = mirrored(2)
    x = np.random.default_rng(0).standard_normal((8, 3)).astype(np.float32)
    batch = next(iter(strategy.experimental_distribute_dataset((x, np.zeros((8, 2), np.float32)))))

    class Net(nnx.Module):
        def __init__(self):
            self.dense = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
            self.norm = nnx.BatchNorm(2, rngs=nnx.Rngs(0))
            self.drop = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=1))

        def __call__(self, x):
            return self.drop(self.norm(self.dense(x)))

    with strategy.scope():
        net, ref = Net(), Net()
        opt = nnx.Optimizer(net, optax.sgd(0.1), wrt=nnx.Param)
        ref_opt = nnx.Optimizer(ref, optax.sgd(0.1), wrt=nnx.Param)

    @mirrax.function
    def step(batch):
        return strategy.run(_squared_error_step, args=(net, opt, batch))

    for _ in range(2):
        step(batch)
        strategy.run(_squared_error_step, args=(ref, ref_opt, batch))
    # The same step (RNG streams and synchronized statistics included) inside one program;
    # the tolerance is float rounding where XLA fuses the larger program differently.
    for a, b in (
        (net.norm.mean, ref.norm.mean),
        (net.norm.var, ref.norm.var),
        (net.dense.kernel, ref.dense.kernel),
    ):
        np.testing.assert_allclose(np.asarray(a[...]), np.asarray(b[...]), rtol=1e-5, atol=1e-7)
    assert int(net.drop.rngs.count[...]) == int(ref.drop.rngs.count[...]) == 2


def test_replica_invariant_mode_gives_the_same_bits_on_1_and_4_replicas():
    w1, w2, x, y = mlp_data()
    results = []
    for replicas in (1, 4):
        strategy = mirrax.MirroredStrategy(
            [f"cpu:{i}" for i in range(replicas)], replica_invariant=True, micro_batches=4
        )
        batch = next(iter(strategy.experimental_distribute_dataset((x, y))))
        with strategy.scope():
            model = MLP(w1, w2)
            optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

        def step(batch):
            xb, yb = batch

            def loss_fn(model, xb, yb):
                per_example = optax.softmax_cross_entropy_with_integer_labels(model(xb), yb)
                return mirrax.compute_average_loss(per_example, global_batch_size=16)

            loss, grads = mirrax.value_and_grad(loss_fn)(model, xb, yb)
            optimizer.update(model, grads)
            return loss

        @mirrax.function
        def train(batch):
            return strategy.reduce("sum", strategy.run(step, args=(batch,)), axis=None)

        losses = [np.asarray(train(batch)) for _ in range(2)]
        results.append((losses, np.asarray(model.l1.kernel[...])))
    # The mode's guarantee (docs/design.md, "Replica invariance"), inside one function program.
    assert [loss.tobytes() for loss in results[0][0]] == [loss.tobytes() for loss in results[1][0]]
    assert results[0][1].tobytes() == results[1][1].tobytes()


# -- bad input ------------------------------------------------------------------------------------


def test_bad_decorator_use_is_refused_with_the_fix():
    with pytest.raises(TypeError, match=r"func must be callable; received 3 of type int"):
        mirrax.function(3)
    with pytest.raises(TypeError, match=r"option input_signature=\[\] is not supported"):
        mirrax.function(lambda: 0, input_signature=[])
    with pytest.raises(ValueError, match=r"jit_compile must be None or True; received False"):
        mirrax.function(jit_compile=False)
    # TF's accepted spellings work.
    assert mirrax.function(jit_compile=True, reduce_retracing=True)(lambda: 1)() == 1


def test_a_dataset_argument_names_the_two_fixes():
    strategy = mirrored(2)
    dataset = strategy.experimental_distribute_dataset(np.ones((4, 1), np.float32))

    @mirrax.function
    def step(data):
        return 0

    with pytest.raises(
        TypeError,
        match=r"args\[0\] is a DistributedDataset, not a batch or an iterator.*iter\(dist_dataset\)",
    ):
        step(dataset)


def test_looping_over_an_iterator_argument_inside_is_refused():
    strategy = mirrored(2)
    iterator = iter(strategy.experimental_distribute_dataset(np.ones((4, 1), np.float32)))

    @mirrax.function
    def epoch(iterator):
        return [strategy.run(jnp.sum, args=(x,)) for x in iterator]

    with pytest.raises(TypeError, match=r"for x in iterator\) would trace every batch"):
        epoch(iterator)


def test_a_function_called_inside_jit_or_returning_a_module_is_refused():
    strategy = mirrored(2)
    model, _ = _linear(strategy)

    @mirrax.function
    def double(x):
        return x * 2

    with pytest.raises(
        mirrax.errors.ReplicaContextError, match=r"args\[0\] is a traced value.*call it outside"
    ):
        jax.jit(double)(jnp.ones(2))

    @mirrax.function
    def leaks():
        return model

    with pytest.raises(
        TypeError, match=r"leaks returned a Linear.*updated in place and need not be returned"
    ):
        leaks()
    assert float(model.kernel[0, 0]) == 2.0


def test_state_the_function_does_not_carry_is_refused_before_anything_changes():
    strategy = mirrored(2)
    model, optimizer = _linear(strategy)
    batch = next(iter(strategy.experimental_distribute_dataset((np.ones((4, 1), np.float32),) * 2)))

    class Box:
        pass

    outer, inner = Box(), Box()
    outer.inner, inner.model, inner.optimizer = inner, model, optimizer

    @mirrax.function
    def step(batch):  # two attributes deep: past the captures walk
        return strategy.run(_squared_error_step, args=(outer.inner.model, outer.inner.optimizer, batch))

    with pytest.raises(
        mirrax.errors.CapturedStateError, match=r"reaches NNX objects that step does not carry"
    ):
        step(batch)
    assert float(model.kernel[0, 0]) == 2.0  # the caller's model is untouched


def test_two_strategies_in_one_function_are_refused():
    one, two = mirrored(2), mirrored(4)

    @mirrax.function
    def both():
        return one.run(lambda: jnp.ones(())), two.run(lambda: jnp.ones(()))

    with pytest.raises(
        mirrax.errors.MixedStrategyError, match=r"calls strategy.run of 2 different strategies"
    ):
        both()


def test_a_changing_python_value_warns_on_the_sixth_compile():
    @mirrax.function
    def scale(x, factor):
        return x * factor

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for factor in range(6):
            scale(jnp.ones(()), factor)
    messages = [str(w.message) for w in caught if "has compiled scale 6 times" in str(w.message)]
    assert len(messages) == 1 and "pass values that change every call as arrays" in messages[0]


def test_a_function_called_inside_jit_with_captured_state_leaves_the_model_as_it_was():
    strategy = mirrored(2)
    model, optimizer = _linear(strategy)
    batch = next(iter(strategy.experimental_distribute_dataset((np.ones((4, 1), np.float32),) * 2)))

    @mirrax.function
    def step():
        return strategy.reduce(
            "sum", strategy.run(_squared_error_step, args=(model, optimizer, batch)), axis=None
        )

    # Before: the jit returned a number and the model held tracers from then on.
    with pytest.raises(mirrax.errors.ReplicaContextError, match=r"step was called inside jax.jit"):
        jax.jit(lambda: step())()
    assert float(model.kernel[0, 0]) == 2.0 and int(optimizer.step[...]) == 0
    assert float(step()) == 1.0  # (2 - 1)^2: the model still trains


def test_a_captured_iterator_is_refused_rather_than_frozen_into_the_program():
    strategy = mirrored(2)
    iterator = iter(strategy.experimental_distribute_dataset(np.arange(8, dtype=np.float32).reshape(8, 1)))

    @mirrax.function
    def take():  # before: every call summed the batch its trace took
        return strategy.reduce("sum", strategy.run(jnp.sum, args=(next(iterator),)), axis=None)

    with pytest.raises(
        TypeError, match=r"calls next\(\) on a distributed iterator it captures.*take\(iterator\)"
    ):
        take()
    # Nothing was taken: the first batch (all 8 rows, 0 + 1 + ... + 7 = 28) is still next.
    assert float(strategy.reduce("sum", strategy.run(jnp.sum, args=(next(iterator),)), axis=None)) == 28.0


def test_local_results_and_an_iterator_given_to_run_inside_a_function():
    strategy = mirrored(2)
    dataset = strategy.experimental_distribute_dataset(np.arange(8, dtype=np.float32).reshape(8, 1))

    @mirrax.function
    def per_replica_sums(batch):
        return strategy.experimental_local_results(strategy.run(jnp.sum, args=(batch,)))

    # Rows 0-3 on replica 0 (sum 6), rows 4-7 on replica 1 (sum 22).
    assert [float(v) for v in per_replica_sums(next(iter(dataset)))] == [6.0, 22.0]

    @mirrax.function
    def wrong(iterator):
        return strategy.run(jnp.sum, args=(iterator,))

    with pytest.raises(TypeError, match=r"is a TracedIterator, not a batch"):
        wrong(iter(dataset))


def test_a_python_decision_on_a_traced_value_names_the_function_and_the_fix():
    strategy = mirrored(2)
    w1, w2, x, y = mlp_data()
    model = MLP(w1, w2)
    batch = next(iter(strategy.experimental_distribute_dataset((x, y))))
    before = [np.asarray(a) for a in jax.tree.leaves(nnx.state(model))]

    def per_replica(batch):
        return model(batch[0]).sum()

    @mirrax.function
    def positive_part(batch):
        total = strategy.reduce("sum", strategy.run(per_replica, args=(batch,)), axis=None)
        if total > 0:  # Python control flow on a value computed in the program
            return total
        return -total

    with pytest.raises(
        mirrax.errors.TracedValueError, match=r"mirrax.function: positive_part asks for the Python value"
    ) as info:
        positive_part(batch)
    assert "jnp.where, jax.lax.cond" in str(info.value)
    assert "state_leaves" not in str(info.value)  # JAX's names of the program's inner arguments
    assert isinstance(info.value, TypeError)  # what JAX raised, as before
    for got, want in zip(jax.tree.leaves(nnx.state(model)), before):
        np.testing.assert_array_equal(np.asarray(got), want)

    def branching_step(model, batch):
        loss = model(batch[0]).sum()
        return loss if int(loss) > 0 else -loss

    with pytest.raises(
        mirrax.errors.TracedValueError, match=r"strategy.run: branching_step asks for the Python value"
    ):
        strategy.run(branching_step, args=(model, batch))
