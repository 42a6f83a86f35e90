"""The graph-transformer quickstart trained with ``model.graph_kernel: "triton"`` tracks the csr run.

``configs/quickstart_graphtransformer.json`` (2 ranks, the model sharded by destination node, DeepSpeed
ZeRO 1, fp32) trains a few steps with each graph kernel on the same generated data; the Triton run's
per-step losses equal the csr run's within 1e-4 (relative). On a CPU the Triton kernels run in Triton's
interpreter, one numpy call per tile operation of every program, so the model is shrunk to what the
interpreter trains in seconds: O1 data (40 cells), an ico0 multimesh (12 nodes), one processor block, 16
channels, micro-batch 1; layout, engine, optimizer and graph kinds are the quickstart's.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from stormshard.data.synthetic import generate_synthetic_dataset
from tests.distributed import run_distributed
from tests.tiny_run import train_losses

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (pip install triton)")

ROOT = Path(__file__).resolve().parents[1]


def _config(dataset: str, out: Path, graph_kernel: str) -> dict:
    cfg = json.loads((ROOT / "configs" / "quickstart_graphtransformer.json").read_text())
    cfg["model"].update(num_channels=16, graph_kernel=graph_kernel)
    cfg["model"]["processor"].update(num_layers=1, num_heads=4)
    cfg["model"]["encoder"]["num_heads"] = cfg["model"]["decoder"]["num_heads"] = 2
    cfg["graph"]["hidden"] = "ico0"
    cfg["data"].update(path=dataset, train={"start": None, "end": "2020-01-06T18"},
                       validation={"start": "2020-01-07", "end": None}, validation_samples=1)
    cfg["training"].update(max_steps=3, warmup_steps=1, micro_batch_size=1, validation_interval=100,
                           checkpoint_interval=100, output_dir=str(out))
    cfg["logging"] = {"progress": False, "wandb": False}
    return cfg


def test_quickstart_graphtransformer_trains_the_same_with_the_triton_kernel(tmp_path):
    dataset = str(tmp_path / "o1.zarr")
    generate_synthetic_dataset(dataset, grid="o1", steps=40, seed=3)
    losses = {kernel: run_distributed(train_losses, 2, _config(dataset, tmp_path / kernel, kernel), timeout=600)[0]
              for kernel in ("csr", "triton")}
    assert len(losses["triton"]) == len(losses["csr"]) == 3
    for a, b in zip(losses["triton"], losses["csr"], strict=True):
        assert math.isclose(a, b, rel_tol=1e-4), losses
