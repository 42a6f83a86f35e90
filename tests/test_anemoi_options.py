"""anemoi-models' ``qk_norm`` and gated MLPs (``mlp_implementation``) through ``import-anemoi`` and ``export-anemoi``.

Fixtures written by anemoi-training itself (``tests/fixtures/anemoi/make_option_fixtures.py``):
``transformer_qk_gated`` (sliding-window transformer: qk_norm in the processor and the encoder, SwiGLU processor MLP at
ratio 2.75, GeGLU encoder, GLU decoder) and ``gt_qk_gated`` (graph transformer: qk_norm in every block, SwiGLU
processor MLP at ratio 2.75, ReGLU encoder). The import needs no anemoi; the export tests run anemoi's
``predict_step`` in the anemoi-training venv (``$ANEMOI_TRAINING_ENV``; skipped without one). The first fine-tuning
loss: ``tests/test_anemoi_end_to_end.py``."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import stormshard
from launch.convert_checkpoint import main as convert_main
from stormshard.checkpoint.anemoi_import import import_anemoi
from stormshard.checkpoint.anemoi_pickle import module_tensors, open_anemoi_checkpoint
from stormshard.checkpoint.anemoi_plan import fold_qkv_bias
from stormshard.checkpoint.errors import ConversionError
from stormshard.checkpoint.export import export_bundle
from stormshard.data.anemoi_layout import AnemoiDataset
from stormshard.data.synthetic import generate_synthetic_dataset
from tests.anemoi_repickle import rewrite_metadata
from tests.anemoi_runner import run_in_anemoi_env
from tests.test_anemoi_export import FIXTURES, REPO, needs_anemoi
from tests.tiny_run import tiny_config, train_losses

#: fixture -> (model name, {section: (qk_norm, mlp_implementation, mlp_ratio)})
VARIANTS = {
    "transformer_qk_gated": ("transformer", {"processor": (True, "swiglu", 2.75), "encoder": (True, "geglu", 2.5),
                                             "decoder": (False, "glu", 2.0)}),
    "gt_qk_gated": ("graphtransformer", {"processor": (True, "swiglu", 2.75), "encoder": (True, "reglu", 2.5),
                                         "decoder": (True, "mlp", 2.0)}),
}


def _parameter_count(module: object) -> int:
    """The parameters of a pickled (stub) module tree, counted as ``nn.Module.named_parameters`` without dedup."""
    state = module.__dict__
    own = sum(t.numel() for t in (state.get("_parameters") or {}).values() if t is not None)
    return own + sum(_parameter_count(child) for child in (state.get("_modules") or {}).values() if child is not None)


def run_in_anemoi(*args: str) -> subprocess.CompletedProcess:
    """``args`` run by the anemoi venv's python, with this checkout's stormshard importable (forked from the
    session's anemoi fork server, ``tests/anemoi_runner.py``)."""
    return run_in_anemoi_env(list(args), cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})


def _relative_error(got: np.ndarray, expected: np.ndarray) -> float:
    """The largest error of any output variable over that variable's spread."""
    spread = expected.reshape(-1, expected.shape[-1]).std(axis=0)
    return float((np.abs(got - expected).reshape(-1, expected.shape[-1]).max(axis=0) / spread).max())


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_import_predicts_what_anemoi_predicts(variant, tmp_path):
    """Both files anemoi-training wrote (inference.ckpt: options read from the pickled model; last.ckpt: from the
    config) import to the same options and weights, and predict what anemoi's predict_step did within 1e-5 of each
    output's spread (measured: transformer 6.4e-6, gt 5.4e-6); every anemoi parameter arrives, a gated MLP's gate
    and value rows interleaved in fc1."""
    name, sections = VARIANTS[variant]
    weights = {}
    for source in ("inference.ckpt", "last.ckpt"):
        bundle = import_anemoi(FIXTURES / variant / source, tmp_path / source)
        model = stormshard.load_model(bundle)
        assert model.config.name == name and model.config.latent_skip and model.config.relu_bounded == ("tracer_2",)
        for section, (qk, kind, ratio) in sections.items():
            got = getattr(model.config, section)
            assert (got.qk_norm, got.mlp_implementation, got.mlp_ratio) == (qk, kind, ratio), (section, got)
        x = torch.from_numpy(np.load(FIXTURES / variant / "input.npy"))
        error = _relative_error(model.predict(x).numpy(), np.load(FIXTURES / variant / "output.npy"))
        assert error <= 1e-5, (source, error)
        weights[source] = load_file(str(bundle / "model.safetensors"))
    assert weights["inference.ckpt"].keys() == weights["last.ckpt"].keys()
    assert all(torch.equal(w, weights["last.ckpt"][k]) for k, w in weights["inference.ckpt"].items())
    ours = weights["inference.ckpt"]
    root = open_anemoi_checkpoint(FIXTURES / variant / "inference.ckpt").root
    theirs = module_tensors(root)
    prefix = "processor.processor.blocks.0.mlp.fc1" if name == "transformer" else "processor.blocks.0.mlp.0"
    gate = f"model.processor.proc.0.{'mlp' if name == 'transformer' else 'node_dst_mlp'}.mlp.0"
    assert torch.equal(ours[f"{prefix}.weight"][0::2], theirs[f"{gate}.gate_proj.weight"])
    assert torch.equal(ours[f"{prefix}.bias"][1::2], theirs[f"{gate}.value_proj.bias"])
    norm = "processor.processor.blocks.1.attention" if name == "transformer" else "processor.blocks.1"
    anemoi_norm = "model.processor.proc.1" + (".attention" if name == "transformer" else "")
    assert torch.equal(ours[f"{norm}.k_norm.weight"], theirs[f"{anemoi_norm}.k_norm.weight"])
    # every anemoi parameter arrives: the same count, less the mappers' layer_norm_attention (an alias of
    # layer_norm_attention_dest, counted twice), plus the transformer's zero lin_qkv biases (anemoi's q/k/v have none)
    c, layers = 16, 2
    extra = 3 * c * layers if name == "transformer" else 0
    assert sum(w.numel() for w in ours.values()) == _parameter_count(root) - 2 * 2 * c + extra


def test_import_refuses_norms_and_gates_stormshard_lacks(tmp_path):
    """A QueryNorm other than anemoi's default LayerNorm, and a config whose mlp_implementation disagrees with the
    tensors: one error naming each (read from the Lightning file's config), nothing written."""
    def edit(meta: dict) -> None:
        model = meta["config"]["model"]
        model["processor"]["layer_kernels"]["QueryNorm"] = {"_target_": "torch.nn.RMSNorm"}
        model["encoders"]["0"]["mapper"]["mlp_implementation"] = "mlp"

    path = rewrite_metadata(FIXTURES / "gt_qk_gated" / "last.ckpt", tmp_path / "last.ckpt", edit)
    with pytest.raises(ConversionError) as err:
        import_anemoi(path, tmp_path / "bundle")
    message = str(err.value)
    assert "processor qk_norm with QueryNorm RMSNorm" in message, message
    assert "encoder MLP with gate_proj / value_proj tensors but mlp_implementation='mlp'" in message, message
    assert not (tmp_path / "bundle").exists()


def _attention(block: dict[str, torch.Tensor], x: torch.Tensor, heads: int) -> torch.Tensor:
    """stormshard's attention sub-block with qk_norm (float64, full attention): LayerNorm, lin_qkv ``(heads three
    d)`` with bias, per-head query / key norms, attention, projection."""
    c = x.shape[-1]
    h = torch.nn.functional.layer_norm(x, (c,), block["gamma"], block["beta"])
    b = block["bias"].reshape(heads, 3, c // heads)
    q, k, v = (h @ w.T + b[:, i].reshape(c) for i, w in enumerate((block["wq"], block["wk"], block["wv"])))
    q, k, v = (t.reshape(-1, heads, c // heads).transpose(0, 1) for t in (q, k, v))
    q = torch.nn.functional.layer_norm(q, (c // heads,), block["qn"])
    k = torch.nn.functional.layer_norm(k, (c // heads,), block["kn"])
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    return out.transpose(0, 1).reshape(-1, c) @ block["wo"].T + block["bo"]


@pytest.mark.parametrize("query_bias", [True, False])
def test_qkv_bias_folds_exactly_with_qk_norm(query_bias):
    """With qk_norm the key bias changes the normed keys: it moves into lin_k (as the query bias into lin_q),
    exactly; without a query bias the key bias still folds (nothing dropped)."""
    c, heads = 16, 4
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    block = {"gamma": 1 + 0.3 * r(c), "beta": 0.5 * r(c), "wq": r(c, c) / c**0.5, "wk": r(c, c) / c**0.5,
             "wv": r(c, c) / c**0.5, "wo": r(c, c) / c**0.5, "bo": 0.1 * r(c), "bias": 0.5 * r(3 * c),
             "qn": 1 + 0.3 * r(c // heads), "kn": 1 + 0.3 * r(c // heads)}
    if not query_bias:
        block["bias"].view(heads, 3, -1)[:, 0] = 0
    folded = fold_qkv_bias(block, heads, "blocks.0")
    anemoi = block | {k: folded[k] for k in ("beta", "wq", "wk", "bo")} | {"bias": torch.zeros(3 * c)}
    x = torch.randn(40, c, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) * 2 + 1
    torch.testing.assert_close(_attention(anemoi, x, heads), _attention(block, x, heads), rtol=1e-10, atol=1e-10)
    assert not torch.equal(folded["wk"], block["wk"])


# ------------------------------------------------------------------------------------------ export (anemoi venv)

#: tiny stormshard models with the options, trained 2 steps (their lin_qkv biases too: folded with the keys exact)
MODELS = {
    "transformer": {"model.processor.qk_norm": True, "model.processor.mlp_implementation": "swiglu",
                    "model.processor.mlp_ratio": 2.75, "model.latent_skip": True, "model.decoder_embedding": True,
                    "model.encoder": {"num_heads": 2, "mlp_ratio": 2.5, "qk_norm": True, "mlp_implementation": "geglu"},
                    "model.decoder": {"num_heads": 2, "mlp_ratio": 1.0, "mlp_implementation": "glu"}},
    "graphtransformer": {"model.name": "graphtransformer", "model.processor.qk_norm": True,
                         "model.processor.mlp_implementation": "reglu", "model.processor.mlp_ratio": 1.5,
                         "model.encoder": {"num_heads": 2, "qk_norm": True, "mlp_implementation": "swiglu"},
                         "model.decoder": {"num_heads": 2, "qk_norm": True}},
}


def _perturbed(bundle: Path, seed: int = 0) -> None:
    """Every weight of ``bundle`` changed (norm weights away from 1, biases away from 0; lin_qkv's biases too)."""
    g = torch.Generator().manual_seed(seed)
    weights = {n: w + (0.2 if w.dim() == 1 else 0.05) * torch.randn(w.shape, generator=g)
               for n, w in load_file(str(bundle / "model.safetensors")).items()}
    save_file(weights, str(bundle / "model.safetensors"))


def _anemoi_predicts(ckpt: Path, x: Path, tmp_path: Path) -> np.ndarray:
    run = run_in_anemoi(str(FIXTURES / "anemoi_predict.py"), str(ckpt), str(x), str(tmp_path / "y.npy"),
                        str(tmp_path / "meta.json"))
    assert run.returncode == 0, run.stderr[-3000:]
    return np.load(tmp_path / "y.npy")


@needs_anemoi
@pytest.mark.parametrize("name", list(MODELS))
def test_export_of_a_stormshard_model_with_the_options_predicts_in_anemoi(name, tmp_path):
    """A stormshard-trained model with qk_norm and gated MLPs (every weight then changed) exports by building
    anemoi's model; anemoi's predict_step equals stormshard's predict, and the file imports back to the same options
    and predictions."""
    dataset = tmp_path / "o8.zarr"
    generate_synthetic_dataset(dataset, grid="o8", steps=64, seed=1)
    cfg = tiny_config(str(dataset), tmp_path / "run", **{"data.validation_samples": 2, "training.max_steps": 2,
                                                         **MODELS[name]})
    train_losses(0, 1, cfg)
    bundle = export_bundle(tmp_path / "run" / "checkpoints", tmp_path / "bundle")
    _perturbed(bundle)
    out = tmp_path / "out.ckpt"
    export = run_in_anemoi("launch/convert_checkpoint.py", "export-anemoi", str(bundle), "--out", str(out))
    assert export.returncode == 0, export.stderr[-3000:]
    if name == "transformer":
        assert "lin_qkv bias folded into layer_norm_attention.bias, lin_q, lin_k" in export.stderr, export.stderr
    model = stormshard.load_model(bundle)
    ds = AnemoiDataset.open(dataset)  # a dataset window and a perturbed copy, (2, multistep, grid, inputs)
    cols = [list(ds.variables).index(n) for n in model.variables.input_names]
    x = torch.from_numpy(np.asarray(ds.data[40:42], dtype=np.float32)[:, cols, 0, :]).permute(0, 2, 1)[None]
    x = torch.cat([x, x + 0.3 * torch.randn(x.shape, generator=torch.Generator().manual_seed(0)) * x.std()])
    np.save(tmp_path / "x.npy", x.numpy())
    ours = model.predict(x).numpy()
    assert _relative_error(ours, _anemoi_predicts(out, tmp_path / "x.npy", tmp_path)) <= 1e-4
    back = stormshard.load_model(import_anemoi(out, tmp_path / "back"))
    for section in ("processor", "encoder", "decoder"):
        mine, read = getattr(model.config, section), getattr(back.config, section)
        assert (read.qk_norm, read.mlp_implementation, read.mlp_ratio) == \
            (mine.qk_norm, mine.mlp_implementation, mine.mlp_ratio), section
    assert _relative_error(back.predict(x).numpy(), ours) <= 1e-4


@needs_anemoi
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_imported_options_export_both_ways(variant, tmp_path):
    """The inference file's import, every weight changed, written back into its anemoi checkpoint (the pickled
    model's q / k norms and gate / value projections; a transformer's trained lin_qkv bias folded); the Lightning
    file's import, built into anemoi's model: anemoi's predict_step equals stormshard's predict, and for the built one
    the original anemoi model's."""
    x = FIXTURES / variant / "input.npy"
    bundle = import_anemoi(FIXTURES / variant / "inference.ckpt", tmp_path / "bundle")
    _perturbed(bundle)
    out = tmp_path / "written.ckpt"
    assert convert_main(["export-anemoi", str(bundle), "--out", str(out)]) == 0
    ours = stormshard.load_model(bundle).predict(torch.from_numpy(np.load(x))).numpy()
    assert _relative_error(ours, _anemoi_predicts(out, x, tmp_path)) <= 1e-4
    built = import_anemoi(FIXTURES / variant / "last.ckpt", tmp_path / "from_last")
    out = tmp_path / "built.ckpt"
    run = run_in_anemoi("launch/convert_checkpoint.py", "export-anemoi", str(built), "--out", str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    assert _relative_error(_anemoi_predicts(out, x, tmp_path), np.load(FIXTURES / variant / "output.npy")) <= 1e-4

