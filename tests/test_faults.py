"""Faults: a rank killed mid-step ends the job naming it, a process killed mid-save leaves the previous
checkpoint for --resume, an unwritable output_dir or a full disk stops the run before it loses work,
and a graph build that fails on rank 0 ends every rank with rank 0's message (CPU, gloo)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections import namedtuple
from pathlib import Path

import pytest

from stormshard.checkpoint.format import latest_checkpoint, list_checkpoints
from stormshard.training.diskspace import DiskSpaceError
from stormshard.training.launch import run_training
from tests.test_launch import ROOT, dataset, finish, start_ranks, write_config  # noqa: F401 - dataset is a fixture
from tests.tiny_run import tiny_config

pytestmark = pytest.mark.filterwarnings("ignore")


def _wait_for(predicate, timeout: float, procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if any(p.poll() is not None for p in procs):
            for p in procs:
                p.kill()
            raise AssertionError(f"a rank ended early: {[Path(p.log.name).read_text() for p in procs]}")
        if time.monotonic() > deadline:
            for p in procs:
                p.kill()
            raise AssertionError("timed out waiting for training to start")
        time.sleep(0.2)


def test_killed_rank_ends_the_job_naming_it(dataset, tmp_path):  # noqa: F811
    config = write_config(tmp_path, dataset, **{"training.max_steps": 100000, "training.checkpoint_interval": 100000,
                                                "training.validation_interval": 100000, "training.warmup_steps": 1})
    procs = start_ranks("slurm", ["--config", str(config)], logs=tmp_path)
    metrics = tmp_path / "run" / "metrics.jsonl"
    _wait_for(lambda: metrics.is_file() and '"loss"' in metrics.read_text(), 240, procs)
    procs[1].send_signal(signal.SIGKILL)  # mid-run: rank 0 is inside a step's collectives
    killed = time.monotonic()
    (rc0, out0), (rc1, _) = finish(procs, timeout=60)
    elapsed = time.monotonic() - killed
    assert rc1 == -signal.SIGKILL and rc0 == 1, out0
    assert elapsed < 30, f"rank 0 took {elapsed:.1f} s to end"
    assert "rank 1 (host" in out0 and "stopped during the run" in out0 and "--resume" in out0, out0
    assert out0.count("error:") == 1 and "Traceback" not in out0, out0


_DIE_IN_SAVE = textwrap.dedent(
    """
    import os, runpy, sys
    import stormshard.training.checkpoint as ck

    original = ck._write_torch

    def dying_writer(obj, path):
        if obj.get("step") == 2:  # the second checkpoint: half a file, then the process dies
            with open(path.with_name(path.name + ".part"), "wb") as f:
                f.write(b"half a checkpoint")
            os._exit(17)
        original(obj, path)

    ck._write_torch = dying_writer
    sys.argv = [sys.argv[0]] + sys.argv[1:]
    runpy.run_path(os.path.join(os.getcwd(), "launch", "train.py"), run_name="__main__")
    """
)


def test_killed_save_keeps_the_previous_checkpoint_for_resume(dataset, tmp_path):  # noqa: F811
    cfg = tiny_config(dataset, tmp_path / "run", **{"training.max_steps": 3, "training.checkpoint_interval": 1,
                                                    "data.validation_samples": 1, "engine": "local", "deepspeed": {}})
    config = tmp_path / "config.json"
    config.write_text(json.dumps(cfg))
    env = {k: v for k, v in os.environ.items()  # an in-process run of this session may have set them
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    log = tmp_path / "train.log"
    with open(log, "w") as f:  # a file, not a pipe (see tests.test_launch.start_ranks)
        proc = subprocess.run([sys.executable, "-c", _DIE_IN_SAVE, "--config", str(config)], cwd=ROOT,
                              env={**env, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}, stdout=f,
                              stderr=subprocess.STDOUT, timeout=240)
    assert proc.returncode == 17, log.read_text()
    checkpoints = tmp_path / "run" / "checkpoints"
    assert (checkpoints / "step_00000002.tmp").is_dir()
    assert latest_checkpoint(checkpoints).name == "step_00000001"
    # --resume takes step 1 and trains steps 2 and 3
    result = run_training(cfg, resume=True)
    assert len(result.losses) == 2 and Path(result.checkpoint).name == "step_00000003"
    assert [p.name for p in list_checkpoints(checkpoints)] == ["step_00000002", "step_00000003"]
    assert not (checkpoints / "step_00000002.tmp").exists()


def test_output_dir_that_cannot_be_written_fails_before_anything(dataset, tmp_path, capsys):  # noqa: F811
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    config = write_config(tmp_path, dataset, **{"training.output_dir": str(blocker / "run")})
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_cli", ROOT / "launch" / "train.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    assert cli.main(["--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "training.output_dir=" in err and "is a file, not a directory" in err and "Traceback" not in err, err
    if os.geteuid() != 0:  # root writes anywhere: the permission case needs an ordinary user
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o500)
        config = write_config(tmp_path, dataset, **{"training.output_dir": str(locked / "run")})
        assert cli.main(["--config", str(config)]) == 2
        assert "is not writable" in capsys.readouterr().err
        locked.chmod(0o700)


_Usage = namedtuple("_Usage", "total used free")


def _fake_disk(monkeypatch, free_per_call):
    import stormshard.training.diskspace as diskspace

    calls = []

    def disk_usage(path):
        calls.append(path)
        free = free_per_call[min(len(calls), len(free_per_call)) - 1]
        return _Usage(10**12, 10**12 - free, free)

    monkeypatch.setattr(diskspace.shutil, "disk_usage", disk_usage)
    return calls


def test_disk_too_small_stops_before_the_first_step(dataset, tmp_path, monkeypatch):  # noqa: F811
    cfg = tiny_config(dataset, tmp_path / "run", **{"training.max_steps": 3, "training.checkpoint_interval": 1,
                                                    "data.validation_samples": 1, "engine": "local", "deepspeed": {}})
    _fake_disk(monkeypatch, [1000])
    with pytest.raises(DiskSpaceError) as err:
        run_training(cfg)
    msg = str(err.value)
    assert "has 1000 B free but the checkpoint of step 1 needs about" in msg and "training.output_dir" in msg, msg
    assert "no checkpoint was written yet" in msg
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert not metrics.exists() or '"loss"' not in metrics.read_text()  # no step was trained
    assert latest_checkpoint(tmp_path / "run" / "checkpoints") is None


def test_disk_filling_up_stops_before_the_save_that_cannot_fit(dataset, tmp_path, monkeypatch):  # noqa: F811
    cfg = tiny_config(dataset, tmp_path / "run", **{"training.max_steps": 3, "training.checkpoint_interval": 1,
                                                    "data.validation_samples": 1, "engine": "local", "deepspeed": {}})
    _fake_disk(monkeypatch, [10**11, 10**11, 1000])  # start, save of step 1, save of step 2
    with pytest.raises(DiskSpaceError, match="checkpoint of step 2 needs.*the last complete checkpoint is .*step_00000001"):
        run_training(cfg)
    checkpoints = tmp_path / "run" / "checkpoints"
    assert latest_checkpoint(checkpoints).name == "step_00000001"
    assert not (checkpoints / "step_00000002.tmp").exists()  # nothing of the checkpoint that cannot fit


_FAIL_GRAPH_ON_RANK0 = textwrap.dedent(
    """
    import os, runpy, sys
    import stormshard.graphs.builder as builder

    if os.environ["SLURM_PROCID"] == "0":
        def broken_build(*args, **kwargs):
            raise RuntimeError("the graph builder ran out of memory")
        builder.build_graph = broken_build
    runpy.run_path(os.path.join(os.getcwd(), "launch", "train.py"), run_name="__main__")
    """
)


def test_graph_build_failure_on_rank_zero_ends_every_rank(dataset, tmp_path):  # noqa: F811
    config = write_config(tmp_path, dataset)
    procs = start_ranks("slurm", ["--config", str(config)], prefix=["-c", _FAIL_GRAPH_ON_RANK0], logs=tmp_path)
    (rc0, out0), (rc1, out1) = finish(procs, timeout=120)
    assert rc0 == 1 and rc1 == 1, out0 + out1
    assert out0.count("error:") == 1 and "the graph builder ran out of memory" in out0 and "Traceback" not in out0
    assert "error:" not in out1 and "Traceback" not in out1, out1  # rank 0's message is the one message
