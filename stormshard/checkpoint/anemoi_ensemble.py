"""anemoi's ensemble model (anemoi-models' ``AnemoiEnsModelEncProcDec``, AIFS-ENS) as stormshard's ``ensemble`` model.

Read (the import), from the checkpoint's training config (``config.model``, in the inference and the Lightning
file alike) and its tensors:

- the model class (``model.model._target_``, or the pickled model's class): an ensemble model gets
  ``name: "ensemble"`` with ``ensemble.fcstep_input`` (anemoi always appends the forecast step ``min(1, step)`` to
  the data-node inputs) and ``condition_on_residual`` (``model.condition_on_residual``: the residual's prognostic
  variables appended after it);
- the noise injector: ``NoiseConditioning`` -> ``noise_embedding: "anemoi"`` (its ``noise_mlp``: Linear
  ``noise_channels_dim -> noise_mlp_hidden_dim``, the activation, Linear back, LayerNorm; the processor's
  ``ConditionalLayerNorm`` s read that as the condition), ``noise_std``, ``noise_channels_dim``,
  ``noise_mlp_hidden_dim`` (checked against the tensors);
- the processor blocks' ``ConditionalLayerNorm`` ``scale`` / ``bias`` Linears -> one ``scale_shift`` Linear
  (rows ``[scale; bias]``: the same ``norm(x) * (1 + scale(c)) + shift(c)``).

What stormshard's ensemble model cannot express is a :class:`ConversionError` naming the field and its value:
``NoiseInjector`` (noise projected into the latent, no conditional norms) and ``NoOpNoiseInjector``, a noise
projection (``noise_matrix`` / ``noise_edges_name``: noise drawn on another grid), a processor other than the
sliding-window ``TransformerProcessor``, a noise-MLP activation other than exact GELU, processor norms other than
``ConditionalLayerNorm`` conditioned on the noise channels, conditional norms in the mappers.

Written (the export, :mod:`stormshard.checkpoint.anemoi_plan`): the same mapping back
(:func:`ensemble_model_section`, :func:`ensemble_anemoi_weights`) for an ``ensemble`` model with the anemoi options
(:func:`check_ensemble_exportable` names what anemoi's model lacks).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from stormshard.checkpoint.anemoi_layouts import model_config_json
from stormshard.checkpoint.anemoi_pickle import AnemoiCheckpoint, stub_class_name
from stormshard.checkpoint.errors import ConversionError
from stormshard.models.config import EnsembleConfig, ModelConfig

__all__ = ["ENSEMBLE_MODEL", "is_anemoi_ensemble", "ensemble_members", "check_ensemble_fields",
           "check_ensemble_exportable", "ensemble_model_section", "anemoi_ensemble_config", "as_ensemble", "ensemble_weight_pairs",
           "ensemble_stormshard_weights", "ensemble_anemoi_weights"]

#: anemoi-models' ensemble model class
ENSEMBLE_MODEL = "AnemoiEnsModelEncProcDec"
_FIX = ("stormshard imports anemoi's ensemble model with a sliding-window TransformerProcessor whose "
        "ConditionalLayerNorms read anemoi's NoiseConditioning on the hidden grid (anemoi-training's transformer_ens "
        "config); retrain with those settings, or import a deterministic model")


def _short(name: Any) -> str:
    return str(name or "").rsplit(".", 1)[-1]


def _pickled_model_class(ckpt: AnemoiCheckpoint) -> str:
    if ckpt.kind != "inference":
        return ""
    model = (getattr(ckpt.root, "__dict__", {}).get("_modules") or {}).get("model")
    return _short(stub_class_name(model)) if model is not None else ""


def is_anemoi_ensemble(ckpt: AnemoiCheckpoint, t: dict[str, Tensor]) -> bool:
    """True for anemoi's ensemble model: its class in the config or the pickle, or noise-injector tensors."""
    inner = model_config_json(ckpt.metadata).get("model")
    target = _short(inner.get("_target_")) if isinstance(inner, dict) else ""
    return ENSEMBLE_MODEL in (target, _pickled_model_class(ckpt)) or any(k.startswith("model.noise_injector.")
                                                                          for k in t)


def _kernel(section: Any, name: str) -> str:
    """The class a ``layer_kernels`` entry names (``""``: none given)."""
    kernels = section.get("layer_kernels") if isinstance(section, dict) else None
    entry = kernels.get(name) if isinstance(kernels, dict) else None
    return _short(entry.get("_target_")) if isinstance(entry, dict) else ""


def _problems(model: dict[str, Any], noise: dict[str, Any]) -> list[str]:
    """What the config's ensemble fields ask that stormshard's ensemble model cannot compute."""
    problems = []
    injector = _short(noise.get("_target_"))
    if injector != "NoiseConditioning":
        problems.append(f"model.noise_injector._target_={noise.get('_target_')!r}: stormshard's ensemble conditions "
                        "the processor's norms on the noise (anemoi's NoiseConditioning); NoiseInjector / "
                        "NoOpNoiseInjector have no equivalent")
    for field in ("noise_matrix", "noise_edges_name"):
        if noise.get(field) is not None:
            problems.append(f"model.noise_injector.{field}={noise[field]!r}: noise drawn on another grid and "
                            "projected to the hidden grid is not supported (set it to null: noise on the hidden grid)")
    activation = _kernel(noise, "Activation") or "GELU"
    if activation != "GELU" or (noise.get("layer_kernels") or {}).get("Activation", {}).get("approximate",
                                                                                            "none") != "none":
        problems.append(f"model.noise_injector.layer_kernels.Activation={activation!r}: the noise MLP's activation "
                        "must be torch.nn.GELU (exact)")
    for kernel in ("Linear", "LayerNorm"):
        got = _kernel(noise, kernel)
        if got not in ("", kernel, f"Autocast{kernel}"):
            problems.append(f"model.noise_injector.layer_kernels.{kernel}={got!r}: must be torch's {kernel}")
    processor = model.get("processor") if isinstance(model.get("processor"), dict) else {}
    if _short(processor.get("_target_")) not in ("", "TransformerProcessor"):
        problems.append(f"model.processor._target_={processor.get('_target_')!r}: stormshard's ensemble processor "
                        "is the sliding-window transformer (anemoi's TransformerProcessor)")
    norm = processor.get("layer_kernels", {}).get("LayerNorm", {}) if isinstance(processor.get("layer_kernels"),
                                                                                    dict) else {}
    if _short(norm.get("_target_")) not in ("", "ConditionalLayerNorm"):
        problems.append(f"model.processor.layer_kernels.LayerNorm={norm.get('_target_')!r}: the processor's norms "
                        "must be anemoi's ConditionalLayerNorm (conditioned on the noise)")
    channels = noise.get("noise_channels_dim")
    if norm.get("condition_shape") is not None and norm.get("condition_shape") != channels:
        problems.append(f"model.processor.layer_kernels.LayerNorm.condition_shape={norm.get('condition_shape')!r}: "
                        f"must be model.noise_injector.noise_channels_dim ({channels!r})")
    for section in ("encoders", "decoders"):
        for key, block in (model.get(section) or {}).items() if isinstance(model.get(section), dict) else ():
            mapper = block.get("mapper") if isinstance(block, dict) else None
            if _kernel(mapper, "LayerNorm") == "ConditionalLayerNorm":
                problems.append(f"model.{section}.{key}.mapper.layer_kernels.LayerNorm=ConditionalLayerNorm: "
                                "stormshard's mappers take no condition")
    return problems


def _sections(ckpt: AnemoiCheckpoint) -> tuple[dict[str, Any], dict[str, Any]]:
    model = model_config_json(ckpt.metadata)
    return model, model.get("noise_injector") if isinstance(model.get("noise_injector"), dict) else {}


def check_ensemble_fields(ckpt: AnemoiCheckpoint) -> None:
    """A :class:`ConversionError` naming each ensemble field of the config stormshard cannot express (before the
    tensors are read: a graph processor's Lightning file fails on its graph otherwise)."""
    problems = _problems(*_sections(ckpt))
    if problems:
        raise ConversionError(f"{ckpt.path}: this anemoi ensemble model has no stormshard equivalent:", problems,
                              fix=_FIX)


def anemoi_ensemble_config(ckpt: AnemoiCheckpoint, t: dict[str, Tensor]) -> EnsembleConfig:
    """The :class:`EnsembleConfig` of anemoi's ensemble model in ``ckpt`` (canonical tensors ``t``), or a
    :class:`ConversionError` naming each field stormshard cannot express."""
    model, noise = _sections(ckpt)
    problems = _problems(model, noise)
    if "model.processor.proc.0.layer_norm_attention.scale.weight" not in t:
        problems.append("model.processor.proc.0.layer_norm_attention.scale: the processor has no conditional norms")
    first = t.get("model.noise_injector.noise_mlp.mlp.0.weight")
    if first is None and not problems:
        problems.append("model.noise_injector.noise_mlp: the checkpoint holds no noise MLP weights")
    hidden, channels = (int(first.shape[0]), int(first.shape[1])) if first is not None else (0, 0)
    for field, value in (("noise_channels_dim", channels), ("noise_mlp_hidden_dim", hidden)):
        if first is not None and noise.get(field) not in (None, value):
            problems.append(f"model.noise_injector.{field}={noise.get(field)!r} but the noise MLP's weights are "
                            f"{value} wide")
    std = noise.get("noise_std", 1.0)
    if isinstance(std, bool) or not isinstance(std, int | float) or not std > 0:
        problems.append(f"model.noise_injector.noise_std={std!r}: must be a positive number")
    if problems:
        raise ConversionError(f"{ckpt.path}: this anemoi ensemble model has no stormshard equivalent:", problems,
                              fix=_FIX)
    return EnsembleConfig(noise_channels=channels, noise_std=float(std), noise_embedding="anemoi",
                          noise_mlp_hidden=hidden, fcstep_input=True,
                          condition_on_residual=bool(model.get("condition_on_residual", False)))


def as_ensemble(config: ModelConfig, ensemble: EnsembleConfig) -> ModelConfig:
    """The sliding-window ``transformer`` config read from the checkpoint, as the ``ensemble`` model."""
    if config.name != "transformer":
        raise ConversionError(f"model.processor: an ensemble model of kind {config.name!r}: stormshard's ensemble "
                              "processor is the sliding-window transformer", fix=_FIX)
    return ModelConfig(**{**config.model_dump(), "name": "ensemble", "ensemble": ensemble.model_dump()})


def ensemble_weight_pairs(config: ModelConfig) -> list[tuple[str, str]]:
    """(stormshard, anemoi) names of the noise MLP, copied unchanged (``noise_embedding: "anemoi"``)."""
    if config.ensemble is None or config.ensemble.noise_embedding != "anemoi":
        return []
    ours, theirs = "processor.noise_embedding", "model.noise_injector.noise_mlp"
    return [(f"{ours}.{i}.{p}", f"{theirs}.{name}.{p}") for i, name in ((0, "mlp.0"), (2, "mlp.2"), (3, "layer_norm"))
            for p in ("weight", "bias")]


def _norm_names(config: ModelConfig) -> list[tuple[str, str]]:
    """(stormshard ``scale_shift`` prefix, anemoi ``ConditionalLayerNorm`` prefix) of every processor norm."""
    return [(f"processor.blocks.{i}.{ours}.scale_shift", f"model.processor.proc.{i}.{theirs}")
            for i in range(config.processor.num_layers)
            for ours, theirs in (("norm_attention", "layer_norm_attention"), ("norm_mlp", "layer_norm_mlp"))]


def ensemble_stormshard_weights(t: dict[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    """The conditional norms: anemoi's ``scale`` and ``bias`` Linears stacked as ``scale_shift`` (rows
    ``[scale; shift]``); KeyError if absent."""
    return {f"{ours}.{p}": torch.cat([t[f"{theirs}.scale.{p}"], t[f"{theirs}.bias.{p}"]])
            for ours, theirs in _norm_names(config) for p in ("weight", "bias")}


def ensemble_anemoi_weights(weights: dict[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    """The inverse of :func:`ensemble_stormshard_weights`."""
    out = {}
    for ours, theirs in _norm_names(config):
        for p in ("weight", "bias"):
            scale, shift = weights[f"{ours}.{p}"].chunk(2, dim=0)
            out[f"{theirs}.scale.{p}"], out[f"{theirs}.bias.{p}"] = scale, shift
    return out


def ensemble_members(metadata: dict[str, Any]) -> int:
    """Members per initial state of anemoi's run (``training.ensemble_size_per_device`` times the devices of an
    ensemble over the model's: ``num_gpus_per_ensemble / num_gpus_per_model``), at least 2 (the CRPS needs two)."""
    config = metadata.get("config") if isinstance(metadata.get("config"), dict) else {}
    per_device = (config.get("training") or {}).get("ensemble_size_per_device", 2)
    hardware = (config.get("system") or {}).get("hardware") or config.get("hardware") or {}
    per_model = hardware.get("num_gpus_per_model") or 1
    per_ensemble = hardware.get("num_gpus_per_ensemble") or per_model
    members = per_device * max(1, int(per_ensemble) // int(per_model)) if isinstance(per_device, int) else 2
    return max(2, int(members))


def check_ensemble_exportable(config: ModelConfig) -> list[str]:
    """What of an ``ensemble`` model anemoi's ``AnemoiEnsModelEncProcDec`` cannot compute (the export), one line per
    field with its value: its noise embedding must be anemoi's MLP, the fcstep input on (anemoi always reads it),
    ``condition_on_residual`` off (anemoi-models 0.19's forward fails on it)."""
    e, problems = config.ensemble, []
    if e is None:
        return problems
    if e.noise_embedding != "anemoi":
        problems.append(f"model.ensemble.noise_embedding={e.noise_embedding!r} has no anemoi equivalent (anemoi's "
                        "NoiseConditioning MLP: 'anemoi')")
    if not e.fcstep_input:
        problems.append("model.ensemble.fcstep_input=False: anemoi's ensemble model always reads the forecast step")
    if e.condition_on_residual:
        problems.append("model.ensemble.condition_on_residual=True: anemoi-models 0.19's ensemble forward fails on it")
    return problems


def ensemble_model_section(config: ModelConfig) -> dict[str, Any]:
    """The keys of anemoi's ``config.model`` that make the exported model anemoi's ensemble model: the model class,
    ``condition_on_residual``, its ``NoiseConditioning`` (noise on the hidden grid) and the processor's
    ``ConditionalLayerNorm`` kernel (merged into the processor section by the caller)."""
    e = config.ensemble
    if e is None:
        return {}
    return {
        "model": {"_target_": f"anemoi.models.models.{ENSEMBLE_MODEL}", "hidden_nodes_name": "hidden",
                  "latent_skip": config.latent_skip, "_convert_": "none"},
        "condition_on_residual": e.condition_on_residual,
        "noise_injector": {"_target_": "anemoi.models.layers.ensemble.NoiseConditioning", "noise_std": e.noise_std,
                           "noise_channels_dim": e.noise_channels, "noise_mlp_hidden_dim": e.noise_mlp_hidden,
                           "noise_matrix": None, "noise_edges_name": None, "edge_weight_attribute": None,
                           "row_normalize_noise_matrix": False, "autocast": False,
                           "layer_kernels": {"Activation": {"_target_": "torch.nn.GELU"}}},
        "processor_norm": {"_target_": "anemoi.models.layers.normalization.ConditionalLayerNorm",
                           "normalized_shape": config.num_channels, "condition_shape": e.noise_channels,
                           "zero_init": True, "autocast": False},
    }
