"""mirrax.metrics: Keras's values, SUM-aggregated state under every strategy, masking, resolution.

Expected numbers are Keras's documented values for the same inputs (keras.metrics.* docstrings
and tests), with the arithmetic written out.
"""

import numpy as np
import pytest

import mirrax
from mirrax import losses, metrics


def result(metric, *args, **kwargs):
    metric.update_state(*args, **kwargs)
    return np.asarray(metric.result())


def test_mean_and_sum_match_keras():
    assert result(metrics.Mean(), [1, 3, 5, 7]) == 4.0  # 16 / 4
    assert result(metrics.Mean(), [1, 3, 5, 7], sample_weight=[1, 1, 0, 0]) == 2.0  # (1 + 3) / 2
    assert result(metrics.Sum(), [1, 3, 5, 7]) == 16.0
    assert result(metrics.Sum(), [1, 3, 5, 7], sample_weight=[1, 1, 0, 0]) == 4.0
    # A row of values is one example: means [1.5, 3.5] weighted [1, 3] -> (1.5 + 10.5) / 4 = 3.
    assert result(metrics.Mean(), np.array([[1, 2], [3, 4]]), sample_weight=[1, 3]) == 3.0
    # Weights per element (Keras): example 0 -> (1*1 + 2*0) / 2 = 0.5 over weight 0.5;
    # example 1 -> (3 + 4) / 2 = 3.5 over weight 1; (0.5 + 3.5) / (0.5 + 1) = 2.6667.
    assert result(
        metrics.Mean(), np.array([[1, 2], [3, 4]]), sample_weight=np.array([[1, 0], [1, 1]])
    ) == pytest.approx(4 / 1.5)
    mean = metrics.Mean()
    mean.update_state(2.0)  # a scalar counts once
    mean.update_state(np.array([5.0, 8.0]))
    assert float(mean.result()) == 5.0  # (2 + 5 + 8) / 3
    assert float(metrics.Mean().result()) == 0.0  # Keras's divide_no_nan, not NaN


def test_accuracy_metrics_match_keras():
    assert result(metrics.Accuracy(), [[1], [2], [3], [4]], [[0], [2], [3], [4]]) == 0.75
    assert (
        result(metrics.Accuracy(), [[1], [2], [3], [4]], [[0], [2], [3], [4]], sample_weight=[1, 1, 0, 0])
        == 0.5
    )
    y, p = [[1], [1], [0], [0]], [[0.98], [1], [0], [0.6]]
    assert result(metrics.BinaryAccuracy(), y, p) == 0.75  # 0.6 > 0.5 -> 1, wrong
    assert result(metrics.BinaryAccuracy(), y, p, sample_weight=[1, 0, 0, 1]) == 0.5
    assert result(metrics.BinaryAccuracy(threshold=0.7), y, p) == 1.0  # 0.6 -> 0, right
    onehot, probs = [[0, 0, 1], [0, 1, 0]], [[0.1, 0.9, 0.8], [0.05, 0.95, 0]]
    assert result(metrics.CategoricalAccuracy(), onehot, probs) == 0.5
    assert result(metrics.CategoricalAccuracy(), onehot, probs, sample_weight=[0.7, 0.3]) == pytest.approx(
        0.3
    )
    sparse, probs = [[2], [1]], [[0.1, 0.6, 0.3], [0.05, 0.95, 0]]
    assert result(metrics.SparseCategoricalAccuracy(), sparse, probs) == 0.5
    assert result(
        metrics.SparseCategoricalAccuracy(), [2, 1], probs, sample_weight=[0.7, 0.3]
    ) == pytest.approx(0.3)


def test_regression_metrics_match_keras():
    y, p = [[0, 1], [0, 0]], [[1, 1], [0, 0]]
    assert result(metrics.MeanSquaredError(), y, p) == 0.25  # example errors 0.5, 0 -> mean 0.25
    assert result(metrics.MeanSquaredError(), y, p, sample_weight=[1, 0]) == 0.5
    assert result(metrics.MeanAbsoluteError(), y, p) == 0.25
    assert result(metrics.MeanAbsoluteError(), y, p, sample_weight=[1, 0]) == 0.5


def test_precision_and_recall_match_keras():
    y, p = [0, 1, 1, 1], [1, 0, 1, 1]
    # tp = 2 (positions 2, 3), fp = 1 (position 0), fn = 1 (position 1): 2/3 each.
    assert result(metrics.Precision(), y, p) == pytest.approx(2 / 3)
    assert result(metrics.Recall(), y, p) == pytest.approx(2 / 3)
    assert result(metrics.Precision(), y, p, sample_weight=[0, 0, 1, 0]) == 1.0
    assert result(metrics.Recall(), y, p, sample_weight=[0, 0, 1, 0]) == 1.0
    # top_k over the last axis (ties by index): top 2 are positions 0, 1, both negative -> 0.
    assert result(metrics.Precision(top_k=2), [0, 0, 1, 1], [1, 1, 1, 1]) == 0.0
    assert result(metrics.Precision(top_k=4), [0, 0, 1, 1], [1, 1, 1, 1]) == 0.5
    # Several thresholds give a vector: at 0.15 preds [.9,.2,.8,.1] -> [1,1,1,0]; at 0.85 -> [1,0,0,0].
    values = result(metrics.Precision(thresholds=[0.15, 0.85]), [0, 1, 1, 0], [0.9, 0.2, 0.8, 0.1])
    np.testing.assert_allclose(values, [2 / 3, 0.0])  # tp 2, fp 1; tp 0, fp 1
    # class_id scores one column: column 1 predicts [0.6 > .5, 0.2] vs labels [1, 1]: recall 1/2.
    assert result(metrics.Recall(class_id=1), [[0, 1], [0, 1]], [[0.4, 0.6], [0.8, 0.2]]) == 0.5


def test_auc_matches_keras():
    # Keras's docstring: thresholds [-1e-7, 0.5, 1+1e-7]; tp [2,1,0], fp [2,0,0], fn [0,1,2],
    # tn [0,2,2]; recall [1, .5, 0], fpr [1, 0, 0]; (1 - 0)(1 + .5)/2 + 0 = 0.75.
    y, p = [0, 0, 1, 1], [0, 0.5, 0.3, 0.9]
    assert result(metrics.AUC(num_thresholds=3), y, p) == pytest.approx(0.75)
    assert result(metrics.AUC(num_thresholds=3), y, p, sample_weight=[1, 0, 0, 1]) == pytest.approx(1.0)
    # Keras's tests, weights [1, 2, 3, 4]: tp [7,4,0], fp [3,0,0], fn [0,3,7], tn [0,3,3].
    w = [1, 2, 3, 4]
    # ROC: recall [1, 4/7, 0], fpr [1, 0, 0]: (1 + 4/7) / 2 = 0.7857.
    assert result(metrics.AUC(num_thresholds=3), y, p, sample_weight=w) == pytest.approx((1 + 4 / 7) / 2)
    assert result(
        metrics.AUC(num_thresholds=3, summation_method="majoring"), y, p, sample_weight=w
    ) == pytest.approx(1.0)
    assert result(
        metrics.AUC(num_thresholds=3, summation_method="minoring"), y, p, sample_weight=w
    ) == pytest.approx(4 / 7)
    # PR interpolation (Davis & Goadrich): P = [10, 4, 0], slope [0.5, 1], intercept [2, 0]:
    # (0.5 (3 + 2 ln 2.5) + 1 * 4) / 7 = 0.9166.
    assert result(metrics.AUC(num_thresholds=3, curve="pr"), y, p, sample_weight=w) == pytest.approx(
        (0.5 * (3 + 2 * np.log(2.5)) + 4) / 7, rel=1e-5
    )
    # PR majoring: precision [0.7, 1, 0], recall [1, 4/7, 0]: 1 * 3/7 + 1 * 4/7 = 1.
    assert result(
        metrics.AUC(num_thresholds=3, curve="PR", summation_method="majoring"), y, p, sample_weight=w
    ) == pytest.approx(1.0)
    # Logits: sigmoid first; 2-D inputs are flattened (Keras's multi_label=False).
    logits = np.log(np.array([0.01, 0.5, 0.3, 0.9]) / (1 - np.array([0.01, 0.5, 0.3, 0.9])))
    assert result(
        metrics.AUC(num_thresholds=3, from_logits=True), np.array(y)[:, None], logits[:, None]
    ) == pytest.approx(0.75)
    auc = metrics.AUC()
    assert auc.num_thresholds == 200 and auc.thresholds[1] == pytest.approx(1 / 199)
    assert float(auc.result()) == 0.0


def test_reset_state_zeroes_everything_and_is_refused_inside_run():
    for metric, args in [
        (metrics.Mean(), ([1.0, 2.0],)),
        (metrics.AUC(num_thresholds=5), ([0, 1], [0.2, 0.7])),
        (metrics.Precision(thresholds=[0.3, 0.6]), ([0, 1], [0.2, 0.7])),
    ]:
        metric.update_state(*args)
        metric.reset_state()
        np.testing.assert_array_equal(metric.result(), np.zeros_like(metric.result()))
        metric.update_state(*args)
        assert np.any(np.asarray(metric.result()) != 0)
    strategy = mirrax.MirroredStrategy(["cpu:0"])
    with pytest.raises(mirrax.errors.ReplicaContextError, match="reset_state.*outside strategy.run"):
        strategy.run(lambda m: m.reset_state(), args=(metrics.Mean(),))


def test_argument_errors_say_what_was_received():
    with pytest.raises(ValueError, match=r"thresholds must be .* in \[0, 1\]; received thresholds=1.5"):
        metrics.Precision(thresholds=1.5)
    with pytest.raises(ValueError, match="num_thresholds must be an integer > 1; received 1"):
        metrics.AUC(num_thresholds=1)
    with pytest.raises(ValueError, match="curve must be 'ROC' or 'PR'; received 'XY'"):
        metrics.AUC(curve="XY")
    with pytest.raises(ValueError, match="summation_method must be one of .*received 'avg'"):
        metrics.AUC(summation_method="avg")
    with pytest.raises(ValueError, match="float32 state; received dtype='float16'"):
        metrics.Mean(dtype="float16")
    with pytest.raises(
        ValueError, match=r"sample_weight of shape \(3,\) does not fit values of shape \(2,\)"
    ):
        metrics.Mean().update_state([1.0, 2.0], sample_weight=[1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match=r"y_true of shape \(2, 3\) does not fit .*CategoricalAccuracy"):
        metrics.SparseCategoricalAccuracy().update_state(np.eye(3)[:2], np.eye(3)[:2])


def test_get_resolves_accuracy_by_the_loss_as_keras():
    cases = [
        (losses.BinaryCrossentropy(), metrics.BinaryAccuracy),
        ("binary_crossentropy", metrics.BinaryAccuracy),
        (losses.CategoricalCrossentropy(), metrics.CategoricalAccuracy),
        (losses.SparseCategoricalCrossentropy(from_logits=True), metrics.SparseCategoricalAccuracy),
        ("sparse_categorical_crossentropy", metrics.SparseCategoricalAccuracy),
    ]
    for loss, cls in cases:
        for name in ("accuracy", "acc"):
            metric = metrics.get(name, loss=loss)
            assert type(metric) is cls and metric.name == name
    # With logits, "above 0.5 probability" is "logit above 0": predictions [-1, 0.3] -> [0, 1].
    logit_acc = metrics.get("accuracy", loss=losses.BinaryCrossentropy(from_logits=True))
    assert result(logit_acc, [0, 1], [-1.0, 0.3]) == 1.0


def test_get_accuracy_without_a_crossentropy_loss_follows_keras_3_shape_rule():
    def acc(y, p):
        return result(metrics.get("accuracy", loss="mse"), y, p)

    assert acc([[1], [0]], [[0.8], [0.6]]) == 0.5  # y_pred (batch, 1): binary, 0.6 -> 1 wrong
    assert acc([2, 0], [[0.1, 0.2, 0.7], [0.1, 0.8, 0.1]]) == 0.5  # lower rank labels: sparse
    assert acc([[0, 0, 1], [1, 0, 0]], [[0.1, 0.2, 0.7], [0.1, 0.8, 0.1]]) == 0.5  # categorical
    assert metrics.get("accuracy").name == "accuracy"


def test_get_resolves_names_and_refuses_unknown_ones():
    expected = {
        "precision": metrics.Precision,
        "recall": metrics.Recall,
        "auc": metrics.AUC,
        "AUC": metrics.AUC,
        "mse": metrics.MeanSquaredError,
        "MSE": metrics.MeanSquaredError,
        "mean_squared_error": metrics.MeanSquaredError,
        "mae": metrics.MeanAbsoluteError,
        "binary_accuracy": metrics.BinaryAccuracy,
        "Mean": metrics.Mean,
        "sparse_categorical_accuracy": metrics.SparseCategoricalAccuracy,
        "CategoricalAccuracy": metrics.CategoricalAccuracy,
    }
    for name, cls in expected.items():
        metric = metrics.get(name)
        assert type(metric) is cls and metric.name == name  # named by the string, as Keras 3
    auc = metrics.AUC(curve="PR")
    assert metrics.get(auc) is auc and metrics.get(None) is None

    def hits(y_true, y_pred):
        return (y_true == y_pred).astype("float32")

    wrapped = metrics.get(hits)
    assert isinstance(wrapped, metrics.MeanMetricWrapper) and wrapped.name == "hits"
    assert result(wrapped, np.array([1, 2, 3]), np.array([1, 0, 3])) == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="Unknown metric 'f1'. Known names: .*accuracy.*auc.*precision"):
        metrics.get("f1")
    with pytest.raises(mirrax.errors.MirraxError, match="Could not interpret metric identifier 7"):
        metrics.get(7)


# -- under every strategy: per-replica updates, SUM-aggregated state, masked padding -----------

_N_FULL, _N_PARTIAL, _CLASSES = 8, 5, 3


def _data():
    rng = np.random.default_rng(0)
    n = _N_FULL + _N_PARTIAL
    logits = rng.normal(size=(n, _CLASSES)).astype(np.float32)
    return {
        "labels": rng.integers(0, _CLASSES, n).astype(np.int32),
        "probs": np.exp(logits) / np.exp(logits).sum(-1, keepdims=True),
        "binary": rng.integers(0, 2, (n, 1)).astype(np.float32),
        "scores": rng.uniform(size=(n, 1)).astype(np.float32),
        "values": rng.normal(size=n).astype(np.float32),
        "weights": rng.uniform(0.5, 2.0, n).astype(np.float32),
    }


def _metrics():
    return {
        "mean": metrics.Mean(),
        "sum": metrics.Sum(),
        "sparse": metrics.SparseCategoricalAccuracy(),
        "categorical": metrics.CategoricalAccuracy(),
        "binary": metrics.BinaryAccuracy(),
        "precision": metrics.Precision(thresholds=[0.3, 0.5, 0.7]),
        "recall": metrics.Recall(),
        "auc": metrics.AUC(num_thresholds=50),
        "pr_auc": metrics.AUC(num_thresholds=50, curve="PR"),
        "mse": metrics.MeanSquaredError(),
    }


def _update(ms, batch):
    w = batch["weights"]
    ms["mean"].update_state(batch["values"], w)
    ms["sum"].update_state(batch["values"], w)
    ms["sparse"].update_state(batch["labels"], batch["probs"], w)
    onehot = (batch["labels"][:, None] == np.arange(_CLASSES)[None, :]).astype(np.float32)
    ms["categorical"].update_state(onehot, batch["probs"], w)
    for name in ("binary", "precision", "recall", "auc", "pr_auc"):
        ms[name].update_state(batch["binary"], batch["scores"], w)
    ms["mse"].update_state(batch["binary"], batch["scores"])


@pytest.mark.slow
def test_partial_batches_under_every_strategy_equal_the_unsplit_metrics(strategy):
    data = _data()
    # A full batch of 8, then a partial one of 5, padded to the first batch's per-replica size:
    # on 4 replicas the shards are 2,2,2,2 then 2,2,1,0 (+ 3 padding rows that must not count).
    batches = [{k: v[:_N_FULL] for k, v in data.items()}, {k: v[_N_FULL:] for k, v in data.items()}]
    distributed = _metrics()
    for batch in strategy.experimental_distribute_dataset(batches):
        strategy.run(_update, args=(distributed, batch))
    unsplit = _metrics()
    _update(unsplit, data)  # eagerly, outside every strategy, all 13 examples at once
    for name in unsplit:
        np.testing.assert_allclose(
            distributed[name].result(), unsplit[name].result(), rtol=2e-6, atol=1e-7, err_msg=name
        )
    # Every example counted once: the weight count is the sum of the 13 weights.
    assert float(distributed["mean"].count.get_value()) == pytest.approx(
        float(data["weights"].sum()), rel=1e-6
    )
    assert float(distributed["auc"].true_positives.get_value()[0]) == pytest.approx(
        float((data["weights"] * data["binary"][:, 0]).sum()), rel=1e-6
    )  # every positive above -1e-7


def test_confusion_counts_are_summed_not_per_replica_results_averaged(multi_strategy):
    # Replica-local precisions differ; the metric is the precision of the pooled counts.
    # 4 examples over R replicas; predictions all positive, labels [1, 0, 0, 0]: tp 1, fp 3 -> 0.25.
    labels = np.array([[1.0], [0.0], [0.0], [0.0]], np.float32)
    scores = np.full((4, 1), 0.9, np.float32)
    precision = metrics.Precision()
    batch = next(iter(multi_strategy.experimental_distribute_dataset((labels, scores))))
    multi_strategy.run(lambda m, b: m.update_state(*b), args=(precision, batch))
    assert float(precision.result()) == 0.25
    with multi_strategy.scope():  # cross-replica context: no replica context, eager update works
        precision.update_state(labels[:1], scores[:1])
    assert float(precision.result()) == pytest.approx(2 / 5)  # tp 2, fp 3
