"""Checksums of checkpoint files: recorded at save, verified at ``--resume`` and by conversion.

Every writer of a checkpoint records, in the ``files`` table of ``metadata.json`` (written last,
atomically), the size and sha256 of each other file of the step directory. Verifying a checkpoint
(:func:`checkpoint_problems`) lists, file by file: ``metadata.json`` unreadable (truncated or
overwritten), a rank file missing, a size that differs from the one recorded (truncated), and, with
``contents=True``, a sha256 that differs (overwritten or corrupted). A checkpoint written before
checksums (no ``files`` table) gets what can be checked without them: the rank files of its world
are there and non-empty.

At ``--resume`` a damaged newest checkpoint stops the run (:func:`damaged_checkpoint_error`) with
every damaged file and the previous complete checkpoint to continue from: stormshard does not fall
back on its own, since the next save would then replace the damaged step and the steps after the
previous checkpoint would be trained again without anyone deciding so.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from stormshard.checkpoint.format import (
    METADATA,
    PICKLED_FORMAT,
    CheckpointError,
    latest_checkpoint,
    list_checkpoints,
    pickled_format_error,
    rank_name,
)

__all__ = ["FILES", "file_record", "record_files", "file_problems", "checkpoint_problems", "previous_complete",
           "damaged_checkpoint_error", "check_resume_checkpoint"]

FILES = "files"  # the metadata.json key: {file name: {"bytes": n, "sha256": hex}}
_CHUNK = 1 << 22


def file_record(path: str | os.PathLike) -> dict[str, Any]:
    """``{"bytes": size, "sha256": hex digest}`` of the file at ``path``."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return {"bytes": size, "sha256": digest.hexdigest()}


def record_files(paths: Iterable[str | os.PathLike]) -> dict[str, dict[str, Any]]:
    """:func:`file_record` of each existing file, keyed by its name."""
    return {Path(p).name: file_record(p) for p in paths if Path(p).is_file()}


def file_problems(step_dir: str | os.PathLike, records: Mapping[str, Any], names: Iterable[str] | None = None,
                  contents: bool = True) -> list[str]:
    """The files of ``step_dir`` (``names``, default: all of ``records``) that differ from their
    ``records``: missing, another size, or (``contents``) another sha256; one line per file, naming it."""
    root = Path(step_dir)
    out = []
    for name in (sorted(records) if names is None else names):
        want = records.get(name)
        f = root / name
        if not isinstance(want, Mapping):
            continue
        if not f.is_file():
            out.append(f"{f}: missing")
            continue
        size = f.stat().st_size
        if size != want.get("bytes"):
            out.append(f"{f}: {size} bytes, {want.get('bytes')} when it was saved (truncated or overwritten)")
        elif contents and file_record(f)["sha256"] != want.get("sha256"):
            out.append(f"{f}: its contents differ from the sha256 recorded when it was saved (overwritten or "
                       "corrupted)")
    return out


def _metadata(step_dir: Path) -> tuple[dict[str, Any] | None, str | None]:
    file = step_dir / METADATA
    try:
        meta = json.loads(file.read_text())
    except FileNotFoundError:
        return None, f"{file}: missing"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return None, f"{file}: not readable JSON ({exc}): truncated or overwritten"
    if not isinstance(meta, dict) or not isinstance(meta.get("world_size"), int) or \
            isinstance(meta.get("world_size"), bool):
        return None, f"{file}: holds no world_size: not the metadata of a stormshard training checkpoint"
    return meta, None


def checkpoint_problems(step_dir: str | os.PathLike, contents: bool = False,
                        ranks: Iterable[int] | None = None) -> list[str]:
    """What is damaged in the training checkpoint ``step_dir``: ``metadata.json`` unreadable, rank files
    missing, files whose size (and, with ``contents``, sha256) differs from the recorded one. ``ranks``:
    check only these ranks' files (default: all). A checkpoint of the pickled format raises
    :func:`~stormshard.checkpoint.format.pickled_format_error` (naming the checkpoints directory to
    upgrade)."""
    root = Path(step_dir)
    meta, problem = _metadata(root)
    if meta is None:
        return [problem or f"{root / METADATA}: unreadable"]
    if meta.get("format") == PICKLED_FORMAT:
        raise pickled_format_error(root.parent)  # the checkpoints directory: `upgrade` takes every step in it
    world = meta["world_size"]
    wanted = range(world) if ranks is None else list(ranks)
    names = [f"{rank_name(r)}.pt" for r in wanted]
    records = meta.get(FILES)
    if not isinstance(records, Mapping):  # written before checksums: what can be checked without them
        out = []
        for name in names:
            f = root / name
            if not f.is_file():
                out.append(f"{f}: missing")
            elif f.stat().st_size == 0:
                out.append(f"{f}: empty (0 bytes)")
        return out
    mine = [n for n in records if ranks is None or any(n.startswith(rank_name(r) + ".") for r in wanted)]
    out = [f"{root / n}: missing (not even recorded in {METADATA})" for n in names if n not in records]
    return out + file_problems(root, records, sorted(mine), contents=contents)


def previous_complete(step_dir: str | os.PathLike) -> Path | None:
    """The newest checkpoint before ``step_dir`` in its directory whose files are all there with their
    recorded sizes (contents are not hashed here), or None."""
    target = Path(step_dir)
    older = [p for p in list_checkpoints(target.parent) if p.name < target.name]
    for candidate in reversed(older):
        try:
            if not checkpoint_problems(candidate):
                return candidate
        except CheckpointError:  # an older checkpoint of the pickled format: not resumable as it is
            continue
    return None


def damaged_checkpoint_error(step_dir: str | os.PathLike, problems: Iterable[str]) -> CheckpointError:
    """The error for a damaged checkpoint: every damaged file, and the previous complete step to go on from."""
    target = Path(step_dir)
    lines = [f"checkpoint {target} is damaged:"] + [f"  - {p}" for p in problems]
    previous = previous_complete(target)
    if previous is not None:
        step = int(previous.name.rsplit("_", 1)[-1])
        lines.append(f"the previous complete checkpoint is {previous} (step {step}): move the damaged one aside "
                     f"(mv {target} {target}.damaged) and run with --resume again to continue from step {step}, "
                     "or restore the damaged files")
    else:
        lines.append("no earlier complete checkpoint is left: restore the damaged files, or start a new run with a "
                     "new training.output_dir")
    return CheckpointError("\n".join(lines))


def check_resume_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The checkpoint ``--resume`` takes from ``directory`` (None when there is none), after the checks
    that need no hashing: readable ``metadata.json``, current format, every file there with its
    recorded size; else :func:`damaged_checkpoint_error` (or the format-1 upgrade error)."""
    target = latest_checkpoint(directory)
    if target is None:
        return None
    problems = checkpoint_problems(target)
    if problems:
        raise damaged_checkpoint_error(target, problems)
    return target
