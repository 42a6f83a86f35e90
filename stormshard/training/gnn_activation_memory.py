"""The activation memory of the GNN model (``model.name: "gnn"``): its blocks keep per-edge tensors.

A GNN block (:mod:`stormshard.layers.gnn`) runs an MLP on every edge and one on every destination
node, so what autograd keeps grows with the edges, not the nodes: with anemoi's options
(``edge_embedding``: edges carried at ``num_channels``; ``mlp_hidden_layers``) the per-edge MLPs
dominate (12.5 GB of 12.8 at O96 -> O48, 256 channels, bf16). Per block, per sample, on the
plain autograd path CUDA runs (the CPU's fused kernel keeps less):

- edge MLP, ``E`` edges: each hidden layer keeps its pre-activation and activation (``2 L H_e``),
  the output linear's result, the norm's output and the updated edge (``3 e``);
- the edge embedding where the block embeds (mappers with ``edge_embedding``; the processor's first
  block): its input, ``2 L H_emb`` and ``2 e``;
- node MLP, ``N`` destinations: its input ``[x, aggregated]`` (``C + e``), ``2 L H_n`` and ``2 C``;

with ``e`` the block's edge channels (the graph's 3 attributes plus trainable ones, or ``C`` when
embedded), ``H`` the MLP widths, ``L`` ``mlp_hidden_layers``. A checkpointed processor keeps each
layer's nodes and edges (``N C + E e``), and recomputes one layer at a time once the last step's
decoder is freed (a transient); a checkpointed encoder keeps its input.
Edges are counted from the graph config: ``knn`` destinations x neighbours, ``multimesh`` 8 per
hidden node, ``cutoff`` 1.7 x ``(factor / 0.6)^2`` per data node (measured 1.2-1.6 at 0.6).
"""

from __future__ import annotations

from dataclasses import dataclass

from stormshard.graphs.config import CutoffEdges, GraphConfig, KNNEdges

__all__ = ["GNNSection", "GNNShape", "gnn_shape", "gnn_activation_elements", "section_edges"]

#: the graph's edge attributes: length and direction (graphs.attributes.edge_attributes)
EDGE_ATTRIBUTES = 3
_MULTIMESH_EDGES_PER_NODE = 8
_CUTOFF_EDGES_PER_DATA_NODE = 1.7  # at factor 0.6 (measured 1.23-1.60 on o32..o160 data, o16..ico6 hidden)


@dataclass(frozen=True)
class GNNSection:
    """One GNN section's block shape: ``edges`` and ``destinations`` over the whole graph, its widths
    (``edge_channels`` kept per edge, MLP hidden widths), ``mlp_layers`` and the edge embedding
    ``(input channels, hidden)`` or None."""

    edges: int
    destinations: int
    edge_channels: int
    edge_hidden: int
    node_hidden: int
    mlp_layers: int
    embedding: tuple[int, int] | None = None

    def block_elements(self, channels: int, gpus_per_model: int, embedded: bool = True) -> float:
        """Elements one block keeps per sample on one rank (``embedded``: this block embeds its edges)."""
        edges = -(-self.edges // gpus_per_model)
        nodes = -(-self.destinations // gpus_per_model)
        e, layers = self.edge_channels, self.mlp_layers
        per_edge = 2 * layers * self.edge_hidden + 3 * e
        if embedded and self.embedding is not None:
            width, hidden = self.embedding
            per_edge += width + 2 * layers * hidden + 2 * e
        per_node = channels + e + 2 * layers * self.node_hidden + 2 * channels
        return edges * per_edge + nodes * per_node


@dataclass(frozen=True)
class GNNShape:
    """The GNN model's three sections, ``update_src_nodes`` (the encoder's node MLP once more on the data
    nodes) and the MLP node embedding / head hidden width (0: linear)."""

    encoder: GNNSection
    processor: GNNSection
    decoder: GNNSection
    update_src_nodes: bool = False
    mlp_width: int = 0


def section_edges(edges: KNNEdges | CutoffEdges | object, sources: int, destinations: int, data: int) -> int:
    """The edge count of a section with ``sources`` / ``destinations`` nodes (``data`` data nodes)."""
    if isinstance(edges, KNNEdges):
        return destinations * min(edges.num_neighbours, sources)
    if isinstance(edges, CutoffEdges):
        return round(_CUTOFF_EDGES_PER_DATA_NODE * (edges.factor / 0.6) ** 2 * data)
    return _MULTIMESH_EDGES_PER_NODE * destinations


def gnn_shape(model, graph: GraphConfig, data_cells: int, hidden: int) -> GNNShape:  # noqa: ANN001 - ModelConfig
    """The :class:`GNNShape` of ``model`` (a ``gnn`` :class:`~stormshard.models.config.ModelConfig`) on ``graph``."""
    c = model.num_channels

    def section(cfg, edges: int, destinations: int, first_embeds: bool = True) -> GNNSection:  # noqa: ANN001
        raw = EDGE_ATTRIBUTES + cfg.trainable_edge_size
        width = c if cfg.edge_embedding else raw
        edge_hidden = max(1, round(width * cfg.mlp_ratio))
        message = edge_hidden if cfg.edge_mlp_ratio is None else max(1, round(width * cfg.edge_mlp_ratio))
        return GNNSection(edges, destinations, width, message, max(1, round(c * cfg.mlp_ratio)), cfg.mlp_hidden_layers,
                          (raw, edge_hidden) if cfg.edge_embedding and first_embeds else None)

    encoder_edges = section_edges(graph.encoder, data_cells, hidden, data_cells)
    processor_edges = section_edges(graph.processor, hidden, hidden, data_cells)
    decoder_edges = section_edges(graph.decoder, hidden, data_cells, data_cells)
    return GNNShape(section(model.encoder, encoder_edges, hidden), section(model.processor, processor_edges, hidden),
                    section(model.decoder, decoder_edges, data_cells), model.encoder.update_src_nodes,
                    max(1, round(c * model.decoder.mlp_ratio)) if model.node_embedding == "mlp" else 0)


def gnn_activation_elements(shape: GNNShape, *, channels: int, gpus_per_model: int, num_layers: int,
                            checkpointing: bool | str, encoder_checkpointing: bool | str,
                            data_cells: int) -> tuple[float, float]:
    """``(per step, transient)`` elements per sample on one rank: the GNN's encoder, processor and decoder
    (the module docstring) and the backward's peak transient (the decoder's widest per-edge gradients)."""
    c, k = channels, gpus_per_model
    data_local = -(-data_cells // k)
    hidden_local = -(-shape.processor.destinations // k)
    encoder = data_local * c if encoder_checkpointing else shape.encoder.block_elements(c, k)
    if shape.update_src_nodes:
        encoder += data_local * (2 * c + 2 * shape.encoder.mlp_layers * shape.encoder.node_hidden + 2 * c)
    layer = shape.processor.block_elements(c, k, embedded=False)
    first = shape.processor.block_elements(c, k, embedded=True)
    decoder = shape.decoder.block_elements(c, k)
    embeddings = 3 * data_local * (2 * shape.mlp_width + c) if shape.mlp_width else 0  # data, decoder data, head
    decoder_edges = -(-shape.decoder.edges // k)
    transient = decoder_edges * 2 * shape.decoder.edge_hidden + data_local * (2 + 2 * c)
    if checkpointing:  # each layer's inputs; one layer recomputed once the decoder's backward has freed the decoder
        processor = num_layers * (hidden_local * c + -(-shape.processor.edges // k) * shape.processor.edge_channels)
        transient = max(transient, first - decoder)
    else:
        processor = first + (num_layers - 1) * layer
    return encoder + processor + decoder + embeddings, transient
