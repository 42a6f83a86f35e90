"""anemoi's output boundings both ways, without anemoi: a training config's bounding list (Lightning files,
older layouts) read as stormshard's ``relu_bounded`` / ``model.bounding`` with the normalized kinds' thresholds
from the state dict, the export's physical thresholds, and the template export refusing a bundle whose boundings
are not the pickled ones. Through anemoi itself: ``tests/test_anemoi_export.py`` case ``bounded`` (a
stormshard model with every kind exported, anemoi's ``predict_step`` equal, imported back from anemoi's pickled
modules to the same list and predictions)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from launch.convert_checkpoint import main as convert_main
from stormshard.checkpoint.anemoi_bounding import (
    anemoi_bounding_config,
    config_bounding,
    stormshard_boundings,
)
from stormshard.checkpoint.anemoi_import import import_anemoi
from stormshard.checkpoint.errors import ConversionError
from stormshard.models.config import BoundingConfig

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "anemoi"
P = "anemoi.models.layers.bounding."

AIFS_LIST = [  # an AIFS-style training config's model.bounding
    {"_target_": P + "ReluBounding", "variables": ["tp", "ro"]},
    {"_target_": P + "HardtanhBounding", "variables": ["tcc", "lcc"], "min_val": 0, "max_val": 1},
    {"_target_": P + "FractionBounding", "variables": ["cp", "sf"], "min_val": 0, "max_val": 1, "total_var": "tp"},
    {"_target_": P + "NormalizedReluBounding", "variables": ["sd", "q"], "min_val": [0.0, 0.0],
     "normalizer": ["mean-std", "std"]},
]


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


def test_export_writes_physical_thresholds_anemoi_normalises_back():
    variables = ["sd", "q", "t"]
    mean, std = np.array([0.3, 2.0, 280.0]), np.array([0.5, 4.0, 10.0])
    mul, add = 1 / std, -mean / std
    methods = {"sd": "mean-std", "q": "std", "t": "none"}
    spec = BoundingConfig(kind="normalized_relu", variables=("sd", "q"), thresholds=(-0.6, 0.25))
    out = anemoi_bounding_config(("t",), (spec,), variables, mul, add, methods)
    assert out[0] == {"_target_": P + "ReluBounding", "variables": ["t"]}
    assert out[1]["normalizer"] == ["mean-std", "std"]
    # anemoi's NormalizedReluBounding: mean-std (min - mean) / std; std min / std (with stormshard's std
    # normaliser, x * mul: the mean is not removed)
    sd_min, q_min = out[1]["min_val"]
    assert abs((sd_min - mean[0]) / std[0] - (-0.6)) < 1e-12
    with pytest.raises(ConversionError, match=r"'t': the variable is normalised with 'none'"):
        anemoi_bounding_config((), (spec.model_copy(update={"variables": ("t", "q")}),), variables, mul, add, methods)


def test_export_into_the_anemoi_checkpoint_keeps_its_boundings(tmp_path, capsys):
    """A bundle imported from anemoi (ReluBounding of tracer_2) whose boundings changed is refused by the export
    into that file (its pickled boundings are copied unchanged): exit 2, one error line, nothing written."""
    bundle = import_anemoi(FIXTURES / "gt" / "inference.ckpt", tmp_path / "bundle")
    meta = json.loads((bundle / "metadata.json").read_text())
    meta["model"]["bounding"] = [{"kind": "hardtanh", "variables": ["tracer_3"], "min_val": -1.0, "max_val": 1.0}]
    (bundle / "metadata.json").write_text(json.dumps(meta))
    out = tmp_path / "out.ckpt"
    assert convert_main(["export-anemoi", str(bundle), "--out", str(out)]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: {bundle} (written into ") and \
        "are not those of the anemoi checkpoint it descends from (['ReluBounding'])" in errors[0], errors
    assert not out.exists()
