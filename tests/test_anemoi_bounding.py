"""anemoi's output boundings both ways (:mod:`stormshard.checkpoint.anemoi_bounding`).

The fixture ``fixtures/anemoi/gt_bounded`` (anemoi-training 0.17.1 / anemoi-models 0.19.0, ``make_fixtures.py``;
``configs/fixture_gt_bounded.yaml``): gt with anemoi's list ReluBounding(tracer_2), HardtanhBounding(tracer_3,
-0.5..0.8), FractionBounding(tracer_product of tracer_2), LeakyHardtanhBounding(tracer_1, -1..1) and
NormalizedReluBounding(tracer_3, tracer_1; normalizers std, mean-std). Its import predicting anemoi's
``predict_step``, its fan-out at gpus_per_model 2, its export round trip and its Lightning ``last.ckpt`` are in
``test_anemoi_import.py`` (variant ``gt_bounded``); here: what the boundings read, that they bind, the forms
derived from the fixture (thresholds computed from statistics, variables anemoi skips, a user-named dataset),
the refused lists, the export's physical thresholds, and the export by building through anemoi. A stormshard
model with the kinds exported through anemoi: ``tests/test_anemoi_export.py`` case ``bounded``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import stormshard
from launch.convert_checkpoint import main as convert_main
from stormshard.checkpoint.anemoi_bounding import (
    AnemoiBounding,
    anemoi_bounding_config,
    anemoi_norm_min_val,
    config_bounding,
    stormshard_boundings,
)
from stormshard.checkpoint.anemoi_import import import_anemoi, read_anemoi
from stormshard.checkpoint.anemoi_pickle import open_anemoi_checkpoint
from stormshard.checkpoint.errors import ConversionError
from stormshard.models.config import BoundingConfig
from tests.anemoi_repickle import module_children, rewrite_metadata, save_stub_tree
from tests.test_anemoi_export import _anemoi, needs_anemoi

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "anemoi"
VARIANT = FIXTURES / "gt_bounded"
INFERENCE, LAST = VARIANT / "inference.ckpt", VARIANT / "last.ckpt"
P = "anemoi.models.layers.bounding."
STATE_KEY = "model.model.boundings.data.4.norm_min_val"  # the NormalizedReluBounding's buffer in last.ckpt

AIFS_LIST = [  # an AIFS-style training config's model.bounding
    {"_target_": P + "ReluBounding", "variables": ["tp", "ro"]},
    {"_target_": P + "HardtanhBounding", "variables": ["tcc", "lcc"], "min_val": 0, "max_val": 1},
    {"_target_": P + "FractionBounding", "variables": ["cp", "sf"], "min_val": 0, "max_val": 1, "total_var": "tp"},
    {"_target_": P + "NormalizedReluBounding", "variables": ["sd", "q"], "min_val": [0.0, 0.0],
     "normalizer": ["mean-std", "std"]},
]


def _errors(capsys) -> list[str]:  # noqa: ANN001
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]


def _predict_error(model) -> np.ndarray:  # noqa: ANN001
    """Per output variable: max |predict - anemoi's predict_step| / the variable's spread (fixture inputs)."""
    x = torch.from_numpy(np.load(VARIANT / "input.npy"))
    expected = np.load(VARIANT / "output.npy")
    spread = expected.reshape(-1, expected.shape[-1]).std(axis=0)
    return np.abs(model.predict(x).numpy() - expected).reshape(-1, expected.shape[-1]).max(axis=0) / spread


def _pickled_boundings(path: Path = INFERENCE) -> list:
    model = module_children(open_anemoi_checkpoint(path).root)["model"]
    return list(module_children(module_children(module_children(model)["boundings"])["data"]).values())


def _bounding_config(meta: dict) -> list[dict]:
    return meta["config"]["model"]["bounding"]["datasets"]["data"]


def test_a_config_list_reads_in_order_with_thresholds_from_the_state_dict():
    boundings = [config_bounding(b) for b in AIFS_LIST]
    tensors = {"model.boundings.data.3.norm_min_val": torch.tensor([-1.5, 0.0])}
    relu, bounding = stormshard_boundings(boundings, tensors, "ckpt")
    assert relu == ()
    assert bounding == (
        BoundingConfig(kind="relu", variables=("tp", "ro")),
        BoundingConfig(kind="hardtanh", variables=("tcc", "lcc"), min_val=0.0, max_val=1.0),
        BoundingConfig(kind="fraction", variables=("cp", "sf"), min_val=0.0, max_val=1.0, total_variable="tp"),
        BoundingConfig(kind="normalized_relu", variables=("sd", "q"), thresholds=(-1.5, 0.0)),
    )
    # ReluBoundings only: relu_bounded, as every import before the other kinds
    assert stormshard_boundings(boundings[:1], {}, "ckpt") == (("tp", "ro"), ())
    with pytest.raises(ConversionError, match=r"ckpt: output bounding 3 \(NormalizedReluBounding of \['sd', 'q'\]\) "
                                              r"has no norm_min_val tensor"):
        stormshard_boundings(boundings, {}, "ckpt")


def test_the_fixtures_boundings_read_and_bind(tmp_path):
    """The pickled list reads as model.bounding, in anemoi's order, with the NormalizedReluBounding's thresholds
    its norm_min_val buffer paired in config order (tracer_3 then tracer_1), which anemoi's formula gives from the
    pickled statistics bit for bit; every bounding binds on the fixture inputs; without the list the same weights
    are far from anemoi's prediction."""
    bundle = import_anemoi(INFERENCE, tmp_path / "bundle")
    model = stormshard.load_model(bundle)
    cfg = model.config
    buffer = _pickled_boundings()[4].__dict__["_buffers"]["norm_min_val"]
    assert cfg.relu_bounded == () and cfg.bounding == (
        BoundingConfig(kind="relu", variables=("tracer_2",)),
        BoundingConfig(kind="hardtanh", variables=("tracer_3",), min_val=-0.5, max_val=0.8),
        BoundingConfig(kind="fraction", variables=("tracer_product",), min_val=0.0, max_val=1.0,
                       total_variable="tracer_2"),
        BoundingConfig(kind="leaky_hardtanh", variables=("tracer_1",), min_val=-1.0, max_val=1.0),
        BoundingConfig(kind="normalized_relu", variables=("tracer_3", "tracer_1"), thresholds=tuple(buffer.tolist())),
    )
    stats = open_anemoi_checkpoint(INFERENCE).root.__dict__["statistics"]["data"]
    names = json.loads((VARIANT / "reference.json").read_text())["variables"]
    spec = config_bounding(_bounding_config(open_anemoi_checkpoint(INFERENCE).metadata)[4])
    assert anemoi_norm_min_val(spec, stats, {n: i for i, n in enumerate(names)}, "x") == tuple(buffer.tolist())
    assert abs(buffer[0] - 4.0 / stats["stdev"][2]) < 1e-7 and abs(buffer[1] - (279.0 - stats["mean"][0]) /
                                                                    stats["stdev"][0]) < 1e-7
    x = torch.from_numpy(np.load(VARIANT / "input.npy"))
    with torch.no_grad():
        y = model.model(model.normaliser.normalise(x.double()).float())  # the normalised prediction
    out = list(model.variables.output_names)
    t1, t2, t3, tp = (y[..., out.index(n)] for n in ("tracer_1", "tracer_2", "tracer_3", "tracer_product"))
    thr3, thr1 = buffer.tolist()
    assert (t2 >= 0).all() and (t2 == 0).sum() > 50
    at = (t3 - 0.8).abs() < 1e-6  # hardtanh's bound, through the normalized ReLU after it (to a float32 rounding)
    assert (t3 <= 0.8 + 1e-6).all() and (t3 >= thr3).all() and at.sum() > 50 and (t3 == thr3).sum() > 50
    assert (t1 >= thr1).all() and (t1 == thr1).sum() > 50 and (t1 > 1).sum() > 0  # leaky above 1: slope 0.01
    assert (tp >= 0).all() and (tp <= t2 + 1e-6).all() and (tp == t2).sum() > 10 and ((tp == 0) & (t2 > 0)).sum() > 10
    assert (_predict_error(model) <= 1e-4).all()
    meta = json.loads((bundle / "metadata.json").read_text())
    meta["model"]["bounding"] = []
    (bundle / "metadata.json").write_text(json.dumps(meta))
    assert _predict_error(stormshard.load_model(bundle)).max() > 1e-2


def test_thresholds_computed_from_statistics_when_the_state_dict_lacks_them(tmp_path):
    """A Lightning file without the norm_min_val tensor (anemoi-models before 0.9.6 kept it as a plain attribute):
    the thresholds are computed from the config's min_val / normalizer and the file's statistics as anemoi computes
    them, equal to the buffer bit for bit; without the statistics too, a clear error."""
    root = open_anemoi_checkpoint(LAST).root
    del root["state_dict"][STATE_KEY]
    src = save_stub_tree(root, tmp_path / "no-buffer.ckpt", LAST)
    assert read_anemoi(src).config == read_anemoi(INFERENCE).config
    del root["hyper_parameters"]["statistics"]
    src = save_stub_tree(root, tmp_path / "no-statistics.ckpt", LAST)
    with pytest.raises(ConversionError, match=r"output bounding 4 \(NormalizedReluBounding of \['tracer_3', "
                                              r"'tracer_1'\]\) has no norm_min_val tensor .* no statistics"):
        read_anemoi(src)


def test_the_first_normalizer_form_is_computed_as_anemoi_computed_it():
    """anemoi-models' first NormalizedReluBounding (one ``normalizer`` string, mean-std only): ``min_val - mean``
    stored in float32, then times ``1 / stdev``; the list form divides in float64 and stores once."""
    stats = {"mean": np.array([280.123456789, 0.3]), "stdev": np.array([9.87654321, 0.7])}
    old = AnemoiBounding("NormalizedReluBounding", ("a",), physical_min=(273.15,), normalizer="mean-std")
    new = AnemoiBounding("NormalizedReluBounding", ("a",), physical_min=(273.15,), normalizer=("mean-std",))
    reference = torch.zeros(1)
    reference[0] = 273.15 - stats["mean"][0]
    reference[0] *= 1.0 / stats["stdev"][0]
    assert anemoi_norm_min_val(old, stats, {"a": 0}, "x") == (float(reference[0]),)
    assert anemoi_norm_min_val(new, stats, {"a": 0}, "x") == (float(np.float32((273.15 - 280.123456789) / 9.87654321)),)
    with pytest.raises(ConversionError, match=r"needs the statistics \['min', 'max'\]"):
        anemoi_norm_min_val(AnemoiBounding("NormalizedReluBounding", ("a",), physical_min=(0.0,),
                                           normalizer=("min-max",)), stats, {"a": 0}, "x")


def test_variables_anemoi_skips_are_skipped(tmp_path):
    """Config variables that are not model outputs (a forcing, a variable not in the dataset): anemoi-models 0.9.6
    to 0.18 skip them (``_create_index``; the normalized kinds with their min_val / normalizer entries, 0.17+), so
    does the import; a bounding left with none is a no-op and dropped."""
    def extra(meta: dict) -> None:
        listed = _bounding_config(meta)
        listed[1]["variables"] = ["insolation", "tracer_3", "sst"]
        listed[4].update(variables=["sst", "tracer_3", "tracer_1"], min_val=[271.0, 4.0, 279.0],
                         normalizer=["max", "std", "mean-std"])
        listed.insert(2, {"_target_": P + "LeakyReluBounding", "variables": ["insolation"]})

    def renumber(root: dict) -> None:  # the inserted (empty) bounding shifts the normalized one to index 5
        root["state_dict"]["model.model.boundings.data.5.norm_min_val"] = root["state_dict"].pop(STATE_KEY)

    root = open_anemoi_checkpoint(LAST).root
    renumber(root)
    src = save_stub_tree(root, tmp_path / "skipped.ckpt", LAST, edit_metadata=extra)
    assert read_anemoi(src).config == read_anemoi(LAST).config
    del root["state_dict"]["model.model.boundings.data.5.norm_min_val"]  # computed from the kept entries too
    src = save_stub_tree(root, tmp_path / "skipped-computed.ckpt", LAST, edit_metadata=extra)
    assert read_anemoi(src).config == read_anemoi(LAST).config


@pytest.mark.parametrize("total, why", [("insolation", "is not an output variable"),
                                        ("tracer_product", "is one of its own variables")])
def test_a_fraction_of_what_stormshard_cannot_reproduce_is_refused(total, why, tmp_path, capsys):
    """A fraction whose total is not an output (anemoi's forward fails on it) or is one of its own variables
    (anemoi multiplies by the clamped total): exit 2, one error line naming the bounding, nothing written."""
    def edit(meta: dict) -> None:
        _bounding_config(meta)[2]["total_var"] = total

    src = rewrite_metadata(LAST, tmp_path / "fraction.ckpt", edit)
    assert convert_main(["import-anemoi", str(src), "--out", str(tmp_path / "b")]) == 2
    errors = _errors(capsys)
    assert len(errors) == 1 and f"output bounding 2 (FractionBounding of ['tracer_product']): its total_var " \
        f"'{total}' {why}" in errors[0], errors
    assert not (tmp_path / "b").exists()


def test_boundings_of_a_user_named_dataset_read(tmp_path):
    """The pickled boundings' ModuleDict keyed by another dataset name (user-defined in anemoi) reads the same."""
    root = open_anemoi_checkpoint(INFERENCE).root
    per_dataset = module_children(module_children(module_children(root)["model"])["boundings"])
    per_dataset["era5"] = per_dataset.pop("data")
    src = save_stub_tree(root, tmp_path / "era5.ckpt", INFERENCE)
    assert read_anemoi(src).config == read_anemoi(INFERENCE).config


def test_export_writes_physical_thresholds_anemoi_normalises_back():
    variables = ["sd", "q", "t", "cp"]
    stats = {"mean": np.array([0.3, 2.0, 280.0, 0.1]), "stdev": np.array([0.5, 4.0, 10.0, 0.2])}
    methods = {"sd": "mean-std", "q": "std", "t": "min-max", "cp": "mean-std"}
    spec = BoundingConfig(kind="normalized_relu", variables=("sd", "q"), thresholds=(-0.6, 0.25))
    out = anemoi_bounding_config(("t",), (spec,), variables, stats, methods)
    assert out[0] == {"_target_": P + "ReluBounding", "variables": ["t"]}
    assert out[1]["normalizer"] == ["mean-std", "std"]
    # anemoi's NormalizedReluBounding: mean-std (min - mean) / stdev; std min / stdev (stormshard's std: x / stdev)
    assert out[1]["min_val"] == pytest.approx([0.3 - 0.6 * 0.5, 0.25 * 4.0], rel=1e-15)
    spec_t = spec.model_copy(update={"variables": ("t", "q")})
    with pytest.raises(ConversionError, match=r"bundle: model.bounding normalized_relu of 't': the variable is "
                                              r"normalised with 'min-max'"):
        anemoi_bounding_config((), (spec_t,), variables, stats, methods, "bundle")
    # the config refuses it (test_bounding.py); export refuses it too, for a config built without validation
    own = BoundingConfig.model_construct(kind="fraction", variables=("cp", "t"), min_val=0.0, max_val=1.0,
                                         total_variable="t", thresholds=None)
    with pytest.raises(ConversionError, match=r"its total_variable 't' is one of its own variables"):
        anemoi_bounding_config((), (own,), variables, stats, methods)
    flat = {"mean": stats["mean"], "stdev": np.array([0.0, 4.0, 10.0, 0.2])}  # a constant variable
    with pytest.raises(ConversionError, match=r"of 'sd': anemoi rebuilds the threshold -0.6 as"):
        anemoi_bounding_config((), (spec,), variables, flat, methods)


def test_export_refuses_a_threshold_anemoi_cannot_rebuild(tmp_path, capsys):
    """A normalized bounding of a variable normalised with min-max (anemoi's NormalizedReluBounding would read
    ``statistics["min"]``, which a dataset's statistics lack): exit 2, one error line naming the bundle, the
    bounding and the variable, before anemoi is needed or anything is written."""
    bundle = import_anemoi(LAST, tmp_path / "bundle")
    meta = json.loads((bundle / "metadata.json").read_text())
    meta["normalisation"]["methods"] = {"tracer_1": "min-max"}
    (bundle / "metadata.json").write_text(json.dumps(meta))
    out = tmp_path / "out.ckpt"
    assert convert_main(["export-anemoi", str(bundle), "--out", str(out)]) == 2
    errors = _errors(capsys)
    assert errors == [f"error: {bundle}: model.bounding normalized_relu of 'tracer_1': the variable is normalised "
                      "with 'min-max'; anemoi's NormalizedReluBounding rebuilds its threshold only for mean-std / std "
                      "(its min-max and max read statistics keys a dataset does not have)"], errors
    assert not out.exists()


def test_export_into_the_anemoi_checkpoint_keeps_its_boundings(tmp_path, capsys):
    """A bundle imported from anemoi (ReluBounding of tracer_2) whose boundings changed is refused by the export
    into that file (its pickled boundings are copied unchanged): exit 2, one error line, nothing written."""
    bundle = import_anemoi(FIXTURES / "gt" / "inference.ckpt", tmp_path / "bundle")
    meta = json.loads((bundle / "metadata.json").read_text())
    meta["model"]["bounding"] = [{"kind": "hardtanh", "variables": ["tracer_3"], "min_val": -1.0, "max_val": 1.0}]
    (bundle / "metadata.json").write_text(json.dumps(meta))
    out = tmp_path / "out.ckpt"
    assert convert_main(["export-anemoi", str(bundle), "--out", str(out)]) == 2
    errors = _errors(capsys)
    assert len(errors) == 1 and errors[0].startswith(f"error: {bundle} (written into ") and \
        "are not those of the anemoi checkpoint it descends from (['ReluBounding'])" in errors[0], errors
    assert not out.exists()


def test_export_into_the_bounded_checkpoint_refuses_a_changed_threshold(tmp_path, capsys):
    """The gt_bounded bundle exports into its own file as it is; with one threshold changed, refused."""
    bundle = import_anemoi(INFERENCE, tmp_path / "bundle")
    assert convert_main(["export-anemoi", str(bundle), "--out", str(tmp_path / "same.ckpt")]) == 0
    meta = json.loads((bundle / "metadata.json").read_text())
    meta["model"]["bounding"][4]["thresholds"][1] = 0.0
    (bundle / "metadata.json").write_text(json.dumps(meta))
    out = tmp_path / "out.ckpt"
    assert convert_main(["export-anemoi", str(bundle), "--out", str(out)]) == 2
    errors = _errors(capsys)
    assert len(errors) == 1 and "are not those of the anemoi checkpoint it descends from" in errors[0], errors
    assert not out.exists()


@needs_anemoi
def test_the_bounded_import_exports_by_building_and_predicts_as_the_original(tmp_path):
    """gt_bounded's last.ckpt import (no pickled model to write into) exported by building anemoi's model: the
    bounding list written in physical units (tracer_3's threshold with the bundle's mean-std, not the fixture's
    std), anemoi rebuilds the original norm_min_val bit for bit, and its predict_step equals the original's."""
    bundle = import_anemoi(LAST, tmp_path / "from_last")
    out = tmp_path / "back.ckpt"
    run = _anemoi("launch/convert_checkpoint.py", "export-anemoi", str(bundle), "--out", str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    exported = open_anemoi_checkpoint(out)
    listed = _bounding_config(exported.metadata)
    assert [b["_target_"].rsplit(".", 1)[1] for b in listed] == [
        "ReluBounding", "HardtanhBounding", "FractionBounding", "LeakyHardtanhBounding", "NormalizedReluBounding"]
    stats = json.loads((bundle / "statistics.json").read_text())
    assert listed[4]["normalizer"] == ["mean-std", "mean-std"]
    assert listed[4]["min_val"][0] == pytest.approx(stats["tracer_3"]["mean"] + 4.0, abs=1e-3)
    assert listed[4]["min_val"][1] == pytest.approx(279.0, abs=1e-3)
    theirs = _pickled_boundings(out)[4].__dict__["_buffers"]["norm_min_val"]
    assert torch.equal(theirs, _pickled_boundings()[4].__dict__["_buffers"]["norm_min_val"])
    assert read_anemoi(out).config == read_anemoi(INFERENCE).config
    run = _anemoi(str(FIXTURES / "anemoi_predict.py"), str(out), str(VARIANT / "input.npy"), str(tmp_path / "y.npy"),
                  str(tmp_path / "meta.json"))
    assert run.returncode == 0, run.stderr[-3000:]
    expected = np.load(VARIANT / "output.npy")  # anemoi's own predict_step of the original model
    spread = expected.reshape(-1, expected.shape[-1]).std(axis=0)
    assert (np.abs(np.load(tmp_path / "y.npy") - expected).reshape(-1, expected.shape[-1]).max(axis=0)
            / spread <= 1e-4).all()
