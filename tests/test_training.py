"""The training loop end to end: loss parity across layouts, resume, skill against persistence,
ensemble training, and bad configs that fail before anything is created."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from stormshard.training.config import ConfigError, load_experiment_config
from stormshard.training.launch import run_training
from tests.distributed import run_distributed
from tests.tiny_run import tiny_config


def _config(dataset: str, out: Path, **changes) -> dict:
    return tiny_config(dataset, out, **changes)


def _train(rank, world, cfg, resume=False):
    result = run_training(cfg, resume=resume)
    return result.losses, result.validation


# ------------------------------------------------------------------------------ loss parity

LAYOUTS = [  # (world, gpus_per_model, micro batch): the same effective batch of 2 everywhere
    (1, 1, 2),
    (2, 1, 1),
    (2, 2, 2),
    (4, 2, 1),
]


def test_loss_parity_across_layouts(dataset, tmp_path):
    losses = {}
    for world, gpm, micro in LAYOUTS:
        cfg = _config(dataset, tmp_path / f"w{world}g{gpm}", **{
            "parallel.gpus_per_model": gpm, "training.micro_batch_size": micro})
        if world == 1:
            losses[(world, gpm)] = _train(0, 1, cfg)[0]
        else:
            out = run_distributed(_train, world, cfg)
            assert all(o[0] == out[0][0] for o in out), "ranks disagree on the logged loss"
            losses[(world, gpm)] = out[0][0]
    reference = losses[(1, 1)]
    assert len(reference) == 3
    for layout, curve in losses.items():
        assert curve == pytest.approx(reference, rel=2e-5), f"layout {layout}: {curve} vs {reference}"


def test_tensor_parallel_and_graph_processors_match_single_process(dataset, tmp_path):
    for i, extra in enumerate([
        {"parallel.shard_strategy": "tensor"},
        {"model.name": "graphtransformer", "graph.hidden": "ico1", "graph.processor": {"kind": "multimesh"}},
    ]):
        single = _train(0, 1, _config(dataset, tmp_path / f"single{i}", **extra))[0]
        sharded = run_distributed(_train, 2, _config(dataset, tmp_path / f"sharded{i}", **{
            "parallel.gpus_per_model": 2, **extra}))[0][0]
        assert sharded == pytest.approx(single, rel=2e-5), extra


@pytest.mark.parametrize("kind", ["huber", "rmse"])
def test_training_loss_kind_trains_equal_at_every_layout(dataset, tmp_path, kind):
    """``training.loss`` reaches the trained loss (its curve differs from the MSE's) and a model group of 2 records
    the single-process curve (the Huber threshold 0.5 in normalised units: both branches are taken)."""
    changes = {"training.loss": kind, "training.huber_delta": 0.5}
    single = _train(0, 1, _config(dataset, tmp_path / "single", **changes))[0]
    sharded = run_distributed(_train, 2, _config(dataset, tmp_path / "sharded", **{
        "parallel.gpus_per_model": 2, **changes}))[0][0]
    assert sharded == pytest.approx(single, rel=2e-5)
    mse = _train(0, 1, _config(dataset, tmp_path / "mse"))[0]
    assert all(abs(a - b) > 1e-3 * abs(b) for a, b in zip(single, mse, strict=True)), (single, mse)


# ------------------------------------------------------------------------------ resume


def test_resume_equals_uninterrupted(dataset, tmp_path):
    """A run interrupted after step 2 (only its step-2 checkpoint survives) and resumed gives the
    uninterrupted loss curve, bit for bit."""
    changes = {"parallel.gpus_per_model": 2, "training.max_steps": 5, "training.checkpoint_interval": 2,
               "training.keep_checkpoints": 5, "deepspeed.zero_optimization": {"stage": 1}}
    full = run_distributed(_train, 2, _config(dataset, tmp_path / "full", **changes))[0][0]
    assert len(full) == 5
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(tmp_path / "full" / "checkpoints" / "step_00000002",
                    resumed_dir / "checkpoints" / "step_00000002")
    resumed = run_distributed(_train, 2, _config(dataset, resumed_dir, **changes), True)[0][0]
    assert resumed == full[2:]
    # a checkpoint of an earlier release stores the old spellings of the strategy and precision:
    # --resume reads them into their one home and resumes the same curve
    old_dir = tmp_path / "old_spellings"
    step = old_dir / "checkpoints" / "step_00000002"
    shutil.copytree(tmp_path / "full" / "checkpoints" / "step_00000002", step)
    metadata = json.loads((step / "metadata.json").read_text())
    stored = metadata["config"]
    stored["parallel"]["shard_strategy"] = None
    stored["model"]["processor"]["shard_strategy"] = "shard_sequence"
    stored["deepspeed"]["bf16"] = {"enabled": False}
    (step / "metadata.json").write_text(json.dumps(metadata))
    old = run_distributed(_train, 2, _config(dataset, old_dir, **changes), True)[0][0]
    assert old == full[2:]


def test_resume_without_checkpoint_fails_before_anything_is_created(dataset, tmp_path):
    out = tmp_path / "fresh"
    with pytest.raises(ConfigError) as err:
        run_training(_config(dataset, out), resume=True)
    message = str(err.value)
    assert str(out / "checkpoints") in message and "remove --resume" in message and "training.output_dir" in message
    assert not out.exists()
    # the launcher reports it without a traceback
    cfg_file = tmp_path / "fresh.json"
    cfg_file.write_text(json.dumps(_config(dataset, out)))
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_cli", Path(__file__).parent.parent / "launch" / "train.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    assert cli.main(["--config", str(cfg_file), "--resume"]) == 2
    assert not out.exists()


# ------------------------------------------------------------------------------ read_group_size


def _train_counting_reads(rank, world, cfg):
    """Train and count this rank's reads from the store (AnemoiDataset.read calls)."""
    from stormshard.data.anemoi_layout import AnemoiDataset

    original, calls = AnemoiDataset.read, [0]

    def counting(self, *args, **kwargs):
        calls[0] += 1
        return original(self, *args, **kwargs)

    AnemoiDataset.read = counting
    try:
        result = run_training(cfg)
    finally:
        AnemoiDataset.read = original
    return result.losses, result.validation, calls[0]


def test_read_group_size_readers_hand_out_slices(dataset, tmp_path):
    """r readers per model group: the losses and validation equal the default (every rank reads its
    own slice), and only the readers touch the store."""
    runs = {}
    for r in (None, 2, 1):
        cfg = _config(dataset, tmp_path / f"r{r}", **{"parallel.gpus_per_model": 2, "parallel.read_group_size": r,
                                                      "training.rollout": 2})
        runs[r] = run_distributed(_train_counting_reads, 2, cfg)
    default = runs[None]
    assert default[0][2] > 0 and default[1][2] > 0  # r = gpus_per_model: every rank reads
    for r in (2, 1):
        for rank in range(2):
            assert runs[r][rank][0] == default[0][0], f"read_group_size={r}: losses differ"
            assert runs[r][rank][1] == default[0][1], f"read_group_size={r}: validation differs"
    assert runs[2][0][2] == default[0][2] and runs[2][1][2] == default[1][2]
    assert runs[1][0][2] == default[0][2] and runs[1][1][2] == 0, "only the reader may touch the store"


# ------------------------------------------------------------------------------ skill


def test_tiny_model_beats_persistence(dataset, tmp_path):
    cfg = _config(dataset, tmp_path / "skill", **{
        "training.max_steps": 400, "training.lr": 3e-3, "training.warmup_steps": 10, "engine": "local", "deepspeed": {},
        "training.micro_batch_size": 2, "model.num_channels": 32,
        "data.validation_samples": 8})
    losses, validation = _train(0, 1, cfg)
    assert losses[-1] < 0.5 * losses[0]
    for name in ("tracer_1", "tracer_2", "tracer_3"):
        assert validation["rmse"][name] < 0.8 * validation["persistence"][name], validation


def test_ensemble_training_runs_and_learns(dataset, tmp_path):
    cfg = _config(dataset, tmp_path / "ens", **{
        "model.name": "ensemble", "model.ensemble": {"noise_channels": 2}, "parallel.gpus_per_model": 1,
        "parallel.gpus_per_ensemble": 2, "parallel.ensemble_size_per_device": 2, "training.max_steps": 6,
        "training.micro_batch_size": 1})
    out = run_distributed(_train, 2, cfg)
    losses = out[0][0]
    assert out[1][0] == losses and len(losses) == 6 and losses[-1] < losses[0]


# ------------------------------------------------------------------------------ bad configs

BAD = [
    ({"model.num_chanels": 16}, "model.num_chanels"),
    ({"model.num_channels": 10}, "num_channels=10 is not divisible"),
    ({"parallel.pipeline_model_parallel_size": 2}, "pipeline_model_parallel_size=2"),
    ({"parallel.tensor_model_parallel_size": 2, "parallel.gpus_per_model": 4}, "tensor_model_parallel_size=2"),
    ({"parallel.gpus_per_model": 2}, "world_size=1 is not a multiple of gpus_per_model=2"),
    ({"training.max_steps": None}, "exactly one of max_steps and epochs"),
    ({"training.lr": -1}, "training.lr"),
    ({"deepspeed.zero_optimization": {"stage": 3}}, "stage=3 is not supported"),
    ({"compression": {"rank": 2}, "engine": "local", "deepspeed": {}}, "engine='local' has no data parallelism"),
    ({"data.path": "/nonexistent/data.zarr"}, "data.path='/nonexistent/data.zarr' does not exist"),
    ({"data.forcing": ["sst"]}, "forcing variables ['sst'] are not in"),
    ({"graph.hidden": "cube7"}, "hidden='cube7'"),
    ({"engine": "horovod"}, "engine"),
    ({"model.name": "ensemble"}, "at least 2 members"),
    ({"training.loss": "l1"}, "training.loss = \"l1\": Input should be 'mse', 'mae', 'huber', 'logcosh' or 'rmse'"),
    ({"training.huber_delta": 0}, "training.huber_delta = 0: Input should be greater than 0"),
    ({"model.name": "ensemble", "parallel.ensemble_size_per_device": 2, "training.loss": "mae"},
     "training.loss='mae' with model.name='ensemble'"),
    ({"parallel.shard_strategy": "tensor", "model.processor.shard_strategy": "shard_heads"},
     "model.processor.shard_strategy='shard_heads' (deprecated) and parallel.shard_strategy='tensor' disagree"),
]


@pytest.mark.parametrize("changes, fragment", BAD, ids=[b[1][:30] for b in BAD])
def test_bad_configs_fail_before_anything_is_created(dataset, tmp_path, changes, fragment):
    out = tmp_path / "run"
    cfg = _config(dataset, out, **changes)
    with pytest.raises((ConfigError, ValueError)) as err:
        run_training(cfg)
    assert fragment in str(err.value), str(err.value)
    assert not out.exists()


def test_config_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_experiment_config(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_experiment_config(bad)
    bad.write_text(json.dumps({"modle": {}}))
    with pytest.raises(ConfigError, match="modle = .*unknown key"):
        load_experiment_config(bad)


def test_shipped_configs_validate():
    paths = sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.json"))
    assert len(paths) >= 8, "the shipped configs were not found next to tests/"
    for path in paths:
        load_experiment_config(path)
