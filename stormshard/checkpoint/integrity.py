"""Checksums of checkpoint files: recorded at save, verified at ``--resume`` and by conversion.

Every writer of a checkpoint records, in the ``files`` table of ``metadata.json`` (written last,
atomically), the size and sha256 of each other file of the step directory. Verifying a checkpoint
(:func:`checkpoint_problems`) lists, file by file: ``metadata.json`` unreadable (truncated or
overwritten) or without the ``world_size``, ``step``, ``layout`` and ``config`` a resume reads, a rank
file missing, a size that differs from the one recorded (truncated), and, with ``contents=True``, a
sha256 that differs (overwritten or corrupted). A checkpoint written before
checksums (no ``files`` table) gets what can be checked without them: the rank files of its world
are there and non-empty.

At ``--resume`` the checkpoint is the one ``latest`` names (:func:`resume_target`); a damaged one, a
damaged ``latest`` or one naming a missing step stops the run (:func:`damaged_checkpoint_error`) with
every damaged file and the previous complete checkpoint to continue from: stormshard does not fall
back on its own, since the next save would then replace the damaged step and the steps after the
previous checkpoint would be trained again without anyone deciding so. Moving the damaged step aside
(``mv step_N step_N.damaged``) is that decision. It goes forward on its own in one case: a complete
step newer than the one ``latest`` names and saved after ``latest`` was last written (a save that
stopped between renaming its step and rewriting ``latest``: a kill, a full disk), which nobody chose
against.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stormshard.checkpoint.format import (
    LATEST,
    METADATA,
    PICKLED_FORMAT,
    CheckpointError,
    list_checkpoints,
    pickled_format_error,
    rank_name,
    saved_after_pointer,
    step_of,
)

__all__ = ["FILES", "file_record", "record_files", "file_problems", "checkpoint_problems", "previous_complete",
           "damaged_checkpoint_error", "ResumeTarget", "resume_target"]

FILES = "files"  # the metadata.json key: {file name: {"bytes": n, "sha256": hex}}
_READ_KEYS: dict[str, type] = {"step": int, "layout": dict, "config": dict}  # besides world_size, what a resume reads
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
    wrong = [key for key, kind in _READ_KEYS.items()
             if not isinstance(meta.get(key), kind) or isinstance(meta.get(key), bool)]
    if wrong:  # what loading reads: met here rather than as a KeyError once the run has started
        return None, (f"{file}: {', '.join(f'{k} missing or not a JSON {_READ_KEYS[k].__name__}' for k in wrong)}: "
                      "edited or overwritten (a training save writes them)")
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


@dataclass(frozen=True)
class ResumeTarget:
    """The checkpoint ``--resume`` continues (:func:`resume_target`) and, when the step ``latest`` names
    was moved aside by the user, a line saying so."""

    path: Path
    note: str = ""


def _step_entries(root: Path) -> list[tuple[int, Path]]:
    """Every ``step_NNNNNNNN`` entry of ``root`` (a directory or not, complete or not), by step."""
    found = []
    for p in root.iterdir():
        step = step_of(p.name)
        if step is not None:
            found.append((step, p))
    return sorted(found)


def _newest_complete(root: Path, below: int | None = None) -> Path | None:
    for step, p in reversed(_step_entries(root)):
        if (below is None or step < below) and p.is_dir():
            try:
                if not checkpoint_problems(p):
                    return p
            except CheckpointError:  # the pickled format: not resumable as it is
                continue
    return None


def _pointer_error(pointer: Path, what: str) -> CheckpointError:
    newest = _newest_complete(pointer.parent)
    fix = (f"the newest complete checkpoint is {newest}: to continue from it, write its name into the pointer "
           f"(echo {newest.name} > {pointer}) and run with --resume again" if newest is not None else
           "no complete checkpoint is left: start a new run with a new training.output_dir")
    return CheckpointError(f"{pointer}, the pointer to the checkpoint --resume continues, {what}; stormshard does not "
                           f"pick another checkpoint on its own: {fix}")


def _moved_aside(pointer: Path, name: str, step: int) -> ResumeTarget:
    """``latest`` names a step that is gone: the user's decision when they moved it aside (``mv step_N
    step_N.damaged``), then the newest older step, which must be complete; else an error."""
    root = pointer.parent
    others = sorted(p.name for p in root.iterdir() if p.name.startswith(name + "."))
    moved = [n for n in others if n.rsplit(".", 1)[-1] not in ("tmp", "old")]
    if not moved:
        hint = ""
        if f"{name}.old" in others:
            hint = (f" ({name}.old is its previous copy, left by a save interrupted while it replaced the step: "
                    f"mv {root / (name + '.old')} {root / name} restores it)")
        raise _pointer_error(pointer, f"names {name}, but {root / name} does not exist{hint}")
    newer = [p.name for s, p in _step_entries(root) if s > step]
    if newer:  # resuming from an older step would retrain and overwrite them
        raise CheckpointError(
            f"{pointer} names {name}, which was moved aside ({', '.join(moved)}), but {root} holds newer steps "
            f"({', '.join(newer)}): resuming from before {name} would train those steps again and overwrite them; "
            f"point {pointer} at the one to continue (echo {newer[-1]} > {pointer}) or move them aside too")
    older = [(s, p) for s, p in _step_entries(root) if s < step]
    if not older:
        raise CheckpointError(f"{pointer} names {name}, which was moved aside ({', '.join(moved)}), and no earlier "
                              "checkpoint is left: restore it, or start a new run with a new training.output_dir")
    previous = older[-1][1]
    problems = [f"{previous}: not a directory"] if not previous.is_dir() else checkpoint_problems(previous)
    if problems:
        raise damaged_checkpoint_error(previous, problems)
    return ResumeTarget(previous, f"resume: {name} (named by {pointer}) was moved aside ({', '.join(moved)}): "
                                  f"continuing from {previous.name}")


def _saved_after_pointer(pointer: Path, name: str, newest: Path) -> ResumeTarget | None:
    """The step ``newest`` (newer than the one ``pointer`` names) to continue from when it is what an interrupted
    save leaves: complete, and its ``metadata.json`` (written by the save before it renames the step and rewrites
    the pointer) not older than the pointer, both by the file system's clock; else None (damaged, or the pointer
    was written after it: someone chose an older step, which :func:`resume_target` refuses to guess about)."""
    try:
        if not newest.is_dir() or checkpoint_problems(newest) or not saved_after_pointer(pointer, newest):
            return None
    except (OSError, CheckpointError):
        return None
    return ResumeTarget(newest, f"resume: {pointer} names {name}, but {newest.name} is newer, "
                                "complete and was saved after the pointer was written (a save stopped after it wrote "
                                f"the step, before it updated {pointer.name}): continuing from {newest.name}; to "
                                "continue from the older step instead, move the newer one(s) aside (mv "
                                f"{newest} {newest}.aside) and run with --resume again")


def resume_target(directory: str | os.PathLike) -> ResumeTarget | None:
    """The checkpoint ``--resume`` continues from ``directory``: the step ``latest`` names (without a
    ``latest``, the newest step), complete (readable ``metadata.json``, current format, every file there
    with its recorded size; contents are hashed when the ranks load it); None when the directory holds
    no checkpoint at all. Every kind of damage stops with a :class:`CheckpointError` naming it and the
    checkpoint to continue from instead (:func:`damaged_checkpoint_error`): a damaged or empty
    ``latest``, a step it names that is missing, not a directory or incomplete, a step newer than the
    one it names (unless that newest step is complete and was saved after ``latest`` was written: an
    interrupted save left ``latest`` behind, and the newest step is taken, with a note saying so). The one
    fallback is the user's own decision: a step moved aside (``step_N.damaged``) gives way to the newest
    older step (which must be complete), with a note saying so."""
    root = Path(directory)
    pointer = root / LATEST
    if not root.is_dir():
        return None
    if not pointer.exists() and not pointer.is_symlink():
        entries = _step_entries(root)
        if not entries:
            return None
        target = entries[-1][1]
    else:
        try:
            name = pointer.read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise _pointer_error(pointer, f"cannot be read ({exc.strerror if isinstance(exc, OSError) else exc})") \
                from None
        step = step_of(name)
        if step is None:
            shown = "is empty" if not name else f"holds {name[:60]!r}, not a step_NNNNNNNN name"
            raise _pointer_error(pointer, f"is damaged: it {shown}")
        target = root / name
        if not target.exists() and not target.is_symlink():
            return _moved_aside(pointer, name, step)
        newer = [p.name for s, p in _step_entries(root) if s > step]
        ahead = _saved_after_pointer(pointer, name, root / newer[-1]) if newer else None
        if ahead is not None:
            return ahead
        if newer:
            raise CheckpointError(
                f"{pointer} names {name} but {', '.join(newer)} is newer (and not a complete step saved after "
                f"{pointer.name} was written, which --resume would take: {pointer.name} was edited, or the step is "
                f"damaged): stormshard does not choose between them; to continue from {newer[-1]} "
                f"write its name into the pointer (echo {newer[-1]} > {pointer}), to continue from {name} move the "
                f"newer one(s) aside (mv {root / newer[-1]} {root / newer[-1]}.aside), then run with --resume again")
    if not target.is_dir():
        kind = "a file" if target.is_file() else "not a directory"
        raise damaged_checkpoint_error(target, [f"{target}: {kind}, not a checkpoint directory"])
    problems = checkpoint_problems(target)
    if problems:
        raise damaged_checkpoint_error(target, problems)
    return ResumeTarget(target)
