"""Upgrade checkpoints of the pickled format to the current one, in place.

Checkpoint format 1 (training) and consolidated version 1 stored the optimizer, scheduler, RNG and
data state as pickled python objects. This release reads them only here, behind an explicit command,
for one release, with ``torch.load(weights_only=True)`` and an allow-list of what those files hold
(:func:`~stormshard.checkpoint.state_codec.pickled_state_globals`: numpy arrays, scalars and dtypes,
DeepSpeed's plain-data classes): nothing in the file runs. A file that names anything else is an
error naming it, before any checkpoint is rewritten; only with ``--trust-model-code``
(``trust_pickles=True``) is it unpickled unrestricted, which runs code from the file::

    python launch/convert_checkpoint.py upgrade runs/old/checkpoints   # every step_NNNNNNNN in it
    python launch/convert_checkpoint.py upgrade runs/old/checkpoints/step_00000120
    python launch/convert_checkpoint.py upgrade runs/old/full          # a consolidated checkpoint

Each checkpoint is rewritten atomically (a temporary directory, then a rename over the old one):
its state files as tensors plus a JSON skeleton (:mod:`stormshard.checkpoint.state_codec`), every
other file copied byte for byte, and ``metadata.json`` with the new format and the size and sha256
of every file. The state is the same, bit for bit: ``--resume`` continues the run as before.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from stormshard.checkpoint.consolidate import CONSOLIDATED_FORMAT, CONSOLIDATED_VERSION, atomic_directory
from stormshard.checkpoint.errors import ConversionError
from stormshard.checkpoint.format import (
    FORMAT_VERSION,
    METADATA,
    PICKLED_FORMAT,
    CheckpointError,
    fsync_directory,
    list_checkpoints,
    rank_name,
    read_metadata,
)
from stormshard.checkpoint.integrity import FILES, record_files
from stormshard.checkpoint.state_codec import (
    UntrustedPickle,
    check_pickled_file,
    read_pickled_file,
    write_state_file,
)

__all__ = ["upgrade_checkpoints"]


def _targets(path: Path) -> list[Path]:
    if (path / METADATA).is_file():
        return [path]
    steps = list_checkpoints(path)
    if not steps:
        raise ConversionError(f"{path} is not a checkpoint: no {METADATA} in it and no complete step_NNNNNNNN "
                              "below it", fix="pass a run's checkpoints directory, a step_NNNNNNNN directory or a "
                                              "consolidated checkpoint")
    return steps


def _rewrite(step_dir: Path, meta: dict[str, Any], state_files: dict[str, Any], fields: dict[str, Any]) -> None:
    """``step_dir`` again: ``state_files`` (name -> state) in the new encoding, the other files copied,
    ``metadata.json`` updated with ``fields`` and the file records; atomically."""
    with atomic_directory(step_dir, overwrite=True) as tmp:
        for f in sorted(step_dir.iterdir()):
            if f.name == METADATA or f.name in state_files:
                continue
            if f.is_dir():
                shutil.copytree(f, tmp / f.name)
            else:
                shutil.copy2(f, tmp / f.name)
        for name, state in state_files.items():
            write_state_file(state, tmp / name)
        new = {**meta, **fields}
        new[FILES] = record_files(sorted(p for p in tmp.iterdir() if p.is_file()))
        (tmp / METADATA).write_text(json.dumps(new, indent=1))
        fsync_directory(tmp)


def _tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def _check_space(targets: list[Path], given: str | os.PathLike) -> None:
    """A :class:`ConversionError` before any rewrite when the file system cannot hold the largest checkpoint
    to upgrade twice over for a moment: each is rewritten as a full copy beside itself (tensors and JSON:
    about its size) before the old one is removed."""
    if not targets:
        return
    need = max(_tree_bytes(t) for t in targets)
    free = shutil.disk_usage(targets[0].parent).free
    if free < need * 1.1 + (64 << 20):
        raise ConversionError(
            f"cannot upgrade {given}: each checkpoint is rewritten as a copy beside itself before the old one is "
            f"removed, and the largest ({max(targets, key=_tree_bytes)}) takes {need / 2**20:,.0f} MiB while "
            f"{targets[0].parent} has {free / 2**20:,.0f} MiB free; nothing was changed",
            fix="free some space there (or upgrade a copy on a larger disk) and run the upgrade again")


def _pickled_files(target: Path, meta: Any) -> list[Path]:
    """The pickled state files of a checkpoint of format 1 or consolidated version 1 (those present)."""
    fmt = meta.get("format") if isinstance(meta, dict) else None
    if fmt == PICKLED_FORMAT and isinstance(meta.get("world_size"), int):
        names = [f"{rank_name(r)}.pt" for r in range(meta["world_size"])]
    elif fmt == CONSOLIDATED_FORMAT and meta.get("version") == 1:
        names = ["trainer.pt"] + (["optimizer.pt"] if meta.get("optimizer") else [])
    else:
        return []
    return [target / n for n in names if (target / n).is_file()]


def _upgrade_training(step_dir: Path, meta: dict[str, Any], trust: bool) -> None:
    world = meta.get("world_size")
    if not isinstance(world, int) or world < 1:
        raise ConversionError(f"{step_dir / METADATA} has world_size {world!r}: not a stormshard training checkpoint")
    problems, states = [], {}
    for r in range(world):
        f = step_dir / f"{rank_name(r)}.pt"
        if not f.is_file():
            problems.append(f"{f}: missing")
            continue
        try:
            payload = read_pickled_file(f, trust=trust)
        except CheckpointError as exc:
            problems.append(str(exc))
            continue
        if not isinstance(payload, dict) or payload.get("rank") != r or payload.get("step") != meta.get("step"):
            problems.append(f"{f}: does not hold rank {r} of step {meta.get('step')}")
            continue
        states[f.name] = {**payload, "format": FORMAT_VERSION}
    if problems:
        raise ConversionError(f"cannot upgrade {step_dir}: it is damaged", problems,
                              fix="upgrade an intact checkpoint (an earlier step_NNNNNNNN)")
    _rewrite(step_dir, meta, states, {"format": FORMAT_VERSION, "upgraded_from": PICKLED_FORMAT})


def _upgrade_consolidated(path: Path, meta: dict[str, Any], trust: bool) -> None:
    names = ["trainer.pt"] + (["optimizer.pt"] if meta.get("optimizer") else [])
    states = {}
    for name in names:
        try:
            states[name] = read_pickled_file(path / name, trust=trust)
        except CheckpointError as exc:
            raise ConversionError(f"cannot upgrade {path}: {exc}") from None
    _rewrite(path, meta, states, {"version": CONSOLIDATED_VERSION, "upgraded_from": 1})


def upgrade_checkpoints(path: str | os.PathLike, *, trust_pickles: bool = False) -> list[tuple[Path, str]]:
    """Upgrade the checkpoint(s) at ``path`` (a checkpoints directory: every complete step in it; a step
    directory; a consolidated checkpoint) to the current format, in place. Returns ``(path, what was
    done)`` per checkpoint. The pickled files are read with an allow-list; every file of every
    checkpoint is checked against it before the first is rewritten (a :class:`ConversionError` naming
    the file, the global and the opt-in); ``trust_pickles`` reads what it refuses unrestricted."""
    targets = []
    for target in _targets(Path(path)):
        try:
            targets.append((target, read_metadata(target)))
        except CheckpointError as exc:
            raise ConversionError(str(exc)) from None
    for target, meta in targets if not trust_pickles else ():
        for f in _pickled_files(target, meta):
            try:
                check_pickled_file(f)
            except UntrustedPickle as exc:
                raise ConversionError(
                    f"cannot upgrade {path}: {exc}; nothing was changed",
                    fix=f"only if you wrote this checkpoint yourself, unpickle it unrestricted (that runs code from "
                        f"the file): python launch/convert_checkpoint.py upgrade {path} --trust-model-code "
                        "(Python: upgrade_checkpoints(..., trust_pickles=True))") from None
    _check_space([t for t, m in targets if _pickled_files(t, m)], path)
    done = []
    for target, meta in targets:
        fmt = meta.get("format") if isinstance(meta, dict) else None
        if fmt == PICKLED_FORMAT:
            _upgrade_training(target, meta, trust_pickles)
            done.append((target, f"upgraded from format {PICKLED_FORMAT} to {FORMAT_VERSION}"))
        elif fmt == CONSOLIDATED_FORMAT and meta.get("version") == 1:
            _upgrade_consolidated(target, meta, trust_pickles)
            done.append((target, f"upgraded from consolidated version 1 to {CONSOLIDATED_VERSION}"))
        elif fmt in (FORMAT_VERSION, CONSOLIDATED_FORMAT):
            done.append((target, "already in the current format"))
        else:
            raise ConversionError(f"{target / METADATA} has format {fmt!r}: not a stormshard checkpoint")
    return done
