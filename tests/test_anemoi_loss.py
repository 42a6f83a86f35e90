"""An imported anemoi model fine-tunes with anemoi-training's loss: ``training.training_loss`` of the checkpoint's
config becomes the bundle's ``finetune_config.json`` ``training.loss`` (anemoi's MSE, MAE, Huber with its delta,
log-cosh and RMSE) and its variable scalers ``training.loss_scaling`` (per-variable weights, pressure-level
scalers), and a loss or scaler stormshard does not have is left out with a warning and a note in the metadata.
The first fine-tuning losses are held to anemoi-training's own (``fixtures/anemoi/make_loss_fixtures.py``)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from stormshard.checkpoint.anemoi_import import import_anemoi
from stormshard.checkpoint.anemoi_loss import anemoi_training_loss, anemoi_variable_weights
from stormshard.training.config import load_experiment_config
from tests.anemoi_repickle import rewrite_metadata
from tests.test_anemoi_end_to_end import _first_loss, dataset  # noqa: F401 (a fixture)

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
        assert {k: meta[k] for k in ("anemoi", "loss", "huber_delta", "note") if k in meta} == \
            {"anemoi": target, **expect, "note": None}
        assert meta["loss_scaling"] is None and meta["scaler_notes"] == []  # the fixture's weights are all 1
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


KINDS = json.loads((FIXTURES / "gt" / "first_loss_kinds.json").read_text())


def _apply(changes: dict):
    """Set the dotted keys of ``changes`` in the stored config, as the hydra overrides of the anemoi run did."""
    def edit(meta: dict) -> None:
        for key, value in changes.items():
            *path, last = key.split(".")
            node = meta["config"]
            for part in path:
                node = node.setdefault(part, {})
            node[last] = value
    return edit


@pytest.mark.parametrize("case", sorted(KINDS["cases"]))
def test_first_finetune_loss_equals_anemoi_trainings_under_other_losses(case, dataset, tmp_path):  # noqa: F811
    """anemoi-training's first loss of gt's weights under MAE / Huber (delta 0.3) / log-cosh with variable weights
    and a ReLU or linear pressure-level scaler on the tracers, and plain RMSE, equals stormshard's first
    fine-tuning loss of the imported bundle times the mean variable weight (anemoi averages the weighted
    variables, stormshard divides by the weights' sum: a constant per model)."""
    ref = KINDS["cases"][case]
    src = rewrite_metadata(FIXTURES / "gt" / "last.ckpt", tmp_path / "last.ckpt", _apply(ref["changes"]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every scaler the cases use maps
        bundle = import_anemoi(src, tmp_path / "bundle")
    training = json.loads((bundle / "finetune_config.json").read_text())["training"]
    weights = (training.get("loss_scaling") or {}).get("variables")
    if case in ("huber_weighted", "logcosh_star"):  # a level scaler on the tracers' group: every weight differs
        assert len(set(weights.values())) == 4, weights
    elif case == "mae_weighted":  # the {param: [...]} group reads the metadata: no level weight (as anemoi)
        assert weights == {"tracer_1": 3.0, "tracer_2": 3.0, "tracer_3": 3.0, "tracer_product": 0.5}
    loss = _first_loss(bundle, dataset, tmp_path / "run")
    mean_weight = sum(weights.values()) / len(weights) if weights else 1.0
    assert loss * mean_weight == pytest.approx(ref["loss"], rel=2e-6, abs=0), (loss, mean_weight, ref["loss"])


def test_variable_weights_follow_anemoi_groups_and_metadata():
    """Parameter, level and group from the dataset's variables_metadata where anemoi trusts it (a level and a
    non-surface levtype), else from the name; groups by list or by a metadata attribute, in their order; a
    tendency scaler is left out with a note; a group by an attribute a variable without metadata cannot answer
    leaves the level scaler out (anemoi stops training there)."""
    meta = {
        "config": {"training": {
            "training_loss": {"_target_": "anemoi.training.losses.MSELoss",
                              "scalers": ["general_variable", "pressure_level", "stdev_tendency"]},
            "variable_groups": {"default": "sfc", "ml": {"is_model_level": True}, "pl": ["t", "q"]},
            "scalers": {
                "general_variable": {"_target_": "x.GeneralVariableLossScaler", "weights": {"default": 2.0, "t": 6.0}},
                "pressure_level": {"_target_": "x.ReluVariableLevelScaler", "group": "pl", "slope": 0.001,
                                   "y_intercept": 0.2},
                "stdev_tendency": {"_target_": "x.StdevTendencyScaler"}}}},
        "dataset": {"variables_metadata": {
            "temp850": {"mars": {"param": "t", "levelist": 850, "levtype": "pl"}},  # named unlike t_850
            "q_50": {"mars": {"param": "Q", "levtype": "pl"}},  # untrusted (pressure level, no level): the name
            "t_ml_3": {"mars": {"param": "t", "levelist": 3, "levtype": "ml"}},  # group ml: no level scaling
            "t_500": {"mars": {"param": "t", "levelist": 500, "levtype": "pl"}},
            "2t": {"mars": {"param": "2t", "levtype": "sfc"}}}},
    }
    found = anemoi_variable_weights(meta, ["temp850", "q_50", "t_500", "2t", "t_ml_3"])
    assert found.weights == pytest.approx({"temp850": 6.0 * 0.85, "q_50": 2.0 * 0.2, "t_500": 6.0 * 0.5, "2t": 2.0,
                                           "t_ml_3": 6.0})
    assert found.applied == ("general_variable", "pressure_level")
    assert len(found.notes) == 1 and "stdev_tendency (StdevTendencyScaler) has no stormshard equivalent" in found.notes[0]
    del meta["dataset"]["variables_metadata"]["2t"]
    found = anemoi_variable_weights(meta, ["temp850", "2t"])
    assert found.weights == {"temp850": 6.0, "2t": 2.0} and found.applied == ("general_variable",)
    assert "pressure_level (ReluVariableLevelScaler) could not be read" in found.notes[0]
    assert "variable_groups.ml selects by ['is_model_level'] and 2t has no variables_metadata" in found.notes[0]


def test_variable_weights_of_older_anemoi_training_configs():
    """Before ``training.scalers``: anemoi-training 0.1-0.3's ``variable_loss_scaling`` ``{default, pl, sfc}`` with its
    ``pressure_level_scaler`` (a level variable is ``<first part>_..._<digits>``; pl weights only the parameters it
    names), and 0.4-0.5's flat table with ``additional_scalars`` chosen by the loss's ``scalars`` list."""
    old = {"config": {"training": {
        "training_loss": {"_target_": "anemoi.training.losses.mse.WeightedMSELoss"},
        "variable_loss_scaling": {"default": 1, "pl": {"q": 0.6, "t": 6, "z": 12}, "sfc": {"sp": 10, "tp": 0.025}},
        "pressure_level_scaler": {"_target_": "anemoi.training.data.scaling.ReluPressureLevelScaler",
                                  "minimum": 0.2, "slope": 0.001}}}}
    found = anemoi_variable_weights(old, ["q_50", "t_850", "z_500", "w_500", "sp", "tp", "2t", "tracer_x_3"])
    assert found.weights == pytest.approx({"q_50": 0.6 * 0.2, "t_850": 6 * 0.85, "z_500": 12 * 0.5, "w_500": 1.0,
                                           "sp": 10.0, "tp": 0.025, "2t": 1.0, "tracer_x_3": 1.0})
    old["config"]["training"]["pressure_level_scaler"] = {"_target_": "x.LinearPressureLevelScaler", "minimum": 0.1,
                                                          "slope": 0.002}
    assert anemoi_variable_weights(old, ["t_850"]).weights == pytest.approx({"t_850": 6 * (1.7 + 0.1)})
    middle = {"config": {"training": {
        "training_loss": {"_target_": "x.WeightedMSELoss", "scalars": ["variable", "variable_pressure_level"]},
        "variable_groups": {"default": "sfc", "pl": ["q", "t"]},
        "variable_loss_scaling": {"default": 1, "q": 0.6, "t": 6, "sp": 10},
        "additional_scalars": [
            {"_target_": "x.ReluVariableLevelScaler", "name": "variable_pressure_level", "group": "pl",
             "y_intercept": 0.2, "slope": 0.001},
            {"_target_": "x.StdevTendencyScaler", "name": "tendency"}]}}}  # not in the loss's list: not applied
    found = anemoi_variable_weights(middle, ["q_50", "t_850", "sp", "2t"])
    assert found.weights == pytest.approx({"q_50": 0.12, "t_850": 5.1, "sp": 10.0, "2t": 1.0}) and not found.notes
    middle["config"]["training"]["training_loss"]["scalars"].append("tendency")
    assert "tendency (StdevTendencyScaler) has no stormshard equivalent" in \
        anemoi_variable_weights(middle, ["q_50"]).notes[0]
