"""One run at a time per ``training.output_dir``: a lock file that rank 0 holds while the run writes there.

Two jobs training into one output folder (a job submitted twice, an array job with one ``output_dir``, a
job started again while its first copy still runs) would write over each other's checkpoints, ``latest``
and ``metrics.jsonl``. Rank 0 therefore holds ``<output_dir>/.stormshard-run.lock`` from before the run
writes its first file (the graph cache, ``config.json``) until it ends, with or without an error:

- the lock is created exclusively (``O_CREAT | O_EXCL``): of two runs starting at once, one gets it;
- it holds the holder's host, pid, SLURM job id (if any) and start time, as JSON;
- a daemon thread refreshes its modification time every :data:`REFRESH_S` seconds.

A lock is **stale**, and the new run takes it over, when its run cannot be alive: its process is gone (same
host, pid not running), it is this SLURM job's (a requeued job restarts under the same id), or it was not
refreshed for ``STORMSHARD_RUN_LOCK_STALE_S`` seconds (default 120: a run killed on another host). A
live lock is bad input: :meth:`RunLock.acquire` (which ``run_training`` runs on rank 0 through
:func:`~stormshard.training.rank_zero.rank_zero_first`, so every rank stops) raises an error naming the
holder and the fix before the run writes anything. Nothing is communicated here.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stormshard.env import VARIABLES
from stormshard.training.config import ConfigError

__all__ = ["LOCK_NAME", "REFRESH_S", "LockHolder", "RunLock", "live_holder"]

LOCK_NAME = ".stormshard-run.lock"
#: seconds between two refreshes of a held lock's modification time
REFRESH_S = 20.0
_STALE_VARIABLE = "STORMSHARD_RUN_LOCK_STALE_S"


@dataclass(frozen=True)
class LockHolder:
    """The run a lock file names, and how long ago it last refreshed the lock."""

    host: str
    pid: int
    job: str | None  # SLURM_JOB_ID
    started: float  # seconds since the epoch
    age_s: float  # since the last refresh

    def describe(self) -> str:
        job = f", SLURM job {self.job}" if self.job else ""
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"host {self.host}, pid {self.pid}{job}, started {started}, alive {self.age_s:.0f} s ago"


def _this_job() -> str | None:
    return os.environ.get("SLURM_JOB_ID") or None


def _read_holder(path: Path) -> LockHolder | None:
    """The holder ``path`` names; None when there is no lock. A lock that cannot be read (being written by a
    run starting this moment, or damaged) names an unknown holder, alive until it is stale by its age."""
    try:
        stat = path.stat()
    except OSError:
        return None
    age = max(time.time() - stat.st_mtime, 0.0)
    try:
        raw: Any = json.loads(path.read_text(encoding="utf-8"))
        return LockHolder(str(raw["host"]), int(raw["pid"]), raw.get("job") or None, float(raw["started"]), age)
    except (OSError, ValueError, KeyError, TypeError):
        return LockHolder("unknown", -1, None, stat.st_mtime, age)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def live_holder(output_dir: str | os.PathLike) -> LockHolder | None:
    """The run that holds ``output_dir``'s lock and may be alive; None when there is no lock or it is stale
    (module docstring)."""
    holder = _read_holder(Path(output_dir) / LOCK_NAME)
    if holder is None:
        return None
    if holder.host == socket.gethostname() and (holder.pid == os.getpid() or not _process_alive(holder.pid)):
        return None  # gone, or this very process (an earlier run in it ended without its release)
    if holder.job is not None and holder.job == _this_job():
        return None  # this SLURM job, requeued
    if holder.age_s > float(VARIABLES[_STALE_VARIABLE].read()):
        return None
    return holder


def _held_error(output_dir: Path, holder: LockHolder) -> ConfigError:
    stale = VARIABLES[_STALE_VARIABLE].read()
    return ConfigError(
        f"training.output_dir={str(output_dir)!r} is in use by another run ({holder.describe()}): two runs in "
        f"one output_dir would overwrite each other's checkpoints and metrics. Wait for it to end, or set another "
        f"training.output_dir; if that run is dead, delete {output_dir / LOCK_NAME} (a lock not refreshed for "
        f"{stale:g} s, {_STALE_VARIABLE}, counts as dead); nothing was started")


class RunLock:
    """The lock of ``output_dir``, held from :meth:`acquire` to :meth:`release` (also a context manager)."""

    def __init__(self, output_dir: str | os.PathLike) -> None:
        self.output_dir = Path(output_dir)
        self.path = self.output_dir / LOCK_NAME
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._created_dir = False
        self.held = False

    def acquire(self) -> RunLock:
        """Create the lock (taking over a stale one), then refresh it in the background; a
        :class:`~stormshard.training.config.ConfigError` when a run that may be alive holds it."""
        self._created_dir = not self.output_dir.exists()
        self.output_dir.mkdir(parents=True, exist_ok=True)
        record = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "job": _this_job(),
                             "started": time.time()}).encode()
        for _ in range(2):  # a second try after removing a stale lock
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = live_holder(self.output_dir)
                if holder is not None:
                    self._remove_created_dir()
                    raise _held_error(self.output_dir, holder) from None
                self.path.unlink(missing_ok=True)  # stale: taken over
                continue
            with os.fdopen(fd, "wb") as f:
                f.write(record)
            self.held = True
            break
        else:
            self._remove_created_dir()
            raise ConfigError(f"training.output_dir={str(self.output_dir)!r}: its lock {self.path} was taken by "
                              "another run starting at the same moment: set another training.output_dir")
        self._thread = threading.Thread(target=self._refresh, name="stormshard-run-lock", daemon=True)
        self._thread.start()
        return self

    def _refresh(self) -> None:
        while not self._stop.wait(REFRESH_S):
            try:
                os.utime(self.path)
            except OSError:  # removed by hand: nothing to refresh
                return

    def release(self) -> None:
        """Stop refreshing and remove the lock (and the output folder, when acquiring made it and it is empty);
        nothing when it is not held (another run's lock stays)."""
        if not self.held:
            return
        self.held = False
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.path.unlink(missing_ok=True)
        self._remove_created_dir()

    def _remove_created_dir(self) -> None:
        if self._created_dir and self.output_dir.is_dir() and not any(self.output_dir.iterdir()):
            self.output_dir.rmdir()

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
