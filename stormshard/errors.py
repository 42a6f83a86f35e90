"""Exit statuses, what counts as bad input, and the failure classes every layer shares.

The entry points (:mod:`stormshard.cli`) and the library below them (training, checkpoint
conversion, inference) agree here on how a failure ends a job, without importing each other:

- :data:`BAD_INPUT`: the exception types that mean a config, flag, dataset, checkpoint or path that
  cannot work (every ``ValueError``, pydantic's ``ValidationError`` included, and the file errors);
  they exit with :data:`EXIT_BAD_INPUT`;
- :class:`ReportedByRank`: a failure whose message one rank (``reporter``) prints for the whole job
  (a rank that died, a failure of rank 0 the others waited for); exit status :data:`EXIT_FAILURE`;
- :func:`format_validation_errors`: one line per problem of a pydantic ``ValidationError``.

This module imports nothing from stormshard.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pydantic import ValidationError

__all__ = ["EXIT_BAD_INPUT", "EXIT_FAILURE", "BAD_INPUT", "ReportedByRank", "format_validation_errors"]

EXIT_BAD_INPUT = 2
EXIT_FAILURE = 1

BAD_INPUT: tuple[type[BaseException], ...] = (
    ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError, PermissionError,
)


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
