"""What `mirrax launch` prints: its workers' lines, each after its worker's prefix and whole,
without Gloo's "is connected" noise, and its own messages. Standard library only."""

from __future__ import annotations

import re
import threading
from typing import TextIO

# Gloo (jax.distributed's CPU collectives) prints this C++ line once per worker and connection
# group, through the worker's own stdout/stderr: noise when every peer connected (it is kept
# when fewer peers connected than expected, which tells why a collective waits).
_GLOO_CONNECTED = re.compile(
    rb"\[Gloo\] Rank \d+ is connected to (\d+) peer ranks\. Expected number of connected peer "
    rb"ranks is : (\d+)\s*"
)
# Two threads of one worker may print that line at once, and the C++ stream interleaves the
# pieces ("[Gloo] Rank [Gloo] Rank 3 is connected to 3 peer ranks. ... : 23 is connected to 3"
# then " peer ranks. Expected ... : 3"): a line made only of those pieces is dropped too.
_GLOO_PIECES = re.compile(
    rb"\[Gloo\] Rank|is connected to|peer ranks\.|Expected number of connected peer ranks is :"
    rb"|\d+|\s+"
)
_GLOO_WORDS = re.compile(rb"\[Gloo\] Rank|is connected to|connected peer ranks")


class Output:
    """Whole lines to the launcher's streams, one at a time, flushed: never two half lines."""

    def __init__(self, stdout: TextIO, stderr: TextIO):
        self.stdout, self.stderr = stdout, stderr
        self._lock = threading.Lock()
        self._broken: set[int] = set()

    def line(self, stream: TextIO, text: str) -> None:
        with self._lock:
            if id(stream) in self._broken:
                return
            try:
                try:
                    stream.write(text + "\n")
                except UnicodeEncodeError:  # e.g. U+FFFD on an ASCII terminal
                    stream.write(text.encode("ascii", "backslashreplace").decode("ascii") + "\n")
                stream.flush()
            except (OSError, ValueError):
                # A closed stream (`mirrax launch ... | head`): keep draining the workers' pipes
                # so they never block, but write no more.
                self._broken.add(id(stream))

    def message(self, text: str) -> None:
        self.line(self.stderr, f"mirrax launch: {text}")


def relay_lines(pipe, prefix: str, output: Output, stream: TextIO) -> None:
    """Copies `pipe` (bytes) to `stream` line by line, each line after `prefix`, without Gloo's
    "is connected" lines (`_GLOO_CONNECTED`), whole or interleaved (`_GLOO_PIECES`)."""
    with pipe:
        for raw in iter(pipe.readline, b""):
            if raw.endswith(b"\n"):
                raw = raw[:-1]
            gloo = _GLOO_CONNECTED.fullmatch(raw)
            if gloo is not None and gloo[1] == gloo[2]:
                continue
            if gloo is None and _GLOO_WORDS.search(raw) and not _GLOO_PIECES.sub(b"", raw):
                continue
            output.line(stream, prefix + raw.decode("utf-8", errors="replace"))
