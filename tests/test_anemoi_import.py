"""``convert_checkpoint.py import-anemoi``: anemoi inference checkpoints -> stormshard bundles that
predict what anemoi's ``predict_step`` predicts (fixtures and reference outputs written by anemoi
itself: ``tests/fixtures/anemoi/make_fixtures.py``). No anemoi needed."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

import stormshard
from launch.convert_checkpoint import main as convert_main
from stormshard.checkpoint.anemoi_import import import_anemoi
from stormshard.checkpoint.anemoi_pickle import module_tensors, open_anemoi_checkpoint
from stormshard.checkpoint.errors import ConversionError
from tests.anemoi_runner import ANEMOI_PYTHON, run_in_anemoi_env

FIXTURES = Path(__file__).parent / "fixtures" / "anemoi"
#: fixture variant -> stormshard model name (gt_truncated: gt with anemoi's TruncatedConnection residual;
#: gt_bounded: gt with a list of anemoi's bounding kinds, tests/test_anemoi_bounding.py; gnn: anemoi-training's
#: packaged GNN model, GNNForwardMapper / GNNProcessor / GNNBackwardMapper)
KINDS = {"gt": "graphtransformer", "transformer": "transformer", "gt_truncated": "graphtransformer",
         "gt_bounded": "graphtransformer", "gnn": "gnn"}


def _parameters(module, prefix=""):
    """The parameter names of a stubbed module tree (``nn.Module.named_parameters`` without dedup)."""
    state = module.__dict__
    names = [prefix + n for n in (state.get("_parameters") or {})]
    for name, child in (state.get("_modules") or {}).items():
        if child is not None:
            names += _parameters(child, f"{prefix}{name}.")
    return names


@pytest.mark.parametrize("variant", list(KINDS))
def test_import_predicts_what_anemoi_predicts(variant, tmp_path, capsys):
    out = tmp_path / "bundle"
    assert convert_main(["import-anemoi", str(FIXTURES / variant / "inference.ckpt"), "--out", str(out)]) == 0
    assert "imported" in capsys.readouterr().out
    model = stormshard.load_model(out)
    ref = json.loads((FIXTURES / variant / "reference.json").read_text())
    assert list(model.variables.input_names) == ref["input_variables"]
    assert list(model.variables.output_names) == ref["output_variables"]
    assert model.timestep == "6h" and model.multistep_input == ref["multistep_input"]
    cfg = model.config
    assert cfg.name == KINDS[variant]
    assert cfg.residual == ("truncated" if variant == "gt_truncated" else "last_step")
    assert cfg.latent_skip and cfg.decoder_embedding == (variant != "gnn")  # anemoi's GNN decoder embeds nothing
    if variant == "gnn":  # anemoi's GNN model: every option of it on, mlp_extra_layers 0 (2 hidden layers)
        assert (cfg.node_embedding, cfg.head, cfg.encoder.update_src_nodes) == ("mlp", "mlp", True)
        for section in (cfg.processor, cfg.encoder, cfg.decoder):
            assert section.edge_embedding and section.aggregate_updated_edges and section.edge_mlp_ratio == 1.0
            assert section.mlp_hidden_layers == 2 and section.mlp_ratio == 1 and section.trainable_edge_size == 2
    if variant == "gt_bounded":  # anemoi's list, in order: ReluBounding of tracer_2 first
        assert cfg.relu_bounded == () and cfg.bounding[0].kind == "relu" and cfg.bounding[0].variables == ("tracer_2",)
        assert [b.kind for b in cfg.bounding] == ["relu", "hardtanh", "fraction", "leaky_hardtanh", "normalized_relu"]
    else:
        assert cfg.relu_bounded == ("tracer_2",) and cfg.bounding == ()
    assert cfg.encoder.trainable_edge_size == 2 and cfg.decoder.trainable_edge_size == 2
    # every anemoi parameter arrives: same count (anemoi's mapper layer_norm_attention is its
    # layer_norm_attention_dest under a second name, listed twice; stormshard's zero q/k/v bias aside)
    ours = sum(p.numel() for p in model.model.parameters())
    c, layers = cfg.num_channels, cfg.processor.num_layers
    unused = 2 * 2 * c if variant != "gnn" else 0  # encoder + decoder layer_norm_attention: the alias, counted twice
    extra = 3 * c * layers if variant == "transformer" else 0
    ckpt = open_anemoi_checkpoint(FIXTURES / variant / "inference.ckpt")
    buffers = set(module_tensors(ckpt.root)) - set(_parameters(ckpt.root))
    theirs = sum(t.numel() for n, t in module_tensors(ckpt.root).items() if n not in buffers)
    assert ours == theirs - unused + extra
    x = torch.from_numpy(np.load(FIXTURES / variant / "input.npy"))
    expected = np.load(FIXTURES / variant / "output.npy")
    got = model.predict(x).numpy()
    assert got.shape == expected.shape
    spread = expected.reshape(-1, expected.shape[-1]).std(axis=0)
    err = np.abs(got - expected).reshape(-1, expected.shape[-1]).max(axis=0)
    assert (err <= 1e-4 * spread).all(), err / spread
    with torch.no_grad():  # ReLU bounding: the bounded column is >= 0 in normalised units
        normalised = model.model(model.normaliser.normalise(x.double()).float())
    assert (normalised[..., ref["output_variables"].index("tracer_2")] >= 0).all()


def test_import_errors(tmp_path, capsys):
    text = tmp_path / "notes.ckpt"
    text.write_text("not a checkpoint")
    assert convert_main(["import-anemoi", str(text), "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if line.startswith("error:")] == [
        f"error: {text} is not an anemoi checkpoint: not a torch zip file"]
    assert not (tmp_path / "b").exists()
    lightning = tmp_path / "last.ckpt"  # a Lightning checkpoint without the graph anemoi-training saves in it
    torch.save({"state_dict": {"model.w": torch.ones(1)}, "hyper_parameters": {"metadata": {"version": "2.0"}}},
               lightning)
    with pytest.raises(ConversionError, match="has no graph"):
        import_anemoi(lightning, tmp_path / "c")
    assert not (tmp_path / "c").exists()
    plain = tmp_path / "weights.pt"  # a torch zip, but no anemoi model and no anemoi metadata
    torch.save({"weight": torch.ones(2)}, plain)
    assert convert_main(["import-anemoi", str(plain), "--out", str(tmp_path / "d")]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "is not an anemoi checkpoint" in errors[0], errors
    assert not (tmp_path / "d").exists()


def test_gnn_import_refuses_what_stormshard_gnn_does_not_compute(tmp_path, capsys):
    """anemoi's GNN with gated MLPs, another activation or other decoder inputs than the encoder's data latents:
    exit 2, one error naming each, nothing written (read from the checkpoint's config, inference or Lightning)."""
    from tests.anemoi_repickle import rewrite_metadata

    def edit(meta: dict) -> None:
        model = meta["config"]["model"]
        model["processor"]["mlp_implementation"] = "swiglu"
        model["encoders"]["0"]["mapper"]["layer_kernels"]["Activation"] = {"_target_": "torch.nn.SiLU"}
        model["decoders"]["0"]["target_node_features"] = ["encoded_data", "coordinates"]

    for name in ("inference.ckpt", "last.ckpt"):
        src = rewrite_metadata(FIXTURES / "gnn" / name, tmp_path / name, edit)
        assert convert_main(["import-anemoi", str(src), "--out", str(tmp_path / "b")]) == 2
        err = capsys.readouterr().err
        assert len([line for line in err.splitlines() if line.startswith("error:")]) == 1, err
        for fragment in ("processor mlp_implementation='swiglu' (gated MLPs", "encoder layer_kernels.Activation="
                         "torch.nn.SiLU (stormshard's GNN computes torch.nn.GELU)",
                         "decoder target_node_features=['encoded_data', 'coordinates']"):
            assert fragment in err, err
        assert not (tmp_path / "b").exists()


def _predict_error(model, variant: str) -> np.ndarray:
    """Per output variable: max |stormshard predict - anemoi predict_step| / the variable's spread."""
    x = torch.from_numpy(np.load(FIXTURES / variant / "input.npy"))
    expected = np.load(FIXTURES / variant / "output.npy")
    got = model.predict(x).numpy()
    assert got.shape == expected.shape
    spread = expected.reshape(-1, expected.shape[-1]).std(axis=0)
    return np.abs(got - expected).reshape(-1, expected.shape[-1]).max(axis=0) / spread


@pytest.mark.parametrize("variant", ["gt", "transformer", "gt_bounded", "gnn"])
def test_lightning_checkpoint_imports_as_its_inference_checkpoint(variant, tmp_path, capsys):
    """``last.ckpt`` (anemoi-training 0.17's Lightning checkpoint, written by the same callback at the
    same step as ``inference.ckpt``): same weights, graph (the sliding-window transformer's has no
    processor edges), loss weights, statistics and config as the inference checkpoint's import, and
    ``predict`` equals anemoi's ``predict_step``; it does not export back (into the file: it exports by building,
    tests/test_anemoi_export.py)."""
    from safetensors.torch import load_file

    from stormshard.graphs.builder import load_graph

    ours, ref = tmp_path / "from_last", tmp_path / "from_inference"
    assert convert_main(["import-anemoi", str(FIXTURES / variant / "last.ckpt"), "--out", str(ours)]) == 0
    import_anemoi(FIXTURES / variant / "inference.ckpt", ref)
    a, b = load_file(str(ours / "model.safetensors")), load_file(str(ref / "model.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)
    ga, gb = load_graph(ours / "graph.pt"), load_graph(ref / "graph.pt")
    assert sorted(ga.edge_types) == sorted(gb.edge_types)
    assert (("hidden", "to", "hidden") in gb.edge_types) == (variant != "transformer")
    for et in gb.edge_types:  # edges from the file's graph_data, sorted by destination as anemoi's provider
        assert torch.equal(ga[et].edge_index, gb[et].edge_index) and torch.equal(ga[et].edge_attr, gb[et].edge_attr)
    assert torch.equal(ga["data"].area_weight, gb["data"].area_weight)  # the graph's area_weight, unit-sum
    assert json.loads((ours / "statistics.json").read_text()) == json.loads((ref / "statistics.json").read_text())
    meta, ref_meta = (json.loads((d / "metadata.json").read_text()) for d in (ours, ref))
    assert meta["model"] == ref_meta["model"] and meta["timestep"] == "6h" and meta["step"] == 2
    assert meta["model"]["name"] == KINDS[variant]
    assert meta["anemoi"]["checkpoint"] == "lightning" and meta["anemoi"]["migrations"] == []
    model = stormshard.load_model(ours)
    err = _predict_error(model, variant)
    assert (err <= 1e-4).all(), err
    x = torch.from_numpy(np.load(FIXTURES / variant / "input.npy"))
    assert torch.equal(model.predict(x), stormshard.load_model(ref).predict(x))
    assert not (ours / "anemoi_source.ckpt").exists()
    capsys.readouterr()
    assert convert_main(["export-anemoi", str(ours), "--out", str(tmp_path / "x.ckpt")]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Lightning training checkpoint" in errors[0], errors
    assert not (tmp_path / "x.ckpt").exists()


def test_init_weights_from_a_lightning_checkpoint():
    """``training.init_weights: last.ckpt`` reads the weights the inference checkpoint gives."""
    from stormshard.training.finetune import init_weights_kind, read_init_weights

    last, inference = FIXTURES / "gt" / "last.ckpt", FIXTURES / "gt" / "inference.ckpt"
    assert init_weights_kind(last) == "anemoi"
    a, b = read_init_weights(last), read_init_weights(inference)
    assert set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)


def _forecast(rank: int, world: int, bundle: str, dataset: str, out: str, k: int) -> list[str]:
    from stormshard.inference.forecast import run_forecast

    result = run_forecast(bundle, dataset, ["2020-01-03T00"], 3, out, precision="fp64", verbose=False,
                          gpus_per_model=k, verify=False)
    return [str(s) for s in result.stores]


@pytest.mark.parametrize("variant", list(KINDS))
def test_imported_bundle_forecasts_sharded_as_one_process(variant, tmp_path):
    """``launch/forecast.py`` on an imported bundle at gpus_per_model 2 equals one process (fp64):
    the trainable edge features, latent skip, decoder embedding, bounding and truncated residual shard like
    the rest."""
    from stormshard.data.anemoi_layout import AnemoiDataset
    from stormshard.data.synthetic import generate_synthetic_dataset
    from tests.distributed import run_distributed

    bundle = import_anemoi(FIXTURES / variant / "inference.ckpt", tmp_path / "bundle")
    dataset = tmp_path / "o16.zarr"
    generate_synthetic_dataset(dataset, grid="o16", steps=16, seed=3)
    one = _forecast(0, 1, str(bundle), str(dataset), str(tmp_path / "one"), 1)
    two = run_distributed(_forecast, 2, str(bundle), str(dataset), str(tmp_path / "two"), 2)[0]
    a, b = (np.asarray(AnemoiDataset.open(s[0]).data[:]) for s in (one, two))
    assert not np.isnan(b).any()
    np.testing.assert_allclose(b, a, rtol=1e-9, atol=1e-9)


@pytest.mark.skipif(not ANEMOI_PYTHON.exists(), reason="needs an anemoi-training venv (ANEMOI_TRAINING_ENV)")
@pytest.mark.parametrize("variant", list(KINDS))
def test_export_round_trip_in_anemoi(variant, tmp_path):
    """import -> change every weight (as fine-tuning would) -> export-anemoi: anemoi's own
    ``torch.load`` + ``predict_step`` equals stormshard's ``predict`` of the changed bundle, and
    ``load_metadata`` gives metadata 2.0 with the same variables and timestep."""
    from safetensors.torch import load_file, save_file

    bundle = tmp_path / "bundle"
    import_anemoi(FIXTURES / variant / "inference.ckpt", bundle)
    weights = load_file(str(bundle / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    changed = {n: (w if n.endswith("lin_qkv.bias") else w * 1.05 + 0.01 * torch.randn(w.shape, generator=g))
               for n, w in weights.items()}
    save_file(changed, str(bundle / "model.safetensors"))
    out = tmp_path / "exported.ckpt"
    assert convert_main(["export-anemoi", str(bundle), "--out", str(out)]) == 0
    x = FIXTURES / variant / "input.npy"
    run_in_anemoi_env([str(FIXTURES / "anemoi_predict.py"), str(out), str(x), str(tmp_path / "y.npy"),
                       str(tmp_path / "meta.json")], check=True, env=dict(os.environ, OMP_NUM_THREADS="1"), text=False)
    theirs = np.load(tmp_path / "y.npy")
    ours = stormshard.load_model(bundle).predict(torch.from_numpy(np.load(x))).numpy()
    spread = theirs.reshape(-1, theirs.shape[-1]).std(axis=0)
    err = np.abs(ours - theirs).reshape(-1, theirs.shape[-1]).max(axis=0)
    assert (err <= 1e-4 * spread).all(), err / spread
    assert not np.allclose(theirs, np.load(FIXTURES / variant / "output.npy"), atol=1e-3)  # the new weights
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["version"].startswith("2") and meta["timestep"] == "6h"
    assert meta["variables"] == list(stormshard.load_model(bundle).variables.variables)


def test_export_needs_an_imported_bundle(tmp_path, capsys):
    assert convert_main(["export-anemoi", str(tmp_path / "nothing"), "--out", str(tmp_path / "x.ckpt")]) == 2
    assert "not a stormshard inference bundle" in capsys.readouterr().err
    assert not (tmp_path / "x.ckpt").exists()


def _with_metadata(dst: Path, change) -> Path:  # noqa: ANN001 - change: bytes of anemoi.json -> new bytes
    """A copy of the gt inference fixture whose ``anemoi-metadata/anemoi.json`` entry is ``change(old bytes)``."""
    import zipfile

    with zipfile.ZipFile(FIXTURES / "gt" / "inference.ckpt") as z, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as out:
        for info in z.infolist():
            data = z.read(info)
            out.writestr(info, change(data) if info.filename.endswith("anemoi-metadata/anemoi.json") else data)
    return dst


def _metadata_change(**changes):  # noqa: ANN202
    def change(data: bytes) -> bytes:
        meta = json.loads(data)
        for key, value in changes.items():
            if value is None:
                meta.pop(key)
            else:
                meta[key] = value
        return json.dumps(meta).encode()
    return change


def test_older_layout_is_a_clear_error(tmp_path, capsys):
    """A metadata 1.0 file (no data_indices per dataset): exit 2, one error line naming it, nothing written."""
    old = _with_metadata(tmp_path / "aifs1.ckpt", _metadata_change(version="1.0", data_indices=None))
    assert convert_main(["import-anemoi", str(old), "--out", str(tmp_path / "b")]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "metadata 1.0 / older layout" in errors[0]
    assert not (tmp_path / "b").exists()


def _object_dtype(data: bytes) -> bytes:
    meta = json.loads(data)
    meta["supporting_arrays_paths"]["data"]["latitudes"]["dtype"] = "object"  # what save_metadata writes for one
    return json.dumps(meta).encode()


ENTRY = "inference-last/anemoi-metadata/anemoi.json"
LATITUDES = "supporting_arrays_paths.data.latitudes (entry inference-last/anemoi-metadata/data/latitudes.numpy)"


@pytest.mark.parametrize("case, change, names", [
    ("malformed-json", lambda d: d[:200], [ENTRY, "is not valid JSON"]),
    ("json-list", lambda d: b"[1, 2]", [ENTRY, "holds a JSON list"]),
    ("object-dtype-array", _object_dtype, [LATITUDES, "dtype 'object'", "is not numeric"]),
    ("directory", None, ["is a directory", "gt/inference.ckpt", "give the .ckpt file itself"]),
])
def test_anemoi_file_errors_name_the_file_and_entry(case, change, names, tmp_path, capsys):
    """A malformed anemoi.json, an object-dtype supporting array, a directory given as the checkpoint:
    exit 2, one ``error:`` line naming the file and the entry, no traceback, nothing written or changed;
    ``training.init_weights`` of the same file says the same."""
    from stormshard.training.finetune import read_init_weights
    from tests.bad_input_helpers import content_hashes

    if change is None:
        bad = tmp_path / "run"
        (bad / "gt").mkdir(parents=True)
        (bad / "gt" / "inference.ckpt").write_bytes((FIXTURES / "gt" / "inference.ckpt").read_bytes())
    else:
        bad = _with_metadata(tmp_path / f"{case}.ckpt", change)
    before = content_hashes(tmp_path)
    assert convert_main(["import-anemoi", str(bad), "--out", str(tmp_path / "bundle")]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert errors[0].startswith(f"error: {bad}") and all(n in err for n in names), err
    assert content_hashes(tmp_path) == before
    if change is not None:
        with pytest.raises(ConversionError) as info:
            read_init_weights(bad)
        assert str(info.value).startswith(str(bad)) and all(n in str(info.value) for n in names)


def test_export_of_a_bundle_that_lost_its_anemoi_source(tmp_path, capsys):
    """export-anemoi of an imported bundle whose anemoi_source.ckpt is gone: exit 2, one error naming that
    file and the metadata entry that names it (not "needs anemoi-models"), nothing written; and one whose
    anemoi_source.ckpt has a malformed anemoi.json names that entry."""
    from tests.bad_input_helpers import content_hashes

    bundle = import_anemoi(FIXTURES / "gt" / "inference.ckpt", tmp_path / "bundle")
    (bundle / "anemoi_source.ckpt").unlink()
    before = content_hashes(tmp_path)
    assert convert_main(["export-anemoi", str(bundle), "--out", str(tmp_path / "x.ckpt")]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {bundle / 'anemoi_source.ckpt'} is missing: {bundle / 'metadata.json'} (anemoi.template) "
                      f"names it as the anemoi checkpoint this bundle was imported from "
                      f"({json.loads((bundle / 'metadata.json').read_text())['anemoi']['uuid']}), and export-anemoi "
                      "writes the weights into it"], err
    assert "Traceback" not in err and "anemoi-models" not in err
    assert content_hashes(tmp_path) == before
    _with_metadata(bundle / "anemoi_source.ckpt", lambda d: d[:100])
    before = content_hashes(tmp_path)
    assert convert_main(["export-anemoi", str(bundle), "--out", str(tmp_path / "x.ckpt")]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"{bundle / 'anemoi_source.ckpt'}: its metadata entry {ENTRY}" in errors[0], errors
    assert content_hashes(tmp_path) == before
