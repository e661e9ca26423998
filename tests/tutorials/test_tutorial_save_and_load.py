"""Port of tensorflow/docs site/en/tutorials/distribute/save_and_load.ipynb ("Save and load a
model using a distribution strategy"), as a TF user would port it.

Translation (mechanical): `tf.distribute.X` -> `mirrax.X`; the tf.keras model -> Keras 3 on JAX
wrapped in `mirrax.Model`, compiled with Keras's loss, optimizer and metric objects;
`tf.keras.models.load_model` -> `mirrax.models.load_model`; `tf.saved_model.save(model, p)` /
`tf.saved_model.load(p)` -> `mirrax.export(model, p, input_signature)` /
`mirrax.load_exported(p)` (JAX traces for a signature, which TF reads from the Keras model);
tensorflow_datasets' MNIST -> the bundled digits as lists of global batches (shuffled once;
`.cache().shuffle()` reshuffles every epoch); 16 examples per replica instead of 64.

Sections (6 with code, 5 ported): overview (train a model), the Keras API (save, load with
and without a strategy), the tf.saved_model API, which API should I use, caveats (a
subclassed model saved before and after fit). Not ported: "Saving/Loading from a local
device" (`tf.saved_model.SaveOptions(experimental_io_device=...)`: no such device placement in
JAX) and the cell of "The tf.saved_model API" that wraps the artifact in
`tensorflow_hub.KerasLayer` (TensorFlow Hub needs TensorFlow).
"""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

keras = pytest.importorskip("keras")

import mirrax  # noqa: E402
from tests.tutorials import sections  # noqa: E402

# The notebook's `input_shape=` on the first layer: Keras 3 accepts it with a UserWarning.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:Do not pass an `input_shape`:UserWarning"),
    pytest.mark.xdist_group("tutorial_save_and_load"),
]
tutorial = sections.Tutorial()
DEFAULT_FUNCTION_KEY = "serving_default"


@tutorial.section
def overview(ns):
    ns.mirrored_strategy = mirrax.MirroredStrategy()

    def get_data():
        (x_train, y_train), (x_test, y_test) = mirrax.data.load_digits()
        BATCH_SIZE_PER_REPLICA = 16
        BATCH_SIZE = BATCH_SIZE_PER_REPLICA * ns.mirrored_strategy.num_replicas_in_sync
        order = np.random.default_rng(0).permutation(len(x_train))  # .shuffle(BUFFER_SIZE)
        x_train, y_train = x_train[order], y_train[order]
        # map(scale): the digits already are float32 in [0, 1].
        train_dataset = [
            (x_train[i : i + BATCH_SIZE], y_train[i : i + BATCH_SIZE])
            for i in range(0, len(x_train), BATCH_SIZE)
        ]
        eval_dataset = [
            (x_test[i : i + BATCH_SIZE], y_test[i : i + BATCH_SIZE])
            for i in range(0, len(x_test), BATCH_SIZE)
        ]
        return train_dataset, eval_dataset

    def get_model():
        with ns.mirrored_strategy.scope():
            model = mirrax.Model(
                keras.Sequential(
                    [
                        keras.layers.Conv2D(32, 3, activation="relu", input_shape=(8, 8, 1)),
                        keras.layers.MaxPooling2D(),
                        keras.layers.Flatten(),
                        keras.layers.Dense(64, activation="relu"),
                        keras.layers.Dense(10),
                    ]
                )
            )
            model.compile(
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                optimizer=keras.optimizers.Adam(),
                metrics=[keras.metrics.SparseCategoricalAccuracy()],
            )
            return model

    ns.get_model = get_model
    keras.utils.set_random_seed(0)
    ns.model = get_model()
    ns.train_dataset, ns.eval_dataset = get_data()
    history = ns.model.fit(ns.train_dataset, epochs=2, verbose=0).history
    return {
        "history": {k: [float(v) for v in vs] for k, vs in history.items()},
        "steps": len(ns.train_dataset),
    }


@tutorial.section
def the_keras_api(ns):
    keras_model_path = os.path.join(ns.tmp_dir, "keras_save.keras")
    ns.model.save(keras_model_path)
    before = ns.model.predict(ns.eval_dataset[0][0], verbose=0)
    restored_keras_model = mirrax.models.load_model(keras_model_path)
    restored = restored_keras_model.predict(ns.eval_dataset[0][0], verbose=0)
    restored_history = restored_keras_model.fit(ns.train_dataset, epochs=2, verbose=0).history
    another_strategy = mirrax.OneDeviceStrategy("/cpu:0")
    with another_strategy.scope():
        restored_keras_model_ds = mirrax.models.load_model(keras_model_path)
        ds_history = restored_keras_model_ds.fit(ns.train_dataset, epochs=2, verbose=0).history
    return {
        "equal_predictions": bool(np.array_equal(before, restored)),
        "type": type(restored_keras_model).__name__,
        "restored_loss": [float(v) for v in restored_history["loss"]],
        "ds_loss": [float(v) for v in ds_history["loss"]],
        "ds_strategy": type(restored_keras_model_ds.distribute_strategy).__name__,
    }


@tutorial.section
def the_tf_saved_model_api(ns):
    model = ns.get_model()  # get a fresh model
    saved_model_path = os.path.join(ns.tmp_dir, "tf_save")
    mirrax.export(model, saved_model_path, input_signature=jax.ShapeDtypeStruct((None, 8, 8, 1), jnp.float32))
    loaded = mirrax.load_exported(saved_model_path)
    inference_func = loaded.signatures[DEFAULT_FUNCTION_KEY]
    predict_dataset = [images for images, _ in ns.eval_dataset]  # .map(lambda i, l: i)
    one = np.asarray(inference_func(predict_dataset[0]))
    expected = model.predict(predict_dataset[0], verbose=0)
    another_strategy = mirrax.MirroredStrategy()
    with another_strategy.scope():
        loaded = mirrax.load_exported(saved_model_path)
        inference_func = loaded.signatures[DEFAULT_FUNCTION_KEY]
        dist_predict_dataset = another_strategy.experimental_distribute_dataset(predict_dataset)
        # Calling the function in a distributed manner
        for batch in dist_predict_dataset:
            result = another_strategy.run(inference_func, args=(batch,))
            break
    distributed = np.asarray(another_strategy.gather(result, axis=0))
    return {
        "shape": list(one.shape),
        "close": bool(np.allclose(one, expected, atol=1e-5)),
        "distributed_close": bool(np.allclose(distributed, expected, atol=1e-5)),
    }


@tutorial.section
def which_api_should_i_use(ns):
    model = ns.get_model()
    saved_model_path = os.path.join(ns.tmp_dir, "tf_save_keras")
    # Saving the model using Keras `Model.save`: Keras 3 (also under TensorFlow) refuses a
    # path without ".keras" (the notebook's SavedModel directory), so that is what is checked.
    try:
        model.save(saved_model_path)
    except ValueError as e:
        return {"refused": type(e).__name__, "message": str(e)}
    return {"refused": None, "message": ""}


class SubclassedModel(keras.Model):
    """Example model defined by subclassing `keras.Model`."""

    output_name = "output_layer"

    def __init__(self):
        super().__init__()
        self._dense_layer = keras.layers.Dense(5, dtype="float32", name=self.output_name)

    def call(self, inputs):
        return self._dense_layer(inputs)


@tutorial.section
def caveats(ns):
    my_model = mirrax.Model(SubclassedModel())
    saved_model_path = os.path.join(ns.tmp_dir, "subclassed.keras")
    try:
        my_model.save(saved_model_path)
        before = None
    except ValueError as e:
        before = type(e).__name__
    BATCH_SIZE_PER_REPLICA = 4
    BATCH_SIZE = BATCH_SIZE_PER_REPLICA * ns.mirrored_strategy.num_replicas_in_sync
    dataset_size = 100
    row = np.arange(5, dtype=np.float32)
    dataset = [
        (np.tile(row, (n, 1)), np.tile(row, (n, 1)))
        for n in [BATCH_SIZE] * (dataset_size // BATCH_SIZE) + [dataset_size % BATCH_SIZE]
    ]
    my_model.compile(optimizer="adam", loss="mean_squared_error")
    my_model.fit(dataset, epochs=2, verbose=0)
    my_model.save(saved_model_path)
    return {"refused_before_fit": before, "saved_after_fit": os.path.exists(saved_model_path)}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    import types

    return tutorial.run_all(types.SimpleNamespace(tmp_dir=str(tmp_path_factory.mktemp("sl"))))


def test_overview(outcomes):
    values = sections.result(outcomes, "overview")
    # ceil(1437 / 128) = 12 global batches; 2 epochs: the loss falls, the accuracy rises.
    assert values["steps"] == 12
    loss, accuracy = values["history"]["loss"], values["history"]["sparse_categorical_accuracy"]
    assert loss[1] < loss[0] and accuracy[1] > accuracy[0]


def test_the_keras_api(outcomes):
    overview = sections.result(outcomes, "overview")
    values = sections.result(outcomes, "the_keras_api")
    # Same weights, same program: the same predictions; training goes on from the trained
    # model (below its first epoch's loss), with and without another strategy's scope.
    assert values["equal_predictions"] and values["type"] == "Model"
    assert max(values["restored_loss"]) < overview["history"]["loss"][0]
    assert max(values["ds_loss"]) < overview["history"]["loss"][0]
    assert values["ds_strategy"] == "OneDeviceStrategy"


@pytest.mark.xfail(
    strict=True,
    reason="not in issue 26: mirrax.load_exported's artifact has "
    "no .signatures['serving_default'] (it is called directly); the "
    "tf.saved_model API has no mirrax name",
)
def test_the_tf_saved_model_api(outcomes):
    values = sections.result(outcomes, "the_tf_saved_model_api")
    # One eval batch of 128 images -> 128 x 10 logits, as the model's own predict, on one
    # device and under a MirroredStrategy (float rounding of a different program: 1e-5).
    assert values == {"shape": [128, 10], "close": True, "distributed_close": True}


def test_which_api_should_i_use(outcomes):
    values = sections.result(outcomes, "which_api_should_i_use")
    assert values["refused"] is not None and ".keras" in values["message"]


@pytest.mark.xfail(
    strict=True,
    reason="not in issue 26: mirrax.Model refuses an unbuilt "
    "subclassed Keras model (TF builds it at the first fit); item 6: save",
)
def test_caveats(outcomes):
    # Keras refuses to save a subclassed model before it is built; after fit it saves.
    assert sections.result(outcomes, "caveats") == {
        "refused_before_fit": "ValueError",
        "saved_after_fit": True,
    }
