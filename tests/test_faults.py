"""Faults: a rank killed mid-step ends the job naming it, a process killed mid-save leaves the previous
checkpoint for --resume, an unwritable output_dir or a full disk stops the run before it loses work,
a graph build that fails on rank 0 ends every rank with rank 0's message (CPU, gloo); no data is lost:
a new run in an earlier run's output_dir is refused, a resumed run logs every step once, and a damaged
newest checkpoint (truncated, zeroed or missing rank file, truncated metadata.json) stops --resume
naming the file and the previous complete checkpoint."""

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

from stormshard.checkpoint.format import CheckpointError, latest_checkpoint, list_checkpoints
from stormshard.checkpoint.upgrade import upgrade_checkpoints
from stormshard.training.config import ConfigError
from stormshard.training.diskspace import DiskSpaceError
from stormshard.training.launch import run_training
from tests.distributed import run_distributed
from tests.test_checkpoint import to_pickled_format
from tests.test_launch import ROOT, finish, start_ranks, write_config
from tests.tiny_run import tiny_config, train_losses

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


def test_killed_rank_ends_the_job_naming_it(dataset, tmp_path):
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


def test_killed_save_keeps_the_previous_checkpoint_for_resume(dataset, tmp_path):
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


def test_output_dir_that_cannot_be_written_fails_before_anything(dataset, tmp_path, capsys):
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


def test_disk_too_small_stops_before_the_first_step(dataset, tmp_path, monkeypatch):
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


def test_disk_filling_up_stops_before_the_save_that_cannot_fit(dataset, tmp_path, monkeypatch):
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


def test_graph_build_failure_on_rank_zero_ends_every_rank(dataset, tmp_path):
    config = write_config(tmp_path, dataset)
    procs = start_ranks("slurm", ["--config", str(config)], prefix=["-c", _FAIL_GRAPH_ON_RANK0], logs=tmp_path)
    (rc0, out0), (rc1, out1) = finish(procs, timeout=120)
    assert rc0 == 1 and rc1 == 1, out0 + out1
    assert out0.count("error:") == 1 and "the graph builder ran out of memory" in out0 and "Traceback" not in out0
    assert "error:" not in out1 and "Traceback" not in out1, out1  # rank 0's message is the one message


# ------------------------------------------------------------------------------ data is never lost


def _local(data: str, out: Path, **changes) -> dict:  # noqa: ANN003
    return tiny_config(data, out, **{"training.max_steps": 3, "training.checkpoint_interval": 1,
                                        "training.keep_checkpoints": 3, "data.validation_samples": 1,
                                        "engine": "local", "deepspeed": {}, **changes})


def _snapshot(root: Path) -> dict[str, bytes]:
    """Every file of a run but config.json (the resolved config each start writes, not the run's data)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != "config.json"}


def _train_cli():
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_cli", ROOT / "launch" / "train.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    return cli


def test_a_new_run_in_an_earlier_runs_output_dir_is_refused(dataset, tmp_path, capsys):
    cfg = _local(dataset, tmp_path / "run", **{"training.max_steps": 2})
    run_training(cfg)
    before = _snapshot(tmp_path / "run")
    with pytest.raises(ConfigError) as err:
        run_training(cfg)
    msg = str(err.value)
    assert f"training.output_dir={str(tmp_path / 'run')!r} already holds a run" in msg, msg
    assert "step_00000002" in msg and "metrics.jsonl with" in msg and "--resume" in msg and "new training.output_dir" in msg
    config = tmp_path / "config.json"
    config.write_text(json.dumps(cfg))
    assert _train_cli().main(["--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "already holds a run" in err and "Traceback" not in err, err
    assert _snapshot(tmp_path / "run") == before  # nothing overwritten, nothing appended
    # metrics of a run that never reached a checkpoint count too (it cannot be resumed)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    with pytest.raises(ConfigError, match="no complete checkpoint to --resume from"):
        run_training(_local(dataset, tmp_path / "other"))


def test_resume_logs_every_step_once(dataset, tmp_path):
    """A run stopped after its step-2 checkpoint but with metrics up to step 4 (a kill after step 4, before its
    save) resumes from step 2: the records past step 2 are dropped, so each step appears once."""
    cfg = _local(dataset, tmp_path / "run", **{"training.max_steps": 4, "training.checkpoint_interval": 2,
                                               "training.validation_interval": 2})
    full = run_training(cfg).losses
    metrics = tmp_path / "run" / "metrics.jsonl"
    checkpoints = tmp_path / "run" / "checkpoints"
    import shutil

    shutil.rmtree(checkpoints / "step_00000004")  # the kill came before step 4's checkpoint
    (checkpoints / "latest").write_text("step_00000002\n")
    with open(metrics, "a") as f:
        f.write('{"step": 5, "loss"')  # and cut a line short
    records = [json.loads(line) for line in metrics.read_text().splitlines()[:-1]]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4]
    resumed = run_training(cfg, resume=True).losses
    assert resumed == full[2:]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4]
    assert [r["step"] for r in records if "val_rmse/tracer_1" in r] == [2, 4]
    assert [r["loss"] for r in records if "loss" in r][2:] == pytest.approx(full[2:], rel=0, abs=0)


def test_resuming_a_finished_run_changes_nothing(dataset, tmp_path, capsys):
    """``--resume`` of a run that already trained its ``max_steps``: nothing is trained or saved again, the
    final validation is computed (returned) but not logged a second time, and the run says so."""
    cfg = _local(dataset, tmp_path / "run", **{"training.max_steps": 2, "training.checkpoint_interval": 2})
    first = run_training(cfg)
    files = _snapshot(tmp_path / "run")
    capsys.readouterr()
    again = run_training(cfg, resume=True)
    assert again.losses == [] and again.checkpoint == first.checkpoint
    assert again.validation == first.validation
    assert "nothing to train (raise training.max_steps to continue)" in capsys.readouterr().err
    after = _snapshot(tmp_path / "run")
    assert after.keys() == files.keys()
    assert {k: v for k, v in after.items() if k != "metrics.jsonl"} == \
        {k: v for k, v in files.items() if k != "metrics.jsonl"}
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "val_rmse/tracer_1" in r] == [2]


def test_resuming_a_run_killed_in_its_final_validation_logs_that_validation(dataset, tmp_path):
    """A run killed after its last checkpoint, during its final validation (before logging it): ``--resume`` trains
    nothing, and the validation the run never logged is logged now, once (it used to be lost from metrics.jsonl)."""
    cfg = _local(dataset, tmp_path / "run", **{"training.max_steps": 2, "training.checkpoint_interval": 2})
    run_training(cfg)
    metrics = tmp_path / "run" / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    metrics.write_text("".join(line + "\n" for line in lines if "val_rmse/" not in line))  # the kill came first
    run_training(cfg, resume=True)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records if "val_rmse/tracer_1" in r] == [2]
    assert [r["step"] for r in records if "loss" in r] == [1, 2]


def _damage(step_dir: Path, how: str) -> Path:
    """Damage one file of ``step_dir`` as a crash, a full disk or a bad copy would; returns the file."""
    if how == "truncated metadata.json":
        f = step_dir / "metadata.json"
        f.write_text(f.read_text()[:200])
        return f
    f = step_dir / "rank_00000.pt"
    if how == "truncated rank file":
        f.write_bytes(f.read_bytes()[:1000])
    elif how == "zeroed rank file":
        f.write_bytes(b"\0" * f.stat().st_size)
    else:
        f.unlink()
    return f


def test_damaged_newest_checkpoint_stops_resume_naming_the_file(dataset, tmp_path, capsys):
    import shutil

    base = tmp_path / "base"
    cfg = _local(dataset, base)
    full = run_training(cfg).losses
    for how in ("truncated rank file", "zeroed rank file", "truncated metadata.json", "missing rank file"):
        run = tmp_path / how.replace(" ", "_").replace(".", "_")
        shutil.copytree(base, run)
        damaged = _damage(run / "checkpoints" / "step_00000003", how)
        before = _snapshot(run)
        with pytest.raises(CheckpointError) as err:
            run_training(_local(dataset, run), resume=True)
        msg = str(err.value)
        assert f"checkpoint {run / 'checkpoints' / 'step_00000003'} is damaged" in msg and str(damaged) in msg, msg
        assert f"previous complete checkpoint is {run / 'checkpoints' / 'step_00000002'} (step 2)" in msg, msg
        for raw in ("PytorchStreamReader", "storages", "Expecting ", "Traceback"):
            assert raw not in msg, (how, msg)
        assert _snapshot(run) == before, how  # nothing written: metrics, checkpoints, latest untouched
    # through the launcher: one error line, exit status 2
    config = tmp_path / "zeroed.json"
    config.write_text(json.dumps(_local(dataset, tmp_path / "zeroed_rank_file")))
    assert _train_cli().main(["--config", str(config), "--resume"]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "rank_00000.pt: its contents differ from the sha256" in err, err
    # the advice works: the damaged checkpoint moved aside, --resume continues from step 2
    step3 = tmp_path / "zeroed_rank_file" / "checkpoints" / "step_00000003"
    step3.rename(step3.with_name("step_00000003.damaged"))
    assert run_training(_local(dataset, tmp_path / "zeroed_rank_file"), resume=True).losses == full[2:]
    # a checkpoint of the earlier, pickled format: refused before any work, until upgraded
    old = tmp_path / "old"
    shutil.copytree(base, old)
    for step_dir in list_checkpoints(old / "checkpoints"):
        to_pickled_format(step_dir)
    with pytest.raises(CheckpointError, match=r"convert_checkpoint.py upgrade .*old/checkpoints"):
        run_training(_local(dataset, old, **{"training.max_steps": 4}), resume=True)
    upgrade_checkpoints(old / "checkpoints")
    cont = run_training(_local(dataset, base, **{"training.max_steps": 4}), resume=True).losses
    assert run_training(_local(dataset, old, **{"training.max_steps": 4}), resume=True).losses == cont


def _resume_message(rank: int, world: int, cfg: dict) -> str:
    try:
        run_training(cfg, resume=True)
    except CheckpointError as exc:
        return str(exc)
    return "resumed"


def test_a_damaged_file_of_one_rank_stops_every_rank(dataset, tmp_path):
    cfg = _local(dataset, tmp_path / "run", **{"training.max_steps": 2, "parallel.gpus_per_model": 2})
    run_distributed(train_losses, 2, cfg)
    f = tmp_path / "run" / "checkpoints" / "step_00000002" / "rank_00001.pt"
    f.write_bytes(b"\0" * f.stat().st_size)
    messages = run_distributed(_resume_message, 2, cfg)
    assert messages[0] == messages[1] and f"{f}: its contents differ from the sha256" in messages[0], messages
    assert "step_00000001 (step 1)" in messages[0]
