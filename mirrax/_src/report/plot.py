"""The scaling report's plot: predicted speedup against replicas, with the ideal line, as a PNG,
SVG or PDF (the format the file's suffix names). matplotlib is optional (`pip install
mirrax[plot]`): imported only when a plot is drawn, through its object interface (no pyplot),
so the caller's matplotlib state is left alone."""

from __future__ import annotations

import importlib.util
import os

from mirrax import errors

# What matplotlib's savefig writes from a suffix, for every backend it ships (Agg, SVG, PDF).
FORMATS = ("png", "svg", "pdf")


def plot_format(path) -> str:
    """The format `path`'s suffix names ("png", "svg" or "pdf"; any case: "x.PNG" is "png").

    Raises:
      InvalidArgumentError: any other suffix, or none: a file named "out.txt" would hold PNG
        bytes under a name no viewer opens as an image.
    """
    suffix = os.path.splitext(os.fspath(path))[1]
    if suffix[1:].lower() not in FORMATS:
        stem = os.path.splitext(os.fspath(path))[0]
        found = f"suffix {suffix!r}" if suffix else "no suffix"
        raise errors.InvalidArgumentError(
            f"plot: the file's suffix names its format, one of "
            f"{', '.join('.' + f for f in FORMATS)}; received {os.fspath(path)!r} ({found}). "
            f"Name the file e.g. {stem + '.png'!r}."
        )
    return suffix[1:].lower()


def check_path(path) -> None:
    """Refuses, before any work, a plot that could not be written.

    Raises:
      InvalidArgumentTypeError: `path` is not a str or os.PathLike.
      InvalidArgumentError: its suffix is not .png, .svg or .pdf (`plot_format`).
      MissingFolderError: the folder of `path` does not exist.
      ExistingPathError: `path` is a folder.
      MissingDependencyError: matplotlib is not installed.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise errors.InvalidArgumentTypeError(
            f"plot: path must be a file path (str or os.PathLike) for the PNG; received "
            f"{type(path).__name__}."
        )
    if os.path.isdir(path):
        raise errors.ExistingPathError(
            f"plot: {os.fspath(path)!r} is a folder; give the path of the PNG file to write, "
            f"e.g. {os.path.join(os.fspath(path), 'speedup.png')!r}."
        )
    plot_format(path)
    folder = os.path.dirname(os.path.abspath(os.fspath(path)))
    if not os.path.isdir(folder):
        raise errors.MissingFolderError(
            f"plot: the folder {folder} of {os.fspath(path)!r} does not exist. Create it, or "
            "give a path in an existing folder."
        )
    if importlib.util.find_spec("matplotlib") is None:
        raise errors.MissingDependencyError(
            "plot: drawing the speedup needs matplotlib, which is not installed. Install it "
            "with `pip install mirrax[plot]` (or `pip install matplotlib`), or drop the plot "
            "(--plot) and read the table."
        )


def write_speedup(report, path) -> None:
    """Draws `report`'s predicted speedup (and the ideal, N) against replicas into `path`, in
    the format its suffix names (.png, .svg or .pdf), as matplotlib's `savefig` does.

    Raises:
      As `check_path`.
    """
    check_path(path)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    replicas = [row.replicas for row in report.rows]
    figure = Figure(figsize=(6, 4), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    axes.plot(replicas, replicas, "--", color="gray", label="ideal (N)")
    axes.plot(replicas, [row.speedup for row in report.rows], "o-", label=f"predicted, {report.link.name}")
    extrapolated = [row for row in report.rows if row.source != "compiled"]
    if extrapolated:
        axes.plot(
            [row.replicas for row in extrapolated],
            [row.speedup for row in extrapolated],
            "o",
            markerfacecolor="white",
            color="C0",
            label="from an extrapolated program",
        )
    axes.set_xscale("log", base=2)
    axes.set_xticks(replicas, [str(n) for n in replicas])
    axes.set_xlabel("replicas (per-replica batch fixed)")
    axes.set_ylabel("speedup over one device")
    axes.set_title(report.step, fontsize=9)
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(os.fspath(path), format=plot_format(path))
