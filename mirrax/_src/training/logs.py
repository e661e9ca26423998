"""The logs of `Model`'s loops: the keys fit's epoch logs will hold, the loss tracker's and
metrics' values read as Python floats, and their reset between passes."""

from __future__ import annotations

import numpy as np

from mirrax._src.training import callbacks as callbacks_lib
from mirrax._src.training import metric_registry


def log_keys(model, compiled, validation: bool, callbacks: list):
    """The keys fit's epoch logs will hold (callbacks get them as params["metrics"]), or
    None when a callback of the user's own (or a LambdaCallback, whose functions are the
    user's) may add keys (as Keras's callbacks may write into the logs): the monitoring
    callbacks then look for their key at each epoch end."""
    if any(
        isinstance(c, callbacks_lib.LambdaCallback) or not type(c).__module__.startswith("mirrax.")
        for c in callbacks
    ):
        return None
    keys = metric_keys(model, compiled)
    if validation:
        keys += [f"val_{key}" for key in keys]
    if model.optimizer.has_learning_rate:
        keys.append("learning_rate")
    return keys


def metric_keys(model, compiled) -> list:
    """["loss", <output>_loss... (several outputs), <metric log keys>...]: one per metric, one
    per threshold of a several-threshold Precision / Recall (`metric_registry.log_names`)."""
    return (
        ["loss"]
        + _output_loss_names(compiled)
        + [
            key
            for name, metric in zip(compiled.metric_names, model.metrics)
            for key in metric_registry.log_names(name, metric)
        ]
    )


def metric_objects(model, compiled) -> dict:
    """{"loss": the loss tracker, <metric name>: metric} (`Model.metrics_state`)."""
    return {"loss": compiled.tracker, **dict(zip(compiled.metric_names, model.metrics))}


def reset_metrics(model, compiled):
    """Resets the loss tracker and every metric."""
    compiled.tracker.reset()
    for metric in model.metrics:
        metric.reset_state()


def logs_of(model, compiled) -> dict:
    """{"loss": ..., <metric>: ...} as Python floats (reading them waits for the last step); a
    several-threshold Precision / Recall gives one entry per threshold (`metric_registry.log_names`)."""
    logs = {"loss": float(compiled.tracker.result())}
    names = _output_loss_names(compiled)
    if names:
        logs.update(zip(names, (float(v) for v in np.asarray(compiled.tracker.output_results()))))
    for name, metric in zip(compiled.metric_names, model.metrics):
        logs.update(metric_registry.log_values(name, metric))
    return logs


def _output_loss_names(compiled) -> list:
    return [] if compiled.outputs is None else compiled.outputs.loss_log_names
