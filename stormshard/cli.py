"""What every entry point (``launch/train.py``, ``launch/convert_checkpoint.py``,
``launch/forecast.py``) does with a failure: one message, from one rank, and an exit status.

- **Bad input** (a config, a flag, a dataset, a checkpoint or a path that cannot work: every
  ``ValueError`` such as ``ConfigError``, ``LayoutError``, ``AnemoiLayoutError``,
  ``CheckpointError``, pydantic's ``ValidationError``; and ``FileNotFoundError``,
  ``FileExistsError``, ``NotADirectoryError``, ``IsADirectoryError``, ``PermissionError``) prints
  ``error: <message>`` on rank 0 only (every rank runs the same checks and reaches the same
  verdict) and exits with status 2.
- **A rank that died** (:class:`~stormshard.training.watchdog.RankFailure`) is printed by the
  lowest surviving rank; exit status 1. A failure of rank 0 in work the other ranks wait for
  (:mod:`stormshard.training.rank_zero`) is printed by rank 0 alone.
- **Anything else** is a bug or a machine fault: ``error: <type>: <message>`` from every rank that
  hits it (prefixed with the rank in a multi-rank job), exit status 1.
- A Python traceback is printed only with ``--debug``.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Callable
from typing import TextIO

__all__ = ["BAD_INPUT", "EXIT_BAD_INPUT", "EXIT_FAILURE", "add_debug_flag", "process_rank", "report_failure",
           "run_cli"]

EXIT_BAD_INPUT = 2
EXIT_FAILURE = 1

BAD_INPUT: tuple[type[BaseException], ...] = (
    ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError, PermissionError,
)

# rank variables of the launchers stormshard.training.launch knows, in its order
_RANK_VARIABLES = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")


def add_debug_flag(parser: argparse.ArgumentParser) -> None:
    """``--debug``: print the Python traceback of a failure as well."""
    parser.add_argument("--debug", action="store_true", help="print the Python traceback of a failure")


def process_rank() -> int:
    """This process's global rank: the process group's when it exists, else the launcher's variable
    (0 for a plain ``python`` start)."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except ImportError:
        pass
    for name in _RANK_VARIABLES:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


def _world_size() -> int:
    for name in ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 1


def _message(exc: BaseException) -> str:
    from pydantic import ValidationError

    if isinstance(exc, ValidationError):
        from stormshard.training.config import _format_errors

        return _format_errors(exc, exc.title)
    if isinstance(exc, (FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError,
                        PermissionError)) and exc.filename is not None:
        reason = exc.strerror or type(exc).__name__
        fix = {FileNotFoundError: "check the path", FileExistsError: "remove it or pass --overwrite",
               PermissionError: "check its permissions or choose another path"}.get(type(exc), "check the path")
        return f"{exc.filename}: {reason}: {fix}"
    text = str(exc).strip()
    return text or type(exc).__name__


def report_failure(exc: BaseException, debug: bool = False, stream: TextIO | None = None) -> int:
    """Print ``exc`` by the rules of the module docstring; returns the exit status."""
    from stormshard.training.rank_zero import RankZeroFailed
    from stormshard.training.watchdog import RankFailure

    stream = stream or sys.stderr
    rank = process_rank()
    if isinstance(exc, RankFailure):
        status, printer, text = EXIT_FAILURE, exc.reporter == rank, f"error: {exc}"
    elif isinstance(exc, RankZeroFailed):  # rank 0 prints its own exception
        status, printer, text = EXIT_FAILURE, False, f"error: {exc}"
    elif isinstance(exc, BAD_INPUT):
        status, printer, text = EXIT_BAD_INPUT, rank == 0, f"error: {_message(exc)}"
    else:
        status, printer = EXIT_FAILURE, True
        prefix = f"[rank {rank}] " if _world_size() > 1 else ""
        text = f"{prefix}error: {type(exc).__name__}: {_message(exc)}"
        if not debug:
            text += "\n(rerun with --debug for the traceback)"
    if printer or debug:
        if debug:
            traceback.print_exception(exc, file=stream)
        print(text, file=stream, flush=True)
    return status


def run_cli(body: Callable[[], int | None], debug: bool = False) -> int:
    """Run an entry point's ``body``; a failure becomes one message and an exit status
    (:func:`report_failure`). ``KeyboardInterrupt`` exits 130 without a traceback."""
    try:
        status = body()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - every failure is reported the same way
        return report_failure(exc, debug)
    return 0 if status is None else int(status)
