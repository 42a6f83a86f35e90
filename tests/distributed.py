"""Run a function on N gloo ranks on CPU: the spawn helper of the distributed tests.

``run_distributed(fn, world_size, *args)`` calls ``fn(rank, world_size, *args)`` on every rank of
a gloo process group and returns the list of per-rank results. ``fn`` must be a module-level
function (it is pickled by reference). Ranks live in a pool kept per world size, so a test pays
the process start-up once per session; a failure or a hang tears that pool down and the next
call builds a fresh one.

- an exception on any rank fails the test with that rank's traceback;
- a rank that dies fails the test at once (its exit code is reported);
- a rank that hangs fails the test after ``timeout`` seconds.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import queue
import socket
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

__all__ = ["run_distributed", "DistributedTestError", "shutdown_pools"]

DEFAULT_TIMEOUT = float(os.environ.get("STORMSHARD_TEST_TIMEOUT", "180"))


class DistributedTestError(AssertionError):
    """A rank raised, died or hung."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, tasks: mp.Queue, results: mp.Queue, root: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank), OMP_NUM_THREADS="1",
    )
    if root not in sys.path:
        sys.path.insert(0, root)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=DEFAULT_TIMEOUT))
    except Exception:  # noqa: BLE001
        results.put((rank, "error", traceback.format_exc()))
        return
    results.put((rank, "ready", None))
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            out = fn(rank, world_size, *args, **kwargs)
            results.put((rank, "ok", out))
        except BaseException:  # noqa: BLE001
            results.put((rank, "error", traceback.format_exc()))
    dist.destroy_process_group()


class _Pool:
    def __init__(self, world_size: int) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        port = _free_port()
        self.procs = [
            ctx.Process(target=_worker, args=(r, world_size, port, self.tasks[r], self.results, root), daemon=True)
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()
        self._collect("ready", timeout=120.0)

    def _collect(self, expect: str, timeout: float) -> list[Any]:
        out: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while len(out) + len(errors) < self.world_size:
            try:
                rank, status, payload = self.results.get(timeout=0.2)
            except queue.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(self.procs) if not p.is_alive()]
                if dead:
                    self.close()
                    detail = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
                    raise DistributedTestError(
                        f"rank(s) {', '.join(f'{r} (exit code {c})' for r, c in dead)} died{detail}"
                    ) from None
                if errors and time.monotonic() > min(deadline, self._first_error + 5.0):
                    break
                if time.monotonic() > deadline:
                    self.close()
                    missing = sorted(set(range(self.world_size)) - set(out) - set(errors))
                    raise DistributedTestError(
                        f"rank(s) {missing} did not finish within {timeout:.0f} s (hang?)"
                    ) from None
                continue
            if status == "error":
                if not errors:
                    self._first_error = time.monotonic()
                errors[rank] = payload
            else:
                out[rank] = payload
        if errors:
            self.close()
            detail = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            raise DistributedTestError(f"rank(s) {sorted(errors)} raised:{detail}")
        return [out[r] for r in range(self.world_size)]

    def run(self, fn: Callable, args: tuple, kwargs: dict, timeout: float) -> list[Any]:
        for q in self.tasks:
            q.put((fn, args, kwargs))
        return self._collect("ok", timeout)

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self) -> None:
        for q in self.tasks:
            try:
                q.put_nowait(None)
            except Exception:  # noqa: BLE001
                pass
        deadline = time.monotonic() + 2.0
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=2.0)
        _POOLS.pop(self.world_size, None)


_POOLS: dict[int, _Pool] = {}


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = DEFAULT_TIMEOUT, **kwargs: Any) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo ranks; return per-rank results."""
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    pool = _POOLS.get(world_size)
    if pool is None or not pool.alive():
        if pool is not None:
            pool.close()
        pool = _POOLS[world_size] = _Pool(world_size)
    return pool.run(fn, args, kwargs, timeout)


def shutdown_pools() -> None:
    for pool in list(_POOLS.values()):
        pool.close()


atexit.register(shutdown_pools)
