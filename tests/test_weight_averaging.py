"""``training.weight_averaging`` (EMA / SWA): the arithmetic, the same average at every layout and engine,
validation with the average, checkpoints and resume, and bad configs."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from stormshard.checkpoint.consolidate import consolidate_checkpoint
from stormshard.training.config import ConfigError, load_experiment_config
from stormshard.training.launch import run_training
from stormshard.training.weight_averaging import WeightAverage, resume_average, should_update
from stormshard.training.weight_averaging_config import WeightAveragingSettings
from tests.distributed import run_distributed
from tests.tiny_run import tiny_config

ROOT = Path(__file__).resolve().parent.parent
EMA = {"kind": "ema", "decay": 0.6}


# ------------------------------------------------------------------------------ the arithmetic


def _direct(kind: str, decay: float, start: int, every: int, weights: list[dict[str, torch.Tensor]],
            taken: list[bool]) -> tuple[dict[str, torch.Tensor], int]:
    """The average by its definition, in float64: ``weights[s]`` are the parameters after step ``s``."""
    avg, n = {k: v.double() for k, v in _initial.items()}, 0  # before any update: the starting weights
    for s, (w, ok) in enumerate(zip(weights, taken, strict=True)):
        if not ok or s < start or s % every:
            continue
        if n == 0:
            avg = {k: v.double() for k, v in w.items()}
        elif kind == "ema":
            avg = {k: decay * avg[k] + (1 - decay) * w[k].double() for k in avg}
        else:
            avg = {k: (avg[k] * n + w[k].double()) / (n + 1) for k in avg}
        n += 1
    return avg, n


_initial: dict[str, torch.Tensor] = {}


@pytest.mark.parametrize("kind", ["ema", "swa"])
@pytest.mark.parametrize("start,every", [(0, 1), (2, 2), (1, 3)])
def test_average_equals_its_float64_definition(kind, start, every):
    """Seven steps, step 4 skipped by the engine: the fp32 average equals the float64 definition (first update a
    copy, then the EMA / running mean) within fp32 rounding, and counts only the updates the schedule asks for."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3, bias=False))
    _initial.clear()
    _initial.update({n: p.detach().clone() for n, p in model.named_parameters()})
    settings = WeightAveragingSettings(kind=kind, **({"decay": 0.7} if kind == "ema" else {}),
                                       start_step=start, every_n_steps=every)
    average = WeightAverage(settings, model)
    weights, taken = [], []
    for s in range(7):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        weights.append({n: p.detach().clone() for n, p in model.named_parameters()})
        taken.append(s != 4)
        assert average.update(s, taken[-1]) == (taken[-1] and should_update(settings, s))
    want, updates = _direct(kind, 0.7, start, every, weights, taken)
    assert average.updates == updates > 0
    for name, got in zip(average.names, average.tensors, strict=True):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want[name], rtol=1e-6, atol=1e-6)
    # the last one's weights differ from the average: the test sees the averaging
    assert not torch.allclose(average.tensors[0], weights[-1][average.names[0]])


def test_swap_in_restores_the_trained_weights_bit_for_bit():
    torch.manual_seed(1)
    model = nn.Linear(4, 4).to(torch.bfloat16)
    average = WeightAverage(WeightAveragingSettings(kind="ema", decay=0.5), model)
    with torch.no_grad():
        model.weight.add_(0.3)
    average.update(0)
    with torch.no_grad():
        model.weight.add_(0.7)
    trained = {n: p.detach().clone() for n, p in model.named_parameters()}
    with average.swapped_in():
        assert torch.equal(model.weight, average.tensors[0].to(torch.bfloat16))
    assert all(torch.equal(p, trained[n]) for n, p in model.named_parameters())


def test_resume_decisions():
    """On -> on continues (another kind restarts from the resumed weights), off -> on starts at the resumed weights,
    on -> off drops the stored average; each says so."""
    model = nn.Linear(3, 2)
    ema = WeightAverage(WeightAveragingSettings(kind="ema", decay=0.5), model)
    with torch.no_grad():
        model.weight.add_(1.0)
    ema.update(0)
    ema.update(1)
    stored = ema.state_dict()
    same = WeightAverage(WeightAveragingSettings(kind="ema", decay=0.5), model)
    assert resume_average(same, stored) == () and same.updates == 2
    swa = WeightAverage(WeightAveragingSettings(kind="swa"), model)
    note = resume_average(swa, stored)
    assert swa.updates == 0 and "restarts" in note[0] and torch.equal(swa.tensors[0], model.weight)
    fresh = WeightAverage(WeightAveragingSettings(kind="ema", decay=0.9), model)
    assert "starts from the resumed weights" in resume_average(fresh, None)[0]
    assert "dropped" in resume_average(None, stored)[0]


# ------------------------------------------------------------------------------ bad configs

BAD = [
    ({"kind": "ema", "decay": 1.0}, "training.weight_averaging.decay", "between 0 and 1"),
    ({"kind": "ema", "decay": 0}, "training.weight_averaging.decay", "between 0 and 1"),
    ({"kind": "swa", "start_step": -1}, "training.weight_averaging.start_step", "0 or more"),
    ({"kind": "ema", "every_n_steps": 0}, "training.weight_averaging.every_n_steps", "1 or more"),
    ({"kind": "polyak"}, "training.weight_averaging.kind", "\"ema\""),
    ({"kind": "ema", "decai": 0.9}, "training.weight_averaging.decai", "unknown key"),
    ({"kind": "swa", "decay": 0.9}, "training.weight_averaging.decay", "remove decay"),
]


@pytest.mark.parametrize("value,field,fix", BAD)
def test_bad_settings_are_one_clear_error(dataset, tmp_path, value, field, fix):
    cfg = tiny_config(dataset, tmp_path / "run", **{"training.weight_averaging": value})
    with pytest.raises(ConfigError) as err:
        load_experiment_config(cfg)
    assert field in str(err.value) and fix in str(err.value), str(err.value)


def test_bad_settings_stop_the_launcher_before_any_file(dataset, tmp_path):
    cfg = tiny_config(dataset, tmp_path / "run", **{"training.weight_averaging": {"kind": "ema"}})
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    proc = subprocess.run([sys.executable, str(ROOT / "launch" / "train.py"), "--config", str(path),
                           "training.weight_averaging.decay=1.5"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    lines = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "training.weight_averaging.decay" in lines[0] and "1.5" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------ layouts and engines


def _trained(rank, world, cfg):  # noqa: ANN001
    result = run_training(cfg)
    return result.losses, result.checkpoint


def _averaged_weights(checkpoint: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    ckpt = consolidate_checkpoint(checkpoint)
    return ckpt.average, ckpt.model


@pytest.mark.parametrize("engine,stage", [("local", None), ("deepspeed", 0), ("deepspeed", 1), ("deepspeed", 2)])
def test_average_is_the_same_at_every_layout(dataset, tmp_path, engine, stage):
    """Three EMA steps on one process and on model groups of 2, 3 (uneven slices) and 4 ranks (world 4 at DeepSpeed
    ZeRO 1/2: model groups of 2 x 2 data-parallel replicas at micro batch 1): the consolidated average equals the
    one-process average within fp32 rounding, and differs from the trained weights. AdamW's eps is 1e-3: gradients
    that are zero up to rounding (the key biases: softmax ignores them) would otherwise take full-size steps whose
    sign is the rounding noise of each layout, in the trained weights as in their average."""
    base = {"engine": engine, "training.weight_averaging": EMA, "optimizer.eps": 1e-3,
            "deepspeed": {} if stage is None else {"zero_optimization": {"stage": stage}}}
    single = _trained(0, 1, tiny_config(dataset, tmp_path / "single", **base))
    reference, trained = _averaged_weights(single[1])
    assert reference.keys() == trained.keys()
    assert max((reference[n] - trained[n]).abs().max().item() for n in reference) > 1e-4
    layouts = [(2, 2, 2), (3, 3, 2)] + ([(4, 4, 2)] if not stage else [(4, 2, 1)])
    for world, gpm, micro in layouts:
        cfg = tiny_config(dataset, tmp_path / f"w{world}g{gpm}", **base, **{
            "parallel.gpus_per_model": gpm, "training.micro_batch_size": micro})
        out = run_distributed(_trained, world, cfg)
        assert out[0][0] == pytest.approx(single[0], rel=2e-5)
        average, _ = _averaged_weights(out[0][1])
        assert average.keys() == reference.keys()
        for name in reference:
            torch.testing.assert_close(average[name], reference[name], rtol=1e-5, atol=5e-7,
                                       msg=lambda m, n=name, w=world, g=gpm: f"world {w} gpm {g} {n}: {m}")


# ------------------------------------------------------------------------------ validation


def test_validation_uses_the_average(dataset, tmp_path):
    """Validation runs on the averaged weights: its RMSE differs from the trained weights' and equals a direct
    evaluation with the averaged weights loaded; the trained weights come back bit for bit; the log says so."""
    from stormshard.training.loop import Trainer

    cfg = tiny_config(dataset, tmp_path / "run", **{"engine": "local", "deepspeed": {}, "training.weight_averaging": EMA})
    trainer = Trainer(load_experiment_config(cfg))
    result = trainer.fit()
    trained = {n: p.detach().clone() for n, p in trainer.engine.module.named_parameters()}
    averaged = trainer.validate()
    assert all(torch.equal(p, trained[n]) for n, p in trainer.engine.module.named_parameters())
    assert averaged["averaged"] == {"kind": "ema", "updates": 3}
    assert averaged["rmse"] == result.validation["rmse"]
    with_trained = trainer.validate_weights()
    assert all(abs(with_trained["rmse"][k] - v) > 1e-6 * abs(v) for k, v in averaged["rmse"].items())
    average, _ = _averaged_weights(result.checkpoint)
    with torch.no_grad():
        for n, p in trainer.engine.module.named_parameters():
            p.copy_(average[n])
    assert trainer.validate_weights()["rmse"] == averaged["rmse"]
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("val_averaged_weights_updates") == 3 for r in records)


# ------------------------------------------------------------------------------ checkpoints and resume


def _resume(rank, world, cfg, resume):  # noqa: ANN001
    result = run_training(cfg, resume=resume)
    return result.losses, result.checkpoint


def test_resume_is_bit_identical(dataset, tmp_path):
    """A run interrupted after step 2 (its step-2 checkpoint only) and resumed ends with the uninterrupted loss
    curve and average, bit for bit (model group of 2, DeepSpeed ZeRO 1, SWA from step 1)."""
    changes = {"parallel.gpus_per_model": 2, "training.max_steps": 5, "training.checkpoint_interval": 2,
               "training.keep_checkpoints": 5, "deepspeed.zero_optimization": {"stage": 1},
               "training.weight_averaging": {"kind": "swa", "start_step": 1}}
    full = run_distributed(_resume, 2, tiny_config(dataset, tmp_path / "full", **changes), False)[0]
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(tmp_path / "full" / "checkpoints" / "step_00000002", resumed_dir / "checkpoints" / "step_00000002")
    resumed = run_distributed(_resume, 2, tiny_config(dataset, resumed_dir, **changes), True)[0]
    assert resumed[0] == full[0][2:]
    a, b = consolidate_checkpoint(full[1]), consolidate_checkpoint(resumed[1])
    assert a.average_info == b.average_info and a.average_info["updates"] == 4
    assert all(torch.equal(a.average[n], b.average[n]) for n in a.average)
    # averaging turned off at resume: allowed, the curve is the same and the checkpoints hold no average
    off_dir = tmp_path / "off"
    shutil.copytree(tmp_path / "full" / "checkpoints" / "step_00000002", off_dir / "checkpoints" / "step_00000002")
    off = run_distributed(_resume, 2, tiny_config(dataset, off_dir, **{**changes, "training.weight_averaging": None}),
                          True)[0]
    assert off[0] == full[0][2:] and consolidate_checkpoint(off[1]).average is None


def test_resume_of_a_bf16_zero2_run_is_bit_identical(dataset, tmp_path):
    """bf16 at ZeRO 2 on one process (the average reads DeepSpeed's fp32 master partition, which a resume
    refills in place): the resumed run ends with the uninterrupted losses and average, bit for bit."""
    changes = {"training.max_steps": 4, "training.checkpoint_interval": 2, "training.keep_checkpoints": 5,
               "training.precision": "bf16", "deepspeed.zero_optimization": {"stage": 2},
               "training.weight_averaging": {"kind": "ema", "decay": 0.5}}
    full = _resume(0, 1, tiny_config(dataset, tmp_path / "full", **changes), False)
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(tmp_path / "full" / "checkpoints" / "step_00000002", resumed_dir / "checkpoints" / "step_00000002")
    resumed = _resume(0, 1, tiny_config(dataset, resumed_dir, **changes), True)
    assert resumed[0] == full[0][2:]
    a, b = consolidate_checkpoint(full[1]), consolidate_checkpoint(resumed[1])
    assert a.average_info == b.average_info and a.average_info["updates"] == 4
    assert all(torch.equal(a.average[n], b.average[n]) for n in a.average)
    assert any(not torch.equal(a.average[n], a.model[n]) for n in a.average)


# ------------------------------------------------------------------------------ using the average


@pytest.fixture(scope="module")
def runs(dataset, tmp_path_factory):
    """Two tiny runs of 3 steps: one with an EMA, one without; their last checkpoints."""
    root = tmp_path_factory.mktemp("wa_runs")
    with_average = run_training(tiny_config(dataset, root / "ema", **{"training.weight_averaging": EMA})).checkpoint
    without = run_training(tiny_config(dataset, root / "plain")).checkpoint
    return with_average, without


def _launcher(name: str):  # noqa: ANN202
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"{name}_cli", ROOT / "launch" / f"{name}.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    return cli


def test_export_reshard_consolidate_take_the_average_by_default(runs, tmp_path):
    from safetensors.torch import load_file

    from stormshard.checkpoint.consolidate import load_consolidated
    from stormshard.checkpoint.export import export_bundle
    from stormshard.checkpoint.reshard import reshard_checkpoint
    from stormshard.training.finetune import read_init_weights

    source, _ = runs
    ckpt = consolidate_checkpoint(source)
    assert ckpt.average is not None and ckpt.average_info["updates"] == 3
    names = list(ckpt.average)
    assert any(not torch.equal(ckpt.average[n], ckpt.model[n]) for n in names)

    def same(a, b):  # noqa: ANN001, ANN202
        return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)

    # export: the average by default, the trained weights on request; metadata.json says which
    export_bundle(source, tmp_path / "avg")
    export_bundle(source, tmp_path / "trained", weights="trained")
    assert same(load_file(str(tmp_path / "avg" / "model.safetensors")), ckpt.average)
    assert same(load_file(str(tmp_path / "trained" / "model.safetensors")), ckpt.model)
    meta = json.loads((tmp_path / "avg" / "metadata.json").read_text())
    assert meta["weights"] == "averaged" and meta["weight_average"]["updates"] == 3
    # init_weights fine-tuning starts from the average
    assert same(read_init_weights(source), ckpt.average)
    # consolidate keeps both (a training checkpoint: resume needs the trained weights); --weights trained drops it
    cli = _launcher("convert_checkpoint")
    assert cli.main(["consolidate", source, "--out", str(tmp_path / "full")]) == 0
    full = load_consolidated(tmp_path / "full")
    assert same(full.average, ckpt.average) and same(full.model, ckpt.model) and full.average_info == ckpt.average_info
    assert cli.main(["consolidate", source, "--out", str(tmp_path / "plain_full"), "--weights", "trained"]) == 0
    assert load_consolidated(tmp_path / "plain_full").average is None
    export_bundle(tmp_path / "full", tmp_path / "from_full")  # the consolidated one exports its average too
    assert same(load_file(str(tmp_path / "from_full" / "model.safetensors")), ckpt.average)
    # reshard to a model group of 2 carries the average, sliced as the parameters are
    step = reshard_checkpoint(source, tmp_path / "k2" / "checkpoints", gpus_per_model=2)
    resharded = consolidate_checkpoint(step)
    assert same(resharded.average, ckpt.average) and same(resharded.model, ckpt.model)


def test_inspect_shows_the_weight_average(runs, tmp_path):
    """``inspect`` says which checkpoint holds an average, of which kind, and a bundle which weights it holds."""
    from stormshard.checkpoint.export import export_bundle
    from stormshard.checkpoint.inspect import format_inspection, inspect_checkpoint

    source, plain = runs
    assert inspect_checkpoint(plain)["weight_average"] is None
    assert "weight average" not in format_inspection(inspect_checkpoint(plain), parameters=False)
    text = format_inspection(inspect_checkpoint(source), parameters=False)
    assert "weight average: EMA (decay 0.6, from step 0, every 1 step(s)), in the rank files" in text, text
    cli = _launcher("convert_checkpoint")
    assert cli.main(["consolidate", source, "--out", str(tmp_path / "full")]) == 0
    full = inspect_checkpoint(tmp_path / "full")["weight_average"]
    assert (full["updates"], full["where"]) == (3, "average.safetensors"), full
    export_bundle(source, tmp_path / "avg")
    export_bundle(source, tmp_path / "trained", weights="trained")
    assert "EMA (decay 0.6" in format_inspection(inspect_checkpoint(tmp_path / "avg"), parameters=False)
    assert "weights: as trained" in format_inspection(inspect_checkpoint(tmp_path / "trained"), parameters=False)


def test_forecast_takes_the_average_by_default(runs, tmp_path):
    from stormshard.inference.loader import load_forecaster

    source, plain = runs
    ckpt = consolidate_checkpoint(source)
    for weights, want in ((None, ckpt.average), ("averaged", ckpt.average), ("trained", ckpt.model)):
        model = load_forecaster(source, weights=weights)
        got = dict(model.model.named_parameters())
        assert all(torch.equal(got[n], want[n]) for n in want), weights
        assert model.metadata["weights"] == (weights or "averaged")
    assert load_forecaster(plain).metadata["weights"] == "trained"


def test_averaged_weights_without_an_average_is_one_clear_error(runs, dataset, tmp_path):
    _, plain = runs
    cli = _launcher("convert_checkpoint")
    for command in ("export", "consolidate"):
        out = tmp_path / command
        assert cli.main([command, plain, "--out", str(out), "--weights", "averaged"]) == 2
        assert not out.exists()
    forecast = _launcher("forecast")
    out = tmp_path / "forecast"
    assert forecast.main(["--model", plain, "--dataset", dataset, "--date", "2020-01-12T00", "--steps", "1",
                          "--out", str(out), "--weights", "averaged", "--no-scores"]) == 2
    assert not out.exists()


def test_bf16_zero1_averages_the_fp32_master(dataset, tmp_path):
    """DeepSpeed bf16 at ZeRO 1 keeps the fp32 master apart from the bf16 parameters. One update (at the last step:
    a copy) gives exactly the consolidated weights (DeepSpeed's fp32 master) on one data-parallel rank; with two,
    each holding half the master, the average reads the bf16 parameters: the master rounded to bf16."""
    changes = {"training.precision": "bf16", "deepspeed.zero_optimization": {"stage": 1},
               "training.weight_averaging": {"kind": "ema", "start_step": 2}}
    one = _trained(0, 1, tiny_config(dataset, tmp_path / "dp1", **changes))[1]
    average, master = _averaged_weights(one)
    assert all(torch.equal(average[n], master[n]) for n in master)
    assert any(not torch.equal(master[n], master[n].bfloat16().float()) for n in master)  # not bf16 values
    two = run_distributed(_trained, 2, tiny_config(dataset, tmp_path / "dp2", **changes,
                                                   **{"training.micro_batch_size": 1}))[0][1]
    average, master = _averaged_weights(two)
    assert all(torch.equal(average[n], master[n].bfloat16().float()) for n in master)


# ------------------------------------------------------------------------------ anemoi


@pytest.mark.parametrize("section, expect", [
    ({"_target_": "pytorch_lightning.callbacks.EMAWeightAveraging", "decay": 0.99},  # anemoi's ema.yaml, decay 0.99
     {"kind": "ema", "decay": 0.99, "start_step": 0, "every_n_steps": 1}),
    ({"_target_": "anemoi.training.diagnostics.callbacks.weight_averaging.SWAWeightAveraging",
      "update_starting_at_step": 1000, "update_every_n_steps": 10},
     {"kind": "swa", "start_step": 1000, "every_n_steps": 10}),
    ({"_target_": "pytorch_lightning.callbacks.StochasticWeightAveraging", "swa_lrs": 1e-4},  # swa.yaml: a note
     {"kind": "swa", "start_step": 0, "every_n_steps": 1}),
])
def test_import_anemoi_maps_weight_averaging_into_the_finetune_config(dataset, tmp_path, section, expect):
    from stormshard.checkpoint.anemoi_import import import_anemoi
    from stormshard.checkpoint.anemoi_weight_averaging import (
        anemoi_weight_averaging,
        stormshard_weight_averaging,
    )
    from tests.anemoi_repickle import rewrite_metadata

    def edit(meta: dict) -> None:
        meta["config"]["training"]["weight_averaging"] = section

    src = rewrite_metadata(ROOT / "tests" / "fixtures" / "anemoi" / "gt" / "inference.ckpt", tmp_path / "in.ckpt", edit)
    with pytest.warns(UserWarning, match="swa_lrs") if "swa_lrs" in section else _no_warning():
        import_anemoi(src, tmp_path / "bundle")
    finetune = json.loads((tmp_path / "bundle" / "finetune_config.json").read_text())
    assert finetune["training"]["weight_averaging"] == expect
    config = load_experiment_config({**finetune, "data": {**finetune["data"], "path": dataset}})
    assert config.training.weight_averaging.model_dump() == {"decay": None, **expect}
    # export-anemoi writes stormshard's averaging back as anemoi's own callback, which imports as the same
    back = anemoi_weight_averaging(expect)
    assert back["_target_"].startswith("anemoi.training.diagnostics.callbacks.weight_averaging.")
    assert stormshard_weight_averaging({"training": {"weight_averaging": back}}) == (expect, None)


def _no_warning():  # noqa: ANN202
    import contextlib
    import warnings

    stack = contextlib.ExitStack()
    stack.enter_context(warnings.catch_warnings())
    warnings.simplefilter("error", UserWarning)
    return stack


def test_export_anemoi_plan_holds_the_weight_averaging():
    from stormshard.checkpoint.anemoi_weight_averaging import anemoi_weight_averaging

    assert anemoi_weight_averaging(None) is None
    assert anemoi_weight_averaging({"kind": "ema", "decay": 0.9, "start_step": 3, "every_n_steps": 2}) == {
        "_target_": "anemoi.training.diagnostics.callbacks.weight_averaging.EMAWeightAveraging", "decay": 0.9,
        "update_every_n_steps": 2, "update_starting_at_step": 3}
