"""Import an anemoi checkpoint as a stormshard inference bundle: an inference checkpoint or a
Lightning ``last.ckpt``, of the anemoi-models 0.19 layout or an older one anemoi's migration rules map.

``import_anemoi(ckpt, out)`` reads the file with :mod:`stormshard.checkpoint.anemoi_pickle` (no
anemoi needed, nothing in the file runs), renames its tensors to the 0.19 inference layout
(:mod:`stormshard.checkpoint.anemoi_layouts`: Lightning state dicts, older layouts), reads the
architecture from the pickled model (or, for Lightning and older files, from the training config in
the metadata: :class:`AnemoiArchitecture`), then builds from it, never rebuilding anything:

- the model config: processor kind (``GraphTransformerProcessor`` -> ``graphtransformer``,
  ``TransformerProcessor`` -> ``transformer``, ``GNNProcessor`` with GNN mappers -> ``gnn`` with anemoi's GNN
  options, :mod:`~stormshard.checkpoint.anemoi_gnn`), channels, layers, heads, MLP ratios, window, the
  trainable node and edge sizes, ``latent_skip``, the decoder's own input embedding
  (``decoder_embedding``), the output boundings (every anemoi-models 0.19 class; ReluBoundings only:
  ``relu_bounded``; any other list: ``bounding``, in order, the normalized kinds' ``norm_min_val`` from the
  pickled buffer, the state dict, or anemoi's formula on the checkpoint's statistics; variables that are not
  outputs skipped as anemoi skips them: :mod:`~stormshard.checkpoint.anemoi_bounding`), ``self_projection``
  (anemoi's ``lin_self``);
- the graph: node coordinates from the model's ``latlons_*`` buffers, edges and edge attributes
  from its graph providers' buffers (a Lightning file: from its ``graph_data``), sorted by
  destination, the order the trainable edge tensors follow; the data nodes' ``area_weight`` is the
  loss weight anemoi-training gave each cell (:mod:`stormshard.checkpoint.anemoi_node_weights`: the
  stored graph's ``area_weight``, normalised as its loss scaler does);
- a truncated residual (anemoi's ``TruncatedConnection``, an AIFS 1.x model's ``A_down`` / ``A_up``):
  ``model.residual: "truncated"`` and its two matrices as the graph's truncation edges
  (:mod:`stormshard.checkpoint.anemoi_truncation`: from the pickled model, or the stored graph's edges; a
  Lightning file of the on-the-fly or file form holds no matrices and is refused naming the fix);
- the variables (dataset order, forcing, diagnostic) from ``data_indices``, and the normaliser
  statistics from ``_norm_mul`` / ``_norm_add`` (anemoi normalises ``x * mul + add``: exactly
  mean-std with ``mean = -add / mul``, ``stdev = 1 / mul``, whatever anemoi's method was);
- the weights, mapped by name (:mod:`stormshard.checkpoint.anemoi_weights`), shape-checked against the model.
- ``finetune_config.json`` (:func:`finetune_config`): a training config that fine-tunes the bundle
  (its graph file, statistics and weights, anemoi's training loss where stormshard has it:
  :mod:`stormshard.checkpoint.anemoi_loss`; ``data.path`` a placeholder the user overrides).

:func:`read_anemoi` does all of it without writing (``training.init_weights`` reads an anemoi
checkpoint with it).

What stormshard's model cannot represent (another mapper or processor kind, several datasets,
a bounding class anemoi-models 0.19 does not have, another residual, an ``emb_nodes_src`` in the decoder,
...) is a :class:`ConversionError`
naming it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from stormshard.checkpoint.anemoi_block_options import block_options, block_prefixes, mlp_hidden
from stormshard.checkpoint.anemoi_bounding import (
    ANEMOI_BOUNDINGS,
    checkpoint_statistics,
    pickled_bounding,
    stormshard_boundings,
)
from stormshard.checkpoint.anemoi_ensemble import (
    anemoi_ensemble_config,
    as_ensemble,
    check_ensemble_fields,
    ensemble_members,
    is_anemoi_ensemble,
)
from stormshard.checkpoint.anemoi_files import check_anemoi_file
from stormshard.checkpoint.anemoi_gnn import GNN_PROCESSOR, gnn_model_sections, gnn_problems
from stormshard.checkpoint.anemoi_layouts import (
    AnemoiArchitecture,
    CanonicalTensors,
    architecture_from_config,
    canonical_tensors,
    dataset_and_hidden_names,
    model_config_json,
)
from stormshard.checkpoint.anemoi_loss import anemoi_training_loss, anemoi_variable_weights
from stormshard.checkpoint.anemoi_node_weights import loss_node_weights
from stormshard.checkpoint.anemoi_pickle import (
    AnemoiCheckpoint,
    open_anemoi_checkpoint,
    stub_class_name,
)
from stormshard.checkpoint.anemoi_truncation import (
    TRUNCATED_RESIDUALS,
    AnemoiTruncation,
    add_truncation_graph,
    read_truncation,
)
from stormshard.checkpoint.anemoi_weight_averaging import stormshard_weight_averaging
from stormshard.checkpoint.anemoi_weights import qkv_names, stormshard_weights
from stormshard.checkpoint.consolidate import atomic_directory, check_output_free, save_safetensors
from stormshard.checkpoint.errors import ConversionError
from stormshard.checkpoint.export import BUNDLE_FORMAT, write_bundle_metadata
from stormshard.graphs.builder import DECODER, ENCODER, PROCESSOR, save_graph
from stormshard.graphs.hetero import HeteroGraph
from stormshard.models.config import MapperConfig, ModelConfig, ProcessorConfig
from stormshard.models.registry import build_model
from stormshard.models.variables import VariableIndex

__all__ = ["import_anemoi", "read_anemoi", "ImportedAnemoi", "finetune_config", "anemoi_model_parts",
           "anemoi_architecture", "anemoi_latlon",
           "TEMPLATE", "FINETUNE_DATA_PLACEHOLDER"]

#: the anemoi checkpoint an imported bundle keeps (``export-anemoi`` writes its weights into it)
TEMPLATE = "anemoi_source.ckpt"

_PROCESSORS = {"GraphTransformerProcessor": "graphtransformer", "TransformerProcessor": "transformer",
               GNN_PROCESSOR: "gnn"}
_UNSUPPORTED_FIX = ("only anemoi-models 0.19 encoder-processor-decoders import: graph-transformer mappers with a "
                    "GraphTransformerProcessor or TransformerProcessor, or anemoi's GNN (GNN mappers and GNNProcessor)")


def _attr(obj: Any, *path: str) -> Any:
    for name in path:
        d = obj.__dict__ if hasattr(obj, "__dict__") else {}
        if name in d:
            obj = d[name]
        elif name in (d.get("_modules") or {}):
            obj = d["_modules"][name]
        elif isinstance(obj, dict) and name in obj:
            obj = obj[name]
        else:
            raise KeyError(".".join(path))
    return obj


def _short(obj: Any) -> str:
    return (stub_class_name(obj) or type(obj).__name__).rsplit(".", 1)[-1]


def _plain(obj: Any) -> Any:
    """An omegaconf container pickled in the model (a stub) as plain lists / dicts / values."""
    name = stub_class_name(obj) or ""
    d = obj.__dict__ if hasattr(obj, "__dict__") else {}
    if name.endswith("ListConfig"):
        return [_plain(v) for v in d.get("_content") or []]
    if name.endswith("DictConfig"):
        return {k: _plain(v) for k, v in (d.get("_content") or {}).items()}
    if name.startswith("omegaconf.nodes."):
        return d.get("_val")
    return obj


def anemoi_latlon(sincos: Tensor) -> Tensor:
    """anemoi's ``latlons_*`` buffer ``[sin lat, sin lon, cos lat, cos lon]`` -> ``(nodes, 2)`` radians."""
    s = sincos.double()
    return torch.stack([torch.atan2(s[:, 0], s[:, 2]), torch.atan2(s[:, 1], s[:, 3])], dim=-1)


def anemoi_model_parts(ckpt: AnemoiCheckpoint) -> dict[str, Any]:
    """The pieces of a pickled anemoi-models 0.19 model the import reads (``KeyError`` naming what is
    missing: another layout, whose architecture the metadata's config then gives)."""
    if ckpt.kind != "inference":
        raise KeyError("model (a Lightning checkpoint holds a state_dict, not a pickled model)")
    model = _attr(ckpt.root, "model")
    parts = {"model": model, "processor": _attr(model, "processor"), "encoder": _attr(model, "encoder"),
             "decoder": _attr(model, "decoder")}
    if _short(parts["encoder"]) != "ModuleDict" or _short(parts["decoder"]) != "ModuleDict":
        raise KeyError("encoder (a ModuleDict of mappers, anemoi-models 0.12+)")
    return parts


def _pickled_architecture(ckpt: AnemoiCheckpoint) -> AnemoiArchitecture:
    parts = anemoi_model_parts(ckpt)
    model, proc = parts["model"], parts["processor"]
    encoders = list(dict(_attr(parts["encoder"], "_modules")).values())
    decoders = list(dict(_attr(parts["decoder"], "_modules")).values())
    block0 = next(iter(dict(_attr(proc, "proc", "_modules")).values()))
    state = model.__dict__
    window, options = 0, ()
    if _short(proc) == "TransformerProcessor":
        attention = _attr(block0, "attention").__dict__
        heads = int(attention["num_heads"])
        w = attention.get("window_size")
        window = int(w[0] if isinstance(w, (tuple, list)) else w or 0)
        options = tuple(k for k in ("use_alibi_slopes", "use_rotary_embeddings", "softcap") if attention.get(k))
    elif _short(proc) == "GraphTransformerProcessor":
        heads = int(block0.__dict__["num_heads"])  # KeyError for a chunked (older) processor
    else:
        heads = 0
    per_dataset = dict(_attr(model, "boundings", "_modules"))  # one ModuleList per dataset (user-named)
    dataset, _ = dataset_and_hidden_names(ckpt.metadata)
    own = per_dataset.get(dataset, next(iter(per_dataset.values())) if len(per_dataset) == 1 else None)
    boundings = [pickled_bounding(bounding, _short(bounding), _plain)
                 for bounding in ((own.__dict__.get("_modules") or {}) if own is not None else {}).values()]
    residuals = dict((state.get("_modules") or {}).get("residual").__dict__.get("_modules") or {}) \
        if (state.get("_modules") or {}).get("residual") is not None else {}
    residual = _short(next(iter(residuals.values()))) if residuals else "SkipConnection"
    if state.get("A_down") is not None or state.get("A_up") is not None:
        residual = "truncation matrices (A_down / A_up)"
    config = ckpt.metadata.get("config") or {}
    return AnemoiArchitecture(
        source="pickled model", processor=_short(proc), encoders=tuple(_short(e) for e in encoders),
        decoders=tuple(_short(d) for d in decoders), processor_heads=heads,
        encoder_heads=int(_attr(encoders[0], "proc").__dict__.get("num_heads") or 0) if encoders else 0,
        decoder_heads=int(_attr(decoders[0], "proc").__dict__.get("num_heads") or 0) if decoders else 0,
        window_size=window, attention_options=options, latent_skip=bool(state.get("latent_skip", False)),
        boundings=tuple(boundings),
        n_step_input=int(state.get("n_step_input", 0) or (config.get("task") or {}).get("multistep_input") or 1),
        n_step_output=int(state.get("n_step_output", 1) or 1), residual=residual)


def anemoi_architecture(ckpt: AnemoiCheckpoint) -> AnemoiArchitecture:
    """The architecture from the pickled model (0.19 layout), else from the metadata's training config
    (Lightning checkpoints, older pickled layouts)."""
    if ckpt.kind == "inference":
        try:
            return _pickled_architecture(ckpt)
        except (KeyError, StopIteration, AttributeError, TypeError, ValueError):
            pass  # an older pickled layout: the training config in the metadata describes it
    try:
        return architecture_from_config(ckpt.metadata)
    except ConversionError as err:
        raise ConversionError(f"{ckpt.path}: {err}") from None


def _check_kinds(ckpt: AnemoiCheckpoint, arch: AnemoiArchitecture) -> str:
    problems = []
    kind = _PROCESSORS.get(arch.processor)
    if kind is None:
        problems.append(f"processor {arch.processor} (supported: {sorted(_PROCESSORS)})")
    if len(arch.encoders) != 1 or len(arch.decoders) != 1:
        problems.append(f"{len(arch.encoders)} encoders and {len(arch.decoders)} decoders (one dataset only)")
    if kind == "gnn" and arch.encoders and arch.decoders:
        problems += gnn_problems(model_config_json(ckpt.metadata), arch.encoders[0], arch.decoders[0])
    elif arch.encoders and arch.encoders[0] != "GraphTransformerForwardMapper":
        problems.append(f"encoder {arch.encoders[0]} (only GraphTransformerForwardMapper)")
    if kind != "gnn" and arch.decoders and arch.decoders[0] != "GraphTransformerBackwardMapper":
        problems.append(f"decoder {arch.decoders[0]} (only GraphTransformerBackwardMapper)")
    if arch.residual != "SkipConnection" and arch.residual not in TRUNCATED_RESIDUALS:
        problems.append(f"residual {arch.residual} (stormshard's residuals: the last input step, anemoi's "
                        "SkipConnection, and the truncated one, anemoi's TruncatedConnection)")
    problems += [f"output bounding {b.cls} (the kinds: {', '.join(ANEMOI_BOUNDINGS)})" for b in arch.boundings
                 if b.cls not in ANEMOI_BOUNDINGS]
    if arch.n_step_output != 1:
        problems.append(f"n_step_output={arch.n_step_output} (one output step only)")
    if arch.attention_options:
        problems.append(f"transformer attention with {', '.join(arch.attention_options)} (ALiBi / rotary embeddings / "
                        "softcap are not supported)")
    if problems:
        raise ConversionError(f"{ckpt.path}: this anemoi model has no stormshard equivalent (read from its "
                              f"{arch.source}):", problems, fix=_UNSUPPORTED_FIX)
    return str(kind)


def _variables(ckpt: AnemoiCheckpoint) -> tuple[VariableIndex, dict[str, Any]]:
    """Variables and roles from ``data_indices``: metadata 2.0 (one level per dataset) or the older
    single-dataset layout (``data_indices.data.input``; names from ``dataset.variables`` if it has no
    ``name_to_index``)."""
    indices = ckpt.metadata.get("data_indices")
    idx = None
    if isinstance(indices, dict) and isinstance(indices.get("data"), dict) and "input" in indices["data"]:
        idx = indices  # metadata 1.0 / anemoi-models before 0.12: {"data": {"input", "output"}, "model": ...}
    elif isinstance(indices, dict) and len(indices) == 1 and isinstance(next(iter(indices.values())), dict):
        idx = next(iter(indices.values()))
    if not isinstance(idx, dict) or not isinstance(idx.get("data"), dict):
        raise ConversionError(f"{ckpt.path}: the metadata has no data_indices (metadata 1.0 / older layout without "
                              "the variables' indices)",
                              fix="older anemoi layouts need data_indices in the metadata: load and save the "
                                  "checkpoint with anemoi-models' migration tool first")
    data_in, data_out = idx["data"]["input"], idx["data"]["output"]
    name_to_index = data_in.get("name_to_index") or {
        str(n): i for i, n in enumerate((ckpt.metadata.get("dataset") or {}).get("variables") or [])}
    if not name_to_index:
        raise ConversionError(f"{ckpt.path}: data_indices has no name_to_index and the metadata no "
                              "dataset.variables: the variables' names are unknown", fix=_UNSUPPORTED_FIX)
    names = [n for n, _ in sorted(name_to_index.items(), key=lambda kv: kv[1])]
    forcing = [names[i] for i in data_in["forcing"]]
    diagnostic = [names[i] for i in data_out["diagnostic"]]
    variables = VariableIndex.build(names, forcing, diagnostic)
    problems = []
    if list(data_in["full"]) != list(variables.input_idx):
        problems.append(f"input columns {data_in['full']} != dataset order minus diagnostics "
                        f"{list(variables.input_idx)}")
    if list(data_out["full"]) != list(variables.output_idx):
        problems.append(f"output columns {data_out['full']} != dataset order minus forcings "
                        f"{list(variables.output_idx)}")
    if problems:
        raise ConversionError(f"{ckpt.path}: variable layout stormshard cannot represent:", problems,
                              fix="variables must be in dataset order (anemoi's default)")
    return variables, idx


def _graph(ckpt: AnemoiCheckpoint, t: dict[str, Tensor], kind: str,
           truncation: AnemoiTruncation | None) -> tuple[HeteroGraph, str]:
    """The graph (with ``truncation``'s nodes and edges), and where its data nodes' ``area_weight`` (the loss
    weights) came from."""
    g = HeteroGraph()
    latlon = anemoi_latlon(t["model.node_attributes.latlons_data"])
    g["data"].x = latlon.float()
    g["hidden"].x = anemoi_latlon(t["model.node_attributes.latlons_hidden"]).float()
    node_weights = loss_node_weights(ckpt, latlon)  # anemoi-training's node_weights scaler
    g["data"].area_weight = node_weights.weights
    g["hidden"].area_weight = torch.ones(g["hidden"].x.shape[0])  # unused: no loss on hidden nodes
    providers = {ENCODER: "model.encoder_graph_provider.data", DECODER: "model.decoder_graph_provider.data"}
    if kind != "transformer":  # the sliding-window transformer uses no processor edges
        providers[PROCESSOR] = "model.processor_graph_provider"
    for edge_type, prefix in providers.items():
        g[edge_type].edge_index = t[f"{prefix}.edge_index_base"].long()
        g[edge_type].edge_attr = t[f"{prefix}.edge_attr"].float()
    if truncation is not None:
        add_truncation_graph(g, truncation)
    g.config_hash = "anemoi-import"
    g.coverage_edges = {}
    g.validate()
    return g, node_weights.source


def _model_config(ckpt: AnemoiCheckpoint, t: dict[str, Tensor], kind: str, arch: AnemoiArchitecture,
                  truncated: bool, variables: VariableIndex) -> ModelConfig:
    """The stormshard model config: sizes from the (canonical) tensors, the rest from ``arch``."""
    problems = []
    if "model.decoder.0.emb_nodes_src.weight" in t:
        problems.append("decoder emb_nodes_src (processor width != decoder width)")
    relu, bounding = stormshard_boundings(
        arch.boundings, t, str(ckpt.path), variables.output_names,
        checkpoint_statistics(ckpt.root, dataset_and_hidden_names(ckpt.metadata)[0]), variables.variables)

    def edge_size(prefix: str) -> int:
        w = t.get(f"{prefix}.trainable.trainable")
        return 0 if w is None else int(w.shape[1])

    edges = {"processor": edge_size("model.processor_graph_provider"),
             "encoder": edge_size("model.encoder_graph_provider.data"),
             "decoder": edge_size("model.decoder_graph_provider.data")}
    layers = len({int(m[1]) for k in t if (m := re.match(r"^model\.processor\.proc\.(\d+)\.", k))})
    if kind == "gnn":
        fields, more = gnn_model_sections(t, layers)
        problems += more
    else:
        fields = _attention_sections(ckpt, t, kind, arch, layers, problems)
    if problems:
        raise ConversionError(f"{ckpt.path}: this anemoi model has no stormshard equivalent:", problems,
                              fix=_UNSUPPORTED_FIX)
    sections = {name: (ProcessorConfig if name == "processor" else MapperConfig)(
        **fields.pop(name), trainable_edge_size=edges[name]) for name in edges}
    return ModelConfig(
        name=kind, multistep_input=arch.n_step_input,
        trainable_size=int(t["model.node_attributes.trainable_tensors.data.trainable"].shape[1]),
        latent_skip=arch.latent_skip, relu_bounded=relu, bounding=bounding,
        residual="truncated" if truncated else "last_step", **sections, **fields)


def _attention_sections(ckpt: AnemoiCheckpoint, t: dict[str, Tensor], kind: str, arch: AnemoiArchitecture,
                        layers: int, problems: list[str]) -> dict[str, object]:
    """The ModelConfig fields of a graph-transformer or sliding-window-transformer model (``processor`` /
    ``encoder`` / ``decoder`` without their trainable edge sizes; ``qk_norm`` and gated MLPs:
    :mod:`~stormshard.checkpoint.anemoi_block_options`); what does not map is added to ``problems``."""
    c = t["model.encoder.0.emb_nodes_src.weight"].shape[0]
    options = block_options(ckpt, t, kind, problems)

    def mlp_ratio(section: str) -> float:  # hidden / c: stormshard's round(c x ratio) gives the hidden width back
        ratio = mlp_hidden(t, block_prefixes(kind, section)[1]) / c
        return int(ratio) if section == "processor" and ratio == int(ratio) else ratio

    window = ProcessorConfig().window_size if kind == "graphtransformer" else arch.window_size  # graphs: unused
    return {"num_channels": c, "decoder_embedding": True,
            "processor": dict(num_layers=layers, num_heads=arch.processor_heads, mlp_ratio=mlp_ratio("processor"),
                              window_size=window, self_projection=kind == "graphtransformer", **options["processor"]),
            "encoder": dict(num_heads=arch.encoder_heads, mlp_ratio=mlp_ratio("encoder"), self_projection=True,
                            **options["encoder"]),
            "decoder": dict(num_heads=arch.decoder_heads, mlp_ratio=mlp_ratio("decoder"), self_projection=True,
                            **options["decoder"])}


def _statistics(ckpt: AnemoiCheckpoint, t: dict[str, Tensor], variables: VariableIndex) -> dict[str, dict[str, float]]:
    mul = t["pre_processors.data.processors.normalizer._norm_mul"].double()
    add = t["pre_processors.data.processors.normalizer._norm_add"].double()
    if mul.numel() != len(variables.variables) or bool((mul == 0).any()):
        raise ConversionError(f"{ckpt.path}: the normaliser has {mul.numel()} factors for "
                              f"{len(variables.variables)} variables (or a zero factor)", fix=_UNSUPPORTED_FIX)
    mean, std = (-add / mul).tolist(), (1.0 / mul).tolist()
    return {n: {"mean": mean[i], "stdev": std[i], "minimum": mean[i] - std[i], "maximum": mean[i] + std[i]}
            for i, n in enumerate(variables.variables)}


@dataclass(frozen=True)
class ImportedAnemoi:
    """What an anemoi inference checkpoint holds, in stormshard terms (nothing written)."""

    path: Path
    config: ModelConfig
    graph: HeteroGraph
    variables: VariableIndex
    weights: dict[str, Tensor]  # stormshard parameter name -> full tensor
    statistics: dict[str, dict[str, float]]
    metadata: dict[str, Any]  # the bundle's metadata.json


def read_anemoi(source: str | os.PathLike) -> ImportedAnemoi:
    """Read an anemoi checkpoint (inference or Lightning ``last.ckpt``, anemoi-models 0.19 or an older
    layout anemoi's migration rules map; restricted unpickler, nothing runs) and map it onto a
    stormshard model; raises :class:`ConversionError` naming what does not map."""
    check_anemoi_file(source)
    ckpt = open_anemoi_checkpoint(source)
    if is_anemoi_ensemble(ckpt, {}):  # its fields first: what stormshard cannot express, named
        check_ensemble_fields(ckpt)
    canonical = canonical_tensors(ckpt)
    arch = anemoi_architecture(ckpt)
    kind = _check_kinds(ckpt, arch)
    variables, _ = _variables(ckpt)
    t = canonical.tensors
    ensemble = anemoi_ensemble_config(ckpt, t) if is_anemoi_ensemble(ckpt, t) else None  # AIFS-ENS
    try:
        truncation = read_truncation(ckpt, arch, anemoi_latlon(t["model.node_attributes.latlons_data"]))
        config = _model_config(ckpt, t, kind, arch, truncation is not None, variables)
        if ensemble is not None:
            config = as_ensemble(config, ensemble)
        graph, weights_source = _graph(ckpt, t, kind, truncation)
        weights = stormshard_weights(t, config, len(variables.input_names))
    except KeyError as err:  # a tensor of the 0.19 layout is absent: a layout no migration rule maps
        raise ConversionError(
            f"{ckpt.path}: the anemoi model has no {err.args[0]!r} (after anemoi-models' migration rules: "
            f"{'; '.join(canonical.migrations) or 'none applied'}): not a layout stormshard maps "
            f"(metadata {ckpt.metadata.get('version')!r})",
            fix="load and save the checkpoint with anemoi-models 0.19 (its migration tool) first") from None
    target = build_model(config, graph, variables, None, shard_strategy="shard_sequence")
    expected = {k: tuple(v.shape) for k, v in target.state_dict().items()}
    problems = [f"{k}: missing from the mapping" for k in expected if k not in weights]
    problems += [f"{k}: anemoi {tuple(weights[k].shape)} vs stormshard {expected[k]}" for k in expected
                 if k in weights and tuple(weights[k].shape) != expected[k]]
    problems += [f"{k}: mapped but not in the model" for k in weights if k not in expected]
    if problems:
        raise ConversionError(f"{ckpt.path}: the weights do not map onto the stormshard model:", problems,
                              fix=_UNSUPPORTED_FIX)
    config_json = ckpt.metadata.get("config") or {}
    timestep = (config_json.get("task") or {}).get("timestep") or (config_json.get("data") or {}).get("timestep")
    meta = {
        "format": BUNDLE_FORMAT, "version": 1, "step": int((ckpt.metadata.get("training") or {}).get("global_step", 0)),
        "time": time.time(), "source": str(source), "model": config.model_dump(mode="json"),
        "experiment": {"model": config.model_dump(mode="json"), "parallel": {"shard_strategy": "shard_sequence"}},
        "variables": {"dataset": list(variables.variables), "forcing": list(variables.forcing),
                      "diagnostic": list(variables.diagnostic)},
        "normalisation": {"default": "mean-std", "methods": {}},
        "timestep": str(timestep).lower() if timestep else None,
        "dataset": {"path": str((ckpt.metadata.get("dataset") or {}).get("path", "")), "resolution": None},
        "parameters": [{"name": n, "shape": list(w.shape)} for n, w in weights.items()],
        "anemoi": {"run_id": ckpt.metadata.get("run_id"), "uuid": ckpt.metadata.get("uuid"),
                   "metadata_version": ckpt.metadata.get("version"), "checkpoint": ckpt.kind,
                   "migrations": list(canonical.migrations), "architecture_from": arch.source,
                   "loss_node_weights": weights_source, "date_ranges": _date_ranges(ckpt.metadata),
                   "ensemble_members": ensemble_members(ckpt.metadata) if ensemble is not None else None,
                   "training_loss": {**anemoi_training_loss(ckpt.metadata).as_metadata(),
                                     **_variable_weights(ckpt.metadata, variables.output_names)},
                   "truncation": None if truncation is None else {
                       "nodes": truncation.num_nodes, "matrices": truncation.source,
                       "coordinates": truncation.coordinates_source},
                   "weight_averaging": dict(zip(("settings", "note"), stormshard_weight_averaging(config_json),
                                                strict=True)),
                   "template": None if _not_exportable(ckpt, canonical) else TEMPLATE,
                   "not_exportable": _not_exportable(ckpt, canonical)},
    }
    return ImportedAnemoi(ckpt.path, config, graph, variables, weights, _statistics(ckpt, t, variables), meta)


def _variable_weights(metadata: dict[str, Any], output_names: tuple[str, ...]) -> dict[str, Any]:
    """The metadata record of anemoi's per-variable loss weights (:func:`anemoi_variable_weights`)."""
    found = anemoi_variable_weights(metadata, list(output_names))
    return {"loss_scaling": found.loss_scaling(), "scalers": list(found.applied), "scaler_notes": list(found.notes)}


def _not_exportable(ckpt: AnemoiCheckpoint, canonical: CanonicalTensors) -> str | None:
    """Why ``export-anemoi`` cannot write this import back (it writes into the pickled model of an
    anemoi-models 0.19 inference checkpoint), or None."""
    if ckpt.kind != "inference":
        return (f"imported from a Lightning training checkpoint ({ckpt.path.name}), which holds no pickled model: "
                "import the inference-*.ckpt anemoi-training wrote next to it to export back to anemoi")
    if canonical.migrations:
        return ("imported from an older anemoi layout (" + "; ".join(canonical.migrations) + "): export writes "
                "only into anemoi-models 0.19 inference checkpoints; migrate the checkpoint with anemoi-models first")
    return None


def _date_ranges(metadata: dict[str, Any]) -> dict[str, dict[str, str | None]]:
    """The training and validation dates of anemoi's run (``dataloader.<split>[.datasets.<dataset>].start /
    end``), as stormshard's ``data.train`` / ``data.validation``; ``{}`` unless the config has both."""
    loader = (metadata.get("config") or {}).get("dataloader") if isinstance(metadata.get("config"), dict) else None
    dataset, _ = dataset_and_hidden_names(metadata)
    ranges = {}
    for ours, theirs in (("train", "training"), ("validation", "validation")):
        split = (loader or {}).get(theirs) if isinstance(loader, dict) else None
        if isinstance(split, dict) and isinstance(split.get("datasets"), dict):
            split = split["datasets"].get(dataset)
        if not isinstance(split, dict) or not ({"start", "end"} & set(split)):
            return {}
        ranges[ours] = {k: None if split.get(k) is None else str(split[k]) for k in ("start", "end")}
    return ranges


def finetune_config(imported: ImportedAnemoi, bundle: str | os.PathLike) -> dict[str, Any]:
    """A complete training config (``launch/train.py --config``) that fine-tunes the bundle at
    ``bundle``: its model, its graph file (never rebuilt), its statistics and variables, starting from
    its weights, on the training and validation dates of anemoi's run (when the checkpoint's config
    has them); ``data.path`` is a placeholder the user overrides. A transformer's ``lin_qkv`` biases
    (anemoi's q/k/v have none) are frozen at zero, so the result exports back to anemoi."""
    b = Path(bundle).resolve()
    v, config = imported.variables, imported.config
    freeze = [name for name, _ in qkv_names(config)]
    loss = (imported.metadata.get("anemoi") or {}).get("training_loss") or {}
    return {
        "name": f"finetune-{b.name}",
        "model": config.model_dump(mode="json"),
        "data": {"path": FINETUNE_DATA_PLACEHOLDER, "forcing": list(v.forcing), "diagnostic": list(v.diagnostic),
                 "timestep": imported.metadata.get("timestep"), "graph_file": str(b / "graph.pt"),
                 "statistics": str(b / "statistics.json"),
                 **(imported.metadata.get("anemoi") or {}).get("date_ranges", {})},
        "parallel": {"gpus_per_model": 1, "shard_strategy": "shard_sequence",
                     **({"ensemble_size_per_device": imported.metadata["anemoi"]["ensemble_members"]}
                        if config.name == "ensemble" else {})},
        "training": {"max_steps": 1000, "lr": 1e-4, "lr_min": 1e-6, "warmup_steps": 100,
                     "output_dir": f"runs/finetune-{b.name}", "init_weights": str(b),
                     "freeze": [f"{name}.bias" for name in freeze],
                     **{k: loss[k] for k in ("loss", "huber_delta", "loss_scaling", "crps_alpha")
                        if loss.get(k) is not None},
                     "weight_averaging": ((imported.metadata.get("anemoi") or {}).get("weight_averaging")
                                          or {}).get("settings")},
    }


#: ``data.path`` of a ``finetune_config.json``: the user points it at an anemoi dataset
FINETUNE_DATA_PLACEHOLDER = "SET-ME/anemoi-dataset.zarr"


def import_anemoi(source: str | os.PathLike, out: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """Write a stormshard bundle (``load_model(out)``) from an anemoi checkpoint (inference or Lightning
    ``last.ckpt``), with a ``finetune_config.json`` (:func:`finetune_config`). Only a bundle imported
    from an anemoi-models 0.19 inference checkpoint keeps it (``anemoi_source.ckpt``) for export."""
    check_output_free(out, overwrite)  # before the anemoi file is read
    imported = read_anemoi(source)
    meta = imported.metadata
    loss = meta["anemoi"]["training_loss"]
    for note in [loss["note"], *loss["scaler_notes"], (meta["anemoi"].get("weight_averaging") or {}).get("note")]:
        if note:
            warnings.warn(f"{imported.path}: {note}", stacklevel=2)
    with atomic_directory(out, overwrite) as tmp:
        save_safetensors(imported.weights, tmp / "model.safetensors", {"step": str(meta["step"])})
        (tmp / "statistics.json").write_text(json.dumps(imported.statistics, indent=1))
        save_graph(imported.graph, tmp / "graph.pt")
        (tmp / "finetune_config.json").write_text(json.dumps(finetune_config(imported, out), indent=1) + "\n")
        if meta["anemoi"]["template"]:  # for export-anemoi (read with the restricted unpickler)
            shutil.copyfile(imported.path, tmp / TEMPLATE)
        write_bundle_metadata(tmp, meta, ("model.safetensors", "statistics.json", "graph.pt", TEMPLATE))
    return Path(out)
