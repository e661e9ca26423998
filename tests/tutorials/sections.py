"""Runs a ported tutorial's sections in order, once, and keeps each section's outcome.

A tutorial is one program: later sections use what earlier ones made (the model, the
strategy, the checkpoint). The port runs every section in one namespace, in the notebook's
order, catching each section's error so that the others still run; one test per section then
reads its outcome (`result`) and asserts what the tutorial states. A section that failed
re-raises its own error in its test (so an xfail's reason can be checked against it), and a
section that needs an earlier one that failed fails too, naming it.

The multi-worker ports run the same way in every worker process (`run_all` + `write`): each
worker writes its outcomes to `<out_dir>/<task index>.json` after every section, so a worker
that dies or hangs later still reports the sections it finished.
"""

from __future__ import annotations

import json
import os
import time
import traceback
import types


class SectionError(AssertionError):
    """A section raised: its error type, message and traceback (from this process or a worker)."""


class Tutorial:
    """The sections of one tutorial, registered in notebook order with `@tutorial.section`."""

    def __init__(self):
        self.sections: list = []

    def section(self, fn):
        self.sections.append(fn)
        return fn

    def run_all(self, ns: types.SimpleNamespace | None = None, on_result=None) -> dict:
        """Runs every section `fn(ns)` in order; {section name: outcome dict}.

        An outcome is {"ok": True, "values": what fn returned} or {"ok": False, "error": "Type:
        message", "traceback": ...}, each with its "seconds". `on_result(outcomes)` is called
        after each section.
        """
        ns = ns if ns is not None else types.SimpleNamespace()
        outcomes: dict = {}
        for fn in self.sections:
            start = time.monotonic()
            try:
                outcomes[fn.__name__] = {"ok": True, "values": fn(ns)}
            except Exception as e:  # noqa: BLE001 - recorded, raised again by the section's test
                outcomes[fn.__name__] = {
                    "ok": False,
                    "error": f"{type(e).__name__}: {e}",
                    "traceback": traceback.format_exc()[-4000:],
                }
            outcomes[fn.__name__]["seconds"] = round(time.monotonic() - start, 2)
            if on_result is not None:
                on_result(outcomes)
        return outcomes


def result(outcomes: dict, name: str):
    """The values section `name` returned; raises its error when it failed or never ran."""
    if name not in outcomes:
        raise SectionError(
            f"section {name!r} never ran (the process stopped before it); ran: {sorted(outcomes)}"
        )
    outcome = outcomes[name]
    if not outcome["ok"]:
        raise SectionError(f"section {name!r} raised {outcome['error']}\n{outcome['traceback']}")
    return outcome["values"]


def write(out_dir: str, index: int, outcomes: dict) -> None:
    """Writes a worker's outcomes to <out_dir>/<index>.json atomically (rename)."""
    path = os.path.join(out_dir, f"{index}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(outcomes, f, default=repr)
    os.replace(path + ".tmp", path)


def read(out_dir: str, count: int) -> list:
    """The outcomes of workers 0..count-1 ({} for a worker that wrote none)."""
    found = []
    for index in range(count):
        path = os.path.join(out_dir, f"{index}.json")
        found.append(json.load(open(path)) if os.path.exists(path) else {})
    return found
