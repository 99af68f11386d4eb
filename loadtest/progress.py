"""A one-line progress bar on stderr; no dependency, redrawn at most ten times a second."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, total: int, label: str, *, stream: TextIO | None = None, width: int = 30) -> None:
        self.total = max(1, total)
        self.label = label
        self.done = 0
        self.errors = 0
        self._stream = stream if stream is not None else sys.stderr
        self._width = width
        self._start = time.monotonic()
        self._drawn_at = 0.0
        self._enabled = self._stream.isatty() if stream is None else True

    def advance(self, *, error: bool = False) -> None:
        self.done += 1
        self.errors += int(error)
        now = time.monotonic()
        if self.done >= self.total or now - self._drawn_at >= 0.1:
            self._drawn_at = now
            self._draw(now)

    def close(self) -> None:
        self._draw(time.monotonic())
        if self._enabled:
            self._stream.write("\n")
            self._stream.flush()

    def _draw(self, now: float) -> None:
        if not self._enabled:
            return
        filled = int(self._width * min(self.done, self.total) / self.total)
        bar = "#" * filled + "." * (self._width - filled)
        errors = f" {self.errors} errors" if self.errors else ""
        self._stream.write(f"\r{self.label:<24} [{bar}] {self.done}/{self.total} {now - self._start:6.1f}s{errors}")
        self._stream.flush()
