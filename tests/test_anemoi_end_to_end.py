"""The anemoi path end to end: an imported model fine-tunes with anemoi-training's own loss (the
checkpoint's area weights, normalised as anemoi-training's loss scaler does), and the README's
import + fine-tune commands run as written. The reference loss was recorded by anemoi-training itself
(``tests/fixtures/anemoi/make_fixtures.py first-loss``); no anemoi needed here."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from stormshard.checkpoint.anemoi_import import import_anemoi
from stormshard.data.anemoi_layout import AnemoiDataset
from stormshard.data.synthetic import generate_synthetic_dataset
from stormshard.graphs.builder import load_graph, save_graph
from stormshard.training.config import load_experiment_config
from stormshard.training.launch import run_training

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "anemoi"


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    """The harness's synthetic O16 store (seed 0, 6-hourly from 2020-01-01), its first 4 days: the
    fields are a function of the date, so its values are those anemoi-training read."""
    path = tmp_path_factory.mktemp("anemoi-e2e") / "o16.zarr"
    generate_synthetic_dataset(path, grid="o16", steps=16, seed=0)
    return path


def _first_loss(bundle: Path, dataset: Path, out: Path, *extra: str) -> float:
    """The first training loss of ``finetune_config.json`` on the one window of the recorded loss."""
    ref = json.loads((FIXTURES / "gt" / "first_loss.json").read_text())
    start, end = ref["window"]
    cfg = load_experiment_config(bundle / "finetune_config.json", cli_overrides=[
        f"data.path={dataset}", f"training.output_dir={out}", "training.max_steps=1", "training.warmup_steps=0",
        f"data.train.start={start}", f"data.train.end={end}", "data.validation.start=2020-01-03T18",
        "data.validation_samples=1", "data.num_workers=0", "logging.progress=false", "engine=local", *extra])
    return run_training(cfg).losses[0]


@pytest.mark.parametrize("variant", ["gt", "transformer", "gt_truncated", "gt_bounded", "gnn", "transformer_qk_gated",
                                     "gt_qk_gated"])
def test_first_finetune_loss_equals_anemoi_trainings(variant, dataset, tmp_path):
    """The imported model's first fine-tuning loss equals anemoi-training's loss of the same weights on
    the same window (gt 0.78430599 vs 0.78430593, transformer 0.73775935 vs 0.73775929: 8e-8 apart),
    because the bundle's data nodes carry the checkpoint's area weights normalised unit-sum, as
    anemoi's node_weights scaler; with every weight 1 (the import before) gt's loss is 2.8% off.
    gt_truncated (anemoi's TruncatedConnection): its inference checkpoint, written at the step of the
    last.ckpt anemoi-training warm-started from (a Lightning file holds no truncation matrices). gt_bounded
    (anemoi's bounding list: relu, hardtanh, fraction, leaky hardtanh, normalized relu) from its last.ckpt. gnn
    (anemoi-training's packaged GNN model) from its last.ckpt: 0.50750125 recorded. transformer_qk_gated / gt_qk_gated
    (anemoi's qk_norm and gated MLPs, tests/test_anemoi_options.py) from their last.ckpt."""
    ref = json.loads((FIXTURES / variant / "first_loss.json").read_text())
    source = "inference.ckpt" if variant == "gt_truncated" else "last.ckpt"
    bundle = import_anemoi(FIXTURES / variant / source, tmp_path / "bundle")
    graph = load_graph(bundle / "graph.pt")
    area = graph["data"].area_weight
    assert torch.isclose(area.double().sum(), torch.tensor(1.0, dtype=torch.float64), atol=1e-6)
    assert float(area.max() / area.min()) > 2  # not uniform: O16 cells differ in area
    assert "'area_weight'" in json.loads((bundle / "metadata.json").read_text())["anemoi"]["loss_node_weights"]
    # the window anemoi-training used: its normalised sums equal ours (the bundle's statistics)
    stats = json.loads((bundle / "statistics.json").read_text())
    ds = AnemoiDataset.open(dataset)
    first = int(np.searchsorted(ds.dates, np.datetime64(ref["window"][0])))
    x = np.asarray(ds.data[first:first + 3, :, 0, :], dtype=np.float64)  # (time, variables, grid)
    mean, std = (np.array([stats[v][k] for v in ds.variables]) for k in ("mean", "stdev"))
    np.testing.assert_allclose(((x - mean[:, None]) / std[:, None]).sum(axis=-1), ref["window_sums"], rtol=1e-4)

    loss = _first_loss(bundle, dataset, tmp_path / "run")
    assert loss == pytest.approx(ref["loss"], rel=1e-6, abs=0), (loss, ref["loss"])
    if variant == "gt":  # the same run with uniform weights: measurably off, so the match is no accident
        graph["data"].area_weight = torch.ones_like(area)
        save_graph(graph, tmp_path / "uniform.pt")
        uniform = _first_loss(bundle, dataset, tmp_path / "uniform", f"data.graph_file={tmp_path / 'uniform.pt'}")
        assert abs(uniform / ref["loss"] - 1) > 0.01, (uniform, ref["loss"])
    if variant == "gt_bounded":  # the same weights without the bounding list: 0.674 against 0.758
        config = json.loads((bundle / "finetune_config.json").read_text())
        config["model"]["bounding"] = []
        (bundle / "finetune_config.json").write_text(json.dumps(config))
        unbounded = _first_loss(bundle, dataset, tmp_path / "unbounded")
        assert abs(unbounded / ref["loss"] - 1) > 0.05, (unbounded, ref["loss"])


def _readme_commands() -> list[str]:
    """The command lines of the first code block of the README's "Coming from anemoi"."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("### Coming from anemoi"):]
    block = re.search(r"\n\n((?:    .*\n)+)", section)
    assert block, "no code block in 'Coming from anemoi'"
    return [line.strip() for line in block.group(1).splitlines() if line.strip()]


def test_readme_import_and_finetune_commands_run_as_written(tmp_path):
    """The README's ``import-anemoi`` line, then its fine-tune line, exactly as written, in a folder
    holding what they name (the gt fixture as ``run/checkpoint/inference-last.ckpt``, a synthetic
    ``DATASET.zarr`` reaching anemoi's validation dates, ``launch``): the bundle's config carries
    anemoi's training and validation dates, so the run starts, trains and validates (its steps cut to 3
    in the bundle's config, to keep the test short)."""
    commands = _readme_commands()
    imports = next(c for c in commands if "import-anemoi" in c)
    finetune = next(c for c in commands if "launch/train.py" in c)
    assert finetune == ("python launch/train.py --config bundles/aifs/finetune_config.json data.path=DATASET.zarr "
                        "training.output_dir=runs/ft")
    (tmp_path / "launch").symlink_to(ROOT / "launch")
    (tmp_path / "run" / "checkpoint").mkdir(parents=True)
    (tmp_path / "run" / "checkpoint" / "inference-last.ckpt").write_bytes((FIXTURES / "gt" / "inference.ckpt").read_bytes())
    generate_synthetic_dataset(tmp_path / "DATASET.zarr", grid="o16", steps=4 * 153, seed=0)  # to 2020-06-01

    def run(line: str) -> subprocess.CompletedProcess:
        argv = shlex.split(line)
        assert argv[0] == "python"
        return subprocess.run([sys.executable, *argv[1:]], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                              env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT)))

    result = run(imports)
    assert result.returncode == 0, result.stderr[-3000:]
    config_path = tmp_path / "bundles" / "aifs" / "finetune_config.json"
    config = json.loads(config_path.read_text())
    assert config["data"]["train"] == {"start": None, "end": "2020-04-30T18:00:00"}  # anemoi's dataloader dates
    assert config["data"]["validation"] == {"start": "2020-05-01T00:00:00", "end": "2020-05-31T18:00:00"}
    config["training"].update(max_steps=3, warmup_steps=1)
    config_path.write_text(json.dumps(config, indent=1))
    result = run(finetune)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = [json.loads(line) for line in (tmp_path / "runs" / "ft" / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in metrics if "loss" in m]
    assert len(losses) == 3 and all(np.isfinite(losses)), metrics
    assert (tmp_path / "runs" / "ft" / "checkpoints").is_dir()
