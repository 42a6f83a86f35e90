"""Process start-up for the entry points: one process or many, CPU (gloo) or GPU (NCCL).

``run_training(config_path)`` validates the config *before* any process group or file is
created, initialises ``torch.distributed`` from the launcher's environment (DeepSpeed's
launcher, torchrun or SLURM+torchrun set RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT; a plain
``python`` start gets a one-process group on a free local port), trains, and tears down.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import torch
import torch.distributed as dist

from stormshard.training.config import ExperimentConfig, load_experiment_config
from stormshard.training.loop import TrainResult, train
from stormshard.training.preflight import preflight

__all__ = ["init_distributed", "run_training"]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed() -> tuple[int, int]:
    """Initialise the default process group from the environment; returns (rank, world size).

    The backend follows the hardware: NCCL when CUDA is available, gloo otherwise.
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if "WORLD_SIZE" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        backend = "nccl"
    else:
        backend = "gloo"
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group(backend=backend)
    return dist.get_rank(), dist.get_world_size()


def run_training(config: str | os.PathLike | dict[str, Any] | ExperimentConfig, resume: bool = False,
                 overrides: dict[str, Any] | None = None) -> TrainResult:
    """Validate ``config`` (and, with ``resume``, that ``training.output_dir`` holds a checkpoint),
    start the process group, train, and shut down."""
    cfg = config if isinstance(config, ExperimentConfig) else load_experiment_config(config, overrides)
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    inputs = preflight(cfg, world, resume=resume)  # bad input fails here, before any process group exists
    owns_group = not dist.is_initialized()
    init_distributed()
    try:
        return train(cfg, resume=resume, inputs=inputs)
    finally:
        if owns_group and dist.is_initialized():
            dist.destroy_process_group()
