"""Keras-style terminal output: the `Progbar` progress bar and `print_msg`, used by callbacks.

The bar looks like tf.keras 2's, the line the issue quotes:

    782/782 [==============================] - 15s 18ms/step - loss: 1.2345 - accuracy: 0.5678

On a terminal (a stream whose `isatty()` is true, or a Jupyter kernel) the bar is redrawn in
place with a carriage return after each update. Anywhere else (a log file, a pipe, CI) only the
final line is written, once, with no carriage returns, so logs stay readable. Output goes to
`sys.stdout` as it is at the time of writing (so `contextlib.redirect_stdout` and pytest's
capture work), or to the stream given.

In a multi-worker run only the chief (process 0) prints; the other workers' lines go to the
`mirrax` logger at DEBUG level (`logging.getLogger("mirrax").setLevel(logging.DEBUG)` with a
handler shows them), as Keras prints on the chief only.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Iterable
from typing import TextIO

import jax

# The clock the bar reads (seconds); a module attribute so tests can stand in an exact one.
clock = time.monotonic


class _WorkerLog:
    """The output stream of a non-chief worker: complete lines go to the logger at DEBUG."""

    def __init__(self):
        self._pending = ""

    def write(self, text: str) -> int:
        lines = (self._pending + text).replace("\r", "\n").split("\n")
        self._pending = lines.pop()
        logger = logging.getLogger("mirrax")
        for line in lines:
            if line.strip():
                logger.debug("[worker %d] %s", _process_index(), line)
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


def _process_index() -> int:
    return jax.process_index()


def default_stream() -> TextIO:
    """The current `sys.stdout` on the chief; the DEBUG log on the other workers."""
    return sys.stdout if _process_index() == 0 else _WorkerLog()


def print_msg(message: str, stream: TextIO | None = None) -> None:
    """Writes `message` and a newline to `stream` (default: `default_stream()`), flushed.

    As Keras's `io_utils.print_msg`: callbacks print their messages ("Epoch 3: early
    stopping") through it.
    """
    stream = stream if stream is not None else default_stream()
    stream.write(message + "\n")
    stream.flush()


def is_interactive(stream: TextIO) -> bool:
    """True when `stream` redraws a line on a carriage return: a TTY, or Jupyter's stdout."""
    isatty = getattr(stream, "isatty", None)
    try:
        if isatty is not None and isatty():
            return True
    except ValueError:  # a closed stream
        return False
    return stream is sys.stdout and _in_jupyter_kernel()


def _in_jupyter_kernel() -> bool:
    # ipykernel imported is not enough (a program may import it without being a kernel): the
    # running IPython shell must be a kernel's.
    ipython = sys.modules.get("IPython")
    if "ipykernel" not in sys.modules or ipython is None:
        return False
    shell = ipython.get_ipython()
    return shell is not None and hasattr(shell, "kernel")


def format_value(value) -> str:
    """A log value as Keras prints it: `%.4f` when |value| > 1e-3, else `%.4e`; nan as `nan`.

    Values that are not numbers (strings) are printed with `str`.
    """
    try:
        number = float(value)
    except (TypeError, ValueError):
        return str(value)
    if abs(number) > 1e-3:
        return f"{number:.4f}"
    return f"{number:.4e}"  # also nan: abs(nan) > 1e-3 is False, and "%.4e" % nan is "nan"


def format_time_per_unit(seconds: float, unit_name: str) -> str:
    """`" 18ms/step"`: a duration per unit in s, ms or us, as Keras's `Progbar._format_time`."""
    if seconds >= 1 or seconds == 0:
        return f" {seconds:.0f}s/{unit_name}"
    if seconds >= 1e-3:
        return f" {seconds * 1e3:.0f}ms/{unit_name}"
    return f" {seconds * 1e6:.0f}us/{unit_name}"


def _format_eta(seconds: float) -> str:
    if seconds > 3600:
        return f"{int(seconds // 3600)}:{int((seconds % 3600) // 60):02d}:{int(seconds % 60):02d}"
    if seconds > 60:
        return f"{int(seconds // 60)}:{int(seconds % 60):02d}"
    return f"{int(seconds)}s"


def _is_number(value) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True


class Progbar:
    """A progress bar, as `keras.utils.Progbar` (tf.keras 2's look).

    Args:
      target: total number of steps expected, or None when unknown (the bar then shows the
        count so far: `     13/Unknown - 2s 150ms/step - loss: ...`). An update past the target
        is shown as unknown too, never as e.g. `13/5`.
      width: width of the bar in characters (30, as tf.keras 2).
      verbose: 0 silent, 1 a live bar (final line only when not on a terminal), 2 one line
        when finalized.
      interval: minimum time between two redraws of the live bar, in seconds.
      stateful_metrics: names whose values are shown as given. The others are averaged over
        the steps by the bar, as Keras. At most one of `stateful_metrics` and
        `stateless_metrics` may be given.
      stateless_metrics: names that are averaged; every other name is shown as given. Pass
        `()` to show every value as given (what `ProgbarLogger` does: fit's logs are already
        running means over the epoch).
      unit_name: name of a step in the time per step (`"step"`).
      stream: where to write; None means `default_stream()` at each write (the current
        `sys.stdout` on the chief).

    Raises:
      ValueError: both `stateful_metrics` and `stateless_metrics` given, or `verbose` not 0, 1
        or 2.
    """

    def __init__(
        self,
        target: int | None,
        width: int = 30,
        verbose: int = 1,
        interval: float = 0.05,
        stateful_metrics: Iterable[str] | None = None,
        stateless_metrics: Iterable[str] | None = None,
        unit_name: str = "step",
        stream: TextIO | None = None,
    ):
        if stateful_metrics is not None and stateless_metrics is not None:
            raise ValueError(
                "Progbar: pass either stateful_metrics (names shown as given, the others "
                "averaged) or stateless_metrics (names averaged, the others shown as given), "
                f"not both; received stateful_metrics={stateful_metrics!r} and "
                f"stateless_metrics={stateless_metrics!r}."
            )
        if verbose not in (0, 1, 2):
            raise ValueError(
                f"Progbar: verbose must be 0 (silent), 1 (live bar) or 2 (one line); received "
                f"verbose={verbose!r}."
            )
        self.target = target
        self.width = width
        self.verbose = verbose
        self.interval = interval
        self.unit_name = unit_name
        self.stream = stream
        self._stateful = set(stateful_metrics) if stateful_metrics is not None else None
        self._stateless = set(stateless_metrics) if stateless_metrics is not None else None
        self._values: dict = {}  # name -> [sum of value * steps, steps]
        self._values_order: list = []
        self._seen_so_far = 0
        self._start = clock()
        self._last_update = None
        self._time_after_first_step = None
        self._prev_width = 0

    def _averaged(self, name: str) -> bool:
        if self._stateless is not None:
            return name in self._stateless
        return name not in (self._stateful or ())

    def update(self, current: int, values=None, finalize: bool | None = None) -> None:
        """Shows progress at step `current` (steps done so far, 1-based).

        Args:
          current: number of steps done.
          values: `(name, value)` pairs or a dict; averaged over steps unless stateful.
          finalize: whether this is the last update (prints the final line); default
            `current >= target` (False when the target is unknown).
        """
        if finalize is None:
            finalize = self.target is not None and current >= self.target
        items = values.items() if isinstance(values, dict) else (values or [])
        for name, value in items:
            if name not in self._values_order:
                self._values_order.append(name)
            if self._averaged(name) and not finalize and _is_number(value):
                weight = max(current - self._seen_so_far, 1)
                total = self._values.setdefault(name, [0.0, 0])
                total[0] += value * weight
                total[1] += weight
            else:
                self._values[name] = [value, 1]
        self._seen_so_far = current

        now = clock()
        time_per_unit = self._estimate_step_duration(current, now)
        if self.verbose == 0:
            return
        stream = self.stream if self.stream is not None else default_stream()
        if self.verbose == 1 and is_interactive(stream):
            if not finalize and self._last_update is not None and now - self._last_update < self.interval:
                return
            line = self._line(current, now, time_per_unit, finalize, with_bar=True)
            padding = " " * max(self._prev_width - len(line), 0)
            stream.write("\r" + line + padding + ("\n" if finalize else ""))
            stream.flush()
            self._prev_width = len(line)
            self._last_update = now
        elif finalize:
            line = self._line(current, now, time_per_unit, True, with_bar=self.verbose == 1)
            stream.write(line + "\n")
            stream.flush()
            self._last_update = now

    def add(self, n: int, values=None) -> None:
        """Advances the bar by `n` steps (as `keras.utils.Progbar.add`)."""
        self.update(self._seen_so_far + n, values)

    def _line(self, current: int, now: float, time_per_unit: float, finalize: bool, with_bar: bool) -> str:
        target = self.target
        known = target is not None and 0 < target and current <= target
        if known:
            assert target is not None  # known says so (a bool mypy does not follow)
            digits = int(math.log10(target)) + 1
            line = f"{current:{digits}d}/{target}"
            if with_bar:
                done = int(self.width * current / target)
                bar = ""
                if done > 0:
                    bar = "=" * (done - 1) + (">" if current < target else "=")
                line += " [" + bar + "." * (self.width - done) + "]"
        else:
            line = f"{current:7d}/Unknown"
        if known and not finalize:
            assert target is not None
            line += " - ETA: " + _format_eta(time_per_unit * (target - current))
        else:
            line += f" - {now - self._start:.0f}s" + format_time_per_unit(time_per_unit, self.unit_name)
        for name in self._values_order:
            total, count = self._values[name]
            try:
                shown = format_value(total / max(1, count))
            except TypeError:  # a value that is not a number
                shown = str(total)
            line += f" - {name}: {shown}"
        return line

    def _estimate_step_duration(self, current: int, now: float) -> float:
        # As Keras: the first step (compilation) is left out once later steps are known.
        if not current:
            return 0.0
        if self._time_after_first_step is not None and current > 1:
            per_unit = (now - self._time_after_first_step) / (current - 1)
        else:
            per_unit = (now - self._start) / current
        if current == 1:
            self._time_after_first_step = now
        return per_unit
