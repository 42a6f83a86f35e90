"""What a stormshard model becomes in anemoi, worked out without anemoi: the inverse of the import.

``plan_anemoi_export(source)`` takes a stormshard model (an :class:`ExportSource`: config, graph,
variables, weights, statistics) and returns an :class:`AnemoiExportPlan`: the anemoi training config
(``model`` the inverse of the import's config mapping), the graph as anemoi's ``HeteroData`` holds it,
every anemoi parameter's value, the normaliser, and the checkpoint metadata that does not need anemoi
objects. :mod:`stormshard.checkpoint.anemoi_build` turns the plan into anemoi's model and file.

What maps (stormshard -> anemoi-models 0.19):

- ``name: graphtransformer`` / ``transformer`` -> ``GraphTransformerProcessor`` / ``TransformerProcessor``
  (sliding window ``window_size``, scaled-dot-product attention); graph-transformer mappers both ways;
  ``name: gnn`` with anemoi's GNN options -> ``GNNProcessor``, ``GNNForwardMapper`` / ``GNNBackwardMapper``
  (``mlp_extra_layers`` = ``mlp_hidden_layers - 2``, :mod:`~stormshard.checkpoint.anemoi_gnn`);
  ``name: ensemble`` with anemoi's ensemble options -> ``AnemoiEnsModelEncProcDec`` with ``NoiseConditioning`` and a
  ``TransformerProcessor`` of ``ConditionalLayerNorm`` s (:mod:`~stormshard.checkpoint.anemoi_ensemble`);
- channels, layers, heads, MLP ratios, ``trainable_size`` (``node_trainable_parameters``), trainable edge
  sizes (the graph providers' ``trainable_size``), ``latent_skip``, ``relu_bounded`` (``ReluBounding``) and
  ``bounding`` (anemoi's classes; the normalized kinds' thresholds in physical units for a variable normalised
  with ``mean-std`` or ``std``, which anemoi rebuilds from the exported statistics, checked),
  ``multistep_input``, the residual of the prognostic variables (``residual: last_step`` -> ``SkipConnection``;
  ``truncated`` -> ``TruncatedConnection`` on the exported graph's ``truncation`` nodes and the two edge sets
  ``data -> truncation`` / ``truncation -> data``, their weights as ``gauss_weight``, nothing renormalised:
  anemoi's ``ProjectionGraphProvider`` makes the same two matrices, fp32, duplicate entries summed);
- options anemoi's model always has, given values that make it compute what stormshard's does:
  ``self_projection: false`` -> ``lin_self`` zero; ``decoder_embedding: false`` -> the decoder's
  ``emb_nodes_dst`` a copy of the encoder's ``emb_nodes_src`` (both embed the same data-node inputs);
- a transformer's ``lin_qkv`` bias (anemoi's q/k/v have none), folded exactly (:func:`fold_qkv_bias`):
  the key bias shifts every logit of a query equally (softmax ignores it), the value bias passes through
  the attention weights (they sum to one) into the projection's bias, and the query bias moves into the
  block's ``layer_norm_attention`` bias and ``lin_q`` (a LayerNorm output is ``gamma * n + beta`` with
  ``sum(n) = 0``, so ``lin_q`` may add any ``u (1 / gamma)^T`` without changing its ``n`` part); with ``qk_norm``
  the keys are normed before the logits, so the key bias moves into ``lin_k`` the same way (exactly);
- ``qk_norm`` and ``mlp_implementation`` of each section as anemoi's keys of the same names (anemoi's default
  ``QueryNorm`` / ``KeyNorm``; a gated MLP's ``fc1`` rows split into ``gate_proj`` / ``value_proj``);
- the graph: node coordinates (radians), area weights, edges sorted by destination (stable, as anemoi's
  graph provider sorts them; trainable edge rows permuted alike), edge attributes
  ``[length, east, north]`` named ``edge_length`` and ``edge_dirs`` (any other width: ``edge_attr``).

What does not (a :class:`ConversionError` naming the option and its value, before any work): an
``ensemble`` model without anemoi's ensemble options (:func:`~stormshard.checkpoint.anemoi_ensemble.
check_ensemble_exportable`), custom builders, a ``gnn`` model without anemoi's GNN options
(:func:`~stormshard.checkpoint.anemoi_gnn.check_gnn_exportable`), an MLP width anemoi rounds otherwise.
"""

from __future__ import annotations

import datetime
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from einops import rearrange
from torch import Tensor

from stormshard.checkpoint.anemoi_block_options import anemoi_block_options
from stormshard.checkpoint.anemoi_bounding import anemoi_bounding_config
from stormshard.checkpoint.anemoi_ensemble import check_ensemble_exportable, ensemble_model_section
from stormshard.checkpoint.anemoi_gnn import check_gnn_exportable, gnn_component_configs
from stormshard.checkpoint.anemoi_loss import anemoi_loss_config
from stormshard.checkpoint.anemoi_truncation import EDGE_WEIGHT_ATTRIBUTE, truncation_residual_config
from stormshard.checkpoint.anemoi_weight_averaging import anemoi_weight_averaging
from stormshard.checkpoint.anemoi_weights import anemoi_weights
from stormshard.checkpoint.errors import ConversionError
from stormshard.graphs.builder import DECODER, ENCODER, PROCESSOR, TRUNCATION_DOWN, TRUNCATION_UP
from stormshard.graphs.hetero import HeteroGraph
from stormshard.models.config import ModelConfig
from stormshard.models.variables import VariableIndex

__all__ = ["ExportSource", "AnemoiExportPlan", "plan_anemoi_export", "check_exportable", "anemoi_parameters",
           "fold_qkv_bias", "EXPORTABLE_MODELS"]

#: stormshard model -> anemoi processor
EXPORTABLE_MODELS = {"graphtransformer": "anemoi.models.layers.processor.GraphTransformerProcessor",
                     "transformer": "anemoi.models.layers.processor.TransformerProcessor",
                     "gnn": "anemoi.models.layers.processor.GNNProcessor",
                     "ensemble": "anemoi.models.layers.processor.TransformerProcessor"}
_PROVIDERS = {ENCODER: "model.encoder_graph_provider.data", DECODER: "model.decoder_graph_provider.data",
              PROCESSOR: "model.processor_graph_provider"}
_KERNELS = {"LayerNorm": {"_target_": "torch.nn.LayerNorm"}, "Linear": {"_target_": "torch.nn.Linear"},
            "Activation": {"_target_": "torch.nn.GELU"},
            "QueryNorm": {"_target_": "anemoi.models.layers.normalization.AutocastLayerNorm", "bias": False},
            "KeyNorm": {"_target_": "anemoi.models.layers.normalization.AutocastLayerNorm", "bias": False}}


@dataclass(frozen=True)
class ExportSource:
    """A stormshard model to export: what a bundle holds (``weights``: full tensors by stormshard name;
    ``statistics``: ``mean`` / ``stdev`` / ``minimum`` / ``maximum`` over the dataset variables)."""

    path: Path
    config: ModelConfig
    graph: HeteroGraph
    variables: VariableIndex
    weights: dict[str, Tensor]
    statistics: dict[str, np.ndarray]
    normalisation: dict[str, Any]  # {"default": method, "methods": {variable: method}}
    timestep: str
    step: int
    dataset: dict[str, Any]  # {"path": ..., "resolution": ...}
    training: dict[str, Any] = field(default_factory=dict)  # the run's training section: loss, huber_delta, loss_scaling


@dataclass(frozen=True)
class AnemoiExportPlan:
    """Everything anemoi's model and checkpoint are built from (see the module docstring)."""

    config: dict[str, Any]  # the training config: the interface's ``config`` and metadata["config"]
    nodes: dict[str, dict[str, Any]]  # HeteroData node stores: x (radians), area_weight (truncation: x or num_nodes)
    edges: dict[tuple[str, str, str], dict[str, Tensor]]  # edge stores: edge_index (destination-sorted), attributes
    parameters: dict[str, Tensor]  # anemoi parameter name (on AnemoiModelInterface) -> value
    norm_mul: np.ndarray  # float64 (dataset variables): anemoi's normaliser x * mul + add
    norm_add: np.ndarray
    statistics: dict[str, np.ndarray]
    variables: VariableIndex
    multistep: int
    metadata: dict[str, Any]  # metadata 2.0 without the anemoi-made parts (data_indices, metadata_inference)
    supporting_arrays: dict[str, dict[str, np.ndarray]]
    notes: tuple[str, ...]  # how options anemoi's model lacks were expressed in it


def _fail(source: Path, what: str, fix: str) -> ConversionError:
    return ConversionError(f"{source}: {what}", fix=fix)


def check_exportable(config: ModelConfig, source: Path) -> None:
    """A :class:`ConversionError` naming the first option (and its value) anemoi's model lacks."""
    fix = ("export-anemoi writes graphtransformer, transformer and gnn models (anemoi's GraphTransformerProcessor / "
           "TransformerProcessor / GNNProcessor) and ensemble models with the anemoi options (AnemoiEnsModelEncProcDec:"
           " ensemble.noise_embedding 'anemoi', fcstep_input); export other models as stormshard bundles "
           "(convert_checkpoint.py export)")
    if config.name not in EXPORTABLE_MODELS:
        raise _fail(source, f"model.name={config.name!r} has no anemoi equivalent (a custom model builder; anemoi "
                            f"export maps {sorted(EXPORTABLE_MODELS)})", fix)
    ensemble = check_ensemble_exportable(config)
    if ensemble:
        raise _fail(source, f"model.name='ensemble': {ensemble[0]}", fix)
    c = config.num_channels
    for section in ("encoder", "decoder") + (("processor",) if config.name != "gnn" else ()):
        ratio = getattr(config, section).mlp_ratio
        ours, theirs = max(1, int(round(c * ratio))), int(c * ratio + 0.5)
        if ours != theirs:
            raise _fail(source, f"model.{section}.mlp_ratio={ratio} has no anemoi equivalent: {c} x {ratio} rounds "
                                f"to {ours} MLP channels here and to {theirs} in anemoi (halves round up)",
                        "choose a ratio whose product with num_channels is not a half-integer")
    if config.name == "gnn":
        check_gnn_exportable(config, source)


def _qkv(config: ModelConfig) -> list[tuple[str, str]]:
    """(stormshard block prefix, anemoi block prefix) of every transformer block."""
    if config.name != "transformer":
        return []
    return [(f"processor.processor.blocks.{i}", f"model.processor.proc.{i}") for i in range(config.processor.num_layers)]


def fold_qkv_bias(block: dict[str, Tensor], heads: int, name: str) -> dict[str, Tensor]:
    """An anemoi transformer block's ``layer_norm_attention.bias``, ``attention.lin_q.weight`` and
    ``attention.projection.bias`` that compute what stormshard's block with ``lin_qkv`` bias computes.

    ``block`` holds (float64, anemoi's row order ``(heads d)``): ``gamma``, ``beta`` (the norm),
    ``wq``, ``wk``, ``wv``, ``wo``, ``bo`` and ``bias`` (stormshard's ``lin_qkv`` bias, ``(heads three d)``);
    with ``qk_norm`` also ``qn`` / ``kn`` (the query / key norm weights): the keys then fold exactly too, into
    ``wk``. Exact in exact arithmetic (module docstring); a norm weight too close to zero for the query (or key)
    bias to move into ``lin_q`` is a :class:`ConversionError` naming ``name``.
    """
    gamma, beta, wq, wk, wv, wo, bo = (block[k] for k in ("gamma", "beta", "wq", "wk", "wv", "wo", "bo"))
    bq, bk, bv = rearrange(block["bias"], "(h three d) -> three (h d)", h=heads, three=3).unbind(0)
    exact_keys = "kn" in block  # qk_norm: a key bias changes the normed keys, it must fold into lin_k
    if not bool(bq.any()) and not (exact_keys and bool(bk.any())):
        # no query bias (nor, with qk_norm, a key bias): drop the key bias, move the value bias into the projection
        return {"beta": beta, "wq": wq, "wk": wk, "bo": bo + wo @ bv}
    if float(gamma.abs().min()) < 1e-3 * float(gamma.abs().max()):
        raise ConversionError(f"{name}.norm_attention.weight has an entry of {float(gamma.abs().min()):.3g} (max "
                              f"{float(gamma.abs().max()):.3g}): the lin_qkv query bias cannot be folded into anemoi's "
                              "bias-free lin_q through it",
                              fix="fine-tune with the lin_qkv bias frozen at zero (training.freeze) and export again")
    c = gamma.numel()
    s = float((beta / gamma).sum())
    sign = 1.0 if s >= 0 else -1.0
    shift = sign * gamma  # beta' = beta + shift; sum(shift / gamma) = sign * C keeps the divisor away from 0
    u = (bq - wq @ shift) / (s + sign * c)
    folded = {"beta": beta + shift, "wq": wq + torch.outer(u, 1.0 / gamma), "wk": wk, "bo": bo + wo @ (bv - wv @ shift)}
    if exact_keys:  # the same identity for the keys: lin_k gains u_k (1 / gamma)^T
        folded["wk"] = wk + torch.outer((bk - wk @ shift) / (s + sign * c), 1.0 / gamma)
    return folded


def _check_fold(block: dict[str, Tensor], folded: dict[str, Tensor], heads: int, name: str) -> None:
    """The folded block's attention output equals the original's on random tokens (fp32, full attention)."""
    g = torch.Generator().manual_seed(0)
    c = block["gamma"].numel()
    x = torch.randn(64, c, generator=g, dtype=torch.float64) * 3 + torch.randn(c, generator=g, dtype=torch.float64)

    def attend(beta: Tensor, wq: Tensor, wk: Tensor, bias: Tensor, bo: Tensor) -> Tensor:
        h = torch.nn.functional.layer_norm(x.float(), (c,), block["gamma"].float(), beta.float())
        b = rearrange(bias, "(h three d) -> three (h d)", h=heads, three=3).float()
        q, k, v = (h @ w.float().T + bb for w, bb in zip((wq, wk, block["wv"]), b, strict=True))
        q, k, v = (rearrange(t, "n (h d) -> h n d", h=heads) for t in (q, k, v))
        if "kn" in block:  # qk_norm: per head over d
            d = q.shape[-1]
            q = torch.nn.functional.layer_norm(q, (d,), block["qn"].float())
            k = torch.nn.functional.layer_norm(k, (d,), block["kn"].float())
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return rearrange(out, "h n d -> n (h d)") @ block["wo"].float().T + bo.float()

    ref = attend(block["beta"], block["wq"], block["wk"], block["bias"], block["bo"])
    got = attend(folded["beta"], folded["wq"], folded["wk"], torch.zeros_like(block["bias"]), folded["bo"])
    err = float((got - ref).abs().max() / ref.std().clamp_min(1e-12))
    if not err <= 1e-4:
        raise ConversionError(f"{name}: the lin_qkv bias folded into anemoi's bias-free attention differs by {err:.2g} "
                              "of the output's spread (ill-conditioned norm weights)",
                              fix="fine-tune with the lin_qkv bias frozen at zero (training.freeze) and export again")


def _edge_order(graph: HeteroGraph, edge_type: tuple[str, str, str]) -> Tensor:
    """The permutation that sorts an edge set by destination, stable (anemoi's graph providers' order)."""
    return torch.sort(graph[edge_type].edge_index[1].long(), stable=True).indices


def anemoi_parameters(weights: dict[str, Tensor], config: ModelConfig, n_in: int, graph: HeteroGraph,
                      source: Path) -> tuple[dict[str, Tensor], tuple[str, ...]]:
    """stormshard parameters -> the values of anemoi's parameters (names on ``AnemoiModelInterface``),
    with the options anemoi's model always has filled in and a transformer's ``lin_qkv`` bias folded;
    and notes saying how."""
    w, notes, c = dict(weights), [], config.num_channels
    if not config.decoder_embedding and config.name != "gnn":  # anemoi's GNN decoder embeds nothing
        w["embed_data_decoder.weight"], w["embed_data_decoder.bias"] = w["embed_data.weight"], w["embed_data.bias"]
        notes.append("decoder_embedding: false -> the decoder's emb_nodes_dst is a copy of the encoder's emb_nodes_src")
    blocks = [("encoder", config.encoder.self_projection), ("decoder", config.decoder.self_projection)]
    if config.name == "graphtransformer":
        blocks += [(f"processor.blocks.{i}", config.processor.self_projection)
                   for i in range(config.processor.num_layers)]
    off = [name for name, on in blocks if not on and f"{name}.to_q.weight" in w]
    for name in off:
        w[f"{name}.to_self.weight"], w[f"{name}.to_self.bias"] = torch.zeros(c, c), torch.zeros(c)
    if off:
        notes.append(f"self_projection: false -> lin_self is zero in {', '.join(off)}")
    biases = {ours: w[f"{ours}.attention.lin_qkv.bias"].double() for ours, _ in _qkv(config)}
    for ours in biases:
        w[f"{ours}.attention.lin_qkv.bias"] = torch.zeros_like(biases[ours])
    theirs = {k: v for k, v in anemoi_weights(w, config, n_in).items() if v.numel()}  # trainable size 0: none
    for edge_type, prefix in _PROVIDERS.items():
        name = f"{prefix}.trainable.trainable"
        if name in theirs:
            theirs[name] = theirs[name].index_select(0, _edge_order(graph, edge_type))
    folded = 0
    for ours, anemoi in _qkv(config):
        if not bool(biases[ours].any()):
            continue
        block = {"gamma": theirs[f"{anemoi}.layer_norm_attention.weight"], "beta": theirs[f"{anemoi}.layer_norm_attention.bias"],
                 "wq": theirs[f"{anemoi}.attention.lin_q.weight"], "wk": theirs[f"{anemoi}.attention.lin_k.weight"],
                 "wv": theirs[f"{anemoi}.attention.lin_v.weight"], "wo": theirs[f"{anemoi}.attention.projection.weight"],
                 "bo": theirs[f"{anemoi}.attention.projection.bias"]}
        if config.processor.qk_norm:
            block |= {"qn": theirs[f"{anemoi}.attention.q_norm.weight"], "kn": theirs[f"{anemoi}.attention.k_norm.weight"]}
        block = {k: v.double() for k, v in block.items()} | {"bias": biases[ours]}
        new = fold_qkv_bias(block, config.processor.num_heads, f"{source}: {ours}")
        _check_fold(block, new, config.processor.num_heads, f"{source}: {ours}")
        theirs[f"{anemoi}.layer_norm_attention.bias"] = new["beta"].float()
        theirs[f"{anemoi}.attention.lin_q.weight"] = new["wq"].float()
        theirs[f"{anemoi}.attention.lin_k.weight"] = new["wk"].float()
        theirs[f"{anemoi}.attention.projection.bias"] = new["bo"].float()
        folded += 1
    if folded:
        notes.append(f"lin_qkv bias folded into layer_norm_attention.bias, lin_q{', lin_k' * config.processor.qk_norm} "
                     f"and projection.bias ({folded} of {len(biases)} blocks)")
    return {k: v.detach().float().contiguous() for k, v in theirs.items()}, tuple(notes)


def _edge_attribute_names(width: int) -> tuple[str, ...]:
    """stormshard's ``[length, east, north]`` under anemoi's names; another width as one attribute."""
    return ("edge_length", "edge_dirs") if width == 3 else ("edge_attr",)


def _anemoi_graph(graph: HeteroGraph, kind: str, truncated: bool = False
                  ) -> tuple[dict[str, dict[str, Any]], dict[tuple[str, str, str], dict[str, Tensor]]]:
    """Node and edge stores of anemoi's ``HeteroData``: coordinates ``(nodes, 2)`` radians, area weights
    ``(nodes, 1)``, per edge set ``edge_index`` sorted by destination and its attributes (``(E, 1)`` length,
    ``(E, 2)`` direction); a truncated residual's ``truncation`` nodes (coordinates, or only their count where
    the graph has none) and its two edge sets with their weights ``(E, 1)``."""
    nodes = {}
    for name in ("data", "hidden"):
        store = graph[name]
        x = store.x.float()
        area = store.area_weight if "area_weight" in store else torch.ones(x.shape[0])
        nodes[name] = {"x": x.contiguous(), "area_weight": area.float().reshape(-1, 1).contiguous()}
    edges = {}
    for edge_type in (ENCODER, DECODER) + ((PROCESSOR,) if kind != "transformer" else ()):
        order = _edge_order(graph, edge_type)
        index = graph[edge_type].edge_index.long().index_select(1, order)
        attr = graph[edge_type].edge_attr.float().index_select(0, order)
        names = _edge_attribute_names(attr.shape[1])
        parts = (attr[:, :1], attr[:, 1:]) if len(names) == 2 else (attr,)
        edges[edge_type] = {"edge_index": index.contiguous()} | {n: p.contiguous() for n, p in zip(names, parts, strict=True)}
    if truncated:
        store = graph["truncation"]
        nodes["truncation"] = {"x": store.x.float().contiguous()} if "x" in store else {"num_nodes": store.num_nodes}
        for edge_type in (TRUNCATION_DOWN, TRUNCATION_UP):
            edges[edge_type] = {"edge_index": graph[edge_type].edge_index.long().contiguous(),
                                EDGE_WEIGHT_ATTRIBUTE: graph[edge_type].edge_weight.float().reshape(-1, 1).contiguous()}
    return nodes, edges


def _mapper(config: ModelConfig, section: str, edge_width: int, target: str) -> dict[str, Any]:
    m = getattr(config, section)
    out = {"_target_": target, "_convert_": "all", "num_channels": config.num_channels, "num_chunks": m.num_chunks,
           "num_heads": m.num_heads, "mlp_hidden_ratio": float(m.mlp_ratio), "attn_channels": None,
           "trainable_size": m.trainable_edge_size, "sub_graph_edge_attributes": list(_edge_attribute_names(edge_width)),
           "cpu_offload": False, "gradient_checkpointing": False, **anemoi_block_options(config, section),
           "layer_kernels": _KERNELS, "shard_strategy": "edges", "graph_attention_backend": "pyg",
           "edge_pre_mlp": False}
    if section == "decoder":
        out["initialise_data_extractor_zero"] = False
    return out


def _model_section(config: ModelConfig, graph: HeteroGraph, bounding: list[dict[str, Any]]) -> dict[str, Any]:
    """anemoi's ``config.model`` for ``config`` (the inverse of the import's config mapping; ``bounding``:
    anemoi's bounding list, :func:`~stormshard.checkpoint.anemoi_bounding.anemoi_bounding_config`)."""
    p, kind = config.processor, config.name
    processor: dict[str, Any] = {
        "_target_": EXPORTABLE_MODELS[kind], "_convert_": "all", "num_channels": config.num_channels,
        "num_layers": p.num_layers, "num_chunks": 1, "num_heads": p.num_heads, "mlp_hidden_ratio": float(p.mlp_ratio),
        "attn_channels": None, "cpu_offload": False, "gradient_checkpointing": False,
        **anemoi_block_options(config, "processor"), "layer_kernels": _KERNELS}
    if kind == "graphtransformer":
        processor |= {"trainable_size": p.trainable_edge_size, "shard_strategy": "edges", "edge_pre_mlp": False,
                      "sub_graph_edge_attributes": list(_edge_attribute_names(graph[PROCESSOR].edge_attr.shape[1])),
                      "graph_attention_backend": "pyg"}
    else:
        processor |= {"window_size": p.window_size, "dropout_p": 0.0, "softcap": 0.0, "use_alibi_slopes": False,
                      "use_rotary_embeddings": False, "attention_implementation": "scaled_dot_product_attention"}
    mappers = "anemoi.models.layers.mapper.GraphTransformer{}Mapper"
    encoder = _mapper(config, "encoder", graph[ENCODER].edge_attr.shape[1], mappers.format("Forward"))
    decoder = _mapper(config, "decoder", graph[DECODER].edge_attr.shape[1], mappers.format("Backward"))
    ensemble = ensemble_model_section(config)  # anemoi's AnemoiEnsModelEncProcDec: its noise and conditional norms
    if ensemble:
        processor["layer_kernels"] = {**_KERNELS, "LayerNorm": ensemble.pop("processor_norm")}
    if kind == "gnn":  # anemoi's GNN mappers and processor
        widths = {"processor": PROCESSOR, "encoder": ENCODER, "decoder": DECODER}
        gnn = gnn_component_configs(config, {k: list(_edge_attribute_names(graph[e].edge_attr.shape[1]))
                                             for k, e in widths.items()})
        processor, encoder, decoder = gnn["processor"], gnn["encoder"], gnn["decoder"]
    return {
        "keep_batch_sharded": True, "sparse_projector": {"num_chunks": 1},
        "model": {"_target_": "anemoi.models.models.AnemoiModelEncProcDec", "hidden_nodes_name": "hidden",
                  "latent_skip": config.latent_skip, "_convert_": "none"},
        "node_trainable_parameters": {"data": config.trainable_size, "hidden": config.trainable_size},
        "bounding": {"datasets": {"data": bounding}},
        "output_mask": {"datasets": {"data": {"_target_": "anemoi.training.utils.masks.NoOutputMask"}}},
        "latent_skip": config.latent_skip,
        "latent_aggregator": {"_target_": "anemoi.models.layers.aggregator.SumAggregator"},
        "processor": processor,
        "encoders": {"0": {"source_datasets": ["data"], "dataset_fusing_strategy": "not_supported",
                           "mapper": encoder}},
        "decoders": {"0": {"target_datasets": ["data"], "target_node_features": ["encoded_data"],
                           "mapper": decoder}},
        "residual": {"datasets": {"data": truncation_residual_config() if config.residual == "truncated" else
                                  {"_target_": "anemoi.models.layers.residual.SkipConnection", "step": -1}}},
        "compile": [], "recompile_limit": 8, **ensemble,
    }


def _normaliser_config(normalisation: dict[str, Any]) -> dict[str, Any]:
    """stormshard's ``{"default", "methods": {variable: method}}`` as anemoi's InputNormalizer config
    (same method names: ``{"default": method, method: [variables]}``)."""
    out: dict[str, Any] = {"default": normalisation.get("default", "mean-std")}
    for name, method in sorted((normalisation.get("methods") or {}).items()):
        out.setdefault(method, []).append(name)
    return out


def _normaliser(source: ExportSource) -> tuple[np.ndarray, np.ndarray]:
    """anemoi's ``_norm_mul`` / ``_norm_add`` (``x * mul + add``) over the dataset variables, float64."""
    from stormshard.data.anemoi_layout import Statistics
    from stormshard.data.normalisation import Normaliser

    stats = Statistics(*(np.asarray(source.statistics[k], dtype=np.float64) for k in ("mean", "stdev", "minimum", "maximum")))
    norm = Normaliser.from_statistics(stats, source.variables.variables, methods=source.normalisation.get("methods"),
                                      default=source.normalisation.get("default", "mean-std"))
    scale, offset = norm.scale.numpy(), norm.offset.numpy()
    return 1.0 / scale, -offset / scale


def _bounding(source: ExportSource) -> list[dict[str, Any]]:
    """anemoi's bounding list of the bundle's model (the normalized kinds' thresholds in physical units, from the
    statistics the exported checkpoint gives anemoi); a :class:`ConversionError` naming the bundle otherwise."""
    default = source.normalisation.get("default", "mean-std")
    methods = {v: (source.normalisation.get("methods") or {}).get(v, default) for v in source.variables.variables}
    return anemoi_bounding_config(source.config.relu_bounded, source.config.bounding, source.variables.variables,
                                  source.statistics, methods, str(source.path))


def _training_config(source: ExportSource, model: dict[str, Any], run_id: str, loss: dict[str, Any]) -> dict[str, Any]:
    v, ts, m = source.variables, source.timestep, source.config.multistep_input
    path = str(source.dataset.get("path") or "")
    data = {"forcing": list(v.forcing), "diagnostic": list(v.diagnostic), "target": None,
            "processors": {"normalizer": {"_target_": "anemoi.models.preprocessing.normalizer.InputNormalizer",
                                          "config": _normaliser_config(source.normalisation)}}}
    return {
        "data": {"format": "zarr", "frequency": ts, "timestep": ts, "forcing": list(v.forcing),
                 "diagnostic": list(v.diagnostic), "datasets": {"data": data}},
        "dataloader": {"dataset": path, "training": {"datasets": {"data": {"dataset_config": {"dataset": path}}}}},
        "task": {"_target_": "anemoi.training.tasks.Forecaster", "multistep_input": m, "multistep_output": 1,
                 "timestep": ts, "rollout": {"start": 1, "epoch_increment": 0, "maximum": 1}},
        "training": {"run_id": run_id, "fork_run_id": None, "precision": "32", "multistep_input": m,
                     "max_steps": source.step, **loss,
                     "weight_averaging": anemoi_weight_averaging(source.training.get("weight_averaging"))},
        "model": model,
        "graph": {"overwrite": False, "stormshard": {
            "note": "the graph of the stormshard model, stored in the model (graph_data); no recipe rebuilds it",
            "config_hash": str(getattr(source.graph, "config_hash", "")),
            "nodes": {n: int(source.graph[n].num_nodes) for n in ("data", "hidden", "truncation")
                      if n in source.graph}}},
        "system": {"hardware": {"num_gpus_per_node": 1, "num_nodes": 1, "num_gpus_per_model": 1},
                   "input": {"dataset": path, "graph": None}},
    }


def _stormshard_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("stormshard")
    except PackageNotFoundError:  # run from a checkout (PYTHONPATH)
        return "unknown"


def _metadata(source: ExportSource, config: dict[str, Any], run_id: str, notes: tuple[str, ...]) -> dict[str, Any]:
    """Metadata 2.0 as anemoi-training writes it, less what anemoi's objects fill in
    (``data_indices``, ``metadata_inference``: :mod:`stormshard.checkpoint.anemoi_build`)."""
    v, ts = source.variables, source.timestep
    roles = {n: {"role": "forcing" if n in v.forcing else "diagnostic" if n in v.diagnostic else "prognostic"}
             for n in v.variables}
    grid = int(source.graph["data"].x.shape[0])
    path = str(source.dataset.get("path") or "")
    dataset = {"version": None, "arguments": {"args": [{"dataset": path, "frequency": ts}], "kwargs": {}},
               "specific": {"action": "stormshard", "variables": list(v.variables), "frequency": ts},
               "frequency": ts, "variables": list(v.variables), "variables_metadata": roles,
               "shape": [None, len(v.variables), 1, grid], "field_shape": [grid], "dtype": "float32",
               "resolution": source.dataset.get("resolution"), "path": path, "name": None, "sources": [],
               "supporting_arrays": {}}
    return {
        "version": "2.0", "config": config, "seed": 0, "base_seed": 0, "run_id": run_id, "task": "forecaster",
        "dataset": {"data": dataset},
        "timestamp": datetime.datetime.now(tz=datetime.timezone.utc).isoformat(),
        "uuid": str(uuid.uuid4()), "tracker": {}, "training": {"current_epoch": 0, "global_step": source.step,
                                                               "elapsed_time": 0.0},
        "stormshard": {"version": _stormshard_version(), "source": str(source.path), "step": source.step,
                       "model": source.config.model_dump(mode="json"), "export_notes": list(notes)},
    }


def plan_anemoi_export(source: ExportSource) -> AnemoiExportPlan:
    """The anemoi equivalent of ``source`` (no anemoi needed); a :class:`ConversionError` naming what
    has none."""
    config, v = source.config, source.variables
    check_exportable(config, source.path)
    if list(v.input_names) != [n for n in v.variables if n not in v.diagnostic] or \
            list(v.output_names) != [n for n in v.variables if n not in v.forcing]:
        raise _fail(source.path, f"variables: input {list(v.input_names)} / output {list(v.output_names)} are not "
                                 "in dataset order (anemoi's data indices keep it)",
                    "train with the variables in dataset order")
    parameters, notes = anemoi_parameters(source.weights, config, len(v.input_names), source.graph, source.path)
    kind = "transformer" if config.name == "ensemble" else config.name  # no processor edges
    nodes, edges = _anemoi_graph(source.graph, kind, config.residual == "truncated")
    run_id = str(uuid.uuid4())
    loss, loss_notes = anemoi_loss_config(source.training, v.output_names, ensemble=config.name == "ensemble")
    notes = (*notes, *loss_notes)
    training = _training_config(source, _model_section(config, source.graph, _bounding(source)), run_id, loss)
    mul, add = _normaliser(source)
    lat, lon = (np.degrees(source.graph["data"].x[:, i].double().numpy()) for i in (0, 1))
    return AnemoiExportPlan(
        config=training, nodes=nodes, edges=edges, parameters=parameters, norm_mul=mul, norm_add=add,
        statistics={k: np.asarray(source.statistics[k], dtype=np.float64) for k in ("mean", "stdev", "minimum", "maximum")},
        variables=v, multistep=config.multistep_input, metadata=_metadata(source, training, run_id, notes),
        supporting_arrays={"data": {"latitudes": lat, "longitudes": lon}}, notes=notes)
