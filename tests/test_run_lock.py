"""One run at a time per ``training.output_dir`` (``stormshard.training.run_lock``).

Two runs started into one output folder (a job submitted twice) used to train side by side, each writing its
checkpoints, ``latest`` and ``metrics.jsonl`` over the other's. Now rank 0 holds a lock file there for the
run's whole life: a second run stops before it writes anything, naming the holder, on every rank; a lock whose
run cannot be alive (its process gone, this SLURM job's, not refreshed for ``STORMSHARD_RUN_LOCK_STALE_S``)
is taken over, so a killed or requeued run resumes without a manual step.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import stormshard.training.run_lock as run_lock
from stormshard.env import EnvError, check_environment
from stormshard.training.config import ConfigError
from stormshard.training.launch import run_training
from stormshard.training.run_lock import LOCK_NAME, RunLock, live_holder
from tests.bad_input_helpers import run_main
from tests.test_cli_errors import _one_process  # noqa: F401 - autouse: a one-process environment
from tests.tiny_run import tiny_config

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture()
def other_process():
    """A live process of this host that is not this one (the holder of a foreign lock)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc.pid
    proc.kill()
    proc.wait()


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _write_lock(directory: Path, *, host: str | None = None, pid: int, job: str | None = None,
                age_s: float = 0.0) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_NAME
    path.write_text(json.dumps({"host": host or socket.gethostname(), "pid": pid, "job": job,
                                "started": time.time() - age_s}))
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path


def test_a_live_lock_of_another_process_is_refused_and_left_as_it_is(tmp_path, other_process):
    path = _write_lock(tmp_path, pid=other_process, job="4711")
    before = path.read_bytes(), path.stat().st_mtime
    lock = RunLock(tmp_path)
    with pytest.raises(ConfigError) as err:
        lock.acquire()
    text = str(err.value)
    for fragment in (f"training.output_dir={str(tmp_path)!r} is in use by another run", f"pid {other_process}",
                     "SLURM job 4711", socket.gethostname(), "set another training.output_dir", str(path),
                     "STORMSHARD_RUN_LOCK_STALE_S"):
        assert fragment in text, text
    lock.release()  # not held: another run's lock stays
    assert (path.read_bytes(), path.stat().st_mtime) == before
    assert live_holder(tmp_path).pid == other_process


@pytest.mark.parametrize("case", ["dead pid", "this process", "this SLURM job", "old, another host",
                                  "damaged and old"])
def test_a_lock_whose_run_cannot_be_alive_is_taken_over(tmp_path, monkeypatch, other_process, case):
    if case == "dead pid":
        path = _write_lock(tmp_path, pid=_dead_pid())
    elif case == "this process":
        path = _write_lock(tmp_path, pid=os.getpid())
    elif case == "this SLURM job":
        monkeypatch.setenv("SLURM_JOB_ID", "4711")
        path = _write_lock(tmp_path, pid=other_process, job="4711")
    elif case == "old, another host":
        path = _write_lock(tmp_path, host="gpu-node-17", pid=other_process, age_s=200)
    else:
        path = tmp_path / LOCK_NAME
        path.write_text("{not json")
        os.utime(path, (time.time() - 200,) * 2)
    assert live_holder(tmp_path) is None
    with RunLock(tmp_path) as lock:
        assert lock.held
        record = json.loads(path.read_text())
        assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
    assert not path.exists()


def test_a_lock_of_another_host_is_alive_until_it_is_stale(tmp_path, monkeypatch, other_process):
    _write_lock(tmp_path, host="gpu-node-17", pid=other_process, age_s=30)
    assert live_holder(tmp_path).host == "gpu-node-17"  # refreshed 30 s ago: maybe alive
    monkeypatch.setenv("STORMSHARD_RUN_LOCK_STALE_S", "20")
    assert live_holder(tmp_path) is None
    monkeypatch.setenv("STORMSHARD_RUN_LOCK_STALE_S", "-1")
    with pytest.raises(EnvError, match="STORMSHARD_RUN_LOCK_STALE_S='-1'"):
        check_environment()


def test_a_lock_being_written_by_a_run_starting_now_is_not_taken_over(tmp_path):
    path = tmp_path / LOCK_NAME
    path.write_text("")  # created exclusively, its record not written yet
    with pytest.raises(ConfigError, match="host unknown"):
        RunLock(tmp_path).acquire()
    assert path.exists()


def test_a_held_lock_is_refreshed_and_released_with_the_folder_it_made(tmp_path, monkeypatch):
    monkeypatch.setattr(run_lock, "REFRESH_S", 0.05)
    out = tmp_path / "new" / "run"
    lock = RunLock(out).acquire()
    path = out / LOCK_NAME
    os.utime(path, (time.time() - 500,) * 2)
    deadline = time.time() + 10
    while time.time() - path.stat().st_mtime > 100 and time.time() < deadline:
        time.sleep(0.02)
    assert time.time() - path.stat().st_mtime < 100  # the background refresh
    lock.release()
    assert not out.exists() and (tmp_path / "new").exists()


# ------------------------------------------------------------------------------ a run


def _local(data: str, out: Path, **changes) -> dict:  # noqa: ANN003
    return tiny_config(data, out, **{"training.max_steps": 2, "training.checkpoint_interval": 1,
                                     "data.validation_samples": 1, "engine": "local", "deepspeed": {}, **changes})


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else b"" for p in sorted(root.rglob("*"))}


def test_a_second_run_into_a_held_output_dir_stops_before_writing(dataset, tmp_path, capsys, other_process):
    out = tmp_path / "run"
    _write_lock(out, pid=other_process)
    before = _files(tmp_path)
    config = tmp_path / "cfg.json"
    config.write_text(json.dumps(_local(dataset, out)))
    before = _files(tmp_path)
    capsys.readouterr()
    assert run_main("train", ["--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len([line for line in err.splitlines() if "error:" in line]) == 1, err
    assert "is in use by another run" in err and f"pid {other_process}" in err, err
    assert _files(tmp_path) == before  # no graph cache, no config.json, the lock untouched


def test_a_run_holds_the_lock_while_it_trains_and_leaves_none(dataset, tmp_path, monkeypatch):
    out = tmp_path / "run"
    seen: list[bool] = []
    real = run_lock.RunLock.acquire

    def acquire(self):  # noqa: ANN001, ANN202
        got = real(self)
        seen.append((out / LOCK_NAME).is_file())
        return got

    monkeypatch.setattr(run_lock.RunLock, "acquire", acquire)
    result = run_training(_local(dataset, out))
    assert seen == [True] and len(result.losses) == 2
    assert not (out / LOCK_NAME).exists()
    _write_lock(out, pid=_dead_pid())  # a run killed on this host: --resume takes its lock over
    result = run_training(_local(dataset, out, **{"training.max_steps": 3}), resume=True)
    assert len(result.losses) == 1 and not (out / LOCK_NAME).exists()


def _two_ranks_into_a_held_dir(rank: int, world: int, cfg: dict) -> str:
    try:
        run_training(cfg)
    except ConfigError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "trained"


def test_every_rank_stops_when_rank_0_finds_the_output_dir_held(dataset, tmp_path, other_process):
    from tests.distributed import run_distributed

    out = tmp_path / "run"
    lock = _write_lock(out, pid=other_process)
    cfg = _local(dataset, out, **{"parallel.gpus_per_model": 2})
    messages = run_distributed(_two_ranks_into_a_held_dir, 2, cfg, timeout=120)
    assert messages[0].startswith("ConfigError") and "is in use by another run" in messages[0], messages
    assert messages[1].startswith("RankZeroBadInput") and "is in use by another run" in messages[1], messages
    assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME] and lock.exists()
