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
- :func:`format_validation_errors`: one line per problem of a pydantic ``ValidationError``;
- :func:`is_disk_full` / :func:`disk_full_error`: a full disk (``ENOSPC``, ``EDQUOT``) while writing,
  with the path it was writing (the entry points print "the disk is full" and the path);
  :func:`no_partial_output`: a failure while writing an output leaves none of it behind;
  :func:`kept_until_replaced`: outputs written again (``--overwrite``) stay until the new ones are complete.

This module imports nothing from stormshard.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Collection, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pydantic import ValidationError

__all__ = ["EXIT_BAD_INPUT", "EXIT_FAILURE", "BAD_INPUT", "ReportedByRank", "format_validation_errors", "is_bad_input",
           "OutputPathError", "check_writable_directory", "nearest_existing_parent", "is_disk_full", "disk_full_error", "no_partial_output",
           "kept_until_replaced"]

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


#: errno values of an ``OSError`` that means the disk (or the user's quota) is full
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


#: what torch's zip writer (``torch.save``) raises, as a RuntimeError without an errno, when a write fails
TORCH_WRITE_FAILED = ("file write failed", "unexpected pos")


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` is a write that failed because the disk (or quota) is full: an ``OSError`` with
    ``ENOSPC`` / ``EDQUOT``, or ``torch.save``'s ``RuntimeError`` ("PytorchStreamWriter failed writing file
    ...: file write failed"), which loses the errno (a failed write there is the disk, or the device, failing)."""
    if isinstance(exc, OSError):
        return exc.errno in DISK_FULL_ERRNOS
    return isinstance(exc, RuntimeError) and any(text in str(exc) for text in TORCH_WRITE_FAILED)


def disk_full_error(exc: BaseException, path: str | os.PathLike) -> OSError:
    """``exc`` (a full disk: :func:`is_disk_full`) as an ``OSError`` naming ``path``, the output being written:
    not the file ``exc`` names, which may be a temporary one or, for a copy (``shutil``'s ``sendfile``), the
    source read; ``torch.save``'s internals are left out. Raise it ``from exc``."""
    code = exc.errno if isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS else errno.ENOSPC
    return OSError(code, os.strerror(code), str(path))


def _stamp(p: Path) -> tuple:
    """What changes when ``p`` is rewritten: a file's inode, size and mtime; a directory's inode and its
    children's names and mtimes."""
    st = p.lstat()
    if not p.is_dir() or p.is_symlink():
        return st.st_ino, st.st_size, st.st_mtime_ns
    try:
        children = frozenset((c.name, c.lstat().st_mtime_ns) for c in p.iterdir())
    except OSError:
        children = frozenset()
    return st.st_ino, children


def _entries(root: Path, depth: int) -> dict[Path, tuple]:
    """``{path: stamp}`` of the entries of ``root`` down to ``depth`` levels."""
    out: dict[Path, tuple] = {}
    level = [root]
    for _ in range(depth):
        below = []
        for d in level:
            try:
                children = list(d.iterdir()) if d.is_dir() and not d.is_symlink() else []
            except OSError:
                continue
            for c in children:
                out[c] = _stamp(c)
                below.append(c)
        level = below
    return out


def _remove(p: Path) -> None:
    """Remove ``p`` (a file or a tree) if it is there; a cleanup never raises."""
    try:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    except OSError:  # e.g. a parent that is a file: nothing was written there
        pass


@contextlib.contextmanager
def no_partial_output(path: str | os.PathLike, outputs: Collection[str] = (), remove: bool = True) -> Iterator[None]:
    """Run the body that writes the output ``path``; when it fails (any exception, an interrupt too),
    remove (``remove``: the rank that writes) what of the output did not exist before: ``path``
    itself, its ``<path>.partial`` sibling and the directories created above it. When ``path`` existed
    (a forecast's ``--out``), the entries up to two levels into it that are new, and those named in
    ``outputs`` (``forecast.zarr``, ``scores.json``, ...) that were rewritten; everything else there
    stays. A full disk is re-raised naming ``path`` (:func:`disk_full_error`)."""
    p = Path(path).absolute()
    existed = p.exists() or p.is_symlink()
    partial = p.with_name(p.name + ".partial")
    partial_existed = partial.exists()
    created = [d for d in p.parents if not d.exists()]  # deepest first
    depth = 2 if outputs else 0
    before = _entries(p, depth) if existed and remove else {}
    try:
        yield
    except BaseException as exc:
        if remove:
            if not existed:
                _remove(p)
            for entry, stamp in sorted(_entries(p, depth).items(), key=lambda e: len(e[0].parts)):
                if entry.parent.exists() and (entry not in before or entry.name in outputs and before[entry] != stamp):
                    _remove(entry)
            if not partial_existed:
                _remove(partial)
            for d in created:
                try:
                    d.rmdir()
                except OSError:
                    break
        if is_disk_full(exc):
            raise disk_full_error(exc, p) from exc
        raise


@contextlib.contextmanager
def kept_until_replaced(paths: Iterable[str | os.PathLike]) -> Iterator[None]:
    """Outputs ``paths`` that the body writes again (``--overwrite``): each that exists is moved aside first
    (``.<name>.old-<pid>`` beside it). When the body fails, what it wrote there is removed and the old ones are
    put back, so an output is never half-replaced; when it succeeds the old ones are deleted (or put back where
    the body wrote nothing). A process killed meanwhile leaves them under those names."""
    moved: list[tuple[Path, Path]] = []
    try:
        for p in map(Path, paths):
            if p.exists() or p.is_symlink():
                old = p.with_name(f".{p.name}.old-{os.getpid()}")
                _remove(old)
                os.replace(p, old)
                moved.append((p, old))
        yield
    except BaseException:
        for p, old in reversed(moved):
            _remove(p)
            with contextlib.suppress(OSError):
                os.replace(old, p)
        raise
    for p, old in moved:
        if p.exists() or p.is_symlink():
            _remove(old)
        else:
            os.replace(old, p)


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


def format_validation_errors(err: ValidationError, source: str,
                             source_of: Callable[[str, str], str | None] | None = None) -> str:
    """One line per problem of ``err``, prefixed with ``source`` (a file name, "config"); a
    section-level check (a model validator, whose message names the fields) is shown as it is.
    ``source_of(field, message)`` may name another source for one problem (a command-line override
    that set the field), which then replaces ``source`` on that line."""
    problems: list[tuple[str | None, str]] = []
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
                problems.append((source_of(where, msg) if source_of else None, msg))
                continue
        text = f"{where} = {shown}: {msg}"
        problems.append((source_of(where, text) if source_of else None, text))
    if len(problems) == 1:
        own, text = problems[0]
        return f"{own or source}: {text}"
    return "\n".join([f"{source}: {len(problems)} invalid setting(s):"]
                     + [f"  - {own + ': ' if own else ''}{text}" for own, text in problems])
