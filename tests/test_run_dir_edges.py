"""A training run's files over its lifetime (the fourth audit): starting in a folder that holds something,
a save that fails half-way, ``--resume``, and the end of a run.

- A full disk (or quota) while a checkpoint is written, in a rank file or in ``metadata.json``: every rank
  stops with one ``error:`` naming the step, the checkpoints folder and the last complete checkpoint; the
  half-written ``step_NNNNNNNN.tmp`` is removed (its space is free for ``--resume``), ``latest`` and the
  previous checkpoint stay (even with ``training.keep_checkpoints=1``), and ``--resume`` continues from it.
  (It used to be ``error: the disk is full ... writing the output`` with the partial step left behind, and
  a full disk on a rank other than 0 left rank 0 waiting at the save's barrier.)
- A full disk (or another ``OSError``) while ``latest`` is rewritten, after the step was renamed into place: every
  rank stops with one ``error:`` naming the saved step (complete, kept), the folder and ``--resume``; ``latest``
  keeps its old name (no ``latest.part`` left), no older checkpoint is deleted, and ``--resume`` continues from
  the new step, saying so. (It used to be ``error: the disk is full ... writing the output``, with
  ``latest.part`` left behind, the other ranks waiting at the save's barrier, and ``--resume`` refusing to
  choose between ``latest`` and the newer step.)
- Any other I/O error (``EIO``, a permission) on any rank while it writes its files stops every rank with one
  error naming that rank, the file, the OS error and the last complete checkpoint, the ``.tmp`` step removed.
  (It used to be raised by the failing rank only, reported by the rank monitor as a rank that stopped.) So does
  any other exception there (a state the codec cannot store: it used to leave the ``.tmp`` step, exit 1 and
  leave the other ranks to the rank monitor), rank 0 failing to create the ``.tmp`` step, and a directory
  fsync that fails with ``EIO`` (it used to be ignored, whatever the error; only a file system without
  directory fsync, ``EINVAL`` and the like, is skipped now); a step renamed into place whose folder fsync
  fails is removed again.
- ``--resume`` on a disk without room for the next checkpoint stops before ``config.json`` is rewritten and
  before ``metrics.jsonl`` loses the records past the checkpoint (both used to be rewritten first).
- A ``metadata.json`` without the ``config`` (or ``layout``, ``step``) a resume reads is a damaged checkpoint,
  named before any work (it used to be ``KeyError: 'config'`` after ``config.json`` was rewritten).
- A ``config.json`` in ``training.output_dir`` that is not a stormshard config is never overwritten; the
  config of an earlier start that never trained is replaced, and other files there are left alone.
- The weights file of a checkpoint is on the disk (fsync) before the step is renamed, as every other file.
- A failure in the final validation leaves the final checkpoint complete and ``latest`` on it; ``--resume``
  trains nothing and logs that validation once.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from collections import namedtuple
from pathlib import Path

import pytest
import torch

import stormshard.training.checkpoint as checkpoint_module
import stormshard.training.diskspace as diskspace
from stormshard.checkpoint.format import latest_checkpoint, list_checkpoints
from stormshard.checkpoint.integrity import checkpoint_problems
from stormshard.training.checkpoint import save_checkpoint
from stormshard.training.launch import run_training
from stormshard.training.loop import Trainer
from tests.bad_input_helpers import run_main
from tests.test_cli_errors import _one_process  # noqa: F401 - autouse: a one-process environment
from tests.tiny_run import tiny_config

pytestmark = pytest.mark.filterwarnings("ignore")


def _local(data: str, out: Path, **changes) -> dict:  # noqa: ANN003
    return tiny_config(data, out, **{"training.max_steps": 3, "training.checkpoint_interval": 1,
                                     "training.keep_checkpoints": 3, "data.validation_samples": 1,
                                     "engine": "local", "deepspeed": {}, **changes})


def _hashes(root: Path) -> dict[str, str]:
    """The sha256 of every file under ``root`` (directories as ''), by relative path."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else ""
            for p in sorted(root.rglob("*"))}


def _train(tmp_path: Path, cfg: dict, capsys, *args: str) -> tuple[int, str]:
    """``launch/train.py`` in-process with ``cfg``; its exit status and standard error."""
    config = tmp_path / "config_in.json"
    config.write_text(json.dumps(cfg))
    capsys.readouterr()
    code = run_main("train", ["--config", str(config), *args])
    return code, capsys.readouterr().err


def _one_error(err: str, *fragments: str) -> None:
    assert "Traceback" not in err and len([line for line in err.splitlines() if "error:" in line]) == 1, err
    for fragment in fragments:
        assert fragment in err, f"{fragment!r} not in:\n{err}"


def _disk_full() -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # as write() raises it: no file name


# ------------------------------------------------------------------------------ a save that fails half-way


@pytest.mark.parametrize("where", ["rank-file", "metadata"])
def test_a_full_disk_in_a_save_keeps_the_previous_checkpoint_and_removes_the_partial_one(dataset, tmp_path, capsys,
                                                                                        monkeypatch, where):
    run = tmp_path / "run"
    cfg = _local(dataset, run, **{"training.keep_checkpoints": 1})
    real_torch, real_bytes = checkpoint_module._write_torch, checkpoint_module._atomic_write_bytes

    def write_torch(obj, path: Path) -> None:  # noqa: ANN001
        if where == "rank-file" and path.parent.name == "step_00000002.tmp":
            path.with_name(path.name + ".part").write_bytes(b"\0" * 4096)  # what a full disk leaves
            raise _disk_full()
        real_torch(obj, path)

    def write_bytes(path: Path, data: bytes) -> None:
        if where == "metadata" and path.parent.name == "step_00000002.tmp" and path.name == "metadata.json":
            raise _disk_full()
        real_bytes(path, data)

    monkeypatch.setattr(checkpoint_module, "_write_torch", write_torch)
    monkeypatch.setattr(checkpoint_module, "_atomic_write_bytes", write_bytes)
    code, err = _train(tmp_path, cfg, capsys)
    checkpoints = run / "checkpoints"
    assert code == 2, err
    _one_error(err, "the disk is full", "checkpoint of step 2 could not be written", str(checkpoints),
               f"the last complete checkpoint is {checkpoints / 'step_00000001'}", "--resume")
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step_00000001"]  # no .tmp left behind
    assert latest_checkpoint(checkpoints).name == "step_00000001"
    monkeypatch.undo()
    result = run_training(cfg, resume=True)  # the disk has room again: steps 2 and 3
    assert len(result.losses) == 2 and Path(result.checkpoint).name == "step_00000003"
    assert [p.name for p in list_checkpoints(checkpoints)] == ["step_00000003"]


def _save_with_a_full_disk_on_rank_1(rank: int, world: int, directory: str) -> str:
    """Save step 1, then step 2 with rank 1's disk full; what each rank raised at step 2."""
    from stormshard.training.diskspace import DiskSpaceError

    def save(step: int) -> None:
        save_checkpoint(directory, step, {"x": torch.zeros(2)}, {}, {"world_size": world}, rank, world,
                        model=torch.nn.Linear(2, 2))

    def full(obj, path: Path) -> None:  # noqa: ANN001
        raise _disk_full()

    save(1)
    real = checkpoint_module._write_torch
    if rank == 1:
        checkpoint_module._write_torch = full
    try:
        save(2)
    except DiskSpaceError as exc:
        return str(exc)
    finally:
        checkpoint_module._write_torch = real
    return "no error"


def test_a_full_disk_on_one_rank_stops_every_rank_with_one_message(tmp_path):
    from tests.distributed import run_distributed

    messages = run_distributed(_save_with_a_full_disk_on_rank_1, 2, str(tmp_path), timeout=60)
    assert messages[0] == messages[1], messages  # not rank 0 waiting at a barrier for a rank that is gone
    assert "checkpoint of step 2 could not be written" in messages[0] and "rank 1: No space left" in messages[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000001"]


def _fsync_fails_for(name: str | None, when, error: OSError):  # noqa: ANN001, ANN202
    """An ``os.fsync`` that raises ``error`` for a file called ``name`` (None: every directory) while ``when()``
    (the data is written but not on the disk: what a full disk reports at fsync on NFS or with delayed
    allocation)."""
    real = os.fsync

    def fsync(fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        if (os.path.isdir(path) if name is None else os.path.basename(path) == name) and when():
            raise error
        real(fd)

    return fsync


def test_a_full_disk_writing_latest_keeps_the_saved_step_and_resume_continues_from_it(dataset, tmp_path, capsys,
                                                                                        monkeypatch):
    run = tmp_path / "run"
    checkpoints = run / "checkpoints"
    step_2 = checkpoints / "step_00000002"
    cfg = _local(dataset, run, **{"training.keep_checkpoints": 1})
    monkeypatch.setattr(os, "fsync", _fsync_fails_for("latest.part", step_2.is_dir, _disk_full()))
    code, err = _train(tmp_path, cfg, capsys)
    assert code == 2, err
    _one_error(err, "the disk is full", f"the checkpoint of step 2 is saved, complete, as {step_2}",
               f"{checkpoints / 'latest'} could not be rewritten", "No space left on device",
               "latest still names step_00000001", "no older checkpoint was deleted",
               "run with --resume, which continues from step_00000002")
    # the old name or the new one, never a partial one; the saved step kept and the previous one too (keep 1)
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step_00000001", "step_00000002"]
    assert (checkpoints / "latest").read_text() == "step_00000001\n"
    assert checkpoint_problems(step_2, contents=True) == []
    monkeypatch.undo()
    code, err = _train(tmp_path, _local(dataset, run, **{"training.keep_checkpoints": 1}), capsys, "--resume")
    assert code == 0, err
    assert "continuing from step_00000002" in err and "resumed from step 2" in err, err
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step_00000003"]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3]


def test_resume_takes_a_newer_complete_step_only_when_latest_is_older_than_it(tmp_path):
    from stormshard.checkpoint.format import CheckpointError, latest_checkpoint
    from stormshard.checkpoint.integrity import resume_target

    for step in (1, 2):
        save_checkpoint(tmp_path, step, {"x": torch.zeros(2)}, {}, {"world_size": 1}, 0, 1, keep_last=None)
    pointer = tmp_path / "latest"
    saved = (tmp_path / "step_00000002" / "metadata.json").stat().st_mtime_ns
    pointer.write_text("step_00000001\n")  # written after step 2 was saved: someone chose step 1
    os.utime(pointer, ns=(saved + 10**9, saved + 10**9))
    with pytest.raises(CheckpointError, match="names step_00000001 but step_00000002 is newer .* does not choose"):
        resume_target(tmp_path)
    assert latest_checkpoint(tmp_path).name == "step_00000001"  # conversion and inspect read the same step
    os.utime(pointer, ns=(saved - 10**9, saved - 10**9))  # older than step 2: a save stopped before rewriting it
    found = resume_target(tmp_path)
    assert found.path.name == "step_00000002" and "continuing from step_00000002" in found.note, found
    assert latest_checkpoint(tmp_path).name == "step_00000002"  # as --resume: conversion reads what resume trains
    (tmp_path / "step_00000002" / "rank_00000.pt").write_bytes(b"")  # a damaged newer step is never taken
    with pytest.raises(CheckpointError, match="does not choose"):
        resume_target(tmp_path)


def _save_with_io_errors(rank: int, world: int, directory: str) -> list[tuple[str, str, list[str]]]:
    """Save step 1, then: step 2 with an I/O error on rank 1 (its rank file, no file name), step 3 with a
    permission refused on rank 1 (its weights, named), step 4 with rank 0's ``latest`` not written (EIO at
    fsync). Per failed step: the error class, the message, and the folder after it (rank 0, past its cleanup)."""
    from stormshard.checkpoint.format import CheckpointError

    root = Path(directory)
    real_torch, real_weights, real_fsync = (checkpoint_module._write_torch, checkpoint_module._write_safetensors,
                                            os.fsync)

    def save(step: int) -> None:
        save_checkpoint(directory, step, {"x": torch.zeros(2)}, {}, {"world_size": world}, rank, world,
                        model=torch.nn.Linear(2, 2), keep_last=1)

    def eio(obj, path: Path) -> None:  # noqa: ANN001
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    def refused(model, path: Path, metadata) -> None:  # noqa: ANN001
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path.with_name(path.name + ".part")))

    out = []
    save(1)
    for step, fault in ((2, "eio"), (3, "refused"), (4, "latest")):
        if rank == 1 and fault == "eio":
            checkpoint_module._write_torch = eio
        if rank == 1 and fault == "refused":
            checkpoint_module._write_safetensors = refused
        if rank == 0 and fault == "latest":
            os.fsync = _fsync_fails_for("latest.part", lambda: True, OSError(errno.EIO, os.strerror(errno.EIO)))
        try:
            save(step)
            out.append(("none", "no error", []))
        except CheckpointError as exc:
            out.append((type(exc).__name__, str(exc), sorted(p.name for p in root.iterdir())))
        finally:
            checkpoint_module._write_torch, checkpoint_module._write_safetensors = real_torch, real_weights
            os.fsync = real_fsync
    return out


def test_an_io_error_on_one_rank_stops_every_rank_with_one_message(tmp_path):
    from tests.distributed import run_distributed

    results = run_distributed(_save_with_io_errors, 2, str(tmp_path), timeout=60)
    assert [(kind, text) for kind, text, _ in results[0]] == [(kind, text) for kind, text, _ in results[1]], results
    (eio, eio_text, eio_left), (refused, refused_text, refused_left), (latest, latest_text, latest_left) = results[0]
    last = f"the last complete checkpoint is {tmp_path / 'step_00000001'}"
    assert eio == "CheckpointError" and "the disk is full" not in eio_text, eio_text
    for fragment in ("checkpoint of step 2 could not be written", "rank 1: Input/output error (EIO) writing "
                     f"{tmp_path / 'step_00000002.tmp' / 'rank_00001.pt'}", "what was written of it is removed",
                     last, "--resume"):
        assert fragment in eio_text, eio_text
    assert "rank 1: Permission denied (EACCES) writing " \
           f"{tmp_path / 'step_00000003.tmp' / 'rank_00001.safetensors.part'}" in refused_text, refused_text
    assert last in refused_text, refused_text
    assert eio_left == refused_left == ["latest", "step_00000001"]  # no .tmp; latest and step 1 kept (keep 1)
    assert (tmp_path / "latest").read_text() == "step_00000001\n"
    assert latest == "CheckpointError" and "Input/output error (EIO) writing" in latest_text, latest_text
    assert f"the checkpoint of step 4 is saved, complete, as {tmp_path / 'step_00000004'}" in latest_text
    assert latest_left == ["latest", "step_00000001", "step_00000004"]


def _save_with_other_failures(rank: int, world: int, directory: str) -> list[tuple[str, str, list[str], str]]:
    """Save step 1, then: step 2 with a state rank 1's codec cannot store (its TypeError), step 3 with EIO at the
    fsync of ``step_00000003.tmp``, step 4 with EIO at the fsync of the folder after the rename, step 5 with
    rank 0 refused creating ``step_00000005.tmp``, step 6 on a file system that syncs no directory (EINVAL),
    step 7 with EIO at the fsync of the folder after ``latest`` was rewritten. Per step: the error class (or
    "none"), the message, the folder after it and what ``latest`` names."""
    from stormshard.checkpoint.format import CheckpointError

    root = Path(directory)
    real_fsync, real_mkdir = os.fsync, Path.mkdir
    eio = OSError(errno.EIO, os.strerror(errno.EIO))

    def refused(self: Path, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        if self.name == "step_00000005.tmp":
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        real_mkdir(self, *args, **kwargs)

    def pointer_names(step: int) -> bool:
        return (root / "latest").read_text() == f"step_{step:08d}\n"

    faults = {3: (0, _fsync_fails_for("step_00000003.tmp", lambda: True, eio)),
              4: (0, _fsync_fails_for(root.name, lambda: (root / "step_00000004").is_dir() and pointer_names(1), eio)),
              6: (0, _fsync_fails_for(None, lambda: True, OSError(errno.EINVAL, os.strerror(errno.EINVAL)))),
              7: (0, _fsync_fails_for(root.name, lambda: pointer_names(7), eio))}
    out = []
    save_checkpoint(directory, 1, {"x": torch.zeros(2)}, {}, {"world_size": world}, rank, world,
                    model=torch.nn.Linear(2, 2), keep_last=1)
    for step in range(2, 8):
        state = {"x": torch.zeros(2), "sampler": object() if step == 2 and rank == 1 else 0}
        if step in faults and rank == faults[step][0]:
            os.fsync = faults[step][1]
        if step == 5 and rank == 0:
            Path.mkdir = refused
        try:
            save_checkpoint(directory, step, state, {}, {"world_size": world}, rank, world,
                            model=torch.nn.Linear(2, 2), keep_last=1)
            out.append(("none", "no error", [], ""))
        except CheckpointError as exc:
            out.append((type(exc).__name__, str(exc), sorted(p.name for p in root.iterdir()),
                        (root / "latest").read_text().strip()))
        finally:
            os.fsync, Path.mkdir = real_fsync, real_mkdir
    return out


def test_any_failure_of_a_save_on_one_rank_stops_every_rank_with_one_message(tmp_path):
    from tests.distributed import run_distributed

    results = run_distributed(_save_with_other_failures, 2, str(tmp_path), timeout=60)
    assert [r[:2] for r in results[0]] == [r[:2] for r in results[1]], results  # the same error on both ranks
    codec, dir_tmp, dir_root, mkdir, einval, pointer = results[0]
    last = f"the last complete checkpoint is {tmp_path / 'step_00000001'}"
    for (kind, text, left, latest), fragment in (
            (codec, "rank 1: TypeError: checkpoint state at state/sampler: a builtins.object cannot be stored without "
                    f"pickle; store it as tensors and plain values, or add its class to stormshard.checkpoint."
                    f"state_codec.STATE_CLASSES if it is plain data writing {tmp_path / 'step_00000002.tmp'}"),
            (dir_tmp, f"rank 0: Input/output error (EIO) writing {tmp_path / 'step_00000003.tmp'}"),
            (dir_root, f"rank 0: Input/output error (EIO) writing {tmp_path}"),
            (mkdir, f"rank 0: Permission denied (EACCES) writing {tmp_path / 'step_00000005.tmp'}")):
        assert kind == "CheckpointError" and fragment in text and last in text, text
        assert "could not be written" in text and "what was written of it is removed" in text, text
        assert left == ["latest", "step_00000001"] and latest == "step_00000001", (left, latest)  # nothing pruned
    assert "--debug for the traceback on the rank named" in codec[1], codec[1]
    assert einval[0] == "none", einval  # a file system without directory fsync saves as before
    kind, text, left, latest = pointer
    assert kind == "CheckpointError" and f"is saved, complete, as {tmp_path / 'step_00000007'}" in text, text
    assert "latest names it, but the file system did not confirm that on the disk" in text, text
    assert left == ["latest", "step_00000006", "step_00000007"] and latest == "step_00000007", (left, latest)


def test_a_state_the_codec_cannot_store_keeps_the_previous_checkpoint_and_resume_continues(dataset, tmp_path,
                                                                                           capsys, monkeypatch):
    run = tmp_path / "run"
    cfg = _local(dataset, run, **{"training.keep_checkpoints": 1})
    real = checkpoint_module._write_torch

    def write_torch(obj, path: Path) -> None:  # noqa: ANN001
        if path.parent.name == "step_00000002.tmp":  # e.g. a component whose state_dict holds an object
            obj = {**obj, "state": {**obj["state"], "scheduler": object()}}
        real(obj, path)

    monkeypatch.setattr(checkpoint_module, "_write_torch", write_torch)
    code, err = _train(tmp_path, cfg, capsys)
    checkpoints = run / "checkpoints"
    assert code == 2, err
    _one_error(err, "checkpoint of step 2 could not be written", "rank 0: TypeError: checkpoint state at "
               "state/scheduler: a builtins.object cannot be stored without pickle",
               str(checkpoints / "step_00000002.tmp" / "rank_00000.pt"),
               f"the last complete checkpoint is {checkpoints / 'step_00000001'}", "--resume")
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step_00000001"]  # no .tmp left behind
    assert (checkpoints / "latest").read_text() == "step_00000001\n"
    monkeypatch.undo()
    result = run_training(cfg, resume=True)
    assert len(result.losses) == 2 and Path(result.checkpoint).name == "step_00000003"


def test_upgrade_on_a_file_system_without_directory_fsync(tmp_path, monkeypatch):
    """``upgrade`` fsyncs each rewritten step directory; a file system that cannot (EINVAL) used to fail it."""
    from stormshard.checkpoint.upgrade import upgrade_checkpoints
    from tests.test_checkpoint import to_pickled_format

    save_checkpoint(tmp_path, 1, {"x": torch.zeros(2)}, {}, {"world_size": 1}, 0, 1, model=torch.nn.Linear(2, 2))
    to_pickled_format(tmp_path / "step_00000001")
    monkeypatch.setattr(os, "fsync", _fsync_fails_for(None, lambda: True, OSError(errno.EINVAL,
                                                                                   os.strerror(errno.EINVAL))))
    assert [what for _, what in upgrade_checkpoints(tmp_path)] == ["upgraded from format 1 to 2"]
    monkeypatch.undo()
    assert checkpoint_problems(tmp_path / "step_00000001", contents=True) == []


def test_a_checkpoints_weights_are_on_the_disk_before_the_rename(tmp_path, monkeypatch):
    synced: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    save_checkpoint(tmp_path, 1, {"x": torch.zeros(2)}, {}, {"world_size": 1}, 0, 1, model=torch.nn.Linear(2, 2))
    assert {"rank_00000.pt.part", "rank_00000.safetensors.part", "metadata.json.part"} <= set(synced), synced


# ------------------------------------------------------------------------------ --resume


def _killed_after_step_4(dataset: str, run: Path) -> dict:
    """A run with checkpoints at steps 2 and 4 whose step-4 checkpoint was lost (a kill during that save):
    ``latest`` names step 2, ``metrics.jsonl`` holds steps 1-4."""
    cfg = _local(dataset, run, **{"training.max_steps": 4, "training.checkpoint_interval": 2})
    run_training(cfg)
    shutil.rmtree(run / "checkpoints" / "step_00000004")
    (run / "checkpoints" / "latest").write_text("step_00000002\n")
    return cfg


def test_resume_without_room_for_a_checkpoint_rewrites_nothing(dataset, tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    cfg = _killed_after_step_4(dataset, run)
    before = _hashes(run)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(diskspace.shutil, "disk_usage", lambda path: usage(10**12, 10**12 - 1000, 1000))
    code, err = _train(tmp_path, _local(dataset, run, **{"training.max_steps": 6, "training.checkpoint_interval": 2}),
                       capsys, "--resume")
    assert code == 2, err
    _one_error(err, "has 1000 B free but the checkpoint of step 4 needs", "step_00000002")
    assert _hashes(run) == before  # config.json (max_steps 4) and the records of steps 3 and 4 kept
    monkeypatch.undo()
    run_training(cfg, resume=True)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4]


@pytest.mark.parametrize("key", ["config", "layout", "step"])
def test_a_metadata_json_without_what_resume_reads_stops_before_any_work(dataset, tmp_path, capsys, key):
    run = tmp_path / "run"
    cfg = _local(dataset, run, **{"training.max_steps": 2})
    run_training(cfg)
    meta_file = run / "checkpoints" / "step_00000002" / "metadata.json"
    meta = json.loads(meta_file.read_text())
    del meta[key]
    meta_file.write_text(json.dumps(meta, indent=1))
    before = _hashes(run)
    code, err = _train(tmp_path, _local(dataset, run, **{"training.max_steps": 3}), capsys, "--resume")
    assert code == 2, err
    _one_error(err, f"checkpoint {meta_file.parent} is damaged", f"{meta_file}: {key} missing",
               "the previous complete checkpoint is", "step_00000001")
    assert _hashes(run) == before


# ------------------------------------------------------------------------------ what the output_dir holds


def test_a_foreign_config_json_in_the_output_dir_is_never_overwritten(dataset, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text('{"editor.fontSize": 12}\n')  # the project's own config.json
    (run / "notes.txt").write_text("mine\n")
    before = _hashes(run)
    code, err = _train(tmp_path, _local(dataset, run, **{"training.max_steps": 1}), capsys)
    assert code == 2, err
    _one_error(err, f"training.output_dir={str(run)!r} holds {run / 'config.json'}, which is not a stormshard config",
               "move it aside or set another training.output_dir")
    assert _hashes(run) == before
    # the config.json of an earlier start that never trained (a stormshard config) is replaced; other files stay
    (run / "config.json").write_text(json.dumps({"name": "earlier", "training": {"max_steps": 9}}))
    code, err = _train(tmp_path, _local(dataset, run, **{"training.max_steps": 1}), capsys)
    assert code == 0, err
    assert json.loads((run / "config.json").read_text())["training"]["max_steps"] == 1
    assert (run / "notes.txt").read_text() == "mine\n"


# ------------------------------------------------------------------------------ the end of a run


def test_a_failed_final_validation_leaves_the_final_checkpoint(dataset, tmp_path, monkeypatch):
    run = tmp_path / "run"
    cfg = _local(dataset, run, **{"training.max_steps": 2, "training.checkpoint_interval": 2})

    def broken(self, samples=None):  # noqa: ANN001, ANN202
        raise RuntimeError("validation ran out of memory")

    with monkeypatch.context() as patch:
        patch.setattr(Trainer, "validate", broken)
        with pytest.raises(RuntimeError, match="out of memory"):
            run_training(cfg)
    checkpoints = run / "checkpoints"
    assert latest_checkpoint(checkpoints).name == "step_00000002"
    assert not [p for p in checkpoints.iterdir() if p.name.endswith((".tmp", ".old"))]
    result = run_training(cfg, resume=True)  # nothing trained, the validation logged once
    assert result.losses == [] and Path(result.checkpoint).name == "step_00000002"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "val_rmse/tracer_1" in r] == [2]
    assert [r["step"] for r in records if "loss" in r] == [1, 2]
