"""An imported anemoi model fine-tunes with anemoi-training's loss: ``training.training_loss`` of the checkpoint's
config becomes the bundle's ``finetune_config.json`` ``training.loss`` (anemoi's MSE, MAE, Huber with its delta,
log-cosh and RMSE), and a loss stormshard does not have keeps MSE with a warning and a note in the metadata."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from stormshard.checkpoint.anemoi_import import import_anemoi
from stormshard.checkpoint.anemoi_loss import anemoi_training_loss
from stormshard.training.config import load_experiment_config
from tests.anemoi_repickle import rewrite_metadata

FIXTURES = Path(__file__).parent / "fixtures" / "anemoi"


def _with_loss(loss: dict | None):
    def edit(meta: dict) -> None:
        section = meta["config"]["training"]["training_loss"]["datasets"]
        if loss is None:
            del meta["config"]["training"]["training_loss"]
        else:
            section["data"] = {**section["data"], **loss}
    return edit


@pytest.mark.parametrize("target, extra, expect", [
    ("anemoi.training.losses.MSELoss", {}, {"loss": "mse"}),
    ("anemoi.training.losses.MAELoss", {}, {"loss": "mae"}),
    ("anemoi.training.losses.HuberLoss", {"delta": 0.25}, {"loss": "huber", "huber_delta": 0.25}),
    ("anemoi.training.losses.HuberLoss", {}, {"loss": "huber", "huber_delta": 1.0}),
    ("anemoi.training.losses.LogCoshLoss", {}, {"loss": "logcosh"}),
    ("anemoi.training.losses.RMSELoss", {}, {"loss": "rmse"}),
    ("anemoi.training.losses.WeightedMAELoss", {}, {"loss": "mae"}),  # anemoi-training before 0.4
])
def test_known_losses_reach_the_finetune_config(tmp_path, target, extra, expect):
    for name in ("inference.ckpt", "last.ckpt"):
        src = rewrite_metadata(FIXTURES / "gt" / name, tmp_path / name, _with_loss({"_target_": target, **extra}))
        out = tmp_path / f"bundle-{name}"
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no note for a loss stormshard has
            import_anemoi(src, out)
        finetune = json.loads((out / "finetune_config.json").read_text())
        assert {k: finetune["training"][k] for k in ("loss", "huber_delta") if k in finetune["training"]} == expect
        meta = json.loads((out / "metadata.json").read_text())["anemoi"]["training_loss"]
        assert meta == {"anemoi": target, **expect, "note": None}
        config = load_experiment_config({**finetune, "data": {**finetune["data"], "path": str(tmp_path)}})
        assert config.training.loss == expect["loss"]


@pytest.mark.parametrize("loss, fragment", [
    ({"_target_": "anemoi.training.losses.combined.CombinedLoss"}, "anemoi trained with CombinedLoss"),
    ({"_target_": "anemoi.training.losses.HuberLoss", "delta": -1}, "HuberLoss has delta=-1"),
    (None, "names no training loss"),
])
def test_other_losses_keep_mse_and_say_so(tmp_path, loss, fragment):
    src = rewrite_metadata(FIXTURES / "gt" / "inference.ckpt", tmp_path / "other.ckpt", _with_loss(loss))
    with pytest.warns(UserWarning, match=fragment):
        import_anemoi(src, tmp_path / "bundle")
    finetune = json.loads((tmp_path / "bundle" / "finetune_config.json").read_text())
    assert finetune["training"]["loss"] == "mse" and "huber_delta" not in finetune["training"]
    note = json.loads((tmp_path / "bundle" / "metadata.json").read_text())["anemoi"]["training_loss"]["note"]
    assert fragment in note and ("finetune_config.json trains mse" in note or "fine-tuning trains mse" in note)


def test_older_configs_without_datasets_level():
    meta = {"config": {"training": {"training_loss": {"_target_": "anemoi.training.losses.mae.WeightedMAELoss"}}}}
    assert anemoi_training_loss(meta).kind == "mae"
