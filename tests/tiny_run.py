"""A tiny experiment config for end-to-end tests (training, conversion): O8 synthetic data, an
O4 hidden grid, a 2-layer transformer, DeepSpeed ZeRO 0, no progress bar."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from stormshard.training.launch import run_training

BASE: dict[str, Any] = {
    "name": "tiny",
    "model": {
        "name": "transformer", "num_channels": 16, "multistep_input": 2, "trainable_size": 4,
        "processor": {"num_layers": 2, "num_heads": 4, "mlp_ratio": 2, "window_size": 16},
        "encoder": {"num_heads": 2, "mlp_ratio": 1.0}, "decoder": {"num_heads": 2, "mlp_ratio": 1.0},
    },
    "graph": {"data_grid": None, "hidden": "o4", "processor": {"kind": "knn", "num_neighbours": 6}},
    "data": {
        "path": "", "forcing": ["insolation"], "diagnostic": ["tracer_product"], "timestep": "6h",
        "train": {"end": "2020-01-10T18"}, "validation": {"start": "2020-01-11"}, "validation_samples": 4,
    },
    "parallel": {"gpus_per_model": 1},
    # compile off explicitly: on CUDA "auto" would compile every tiny run (test_cuda_compile tests compiling)
    "training": {"max_steps": 3, "lr": 1e-3, "warmup_steps": 1, "validation_interval": 100,
                 "checkpoint_interval": 100, "seed": 0, "output_dir": "", "micro_batch_size": 2, "compile": False},
    "engine": "deepspeed",
    "deepspeed": {"zero_optimization": {"stage": 0}},
    "logging": {"progress": False},
}


def tiny_config(dataset: str, out: Path, **changes: Any) -> dict[str, Any]:
    """``BASE`` on ``dataset`` writing to ``out``, with dotted-key ``changes`` (``"training.lr": 3e-3``)."""
    cfg = copy.deepcopy(BASE)
    cfg["data"]["path"] = dataset
    cfg["training"]["output_dir"] = str(out)
    for dotted, value in changes.items():
        node = cfg
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return cfg


def train_losses(rank: int, world: int, cfg: dict[str, Any], resume: bool = False) -> list[float]:
    """Train ``cfg`` on this rank (for ``run_distributed``); the per-step loss curve."""
    return run_training(cfg, resume=resume).losses
