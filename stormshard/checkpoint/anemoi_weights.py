"""stormshard parameter names <-> anemoi-models 0.19 tensor names (inference layout), both ways.

:func:`parameter_pairs` lists, for a stormshard model config, which stormshard parameter is which anemoi tensor:
``same`` pairs copy unchanged, ``permuted`` pairs reorder the input columns of a Linear weight with an involution
(the same reordering maps both ways):

- node embeddings (every kind): anemoi's node inputs are ``[x..., sin lat, sin lon, cos lat, cos lon, trainable...]``,
  stormshard's ``[x..., sin lat, cos lat, sin lon, cos lon, trainable...]`` (:func:`coordinate_columns`);
- graph-transformer blocks and the sliding-window transformer's blocks renamed (``lin_query`` -> ``to_q``, ...); the
  transformer's q/k/v weights become one ``lin_qkv`` (rows per head, zero bias: anemoi's have none); ``qk_norm``'s
  ``q_norm`` / ``k_norm`` keep their names; a gated MLP's ``gate_proj`` and ``value_proj`` (``mlp.0``) become one
  ``fc1`` / ``mlp.0`` whose rows interleave them (gate ``0::2``, value ``1::2``: :func:`gated_names`,
  :mod:`stormshard.layers.mlp`) and its output linear ``mlp.1`` is ``fc2`` / ``mlp.2``;
- GNN (anemoi's ``GNNForwardMapper`` / ``GNNProcessor`` / ``GNNBackwardMapper`` as stormshard's ``gnn`` with the anemoi
  options): every anemoi ``MLP`` (``mlp.N`` linears, ``layer_norm``) is a stormshard GNN MLP (``N``, its last index the
  LayerNorm): ``emb_nodes_src`` / ``emb_nodes_dst`` -> ``embed_data`` / ``embed_hidden``, ``emb_edges`` -> the block's
  ``edge_embedding`` (the processor's in ``blocks.0``), ``conv.edge_mlp`` -> ``edge_mlp`` (its first linear reads
  ``[x_dst, x_src, e]`` in anemoi, ``[x_src, x_dst, e]`` here: :func:`swapped_node_blocks`), ``node_mlp`` ->
  ``node_mlp``, ``node_data_extractor`` (no norm) -> ``head``;
- trainable node and edge tensors: ``data_embedding`` / ``hidden_embedding``, ``*_edges.trainable``.

:func:`stormshard_weights` and :func:`anemoi_weights` apply the pairs.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor

from stormshard.checkpoint.anemoi_ensemble import (
    ensemble_anemoi_weights,
    ensemble_stormshard_weights,
    ensemble_weight_pairs,
)
from stormshard.checkpoint.errors import ConversionError
from stormshard.models.config import ModelConfig

__all__ = ["parameter_pairs", "stormshard_weights", "anemoi_weights", "qkv_names", "gated_names",
           "coordinate_columns", "swapped_node_blocks"]

#: (stormshard name, anemoi name) pairs copied unchanged; (stormshard, anemoi, input-column involution) pairs
Pairs = list[tuple[str, str]]
Permuted = list[tuple[str, str, Callable[[Tensor], Tensor]]]


def coordinate_columns(weight: Tensor, first: int) -> Tensor:
    """A Linear weight ``(out, in)`` with input columns ``first + 1`` and ``first + 2`` swapped: anemoi's node
    coordinates ``[sin lat, sin lon, cos lat, cos lon]`` <-> stormshard's ``[sin lat, cos lat, sin lon, cos lon]``
    starting at column ``first`` (its own inverse)."""
    order = list(range(first)) + [first, first + 2, first + 1, first + 3] + list(range(first + 4, weight.shape[1]))
    return weight[:, order]


def swapped_node_blocks(weight: Tensor, channels: int) -> Tensor:
    """A GNN edge MLP's first Linear weight ``(out, 2 C + E)`` with its two node blocks of ``channels`` input columns
    swapped: anemoi's ``[x_dst, x_src, e]`` <-> stormshard's ``[x_src, x_dst, e]`` (its own inverse)."""
    c = channels
    return torch.cat([weight[:, c:2 * c], weight[:, :c], weight[:, 2 * c:]], dim=1)


_GT_BLOCK = {"lin_query": "to_q", "lin_key": "to_k", "lin_value": "to_v", "lin_edge": "to_e", "lin_self": "to_self",
             "projection": "proj", "layer_norm_mlp_dst": "norm_mlp", "layer_norm_attention_src": "norm_src",
             "layer_norm_attention_dest": "norm_dst", "layer_norm_attention": "norm", "q_norm": "q_norm",
             "k_norm": "k_norm"}


def _mlp_pairs(src: str, dst: str, fc1: str, fc2: str, gated: bool) -> Pairs:
    """anemoi's block ``MLP`` ``src`` (``mlp.0``, GELU, ``mlp.2``; gated: ``mlp.0`` gate / value, ``mlp.1``) and
    stormshard's ``dst``: the pairs copied unchanged (a gated ``fc1``: :func:`gated_names`)."""
    pairs = [(f"{dst}.{fc2}.{p}", f"{src}.mlp.{1 if gated else 2}.{p}") for p in ("weight", "bias")]
    return pairs if gated else pairs + [(f"{dst}.{fc1}.{p}", f"{src}.mlp.0.{p}") for p in ("weight", "bias")]


def _gt_block(src: str, dst: str, mapper: bool, gated: bool) -> Pairs:
    pairs = _mlp_pairs(f"{src}.node_dst_mlp", f"{dst}.mlp", "0", "2", gated)
    for a, s in _GT_BLOCK.items():
        if mapper and a == "layer_norm_attention" or not mapper and a.startswith("layer_norm_attention_"):
            continue  # a mapper's layer_norm_attention is its layer_norm_attention_dest under a second name
        pairs += [(f"{dst}.{s}.{p}", f"{src}.{a}.{p}") for p in ("weight", "bias")]
    return pairs


def _transformer_block(src: str, dst: str, gated: bool, norms: bool = True) -> Pairs:
    """A sliding-window transformer block; ``norms`` False: an ensemble block, whose conditional norms map apart
    (:mod:`stormshard.checkpoint.anemoi_ensemble`)."""
    pairs = _mlp_pairs(f"{src}.mlp", f"{dst}.mlp", "fc1", "fc2", gated)
    for p in ("weight", "bias"):
        pairs += [(f"{dst}.attention.projection.{p}", f"{src}.attention.projection.{p}"),
                  (f"{dst}.attention.q_norm.{p}", f"{src}.attention.q_norm.{p}"),
                  (f"{dst}.attention.k_norm.{p}", f"{src}.attention.k_norm.{p}")]
        if norms:
            pairs += [(f"{dst}.norm_attention.{p}", f"{src}.layer_norm_attention.{p}"),
                      (f"{dst}.norm_mlp.{p}", f"{src}.layer_norm_mlp.{p}")]
    return pairs


def _mlp(ours: str, theirs: str, hidden_layers: int, *, norm: bool = True,
         first: Callable[[Tensor], Tensor] | None = None) -> tuple[Pairs, Permuted]:
    """A stormshard GNN MLP ``ours`` (Linear, GELU, ..., Linear[, LayerNorm]: modules ``0 .. 2 h[+1]``) and anemoi's
    ``MLP`` ``theirs`` (``mlp.0 .. mlp.2h``, ``layer_norm``); ``first``: the first weight's column involution."""
    same = [(f"{ours}.{2 * k}.{p}", f"{theirs}.mlp.{2 * k}.{p}") for k in range(hidden_layers + 1)
            for p in ("weight", "bias")]
    if norm:
        same += [(f"{ours}.{2 * hidden_layers + 1}.{p}", f"{theirs}.layer_norm.{p}") for p in ("weight", "bias")]
    if first is None:
        return same, []
    return same[1:], [(same[0][0], same[0][1], first)]


def _gnn_pairs(config: ModelConfig, first: int) -> tuple[Pairs, Permuted]:
    """anemoi's GNN model (the anemoi options of :class:`~stormshard.models.config.ModelConfig`)."""
    c, enc, dec, proc = config.num_channels, config.encoder, config.decoder, config.processor
    swap = partial(swapped_node_blocks, channels=c)
    parts = [_mlp("embed_data", "model.encoder.0.emb_nodes_src", enc.mlp_hidden_layers,
                  first=partial(coordinate_columns, first=first)),
             _mlp("embed_hidden", "model.encoder.0.emb_nodes_dst", enc.mlp_hidden_layers,
                  first=partial(coordinate_columns, first=0)),
             _mlp("head", "model.decoder.0.node_data_extractor", dec.mlp_hidden_layers, norm=False)]
    for ours, theirs, section in (("encoder", "model.encoder.0", enc), ("decoder", "model.decoder.0", dec)):
        parts += [_mlp(f"{ours}.edge_embedding", f"{theirs}.emb_edges", section.mlp_hidden_layers),
                  _mlp(f"{ours}.edge_mlp", f"{theirs}.proc.conv.edge_mlp", section.mlp_hidden_layers, first=swap),
                  _mlp(f"{ours}.node_mlp", f"{theirs}.proc.node_mlp", section.mlp_hidden_layers)]
    for i in range(proc.num_layers):
        ours, theirs = f"processor.blocks.{i}", f"model.processor.proc.{i}"
        parts += [_mlp(f"{ours}.edge_mlp", f"{theirs}.conv.edge_mlp", proc.mlp_hidden_layers, first=swap),
                  _mlp(f"{ours}.node_mlp", f"{theirs}.node_mlp", proc.mlp_hidden_layers)]
    parts.append(_mlp("processor.blocks.0.edge_embedding", "model.processor.proc.0.emb_edges", proc.mlp_hidden_layers))
    return [p for same, _ in parts for p in same], [p for _, permuted in parts for p in permuted]


def parameter_pairs(config: ModelConfig, first: int) -> tuple[Pairs, Permuted]:
    """(stormshard, anemoi) parameter names that map unchanged, and those whose input columns are permuted
    (``first``: the index of the data nodes' first coordinate column, ``multistep_input x input variables``)."""
    same = [("data_embedding", "model.node_attributes.trainable_tensors.data.trainable"),
            ("hidden_embedding", "model.node_attributes.trainable_tensors.hidden.trainable")]
    for ours, theirs, size in (("encoder_edges", "model.encoder_graph_provider.data", config.encoder.trainable_edge_size),
                               ("decoder_edges", "model.decoder_graph_provider.data", config.decoder.trainable_edge_size),
                               ("processor.edges", "model.processor_graph_provider",
                                config.processor.trainable_edge_size)):
        if size:
            same.append((f"{ours}.trainable", f"{theirs}.trainable.trainable"))
    if config.name == "gnn":
        gnn_same, permuted = _gnn_pairs(config, first)
        return same + gnn_same, permuted
    same += [("embed_data.bias", "model.encoder.0.emb_nodes_src.bias"),
             ("embed_hidden.bias", "model.encoder.0.emb_nodes_dst.bias"),
             ("embed_data_decoder.bias", "model.decoder.0.emb_nodes_dst.bias")]
    permuted: Permuted = [
        ("embed_data.weight", "model.encoder.0.emb_nodes_src.weight", partial(coordinate_columns, first=first)),
        ("embed_hidden.weight", "model.encoder.0.emb_nodes_dst.weight", partial(coordinate_columns, first=0)),
        ("embed_data_decoder.weight", "model.decoder.0.emb_nodes_dst.weight", partial(coordinate_columns, first=first))]
    gated = {section: getattr(config, section).mlp_implementation != "mlp" for section in ("processor", "encoder",
                                                                                        "decoder")}
    same += _gt_block("model.encoder.0.proc", "encoder", True, gated["encoder"])
    same += _gt_block("model.decoder.0.proc", "decoder", True, gated["decoder"])
    for i in range(config.processor.num_layers):
        if config.name == "graphtransformer":
            same += _gt_block(f"model.processor.proc.{i}", f"processor.blocks.{i}", False, gated["processor"])
        elif config.name == "ensemble":
            same += _transformer_block(f"model.processor.proc.{i}", f"processor.blocks.{i}", gated["processor"],
                                       norms=False)
        else:
            same += _transformer_block(f"model.processor.proc.{i}", f"processor.processor.blocks.{i}",
                                       gated["processor"])
    for p in ("weight", "bias"):
        same += [(f"head.0.{p}", f"model.decoder.0.node_data_extractor.0.{p}"),
                 (f"head.1.{p}", f"model.decoder.0.node_data_extractor.1.{p}")]
    return same + ensemble_weight_pairs(config), permuted


def qkv_names(config: ModelConfig) -> list[tuple[str, str]]:
    """(stormshard ``lin_qkv`` prefix, anemoi attention prefix) of each transformer block."""
    if config.name not in ("transformer", "ensemble"):
        return []
    blocks = "processor.processor.blocks" if config.name == "transformer" else "processor.blocks"
    return [(f"{blocks}.{i}.attention.lin_qkv", f"model.processor.proc.{i}.attention")
            for i in range(config.processor.num_layers)]


def gated_names(config: ModelConfig) -> list[tuple[str, str]]:
    """(stormshard ``fc1`` prefix, anemoi ``GatedMLPLayer`` prefix) of every gated block MLP (``mlp_implementation``
    other than ``"mlp"``): stormshard's rows ``2 i`` / ``2 i + 1`` are anemoi's ``gate_proj`` / ``value_proj`` row
    ``i``."""
    if config.name == "gnn":
        return []
    out = [(f"{ours}.mlp.0", f"{theirs}.node_dst_mlp.mlp.0") for ours, theirs, section in
           (("encoder", "model.encoder.0.proc", config.encoder), ("decoder", "model.decoder.0.proc", config.decoder))
           if section.mlp_implementation != "mlp"]
    if config.processor.mlp_implementation != "mlp":
        for i in range(config.processor.num_layers):
            out.append((f"processor.blocks.{i}.mlp.0", f"model.processor.proc.{i}.node_dst_mlp.mlp.0")
                       if config.name == "graphtransformer" else
                       (f"processor.{'processor.' if config.name == 'transformer' else ''}blocks.{i}.mlp.fc1",
                        f"model.processor.proc.{i}.mlp.mlp.0"))
    return out


def stormshard_weights(t: dict[str, Tensor], config: ModelConfig, n_in: int) -> dict[str, Tensor]:
    """anemoi tensors (canonical names) -> stormshard parameters (float32); a plain pair whose anemoi tensor is
    absent is left out (the caller checks the result against the model), a permuted one is a KeyError."""
    same, permuted = parameter_pairs(config, config.multistep_input * n_in)
    out = {ours: t[theirs] for ours, theirs in same if theirs in t}
    out.update({ours: columns(t[theirs]) for ours, theirs, columns in permuted})  # KeyError: not this layout
    heads = config.processor.num_heads
    for ours, theirs in qkv_names(config):
        q, k, v = (t[f"{theirs}.lin_{n}.weight"] for n in "qkv")
        c = q.shape[0]
        # stormshard's lin_qkv rows are "(heads three d)": per head its q, k and v rows
        out[f"{ours}.weight"] = torch.stack([w.reshape(heads, c // heads, -1) for w in (q, k, v)],
                                            dim=1).reshape(3 * c, -1)
        out[f"{ours}.bias"] = torch.zeros(3 * c)  # anemoi's q/k/v projections have no bias
    for ours, theirs in gated_names(config):  # rows interleaved: gate 0::2, value 1::2 (KeyError: not this layout)
        for p in ("weight", "bias"):
            gate, value = t[f"{theirs}.gate_proj.{p}"], t[f"{theirs}.value_proj.{p}"]
            out[f"{ours}.{p}"] = torch.stack([gate, value], dim=1).flatten(0, 1)
    if config.name == "ensemble":
        out.update(ensemble_stormshard_weights(t, config))
    return {k: v.detach().float().contiguous().clone() for k, v in out.items()}


def anemoi_weights(weights: dict[str, Tensor], config: ModelConfig, n_in: int) -> dict[str, Tensor]:
    """stormshard parameters -> anemoi tensors (the inverse of :func:`stormshard_weights`). A non-zero
    ``lin_qkv`` bias (anemoi's q/k/v have none) is a :class:`ConversionError`."""
    same, permuted = parameter_pairs(config, config.multistep_input * n_in)
    out = {theirs: weights[ours] for ours, theirs in same if ours in weights}
    out.update({theirs: columns(weights[ours]) for ours, theirs, columns in permuted})
    heads = config.processor.num_heads
    for ours, theirs in qkv_names(config):
        if bool(weights[f"{ours}.bias"].any()):
            raise ConversionError(f"{ours}.bias is not zero: anemoi's q/k/v projections have no bias",
                                  fix="fine-tune imported transformer models with that bias frozen at zero")
        w = weights[f"{ours}.weight"]
        c = w.shape[0] // 3
        q, k, v = w.reshape(heads, 3, c // heads, -1).unbind(1)
        for name, part in zip("qkv", (q, k, v), strict=True):
            out[f"{theirs}.lin_{name}.weight"] = part.reshape(c, -1)
    for ours, theirs in gated_names(config):
        for p in ("weight", "bias"):
            out[f"{theirs}.gate_proj.{p}"] = weights[f"{ours}.{p}"][0::2]
            out[f"{theirs}.value_proj.{p}"] = weights[f"{ours}.{p}"][1::2]
    if config.name == "ensemble":
        out.update(ensemble_anemoi_weights(weights, config))
    return {k: v.detach().contiguous() for k, v in out.items()}
