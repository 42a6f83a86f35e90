"""Entry points fail cleanly: one message naming the field and the fix, from rank 0 only, exit status 2
for bad input, a traceback only with --debug; the checks that used to run late now run before anything
is created."""

from __future__ import annotations

import importlib.util
import io
import json
import shutil
from pathlib import Path

import pytest
import zarr

from stormshard.cli import report_failure
from tests.tiny_run import tiny_config

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.filterwarnings("ignore")


def _cli(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_cli", ROOT / "launch" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def _one_process(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS",
                "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        monkeypatch.delenv(key, raising=False)


def _world(monkeypatch, world: int, rank: int = 0) -> None:
    """The torch variables of a rank in a ``world``-rank job (preflight fails before any group is made)."""
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29999")
    monkeypatch.setenv("STORMSHARD_DIST_TIMEOUT", "10")  # a check that let the run start would fail fast


def _train(tmp_path: Path, dataset: str, capsys, *extra: str, **changes) -> tuple[int, str]:
    cfg = tiny_config(dataset, tmp_path / "run", **changes)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    status = _cli("train").main(["--config", str(path), *extra])
    return status, capsys.readouterr().err


BAD_CONFIGS = [
    # the deepspeed section: DeepSpeed 0.19's keys, what stormshard honours, and engine conflicts
    ({"deepspeed.train_micro_batch_size_per_gpuu": 2},
     ["deepspeed.train_micro_batch_size_per_gpuu is not a key DeepSpeed 0.19 accepts", "training.micro_batch_size"]),
    ({"deepspeed.zero_optimization": {"stage": 1, "overlap_com": True}}, ["zero_optimization.overlap_com", "overlap_comm"]),
    ({"deepspeed.zero_optimization": {"stage": 3}}, ["deepspeed.zero_optimization.stage=3 is not supported"]),
    ({"deepspeed.zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, ["read only at ZeRO stage 3"]),
    ({"deepspeed.pipeline": {"stages": 2}}, ["deepspeed.pipeline is not honoured", "parallel.gpus_per_model"]),
    ({"deepspeed.checkpoint": {"tag_validation": "warn"}}, ["deepspeed.checkpoint", "training.checkpoint_interval"]),
    ({"deepspeed.amp": {"enabled": True}}, ["deepspeed.amp was removed"]),
    ({"deepspeed.bf16": {"enabled": False, "immediate_grad_updat": True}}, ["bf16.immediate_grad_updat"]),
    ({"engine": "local", "deepspeed": {"zero_optimization": {"stage": 1}}},
     ["engine='local' does not read it", "remove the deepspeed section"]),
    ({"engine": "ddp", "deepspeed": {"bf16": {"enabled": True}}}, ["deepspeed.bf16", "training.precision"]),
    # late checks moved before anything starts
    ({"graph.processor": {"kind": "knn", "num_neighbours": 500}},
     ["graph.processor.num_neighbours=500 exceeds the 207 source nodes", "lower it to at most 207"]),
    ({"graph.encoder": {"kind": "knn", "num_neighbours": 600}}, ["graph.encoder.num_neighbours=600 exceeds the 544"]),
    ({"graph.decoder": {"kind": "knn", "num_neighbours": 300}}, ["graph.decoder.num_neighbours=300"]),
    ({"training.output_dir": "/proc/stormshard-cannot-write/run"}, ["training.output_dir="]),
]


@pytest.mark.parametrize("changes, fragments", BAD_CONFIGS, ids=[c[1][0][:40] for c in BAD_CONFIGS])
def test_bad_config_one_message_exit_2(dataset, tmp_path, capsys, changes, fragments):
    status, err = _train(tmp_path, dataset, capsys, **changes)
    assert status == 2, err
    assert err.count("error:") == 1 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in err, err
    assert not (tmp_path / "run").exists()


LAYOUT_CASES = [
    (48, {"graph.hidden": "o1", "parallel.gpus_per_model": 48, "graph.processor": {"kind": "knn", "num_neighbours": 3},
          "engine": "local", "deepspeed": {}}, ["graph.hidden='o1' (40 nodes)", "fewer nodes than the 48 ranks"]),
    (2, {"parallel.gpus_per_model": 2, "parallel.shard_strategy": "tensor", "model.num_channels": 24,
         "model.processor": {"num_layers": 1, "num_heads": 3, "mlp_ratio": 2, "window_size": 16}},
     ["model.processor.num_heads=3 is not divisible by parallel.gpus_per_model=2", "'tensor'"]),
    (2, {"parallel.gpus_per_model": 2, "parallel.shard_strategy": "shard_heads", "model.num_channels": 24,
         "model.processor": {"num_layers": 1, "num_heads": 3, "mlp_ratio": 2, "window_size": 16}},
     ["num_heads=3 is not divisible", "'shard_heads'", "shard_strategy='shard_sequence'"]),
]


@pytest.mark.parametrize("world, changes, fragments", LAYOUT_CASES, ids=["hidden<ranks", "tensor-heads",
                                                                         "shard_heads-heads"])
def test_layout_checks_run_before_the_process_group(dataset, tmp_path, capsys, monkeypatch, world, changes, fragments):
    _world(monkeypatch, world)
    status, err = _train(tmp_path, dataset, capsys, **{"parallel.read_group_size": 1, **changes})
    assert status == 2, err
    assert err.count("error:") == 1 and "Traceback" not in err
    for fragment in fragments:
        assert fragment in err, err
    assert not (tmp_path / "run").exists()


def test_only_rank_zero_prints_and_debug_adds_the_traceback(dataset, tmp_path, capsys, monkeypatch):
    _world(monkeypatch, 2, rank=1)
    status, err = _train(tmp_path, dataset, capsys, **{"deepspeed.zero_optimization": {"stage": 3}})
    assert status == 2 and err == "", err  # rank 1 reaches the same verdict and stays quiet
    _world(monkeypatch, 2, rank=0)
    status, err = _train(tmp_path, dataset, capsys, "--debug", **{"deepspeed.zero_optimization": {"stage": 3}})
    assert status == 2 and "Traceback" in err and err.count("error: ") == 1, err


def test_zero_standard_deviation_is_named_before_training(dataset, tmp_path, capsys):
    copy = tmp_path / "constant.zarr"
    shutil.copytree(dataset, copy)
    stdev = zarr.open_group(str(copy), mode="r+")["stdev"]
    values = stdev[:]
    values[1] = 0.0  # tracer_2 became a constant field
    stdev[:] = values
    status, err = _train(tmp_path, str(copy), capsys, **{"data.path": str(copy)})
    assert status == 2, err
    assert "variable 'tracer_2'" in err and "standard deviation is 0" in err, err
    assert "data.normalisation_methods={'tracer_2': 'none'}" in err
    assert not (tmp_path / "run").exists()


def test_deepspeed_config_file_batch_is_checked_before_start(dataset, tmp_path, capsys):
    ds_file = tmp_path / "ds.json"
    ds_file.write_text(json.dumps({"train_batch_size": 8, "zero_optimization": {"stage": 1}}))  # no micro batch
    status, err = _train(tmp_path, dataset, capsys, "--deepspeed_config", str(ds_file))
    assert status == 2, err
    assert "deepspeed.train_batch_size=8 but training.micro_batch_size 2" in err and "= 2" in err, err
    assert not (tmp_path / "run").exists()


def test_convert_checkpoint_names_foreign_metadata(tmp_path, capsys):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "metadata.json").write_text(json.dumps({"format": "anemoi-checkpoint", "version": "1.0",
                                                       "dataset": {"name": "era5"}}))
    assert _cli("convert_checkpoint").main(["inspect", str(foreign)]) == 2
    err = capsys.readouterr().err
    assert "is not the metadata of a stormshard training checkpoint" in err and "step: missing" in err, err
    assert "dataset: foreign key" in err and "Traceback" not in err and err.count("error:") == 1
    layout = tmp_path / "layout"
    layout.mkdir()
    (layout / "metadata.json").write_text(json.dumps({
        "format": 1, "step": 1, "world_size": 1, "layout": {"world_size": 1, "dp_size": 1}, "config": {},
        "ranks": [{"rank": 0, "parameters": [{"name": "w", "shape": [1]}]}]}))
    assert _cli("convert_checkpoint").main(["consolidate", str(layout), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "layout.dp_size: foreign key" in err and "rows lack ['full_shape', 'partition']" in err, err
    assert not (tmp_path / "out").exists()


def test_forecast_missing_paths_exit_2_without_traceback(tmp_path, capsys):
    status = _cli("forecast").main(["--model", str(tmp_path / "missing_bundle"), "--dataset",
                                    str(tmp_path / "missing.zarr"), "--date", "2020-01-05T00", "--out",
                                    str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert status == 2 and err.count("error:") == 1 and "Traceback" not in err, err
    assert "missing" in err


def test_report_failure_rules():
    from pydantic import BaseModel, ValidationError

    class M(BaseModel):
        x: int

    try:
        M(x="a")
    except ValidationError as exc:
        stream = io.StringIO()
        assert report_failure(exc, stream=stream) == 2
        assert stream.getvalue().startswith("error: M: x = \"a\": Input should be a valid integer"), stream.getvalue()
    stream = io.StringIO()
    assert report_failure(KeyError("bug"), stream=stream) == 1
    assert "error: KeyError" in stream.getvalue() and "--debug" in stream.getvalue()
    stream = io.StringIO()
    assert report_failure(FileNotFoundError(2, "No such file or directory", "/x/y.zarr"), stream=stream) == 2
    assert stream.getvalue() == "error: /x/y.zarr: No such file or directory: check the path\n"
