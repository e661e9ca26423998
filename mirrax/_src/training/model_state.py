"""The state `fit` keeps besides the module and the optimizer, as `Model` methods (the
`TrainingState` base class): the loss tracker and the metrics (reset, results, names, the
objects) and the NumPy generator that shuffles array inputs."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from mirrax._src.training import logs as logs_lib
from mirrax._src.training import steps as steps_lib


class TrainingState:
    """`reset_metrics`, `get_metrics_result`, `metrics_names`, `metrics_state` and
    `shuffle_rng` of `mirrax.Model`."""

    _compiled: steps_lib.CompiledState | None
    _check_compiled: Callable[[str], None]  # Model's: raises NotCompiledError

    def reset_metrics(self) -> None:
        """Resets the loss tracker and every metric, as `keras.Model.reset_metrics`."""
        self._check_compiled("reset_metrics")
        logs_lib.reset_metrics(self, self._compiled)

    def get_metrics_result(self) -> dict:
        """{"loss": ..., <metric name>: ...} as Python floats, as `keras.Model.get_metrics_result`
        (what fit logs; reading it waits for the last step)."""
        self._check_compiled("get_metrics_result")
        return logs_lib.logs_of(self, self._compiled)

    @property
    def metrics_state(self) -> dict:
        """{"loss": the loss tracker, <metric name>: the metric}: the NNX objects fit's logs are
        read from (Keras 3's `metrics_variables`, as objects), e.g. for a `mirrax.Checkpoint`
        (BackupAndRestore backs them up); {} before compile."""
        return {} if self._compiled is None else logs_lib.metric_objects(self, self._compiled)

    @property
    def metrics_names(self) -> list:
        """["loss", <metric log names>...] as `evaluate` lists them (tf.keras's); [] uncompiled."""
        return [] if self._compiled is None else logs_lib.metric_keys(self, self._compiled)

    @property
    def shuffle_rng(self) -> np.random.Generator | None:
        """The NumPy generator that orders array inputs (and a PyDataset's batches) in
        `fit(shuffle=True)`, one permutation per epoch; seeded with 0 at `compile`, so a fit
        after compile shuffles alike in every run and on every worker (Keras draws from the
        global RNG). BackupAndRestore backs up its state. None before compile."""
        return None if self._compiled is None else self._compiled.rng
