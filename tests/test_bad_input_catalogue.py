"""A catalogue of bad inputs to the three entry points (``launch/train.py``, ``launch/convert_checkpoint.py``,
``launch/forecast.py``): each exits with status 2 and one ``error:`` line naming the field and the value,
prints no traceback, and writes or changes nothing on disk (every file and directory under the test's
root is the same before and after). The cases run in-process through each launcher's ``main(argv)``;
a few run as subprocesses to prove the exit status, the output and that a bad config fails before torch
is imported. Also here: the command-line overrides, the resolved config saved with a run, the
``--resume`` differences and the in-sample forecast warning."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import zarr

from stormshard.data.synthetic import generate_synthetic_dataset
from tests.bad_input_helpers import run_main as _main  # the launchers in-process
from tests.bad_input_helpers import snapshot as _snapshot
from tests.test_cli_errors import _cli, _one_process  # noqa: F401 - the launchers in-process; one-process env
from tests.tiny_run import tiny_config

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.filterwarnings("ignore")


@dataclass(frozen=True)
class World:
    """Everything the cases read, made once: a dataset and broken copies, a config, a trained run, a bundle."""

    root: Path
    dataset: Path
    config: Path
    run: Path  # a trained run: config.json, checkpoints/, metrics.jsonl
    bundle: Path

    @property
    def ckpt(self) -> Path:
        return self.run / "checkpoints"

    def file(self, name: str) -> Path:
        return self.root / "inputs" / name


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _broken_dataset(src: Path, dst: Path, change: Callable[[zarr.Group, Path], None]) -> None:
    shutil.copytree(src, dst)
    change(zarr.open_group(str(dst), mode="r+"), dst)


def _drop_chunks(store: Path, name: str) -> None:
    """The array ``name`` stays listed but loses every stored value (an interrupted copy)."""
    for item in (store / name).iterdir():
        if not item.name.startswith(".") and item.name != "zarr.json":
            shutil.rmtree(item) if item.is_dir() else item.unlink()


def _drop_array(store: Path, name: str) -> None:
    """The array ``name`` is gone, from the consolidated metadata too."""
    shutil.rmtree(store / name)
    for meta_file in (store / ".zmetadata", store / "zarr.json"):
        if meta_file.is_file():
            meta = json.loads(meta_file.read_text())
            table = meta.get("metadata") or (meta.get("consolidated_metadata") or {}).get("metadata") or {}
            for key in [k for k in table if k == name or k.startswith(f"{name}/")]:
                del table[key]
            meta_file.write_text(json.dumps(meta))


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    root = tmp_path_factory.mktemp("catalogue")
    dataset = root / "o8.zarr"
    generate_synthetic_dataset(dataset, grid="o8", steps=64, seed=1)
    cfg = tiny_config(str(dataset), root / "run")
    config = _write(root / "inputs" / "config.json", json.dumps(cfg, indent=1))
    # the trained run (also the positive test of command-line overrides: they reach the saved config)
    run = root / "trained"
    status = _cli("train").main(["--config", str(config), f"training.output_dir={run}", "engine=local", "deepspeed={}",
                                 "training.max_steps=2", "data.validation_samples=1", "training.seed=7"])
    assert status == 0
    bundle = root / "bundle"
    assert _cli("convert_checkpoint").main(["export", str(run / "checkpoints"), "--out", str(bundle)]) == 0
    w = World(root, dataset, config, run, bundle)
    # config files
    text = json.dumps(cfg, indent=1)
    _write(w.file("syntax.json"), text[:-10])
    _write(w.file("duplicate.json"), text.replace('"max_steps": 3,', '"max_steps": 3, "max_steps": 100000,'))
    _write(w.file("duplicate_nested.json"), text.replace('"window_size": 16', '"window_size": 16, "window_size": 8'))
    _write(w.file("list.json"), "[1, 2]")
    _write(w.file("empty.json"), "")
    _write(w.file("latin1.json"), "")
    w.file("latin1.json").write_bytes(b'{"name": "caf\xe9"}')
    (w.file("a_directory.json")).mkdir()
    _write(w.file("plain_file"), "not a directory")
    _write(w.file("ds_duplicate.json"), '{"zero_optimization": {"stage": 0}, "zero_optimization": {"stage": 1}}')
    _write(w.file("ds_list.json"), "[]")
    _write(w.file("ds_sgd.json"), json.dumps({"optimizer": {"type": "SGD", "params": {"lr": 0.1}}}))
    _write(w.file("ds_micro.json"), json.dumps({"train_micro_batch_size_per_gpu": 8}))
    _write(w.file("not_a_graph.pt"), "not a torch file")
    (w.file("not_zarr")).mkdir()
    # broken datasets
    _broken_dataset(dataset, w.file("no_lat_values.zarr"), lambda g, p: _drop_chunks(p, "latitudes"))
    _broken_dataset(dataset, w.file("no_lat_array.zarr"), lambda g, p: _drop_array(p, "latitudes"))
    _broken_dataset(dataset, w.file("nan_lon.zarr"), lambda g, p: g["longitudes"].__setitem__(3, np.nan))
    _broken_dataset(dataset, w.file("shifted.zarr"),
                    lambda g, p: g["longitudes"].__setitem__(slice(None), (g["longitudes"][:] + 1.0) % 360.0))
    # damaged checkpoints, a run to resume, an existing forecast
    step = sorted(w.ckpt.glob("step_*"))[-1]
    shutil.copytree(w.ckpt, w.file("no_rank/checkpoints"))
    for rank_file in (w.file("no_rank/checkpoints") / step.name).glob("rank_*"):
        rank_file.unlink()
    shutil.copytree(w.ckpt, w.file("bad_meta/checkpoints"))
    meta = w.file("bad_meta/checkpoints") / step.name / "metadata.json"
    meta.write_text(meta.read_text()[:50])
    shutil.copytree(run, w.file("resumable"))
    (w.file("old_forecast") / "forecast.zarr").mkdir(parents=True)
    return w


@dataclass(frozen=True)
class Case:
    id: str
    entry: str  # "train", "convert_checkpoint" or "forecast"
    argv: Callable[[World], list[str]]
    fragments: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)


def train(id: str, args: Callable[[World], list[str]] | list[str], *fragments: str, config: str | None = None,
          **env: str) -> Case:
    """A train.py case: ``--config`` (the base config unless ``config`` names an input file) then ``args``."""
    def argv(w: World) -> list[str]:  # each case its own (absent) output_dir, unless it sets one
        extra = args(w) if callable(args) else list(args)
        own = [] if any(a.startswith("training.output_dir=") for a in extra) else \
            [f"training.output_dir={w.root / 'runs' / id}"]  # a key given twice is an error of its own
        return ["--config", str(w.file(config) if config else w.config), *own, *extra]
    return Case(id, "train", argv, fragments, env)


def convert(id: str, args: Callable[[World], list[str]], *fragments: str) -> Case:
    return Case(id, "convert_checkpoint", args, fragments)


def forecast(id: str, args: Callable[[World], list[str]] | list[str], *fragments: str, **env: str) -> Case:
    """A forecast.py case: the bundle, the dataset, a valid date, 2 steps and an --out, then ``args``
    (which override the earlier options)."""
    def argv(w: World) -> list[str]:
        extra = args(w) if callable(args) else list(args)
        return ["--model", str(w.bundle), "--dataset", str(w.dataset), "--date", "2020-01-12T00", "--steps", "2",
                "--out", str(w.root / "forecast_out"), *extra]
    return Case(id, "forecast", argv, fragments, env)


CASES = [
    # ---------------------------------------------------------------- train.py: the config file(s)
    train("config-missing", [], "config file", "nope.json", "does not exist", config="nope.json"),
    train("config-directory", [], "a_directory.json is a directory, not a JSON file", config="a_directory.json"),
    train("config-syntax", [], "syntax.json is not valid JSON", "line", config="syntax.json"),
    train("config-duplicate-key", [], "training.max_steps is given twice", "3", "100000", config="duplicate.json"),
    train("config-duplicate-nested", [], "model.processor.window_size is given twice", config="duplicate_nested.json"),
    train("config-list", [], "list.json must hold a JSON object", config="list.json"),
    train("config-empty", [], "empty.json is not valid JSON", config="empty.json"),
    train("config-not-utf8", [], "latin1.json is not UTF-8", config="latin1.json"),
    train("ds-missing", lambda w: ["--deepspeed_config", str(w.file("nope_ds.json"))], "DeepSpeed config",
          "nope_ds.json does not exist"),
    train("ds-directory", lambda w: ["--deepspeed_config", str(w.file("a_directory.json"))], "DeepSpeed config",
          "is a directory, not a JSON file"),
    train("ds-duplicate", lambda w: ["--deepspeed_config", str(w.file("ds_duplicate.json"))],
          "zero_optimization is given twice"),
    train("ds-list", lambda w: ["--deepspeed_config", str(w.file("ds_list.json"))], "ds_list.json must hold a JSON "
          "object"),
    train("ds-sgd", lambda w: ["--deepspeed_config", str(w.file("ds_sgd.json"))], "optimizer", "'SGD'", "is not AdamW"),
    train("ds-micro-batch-conflict", lambda w: ["--deepspeed_config", str(w.file("ds_micro.json"))],
          "train_micro_batch_size_per_gpu=8", "training.micro_batch_size=2"),
    # ---------------------------------------------------------------- train.py: command-line overrides
    train("override-no-equals", ["training"], "'training' is not key=value"),
    train("override-empty-part", ["training..lr=1"], "training..lr=1", "empty part"),
    train("override-unknown-section", ["trainng.lr=1"], "unknown key trainng.lr", "did you mean training?"),
    train("override-unknown-training", ["training.max_stepz=5"], "unknown key training.max_stepz",
          "did you mean training.max_steps?", "warmup_steps"),
    train("override-unknown-processor", ["model.processor.window=3"], "unknown key model.processor.window",
          "did you mean model.processor.window_size?"),
    train("override-unknown-graph", ["graph.hiden=o4"], "unknown key graph.hiden", "graph.hidden"),
    train("override-unknown-data", ["data.pth=x.zarr"], "unknown key data.pth", "data.path"),
    train("override-unknown-parallel", ["parallel.gpus_per_modle=1"], "parallel.gpus_per_modle",
          "parallel.gpus_per_model"),
    train("override-unknown-optimizer", ["optimizer.beta=[0.9,0.9]"], "optimizer.beta", "optimizer.betas"),
    train("override-unknown-logging", ["logging.progres=false"], "logging.progres", "logging.progress"),
    train("override-unknown-ddp", ["ddp.bucket_cap=5"], "ddp.bucket_cap", "ddp.bucket_cap_mb"),
    train("override-unknown-compression", ["compression.rnk=2"], "compression.rnk", "compression.rank"),
    train("override-unknown-encoder-edge", ["graph.encoder.factr=0.5"], "graph.encoder.factr", "graph.encoder.factor"),
    train("override-into-a-number", ["training.max_steps.x=1"], "training.max_steps is not an object",
          "training.max_steps.x"),
    train("override-into-a-string", ["data.path.x=1"], "data.path is not an object"),
    train("override-into-a-set-int", ["training.rollout=1", "training.rollout.start=2"],
          "training.rollout is 1 in the config, not an object"),
    train("override-bad-json", ["graph.encoder={\"kind\":"], "graph.encoder", "not valid JSON"),
    train("override-duplicate-in-value", ['deepspeed={"zero_optimization": 1, "zero_optimization": 2}'],
          "deepspeed.zero_optimization is given twice"),
    # ---------------------------------------------------------------- train.py: values (the schema)
    train("max_steps-0", ["training.max_steps=0"], "training.max_steps = 0"),
    train("max_steps-negative", ["training.max_steps=-5"], "training.max_steps = -5"),
    train("max_steps-string", ["training.max_steps=many"], "training.max_steps = \"many\""),
    train("max_steps-and-epochs", ["training.epochs=2"], "give exactly one of max_steps and epochs"),
    train("lr-0", ["training.lr=0"], "training.lr = 0"),
    train("lr-negative", ["training.lr=-1e-3"], "training.lr = -0.001"),
    train("lr_min-above-lr", ["training.lr_min=0.1"], "training.lr_min=0.1 is above training.lr=0.001"),
    train("warmup-longer-than-run", ["training.warmup_steps=50"], "training.warmup_steps=50 exceeds training.max_steps=3"),
    train("micro_batch-0", ["training.micro_batch_size=0"], "training.micro_batch_size = 0"),
    train("micro_batch-float", ["training.micro_batch_size=1.5"], "training.micro_batch_size = 1.5"),
    train("accumulation-0", ["training.gradient_accumulation_steps=0"], "training.gradient_accumulation_steps = 0"),
    train("clipping-negative", ["training.gradient_clipping=-1"], "training.gradient_clipping = -1"),
    train("precision-fp16", ["training.precision=fp16"], "training.precision = \"fp16\""),
    train("compile-yes", ["training.compile=yes"], "training.compile = \"yes\"", "must be true, false or"),
    train("crps_alpha-2", ["training.crps_alpha=2"], "training.crps_alpha = 2"),
    train("rollout-0", ["training.rollout=0"], "training.rollout=0 must be a positive integer"),
    train("validation_rollout-0", ["training.validation_rollout=0"], "training.validation_rollout = 0"),
    train("checkpoint_interval-0", ["training.checkpoint_interval=0"], "training.checkpoint_interval = 0"),
    train("window-0", ["model.processor.window_size=0"], "model.processor.window_size = 0",
          "needs window_size >= 1"),
    train("window-negative", ["model.processor.window_size=-4"], "model.processor.window_size = -4"),
    train("attention-kernel-unknown", ["model.processor.attention_kernel=triton"],
          "model.processor.attention_kernel", "triton"),
    train("attention-kernel-flex-on-cpu", ["model.processor.attention_kernel=flex"],
          "attention_kernel='flex' cannot train here", "no backward on cpu", "'banded'"),
    train("attention-kernel-flash-on-cpu", ["model.processor.attention_kernel=flash"],
          "attention_kernel='flash' cannot train here", "flash-attn needs CUDA"),
    train("num_channels-0", ["model.num_channels=0"], "model.num_channels = 0"),
    train("heads-do-not-divide", ["model.num_channels=18"], "num_channels=18 is not divisible by processor.num_heads=4"),
    train("model-name-unknown", ["model.name=transformr"], "model.name", "transformr"),
    train("model-builder-missing", ["model.name=nosuchpackage.module:build"], "nosuchpackage"),
    train("model-options-builtin", ['model.options={"depth": 3}'], "model.options", "drop model.options"),
    train("model-ensemble-section", ['model.ensemble={"noise_channels": 4}'], "model.ensemble is set",
          "model.name='transformer'"),
    train("multistep-0", ["model.multistep_input=0"], "model.multistep_input = 0"),
    train("num_layers-0", ["model.processor.num_layers=0"], "model.processor.num_layers = 0"),
    train("betas-one", ["optimizer.betas=[0.9]"], "optimizer.betas needs two values (beta1, beta2), got [0.9]"),
    train("betas-three", ["optimizer.betas=[0.9,0.99,0.999]"], "optimizer.betas needs two values",
          "[0.9, 0.99, 0.999]"),
    train("betas-above-one", ["optimizer.betas=[0.9,1.5]"], "optimizer.betas must lie in [0, 1)", "1.5"),
    train("eps-0", ["optimizer.eps=0"], "optimizer.eps = 0"),
    train("optimizer-sgd", ["optimizer.type=sgd"], "optimizer.type = \"sgd\""),
    train("weight_decay-negative", ["optimizer.weight_decay=-0.1"], "optimizer.weight_decay = -0.1"),
    train("engine-unknown", ["engine=horovod"], "engine = \"horovod\""),
    train("gpus_per_model-0", ["parallel.gpus_per_model=0"], "parallel.gpus_per_model = 0"),
    train("shard_strategy-unknown", ["parallel.shard_strategy=pipeline"], "parallel.shard_strategy = \"pipeline\""),
    train("old-spelling-conflict", ["parallel.tensor_model_parallel_size=2"],
          "parallel.tensor_model_parallel_size=2", "parallel.gpus_per_model=1"),
    train("grad-reduction-unknown", ["model_parallel_grad_reduction=sometimes"], "model_parallel_grad_reduction"),
    train("hidden-unknown", ["graph.hidden=xyz"], "hidden='xyz' is neither"),
    train("hidden-ico9", ["graph.hidden=ico9"], "hidden='ico9'", "above 8"),
    train("multimesh-on-o-grid", ['graph.processor={"kind": "multimesh"}'], "multimesh", "hidden='o4'"),
    train("edge-kind-unknown", ['graph.encoder={"kind": "radius"}'], "graph.encoder", "radius"),
    train("data_grid-unknown", ["graph.data_grid=hexagons"], "hexagons"),
    train("area_clip-below-1", ["graph.area_clip_factor=0.5"], "graph.area_clip_factor = 0.5"),
    train("normalisation-unknown", ["data.normalisation=zscore"], "data.normalisation = \"zscore\""),
    train("num_workers-negative", ["data.num_workers=-1"], "data.num_workers = -1"),
    train("prefetch-0", ["data.prefetch=0"], "data.prefetch = 0"),
    train("worker_type-unknown", ["data.worker_type=gpu"], "data.worker_type = \"gpu\""),
    train("validation_samples-0", ["data.validation_samples=0"], "data.validation_samples = 0"),
    train("wandb_mode-unknown", ["logging.wandb_mode=cloud"], "logging.wandb_mode = \"cloud\""),
    train("log_interval-0", ["logging.log_interval=0"], "logging.log_interval = 0"),
    train("ddp-bucket-0", ["ddp.bucket_cap_mb=0"], "ddp.bucket_cap_mb = 0"),
    train("compression-type", ['compression={"type": "topk"}'], "compression.type='topk' is not known"),
    train("zero-3", ['deepspeed.zero_optimization={"stage": 3}'], "deepspeed.zero_optimization.stage=3 is not supported"),
    train("deepspeed-micro-batch-key", ["deepspeed.train_micro_batch_size_per_gpu=2"],
          "deepspeed.train_micro_batch_size_per_gpu", "training.micro_batch_size"),
    train("deepspeed-typo", ["deepspeed.zero_optimisation={}"], "deepspeed.zero_optimisation"),
    train("local-engine-with-deepspeed", ["engine=local"], "engine='local' does not read it"),
    # ---------------------------------------------------------------- train.py: data, layout, directories (preflight)
    train("data-path-missing", lambda w: [f"data.path={w.root / 'absent.zarr'}"], "data.path=", "absent.zarr",
          "does not exist"),
    train("data-path-not-zarr", lambda w: [f"data.path={w.file('not_zarr')}"], "not_zarr is not a zarr group"),
    train("latitudes-without-values", lambda w: [f"data.path={w.file('no_lat_values.zarr')}"],
          "no_lat_values.zarr: the array(s) latitudes (fill value 0.0) hold no stored values"),
    train("latitudes-array-missing", lambda w: [f"data.path={w.file('no_lat_array.zarr')}"],
          "no_lat_array.zarr: missing the array 'latitudes'"),
    train("longitude-nan", lambda w: [f"data.path={w.file('nan_lon.zarr')}"], "nan_lon.zarr: array 'longitudes'",
          "cell 3 = nan"),
    train("validation-after-the-data", ['data.validation={"start": "2021-01-01"}'],
          "data.validation (start 2021-01-01, to the last date) lies after the last date", "2020-01-16T18"),
    train("test-after-the-data", ['data.test={"start": "2021-01-01", "end": "2021-02-01"}'],
          "data.test (start 2021-01-01, end 2021-02-01) lies after the last date"),
    train("train-before-the-data", ['data.train={"end": "2019-05-01"}'], "data.train (from the first date, end "
          "2019-05-01) lies before the first date"),
    train("validation-ends-before-start", ['data.validation={"start": "2020-01-14", "end": "2020-01-13"}'],
          "data.validation (start 2020-01-14, end 2020-01-13) ends", "before it starts"),
    train("date-not-a-date", ['data.validation={"start": "soon"}'], "data.validation", "'soon'"),
    train("train-overlaps-validation", ['data.train={"end": "2020-01-12"}'], "data.train", "data.validation",
          "overlap"),
    train("forcing-unknown", ['data.forcing=["sunshine"]'], "data.forcing", "sunshine"),
    train("diagnostic-unknown", ['data.diagnostic=["rain"]'], "data.diagnostic", "rain"),
    train("imputation-unknown", ['data.imputation={"snow": 0}'], "snow"),
    train("loss-weight-unknown", ['training.loss_scaling={"variables": {"snow": 2}}'], "snow"),
    train("timestep-not-multiple", ["data.timestep=5h"], "data.timestep", "5h"),
    train("train-too-short", ['data.train={"start": "2020-01-10T00", "end": "2020-01-10T12"}'],
          "data.train holds 1 samples, fewer than one global micro-batch"),
    train("knn-larger-than-grid", ['graph.processor={"kind": "knn", "num_neighbours": 500}'],
          "graph.processor.num_neighbours=500 exceeds the 207 source nodes"),
    train("gpus_per_model-above-world", ["parallel.gpus_per_model=2"], "gpus_per_model", "2"),
    train("pipeline-parallel", ["parallel.pipeline_model_parallel_size=2"], "pipeline_model_parallel_size"),
    train("output_dir-under-a-file", lambda w: [f"training.output_dir={w.file('plain_file')}/run"],
          "training.output_dir=", "plain_file is a file, not a directory"),
    train("graph_cache-under-a-file", lambda w: [f"data.graph_cache={w.file('plain_file')}/g/graph.pt"],
          "data.graph_cache=", "is a file, not a directory"),
    train("output_dir-holds-a-run", lambda w: [f"training.output_dir={w.run}"], "already holds a run", "--resume"),
    train("resume-without-checkpoint", lambda w: ["--resume", f"training.output_dir={w.root / 'fresh'}"],
          "--resume was given but", "holds no checkpoint"),
    train("resume-changed-model", lambda w: ["--resume", f"training.output_dir={w.file('resumable')}", "engine=local",
                                             "deepspeed={}", "model.num_channels=32"],
          "--resume: this run differs from the checkpoint", "model.num_channels: stored 16, now 32"),
    train("resume-damaged-metadata", lambda w: ["--resume", f"training.output_dir={w.file('bad_meta')}"],
          "metadata.json"),
    # ---------------------------------------------------------------- train.py: the launcher's environment
    train("world-size-without-rank", [], "WORLD_SIZE=2 is set but RANK is not", WORLD_SIZE="2"),
    train("rank-without-world-size", [], "RANK=1 is set but WORLD_SIZE is not", RANK="1"),
    train("rank-not-integer", [], "RANK='x' is not an integer", RANK="x", WORLD_SIZE="2"),
    train("rank-outside-world", [], "rank 2 is outside the world of 2", RANK="2", WORLD_SIZE="2"),
    train("dist-timeout-bad", [], "STORMSHARD_DIST_TIMEOUT='soon'", STORMSHARD_DIST_TIMEOUT="soon"),
    train("rendezvous-timeout-0", [], "STORMSHARD_RENDEZVOUS_TIMEOUT='0' must be positive",
          STORMSHARD_RENDEZVOUS_TIMEOUT="0"),
    train("heartbeat-bad", [], "STORMSHARD_HEARTBEAT_S='often'", STORMSHARD_HEARTBEAT_S="often"),
    train("slurm-batch-script", [], "SLURM_NTASKS=4", "srun python launch/train.py", SLURM_PROCID="0",
          SLURM_NTASKS="4"),
    # ---------------------------------------------------------------- argparse (every launcher)
    Case("train-no-config", "train", lambda w: [], ("the following arguments are required: --config",)),
    Case("train-unknown-option", "train", lambda w: ["--config", str(w.config), "--max-steps", "5"],
         ("unrecognized arguments", "--max-steps")),
    convert("convert-no-command", lambda w: [], "the following arguments are required"),
    convert("convert-gpus-not-int", lambda w: ["reshard", str(w.ckpt), "--gpus-per-model", "two", "--out", "x"],
            "--gpus-per-model", "'two'"),
    forecast("forecast-steps-not-int", ["--steps", "many"], "--steps", "'many'"),
    forecast("forecast-precision-unknown", ["--precision", "fp8"], "--precision", "'fp8'"),
    forecast("forecast-attention-kernel-unknown", ["--attention-kernel", "triton"], "--attention-kernel", "'triton'"),
    forecast("forecast-attention-kernel-flash-on-cpu", ["--attention-kernel", "flash"], "attention_kernel 'flash'", "flash-attn needs CUDA"),
    forecast("forecast-flex-fp64", ["--attention-kernel", "flex", "--precision", "fp64"], "not fp64"),
    Case("forecast-no-out", "forecast", lambda w: ["--model", str(w.bundle), "--dataset", str(w.dataset), "--date",
                                                   "2020-01-12T00"], ("the following arguments are required: --out",)),
    # ---------------------------------------------------------------- convert_checkpoint.py
    convert("inspect-missing", lambda w: ["inspect", str(w.root / "no_checkpoint")], "no_checkpoint"),
    convert("inspect-a-file", lambda w: ["inspect", str(w.file("plain_file"))], "plain_file"),
    convert("inspect-empty-dir", lambda w: ["inspect", str(w.file("a_directory.json"))], "a_directory.json"),
    convert("consolidate-out-inside-source", lambda w: ["consolidate", str(w.ckpt), "--out", str(w.ckpt / "full")],
            "--out", "is inside the source"),
    convert("consolidate-out-is-source", lambda w: ["consolidate", str(w.ckpt), "--out", str(w.ckpt)],
            "--out", "is the source"),
    convert("consolidate-out-exists", lambda w: ["consolidate", str(w.ckpt), "--out", str(w.file("plain_file"))],
            "plain_file", "--overwrite"),
    convert("consolidate-out-under-a-file", lambda w: ["consolidate", str(w.ckpt), "--out",
                                                       str(w.file("plain_file") / "full")],
            "--out=", "plain_file is a file, not a directory"),
    convert("consolidate-missing-rank-file", lambda w: ["consolidate", str(w.file("no_rank/checkpoints")), "--out",
                                                        str(w.root / "full")], "rank_"),
    convert("consolidate-damaged-metadata", lambda w: ["consolidate", str(w.file("bad_meta/checkpoints")), "--out",
                                                       str(w.root / "full")], "metadata.json"),
    convert("reshard-gpus-0", lambda w: ["reshard", str(w.ckpt), "--gpus-per-model", "0", "--out",
                                         str(w.root / "k0")], "gpus", "0"),
    convert("reshard-gpus-above-nodes", lambda w: ["reshard", str(w.ckpt), "--gpus-per-model", "5000", "--out",
                                                   str(w.root / "k5000")], "5000"),
    convert("reshard-world-not-multiple", lambda w: ["reshard", str(w.ckpt), "--gpus-per-model", "2", "--world-size",
                                                     "3", "--out", str(w.root / "k2")], "3"),
    convert("reshard-dataset-missing", lambda w: ["reshard", str(w.ckpt), "--gpus-per-model", "1", "--dataset",
                                                  str(w.root / "absent.zarr"), "--out", str(w.root / "k1")],
            "absent.zarr"),
    convert("reshard-out-inside-source", lambda w: ["reshard", str(w.ckpt), "--gpus-per-model", "1", "--out",
                                                    str(w.ckpt / "k1")], "is inside the source"),
    convert("export-dataset-missing", lambda w: ["export", str(w.ckpt), "--dataset", str(w.root / "absent.zarr"),
                                                 "--out", str(w.root / "b2")], "absent.zarr"),
    convert("export-graph-not-a-graph", lambda w: ["export", str(w.ckpt), "--graph", str(w.file("not_a_graph.pt")),
                                                   "--out", str(w.root / "b3")], "not_a_graph.pt"),
    convert("export-out-is-source", lambda w: ["export", str(w.ckpt), "--out", str(w.ckpt)], "is the source"),
    # ---------------------------------------------------------------- forecast.py
    forecast("model-missing", lambda w: ["--model", str(w.root / "no_bundle")], "no_bundle"),
    forecast("model-not-a-model", lambda w: ["--model", str(w.file("a_directory.json"))], "a_directory.json"),
    forecast("dataset-missing", lambda w: ["--dataset", str(w.root / "absent.zarr")], "absent.zarr"),
    forecast("dataset-not-zarr", lambda w: ["--dataset", str(w.file("not_zarr"))], "not_zarr is not a zarr group"),
    forecast("dataset-latitudes-without-values", lambda w: ["--dataset", str(w.file("no_lat_values.zarr"))],
             "no_lat_values.zarr: the array(s) latitudes (fill value 0.0) hold no stored values"),
    forecast("dataset-other-grid", lambda w: ["--dataset", str(w.file("shifted.zarr"))],
             "shifted.zarr has other coordinates than the model's grid"),
    forecast("date-not-in-dataset", ["--date", "2021-06-01T00"], "2021-06-01", "is not in the dataset"),
    forecast("forecast-date-not-a-date", ["--date", "yesterday"], "yesterday"),
    forecast("date-too-early", ["--date", "2020-01-01T00"], "2020-01-01T00", "choose a date between"),
    forecast("date-too-late", ["--date", "2020-01-16T18"], "2020-01-16T18", "choose a date between"),
    forecast("date-twice", ["--date", "2020-01-12T00", "2020-01-12T00"], "given more than once"),
    forecast("steps-0", ["--steps", "0"], "steps must be a positive integer, got 0"),
    forecast("gpus-0", ["--gpus-per-model", "0"], "gpus_per_model must be a positive integer, got 0"),
    forecast("gpus-above-world", ["--gpus-per-model", "2"], "gpus_per_model=2 does not divide the 1 launched"),
    forecast("gpus-above-nodes", ["--gpus-per-model", "5000"], "gpus_per_model=5000 is more than"),
    forecast("members-deterministic", ["--members", "3"], "members=3 but the model is deterministic"),
    forecast("members-0", ["--members", "0"], "members must be a positive integer, got 0"),
    forecast("format-unknown", ["--formats", "grib"], "output formats ['grib'] are unknown"),
    forecast("plot-unknown-variable", ["--plot", "rain"], "plot variables ['rain']"),
    forecast("plot-step-outside", ["--plot", "tracer_1", "--plot-steps", "9"], "plot steps [9] are outside 1..2"),
    forecast("cells-per-chunk-0", ["--cells-per-chunk", "0"], "cells_per_chunk must be a positive integer, got 0"),
    forecast("out-exists", lambda w: ["--out", str(w.file("old_forecast"))], "forecast.zarr exists", "--overwrite"),
    forecast("out-under-a-file", lambda w: ["--out", str(w.file("plain_file") / "fc")], "--out=",
             "plain_file is a file, not a directory"),
    forecast("forecast-world-size-without-rank", [], "WORLD_SIZE=2 is set but RANK is not", WORLD_SIZE="2"),
]


def test_the_catalogue_holds_at_least_100_cases():
    assert len(CASES) >= 100 and len({c.id for c in CASES}) == len(CASES)
    assert {c.entry for c in CASES} == {"train", "convert_checkpoint", "forecast"}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_exits_2_with_one_error_line_and_changes_nothing(world, case, capsys, monkeypatch):
    for key, value in case.env.items():
        monkeypatch.setenv(key, value)
    argv = case.argv(world)
    capsys.readouterr()
    before = _snapshot(world.root)
    status = _main(case.entry, argv)
    out, err = capsys.readouterr()
    assert status == 2, f"exit status {status}\n{err}"
    assert "Traceback" not in err + out, err
    errors = [line for line in err.splitlines() if "error: " in line]
    assert len(errors) == 1, err
    for fragment in case.fragments:
        assert fragment in err, f"{fragment!r} not in:\n{err}"
    assert _snapshot(world.root) == before, f"{case.id} changed files under {world.root}"


# ------------------------------------------------------------------------------------------------ in subprocesses


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                              "MASTER_PORT")}
    full.update({"OMP_NUM_THREADS": "1", **(env or {})})
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=full, capture_output=True, text=True, timeout=300)


def test_a_bad_config_fails_before_torch_is_imported(world):
    """The config is validated before torch (and so DeepSpeed) loads: the launcher's error path imports neither."""
    code = ("import runpy, sys\n"
            f"sys.argv = ['train.py', '--config', {str(world.file('duplicate.json'))!r}]\n"
            "try:\n    runpy.run_path('launch/train.py', run_name='__main__')\n"
            "except SystemExit as exc:\n"
            "    print(exc.code, 'torch' in sys.modules, 'deepspeed' in sys.modules)\n")
    done = _run("-c", code)
    assert done.stdout.split() == ["2", "False", "False"], done.stdout + done.stderr
    assert done.stderr.count("error:") == 1 and "training.max_steps is given twice" in done.stderr, done.stderr


@pytest.mark.parametrize("entry, argv, fragment", [
    ("train", ["--config", "{config}", "trainng.lr=1"], "did you mean training?"),
    ("convert_checkpoint", ["inspect", "{root}/no_checkpoint"], "no_checkpoint"),
    ("forecast", ["--model", "{bundle}", "--dataset", "{dataset}", "--date", "2021-06-01T00", "--out", "{root}/fc"],
     "is not in the dataset"),
], ids=["train", "convert", "forecast"])
def test_the_entry_points_exit_2_without_traceback_as_processes(world, entry, argv, fragment):
    argv = [a.format(config=world.config, root=world.root, bundle=world.bundle, dataset=world.dataset) for a in argv]
    before = _snapshot(world.root)
    done = _run(f"launch/{entry}.py", *argv)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and fragment in done.stderr, done.stderr
    assert [line for line in done.stderr.splitlines() if line.startswith("error:")], done.stderr
    assert _snapshot(world.root) == before


# ------------------------------------------------------------------------------------------------ what works


def test_overrides_reach_the_run_and_its_saved_config(world):
    saved = json.loads((world.run / "config.json").read_text())
    assert saved["training"]["max_steps"] == 2 and saved["training"]["seed"] == 7
    assert saved["engine"] == "local" and saved["data"]["validation_samples"] == 1
    assert saved["training"]["output_dir"] == str(world.run)
    from stormshard.training.config import load_experiment_config

    again = load_experiment_config(world.run / "config.json")  # the saved config is a config
    assert again.model_dump(mode="json") == saved


def test_override_values_parse_as_json_or_strings(world):
    from stormshard.training.config import load_experiment_config

    cfg = load_experiment_config(world.config, cli_overrides=[
        "training.max_steps=50", "training.lr=1e-4", "parallel.gpus_per_model=1", "training.output_dir=runs/x y",
        "training.precision=bf16", "compression=null", 'graph.encoder={"kind": "knn", "num_neighbours": 4}', "logging.progress=true",
        "data.test=null", "engine=deepspeed", "deepspeed.zero_optimization.stage=1"])
    assert (cfg.training.max_steps, cfg.training.lr, cfg.training.output_dir) == (50, 1e-4, "runs/x y")
    assert cfg.training.precision == "bf16" and cfg.graph.encoder.num_neighbours == 4 and cfg.compression is None
    ddp = load_experiment_config(world.config, cli_overrides=["engine=ddp", "deepspeed={}", "compression.rank=2"])
    assert ddp.compression.rank == 2
    assert cfg.deepspeed["zero_optimization"] == {"stage": 1} and cfg.data.test is None


def test_resume_lists_every_changed_field(world):
    from stormshard.training.config import load_experiment_config
    from stormshard.training.preflight import check_resume

    run = world.file("resumable")
    cfg = load_experiment_config(run / "config.json", cli_overrides=[
        f"training.output_dir={run}", "training.max_steps=5", "data.validation_samples=2"])
    notes = check_resume(cfg, world=1)
    assert any("training.max_steps: stored 2, now 5" in n for n in notes), notes
    assert any("data.validation_samples: stored 1, now 2" in n for n in notes), notes
    assert any("training.output_dir" in n for n in notes), notes
    bad = load_experiment_config(run / "config.json", cli_overrides=[
        f"training.output_dir={run}", "training.lr=0.01", "optimizer.eps=1e-6", "training.max_steps=5"])
    with pytest.raises(ValueError) as err:
        check_resume(bad, world=1)
    text = str(err.value)
    assert "training.lr: stored 0.001, now 0.01" in text and "optimizer.eps" in text and "max_steps" not in text.split(
        "only ")[0]
    with pytest.raises(ValueError, match="world size: stored 1, now 2"):
        check_resume(cfg, world=2)


def test_a_window_wider_than_the_hidden_grid_is_a_warning(world):
    from stormshard.training.config import load_experiment_config
    from stormshard.training.preflight import window_notes

    wide = load_experiment_config(world.config, cli_overrides=["model.processor.window_size=500"])
    (note,) = window_notes(wide)
    assert "window_size=500" in note and "(208 nodes)" in note and "model.processor.window_size=207" in note
    assert "full attention" in note
    assert window_notes(load_experiment_config(world.config)) == ()


def test_a_forecast_inside_the_training_range_warns_that_scores_are_in_sample(world, capsys):
    out = world.root / "in_sample"
    assert _cli("forecast").main(["--model", str(world.bundle), "--dataset", str(world.dataset), "--date",
                                  "2020-01-05T00", "--steps", "2", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "warning: the forecast from 2020-01-05" in err and "in-sample" in err, err
    out2 = world.root / "out_of_sample"
    assert _cli("forecast").main(["--model", str(world.bundle), "--dataset", str(world.dataset), "--date",
                                  "2020-01-12T00", "--steps", "2", "--out", str(out2)]) == 0
    assert "in-sample" not in capsys.readouterr().err
    shutil.rmtree(out)
    shutil.rmtree(out2)


def test_launch_environment_and_rendezvous_timeout():
    from stormshard.training.launch import LaunchError, detect_launch, rendezvous_timeout

    with pytest.raises(LaunchError, match="WORLD_SIZE=4 is set but RANK is not"):
        detect_launch({"WORLD_SIZE": "4"})
    assert detect_launch({"WORLD_SIZE": "1"}).world_size == 1  # one process: harmless
    assert detect_launch({"RANK": "0"}).world_size == 1
    assert rendezvous_timeout({}).total_seconds() == 60
    assert rendezvous_timeout({"STORMSHARD_RENDEZVOUS_TIMEOUT": "5"}).total_seconds() == 5


def test_a_rank_without_peers_stops_after_the_rendezvous_timeout(world):
    """RANK=1 of 2 with no rank 0: the rendezvous gives up after STORMSHARD_RENDEZVOUS_TIMEOUT, naming the
    address, the rank and the likely cause (not after the 600 s process-group timeout)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = ("import sys, time\n"
            "from stormshard.cli import run_cli\n"
            "from stormshard.training.launch import init_distributed\n"
            "t = time.time()\n"
            "status = run_cli(init_distributed)\n"
            "print('status', status, 'seconds', round(time.time() - t))\n")
    done = _run("-c", code, env={"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                 "STORMSHARD_RENDEZVOUS_TIMEOUT": "2", "TORCH_CPP_LOG_LEVEL": "FATAL"})
    words = done.stdout.split()
    assert words[:2] == ["status", "1"] and int(words[3]) < 30, done.stdout + done.stderr
    err = done.stderr
    assert f"MASTER_ADDR:MASTER_PORT=127.0.0.1:{port}" in err and "rank 1 of 2" in err, err
    assert "the other ranks were not started" in err and "STORMSHARD_RENDEZVOUS_TIMEOUT" in err, err
