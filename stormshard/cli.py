"""What every entry point (``launch/train.py``, ``launch/convert_checkpoint.py``,
``launch/forecast.py``) does with a failure: one message, from one rank, and an exit status.

- **Bad input** (a config, a flag, a dataset, a checkpoint or a path that cannot work: every
  ``ValueError`` such as ``ConfigError``, ``LayoutError``, ``AnemoiLayoutError``,
  ``CheckpointError``, pydantic's ``ValidationError``; and ``FileNotFoundError``,
  ``FileExistsError``, ``NotADirectoryError``, ``IsADirectoryError``, ``PermissionError``, and an
  ``OSError`` refusing a path: a read-only file system) prints
  ``error: <message>`` on rank 0 only (every rank runs the same checks and reaches the same
  verdict) and exits with status 2.
- **A failure one rank reports for the job** (:class:`~stormshard.errors.ReportedByRank`: a rank
  that died, :class:`~stormshard.training.watchdog.RankFailure`, printed by the lowest surviving
  rank; a failure of rank 0 in work the other ranks wait for, :mod:`stormshard.training.rank_zero`,
  printed by rank 0 alone) is printed by its ``reporter`` only; exit status 1.
- **Anything else** is a bug or a machine fault: ``error: <type>: <message>`` from every rank that
  hits it (prefixed with the rank in a multi-rank job), exit status 1.
- A Python traceback is printed only with ``--debug``.
- **Under torchrun** (``TORCHELASTIC_ERROR_FILE`` set), every failing rank also writes the message
  (with ``--debug``, the traceback too) to torch elastic's error file, so that torchrun's failure
  summary shows it as the root cause (its ``traceback :`` field) instead of a link to its docs
  (:func:`write_elastic_error_file`). torchrun itself still prints a log line, its own traceback
  and the summary after it, and exits with status 1 whatever the child's status (shown there as
  ``exitcode``); see the README's "When something fails".

The exit statuses, :data:`BAD_INPUT` and the failure classes live in :mod:`stormshard.errors`, which
the library below the entry points uses too; this module imports nothing from training.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import TextIO

from stormshard.errors import (
    EXIT_BAD_INPUT,
    EXIT_FAILURE,
    ReportedByRank,
    disk_full_error,
    format_validation_errors,
    is_bad_input,
    is_disk_full,
)

__all__ = ["add_debug_flag", "add_trust_flag", "check_arguments_not_empty", "process_rank", "report_failure", "run_cli",
           "write_elastic_error_file"]

# (rank, world size) variables of the launchers stormshard.training.launch knows, in its order
_RANK_VARIABLES = (("RANK", "WORLD_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE"),
                   ("SLURM_PROCID", "SLURM_NTASKS"))


def add_debug_flag(parser: argparse.ArgumentParser) -> None:
    """``--debug``: print the Python traceback of a failure as well."""
    parser.add_argument("--debug", action="store_true", help="print the Python traceback of a failure")


#: what ``--trust-model-code`` allows by default (:mod:`stormshard.models.trust`)
IMPORT_STORED_BUILDER = ("import the model builder module that the stored config of the bundle or checkpoint names "
                         "(model.name 'package.module:attribute')")


def add_trust_flag(parser: argparse.ArgumentParser, what: str = IMPORT_STORED_BUILDER) -> None:
    """``--trust-model-code``: let a file run the code it names (``what`` says which), refused without it."""
    parser.add_argument("--trust-model-code", action="store_true",
                        help=f"{what}; this runs code from the file: use it only for files you trust (without "
                             "it, such a file is an error and nothing runs)")


def check_arguments_not_empty(argv: list[str] | None) -> None:
    """A ``ValueError`` naming the option (``--out is empty``) when a command-line value is empty, e.g.
    from an unset shell variable (``--out "$OUT"``): an empty path would mean the current directory."""
    tokens = list(sys.argv[1:] if argv is None else argv)
    for i, token in enumerate(tokens):
        flag, sep, value = token.partition("=")
        if token.startswith("--") and sep and not value.strip():
            name = flag
        elif not token.strip():
            name = tokens[i - 1] if i and tokens[i - 1].startswith("--") else f"argument {i + 1}"
        else:
            continue
        raise ValueError(f"{name} is empty (an unset shell variable?): an empty value is never read as the current "
                         "directory; give a value")


def process_rank() -> int:
    """This process's global rank: the process group's when it exists, else the launcher's variable
    (0 for a plain ``python`` start). A process that has not loaded torch has no process group: an
    error found before torch loads (a bad config) is reported without loading it."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    for name, size_name in _RANK_VARIABLES:
        value, size = os.environ.get(name, ""), os.environ.get(size_name, "")
        if value.isdigit() and size.isdigit() and int(value) < int(size):
            return int(value)
    return 0  # no launcher, or a rank without a (valid) world: this process is the one to report


def _world_size() -> int:
    for name in ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 1


def _message(exc: BaseException) -> str:
    from pydantic import ValidationError

    if isinstance(exc, ValidationError):
        return format_validation_errors(exc, exc.title)
    if isinstance(exc, (FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError,
                        PermissionError)) and exc.filename is not None:
        reason = exc.strerror or type(exc).__name__
        fix = {FileNotFoundError: "check the path", FileExistsError: "remove it or pass --overwrite",
               PermissionError: "check its permissions or choose another path"}.get(type(exc), "check the path")
        return f"{exc.filename}: {reason}: {fix}"
    if isinstance(exc, OSError) and is_bad_input(exc) and exc.filename is not None:  # e.g. a read-only file system
        return f"{exc.filename}: {exc.strerror or type(exc).__name__}: choose another path (one this user can write)"
    text = str(exc).strip()
    return text or type(exc).__name__


def report_failure(exc: BaseException, debug: bool = False, stream: TextIO | None = None) -> int:
    """Print ``exc`` by the rules of the module docstring; returns the exit status."""
    stream = stream or sys.stderr
    rank = process_rank()
    if isinstance(exc, ReportedByRank):  # e.g. rank 0 prints its own exception, the others this one
        status, printer, text = EXIT_FAILURE, exc.reporter == rank, f"error: {exc}"
    elif is_disk_full(exc):  # every rank that hits it says so (another rank's disk may be fine)
        if not isinstance(exc, OSError):  # torch.save's RuntimeError: no errno, no file name
            exc = disk_full_error(exc, "the output")
        prefix = f"[rank {rank}] " if _world_size() > 1 else ""
        status, printer = EXIT_FAILURE, True
        text = (f"{prefix}error: the disk is full ({exc.strerror or 'no space left on device'}) writing "
                f"{exc.filename or 'the output'}: free space there or write to another file system")
    elif is_bad_input(exc):
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
    trace = "".join(traceback.format_exception(exc)) if debug else ""
    write_elastic_error_file(trace + text)  # every failing rank: torchrun shows the first one's
    return status


def write_elastic_error_file(text: str) -> bool:
    """Under torchrun, write ``text`` to ``$TORCHELASTIC_ERROR_FILE`` in the JSON form of torch elastic's
    ``ErrorHandler.record_exception``, so torchrun's failure summary shows ``text`` as the root cause.
    Returns whether a file was written (False outside torchrun, or when it cannot be written)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE", "")
    if not path:
        return False
    lines = [line for line in text.splitlines() if line.strip()]
    data = {"message": {"message": lines[-1] if lines else text,
                        "extraInfo": {"py_callstack": text, "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(data, f)
    except OSError:
        return False
    return True


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
