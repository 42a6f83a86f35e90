"""Run python commands in the anemoi-training venv (``ANEMOI_PYTHON``) without paying its ~8 s ``import torch,
anemoi.models`` per call: one fork server (``tests/fixtures/anemoi_fork_server.py``) per pytest process imports
them once and runs each call in a forked child, a fresh process state each time.

``run_in_anemoi_env(args, ...)`` has the contract of ``subprocess.run([ANEMOI_PYTHON, *args],
capture_output=True, ...)``: a ``CompletedProcess`` with the same ``args``, ``returncode`` (``-N`` for a signal),
``stdout`` and ``stderr``; ``check`` raises ``CalledProcessError``, ``timeout`` kills the child and raises
``TimeoutExpired``. A call whose environment differs from the server's in a variable read when the interpreter
or torch starts (``PYTHON*`` but ``PYTHONPATH``, thread counts, ``TORCH*``/``CUDA*``) runs as a plain
subprocess. The server starts on the first call, restarts on the next call after it died, and ends with the
pytest process.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import locale
import os
import select
import shutil
import signal
import struct
import subprocess
import tempfile
import threading
import time
from pathlib import Path

ANEMOI_PYTHON = Path(os.environ.get("ANEMOI_TRAINING_ENV", Path.home() / "anemoi-training-env")) / "bin" / "python"
SERVER_SCRIPT = Path(__file__).resolve().parent / "fixtures" / "anemoi_fork_server.py"

#: environment variables a process reads when its interpreter or torch starts: a call that sets them otherwise
#: than the server's environment cannot be forked from it
_STARTUP_PREFIXES = ("PYTHON", "OMP_", "MKL_", "KMP_", "OPENBLAS_", "GOTO_", "NUMEXPR_", "TORCH", "PYTORCH", "CUDA",
                     "NVIDIA", "LD_")
_SERVER_START_TIMEOUT = 600.0


class ServerError(RuntimeError):
    """The fork server died or answered nonsense (the call's outcome is unknown)."""


def _startup_vars(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(_STARTUP_PREFIXES) and k != "PYTHONPATH"}


def _server_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["OMP_NUM_THREADS"] = "1"  # before torch is imported: the forked children share it
    return env


def _decode(data: bytes) -> str:
    """As ``subprocess.run(text=True)`` decodes: the locale's encoding, universal newlines."""
    text = data.decode(locale.getpreferredencoding(False))
    return text.replace("\r\n", "\n").replace("\r", "\n")


class _ForkServer:
    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.env: dict[str, str] = {}
        self.log = None  # the server's stderr: an unnamed temporary file, nothing left behind
        self.ready: dict = {}

    # -- lifecycle -------------------------------------------------------------------------------------
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        self.stop()
        self.env = _server_env()
        self.log = tempfile.TemporaryFile(prefix="anemoi-fork-server-")
        self.proc = subprocess.Popen([str(ANEMOI_PYTHON), str(SERVER_SCRIPT)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, env=self.env, cwd=SERVER_SCRIPT.parent)
        try:
            self.ready = self._receive(time.monotonic() + _SERVER_START_TIMEOUT)
        except BaseException:
            self.stop(kill=True)
            raise
        if not self.ready.get("ready"):
            message = f"the anemoi fork server did not start: {self.ready}\n{self.log_tail()}"
            self.stop(kill=True)
            raise ServerError(message)

    def stop(self, kill: bool = False, child: int | None = None) -> None:
        """End the server: asked (EOF on its stdin), or killed with ``kill``, ``child`` (a call's pid) too."""
        proc, self.proc = self.proc, None
        if child is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
        if proc is not None and kill:
            proc.kill()
        if proc is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()  # the server's loop ends on EOF
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            proc.stdout.close()
        if self.log is not None:
            self.log.close()
            self.log = None

    def log_tail(self, n: int = 4000) -> str:
        if self.log is None:
            return ""
        fd = self.log.fileno()
        size = os.fstat(fd).st_size  # pread: the offset the server writes at stays where it is
        return os.pread(fd, n, max(0, size - n)).decode(errors="replace")

    # -- protocol --------------------------------------------------------------------------------------
    def _send(self, message: dict) -> None:
        body = json.dumps(message).encode("utf-8")
        self.proc.stdin.write(struct.pack(">I", len(body)) + body)
        self.proc.stdin.flush()

    def _read_exact(self, n: int, deadline: float | None) -> bytes:
        fd, chunks = self.proc.stdout.fileno(), []
        while n:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([fd], [], [], wait)[0]:
                raise TimeoutError
            chunk = os.read(fd, n)
            if not chunk:
                raise ServerError(f"the anemoi fork server died (status {self.proc.wait()}):\n{self.log_tail()}")
            chunks.append(chunk)
            n -= len(chunk)
        return b"".join(chunks)

    def _receive(self, deadline: float | None) -> dict:
        (size,) = struct.unpack(">I", self._read_exact(4, deadline))
        return json.loads(self._read_exact(size, None if deadline is None else deadline + 30).decode("utf-8"))

    # -- a call ----------------------------------------------------------------------------------------
    def run(self, args: list[str], cwd: str, env: dict[str, str], timeout: float | None) -> tuple[int, bytes, bytes]:
        """``(returncode, stdout, stderr)`` of ``python ARGS`` forked from the server."""
        outdir = tempfile.mkdtemp(prefix="anemoi-run-")
        try:
            request = {"argv": args, "cwd": cwd, "env": env, "stdout": os.path.join(outdir, "stdout"),
                       "stderr": os.path.join(outdir, "stderr")}
            if not self.alive():
                self.start()
            try:
                self._send(request)
            except (BrokenPipeError, ValueError):  # died since the last call: nothing ran yet
                self.start()
                self._send(request)
            deadline = None if timeout is None else time.monotonic() + timeout
            pid = None
            try:
                pid = self._receive(deadline)["pid"]
                try:
                    returncode = self._receive(deadline)["returncode"]
                except TimeoutError:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                    self._receive(time.monotonic() + 60)  # the server is in step again
                    raise subprocess.TimeoutExpired([str(ANEMOI_PYTHON), *args], timeout,
                                                    *self._outputs(outdir)) from None
            except subprocess.TimeoutExpired:
                raise
            except TimeoutError:  # the server itself is stuck: replaced on the next call
                self.stop(kill=True, child=pid)
                raise subprocess.TimeoutExpired([str(ANEMOI_PYTHON), *args], timeout, *self._outputs(outdir)) from None
            except BaseException:  # it died, or the wait was interrupted (pytest-timeout, ^C): its replies are out of
                self.stop(kill=True, child=pid)  # step with the requests, so it is replaced on the next call
                raise
            return (returncode, *self._outputs(outdir))
        finally:
            shutil.rmtree(outdir, ignore_errors=True)

    @staticmethod
    def _outputs(outdir: str) -> tuple[bytes, bytes]:
        def read(name: str) -> bytes:
            try:
                return Path(outdir, name).read_bytes()
            except OSError:
                return b""

        return read("stdout"), read("stderr")


_server = _ForkServer()
_lock = threading.Lock()
atexit.register(_server.stop)


def run_in_anemoi_env(args: list[str], *, cwd: str | os.PathLike | None = None, env: dict[str, str] | None = None,
                      timeout: float | None = None, text: bool = True,
                      check: bool = False) -> subprocess.CompletedProcess:
    """``subprocess.run([ANEMOI_PYTHON, *args], cwd=cwd, env=env, timeout=timeout, capture_output=True,
    text=text, check=check)``, forked from the session's anemoi fork server. ``args``: ``SCRIPT ARGS...``,
    ``-c CODE ARGS...`` or ``-m MODULE ARGS...``."""
    args = [os.fspath(a) for a in args]
    if not args or (args[0].startswith("-") and args[0] not in ("-c", "-m")) or (args[0] in ("-c", "-m")
                                                                                 and len(args) < 2):
        raise ValueError(f"run_in_anemoi_env runs SCRIPT, -c CODE or -m MODULE, not {args}")
    env = dict(os.environ if env is None else env)
    cwd = os.path.abspath(os.fspath(cwd) if cwd is not None else os.getcwd())
    full_args = [str(ANEMOI_PYTHON), *args]
    with _lock:
        if _startup_vars(env) != _startup_vars(_server.env if _server.alive() else _server_env()):
            return subprocess.run(full_args, cwd=cwd, env=env, timeout=timeout, capture_output=True, text=text,
                                  check=check)
        returncode, stdout, stderr = _server.run(args, cwd, env, timeout)
    if text:
        stdout, stderr = _decode(stdout), _decode(stderr)
    if check and returncode:
        raise subprocess.CalledProcessError(returncode, full_args, stdout, stderr)
    return subprocess.CompletedProcess(full_args, returncode, stdout, stderr)


def server_pid() -> int | None:
    """The running fork server's pid (for tests of this module)."""
    return _server.proc.pid if _server.alive() else None
