"""Launching: SLURM / OpenMPI / MPICH / torchrun environments mapped to the torch variables, host
lists, the "several tasks but world 1" error, the DeepSpeed key tables against the installed
DeepSpeed, and real 2-process starts of launch/train.py under each launcher's environment (CPU, gloo)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from stormshard.training.engine.deepspeed_keys import (
    DEEPSPEED_KEYS,
    DEEPSPEED_SUBSECTION_KEYS,
    REMOVED_KEYS,
    REMOVED_ZERO_KEYS,
)
from stormshard.training.hostlist import HostlistError, expand_hostlist
from stormshard.training.launch import LaunchError, detect_launch, process_group_timeout
from tests.tiny_run import tiny_config

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("hostlist, hosts", [
    ("node01", ["node01"]),
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("gpu[8-10]", ["gpu8", "gpu9", "gpu10"]),
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("a[1-2]-ib,b3", ["a1-ib", "a2-ib", "b3"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ("127.0.0.[1-2]", ["127.0.0.1", "127.0.0.2"]),
])
def test_expand_hostlist(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize("bad", ["", "node[01-", "node]", "node[a-b]", "node[5-3]", "n[[1]]"])
def test_bad_hostlist_is_named(bad):
    with pytest.raises(HostlistError, match="host list"):
        expand_hostlist(bad)


SLURM = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0",
         "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_NNODES": "2"}


def test_slurm_environment():
    launch = detect_launch(SLURM)
    assert (launch.launcher, launch.rank, launch.world_size, launch.local_rank) == ("slurm", 5, 8, 1)
    assert launch.master_addr == "gpu07" and launch.master_port == 15000 + 4242
    assert launch.torch_variables() == {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
                                        "MASTER_ADDR": "gpu07", "MASTER_PORT": str(15000 + 4242)}
    # the step's node list wins over the job's; MASTER_ADDR / MASTER_PORT win over both
    assert detect_launch({**SLURM, "SLURM_STEP_NODELIST": "gpu[08]"}).master_addr == "gpu08"
    explicit = detect_launch({**SLURM, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400"})
    assert (explicit.master_addr, explicit.master_port) == ("10.0.0.1", 29400)
    no_list = {k: v for k, v in SLURM.items() if k != "SLURM_JOB_NODELIST"}
    assert detect_launch({**no_list, "SLURM_LAUNCH_NODE_IPADDR": "10.1.2.3"}).master_addr == "10.1.2.3"
    # the step's task count (srun -n) wins over the job's
    assert detect_launch({**SLURM, "SLURM_STEP_NUM_TASKS": "6"}).world_size == 6


def test_openmpi_and_mpich_environments():
    ompi = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_ADDR": "node1"}
    launch = detect_launch(ompi)
    assert (launch.launcher, launch.rank, launch.world_size, launch.local_rank, launch.master_addr,
            launch.master_port) == ("openmpi", 3, 4, 1, "node1", 29500)
    # one node: the master is local; several nodes without MASTER_ADDR or a SLURM list: an error naming the fix
    single_node = {**ompi, "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
    single_node.pop("MASTER_ADDR")
    assert detect_launch(single_node).master_addr == "127.0.0.1"
    with pytest.raises(LaunchError, match="MASTER_ADDR is not set.*-x MASTER_ADDR"):
        detect_launch({k: v for k, v in ompi.items() if k != "MASTER_ADDR"})
    # mpirun inside a SLURM allocation: OpenMPI's ranks, the allocation's first host
    inside = detect_launch({**single_node, "SLURM_JOB_NODELIST": "cn[3-4]", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"})
    assert (inside.launcher, inside.master_addr) == ("openmpi", "cn3")
    mpich = detect_launch({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"})
    assert (mpich.launcher, mpich.rank, mpich.world_size, mpich.local_rank, mpich.master_addr) == \
        ("mpich", 1, 2, 1, "127.0.0.1")


def test_torch_and_single_environments():
    torchrun = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1234"}
    launch = detect_launch(torchrun)
    assert (launch.launcher, launch.rank, launch.world_size, launch.master_addr, launch.master_port) == \
        ("torch", 1, 2, "h", 1234)
    # torchrun / deepspeed inside srun: torch's variables win
    assert detect_launch({**torchrun, **SLURM}).world_size == 2
    single = detect_launch({})
    assert (single.launcher, single.rank, single.world_size, single.master_addr) == ("single", 0, 1, "127.0.0.1")


@pytest.mark.parametrize("env, match", [
    # a torchrun --standalone per srun task: each would train alone
    ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1", **SLURM}, "world of 1.*SLURM_NTASKS=8"),
    ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1", "OMPI_COMM_WORLD_SIZE": "2"},
     "OMPI_COMM_WORLD_SIZE=2"),
    # `python launch/train.py` in an sbatch script that asked for 8 tasks (no srun)
    ({k: v for k, v in SLURM.items() if k != "SLURM_STEP_ID"} | {"SLURM_PROCID": "0"}, "srun python launch/train.py"),
    ({**SLURM, "SLURM_PROCID": "8"}, "rank 8 is outside the world of 8"),
    ({**SLURM, "SLURM_PROCID": "x"}, "SLURM_PROCID='x' is not an integer"),
    ({**SLURM, "SLURM_JOB_NODELIST": "gpu[07-"}, "SLURM_JOB_NODELIST.*MASTER_ADDR"),
])
def test_bad_launch_environments_are_named(env, match):
    with pytest.raises(LaunchError, match=match):
        detect_launch(env)


def test_process_group_timeout():
    assert process_group_timeout({}).total_seconds() == 600
    assert process_group_timeout({"STORMSHARD_DIST_TIMEOUT": "30"}).total_seconds() == 30
    with pytest.raises(LaunchError, match="STORMSHARD_DIST_TIMEOUT"):
        process_group_timeout({"STORMSHARD_DIST_TIMEOUT": "soon"})


def test_deepspeed_key_tables_match_the_installed_deepspeed():
    """Re-derive the keys DeepSpeed's config reads (a dict that records every lookup) and the fields of
    its zero_optimization / bf16 / fp16 models; the tables in deepspeed_keys must equal them."""
    import deepspeed
    from deepspeed.runtime import config as ds_config
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    seen: set[str] = set()

    class Keys(set):
        def __contains__(self, key):
            seen.add(key)
            return super().__contains__(key)

    class Recording(dict):
        def get(self, key, default=None):
            seen.add(key)
            return super().get(key, default)

        def __getitem__(self, key):
            seen.add(key)
            return super().__getitem__(key)

        def __contains__(self, key):
            seen.add(key)
            return super().__contains__(key)

        def keys(self):
            return Keys(super().keys())

    params = Recording({"unused_marker": 1})  # non-empty: some readers skip an empty dict
    ds_config._reject_removed_config_keys(params)
    ds_config.DeepSpeedConfig._initialize_params(object.__new__(ds_config.DeepSpeedConfig), params)
    seen.discard("unused_marker")
    assert deepspeed.__version__.startswith("0.19")
    assert set(REMOVED_KEYS) == set(ds_config._REMOVED_TOP_LEVEL_CONFIG_KEYS)
    assert set(REMOVED_ZERO_KEYS) == set(ds_config._REMOVED_ZERO_CONFIG_KEYS)
    assert set(DEEPSPEED_KEYS) == seen - set(REMOVED_KEYS)

    def fields(model):
        return {n for n, f in model.model_fields.items()} | {f.alias for f in model.model_fields.values() if f.alias}

    assert DEEPSPEED_SUBSECTION_KEYS["zero_optimization"] == fields(DeepSpeedZeroConfig)
    assert DEEPSPEED_SUBSECTION_KEYS["bf16"] == fields(DeepSpeedBF16Config)
    assert DEEPSPEED_SUBSECTION_KEYS["fp16"] == fields(DeepSpeedFP16Config)


# ------------------------------------------------------------------ 2-process starts of launch/train.py


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_CLEAN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")


def launcher_env(launcher: str, rank: int, world: int, port: int) -> dict[str, str]:
    """What each launcher puts in a rank's environment (only the variables stormshard reads)."""
    env = {k: v for k, v in os.environ.items()
           if k not in _CLEAN and not k.startswith(("SLURM_", "OMPI_", "PMI_", "MPI_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), STORMSHARD_DEAD_AFTER_S="4", STORMSHARD_HEARTBEAT_S="0.5")
    if launcher == "slurm":  # srun --ntasks 2 python launch/train.py (task 0 on the list's first host)
        env.update(SLURM_PROCID=str(rank), SLURM_NTASKS=str(world), SLURM_LOCALID=str(rank), SLURM_STEP_ID="0",
                   SLURM_JOB_ID="1", SLURM_NNODES="1", SLURM_JOB_NODELIST="127.0.0.[1-2]", MASTER_PORT=str(port))
    elif launcher == "openmpi":  # mpirun -n 2 (DeepSpeed --launcher openmpi)
        env.update(OMPI_COMM_WORLD_RANK=str(rank), OMPI_COMM_WORLD_SIZE=str(world),
                   OMPI_COMM_WORLD_LOCAL_RANK=str(rank), OMPI_COMM_WORLD_LOCAL_SIZE=str(world), MASTER_PORT=str(port))
    elif launcher == "mpich":  # mpiexec -n 2 (hydra)
        env.update(PMI_RANK=str(rank), PMI_SIZE=str(world), MPI_LOCALRANKID=str(rank), MPI_LOCALNRANKS=str(world),
                   MASTER_PORT=str(port))
    else:  # torchrun / deepspeed's launcher
        env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port))
    return env


def start_ranks(launcher: str, args: list[str], world: int = 2, prefix: list[str] | None = None,
                extra_env: dict[str, str] | None = None, logs: Path | None = None) -> list[subprocess.Popen]:
    """``python launch/train.py ARGS`` once per rank with ``launcher``'s environment. Output goes to
    files (``rank<N>.log`` under ``logs``), not pipes: a grandchild that inherits a pipe (a data
    loader's fork server) would keep it open after the rank exits."""
    port = _free_port()
    logs = Path(logs or os.environ.get("TMPDIR", "/tmp"))
    procs = []
    for rank in range(world):
        env = {**launcher_env(launcher, rank, world, port), **(extra_env or {})}
        cmd = [sys.executable, *(prefix or [str(ROOT / "launch" / "train.py")]), *args]
        log = open(logs / f"rank{rank}-{port}.log", "w+")  # noqa: SIM115 - read back by finish()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        proc.log = log
        procs.append(proc)
    return procs


def finish(procs: list[subprocess.Popen], timeout: float = 240) -> list[tuple[int, str]]:
    """Wait for every rank; ``(exit status, output)`` per rank."""
    out = []
    for p in procs:
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        p.log.seek(0)
        out.append((p.returncode, p.log.read()))
        p.log.close()
    return out


def write_config(tmp_path: Path, dataset: str, **changes) -> Path:
    cfg = tiny_config(dataset, tmp_path / "run", **{
        "training.max_steps": 2, "training.checkpoint_interval": 1, "data.validation_samples": 1,
        "engine": "ddp", "deepspeed": {}, **changes})
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize("launcher", ["slurm", "openmpi", "mpich", "torchrun"])
def test_two_process_start_under_each_launcher(launcher, dataset, tmp_path):
    config = write_config(tmp_path, dataset)
    (rc0, out0), (rc1, out1) = finish(start_ranks(launcher, ["--config", str(config)], logs=tmp_path))
    assert rc0 == 0 and rc1 == 0, out0 + out1
    assert "layout: world 2" in out0 and "layout:" not in out1  # rank 0 logs, rank 1 is quiet
    step = tmp_path / "run" / "checkpoints" / "step_00000002"
    assert sorted(p.name for p in step.glob("rank_*.pt")) == ["rank_00000.pt", "rank_00001.pt"]


def test_several_tasks_but_world_one_fails_before_anything(dataset, tmp_path, monkeypatch, capsys):
    """torchrun --standalone inside `srun -n 2`: a one-rank world in a 2-task step stops with one message."""
    config = write_config(tmp_path, dataset)
    for key in [k for k in os.environ if k.startswith(("SLURM_", "OMPI_", "PMI_")) or k in _CLEAN]:
        monkeypatch.delenv(key)
    for key, value in {**launcher_env("slurm", 1, 2, _free_port()), "RANK": "0", "WORLD_SIZE": "1",
                       "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(key, value)
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_cli", ROOT / "launch" / "train.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    assert cli.main(["--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "SLURM_NTASKS=2" in err and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()
