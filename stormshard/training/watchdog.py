"""Name the rank that died: per-rank heartbeats in the rendezvous store.

When a rank is killed (out of memory, a node failure, ``kill -9``) the other ranks see only a
transport error ("Connection closed by peer", an NCCL timeout) that does not say which rank went
away. :class:`RankMonitor` runs one daemon thread per rank that writes ``time.time()`` to the key
``stormshard/heartbeat/<rank>`` of the job's rendezvous store (``MASTER_ADDR:MASTER_PORT``, its own
client connection) every ``interval`` seconds: one small store write per rank per interval,
nothing on the training path. When a collective fails, :meth:`RankMonitor.explain` waits until some
rank's heartbeat is older than ``dead_after`` seconds (or the store itself, hosted by rank 0, is
unreachable) and returns a :class:`RankFailure` naming those ranks, their hosts and pids.

Settings (environment): ``STORMSHARD_HEARTBEAT_S`` (interval, default 1; 0 turns the monitor off)
and ``STORMSHARD_DEAD_AFTER_S`` (default 10).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

from stormshard.env import VARIABLES, EnvError
from stormshard.errors import ReportedByRank

__all__ = ["RankFailure", "RankMonitor", "monitor_settings"]

_PREFIX = "stormshard/heartbeat/"
_FAILED = "stormshard/failed/"


class RankFailure(ReportedByRank):
    """One or more ranks stopped during the run; the message names them.

    ``dead`` holds their ranks; ``reporter`` is the lowest surviving rank (the one that prints).
    """

    def __init__(self, message: str, dead: tuple[int, ...], reporter: int) -> None:
        super().__init__(message, reporter)
        self.dead = dead


@dataclass(frozen=True)
class _Beat:
    time: float
    host: str
    pid: int


def monitor_settings(env: Mapping[str, str] | None = None) -> tuple[float, float]:
    """``(interval, dead_after)`` seconds from ``STORMSHARD_HEARTBEAT_S`` / ``STORMSHARD_DEAD_AFTER_S``
    (:mod:`stormshard.env`: finite, not negative; an :class:`~stormshard.env.EnvError` names the variable)."""
    interval = float(VARIABLES["STORMSHARD_HEARTBEAT_S"].read(env))
    dead_after = float(VARIABLES["STORMSHARD_DEAD_AFTER_S"].read(env))
    if interval > 0 and dead_after <= 2 * interval:
        raise EnvError(f"STORMSHARD_DEAD_AFTER_S={dead_after:g} must exceed twice STORMSHARD_HEARTBEAT_S={interval:g}: "
                       f"raise STORMSHARD_DEAD_AFTER_S above {2 * interval:g} or lower the heartbeat")
    return interval, dead_after


class RankMonitor:
    """Heartbeats of every rank in the rendezvous store at ``host:port`` (see the module docstring)."""

    def __init__(self, rank: int, world: int, host: str, port: int, interval: float = 1.0,
                 dead_after: float = 10.0) -> None:
        import torch.distributed as dist

        self.rank, self.world, self.host, self.port = rank, world, host, port
        self.interval, self.dead_after = interval, dead_after
        self._store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=max(2.0, interval * 2)),
                                    wait_for_workers=False)
        self._lock = threading.Lock()  # one request at a time on this client
        self._stop = threading.Event()
        self._me = {"host": socket.gethostname(), "pid": os.getpid()}
        self._beat()
        self._thread = threading.Thread(target=self._run, name="stormshard-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        with self._lock:
            self._store.set(f"{_PREFIX}{self.rank}", json.dumps({"time": time.time(), **self._me}))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._beat()
            except Exception:  # noqa: BLE001 - the store may be gone; explain() reports it
                pass

    def report_failed(self) -> None:
        """Mark this rank as ending on its own error (it reports it), so that the others do not name
        it as a rank that died."""
        self.stop()
        try:
            with self._lock:
                self._store.set(f"{_FAILED}{self.rank}", "1")
        except Exception:  # noqa: BLE001 - the store may be gone
            pass

    def stop(self) -> None:
        """End the heartbeat thread (call on every rank before the process group is destroyed)."""
        self._stop.set()
        self._thread.join(timeout=self.interval * 2 + 1)

    def _read(self) -> dict[int, _Beat]:
        beats: dict[int, _Beat] = {}
        with self._lock:
            for r in range(self.world):
                key = f"{_PREFIX}{r}"
                if self._store.check([f"{_FAILED}{r}"]):
                    beats[r] = _Beat(float("inf"), "", -1)  # it ended on its own error and reports it
                elif self._store.check([key]):
                    raw = json.loads(self._store.get(key))
                    beats[r] = _Beat(float(raw["time"]), str(raw["host"]), int(raw["pid"]))
        return beats

    def explain(self, wait: float | None = None) -> RankFailure | None:
        """After a failed collective: the ranks whose heartbeat stopped, or None if every rank still
        beats after ``wait`` seconds (default ``dead_after + 2 * interval``)."""
        self.stop()
        deadline = time.monotonic() + (self.dead_after + 2 * self.interval if wait is None else wait)
        unreachable_since = None
        while True:
            now = time.time()
            try:
                beats = self._read()
                unreachable_since = None
            except Exception:  # noqa: BLE001 - rank 0 hosts the store: it is gone
                unreachable_since = unreachable_since or time.monotonic()
                if time.monotonic() - unreachable_since >= min(self.dead_after, 3.0) or time.monotonic() > deadline:
                    return self._failure({0: None}, reason=f"the rendezvous store it hosts at {self.host}:{self.port} "
                                                           "is unreachable")
                time.sleep(self.interval / 2)
                continue
            dead = {r: b for r, b in beats.items() if r != self.rank and now - b.time > self.dead_after}
            dead.update({r: None for r in range(self.world) if r not in beats and r != self.rank})
            if dead:
                return self._failure(dead, reason=f"no heartbeat for more than {self.dead_after:g} s")
            if time.monotonic() > deadline:
                return None
            time.sleep(self.interval / 2)

    def _failure(self, dead: dict[int, _Beat | None], reason: str) -> RankFailure:
        names = []
        for r, beat in sorted(dead.items()):
            names.append(f"rank {r}" + ("" if beat is None else f" (host {beat.host}, pid {beat.pid})"))
        alive = [r for r in range(self.world) if r not in dead]
        reporter = min(alive) if alive else self.rank
        message = (f"{', '.join(names)} stopped during the run ({reason}): it was killed, ran out of memory or "
                   f"lost its node; see that rank's log. The run ends; restart with --resume to continue from the "
                   f"last checkpoint")
        return RankFailure(message, tuple(sorted(dead)), reporter)
