"""The AIFS-style encoder-processor-decoder forecast model.

Layout: input ``x`` is ``(batch, time, grid_local, input_variables)`` (normalised, the last
``multistep_input`` states, this rank's grid slice); output ``(batch, grid_local,
output_variables)``: the next state, normalised. Top to bottom:

1. data nodes: the input states, the grid coordinates (sin/cos of lat and lon) and a trainable
   per-node embedding, linearly embedded to ``num_channels`` (GNN ``node_embedding: "mlp"``: an MLP);
2. hidden nodes: coordinates and a trainable embedding, embedded likewise;
3. encoder: graph mapper data -> hidden (halo exchange of the data nodes its edges read);
4. processor on the hidden nodes (sliding-window transformer, graph transformer or GNN);
5. decoder: graph mapper hidden -> data, onto the data-node latents of step 1 (GNN
   ``encoder.update_src_nodes``: as the encoder's node MLP updated them);
6. a linear head to the output variables (GNN ``head: "mlp"``: an MLP), plus the last input state of every prognostic
   variable (residual prediction; ``residual: "truncated"``: that state through the graph's coarser
   truncation grid and back, :class:`~stormshard.layers.truncation.TruncatedResidual`).

Every layer runs on this rank's node slices (``ModelShardPlan``); nothing is gathered: the
loss consumes the sharded output. Parameters are replicated over the model group (except
tensor-parallel slices): the trainer sums their gradients over the group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from einops import rearrange
from torch import Tensor, nn

from stormshard.graphs.builder import DECODER, ENCODER, PROCESSOR, TRUNCATION_DOWN, TRUNCATION_UP
from stormshard.graphs.hetero import HeteroGraph
from stormshard.layers.bounding import OutputBounding
from stormshard.layers.gnn import EdgeBufferPool, GNNMapperBlock, gnn_mlp
from stormshard.layers.graph_transformer import GraphTransformerMapperBlock
from stormshard.layers.norm import LayerNorm
from stormshard.layers.norm_linear import MIN_ELEMENTS as NORM_LINEAR_MIN_ELEMENTS
from stormshard.layers.norm_linear import keeps_norm_input, norm_linear
from stormshard.layers.truncation import TruncatedResidual
from stormshard.models.config import ModelConfig
from stormshard.models.processors import GraphProcessor, TrainableEdges, WindowTransformerProcessor
from stormshard.models.sharding import ModelShardPlan
from stormshard.models.variables import VariableIndex
from stormshard.parallel.graph import GraphShardPlan

__all__ = ["EncoderProcessorDecoder", "coordinate_features"]


def coordinate_features(latlon: Tensor) -> Tensor:
    """``(nodes, 4)`` = sin/cos of latitude and longitude from ``(nodes, 2)`` radians."""
    lat, lon = latlon[:, 0], latlon[:, 1]
    return torch.stack([lat.sin(), lat.cos(), lon.sin(), lon.cos()], dim=-1)


class EncoderProcessorDecoder(nn.Module):
    """Graph encoder, processor and graph decoder over a grid sharded as ``plan`` describes.

    The constructor builds the single-device-looking model on this rank's node slices (``plan``:
    the model group, the node slices, the graph plans and the processor's shard strategy, bound
    here once; build it with ``processor_graph=config.uses_graph_processor``);
    :func:`~stormshard.models.registry.build_model` builds the plan and then applies
    :func:`~stormshard.models.parallelize.parallelize` (tensor-parallel blocks, checkpointing).
    """

    def __init__(self, config: ModelConfig, graph: HeteroGraph, variables: VariableIndex,
                 plan: ModelShardPlan) -> None:
        super().__init__()
        if not isinstance(plan, ModelShardPlan):
            raise TypeError(f"plan must be a ModelShardPlan (ModelShardPlan.build(graph, model_group, ...)), "
                            f"got {type(plan).__name__}")
        self.config, self.variables, self.plan = config, variables, plan
        c, t = config.num_channels, config.trainable_size
        n_in, n_out = len(variables.input_names), len(variables.output_names)
        data_slice, hidden_slice = self.plan.data_slice, self.plan.hidden_slice
        # one pool of recycled buffers for every GNN block of the model (encoder, processor, decoder):
        # a buffer freed by one layer serves the next (a plain attribute, not state)
        self.edge_buffer_pool = EdgeBufferPool()

        self.register_buffer("data_coords", coordinate_features(graph["data"].x[data_slice].double()).float(),
                             persistent=False)
        self.register_buffer("hidden_coords", coordinate_features(graph["hidden"].x[hidden_slice].double()).float(),
                             persistent=False)
        self.data_embedding = nn.Parameter(torch.randn(self.plan.num_data, t) * 0.02)
        self.hidden_embedding = nn.Parameter(torch.randn(self.plan.num_hidden, t) * 0.02)
        data_inputs = config.multistep_input * n_in + 4 + t + self.extra_data_inputs()
        self.embed_data = self._node_embedding(data_inputs)
        self.embed_hidden = self._node_embedding(4 + t)
        # anemoi's decoder emb_nodes_dst: its own embedding of the data-node inputs (else: the encoder's)
        self.embed_data_decoder = self._node_embedding(data_inputs) if config.decoder_embedding else None

        enc_attr, dec_attr = graph[ENCODER].edge_attr, graph[DECODER].edge_attr
        if config.encoder.trainable_edge_size or config.decoder.trainable_edge_size:
            self.encoder_edges = TrainableEdges(enc_attr, self.plan.encoder, config.encoder.trainable_edge_size)
            self.decoder_edges = TrainableEdges(dec_attr, self.plan.decoder, config.decoder.trainable_edge_size)
            enc_channels, dec_channels = self.encoder_edges.channels, self.decoder_edges.channels
        else:  # the original layout: plain buffers (parameter and buffer names unchanged)
            self.register_buffer("encoder_edge_attr", self.plan.encoder.shard_edges(enc_attr), persistent=False)
            self.register_buffer("decoder_edge_attr", self.plan.decoder.shard_edges(dec_attr), persistent=False)
            enc_channels, dec_channels = enc_attr.shape[1], dec_attr.shape[1]
        self.encoder = self._mapper(config.encoder, enc_channels, self.plan.encoder)
        self.processor = self.build_processor(graph)
        self.decoder = self._mapper(config.decoder, dec_channels, self.plan.decoder)
        self.head = self._mlp_head(n_out) if config.head == "mlp" else nn.Sequential(LayerNorm(c), nn.Linear(c, n_out))
        # model.lean_activations: the head's norm inside its product on large grids (layers.norm_linear)
        self.head_norm_linear_min: int | None = NORM_LINEAR_MIN_ELEMENTS if config.lean_activations else None
        unknown = sorted(set(config.relu_bounded) - set(variables.output_names))
        if unknown:
            raise ValueError(f"model.relu_bounded names {unknown}, which are not output variables "
                             f"({list(variables.output_names)}): name output variables or drop them")
        self.register_buffer("relu_columns", torch.tensor(
            [variables.output_names.index(v) for v in config.relu_bounded], dtype=torch.long), persistent=False)
        # anemoi's other boundings (hardtanh, fractions, leaky and normalized kinds), after relu_bounded, in order
        self.bounding = OutputBounding(config.bounding, variables.output_names) if config.bounding else None

        # residual prediction: output column prognostic_in_output[i] adds input column prognostic_in_input[i]
        self.register_buffer("prognostic_in_input", torch.tensor(variables.prognostic_in_input, dtype=torch.long),
                             persistent=False)
        self.register_buffer("prognostic_in_output", torch.tensor(variables.prognostic_in_output, dtype=torch.long),
                             persistent=False)
        self.truncation = self.build_truncation(graph) if config.residual == "truncated" else None

    @property
    def model_group(self) -> dist.ProcessGroup | None:
        """The model-communication group the model is sharded over (None: one process)."""
        return self.plan.group

    def build_processor(self, graph: HeteroGraph) -> nn.Module:
        """The processor named by the config, on this rank's hidden nodes."""
        if self.config.uses_graph_processor:
            return GraphProcessor(self.config, self.plan, graph[PROCESSOR].edge_attr,
                                  buffer_pool=self.edge_buffer_pool)
        return WindowTransformerProcessor(self.config, self.plan)

    def build_truncation(self, graph: HeteroGraph) -> TruncatedResidual:
        """The truncated residual on this rank's data rows, from the graph's truncation projections."""
        missing = [t for t in (TRUNCATION_DOWN, TRUNCATION_UP) if t not in graph or "edge_weight" not in graph[t]]
        if missing or "truncation" not in graph.node_types:
            raise ValueError(
                f"model.residual='truncated' but the graph has no truncation grid (missing {missing or ['truncation']}"
                "): set graph.truncation (e.g. {\"grid\": \"o32\"}) so the graph is built with it, use a graph file "
                "that has it, or set model.residual='last_step'"
            )
        down, up = graph[TRUNCATION_DOWN], graph[TRUNCATION_UP]
        return TruncatedResidual(down.edge_index, down.edge_weight, up.edge_index, up.edge_weight,
                                 graph["truncation"].num_nodes, self.plan.data_shard)

    def _node_embedding(self, in_channels: int) -> nn.Module:
        """A node embedding ``(nodes, [batch,] in_channels) -> (..., num_channels)``: one Linear, or with
        ``node_embedding: "mlp"`` the encoder's GNN MLP (anemoi's ``emb_nodes_src`` / ``emb_nodes_dst``)."""
        c, enc = self.config.num_channels, self.config.encoder
        if self.config.node_embedding == "linear":
            return nn.Linear(in_channels, c)
        return gnn_mlp(in_channels, max(1, round(c * enc.mlp_ratio)), c, enc.mlp_hidden_layers,
                       buffer_pool=self.edge_buffer_pool)

    def _mlp_head(self, n_out: int) -> nn.Sequential:
        """``head: "mlp"``: ``decoder.mlp_hidden_layers`` (Linear, GELU) pairs of width ``num_channels x
        decoder.mlp_ratio``, then Linear to the outputs, no norm (anemoi's GNN ``node_data_extractor``)."""
        c, dec = self.config.num_channels, self.config.decoder
        hidden = max(1, round(c * dec.mlp_ratio))
        layers: list[nn.Module] = []
        for i in range(dec.mlp_hidden_layers):
            layers += [nn.Linear(c if i == 0 else hidden, hidden), nn.GELU()]
        return nn.Sequential(*layers, nn.Linear(hidden, n_out))

    def _mapper(self, cfg, edge_channels: int, plan: GraphShardPlan) -> nn.Module:  # noqa: ANN001
        """The encoder or decoder block (config section ``cfg``) on its graph's plan; ``forward(x_src,
        x_dst, edge_attr)`` returns the destination nodes. GNN: with ``edge_embedding`` the raw
        ``edge_channels`` are embedded to ``num_channels`` inside the block."""
        c = self.config.num_channels
        if self.config.name == "gnn":
            width, embedded = (c, edge_channels) if cfg.edge_embedding else (edge_channels, None)
            return GNNMapperBlock(c, c, width, plan, mlp_ratio=cfg.mlp_ratio, num_chunks=cfg.num_chunks,
                                  mlp_hidden_layers=cfg.mlp_hidden_layers, edge_in_channels=embedded,
                                  aggregate_updated_edges=cfg.aggregate_updated_edges,
                                  edge_mlp_ratio=cfg.edge_mlp_ratio, buffer_pool=self.edge_buffer_pool)
        return GraphTransformerMapperBlock(c, c, edge_channels, cfg.num_heads, plan, mlp_ratio=cfg.mlp_ratio,
                                           num_chunks=cfg.num_chunks, self_projection=cfg.self_projection,
                                           graph_kernel=self.config.graph_kernel,
                                           lean=self.config.lean_activations, qk_norm=cfg.qk_norm,
                                           mlp_kind=cfg.mlp_implementation)

    def extra_data_inputs(self) -> int:
        """Data-node input channels after the trainable ones (``encode``'s ``extra``); none here."""
        return 0

    def check_input(self, x: Tensor) -> None:
        expect = (self.config.multistep_input, self.plan.data_sizes[self.plan.rank], len(self.variables.input_names))
        if x.dim() != 4 or tuple(x.shape[1:]) != expect:
            raise ValueError(
                f"model input has shape {tuple(x.shape)}, expected (batch, multistep_input={expect[0]}, "
                f"grid_local={expect[1]}, input_variables={expect[2]})"
            )

    def encode(self, x: Tensor, extra: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Steps 1-3: ``x`` -> data-node latents ``(grid_local, batch, C)`` and hidden latents ``(hidden_local, batch, C)``.

        ``extra``: ``(grid_local, batch, extra_data_inputs())`` more data-node inputs, after the trainable ones."""
        self.check_input(x)
        batch = x.shape[0]
        data_slice, hidden_slice = self.plan.data_slice, self.plan.hidden_slice
        # compute dtype: bf16 under DeepSpeed's bf16 mode, else the parameters'
        dtype = next(self.embed_data.parameters()).dtype
        states = rearrange(x, "b t g v -> g b (t v)").to(dtype)
        data_static = torch.cat([self.data_coords.to(dtype), self.data_embedding[data_slice]], dim=-1)
        data_in = torch.cat([states, data_static.unsqueeze(1).expand(-1, batch, -1)], dim=-1)
        if extra is not None:
            data_in = torch.cat([data_in, extra.to(dtype)], dim=-1)
        x_data = self.embed_data(data_in)
        hidden_static = torch.cat([self.hidden_coords.to(dtype), self.hidden_embedding[hidden_slice]], dim=-1)
        x_hidden = self.embed_hidden(hidden_static).unsqueeze(1).expand(-1, batch, -1)
        x_hidden = self.encoder(x_data, x_hidden, self.edges("encoder"))
        if self.config.encoder.update_src_nodes:  # anemoi's GNN: the decoder reads the encoder-updated data latents
            x_data = self.encoder.update_sources(x_data)
        if self.embed_data_decoder is not None:  # anemoi: the decoder embeds the raw data-node inputs itself
            x_data = self.embed_data_decoder(data_in)
        return x_data, x_hidden

    def edges(self, which: str) -> Tensor:
        """This rank's edge features of the encoder or decoder graph (trainable ones appended)."""
        module = getattr(self, f"{which}_edges", None)
        return module() if module is not None else getattr(self, f"{which}_edge_attr")

    def carried_state(self, x: Tensor) -> Tensor:
        """The residual's prognostic part ``(batch, grid_local, prognostic)`` (``prognostic_in_input`` order) of an
        input ``x`` ``(batch, time, grid_local, input_variables)``: its last state, through the truncation grid
        and back with ``residual: "truncated"`` (which communicates over the model group)."""
        carried = x[:, -1].index_select(-1, self.prognostic_in_input)
        if self.truncation is not None:  # anemoi's TruncatedConnection: through the coarse grid and back
            carried = self.truncation(carried)
        return carried

    def decode(self, x_hidden: Tensor, x_data: Tensor, x: Tensor, carried: Tensor | None = None) -> Tensor:
        """Steps 5-6: processed hidden latents -> the next state ``(batch, grid_local, output_variables)``;
        ``carried``: :meth:`carried_state` of ``x`` when the caller has it already."""
        x_data = self.decoder(x_hidden, x_data, self.edges("decoder"))
        if self.config.head == "mlp":
            head = self.head(x_data)
        elif keeps_norm_input(x_data, self.head_norm_linear_min):  # the head's norm inside its product: x_data kept
            head = norm_linear(x_data, self.head[0], [self.head[1]])[0]
        else:
            head = self.head(x_data)
        out = rearrange(head, "g b v -> b g v")
        # the carried state is added in the input's dtype (fp32 in training), never rounded to bf16
        last = x[:, -1]
        carried = self.carried_state(x) if carried is None else carried
        residual = last.new_zeros(out.shape).index_copy(-1, self.prognostic_in_output, carried)
        out = out.to(last.dtype) + residual
        if self.relu_columns.numel():  # anemoi's ReluBounding, after the residual (normalised units)
            out = out.index_copy(-1, self.relu_columns, torch.relu(out.index_select(-1, self.relu_columns)))
        if self.bounding is not None:
            out = self.bounding(out)
        return out

    def forward(self, x: Tensor) -> Tensor:
        x_data, x_hidden = self.encode(x)
        x_proc = self.processor(x_hidden)
        if self.config.latent_skip:  # anemoi's latent skip around the processor
            x_proc = x_proc + x_hidden
        return self.decode(x_proc, x_data, x)
