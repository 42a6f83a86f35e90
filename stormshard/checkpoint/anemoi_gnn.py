"""anemoi's GNN model (``GNNForwardMapper``, ``GNNProcessor``, ``GNNBackwardMapper``: anemoi-training's
``model: gnn``) <-> stormshard's ``gnn`` model with the anemoi options, both ways, without anemoi.

anemoi-models 0.19's GNN, with ``C = num_channels``, ``H = C x mlp_hidden_ratio`` and every ``MLP`` of
``mlp_extra_layers + 2`` (Linear, GELU) pairs before its output Linear and a LayerNorm after it:

- the encoder embeds the data-node inputs and the hidden-node inputs with MLPs (``emb_nodes_src`` /
  ``emb_nodes_dst``, width ``H``), its edges (attributes and trainable tensor) with ``emb_edges`` (width ``H``,
  to ``C``), then one ``GraphConv`` step: ``e' = e + edge_mlp([x_dst, x_src, e])`` (width ``C`` whatever the
  ratio), ``x_dst' = x_dst + node_mlp([x_dst, sum e'])``, and updates its sources with the same node MLP,
  ``x_src' = x_src + node_mlp([x_src, x_src])`` (``update_src_nodes``);
- the processor's first block embeds the hidden edges (``proc.0.emb_edges``); every block is the same
  ``GraphConv`` step, the updated edges passed on;
- the decoder embeds its edges, runs the step onto the encoder's updated data latents (``target_node_features:
  [encoded_data]``, no node embedding of its own) and maps them to the outputs with ``node_data_extractor``
  (an MLP without norm).

stormshard's ``gnn`` is that with ``node_embedding: "mlp"``, ``head: "mlp"``, per section (``processor``,
``encoder``, ``decoder``) ``mlp_hidden_layers = mlp_extra_layers + 2``, ``mlp_ratio`` ``H / C``,
``edge_embedding``, ``aggregate_updated_edges``, ``edge_mlp_ratio: 1``, and ``encoder.update_src_nodes``
(:func:`gnn_model_sections` reads them from the tensors; :func:`check_gnn_exportable` refuses a ``gnn`` model
without them; :func:`gnn_component_configs` writes anemoi's config sections). The tensors map by
:mod:`stormshard.checkpoint.anemoi_weights`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from torch import Tensor

from stormshard.checkpoint.errors import ConversionError
from stormshard.models.config import MapperConfig, ModelConfig, ProcessorConfig

__all__ = ["GNN_PROCESSOR", "GNN_ENCODER", "GNN_DECODER", "gnn_problems", "gnn_model_sections",
           "check_gnn_exportable", "gnn_component_configs"]

GNN_PROCESSOR = "GNNProcessor"
GNN_ENCODER = "GNNForwardMapper"
GNN_DECODER = "GNNBackwardMapper"
#: anemoi's layer kernels stormshard's GNN MLPs compute (torch's Linear, exact GELU, a LayerNorm)
_KERNELS = {"Linear": ("torch.nn.Linear", "torch.nn.modules.linear.Linear"),
            "Activation": ("torch.nn.GELU", "torch.nn.modules.activation.GELU"),
            "LayerNorm": ("torch.nn.LayerNorm", "torch.nn.modules.normalization.LayerNorm",
                          "anemoi.models.layers.normalization.AutocastLayerNorm")}
#: the kernels an exported GNN gets (anemoi-training's gnn.yaml: the autocast LayerNorm, equal in fp32)
_EXPORT_KERNELS = {"LayerNorm": {"_target_": "anemoi.models.layers.normalization.AutocastLayerNorm"},
                   "Linear": {"_target_": "torch.nn.Linear"}, "Activation": {"_target_": "torch.nn.GELU"}}
_SECTIONS = {"processor": "model.processor.proc.0", "encoder": "model.encoder.0.proc", "decoder": "model.decoder.0.proc"}


def _components(model: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The processor, encoder and decoder config sections of anemoi's ``config.model`` (0.19 or older layout)."""
    out = {"processor": model.get("processor")}
    for kind in ("encoder", "decoder"):
        many = model.get(f"{kind}s")
        out[kind] = (next(iter(many.values())) or {}).get("mapper") if isinstance(many, dict) and many else \
            model.get(kind)
    return {k: v for k, v in out.items() if isinstance(v, dict)}


def gnn_problems(model: dict[str, Any], encoder: str, decoder: str) -> list[str]:
    """What of a GNN model (``model``: the checkpoint's ``config.model``; the mapper classes) stormshard's ``gnn``
    does not compute: other mappers, gated MLPs, other layer kernels, other decoder inputs."""
    problems = []
    if (encoder, decoder) != (GNN_ENCODER, GNN_DECODER):
        problems.append(f"{GNN_PROCESSOR} with encoder {encoder} / decoder {decoder} (a GNN processor imports with "
                        f"{GNN_ENCODER} / {GNN_DECODER})")
    for name, section in _components(model).items():
        implementation = section.get("mlp_implementation", "mlp")
        if implementation != "mlp":
            problems.append(f"{name} mlp_implementation={implementation!r} (gated MLPs; stormshard's GNN MLPs are "
                            "Linear, GELU)")
        kernels = section.get("layer_kernels") or model.get("layer_kernels") or {}
        for kernel, allowed in _KERNELS.items():
            spec = kernels.get(kernel) if isinstance(kernels, dict) else None
            if spec is None:
                continue
            target, extra = spec.get("_target_"), sorted(set(spec) - {"_target_", "_partial_"})
            if target not in allowed or extra:
                problems.append(f"{name} layer_kernels.{kernel}={target}{' with ' + str(extra) if extra else ''} "
                                f"(stormshard's GNN computes {allowed[0]})")
    decoders = model.get("decoders")
    features = (next(iter(decoders.values())) or {}).get("target_node_features") \
        if isinstance(decoders, dict) and decoders else None
    if features is not None and list(features) != ["encoded_data"]:
        problems.append(f"decoder target_node_features={list(features)} (the GNN decoder reads the encoder's data "
                        "latents: ['encoded_data'])")
    return problems


def _mlp_depth(t: dict[str, Tensor], prefix: str) -> int:
    """The (Linear, activation) pairs of anemoi's ``MLP`` at ``prefix`` (its linears are ``mlp.0, mlp.2, ...``)."""
    pattern = re.compile(rf"^{re.escape(prefix)}\.mlp\.(\d+)\.weight$")
    linears = [int(m[1]) for k in t if (m := pattern.match(k))]
    return max(linears) // 2 if linears else 0


def gnn_model_sections(t: dict[str, Tensor], num_layers: int) -> tuple[dict[str, Any], list[str]]:
    """The ``gnn`` :class:`~stormshard.models.config.ModelConfig` fields of anemoi's GNN model (canonical tensors
    ``t``; ``processor`` / ``encoder`` / ``decoder`` without their trainable edge sizes, which the caller adds),
    and what does not map."""
    c = int(t["model.encoder.0.proc.node_mlp.layer_norm.weight"].shape[0])
    problems, fields = [], {}
    for section, prefix in _SECTIONS.items():
        node_hidden = int(t[f"{prefix}.node_mlp.mlp.0.weight"].shape[0])
        edge_hidden = int(t[f"{prefix}.conv.edge_mlp.mlp.0.weight"].shape[0])
        ratio = node_hidden / c
        options = dict(mlp_hidden_layers=_mlp_depth(t, f"{prefix}.node_mlp"), edge_embedding=True,
                       aggregate_updated_edges=True, edge_mlp_ratio=edge_hidden / c)
        if section == "processor":
            if ratio != int(ratio):
                problems.append(f"processor mlp_hidden_ratio {ratio} (stormshard's processor takes whole ratios)")
            fields[section] = dict(num_layers=num_layers, mlp_ratio=max(1, int(ratio)), **options)
        else:
            fields[section] = dict(mlp_ratio=ratio, update_src_nodes=section == "encoder", **options)
    return fields | {"num_channels": c, "node_embedding": "mlp", "head": "mlp", "decoder_embedding": False}, problems


def check_gnn_exportable(config: ModelConfig, source: Path) -> None:
    """A :class:`ConversionError` naming the first option of a ``gnn`` model that anemoi's GNN model computes
    otherwise (its value and the setting anemoi's has); nothing when the model is anemoi's GNN."""
    fix = ("anemoi's GNN model (GNNForwardMapper, GNNProcessor, GNNBackwardMapper) is stormshard's gnn with "
           "node_embedding 'mlp', head 'mlp', and in processor, encoder and decoder edge_embedding, "
           "aggregate_updated_edges, edge_mlp_ratio 1 and mlp_hidden_layers >= 2 (encoder.update_src_nodes too): "
           "train a gnn model with them to export it (an imported anemoi GNN has them)")
    wanted: list[tuple[str, Any, Any]] = [("node_embedding", config.node_embedding, "mlp"),
                                          ("head", config.head, "mlp"),
                                          ("decoder_embedding", config.decoder_embedding, False),
                                          ("encoder.update_src_nodes", config.encoder.update_src_nodes, True)]
    sections = {name: getattr(config, name) for name in ("processor", "encoder", "decoder")}
    for name, section in sections.items():
        wanted += [(f"{name}.edge_embedding", section.edge_embedding, True),
                   (f"{name}.aggregate_updated_edges", section.aggregate_updated_edges, True)]
    for name, value, theirs in wanted:
        if value != theirs:
            raise ConversionError(f"{source}: model.{name}={value!r} has no anemoi equivalent (anemoi's GNN model: "
                                  f"{theirs!r})", fix=fix)
    c = config.num_channels
    for name, section in sections.items():
        ratio = section.mlp_ratio if section.edge_mlp_ratio is None else section.edge_mlp_ratio
        if max(1, round(c * ratio)) != c:
            raise ConversionError(f"{source}: model.{name}.edge_mlp_ratio={section.edge_mlp_ratio} (mlp_ratio "
                                  f"{section.mlp_ratio}) makes the edge MLP {max(1, round(c * ratio))} channels wide; "
                                  f"anemoi's GraphConv has num_channels={c}", fix=fix)
        if section.mlp_hidden_layers < 2:
            raise ConversionError(f"{source}: model.{name}.mlp_hidden_layers={section.mlp_hidden_layers} has no anemoi "
                                  "equivalent (anemoi's GNN MLPs have mlp_extra_layers + 2 >= 2 hidden layers)", fix=fix)


def _component(target: str, config: ModelConfig, section: ProcessorConfig | MapperConfig,
               edge_attributes: list[str]) -> dict[str, Any]:
    return {"_target_": target, "_convert_": "all", "num_channels": config.num_channels, "num_chunks": 1,
            "mlp_extra_layers": section.mlp_hidden_layers - 2, "mlp_hidden_ratio": float(section.mlp_ratio),
            "mlp_implementation": "mlp", "trainable_size": section.trainable_edge_size,
            "sub_graph_edge_attributes": edge_attributes, "cpu_offload": False, "gradient_checkpointing": False,
            "layer_kernels": _EXPORT_KERNELS}


def gnn_component_configs(config: ModelConfig, edge_attributes: dict[str, list[str]]) -> dict[str, dict[str, Any]]:
    """anemoi's ``processor`` and the ``encoder`` / ``decoder`` mapper config sections of a ``gnn`` model that
    :func:`check_gnn_exportable` accepts (``edge_attributes``: per section, the graph's edge attribute names)."""
    return {"processor": _component(f"anemoi.models.layers.processor.{GNN_PROCESSOR}", config, config.processor,
                                    edge_attributes["processor"]) | {"num_layers": config.processor.num_layers},
            "encoder": _component(f"anemoi.models.layers.mapper.{GNN_ENCODER}", config, config.encoder,
                                  edge_attributes["encoder"]),
            "decoder": _component(f"anemoi.models.layers.mapper.{GNN_DECODER}", config, config.decoder,
                                  edge_attributes["decoder"])}
