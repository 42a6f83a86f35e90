"""Atomic, per-rank training checkpoints that resume bit-exactly: saving and loading.

The on-disk format (directory layout, file names, ``metadata.json``, the parameter table, finding
the latest complete checkpoint) is :mod:`stormshard.checkpoint.format`, which conversion and
inference read without training; this module adds what needs a running job: the collective save,
the checks of a resume against the current layout and config, and the RNG states.

Saving (:func:`save_checkpoint`, called by every rank with its own ``state``):

1. rank 0 clears a stale ``step_NNNNNNNN.tmp`` and creates it; barrier;
2. every rank writes its files (each through a temporary name, fsync and ``os.replace``); barrier;
   Each rank records the size and sha256 of its files in its ``rank_NNNNN.json``;
3. rank 0 merges the parameter tables and the file records into ``metadata.json``, renames the
   ``.tmp`` directory to ``step_NNNNNNNN``, rewrites ``latest`` (temporary file, fsync, ``os.replace``,
   fsync of the directory: it holds the old name or the new one, never a partial one), and deletes all
   but the last ``keep_last`` checkpoints; barrier.

A crash anywhere before the rename leaves only a ``.tmp`` directory, which loading ignores, so
the previous checkpoint stays the latest. A full disk (or quota), any other ``OSError`` (``EIO``, a
permission, a directory fsync that fails for another reason than a file system without one), or any other
exception (a state the codec cannot store), on any rank while it creates the step, writes its files,
``metadata.json`` or renames the step stops every rank at the next barrier (which carries each rank's
problem) with the same error (a :class:`~stormshard.training.diskspace.DiskSpaceError` for a full disk)
naming the rank, the file and the cause: rank 0 removes the ``.tmp`` directory (its space is free again for
``--resume``; a step renamed but whose directory fsync failed goes too) and the message names the
checkpoint ``latest`` still names. When only ``latest`` cannot be rewritten, the step is complete
and kept: every rank stops with an error naming it, the pointer keeps its old name, no older checkpoint is
deleted, and ``--resume`` continues from the new step (a pointer written before the newest step was saved
gives way to it: :func:`~stormshard.checkpoint.integrity.resume_target`). :func:`load_checkpoint` reads the latest complete one,
checks the stored layout and config against the current ones (an error lists every difference),
verifies each rank's files against their recorded sha256 (a damaged file on any rank stops every
rank with the same error, naming the file and the previous complete checkpoint) and restores
python, numpy and torch RNG states.

Rank files hold tensors plus a JSON skeleton (:mod:`stormshard.checkpoint.state_codec`) and load
with ``torch.load(weights_only=True)``: opening a checkpoint runs no code from it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import shutil
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from stormshard.checkpoint.format import (
    FORMAT_VERSION,
    LATEST,
    METADATA,
    PICKLED_FORMAT,
    CheckpointError,
    fsync_directory,
    latest_checkpoint,
    list_checkpoints,
    parameter_table,
    pickled_format_error,
    rank_name,
    read_metadata,
    step_name,
)
from stormshard.checkpoint.integrity import FILES, checkpoint_problems, damaged_checkpoint_error, record_files
from stormshard.checkpoint.state_codec import read_state_file, write_state_file
from stormshard.errors import is_disk_full
from stormshard.training.diskspace import DiskSpaceError

__all__ = [
    "LoadedCheckpoint",
    "capture_rng_state",
    "restore_rng_state",
    "save_checkpoint",
    "load_checkpoint",
    "verify_resume_files",
    "config_differences",
]


# --------------------------------------------------------------------------------------------
# RNG
# --------------------------------------------------------------------------------------------


def capture_rng_state() -> dict[str, Any]:
    """The states of python's ``random``, numpy's global generator and torch's CPU (and CUDA)
    generators, as plain python objects and tensors."""
    np_state = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {"name": np_state[0], "keys": torch.from_numpy(np_state[1].astype(np.int64)),
                  "pos": int(np_state[2]), "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what :func:`capture_rng_state` captured."""
    random.setstate(_as_tuple(state["python"]))
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuple(x: Any) -> Any:
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


# --------------------------------------------------------------------------------------------
# metadata
# --------------------------------------------------------------------------------------------


def config_differences(stored: Any, current: Any, prefix: str = "") -> list[str]:
    """Dotted paths where two JSON-like values differ, e.g. ``["model.channels: 64 != 128"]``."""
    if isinstance(stored, Mapping) and isinstance(current, Mapping):
        out = []
        for key in sorted(set(stored) | set(current), key=str):
            path = f"{prefix}.{key}" if prefix else str(key)
            if key not in current:
                out.append(f"{path}: stored {stored[key]!r}, missing now")
            elif key not in stored:
                out.append(f"{path}: missing in the checkpoint, now {current[key]!r}")
            else:
                out.extend(config_differences(stored[key], current[key], path))
        return out
    if isinstance(stored, (list, tuple)) and isinstance(current, (list, tuple)) and len(stored) == len(current):
        out = []
        for i, (a, b) in enumerate(zip(stored, current, strict=True)):
            out.extend(config_differences(a, b, f"{prefix}[{i}]"))
        return out
    return [] if stored == current else [f"{prefix or '<root>'}: stored {stored!r}, now {current!r}"]


def _jsonable(x: Any) -> Any:
    """Round-trip through JSON so stored and current configs compare alike (tuples become lists)."""
    return json.loads(json.dumps(x, default=str))


# --------------------------------------------------------------------------------------------
# paths and atomic writes
# --------------------------------------------------------------------------------------------


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    """``data`` into ``path`` through a temporary name, fsynced before the rename: ``path`` holds its old
    contents or ``data``, never part of it; a failed write leaves no temporary file behind."""
    tmp = path.with_name(path.name + ".part")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def _write_torch(obj: Any, path: Path) -> None:
    """``obj`` as tensors plus a JSON skeleton (:func:`~stormshard.checkpoint.state_codec.write_state_file`)
    through a temporary name (a crash leaves no half-written ``path``)."""
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "wb") as f:
        write_state_file(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _write_safetensors(model: nn.Module, path: Path, metadata: dict[str, str]) -> None:
    from safetensors.torch import save_file

    tensors = {k: v.detach().contiguous().cpu().clone() for k, v in model.state_dict().items() if isinstance(v, Tensor)}
    tmp = path.with_name(path.name + ".part")
    save_file(tensors, str(tmp), metadata=metadata)
    with open(tmp, "rb") as f:  # on the disk before the rename, as every other file of the checkpoint
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _shared(problems: list[Any], group: Any, world: int) -> list[Any]:
    """:func:`_gather` as the save's barrier: every rank's ``problems`` on every rank of the save, so that one
    rank's full disk or I/O error stops every rank with the same error instead of leaving the others waiting."""
    if world > 1 and not dist.is_initialized():
        raise CheckpointError(f"world={world} but torch.distributed is not initialised: cannot synchronise ranks")
    return _gather(problems, world, group)


_WRITE, _POINTER = "write", "latest"  # the two phases of a save a problem can belong to
_FULL, _OS, _OTHER = "full", "os", "other"  # what a problem is: a full disk, another OSError, anything else


@dataclass(frozen=True)
class _Problem:
    """One rank's failure in a save, as every rank of the save receives it."""

    phase: str  # _WRITE or _POINTER
    kind: str  # _FULL, _OS or _OTHER
    line: str  # "rank 1: <cause> writing <file>"


def _problem(phase: str, exc: BaseException, rank: int, writing: Path) -> _Problem:
    """The :class:`_Problem` of ``exc``, met while rank ``rank`` wrote ``writing``: its line names the rank, the
    cause (the OS error; any other exception's type and first line, e.g. a state the codec cannot store) and the
    path (an ``OSError``'s own file name, else the file being written)."""
    full = is_disk_full(exc)
    if isinstance(exc, OSError):
        reason = exc.strerror or str(exc) or type(exc).__name__
        code = errno.errorcode.get(exc.errno or 0)
        if code and not full:
            reason += f" ({code})"
        where = exc.filename or writing
        kind = _FULL if full else _OS
    elif full:  # torch.save's RuntimeError of a failed write
        reason, where, kind = "no space left on device", writing, _FULL
    else:
        first = (str(exc).strip().splitlines() or [""])[0]
        reason, where, kind = f"{type(exc).__name__}: {first}".rstrip(": "), writing, _OTHER
    return _Problem(phase, kind, f"rank {rank}: {reason} writing {where}")


def _current_latest(root: Path) -> str:
    """What ``latest`` names now, for a message."""
    try:
        name = (root / LATEST).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return "what it named before (or nothing: this is the run's first checkpoint)"
    return name or "nothing"


def _fix(problems: list[_Problem], full: bool) -> str:
    """What the user does about ``problems`` before ``--resume``."""
    if full:
        return "free space (or lower training.keep_checkpoints, or point training.output_dir at a larger file system)"
    if any(p.kind == _OTHER for p in problems):
        return ("fix what that error says (it is not the file system: a state the checkpoint cannot store, or a bug; "
                "rerun with --debug for the traceback on the rank named)")
    return "fix what that OS error says about the file system (its permissions, the device)"


def _stop_if_failed(problems: list[_Problem], root: Path, tmp: Path, final: Path, step: int, rank: int,
                    own: BaseException | None) -> None:
    """After a failure on any rank (``problems``, gathered), every rank raises the same error (``from`` its own
    exception ``own``, if it had one): a :class:`DiskSpaceError` when every problem is a full disk (or quota),
    else a :class:`CheckpointError`.

    A problem while the checkpoint's files were written or the step renamed: rank 0 removes what was written
    of it (every rank is past its writes) and the error names the checkpoint ``latest`` still names, which
    ``--resume`` continues. A problem only with ``latest``: the step is complete and stays; the error names
    it and says how ``--resume`` continues from it."""
    if not problems:
        return
    lines = "; ".join(p.line for p in problems)
    full = all(p.kind == _FULL for p in problems)
    error = DiskSpaceError if full else CheckpointError
    what = "the disk is full: " if full else ""
    fix = _fix(problems, full)
    if any(p.phase == _WRITE for p in problems):
        if rank == 0:
            _remove_tree(tmp)
        last = latest_checkpoint(root)
        kept = (f"the last complete checkpoint is {last}: {fix}, then run with --resume to continue from it"
                if last is not None else f"no checkpoint was saved yet: {fix}, and start the run again in a new "
                "training.output_dir (or delete this one)")
        raise error(f"training.output_dir: {what}the checkpoint of step {step} could not be written in {root} "
                    f"({lines}); what was written of it is removed and {kept}") from own
    pointer = root / LATEST
    current = _current_latest(root)
    names = (f"{pointer.name} still names {current} (it is replaced whole or not at all)" if current != final.name
             else f"{pointer.name} names it, but the file system did not confirm that on the disk")
    fix = "free space there" if full else fix
    raise error(f"training.output_dir: {what}the checkpoint of step {step} is saved, complete, as {final}, but "
                f"{pointer} could not be rewritten to name it ({lines}): {names} and no older checkpoint was deleted. "
                f"The run stops here: {fix}, then run with --resume, which continues from {final.name}, the newest "
                f"complete checkpoint in {root} (or write its name into the pointer first: echo {final.name} > "
                f"{pointer})") from own


def _remove_tree(path: Path) -> None:
    """Remove ``path`` (a directory tree, or a file or link left there); never raises."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


def _put_in_place(tmp: Path, final: Path) -> None:
    """Rename the complete ``tmp`` to ``final``; a step saved again moves its old copy aside first (and back
    if the rename fails), deleted by the caller once the new one is in place."""
    if not final.exists():
        os.replace(tmp, final)
        return
    old = final.with_name(final.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    os.replace(final, old)
    try:
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            os.replace(old, final)
        raise


def _take_back(tmp: Path, final: Path) -> None:
    """Undo :func:`_put_in_place` (its rename was not confirmed on the disk): ``final`` back to ``tmp``, for
    removal, and a step saved again gets its old copy back."""
    old = final.with_name(final.name + ".old")
    with contextlib.suppress(OSError):
        os.replace(final, tmp)
        if old.is_dir():
            os.replace(old, final)


# --------------------------------------------------------------------------------------------
# save / load
# --------------------------------------------------------------------------------------------


def save_checkpoint(
    directory: str | os.PathLike,
    step: int,
    state: dict[str, Any],
    config: Mapping[str, Any],
    layout: Mapping[str, Any],
    rank: int,
    world: int,
    *,
    model: nn.Module | None = None,
    keep_last: int | None = 3,
    weights_safetensors: bool = True,
    group: Any = None,
) -> Path:
    """Write this rank's ``state`` (engine state, data position...: tensors and plain values, see
    :mod:`stormshard.checkpoint.state_codec`) plus its RNG states into checkpoint ``step``;
    collective over ``group`` (default: world).

    ``model`` (optional) adds its parameter table (names, shapes, Partition) to the metadata and,
    with ``weights_safetensors``, its weights as ``rank_NNNNN.safetensors``. ``keep_last`` complete
    checkpoints are kept (None: all). Returns the final checkpoint path. A failure on any rank (an
    ``OSError``, a state the codec cannot store, anything else) stops every rank with one error.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"step must be a non-negative int, got {step!r}")
    if not 0 <= rank < world:
        raise CheckpointError(f"rank {rank} is outside a world of {world} ranks")
    if keep_last is not None and keep_last < 1:
        raise CheckpointError(f"keep_last must be >= 1 or None (keep all), got {keep_last}")
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict, got {type(state).__name__}")
    config_json, layout_json = _jsonable(dict(config)), _jsonable(dict(layout))
    root = Path(directory)
    final = root / step_name(step)
    tmp = root / (step_name(step) + ".tmp")
    problems: list[_Problem] = []
    own: BaseException | None = None
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            _remove_tree(tmp)  # left by a crashed save
            tmp.mkdir()
        except Exception as exc:  # noqa: BLE001 - every rank stops with it
            problems, own = [_problem(_WRITE, exc, rank, tmp)], exc
    _stop_if_failed(_shared(problems, group, world), root, tmp, final, step, rank, own)

    name = rank_name(rank)
    writing = tmp / f"{name}.pt"
    try:
        table = parameter_table(model) if model is not None else None
        _write_torch({"format": FORMAT_VERSION, "step": step, "rank": rank, "world": world, "state": state,
                      "rng": capture_rng_state()}, writing)
        if model is not None and weights_safetensors:
            writing = tmp / f"{name}.safetensors"
            _write_safetensors(model, writing, {"step": str(step), "rank": str(rank)})
        writing = tmp / f"{name}.json"
        files = record_files([tmp / f"{name}.pt", tmp / f"{name}.safetensors"])
        _atomic_write_bytes(writing, json.dumps({"rank": rank, "parameters": table, FILES: files}).encode())
    except Exception as exc:  # noqa: BLE001 - an OSError, the codec's TypeError...: every rank stops with it
        problems, own = [_problem(_WRITE, exc, rank, writing)], exc
    # the barrier: every rank wrote its files; one rank's failure stops every rank
    _stop_if_failed(_shared(problems, group, world), root, tmp, final, step, rank, own)

    if rank == 0:
        writing, placed = tmp / METADATA, False
        try:
            ranks, records = [], {}
            for r in range(world):
                table_file = tmp / f"{rank_name(r)}.json"
                entry = json.loads(table_file.read_text())
                records.update(entry.pop(FILES, {}))
                records.update(record_files([table_file]))
                ranks.append(entry)
            metadata = {
                "format": FORMAT_VERSION, "step": step, "world_size": world, "time": time.time(),
                "layout": layout_json, "config": config_json, "ranks": ranks, FILES: records,
            }
            _atomic_write_bytes(writing, json.dumps(metadata, indent=1).encode())
            writing = tmp
            fsync_directory(tmp)
            writing = final
            _put_in_place(tmp, final)
            placed, writing = True, root
            fsync_directory(root)
        except Exception as exc:  # noqa: BLE001 - every rank stops with it
            if placed:  # the rename is not on the disk for sure: the step goes, as if its writes had failed
                _take_back(tmp, final)
            problems, own = [_problem(_WRITE, exc, rank, writing)], exc
        if not problems:  # a step saved again: its old copy (kept if the new one is not in place)
            shutil.rmtree(final.with_name(final.name + ".old"), ignore_errors=True)
    if rank == 0 and not problems:
        try:  # the step is complete and in place: a failure from here on keeps it
            writing = root / LATEST
            _atomic_write_bytes(writing, (final.name + "\n").encode())
            writing = root
            fsync_directory(root)
        except Exception as exc:  # noqa: BLE001 - every rank stops with it
            problems, own = [_problem(_POINTER, exc, rank, writing)], exc
        if keep_last is not None and not problems:  # not while `latest` may still name an older one
            for old in list_checkpoints(root)[:-keep_last]:
                if old != final:
                    shutil.rmtree(old, ignore_errors=True)
    # rank 0's failure stops every rank
    _stop_if_failed(_shared(problems, group, world), root, tmp, final, step, rank, own)
    return final


@dataclass(frozen=True)
class LoadedCheckpoint:
    """What :func:`load_checkpoint` returns: this rank's ``state`` and the checkpoint's metadata."""

    path: Path
    step: int
    state: dict[str, Any]
    metadata: dict[str, Any]


def load_checkpoint(
    directory: str | os.PathLike,
    rank: int,
    *,
    config: Mapping[str, Any] | None = None,
    layout: Mapping[str, Any] | None = None,
    world: int | None = None,
    ignore: Iterable[str] = (),
    restore_rng: bool = True,
    path: str | os.PathLike | None = None,
    map_location: Any = "cpu",
    read_stored_config: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None,
) -> LoadedCheckpoint:
    """Load this rank's part of the latest complete checkpoint in ``directory`` (or of ``path``).

    When given, ``world``, ``layout`` and ``config`` must equal the stored ones, except for config
    paths starting with one of ``ignore`` (e.g. ``"training.max_steps"``); the error lists every
    difference. ``read_stored_config`` turns the stored config into the form ``config`` has (e.g.
    old spellings of a checkpoint written by an earlier release moved to their one home) before
    the comparison. RNG states are restored unless ``restore_rng=False``.

    This rank's files are checked against the sha256 recorded at save before they are read; when
    all ranks of the checkpoint's world load it together (a process group of that size), their
    problems are gathered, so a damaged file stops every rank with one message naming it and the
    previous complete checkpoint.
    """
    target = Path(path) if path is not None else latest_checkpoint(directory)
    if target is None:
        raise CheckpointError(f"no complete checkpoint in {directory}: nothing to resume (start without --resume)")
    metadata = read_metadata(target)
    if metadata.get("format") == PICKLED_FORMAT:
        raise pickled_format_error(target.parent if path is None else target)
    problems = []
    if world is not None and metadata["world_size"] != world:
        problems.append(f"world_size: stored {metadata['world_size']}, now {world}")
    if layout is not None:
        problems += [f"layout.{d}" for d in config_differences(metadata["layout"], _jsonable(dict(layout)))]
    if config is not None:
        ignored = tuple(ignore)
        stored = metadata["config"] if read_stored_config is None else read_stored_config(metadata["config"])
        diffs = config_differences(_jsonable(dict(stored)), _jsonable(dict(config)))
        problems += [f"config.{d}" for d in diffs if not (ignored and d.startswith(ignored))]
    if problems:
        raise CheckpointError(
            f"checkpoint {target} does not match this run:\n  " + "\n  ".join(problems)
            + "\nresume with the stored layout and config (or convert the checkpoint to the new layout)"
        )
    if not 0 <= rank < metadata["world_size"]:
        raise CheckpointError(f"rank {rank} is outside the checkpoint's world of {metadata['world_size']} ranks")
    payload, problem = _read_rank(target, rank, int(metadata["step"]), map_location)
    problems = _gather(problem, int(metadata["world_size"]))
    if problems:
        raise damaged_checkpoint_error(target, problems)
    if restore_rng:
        restore_rng_state(payload["rng"])
    return LoadedCheckpoint(target, int(metadata["step"]), payload["state"], metadata)


def verify_resume_files(target: str | os.PathLike, rank: int, world: int) -> None:
    """Before a resumed run writes anything (its ``config.json`` included): this rank's files of the
    checkpoint ``target`` against the sha256 recorded at save (rank ``r`` hashes rank ``r``'s files,
    so no file is read twice); the problems of every rank are gathered (all ``world`` ranks call it
    together), so a damaged file, or a corrupted checksum record, on any rank stops every rank with one
    :func:`~stormshard.checkpoint.integrity.damaged_checkpoint_error` naming it and the previous complete
    checkpoint."""
    target = Path(target)
    problems = _gather(checkpoint_problems(target, contents=True, ranks=[rank]), world)
    if problems:
        raise damaged_checkpoint_error(target, problems)


def _read_rank(target: Path, rank: int, step: int, map_location: Any) -> tuple[dict[str, Any] | None, list[str]]:
    """This rank's payload, or the problems of its files (sha256 against the recorded ones, then reading)."""
    problems = checkpoint_problems(target, contents=True, ranks=[rank])
    if problems:
        return None, problems
    rank_file = target / f"{rank_name(rank)}.pt"
    try:
        payload = read_state_file(rank_file, map_location=map_location)
    except CheckpointError as exc:
        return None, [str(exc)]
    if not isinstance(payload, dict) or payload.get("rank") != rank or payload.get("step") != step or \
            not {"state", "rng"} <= set(payload):
        got = (payload.get("rank"), payload.get("step")) if isinstance(payload, dict) else type(payload).__name__
        return None, [f"{rank_file}: holds (rank, step) {got}, expected ({rank}, {step})"]
    return payload, []


def _gather(problems: list[str], world: int, group: Any = None) -> list[str]:
    """Every rank's ``problems`` (on every rank), when all ``world`` ranks of ``group`` (None: the world) save or
    load the checkpoint together; one rank's damaged file or full disk then stops all of them with the same
    message. Otherwise (one process, or a checkpoint read by another world) this rank's own."""
    if world > 1 and dist.is_initialized() and dist.get_world_size(group) == world:
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, problems, group=group)
        return [p for rank_problems in everyone for p in rank_problems]
    return problems
