"""The examples: ``examples/custom_architecture.py`` runs as a script on 2 gloo ranks and its loss
goes down; its builder, named from JSON (``examples/custom_architecture.json``), trains through
the training entry at gpus_per_model 2 with the single-process loss curve."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from stormshard.data.synthetic import generate_synthetic_dataset
from stormshard.training.config import load_experiment_config
from stormshard.training.launch import run_training
from tests.distributed import run_distributed

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "examples" / "custom_architecture.json"


def test_custom_architecture_example_trains():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "custom_architecture.py")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    losses = [float(v) for v in re.findall(r"loss (\d+\.\d+)", proc.stdout)]
    assert len(losses) == 4, proc.stdout  # steps 0, 8, 16, 24
    assert losses[-1] < 0.6 * losses[0], proc.stdout


def _tiny(dataset: str, out: Path, gpus_per_model: int) -> dict:
    """The example's JSON config on the O8 test dataset, shortened to a few steps."""
    cfg = json.loads(CONFIG.read_text())
    cfg["data"].update(path=dataset, train={"end": "2020-01-10T18"}, validation={"start": "2020-01-11"},
                       validation_samples=2)
    cfg["parallel"]["gpus_per_model"] = gpus_per_model
    cfg["training"].update(max_steps=6, warmup_steps=1, lr=3e-3, validation_interval=100, checkpoint_interval=100,
                           output_dir=str(out))
    cfg["logging"]["progress"] = False
    return cfg


def _train(rank: int, world: int, cfg: dict) -> list[float]:
    return run_training(cfg).losses


def test_custom_model_from_json_trains_sharded_like_one_process(tmp_path):
    dataset = tmp_path / "synthetic.zarr"
    generate_synthetic_dataset(dataset, grid="o8", steps=64, seed=1)
    config = load_experiment_config(_tiny(str(dataset), tmp_path / "check", 2))  # its form checked, nothing imported
    assert config.model.name == "examples.custom_architecture:build" and config.model.options["num_layers"] == 2

    single = _train(0, 1, _tiny(str(dataset), tmp_path / "single", 1))
    sharded = run_distributed(_train, 2, _tiny(str(dataset), tmp_path / "sharded", 2))
    assert sharded[0] == sharded[1], "the ranks of the model group log different losses"
    assert len(single) == 6
    assert sharded[0] == pytest.approx(single, rel=2e-5, abs=0), (sharded[0], single)
    assert single[-1] < single[0], single
