"""anemoi's ensemble model (anemoi-models' ``AnemoiEnsModelEncProcDec``, AIFS-ENS) through ``import-anemoi``.

Fixture written by anemoi-training 0.17.1 itself (``tests/fixtures/anemoi/make_ens_fixtures.py``, config
``configs/fixture_ens.yaml``): a 2-step ``EnsembleTraining`` run (2 members) of a tiny sliding-window transformer with
anemoi's ``NoiseConditioning`` (noise MLP 4 -> 8 -> 4, the processor's ``ConditionalLayerNorm`` s), ``qk_norm``, the
fcstep input, latent skip, trainable node and edge tensors, a ReLU bounding; ``reference.npz``: anemoi's
``predict_step`` at fcstep 0 and 1 with the noise it drew (hooked); ``first_loss.json`` / ``first_loss_noise.npy``:
anemoi-training's first CRPS loss of ``last.ckpt``'s weights on one window, and its members' noise. No anemoi needed.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import stormshard
from stormshard.checkpoint.anemoi_crps_loss import single_scale_loss
from stormshard.checkpoint.anemoi_export import export_anemoi
from stormshard.checkpoint.anemoi_import import import_anemoi
from stormshard.checkpoint.anemoi_loss import anemoi_training_loss
from stormshard.checkpoint.anemoi_plan import check_exportable
from stormshard.checkpoint.errors import ConversionError
from stormshard.models.config import ModelConfig
from stormshard.models.ensemble import EnsembleEncoderProcessorDecoder
from stormshard.models.rollout import forecast_step_flag
from stormshard.training.config import load_experiment_config
from stormshard.training.launch import run_training
from stormshard.training.losses import almost_fair_crps
from tests.anemoi_repickle import rewrite_metadata
from tests.anemoi_runner import run_in_anemoi_env
from tests.test_anemoi_end_to_end import _first_loss, dataset  # noqa: F401 (a fixture)
from tests.test_anemoi_export import needs_anemoi

FIXTURES = Path(__file__).parent / "fixtures" / "anemoi"
ENS = FIXTURES / "ens"


def _relative_error(got: np.ndarray, expected: np.ndarray) -> float:
    """The largest error of any output variable over that variable's spread."""
    spread = expected.reshape(-1, expected.shape[-1]).std(axis=0)
    return float((np.abs(got - expected).reshape(-1, expected.shape[-1]).max(axis=0) / spread).max())


def test_import_predicts_what_anemoi_predicts(tmp_path):
    """Both files import to the same options and weights; with anemoi's noise, ``predict`` equals anemoi's
    ``predict_step`` at fcstep 0 and 1 within 1e-5 of each output's spread (measured 6.0e-6 / 5.9e-6); the other
    step (1.6 of the spread off) or the other draw's noise (0.13 off) is far off, so the fcstep channel and the noise
    path are exercised."""
    ref = np.load(ENS / "reference.npz")
    x = torch.from_numpy(ref["input"])
    weights = {}
    for source in ("inference.ckpt", "last.ckpt"):
        bundle = import_anemoi(ENS / source, tmp_path / source)
        model = stormshard.load_model(bundle)
        e = model.config.ensemble
        assert model.config.name == "ensemble" and model.config.latent_skip and model.config.processor.qk_norm
        assert (e.noise_embedding, e.noise_channels, e.noise_mlp_hidden, e.noise_std) == ("anemoi", 4, 8, 1.0)
        assert e.fcstep_input and not e.condition_on_residual
        for step in (0, 1):
            noise = torch.from_numpy(ref[f"noise_fcstep{step}"])
            expected = ref[f"output_fcstep{step}"]
            assert _relative_error(model.predict(x, noise, step=step).numpy(), expected) <= 1e-5, (source, step)
            other_step = _relative_error(model.predict(x, noise, step=1 - step).numpy(), expected)
            other_noise = _relative_error(model.predict(x, torch.from_numpy(ref[f"noise_fcstep{1 - step}"]),
                                                        step=step).numpy(), expected)
            assert other_step > 0.5 and other_noise > 0.05, (other_step, other_noise)
        weights[source] = load_file(str(bundle / "model.safetensors"))
    assert weights["inference.ckpt"].keys() == weights["last.ckpt"].keys()
    assert all(torch.equal(w, weights["last.ckpt"][k]) for k, w in weights["inference.ckpt"].items())


def test_crps_loss_imports_as_crps_alpha(tmp_path):
    """anemoi-training 0.17's packaged ensemble loss (CRPS alpha 0.95 in a one-scale MultiscaleLossWrapper) becomes
    ``training.crps_alpha``; the older AlmostFairKernelCRPS (alpha) and KernelCRPS (fair) too; anything else keeps
    the default alpha with a warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bundle = import_anemoi(ENS / "last.ckpt", tmp_path / "bundle")
    finetune = json.loads((bundle / "finetune_config.json").read_text())
    assert finetune["training"]["crps_alpha"] == 0.95 and "loss" not in finetune["training"]
    assert finetune["parallel"]["ensemble_size_per_device"] == 2
    config = load_experiment_config({**finetune, "data": {**finetune["data"], "path": str(tmp_path)}})
    assert config.model.name == "ensemble" and config.training.crps_alpha == 0.95
    meta = json.loads((bundle / "metadata.json").read_text())["anemoi"]["training_loss"]
    assert meta["anemoi"] == "anemoi.training.losses.CRPS" and meta["note"] is None  # the one scale unwrapped

    def loss_of(loss: dict) -> dict:
        return {"config": {"model": {"model": {"_target_": "anemoi.models.models.AnemoiEnsModelEncProcDec"}},
                           "training": {"training_loss": {"datasets": {"data": loss}}}}}

    cases = [({"_target_": "anemoi.training.losses.CRPS", "alpha": 0.9}, 0.9),
             ({"_target_": "anemoi.training.losses.CRPS"}, 0.95),
             ({"_target_": "anemoi.training.losses.kcrps.AlmostFairKernelCRPS", "alpha": 0.7}, 0.7),
             ({"_target_": "anemoi.training.losses.kcrps.AlmostFairKernelCRPS"}, 1.0),
             ({"_target_": "anemoi.training.losses.kcrps.KernelCRPS", "fair": False}, 0.0),
             ({"_target_": "anemoi.training.losses.kcrps.KernelCRPS"}, 1.0)]
    for loss, alpha in cases:
        found = anemoi_training_loss(loss_of(loss))
        assert found.crps_alpha == alpha and found.note is None, (loss, found)
    for loss in ({"_target_": "anemoi.training.losses.MSELoss"}, {"_target_": "anemoi.training.losses.CRPS",
                                                                  "alpha": 1.5},
                 {"_target_": "anemoi.training.losses.MultiscaleLossWrapper", "weights": [0.5, 0.5],
                  "per_scale_loss": {"_target_": "anemoi.training.losses.CRPS"}}):
        found = anemoi_training_loss(loss_of(loss))
        assert found.crps_alpha == 0.95 and found.note, (loss, found)
    wrapped = {"_target_": "x.MultiscaleLossWrapper", "weights": [1.0], "multiscale_config": None,
               "per_scale_loss": {"_target_": "x.CRPS", "scalers": ["node_weights"]}}
    assert single_scale_loss(wrapped) == wrapped["per_scale_loss"]


def _anemoi_kernel_crps(members: np.ndarray, truth: np.ndarray, alpha: float) -> np.ndarray:
    """anemoi-training's kernel CRPS written from its docstring: the mean absolute error of the members minus
    ``(alpha / (m (m - 1)) + (1 - alpha) / m^2)`` times the sum of |x_i - x_j| over unordered pairs.
    members ``(m, n)``, truth ``(n,)``."""
    m = members.shape[0]
    skill = np.abs(members - truth).mean(axis=0)
    pairs = sum(np.abs(members[i] - members[j]) for i in range(m) for j in range(i + 1, m))
    return skill - (alpha / (m * (m - 1)) + (1 - alpha) / m**2) * pairs


@pytest.mark.parametrize("alpha", [0.0, 0.95, 1.0])
def test_crps_formulas_agree(alpha):
    """stormshard's almost-fair CRPS is anemoi's kernel CRPS at the same alpha (fair at 1, standard at 0)."""
    g = np.random.default_rng(1)
    members, truth = g.normal(size=(4, 50)), g.normal(size=50)
    ours = almost_fair_crps(torch.from_numpy(members)[:, :, None], torch.from_numpy(truth)[:, None], alpha)
    np.testing.assert_allclose(ours[:, 0].numpy(), _anemoi_kernel_crps(members, truth, alpha), rtol=1e-12)


def test_first_finetune_crps_loss_equals_anemoi_trainings(dataset, tmp_path, monkeypatch):  # noqa: F811
    """The imported ``last.ckpt``'s first fine-tuning loss, its 2 members fed the noise anemoi-training's members
    drew, equals anemoi-training's first CRPS loss (alpha 0.95, area weights unit-sum, 2 members) with no constant
    factor: 0.71978670 recorded, the same float32 here; with other noise (the channels reversed) 0.71891797."""
    ref = json.loads((ENS / "first_loss.json").read_text())
    noise = torch.from_numpy(np.load(ENS / "first_loss_noise.npy")).float().reshape(2, -1, 4)  # (members, hidden, 4)
    bundle = import_anemoi(ENS / "last.ckpt", tmp_path / "bundle")
    calls = []

    def anemoi_noise(self, batch, generator=None, dtype=None):  # noqa: ANN001, ANN202 - member j of the draw order
        calls.append(len(calls))
        return noise[(len(calls) - 1) % 2][None].expand(batch, -1, -1).to(dtype or torch.float32)

    monkeypatch.setattr(EnsembleEncoderProcessorDecoder, "sample_noise", anemoi_noise)
    loss = _first_loss(bundle, dataset, tmp_path / "run")
    assert loss == pytest.approx(ref["loss"], rel=1e-6, abs=0), (loss, ref["loss"])
    noise = noise.flip(-1)  # other noise, same weights: off
    other = _first_loss(bundle, dataset, tmp_path / "other")
    assert abs(other / ref["loss"] - 1) > 5e-4, (other, ref["loss"])


def test_training_rollout_passes_the_step(dataset, tmp_path, monkeypatch):  # noqa: F811
    """A 2-step training rollout of the imported bundle calls the model with step 0 then 1 (anemoi's fcstep)."""
    bundle = import_anemoi(ENS / "last.ckpt", tmp_path / "bundle")
    cfg = load_experiment_config(bundle / "finetune_config.json", cli_overrides=[
        f"data.path={dataset}", f"training.output_dir={tmp_path / 'run'}", "training.max_steps=1",
        "training.warmup_steps=0", "training.rollout=2", "data.train.start=2020-01-03T00",
        "data.train.end=2020-01-03T18", "data.validation.start=2020-01-04T00", "data.validation_samples=1",
        "data.num_workers=0", "logging.progress=false", "engine=local", "training.validation_interval=100"])
    steps = _spy_steps(monkeypatch)
    run_training(cfg)
    assert steps[:2] == [0, 1], steps


def _edit_model(changes: dict):
    def edit(meta: dict) -> None:
        for key, value in changes.items():
            *path, last = key.split(".")
            node = meta["config"]["model"]
            for part in path:
                node = node[part]
            node[last] = value
    return edit


@pytest.mark.parametrize("changes, names", [
    ({"noise_injector._target_": "anemoi.models.layers.ensemble.NoiseInjector"},
     "model.noise_injector._target_='anemoi.models.layers.ensemble.NoiseInjector'"),
    ({"noise_injector.noise_matrix": "o32-to-hidden.npz"}, "model.noise_injector.noise_matrix='o32-to-hidden.npz'"),
    ({"noise_injector.noise_edges_name": ["noise", "to", "hidden"]}, "model.noise_injector.noise_edges_name="),
    ({"noise_injector.layer_kernels.Activation._target_": "torch.nn.SiLU"},
     "model.noise_injector.layer_kernels.Activation='SiLU'"),
    ({"processor._target_": "anemoi.models.layers.processor.GraphTransformerProcessor"},
     "model.processor._target_='anemoi.models.layers.processor.GraphTransformerProcessor'"),
    ({"processor.layer_kernels.LayerNorm._target_": "torch.nn.LayerNorm"}, "model.processor.layer_kernels.LayerNorm="),
    ({"noise_injector.noise_mlp_hidden_dim": 16}, "model.noise_injector.noise_mlp_hidden_dim=16"),
])
def test_what_stormshard_cannot_express_is_refused(tmp_path, changes, names):
    """A clear error naming the anemoi field and its value, before anything is written."""
    src = rewrite_metadata(ENS / "last.ckpt", tmp_path / "last.ckpt", _edit_model(changes))
    with pytest.raises(ConversionError, match="no stormshard equivalent") as err:
        import_anemoi(src, tmp_path / "bundle")
    assert names in str(err.value) and "TransformerProcessor" in str(err.value), str(err.value)
    assert not (tmp_path / "bundle").exists()


def _forecast(rank: int, world: int, bundle: str, store: str, out: str, k: int) -> list[str]:
    from stormshard.inference.forecast import run_forecast

    result = run_forecast(bundle, store, ["2020-01-03T00"], 2, out, precision="fp64", verbose=False,
                          gpus_per_model=k, verify=False, members=2)
    return [str(s) for s in result.stores]


def _spy_steps(monkeypatch) -> list[int]:  # noqa: ANN001 - pytest's monkeypatch
    """The ``step`` of every call of the ensemble model from now on."""
    steps: list[int] = []
    forward = EnsembleEncoderProcessorDecoder.forward

    def spy(self, x, noise=None, step=0):  # noqa: ANN001, ANN202
        steps.append(step)
        return forward(self, x, noise, step=step)

    monkeypatch.setattr(EnsembleEncoderProcessorDecoder, "forward", spy)
    return steps


def test_imported_ensemble_forecasts_sharded_as_one_process(tmp_path, monkeypatch):
    """``launch/forecast.py`` of the imported ensemble (2 members, 2 steps: the model gets step 0 then 1, fcstep 0
    then 1) at gpus_per_model 2 equals one process (fp64)."""
    from stormshard.data.anemoi_layout import AnemoiDataset
    from stormshard.data.synthetic import generate_synthetic_dataset
    from tests.distributed import run_distributed

    bundle = import_anemoi(ENS / "inference.ckpt", tmp_path / "bundle")
    store = tmp_path / "o16.zarr"
    generate_synthetic_dataset(store, grid="o16", steps=16, seed=3)
    steps = _spy_steps(monkeypatch)
    one = _forecast(0, 1, str(bundle), str(store), str(tmp_path / "one"), 1)
    assert steps == [0, 1], steps
    monkeypatch.undo()
    two = run_distributed(_forecast, 2, str(bundle), str(store), str(tmp_path / "two"), 2)[0]
    a, b = (np.asarray(AnemoiDataset.open(s[0]).data[:]) for s in (one, two))
    assert not np.isnan(b).any() and np.abs(a[1:] - a[:1]).max() > 0
    np.testing.assert_allclose(b, a, rtol=1e-9, atol=1e-9)


@needs_anemoi
def test_imported_ensemble_exports_back_into_its_anemoi_checkpoint(tmp_path):
    """import -> change every weight (the lin_qkv biases stay zero: fine-tuning freezes them) -> export-anemoi
    writes them into the anemoi checkpoint; anemoi's own predict_step of that file, its members' noise replaced by
    stormshard's (``anemoi_ens_predict.py``), equals ``predict`` at fcstep 0 and 1 within 1e-5 of the spread
    (measured 5.4e-6 / 6.1e-6; the changed weights move the outputs 0.37 of the spread from the original's)."""
    bundle = import_anemoi(ENS / "inference.ckpt", tmp_path / "bundle")
    g = torch.Generator().manual_seed(0)
    weights = {n: w if n.endswith("lin_qkv.bias") else w + (0.2 if w.dim() == 1 else 0.05) * torch.randn(
        w.shape, generator=g) for n, w in load_file(str(bundle / "model.safetensors")).items()}
    save_file(weights, str(bundle / "model.safetensors"))
    out = export_anemoi(bundle, tmp_path / "out.ckpt")
    ref = np.load(ENS / "reference.npz")
    np.savez(tmp_path / "in.npz", **{k: ref[k] for k in ("input", "noise_fcstep0", "noise_fcstep1")})
    run = run_in_anemoi_env([str(FIXTURES / "anemoi_ens_predict.py"), str(out), str(tmp_path / "in.npz"),
                             str(tmp_path / "out.npz")], env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    theirs, model = np.load(tmp_path / "out.npz"), stormshard.load_model(bundle)
    for step in (0, 1):
        ours = model.predict(torch.from_numpy(ref["input"]), torch.from_numpy(ref[f"noise_fcstep{step}"]),
                             step=step).numpy()
        assert _relative_error(ours, theirs[f"output_fcstep{step}"]) <= 1e-5, step
        assert _relative_error(ours, ref[f"output_fcstep{step}"]) > 0.05  # the weights did change


def test_export_of_an_ensemble_without_an_anemoi_checkpoint_is_refused(tmp_path):
    """An imported bundle that lost its anemoi checkpoint is refused naming the file; an ensemble without the anemoi
    options is refused naming the option (before anemoi is needed)."""
    bundle = import_anemoi(ENS / "inference.ckpt", tmp_path / "bundle")
    (bundle / "anemoi_source.ckpt").unlink()
    with pytest.raises(ConversionError) as err:
        export_anemoi(bundle, tmp_path / "out.ckpt")
    assert "anemoi_source.ckpt" in str(err.value) and not (tmp_path / "out.ckpt").exists()
    with pytest.raises(ConversionError, match="model.ensemble.noise_embedding='mlp' has no anemoi equivalent"):
        check_exportable(ModelConfig(name="ensemble"), tmp_path / "run")


def test_ensemble_options_are_off_by_default_and_validated():
    """The anemoi options change nothing unless set; bad combinations are errors naming the field and the fix."""
    e = ModelConfig(name="ensemble").ensemble
    assert (e.noise_embedding, e.noise_mlp_hidden, e.fcstep_input, e.condition_on_residual) == ("mlp", None, False,
                                                                                                 False)
    with pytest.raises(ValueError, match="noise_embedding='anemoi' needs model.ensemble.noise_mlp_hidden"):
        ModelConfig(name="ensemble", ensemble={"noise_embedding": "anemoi"})
    with pytest.raises(ValueError, match="noise_mlp_hidden=8 is set but noise_embedding='mlp'"):
        ModelConfig(name="ensemble", ensemble={"noise_mlp_hidden": 8})
    assert [forecast_step_flag(k) for k in range(3)] == [0, 1, 1]
    with pytest.raises(ValueError, match="step=-1"):
        forecast_step_flag(-1)


@needs_anemoi
def test_export_of_a_stormshard_ensemble_builds_anemois_ensemble_model(tmp_path):
    """A stormshard-trained ensemble with the anemoi options (noise MLP, fcstep, latent skip, decoder embedding,
    qk_norm; lin_qkv biases then zero: a conditional norm takes no folded query bias), every other weight changed,
    exports by building anemoi's
    AnemoiEnsModelEncProcDec: its predict_step with stormshard's noise equals ``predict`` at fcstep 0 and 1 (within
    1e-5 of the spread), and the file imports back to the same options and predictions. Without the options it is
    refused, naming the field."""
    from stormshard.checkpoint.export import export_bundle
    from stormshard.data.synthetic import generate_synthetic_dataset
    from tests.test_anemoi_options import run_in_anemoi
    from tests.tiny_run import tiny_config, train_losses

    store = tmp_path / "o8.zarr"
    generate_synthetic_dataset(store, grid="o8", steps=64, seed=1)
    ensemble = {"noise_channels": 3, "noise_embedding": "anemoi", "noise_mlp_hidden": 6, "fcstep_input": True}
    cfg = tiny_config(str(store), tmp_path / "run", **{
        "data.validation_samples": 2, "training.max_steps": 2, "model.name": "ensemble", "model.ensemble": ensemble,
        "model.latent_skip": True, "model.decoder_embedding": True, "model.processor.qk_norm": True,
        "parallel.ensemble_size_per_device": 2, "training.crps_alpha": 0.9})
    train_losses(0, 1, cfg)
    bundle = export_bundle(tmp_path / "run" / "checkpoints", tmp_path / "bundle")
    g = torch.Generator().manual_seed(0)
    weights = {n: torch.zeros_like(w) if n.endswith("lin_qkv.bias") else w + (0.2 if w.dim() == 1 else 0.05) *
               torch.randn(w.shape, generator=g) for n, w in load_file(str(bundle / "model.safetensors")).items()}
    save_file(weights, str(bundle / "model.safetensors"))
    out = tmp_path / "out.ckpt"
    export = run_in_anemoi("launch/convert_checkpoint.py", "export-anemoi", str(bundle), "--out", str(out))
    assert export.returncode == 0, export.stderr[-3000:]
    model = stormshard.load_model(bundle)
    x = torch.randn(2, 2, model.graph["data"].num_nodes, len(model.variables.input_names), generator=g)
    x = model.normaliser.denormalise(x.double()).float()
    noise = {f"noise_fcstep{k}": torch.randn(2, model.graph["hidden"].num_nodes, 3, generator=g) for k in (0, 1)}
    np.savez(tmp_path / "in.npz", input=x.numpy(), **{k: v.numpy() for k, v in noise.items()})
    run = run_in_anemoi_env([str(FIXTURES / "anemoi_ens_predict.py"), str(out), str(tmp_path / "in.npz"),
                             str(tmp_path / "out.npz")], env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    theirs = np.load(tmp_path / "out.npz")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the loss reads back: CRPS at the run's crps_alpha
        back_bundle = import_anemoi(out, tmp_path / "back")
    assert json.loads((back_bundle / "finetune_config.json").read_text())["training"]["crps_alpha"] == 0.9
    back = stormshard.load_model(back_bundle)
    assert back.config.ensemble == model.config.ensemble and back.config.latent_skip
    for step in (0, 1):
        ours = model.predict(x, noise[f"noise_fcstep{step}"], step=step).numpy()
        assert _relative_error(ours, theirs[f"output_fcstep{step}"]) <= 1e-5, step
        assert _relative_error(back.predict(x, noise[f"noise_fcstep{step}"], step=step).numpy(), ours) <= 1e-5
    for change, field in (({"noise_embedding": "mlp", "noise_mlp_hidden": None}, "noise_embedding='mlp'"),
                          ({"fcstep_input": False}, "fcstep_input=False"),
                          ({"condition_on_residual": True}, "condition_on_residual=True")):
        config = ModelConfig(name="ensemble", ensemble={**ensemble, **change})
        with pytest.raises(ConversionError, match=f"model.ensemble.{field}"):
            check_exportable(config, tmp_path / "run")
