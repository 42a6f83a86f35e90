"""Exit statuses, what counts as bad input, and the failure classes every layer shares.

The entry points (:mod:`stormshard.cli`) and the library below them (training, checkpoint
conversion, inference) agree here on how a failure ends a job, without importing each other:

- :data:`BAD_INPUT`: the exception types that mean a config, flag, dataset, checkpoint or path that
  cannot work (every ``ValueError``, pydantic's ``ValidationError`` included, and the file errors);
  :func:`is_bad_input` adds an ``OSError`` that refuses a path (a read-only file system, no
  permission); they exit with :data:`EXIT_BAD_INPUT`;
- :func:`check_writable_directory`: the one check that an output directory can be created and
  written, run by every entry point before any work;
- :class:`ReportedByRank`: a failure whose message one rank (``reporter``) prints for the whole job
  (a rank that died, a failure of rank 0 the others waited for); exit status :data:`EXIT_FAILURE`;
- :func:`format_validation_errors`: one line per problem of a pydantic ``ValidationError``.

This module imports nothing from stormshard.
"""

from __future__ import annotations

import errno
import json
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pydantic import ValidationError

__all__ = ["EXIT_BAD_INPUT", "EXIT_FAILURE", "BAD_INPUT", "ReportedByRank", "format_validation_errors", "is_bad_input",
           "OutputPathError", "check_writable_directory", "nearest_existing_parent"]

EXIT_BAD_INPUT = 2
EXIT_FAILURE = 1

BAD_INPUT: tuple[type[BaseException], ...] = (
    ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError, PermissionError,
)


#: errno values of an ``OSError`` that refuses a path the user chose (bad input, not a fault)
REFUSED_PATH_ERRNOS = (errno.EROFS, errno.EACCES, errno.EPERM)


def is_bad_input(exc: BaseException) -> bool:
    """Whether ``exc`` means bad input: one of :data:`BAD_INPUT`, or an ``OSError`` refusing a path
    (a read-only file system, no permission: the output path has to change, nothing is broken)."""
    return isinstance(exc, BAD_INPUT) or (isinstance(exc, OSError) and exc.errno in REFUSED_PATH_ERRNOS)


class OutputPathError(ValueError):
    """An output path that cannot be created or written; the message names the argument and the path."""


def nearest_existing_parent(path: Path) -> Path:
    """``path`` itself when it exists, else its closest existing ancestor."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def check_writable_directory(path: str | os.PathLike, field: str, value: str | os.PathLike | None = None) -> None:
    """Raise :class:`OutputPathError` naming ``field`` (and ``value``, default ``path``) unless the
    directory ``path`` can be created and written: checked on its nearest existing ancestor
    (permissions, then a probe directory created and removed at once, since permissions lie on
    read-only or virtual file systems and for root)."""
    path = Path(path)
    shown = str(path if value is None else value)
    base = nearest_existing_parent(path)
    if not base.is_dir():
        raise OutputPathError(f"{field}={shown!r} cannot be created: {base} is a file, not a directory; choose "
                              "another path")
    reason = None if os.access(base, os.W_OK | os.X_OK) else "it does not allow writing for this user"
    if reason is None:
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".stormshard-probe-", dir=base))
        except OSError as exc:
            reason = exc.strerror or type(exc).__name__
    if reason is not None:
        raise OutputPathError(f"{field}={shown!r} is not writable ({base}: {reason}): fix its permissions or "
                              "choose another path; nothing was started")


class ReportedByRank(RuntimeError):
    """A failure of the job that rank ``reporter`` prints; every other rank exits without a message."""

    def __init__(self, message: str, reporter: int) -> None:
        super().__init__(message)
        self.reporter = reporter


def format_validation_errors(err: ValidationError, source: str) -> str:
    """One line per problem of ``err``, prefixed with ``source`` (a file name, "config"); a
    section-level check (a model validator, whose message names the fields) is shown as it is."""
    problems = []
    for e in err.errors():
        where = ".".join(str(x) for x in e["loc"]) or "(top level)"
        value = e.get("input")
        shown = json.dumps(value, default=str) if not isinstance(value, dict) else "{...}"
        if len(shown) > 80:
            shown = shown[:77] + "..."
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key (a typo? remove it or check the README's config reference)"
        if e["type"] == "value_error":
            msg = str(e.get("ctx", {}).get("error", msg.removeprefix("Value error, ")))
            if isinstance(value, dict):  # a model validator: its message names the fields
                problems.append(msg)
                continue
        problems.append(f"{where} = {shown}: {msg}")
    if len(problems) == 1:
        return f"{source}: {problems[0]}"
    return "\n".join([f"{source}: {len(problems)} invalid setting(s):"] + [f"  - {p}" for p in problems])
