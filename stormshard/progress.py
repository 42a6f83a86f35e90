"""Progress a person can follow: a line per phase of long work, and a plain periodic training line.

Two tools, for every layer (this module imports nothing from stormshard):

- **phase lines** for work that takes more than a few seconds (graph building, checkpoint
  conversion, forecasting). Library code marks its phases with :func:`phase` and :func:`note`;
  they print only inside :func:`reporting`, which an entry point (or a caller that passes
  ``progress=True``) turns on, on rank 0. Elsewhere, in tests and in library use, they cost
  nothing and print nothing::

      with reporting():                        # launch/convert_checkpoint.py, rank 0
          with phase("consolidate: read 8 rank files"):
              ...                              # -> "consolidate: read 8 rank files (3.1 s)"
          note("forecast: step 3/8", throttle=True)  # at most one such line per THROTTLE_S seconds

- :class:`PeriodicLine`, the training progress when the output is not a terminal (a log file,
  a batch job): instead of a progress bar's ``\\r`` frames, one plain line every ``every_s``
  seconds: ``step 120/300 (40%) | loss 0.1234 | 45.6 samples/s | elapsed 0:01:02 | ETA 0:01:33``.

Every line goes to standard error (where the entry points' ``error:`` lines and the training log
go), so standard output keeps only results (``inspect --json``, the scores table).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TextIO

__all__ = ["THROTTLE_S", "PeriodicLine", "active", "format_duration", "note", "phase", "reporting"]

#: seconds between two throttled :func:`note` lines (per-step lines of a fast forecast stay quiet)
THROTTLE_S = 5.0


class _Reporter:
    def __init__(self, stream: TextIO | None) -> None:
        self.stream = stream
        self.last_line = -math.inf

    def line(self, text: str) -> None:
        print(text, file=self.stream or sys.stderr, flush=True)
        self.last_line = time.monotonic()


_REPORTER: ContextVar[_Reporter | None] = ContextVar("stormshard_progress", default=None)


@contextmanager
def reporting(enabled: bool = True, stream: TextIO | None = None) -> Iterator[None]:
    """Print the :func:`phase` and :func:`note` lines of the code inside (to ``stream``, default
    standard error). ``enabled=False`` changes nothing (an outer ``reporting`` still prints), so
    ``with reporting(progress and rank == 0):`` is the usual form."""
    if not enabled or _REPORTER.get() is not None:
        yield
        return
    token = _REPORTER.set(_Reporter(stream))
    try:
        yield
    finally:
        _REPORTER.reset(token)


def active() -> bool:
    """Whether progress lines print here (inside an enabled :func:`reporting`)."""
    return _REPORTER.get() is not None


def note(text: str, *, throttle: bool = False) -> None:
    """Print ``text`` when reporting; with ``throttle``, only when the last line is THROTTLE_S old."""
    reporter = _REPORTER.get()
    if reporter is None or (throttle and time.monotonic() - reporter.last_line < THROTTLE_S):
        return
    reporter.line(text)


@contextmanager
def phase(what: str, done: Callable[[], str] | None = None) -> Iterator[None]:
    """Time the block and, when reporting, print ``what (1.2 s)`` at its end (``what: <done()> (1.2 s)``
    with ``done``, e.g. a count known only afterwards). Nothing is printed when the block fails."""
    if _REPORTER.get() is None:
        yield
        return
    start = time.perf_counter()
    yield
    extra = f": {done()}" if done is not None else ""
    note(f"{what}{extra} ({format_duration(time.perf_counter() - start)})")


def format_duration(seconds: float) -> str:
    """``0.42 s``, ``12.3 s``, ``1:02`` (minutes), ``1:02:03`` (hours)."""
    if not math.isfinite(seconds):
        return "?"
    if seconds < 10:
        return f"{seconds:.2f} s" if seconds < 1 else f"{seconds:.1f} s"
    if seconds < 60:
        return f"{seconds:.0f} s"
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class PeriodicLine:
    """Training progress for a log file: :meth:`update` after each logged step returns (and prints)
    one plain line at the first update, then whenever ``every_s`` seconds have passed since the
    last line, and at the last step; ``None`` otherwise.

    samples/s is over the steps since the previous line; the ETA is the remaining steps at the mean
    step time since this object was made (steps before ``initial`` — a resumed run's — excluded).
    """

    def __init__(self, total: int | None, initial: int = 0, every_s: float = 30.0, stream: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not every_s > 0:
            raise ValueError(f"every_s must be positive, got {every_s}")
        self.total, self.initial, self.every_s = total, initial, every_s
        self.stream, self.clock = stream, clock
        self.start = self.last_time = clock()
        self.last_line: float | None = None
        self.samples = 0

    def update(self, step: int, loss: float | None = None, samples: int | None = None) -> str | None:
        now = self.clock()
        self.samples += samples or 0
        last = self.total is not None and step >= self.total
        if self.last_line is not None and now - self.last_line < self.every_s and not last:
            return None
        parts = [f"step {step}/{self.total} ({100 * step / self.total:.0f}%)" if self.total else f"step {step}"]
        if loss is not None:
            parts.append(f"loss {loss:.4g}")
        if self.samples and now > self.last_time:
            parts.append(f"{self.samples / (now - self.last_time):.4g} samples/s")
        parts.append(f"elapsed {format_duration(now - self.start)}")
        done = step - self.initial
        if self.total is not None and not last and done > 0:
            parts.append(f"ETA {format_duration((self.total - step) * (now - self.start) / done)}")
        text = " | ".join(parts)
        print(text, file=self.stream or sys.stderr, flush=True)
        self.last_line, self.last_time, self.samples = now, now, 0
        return text
