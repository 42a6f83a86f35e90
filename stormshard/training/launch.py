"""Process start-up for the entry points: one process or many, CPU (gloo) or GPU (NCCL).

``run_training(config)`` validates the config *before* any process group or file is created,
initialises ``torch.distributed`` from the launcher's environment, trains, and tears down.

Launchers (:func:`detect_launch` reads the environment; the first that matches wins):

==========================  =======================================================================
``torch``                   ``RANK`` / ``WORLD_SIZE`` set: torchrun, DeepSpeed's launcher (hostfile,
                            ``--no_ssh``, ``--launcher mpich`` through its helper)
``openmpi``                 ``OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK``: ``mpirun``, DeepSpeed
                            ``--launcher openmpi``
``mpich``                   ``PMI_RANK`` / ``PMI_SIZE`` (``MPI_LOCALRANKID``): MPICH / Intel MPI hydra
``slurm``                   ``SLURM_PROCID`` / ``SLURM_NTASKS`` / ``SLURM_LOCALID`` in an ``srun``
                            step: ``srun python launch/train.py`` (one task per GPU), DeepSpeed
                            ``--launcher slurm``
``single``                  none of these: one process on a free local port
==========================  =======================================================================

The master address is ``MASTER_ADDR`` when set, else the first host of the SLURM step / job node
list (``SLURM_STEP_NODELIST``, ``SLURM_JOB_NODELIST``, ``SLURM_NODELIST``, expanded like
``scontrol show hostnames``), else ``SLURM_LAUNCH_NODE_IPADDR``, else ``127.0.0.1`` when all ranks
share one node; the port is ``MASTER_PORT``, else ``15000 + SLURM_JOB_ID % 20000``, else 29500.
A start that finds several tasks in its environment but would run as a world of one is an error
(:class:`LaunchError`): N independent one-process runs would write to the same ``output_dir``; so is
half of torch's pair (``WORLD_SIZE`` > 1 without ``RANK``, or a nonzero ``RANK`` without ``WORLD_SIZE``).

The rendezvous (:func:`init_distributed`) waits at most ``STORMSHARD_RENDEZVOUS_TIMEOUT`` seconds
(default 60) for every rank to reach ``MASTER_ADDR:MASTER_PORT``; a rank whose peers never come (they
were not started, or were started with another address, port or world size) stops with a
:class:`RendezvousError` naming the address, its rank and world and the ranks that did not join,
instead of waiting out the 600 s process-group timeout (``STORMSHARD_DIST_TIMEOUT``, which still
bounds every collective after the start).
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from stormshard.checkpoint.integrity import resume_target
from stormshard.env import VARIABLES, EnvError
from stormshard.errors import ReportedByRank
from stormshard.models.trust import check_model_code, stored_beside
from stormshard.training.checkpoint import verify_resume_files
from stormshard.training.config import ConfigError, ExperimentConfig, load_experiment_config
from stormshard.training.diskspace import DiskSpaceError
from stormshard.training.finetune import GraphDependentMismatch
from stormshard.training.hostlist import HostlistError, first_host
from stormshard.training.loop import Trainer, TrainResult
from stormshard.training.malloc_tuning import tune_malloc
from stormshard.training.preflight import RunInputs, checkpoint_dir, preflight
from stormshard.training.rank_zero import RankZeroFailed, rank_zero_first
from stormshard.training.run_lock import RunLock
from stormshard.training.watchdog import RankFailure, RankMonitor, monitor_settings

__all__ = ["LaunchError", "LaunchEnvironment", "RendezvousError", "detect_launch", "init_distributed",
           "run_training", "process_group_timeout", "rendezvous_timeout", "save_resolved_config"]


class LaunchError(ConfigError):
    """The launcher's environment cannot start this run; the message names the variable and the fix."""


class RendezvousError(ReportedByRank):
    """The ranks did not all meet at ``MASTER_ADDR:MASTER_PORT`` in time; printed by the rank that
    waited (its peers may not exist), exit status 1."""


@dataclass(frozen=True)
class LaunchEnvironment:
    """Where this process sits in the job, read from the launcher's environment."""

    launcher: str  # "torch" | "openmpi" | "mpich" | "slurm" | "single"
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int

    def torch_variables(self) -> dict[str, str]:
        """``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` for ``env://``."""
        return {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(self.local_rank),
                "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port)}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _int(env: Mapping[str, str], name: str, minimum: int = 0) -> int:
    raw = env[name]
    try:
        value = int(raw)
    except ValueError:
        raise LaunchError(f"{name}={raw!r} is not an integer: the launcher set it wrongly, or unset it") from None
    if value < minimum:
        raise LaunchError(f"{name}={raw!r} must be at least {minimum}")
    return value


def _first_of(env: Mapping[str, str], names: tuple[str, ...]) -> str | None:
    return next((n for n in names if env.get(n)), None)


def _slurm_tasks(env: Mapping[str, str]) -> int | None:
    name = _first_of(env, ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"))
    return None if name is None else _int(env, name, 1)


def _master_addr(env: Mapping[str, str], launcher: str, world: int, local_world: int | None) -> str:
    if env.get("MASTER_ADDR"):
        return env["MASTER_ADDR"]
    nodelist = _first_of(env, ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"))
    if nodelist is not None:
        try:
            return first_host(env[nodelist])
        except HostlistError as exc:
            raise LaunchError(f"{nodelist}: {exc}; set MASTER_ADDR to the first host instead") from None
    if env.get("SLURM_LAUNCH_NODE_IPADDR"):
        return env["SLURM_LAUNCH_NODE_IPADDR"]
    if world == 1 or (local_world is not None and local_world == world):
        return "127.0.0.1"
    raise LaunchError(
        f"{launcher}: {world} ranks on several nodes but MASTER_ADDR is not set and no SLURM node list is "
        "available: export MASTER_ADDR=<first host> to every rank (mpirun -x MASTER_ADDR, or DeepSpeed "
        "--launcher_args '-x MASTER_ADDR=<host>')"
    )


def _master_port(env: Mapping[str, str]) -> int:
    if env.get("MASTER_PORT"):
        return _int(env, "MASTER_PORT", 1)
    if env.get("SLURM_JOB_ID", "").isdigit():
        return 15000 + int(env["SLURM_JOB_ID"]) % 20000
    return 29500


def _check_world(launcher: str, world: int, env: Mapping[str, str]) -> None:
    """A world of one while the environment announces several tasks is an error."""
    if world != 1:
        return
    others = []
    for name in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"):
        if env.get(name, "").isdigit() and int(env[name]) > 1:
            others.append(f"{name}={env[name]}")
    if not others:
        return
    if launcher == "torch" and not env.get("SLURM_STEP_ID") and not env.get("SLURM_STEPID") and not any(
            o.startswith(("OMPI", "PMI")) for o in others):
        # torchrun / deepspeed inside a SLURM batch script that asked for several tasks: the batch step
        # runs one process, and torch's variables say world 1; that is what the user started
        return
    raise LaunchError(
        f"this process would run as a world of 1 ({launcher} variables) but the environment announces "
        f"several tasks ({', '.join(others)}): each task would train alone and write the same output_dir. "
        "Start one process per task without an inner launcher (`srun python launch/train.py ...` or "
        "`mpirun -n N python launch/train.py ...`), or give torchrun --nnodes/--nproc_per_node for the whole job"
    )


def _check_torch_pair(env: Mapping[str, str]) -> None:
    """torch's ``RANK`` and ``WORLD_SIZE`` come together: half of the pair would run one process."""
    rank, world = env.get("RANK", ""), env.get("WORLD_SIZE", "")
    if bool(rank) == bool(world) or _first_of(env, ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID")):
        return
    if world and world != "1":
        raise LaunchError(
            f"WORLD_SIZE={world} is set but RANK is not: this process cannot tell which of the {world} ranks it is "
            "and would run alone. Start the job with a launcher that sets both (torchrun, deepspeed, srun, mpirun), "
            "set RANK (0 .. WORLD_SIZE-1) in each process yourself, or unset WORLD_SIZE for a one-process run"
        )
    if rank and rank != "0":
        raise LaunchError(
            f"RANK={rank} is set but WORLD_SIZE is not: the job's size is unknown. Set WORLD_SIZE (and MASTER_ADDR, "
            "MASTER_PORT) in every process, or unset RANK for a one-process run"
        )


def detect_launch(env: Mapping[str, str] | None = None) -> LaunchEnvironment:
    """This process's rank, world size, local rank and master address from the launcher's environment
    (see the module docstring for the order). Raises :class:`LaunchError` naming the variable."""
    env = os.environ if env is None else env
    _check_torch_pair(env)
    if env.get("WORLD_SIZE") and env.get("RANK"):
        launcher, rank, world = "torch", _int(env, "RANK"), _int(env, "WORLD_SIZE", 1)
        local_name = _first_of(env, ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"))
        local = _int(env, local_name) if local_name else 0
        local_world = _int(env, "LOCAL_WORLD_SIZE", 1) if env.get("LOCAL_WORLD_SIZE") else None
    elif env.get("OMPI_COMM_WORLD_SIZE"):
        launcher = "openmpi"
        rank, world = _int(env, "OMPI_COMM_WORLD_RANK"), _int(env, "OMPI_COMM_WORLD_SIZE", 1)
        local = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK") if env.get("OMPI_COMM_WORLD_LOCAL_RANK") else 0
        local_world = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", 1) if env.get("OMPI_COMM_WORLD_LOCAL_SIZE") else None
    elif env.get("PMI_SIZE") and (env.get("PMI_RANK") or env.get("PMIX_RANK")):
        launcher = "mpich"
        rank = _int(env, "PMI_RANK" if env.get("PMI_RANK") else "PMIX_RANK")
        world = _int(env, "PMI_SIZE", 1)
        local_name = _first_of(env, ("MPI_LOCALRANKID", "PALS_LOCAL_RANKID"))
        local = _int(env, local_name) if local_name else 0
        local_world = _int(env, "MPI_LOCALNRANKS", 1) if env.get("MPI_LOCALNRANKS") else None
    elif env.get("SLURM_PROCID") and _slurm_tasks(env) is not None:
        world = _slurm_tasks(env)
        if world > 1 and not (env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID")):
            raise LaunchError(
                f"SLURM_NTASKS={world} but this process is the batch script, not an srun task (SLURM_STEP_ID is "
                "unset): the job would run one process. Start it with `srun python launch/train.py ...` "
                "(one task per GPU), or ask for --ntasks 1"
            )
        launcher, rank = "slurm", _int(env, "SLURM_PROCID")
        local = _int(env, "SLURM_LOCALID") if env.get("SLURM_LOCALID") else 0
        local_world = None
        if env.get("SLURM_NNODES", "").isdigit() and int(env["SLURM_NNODES"]) == 1:
            local_world = world
    else:
        return LaunchEnvironment("single", 0, 1, 0, env.get("MASTER_ADDR") or "127.0.0.1",
                                 _int(env, "MASTER_PORT", 1) if env.get("MASTER_PORT") else _free_port())
    if not 0 <= rank < world:
        raise LaunchError(f"{launcher}: rank {rank} is outside the world of {world} ranks: check the launcher's "
                          "variables (RANK / OMPI_COMM_WORLD_RANK / PMI_RANK / SLURM_PROCID)")
    _check_world(launcher, world, env)
    return LaunchEnvironment(launcher, rank, world, local, _master_addr(env, launcher, world, local_world),
                             _master_port(env))


def _seconds(name: str, env: Mapping[str, str] | None) -> timedelta:
    try:
        return timedelta(seconds=float(VARIABLES[name].read(env)))
    except EnvError as exc:
        raise LaunchError(str(exc)) from None


def process_group_timeout(env: Mapping[str, str] | None = None) -> timedelta:
    """How long a collective may wait before it fails: ``STORMSHARD_DIST_TIMEOUT`` seconds (default 600).

    With NCCL the timeout is enforced by the watchdog when ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1``
    (torch's default): a rank waiting on a dead peer aborts after it instead of hanging. A value that is
    not a finite positive number is a :class:`LaunchError` naming the variable (:mod:`stormshard.env`).
    """
    return _seconds("STORMSHARD_DIST_TIMEOUT", env)


def rendezvous_timeout(env: Mapping[str, str] | None = None) -> timedelta:
    """How long a rank waits at the start for the others: ``STORMSHARD_RENDEZVOUS_TIMEOUT`` seconds (default 60)."""
    return _seconds("STORMSHARD_RENDEZVOUS_TIMEOUT", env)


_JOINED = "stormshard/joined/"


def _rendezvous_error(launch: LaunchEnvironment, wait: timedelta, store: Any, exc: BaseException) -> RendezvousError:
    where = f"MASTER_ADDR:MASTER_PORT={launch.master_addr}:{launch.master_port}"
    missing = None
    if store is not None:
        try:
            missing = [r for r in range(launch.world_size) if not store.check([f"{_JOINED}{r}"])]
        except Exception:  # noqa: BLE001 - the store itself may be gone; the message says less then
            missing = None
    if store is None:
        what = (f"could not reach the rendezvous store at {where} (hosted by rank 0)" if launch.rank else
                f"hosts the rendezvous store at {where} but not every other rank connected")
    elif missing:
        what = f"met at {where} but rank(s) {missing} of {launch.world_size} did not join"
    else:
        what = f"could not start the process group at {where}"
    return RendezvousError(
        f"rank {launch.rank} of {launch.world_size} ({launch.launcher} launch) {what} within "
        f"{wait.total_seconds():g} s: most likely the other ranks were not started (or were started with another "
        "MASTER_ADDR, MASTER_PORT or WORLD_SIZE, or a firewall blocks the port). Start all "
        f"{launch.world_size} ranks with the same MASTER_ADDR / MASTER_PORT; if they start slowly, raise "
        f"STORMSHARD_RENDEZVOUS_TIMEOUT (seconds, now {wait.total_seconds():g}). ({type(exc).__name__}: "
        f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''})",
        reporter=launch.rank,
    )


def init_distributed(launch: LaunchEnvironment | None = None) -> tuple[int, int]:
    """Initialise the default process group from the launcher's environment; returns (rank, world size).

    The torch variables of ``launch`` (default :func:`detect_launch`) are exported for ``env://``.
    The backend follows the hardware: NCCL when CUDA is available, gloo otherwise. Every rank waits
    at most :func:`rendezvous_timeout` for all ranks to join (a :class:`RendezvousError` otherwise);
    collectives afterwards have :func:`process_group_timeout`.
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    launch = launch or detect_launch()
    timeout, wait = process_group_timeout(), rendezvous_timeout()
    os.environ.update(launch.torch_variables())
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    if torch.cuda.is_available():
        torch.cuda.set_device(launch.local_rank % torch.cuda.device_count())
        backend = "nccl"
    else:
        backend = "gloo"
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    store = None
    try:
        # torch's env:// rendezvous (torchrun's agent store included), but with the rendezvous timeout while
        # the ranks gather; the process group gets the collective timeout
        store, _, _ = next(dist.rendezvous("env://", launch.rank, launch.world_size, timeout=wait))
        dist.init_process_group(backend=backend, store=dist.PrefixStore("default_pg", store), rank=launch.rank,
                                world_size=launch.world_size, timeout=timeout)
        store.set(f"{_JOINED}{launch.rank}", socket.gethostname())
        store.wait([f"{_JOINED}{r}" for r in range(launch.world_size)], wait)  # NCCL connects lazily: wait here
        store.set_timeout(timeout)
    except (RuntimeError, OSError) as exc:  # DistNetworkError / DistStoreError / a gloo timeout
        if dist.is_initialized():
            dist.destroy_process_group()
        raise _rendezvous_error(launch, wait, store, exc) from exc
    return dist.get_rank(), dist.get_world_size()


def build_trainer(config: ExperimentConfig, rank: int, resume: bool = False, inputs: RunInputs | None = None) -> Trainer:
    """The run's :class:`~stormshard.training.loop.Trainer` (graph, model, init weights, engine), prepared
    (:meth:`~stormshard.training.loop.Trainer.prepare`: the checkpoint loaded at ``--resume``, room for the first
    checkpoint). A failure every rank raises alike before the run writes anything but its graph cache (a
    ``training.init_weights`` shape that depends on the graph's edges,
    :class:`~stormshard.training.finetune.GraphDependentMismatch`, or no room for the first checkpoint, a
    :class:`~stormshard.training.diskspace.DiskSpaceError` every rank has from an all-reduce) leaves the output
    directory as it was: once every rank has it (a barrier: no rank still reads the graph cache), rank 0 removes
    the cache this build wrote, and the directory if the build made it; ``config.json`` is written after."""
    out = Path(config.training.output_dir)
    cache = None if config.data.graph_file else Path(config.data.graph_cache or out / "graph.pt")
    had_out, had_cache = out.exists(), cache is not None and cache.exists()
    trainer = None
    try:
        trainer = Trainer(config, resume=resume, inputs=inputs)
        trainer.prepare()
        return trainer
    except (GraphDependentMismatch, DiskSpaceError) as exc:
        if isinstance(exc, DiskSpaceError) and trainer is None:  # not prepare's: maybe not every rank's
            raise
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()
        if rank == 0:
            if cache is not None and not had_cache:
                cache.unlink(missing_ok=True)
            if not had_out and out.is_dir() and not any(out.iterdir()):
                out.rmdir()
        raise


def save_resolved_config(config: ExperimentConfig) -> Path:
    """``<training.output_dir>/config.json``: the config this run resolved (file, command-line overrides
    and ``--deepspeed_config`` merged, defaults filled in), which ``--config`` reads back. Written
    atomically by the caller's rank (rank 0)."""
    out = Path(config.training.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    target, tmp = out / "config.json", out / ".config.json.tmp"
    try:
        tmp.write_text(json.dumps(config.model_dump(mode="json"), indent=1) + "\n")
        os.replace(tmp, target)
    except BaseException:  # a full disk: the old config.json (if any) as it was, no temporary file left
        tmp.unlink(missing_ok=True)
        raise
    return target


def _collective_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a failed collective (a transport error or timeout of gloo / NCCL)."""
    if isinstance(exc, (RankZeroFailed, RankFailure)):
        return False
    if isinstance(exc, getattr(dist, "DistError", ())) and not isinstance(exc, ConfigError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        marker in text for marker in ("gloo", "NCCL", "Connection closed", "Connection reset", "Timed out", "timed out"))


def run_training(config: str | os.PathLike | dict[str, Any] | ExperimentConfig, resume: bool = False,
                 overrides: dict[str, Any] | None = None, trust_model_code: bool = False) -> TrainResult:
    """Validate ``config`` (and, with ``resume``, that ``training.output_dir`` holds a checkpoint),
    start the process group, train, and shut down.

    A config file that came with a bundle or checkpoint (a stormshard ``metadata.json`` beside it, e.g. a
    bundle's ``finetune_config.json``) is a stored file: a model builder it names as
    ``"package.module:attribute"`` is imported only with ``trust_model_code=True``
    (:func:`~stormshard.models.trust.check_model_code`), as ``launch/train.py --trust-model-code``.

    When this call starts the process group of several ranks, every rank also runs a
    :class:`~stormshard.training.watchdog.RankMonitor`: a failed collective caused by a rank that died
    is re-raised as :class:`~stormshard.training.watchdog.RankFailure` naming that rank.

    The process's glibc malloc is tuned first (:func:`~stormshard.training.malloc_tuning.tune_malloc`:
    fewer page faults per step, no larger peak; ``STORMSHARD_MALLOC_TUNING=0`` leaves it alone).
    """
    tune_malloc()
    cfg = config if isinstance(config, ExperimentConfig) else load_experiment_config(config, overrides)
    stored = stored_beside(config, cfg.model.name) if isinstance(config, (str, os.PathLike)) else None
    if stored is not None:  # before the builder is resolved (preflight imports the run's own)
        check_model_code(cfg.model.name, f"{config} (beside {stored})", trust_model_code)
    owns_group = not dist.is_initialized()
    launch = detect_launch() if owns_group else None
    world = dist.get_world_size() if not owns_group else launch.world_size
    interval, dead_after = monitor_settings()
    process_group_timeout()  # a bad STORMSHARD_DIST_TIMEOUT fails here too
    rendezvous_timeout()  # and a bad STORMSHARD_RENDEZVOUS_TIMEOUT
    inputs = preflight(cfg, world, resume=resume)  # bad input fails here, before any process group exists
    # the torch variables init_distributed writes (DeepSpeed reads them) are put back afterwards, so an
    # in-process run leaves no RANK / MASTER_PORT behind for a later run or subprocess to collide with
    saved_env = {k: os.environ.get(k) for k in launch.torch_variables()} if owns_group else {}
    if owns_group:
        init_distributed(launch)
    rank = dist.get_rank() if dist.is_initialized() else 0
    monitor = None
    if owns_group and world > 1 and interval > 0:
        monitor = RankMonitor(launch.rank, world, launch.master_addr, launch.master_port, interval, dead_after)
    lock = RunLock(cfg.training.output_dir) if rank == 0 else None
    try:
        # one run per output_dir, from before its first file (graph cache, config.json) to its end
        rank_zero_first(lambda: lock.acquire() if lock is not None else None, "taking training.output_dir's lock")
        if resume:  # every rank hashes its files of the checkpoint before anything is written (config.json too)
            found = resume_target(checkpoint_dir(cfg))
            if found is not None:
                verify_resume_files(found.path, rank, world)
        # the checkpoint loaded (--resume), room for the first checkpoint: nothing written yet but the graph cache
        trainer = build_trainer(cfg, rank, resume=resume, inputs=inputs)
        if rank == 0:  # after the graph, model and init weights are built and checked
            save_resolved_config(cfg)
        result = trainer.fit()
        if monitor is not None:
            dist.barrier()  # every rank is done before any heartbeat stops
            monitor.stop()
        return result
    except Exception as exc:
        if monitor is not None:
            if _collective_failure(exc):  # a peer went away: find out which
                failure = monitor.explain()
                if failure is not None:
                    raise failure from exc
            else:  # this rank's own error: it reports it; the others must not name it as dead
                monitor.report_failed()
        raise
    finally:
        if lock is not None:
            lock.release()
        if monitor is not None:
            monitor.stop()
        if owns_group and dist.is_initialized():
            dist.destroy_process_group()
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

