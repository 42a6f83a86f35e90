"""``convert_checkpoint.py export-anemoi`` of models trained in stormshard (not imported from anemoi):
anemoi's own model is built from the stormshard config and weights, and anemoi's ``torch.load`` +
``predict_step`` equals stormshard's ``predict``.

The export itself needs anemoi-models, so those tests run it in the anemoi-training venv
(``$ANEMOI_TRAINING_ENV``, ``../shared/anemoi-training/setup.sh``; skipped without one); the error cases
and the weight folding need no anemoi."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

import stormshard
from launch.convert_checkpoint import main as convert_main
from stormshard.checkpoint.anemoi_import import import_anemoi
from stormshard.checkpoint.anemoi_plan import fold_qkv_bias
from stormshard.checkpoint.errors import ConversionError
from stormshard.checkpoint.export import export_bundle
from stormshard.data.synthetic import generate_synthetic_dataset
from tests.anemoi_runner import ANEMOI_PYTHON, run_in_anemoi_env
from tests.tiny_run import tiny_config, train_losses

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "anemoi"


def _anemoi_importable() -> bool:
    if not ANEMOI_PYTHON.exists():
        return False
    # forked from the session's anemoi fork server (started here, so its one import of torch and anemoi is this
    # probe's); OMP_NUM_THREADS as the server's, for no other reason than to share it
    probe = run_in_anemoi_env(["-c", "import anemoi.models.interface, anemoi.utils.checkpoints"],
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    return probe.returncode == 0


needs_anemoi = pytest.mark.skipif(not _anemoi_importable(),
                                  reason="needs an anemoi-training venv with anemoi-models (ANEMOI_TRAINING_ENV)")

#: a gnn section with anemoi's GraphConv options (edge MLP at ratio 1) and mlp_extra_layers 1
_ANEMOI_GNN = {"mlp_hidden_layers": 3, "edge_embedding": True, "aggregate_updated_edges": True, "edge_mlp_ratio": 1.0}
#: tiny models trained for 2 steps: options with and without anemoi counterparts in anemoi's model
MODELS = {
    # self_projection / decoder_embedding off (anemoi: zero lin_self, a copy of the encoder embedding),
    # no trainable edges, a per-variable normalisation method
    "graphtransformer": {"model.name": "graphtransformer", "data.normalisation_methods": {"insolation": "min-max"}},
    # anemoi's AIFS options on, lin_qkv biases trained (folded into anemoi's bias-free q/k/v)
    "transformer": {"model.latent_skip": True, "model.decoder_embedding": True, "model.relu_bounded": ["tracer_2"],
                    "model.encoder": {"num_heads": 2, "mlp_ratio": 1.0, "trainable_edge_size": 2},
                    "model.decoder": {"num_heads": 2, "mlp_ratio": 1.0, "trainable_edge_size": 1}},
    "gnn": {"model.name": "gnn", "training.max_steps": 1},
    # anemoi's GNN model (GNNForwardMapper / GNNProcessor / GNNBackwardMapper): MLP node embeddings and head, edge
    # embeddings, the updated edges aggregated, the encoder's update of the data latents; mlp_extra_layers 1 (3 hidden
    # layers; the decoder's 0) and mlp_hidden_ratio 2 (the edge MLPs at ratio 1), trainable node and edge tensors
    "gnn-anemoi": {"model.name": "gnn", "model.node_embedding": "mlp", "model.head": "mlp", "model.latent_skip": True,
                   "model.relu_bounded": ["tracer_2"],
                   "model.processor": {"num_layers": 2, "mlp_ratio": 2, **_ANEMOI_GNN, "trainable_edge_size": 2},
                   "model.encoder": {"mlp_ratio": 2.0, **_ANEMOI_GNN, "update_src_nodes": True, "trainable_edge_size": 1},
                   "model.decoder": {"mlp_ratio": 1.0, **_ANEMOI_GNN, "mlp_hidden_layers": 2, "trainable_edge_size": 2}},
    # anemoi's bounding kinds after ReluBounding, in order: HardtanhBounding, LeakyFractionBounding of a bounded
    # total, NormalizedReluBounding (its threshold exported in physical units, rebuilt by anemoi from the statistics)
    # trained with a Huber loss and per-variable and level weights: exported as anemoi's training_loss and scalers
    "bounded": {"training.loss": "huber", "training.huber_delta": 0.5,
                "training.loss_scaling": {"variables": {"tracer": 2.0, "tracer_product": 0.5},
                                          "pressure_level": {"type": "linear", "slope": 0.1, "y_intercept": 0.3}},
                "model.relu_bounded": ["tracer_2"], "model.bounding": [
        {"kind": "hardtanh", "variables": ["tracer_3"], "min_val": -0.3, "max_val": 0.3},
        {"kind": "leaky_fraction", "variables": ["tracer_product"], "min_val": 0.0, "max_val": 0.8,
         "total_variable": "tracer_2"},
        {"kind": "normalized_relu", "variables": ["tracer_1"], "thresholds": [0.2]}]},
    # anemoi's TruncatedConnection (on the exported graph's truncation edges): the last state through O4 and back
    "truncated": {"model.name": "graphtransformer", "model.residual": "truncated",
                  "graph.truncation": {"grid": "o4", "num_neighbours": 3, "sigma": 0.2}},
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, Path]:
    """name -> the run's checkpoints directory (2 training steps on synthetic O8 data)."""
    root = tmp_path_factory.mktemp("anemoi-export")
    dataset = root / "o8.zarr"
    generate_synthetic_dataset(dataset, grid="o8", steps=64, seed=1)
    runs = {}
    for name, changes in MODELS.items():
        cfg = tiny_config(str(dataset), root / name, **{"data.validation_samples": 2, "training.max_steps": 2,
                                                         **changes})
        train_losses(0, 1, cfg)
        runs[name] = root / name / "checkpoints"
    return runs


def _anemoi(*args: str) -> subprocess.CompletedProcess:
    """Run a command with the anemoi venv's python (stormshard from this checkout on its path), forked from the
    session's anemoi fork server (``tests/anemoi_runner.py``)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    return run_in_anemoi_env(list(args), env=env, cwd=REPO)


def _reference_input(model, dataset: Path) -> torch.Tensor:
    """Two states: a dataset window and a perturbed copy, ``(2, multistep, grid, inputs)``."""
    from stormshard.data.anemoi_layout import AnemoiDataset

    ds = AnemoiDataset.open(dataset)
    cols = [list(ds.variables).index(n) for n in model.variables.input_names]
    window = np.asarray(ds.data[40:40 + model.multistep_input], dtype=np.float32)[:, cols, 0, :]  # (t, v, grid)
    x = torch.from_numpy(window).permute(0, 2, 1)[None]
    g = torch.Generator().manual_seed(0)
    return torch.cat([x, x + 0.3 * torch.randn(x.shape, generator=g) * x.std(dim=(0, 1, 2))])


@needs_anemoi
@pytest.mark.parametrize("name", ["graphtransformer", "transformer", "truncated", "bounded", "gnn-anemoi"])
def test_export_of_a_stormshard_model_predicts_in_anemoi(name, trained, tmp_path):
    """bundle -> export-anemoi (anemoi venv) -> anemoi's torch.load + predict_step == stormshard's predict
    (1e-4 of each output variable's spread, fp32); load_metadata: metadata 2.0, same variables and
    timestep; and the file imports back into stormshard (no anemoi) with the same predictions (a truncated
    residual: anemoi's TruncatedConnection, its matrices the bundle's truncation edges, read back exactly)."""
    bundle = export_bundle(trained[name], tmp_path / "bundle")
    out = tmp_path / f"{name}.ckpt"
    export = _anemoi("launch/convert_checkpoint.py", "export-anemoi", str(bundle), "--out", str(out))
    assert export.returncode == 0, export.stderr[-3000:]
    assert "predict_step equals predict" in export.stderr and "exported" in export.stdout
    model = stormshard.load_model(bundle)
    x = _reference_input(model, trained[name].parent.parent / "o8.zarr")
    np.save(tmp_path / "x.npy", x.numpy())
    run = _anemoi(str(FIXTURES / "anemoi_predict.py"), str(out), str(tmp_path / "x.npy"), str(tmp_path / "y.npy"),
                  str(tmp_path / "meta.json"))
    assert run.returncode == 0, run.stderr[-3000:]
    theirs, ours = np.load(tmp_path / "y.npy"), model.predict(x).numpy()
    assert theirs.shape == ours.shape == (2, x.shape[2], len(model.variables.output_names))
    spread = theirs.reshape(-1, theirs.shape[-1]).std(axis=0)
    err = np.abs(ours - theirs).reshape(-1, theirs.shape[-1]).max(axis=0) / spread
    assert (err <= 1e-4).all(), err
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["version"].startswith("2") and meta["timestep"] == model.timestep == "6h"
    assert meta["variables"] == list(model.variables.variables)
    if name == "transformer":  # the trained lin_qkv biases were there to fold
        assert any(model.model.state_dict()[k].any() for k in model.model.state_dict() if k.endswith("lin_qkv.bias"))
        assert "lin_qkv bias folded" in export.stderr and "lin_qkv bias folded" in _export_notes(out)
    elif name != "gnn-anemoi":  # options anemoi's model always has, given values that compute what stormshard's does
        assert "lin_self is zero" in _export_notes(out) and "emb_nodes_dst is a copy" in _export_notes(out)
    back = stormshard.load_model(import_anemoi(out, tmp_path / "back"))
    assert back.config.name == model.config.name and back.config.latent_skip == model.config.latent_skip
    assert back.config.residual == model.config.residual == ("truncated" if name == "truncated" else "last_step")
    if name == "gnn-anemoi":  # anemoi's GNN read back: the same options and sizes
        gnn_fields = ("mlp_ratio", "mlp_hidden_layers", "edge_embedding", "aggregate_updated_edges", "edge_mlp_ratio",
                      "trainable_edge_size")
        for section in ("processor", "encoder", "decoder"):
            ours_, theirs_ = getattr(model.config, section), getattr(back.config, section)
            assert all(getattr(ours_, f) == getattr(theirs_, f) for f in gnn_fields), (section, ours_, theirs_)
        assert (back.config.node_embedding, back.config.head, back.config.encoder.update_src_nodes) == ("mlp", "mlp", True)
    if name == "truncated":  # the matrices anemoi multiplies are the bundle's, and so are the nodes
        for key in ("truncation", ("data", "to", "truncation"), ("truncation", "to", "data")):
            for attr, value in model.graph[key].items():
                assert torch.equal(back.graph[key][attr], value), (key, attr)
    if name == "bounded":  # anemoi's list read back: every bounding, in order, the threshold the same
        kinds = [(b.kind, b.variables) for b in back.config.bounding]
        assert kinds == [("relu", ("tracer_2",)), ("hardtanh", ("tracer_3",)), ("leaky_fraction", ("tracer_product",)),
                         ("normalized_relu", ("tracer_1",))] and not back.config.relu_bounded, kinds
        assert abs(back.config.bounding[3].thresholds[0] - 0.2) < 1e-6
        # the loss read back as it was trained: Huber 0.5, tracer_<n> weighted 2 * (0.1 n + 0.3), tracer_product 0.5
        training = json.loads((tmp_path / "back" / "finetune_config.json").read_text())["training"]
        assert (training["loss"], training["huber_delta"]) == ("huber", 0.5)
        assert training["loss_scaling"]["variables"] == pytest.approx(
            {"tracer_1": 0.8, "tracer_2": 1.0, "tracer_3": 1.2, "tracer_product": 0.5})
        bounded = ours[..., list(model.variables.output_names).index("tracer_3")]
        # it binds: the prediction (physical units) sits at both clamp values at many points
        assert (bounded == bounded.max()).sum() > 10 and (bounded == bounded.min()).sum() > 10
    again = back.predict(x).numpy()
    assert (np.abs(again - ours).reshape(-1, ours.shape[-1]).max(axis=0) / spread <= 1e-4).all()


def _export_notes(ckpt: Path) -> str:
    import zipfile

    with zipfile.ZipFile(ckpt) as z:
        name = next(n for n in z.namelist() if n.endswith("anemoi-metadata/anemoi.json"))
        return json.dumps(json.loads(z.read(name))["stormshard"]["export_notes"])


def _errors(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]


def _edited_bundle(trained, tmp_path: Path, base: str = "graphtransformer", **model_changes) -> Path:
    bundle = export_bundle(trained[base], tmp_path / "edited")
    meta = json.loads((bundle / "metadata.json").read_text())
    for dotted, value in model_changes.items():
        node = meta["model"]
        *parents, leaf = dotted.split("__")
        for key in parents:
            node = node[key]
        node[leaf] = value
    (bundle / "metadata.json").write_text(json.dumps(meta))
    return bundle


def test_models_without_an_anemoi_equivalent_are_clear_errors(trained, tmp_path, capsys):
    """No anemoi needed: exit 2, one error line naming the option and its value, nothing written."""
    out = tmp_path / "x.ckpt"
    assert convert_main(["export-anemoi", str(trained["gnn"]), "--out", str(out)]) == 2  # a training checkpoint
    errors = _errors(capsys)
    # a gnn model without anemoi's GNN options (linear node embeddings, ...): refused naming the first
    assert len(errors) == 1 and "model.node_embedding='linear' has no anemoi equivalent (anemoi's GNN model: 'mlp')" \
        in errors[0], errors
    bundle = _edited_bundle(trained, tmp_path / "a", encoder__mlp_ratio=0.15625)  # 16 x 0.15625 = 2.5 channels
    assert convert_main(["export-anemoi", str(bundle), "--out", str(out)]) == 2
    errors = _errors(capsys)
    assert len(errors) == 1 and "model.encoder.mlp_ratio=0.15625 has no anemoi equivalent" in errors[0], errors
    bundle = _edited_bundle(trained, tmp_path / "b", name="ensemble")
    assert convert_main(["export-anemoi", str(bundle), "--out", str(out)]) == 2
    errors = _errors(capsys)
    assert len(errors) == 1 and "model.name='ensemble'" in errors[0], errors
    # anemoi's GNN widths: its GraphConv edge MLP is num_channels wide, its MLPs have >= 2 hidden layers
    for change, message in ((dict(processor__edge_mlp_ratio=None), "model.processor.edge_mlp_ratio=None (mlp_ratio 2) "
                             "makes the edge MLP 32 channels wide; anemoi's GraphConv has num_channels=16"),
                            (dict(decoder__mlp_hidden_layers=1), "model.decoder.mlp_hidden_layers=1 has no anemoi "
                             "equivalent")):
        bundle = _edited_bundle(trained, tmp_path / str(len(message)), "gnn-anemoi", **change)
        assert convert_main(["export-anemoi", str(bundle), "--out", str(out)]) == 2
        errors = _errors(capsys)
        assert len(errors) == 1 and message in errors[0], errors
    assert not out.exists() and not list(tmp_path.glob("**/*.ckpt"))


@pytest.mark.skipif(importlib.util.find_spec("anemoi") is not None, reason="anemoi importable in this python")
def test_export_without_anemoi_says_what_to_install(trained, tmp_path, capsys):
    """A mappable model (a training checkpoint), in a python without anemoi-models: exit 2, one error line
    saying what is missing, the install line after it, nothing written; an existing --out is refused."""
    out = tmp_path / "x.ckpt"
    assert convert_main(["export-anemoi", str(trained["transformer"]), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "needs anemoi-models 0.19 importable" in errors[0], errors
    assert "pip install --no-deps anemoi-models" in err and not out.exists()
    out.write_text("keep me")
    assert convert_main(["export-anemoi", str(trained["transformer"]), "--out", str(out)]) == 2
    assert "exists" in _errors(capsys)[0] and out.read_text() == "keep me"


def _block(c: int, heads: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return {"gamma": 1 + 0.3 * r(c), "beta": 0.5 * r(c), "wq": r(c, c) / c**0.5, "wk": r(c, c) / c**0.5,
            "wv": r(c, c) / c**0.5, "wo": r(c, c) / c**0.5, "bo": 0.1 * r(c), "bias": 0.5 * r(3 * c)}


def _attention(block: dict[str, torch.Tensor], x: torch.Tensor, heads: int, window: int) -> torch.Tensor:
    """stormshard's sliding-window attention sub-block (float64): LayerNorm, lin_qkv ``(heads three d)``
    with bias, attention within ``window``, projection."""
    c = x.shape[-1]
    h = torch.nn.functional.layer_norm(x, (c,), block["gamma"], block["beta"])
    b = block["bias"].reshape(heads, 3, c // heads)
    q, k, v = (h @ w.T + b[:, i].reshape(c) for i, w in enumerate((block["wq"], block["wk"], block["wv"])))
    q, k, v = (t.reshape(-1, heads, c // heads).transpose(0, 1) for t in (q, k, v))
    n = x.shape[0]
    near = (torch.arange(n)[:, None] - torch.arange(n)[None]).abs() <= window
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=near)
    return out.transpose(0, 1).reshape(n, c) @ block["wo"].T + block["bo"]


@pytest.mark.parametrize("query_bias", [True, False])
def test_qkv_bias_folds_exactly_into_anemois_bias_free_attention(query_bias):
    c, heads = 16, 4
    block = _block(c, heads, 0)
    if not query_bias:
        block["bias"].view(heads, 3, -1)[:, 0] = 0
    folded = fold_qkv_bias(block, heads, "blocks.0")
    anemoi = block | {"beta": folded["beta"], "wq": folded["wq"], "bo": folded["bo"], "bias": torch.zeros(3 * c)}
    x = torch.randn(40, c, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) * 2 + 1
    for window in (3, 39):
        torch.testing.assert_close(_attention(anemoi, x, heads, window), _attention(block, x, heads, window),
                                   rtol=1e-10, atol=1e-10)
    if not query_bias:  # nothing moves into the norm or lin_q
        assert torch.equal(folded["beta"], block["beta"]) and torch.equal(folded["wq"], block["wq"])
    block["gamma"][3] = 1e-6
    if query_bias:
        with pytest.raises(ConversionError, match=r"blocks\.0\.norm_attention\.weight has an entry"):
            fold_qkv_bias(block, heads, "blocks.0")


@needs_anemoi
@pytest.mark.parametrize("variant", ["gt", "gnn"])
def test_bundle_imported_from_a_lightning_checkpoint_exports_by_building(variant, tmp_path):
    """A bundle imported from a Lightning last.ckpt has no pickled model to write into; the build path
    exports it (gnn: anemoi's GNN model built from the bundle's config), and anemoi's predict_step of the result
    equals that of the original anemoi model."""
    bundle = import_anemoi(FIXTURES / variant / "last.ckpt", tmp_path / "from_last")
    out = tmp_path / "back.ckpt"
    run = _anemoi("launch/convert_checkpoint.py", "export-anemoi", str(bundle), "--out", str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    x = FIXTURES / variant / "input.npy"
    run = _anemoi(str(FIXTURES / "anemoi_predict.py"), str(out), str(x), str(tmp_path / "y.npy"),
                  str(tmp_path / "meta.json"))
    assert run.returncode == 0, run.stderr[-3000:]
    expected = np.load(FIXTURES / variant / "output.npy")  # anemoi's own predict_step of the original model
    got = np.load(tmp_path / "y.npy")
    spread = expected.reshape(-1, expected.shape[-1]).std(axis=0)
    assert (np.abs(got - expected).reshape(-1, expected.shape[-1]).max(axis=0) / spread <= 1e-4).all()


@needs_anemoi
def test_trained_qkv_bias_writes_into_an_imported_checkpoint_folded(tmp_path):
    """An imported transformer whose lin_qkv biases were trained (not frozen): export-anemoi writes into
    its anemoi checkpoint (no anemoi needed for that) with the biases folded; anemoi's predict_step
    equals stormshard's predict, which the biases changed."""
    from safetensors.torch import load_file, save_file

    variant = FIXTURES / "transformer"
    bundle = import_anemoi(variant / "inference.ckpt", tmp_path / "bundle")
    g = torch.Generator().manual_seed(0)
    weights = {n: 0.1 * torch.randn(w.shape, generator=g) if n.endswith("lin_qkv.bias") else w
               for n, w in load_file(str(bundle / "model.safetensors")).items()}
    save_file(weights, str(bundle / "model.safetensors"))
    out = tmp_path / "out.ckpt"
    assert convert_main(["export-anemoi", str(bundle), "--out", str(out)]) == 0
    run = _anemoi(str(FIXTURES / "anemoi_predict.py"), str(out), str(variant / "input.npy"), str(tmp_path / "y.npy"),
                  str(tmp_path / "meta.json"))
    assert run.returncode == 0, run.stderr[-3000:]
    theirs = np.load(tmp_path / "y.npy")
    ours = stormshard.load_model(bundle).predict(torch.from_numpy(np.load(variant / "input.npy"))).numpy()
    spread = theirs.reshape(-1, theirs.shape[-1]).std(axis=0)
    assert (np.abs(ours - theirs).reshape(-1, theirs.shape[-1]).max(axis=0) / spread <= 1e-4).all()
    assert not np.allclose(theirs, np.load(variant / "output.npy"), atol=1e-2)  # the biases changed the forecast


@pytest.mark.parametrize("template", [True, False])
def test_a_damaged_bundle_weights_file_is_one_error_naming_it(tmp_path, capsys, template):
    """Written into the anemoi file the bundle came from, or built: a truncated model.safetensors is one error line
    naming the file, before anything is written (no anemoi needed: it fails before anemoi is imported)."""
    bundle = import_anemoi(FIXTURES / "gt" / ("inference.ckpt" if template else "last.ckpt"), tmp_path / "bundle")
    weights = bundle / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    out = tmp_path / "out.ckpt"
    assert convert_main(["export-anemoi", str(bundle), "--out", str(out)]) == 2
    errors = _errors(capsys)
    assert len(errors) == 1 and f"{weights}" in errors[0] and "damaged" in errors[0], errors
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["bundle"]
