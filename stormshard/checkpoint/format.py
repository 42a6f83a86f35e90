"""The on-disk format of a training checkpoint: file names, the parameter table, finding and reading, and the
one directory fsync every writer of a checkpoint uses (:func:`fsync_directory`).

Written by :func:`stormshard.training.checkpoint.save_checkpoint` (one collective save per step)
and by :func:`stormshard.checkpoint.reshard.reshard_checkpoint`; read by resuming, conversion and
inference. Layout of a checkpoints directory (all ranks must see the same file system)::

    <directory>/
      latest                      # text: "step_00000120" (replaced atomically)
      step_00000120/
        metadata.json             # format, step, world_size, time, layout, config (the experiment
                                  # config as plain JSON), ranks: per rank its parameter table,
                                  # files: per file its size and sha256 (written last)
        rank_00000.pt             # {"format", "step", "rank", "world", "state", "rng"} as tensors plus
                                  # a JSON skeleton (stormshard.checkpoint.state_codec): loads with
                                  # torch.load(weights_only=True)
        rank_00000.safetensors    # optional: this rank's model weights (for conversion / inference)
        rank_00000.json           # this rank's parameter table (merged into metadata.json)
      step_00000130.tmp/          # a save in progress (or one that crashed): never read

A step directory is complete once it holds ``metadata.json`` (written last, before the rename).
Format 1 (releases before checksums) stored pickled python objects in ``rank_NNNNN.pt``; they are
read only by ``python launch/convert_checkpoint.py upgrade`` (:mod:`stormshard.checkpoint.upgrade`,
with an allow-list of the classes those files hold). This module needs no process group, model config or
training code.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any

from torch import nn

from stormshard.parallel.partition import full_shape, get_partition

__all__ = [
    "LATEST",
    "METADATA",
    "FORMAT_VERSION",
    "PICKLED_FORMAT",
    "CheckpointError",
    "pickled_format_error",
    "step_name",
    "step_of",
    "rank_name",
    "parameter_table",
    "list_checkpoints",
    "latest_checkpoint",
    "read_metadata",
    "fsync_directory",
]

LATEST = "latest"
METADATA = "metadata.json"
FORMAT_VERSION = 2
PICKLED_FORMAT = 1  # rank files of pickled python objects: read only by `convert_checkpoint.py upgrade`
_STEP_PREFIX = "step_"


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete, or does not match the current run."""


def pickled_format_error(path: str | os.PathLike) -> CheckpointError:
    """The error for a checkpoint of format 1 (pickled rank files, written before checksums)."""
    return CheckpointError(
        f"{path} was written by an earlier stormshard (checkpoint format {PICKLED_FORMAT}: pickled rank files); "
        f"this release reads format {FORMAT_VERSION}. Upgrade it once, in place (the pickles are read with an "
        f"allow-list, nothing in them runs): python launch/convert_checkpoint.py upgrade {path}")


def step_name(step: int) -> str:
    """The directory name of checkpoint ``step``: ``step_00000120``."""
    return f"{_STEP_PREFIX}{step:08d}"


def rank_name(rank: int) -> str:
    """The stem of rank ``rank``'s files in a step directory: ``rank_00003`` (``.pt``, ``.safetensors``, ``.json``)."""
    return f"rank_{rank:05d}"


def step_of(name: str) -> int | None:
    """The step of a step directory's name (``step_00000120`` -> 120); None for any other name
    (``step_00000120.tmp``, ``latest``)."""
    digits = name.removeprefix(_STEP_PREFIX)
    return int(digits) if name.startswith(_STEP_PREFIX) and digits.isdigit() else None


def parameter_table(model: nn.Module) -> list[dict[str, Any]]:
    """Name, local shape, full shape, dtype, Partition (or None) and whether it is trained, of every
    parameter of ``model``."""
    rows = []
    for name, p in model.named_parameters():
        part = get_partition(p)
        rows.append({
            "name": name, "shape": list(p.shape), "full_shape": list(full_shape(p)),
            "dtype": str(p.dtype).removeprefix("torch."), "partition": None if part is None else part.as_dict(),
            "trainable": bool(p.requires_grad),  # frozen (training.freeze) ones are not in the optimizer
        })
    return rows


def list_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """Complete checkpoints (``step_NNNNNNNN`` holding ``metadata.json``), oldest first."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        step = step_of(p.name)
        if step is not None and p.is_dir() and (p / METADATA).is_file():
            found.append((step, p))
    return [p for _, p in sorted(found)]


def saved_after_pointer(pointer: Path, newest: Path) -> bool:
    """Whether the step ``newest`` (newer than the one ``pointer`` names) is what a save stopped between renaming
    its step and rewriting ``latest`` leaves: it has a ``metadata.json`` (the save writes it before the rename) not
    older than the pointer, by the file system's clock. A pointer written after it was chosen by someone."""
    try:
        return (newest / METADATA).stat().st_mtime_ns >= pointer.stat().st_mtime_ns
    except OSError:
        return False


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The checkpoint ``latest`` points at (or the newest complete one saved after ``latest`` was written:
    :func:`saved_after_pointer`, as ``--resume`` takes it), else (no pointer, or a dangling or damaged one) the
    newest complete one, else None."""
    root = Path(directory)
    pointer = root / LATEST
    complete = list_checkpoints(root)
    if pointer.is_file():
        try:
            name = pointer.read_text().strip()
            target = root / name
            if step_of(name) is not None and (target / METADATA).is_file():
                if complete and step_of(complete[-1].name) > step_of(name) and saved_after_pointer(pointer,
                                                                                                  complete[-1]):
                    return complete[-1]
                return target
        except (OSError, UnicodeDecodeError, ValueError):  # a damaged pointer (e.g. zeroed: a NUL in the name)
            pass
    return complete[-1] if complete else None


def read_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The parsed ``metadata.json`` of the step directory ``path``; :class:`CheckpointError` when it is
    missing (an interrupted save) or unreadable. Its keys are not checked here."""
    file = Path(path) / METADATA
    if not file.is_file():
        raise CheckpointError(f"{path} is not a complete checkpoint (no {METADATA}): a save was interrupted; "
                              "use an earlier step_NNNNNNNN")
    try:
        return json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{file} cannot be read: {exc}: the checkpoint is damaged") from None


#: errno values of a directory that cannot be opened for an fsync (Windows: EACCES, EISDIR) or whose file system
#: does not sync directories (EINVAL, EBADF: PostgreSQL's fsync_fname_ext; ENOTSUP / EOPNOTSUPP, ENOSYS); any
#: other error (EIO, and EROFS: ext4 after it shut the file system down) is a failed write
_NO_DIRECTORY_FSYNC_OPEN = frozenset({errno.EACCES, errno.EISDIR})
_NO_DIRECTORY_FSYNC = frozenset({errno.EINVAL, errno.EBADF, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS})


def fsync_directory(path: str | os.PathLike) -> None:
    """Put the names in the directory ``path`` (a rename) on the disk; a file system that cannot sync a directory
    is skipped, any other error (``EIO``...) raised, with ``path`` as its file name."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        if exc.errno in _NO_DIRECTORY_FSYNC_OPEN:
            return
        raise
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in _NO_DIRECTORY_FSYNC:
            raise OSError(exc.errno, exc.strerror, str(exc.filename or path)) from exc
    finally:
        os.close(fd)
