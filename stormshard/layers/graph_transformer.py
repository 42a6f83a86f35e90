"""Graph-transformer blocks: multi-head attention of every destination node over its incoming edges.

For an edge ``j -> i`` with edge features ``e_ji`` (per head ``h``, head size ``d``)::

    q_i = W_q n_dst(x_i)      k_j = W_k n_src(x_j) + W_e e_ji      v_j = W_v n_src(x_j) + W_e e_ji
    a_ji = softmax over the edges into i of (q_i . k_j / sqrt(d))
    x_i <- x_i + W_o (sum_j a_ji v_j [+ W_s n_dst(x_i)])
    x_i <- x_i + MLP(LayerNorm(x_i))

(pre-norm, residual; the bracketed term with ``self_projection=True``, anemoi-models'
``lin_self``, so that a block has anemoi's parameters and cost). ``qk_norm=True`` (anemoi's ``qk_norm``): ``q_i``
and ``W_k n_src(x_j)`` are layer-normed per head over ``d`` (``q_norm`` / ``k_norm``, no bias, weights shared by
the heads) before the edge term is added to the keys, as anemoi normalises them; ``mlp_kind`` a gated MLP
(:mod:`stormshard.layers.mlp`). The blocks compute the attention with
:func:`stormshard.kernels.graph_csr.fused_graph_attention` (CSR sampled products, segment
softmax and a sparse product; no ``(E, heads, d)`` tensor is formed or kept for the backward);
:func:`graph_attention` is the same math written out per edge (torch-geometric ``softmax`` and
``scatter``), kept as the reference. Layouts: node features ``(num_nodes, channels)``, ``edge_attr``
``(num_edges, edge_channels)``, ``edge_index`` ``(2, num_edges)`` row 0 source, row 1 destination.

Two variants, one return convention each (shared with the GNN blocks of :mod:`stormshard.layers.gnn`):

- :class:`GraphTransformerMapperBlock`: bipartite (encoder data -> hidden, decoder hidden -> data),
  separate source and destination node sets, norms and channel counts; ``forward(x_src, x_dst,
  edge_attr)`` returns the updated destinations only (every mapper block does).
- :class:`GraphTransformerProcessorBlock`: one node set (hidden -> hidden); ``forward(x,
  edge_attr)`` returns ``(x, edge_attr)`` like every processor block, so that a processor chains
  blocks the same way whether they update the edges (GNN) or not (this block: unchanged).

Graph and shard context: every block takes its :class:`~stormshard.parallel.graph.GraphShardPlan`
once, at construction; the plan binds the edge index and the process group. One process uses the
one-rank plan ``GraphShardPlan.build(edge_index, num_nodes)``. Node inputs are this rank's node
slices (``plan.shard_src`` / ``plan.shard_dst``; everything with one rank) and ``edge_attr`` the
plan's edges in plan order (``plan.shard_edges(edge_attr)``; edges sorted by destination, also
with one rank). The normalised source features go through one halo exchange per block (forward
and backward, over the plan's group; nothing with one rank), overlapped with the projection of the
local rows to keys and values (:func:`~stormshard.parallel.halo_projection.halo_linear`); the output is this rank's
destination slice. Parameters are replicated: the caller sums their gradients over the model
group (as DDP does).

Chunking: ``num_chunks > 1`` processes the edges in destination-node chunks with activation
checkpointing per chunk (see :mod:`stormshard.layers.chunking`); results are equal.

Memory (``lean=True``, the default; ``model.lean_activations``): on large node sets the norms run inside the
projections that follow them (:func:`~stormshard.layers.norm_linear.norm_linear`: the input kept for the
backward, not its normed copy) and the MLP keeps one hidden activation and walks its backward by row chunks
(:class:`~stormshard.layers.row_chunked_mlp.RowChunkedMLP`, its norm inside); the same numbers, fewer
activations. Below the thresholds, or with ``lean=False``, the plain composition.
"""

from __future__ import annotations

import torch
from einops import rearrange
from torch import Tensor, nn

from stormshard.kernels.dispatch import check_graph_kernel, graph_attention_kernel
from stormshard.kernels.names import GraphKernel
from stormshard.layers.attention import qk_norms
from stormshard.layers.checkpointing import unwrapped_modules
from stormshard.layers.chunking import (
    check_num_chunks,
    chunk_edge_indices,
    map_destination_chunks,
    precompute_chunks,
)
from stormshard.layers.graph_inputs import (
    PlanFollowsModule,
    check_local_rows,
    check_node_and_edge_shapes,
    check_plan,
    check_positive_int,
)
from stormshard.layers.mlp import mlp_hidden_width
from stormshard.layers.mlp_kinds import MLPKind
from stormshard.layers.norm import LayerNorm
from stormshard.layers.norm_linear import MIN_ELEMENTS as NORM_LINEAR_MIN_ELEMENTS
from stormshard.layers.norm_linear import keeps_norm_input, norm_linear
from stormshard.layers.row_chunked_mlp import MIN_ELEMENTS as MLP_MIN_ELEMENTS
from stormshard.layers.row_chunked_mlp import RowChunkedMLP
from stormshard.parallel.graph import GraphShardPlan
from stormshard.parallel.halo_projection import halo_linear

__all__ = ["GraphTransformerMapperBlock", "GraphTransformerProcessorBlock", "set_graph_kernel"]


def _mlp(channels: int, ratio: float, lean: bool, kind: MLPKind = "mlp") -> RowChunkedMLP:
    # Linear, GELU (or a gate), Linear (nn.Sequential's keys); on very many rows (lean) it keeps fc1's output only
    return RowChunkedMLP(channels, mlp_hidden_width(channels, ratio), min_elements=MLP_MIN_ELEMENTS if lean else None,
                         kind=kind)


class _GraphTransformerBase(PlanFollowsModule):
    """Shared parts: projections, attention over chunks, output projection and MLP."""

    def __init__(
        self,
        src_channels: int,
        dst_channels: int,
        edge_channels: int,
        num_heads: int,
        mlp_ratio: float,
        num_chunks: int,
        hidden_dim: int | None,
        self_projection: bool = False,
        graph_kernel: GraphKernel = "auto",
        lean: bool = True,
        qk_norm: bool = False,
        mlp_kind: MLPKind = "mlp",
    ) -> None:
        super().__init__()
        check_graph_kernel(graph_kernel)
        self.graph_kernel = graph_kernel
        for name, value in (("src_channels", src_channels), ("dst_channels", dst_channels),
                            ("edge_channels", edge_channels), ("num_heads", num_heads)):
            check_positive_int(name, value)
        hidden_dim = dst_channels if hidden_dim is None else check_positive_int("hidden_dim", hidden_dim)
        if hidden_dim % num_heads:
            raise ValueError(
                f"hidden_dim {hidden_dim} is not divisible by num_heads {num_heads}: choose heads "
                "that divide it (or set hidden_dim)"
            )
        if not mlp_ratio > 0:
            raise ValueError(f"mlp_ratio must be positive, got {mlp_ratio}")
        self.num_heads, self.hidden_dim = num_heads, hidden_dim
        self.num_chunks = check_num_chunks(num_chunks)
        self.src_channels, self.dst_channels, self.edge_channels = src_channels, dst_channels, edge_channels
        self.to_q = nn.Linear(dst_channels, hidden_dim)
        self.to_k = nn.Linear(src_channels, hidden_dim)
        self.to_v = nn.Linear(src_channels, hidden_dim)
        self.to_e = nn.Linear(edge_channels, hidden_dim)
        # anemoi's lin_self: a projection of the normed destination added to the attention output
        self.to_self = nn.Linear(dst_channels, hidden_dim) if self_projection else None
        self.proj = nn.Linear(hidden_dim, dst_channels)
        # anemoi's q_norm / k_norm (qk_norm; None: none): per head over hidden_dim / num_heads
        self.q_norm, self.k_norm = qk_norms(hidden_dim // num_heads, qk_norm)
        self.norm_mlp = LayerNorm(dst_channels)
        self.mlp = _mlp(dst_channels, mlp_ratio, lean, mlp_kind)
        # the norms inside their projections from this many input entries on (None: never; module docstring)
        self.norm_linear_min: int | None = NORM_LINEAR_MIN_ELEMENTS if lean else None

    def _check_channels(self, x_src: Tensor, x_dst: Tensor, edge_attr: Tensor) -> None:
        check_node_and_edge_shapes(x_src, x_dst, edge_attr, self.src_channels, self.dst_channels, self.edge_channels)

    def _attend(self, x_src: Tensor, x_dst: Tensor, edge_attr: Tensor, plan: GraphShardPlan, norm_src: LayerNorm,
                norm_dst: LayerNorm) -> Tensor:
        """Norms, attention + residual + MLP. ``x_src`` ``(num_src_local, C_src)`` (this rank's rows) and
        ``x_dst`` are the block's inputs, ``norm_src`` / ``norm_dst`` their pre-norms.

        Keys and values are projected once per source node, the halo rows' exchange overlapped
        with the local rows' projection (:func:`~stormshard.parallel.halo_projection.halo_linear`);
        everything per destination (query, attention over its edges, output projection,
        residuals, MLP) runs inside the chunk of its destination range, so with checkpointing only
        the chunk outputs stay alive. On inputs of at least :data:`~stormshard.layers.norm_linear.MIN_ELEMENTS`
        entries (while gradients are recorded) the projections that follow a norm keep the norm's input, not its
        output, for the backward (:func:`~stormshard.layers.norm_linear.norm_linear`; keys and values so where no
        halo is exchanged), and the MLP its input (:class:`~stormshard.layers.row_chunked_mlp.RowChunkedMLP`).
        """
        heads = self.num_heads
        split = "n ... (h d) -> n ... h d"
        one_set = x_src is x_dst and norm_src is norm_dst  # a processor block: one norm of one node set
        h_src = None
        if keeps_norm_input(x_src, self.norm_linear_min) and sum(plan.halo_per_rank) == 0:
            k, v = norm_linear(x_src, norm_src, (self.to_k, self.to_v))
        else:
            h_src = norm_src(x_src)
            k, v = halo_linear(plan, h_src, (self.to_k.weight, self.to_v.weight), (self.to_k.bias, self.to_v.bias))
        k, v = rearrange(k, split, h=heads), rearrange(v, split, h=heads)
        if self.k_norm is not None:  # per source row and head, before the edge term joins the keys (anemoi's order)
            k = self.k_norm(k)
        edge_index = plan.edge_index
        w_e, b_e = self.to_e.weight, self.to_e.bias
        if one_set and h_src is not None:  # the normed nodes are kept for the keys already: the queries share them
            fused_dst, h_dst = False, h_src
        else:
            fused_dst = keeps_norm_input(x_dst, self.norm_linear_min)
            h_dst = None if fused_dst else norm_dst(x_dst)
        dst_linears = (self.to_q,) if self.to_self is None else (self.to_q, self.to_self)

        def rows(x: Tensor, first: int, end: int) -> Tensor:
            # all rows: the tensor itself (a full slice would add a backward that zero-fills and copies)
            return x if first == 0 and end == x.shape[0] else x[first:end]

        def chunk(ids: Tensor | None, first: int, end: int) -> tuple[Tensor]:
            # a chunk's destination-local edge index was built once (its kernel structures are cached on it)
            index, attr = (edge_index, edge_attr) if ids is None else (self.chunk_index[first], edge_attr[ids])
            if fused_dst:
                projected = norm_linear(rows(x_dst, first, end), norm_dst, dst_linears)
            else:
                q_in = rows(h_dst, first, end)
                projected = [linear(q_in) for linear in dst_linears]
            q = rearrange(projected[0], split, h=heads)
            if self.q_norm is not None:
                q = self.q_norm(q)
            # the edge embedding to_e(attr) added to keys and values, never formed as an (E, heads, d)
            # tensor; logits, softmax statistics and sums in fp32 whatever the compute dtype (bf16);
            # the kernel (csr or triton) chosen by stormshard.kernels.dispatch
            attn = graph_attention_kernel(self.graph_kernel, q, k, v, attr, w_e, b_e, index, end - first)
            attn = rearrange(attn, "n ... h d -> n ... (h d)")
            if self.to_self is not None:
                attn = attn + projected[1]
            x = rows(x_dst, first, end) + self.proj(attn)
            return (x + self.mlp(x, self.norm_mlp),)

        outs, _ = map_destination_chunks(chunk, edge_index, x_dst.shape[0], self.num_chunks, chunks=self.edge_chunks)
        return outs[0][0] if len(outs) == 1 else torch.cat([o[0] for o in outs], dim=0)


class GraphTransformerMapperBlock(_GraphTransformerBase):
    """Bipartite graph-transformer block (encoder data -> hidden, decoder hidden -> data).

    Built with the graph's ``plan`` (``num_nodes=(num_source, num_destination)``).
    ``forward(x_src (N_src_local, [*batch,] src_channels), x_dst (N_dst_local, [*batch,]
    dst_channels), edge_attr (E_local, edge_channels))`` returns the updated destinations
    ``(N_dst_local, [*batch,] dst_channels)``. Communicates one halo exchange of the normed
    sources over the plan's group (forward and backward).
    """

    def __init__(
        self,
        src_channels: int,
        dst_channels: int,
        edge_channels: int,
        num_heads: int,
        plan: GraphShardPlan,
        mlp_ratio: float = 4.0,
        num_chunks: int = 1,
        hidden_dim: int | None = None,
        self_projection: bool = False,
        graph_kernel: GraphKernel = "auto",
        lean: bool = True,
        qk_norm: bool = False,
        mlp_kind: MLPKind = "mlp",
    ) -> None:
        super().__init__(src_channels, dst_channels, edge_channels, num_heads, mlp_ratio, num_chunks, hidden_dim,
                         self_projection, graph_kernel, lean, qk_norm, mlp_kind)
        self.plan = check_plan(plan, processor=False)
        # the edge chunks, once (not inside a compiled forward: their sizes depend on the edges)
        self.edge_chunks = precompute_chunks(self.plan.edge_index, self.plan.num_dst_local, self.num_chunks)
        self.chunk_index = chunk_edge_indices(self.plan.edge_index, self.edge_chunks)
        self.norm_src = LayerNorm(src_channels)
        self.norm_dst = LayerNorm(dst_channels)

    def forward(self, x_src: Tensor, x_dst: Tensor, edge_attr: Tensor) -> Tensor:
        self._check_channels(x_src, x_dst, edge_attr)
        check_local_rows(self.plan, x_src.shape[0], x_dst.shape[0], edge_attr)
        return self._attend(x_src, x_dst, edge_attr, self.plan, self.norm_src, self.norm_dst)


class GraphTransformerProcessorBlock(_GraphTransformerBase):
    """Graph-transformer block on one node set (processor, hidden -> hidden).

    Built with the graph's ``plan`` (``num_nodes=<int>``). ``forward(x (N_local, [*batch,]
    channels), edge_attr (E_local, edge_channels))`` returns ``(x', edge_attr)``: the updated
    nodes and the edge attributes unchanged (the processor-block convention; GNN blocks update
    them). Communicates one halo exchange of the normed nodes over the plan's group.
    """

    def __init__(
        self,
        channels: int,
        edge_channels: int,
        num_heads: int,
        plan: GraphShardPlan,
        mlp_ratio: float = 4.0,
        num_chunks: int = 1,
        hidden_dim: int | None = None,
        self_projection: bool = False,
        graph_kernel: GraphKernel = "auto",
        lean: bool = True,
        qk_norm: bool = False,
        mlp_kind: MLPKind = "mlp",
    ) -> None:
        super().__init__(channels, channels, edge_channels, num_heads, mlp_ratio, num_chunks, hidden_dim,
                         self_projection, graph_kernel, lean, qk_norm, mlp_kind)
        self.plan = check_plan(plan, processor=True)
        # the edge chunks, once (not inside a compiled forward: their sizes depend on the edges)
        self.edge_chunks = precompute_chunks(self.plan.edge_index, self.plan.num_dst_local, self.num_chunks)
        self.chunk_index = chunk_edge_indices(self.plan.edge_index, self.edge_chunks)
        self.norm = LayerNorm(channels)

    def forward(self, x: Tensor, edge_attr: Tensor) -> tuple[Tensor, Tensor]:
        self._check_channels(x, x, edge_attr)
        check_local_rows(self.plan, x.shape[0], x.shape[0], edge_attr)
        return self._attend(x, x, edge_attr, self.plan, self.norm, self.norm), edge_attr


def set_graph_kernel(model: nn.Module, kernel: GraphKernel) -> int:
    """Make every graph-transformer block of ``model`` compute its attention with ``kernel``
    (``"auto"``, ``"csr"``, ``"triton"``: :mod:`stormshard.kernels.dispatch`); returns how many blocks
    changed. The kernels compute the same function (to round-off): a model trained with one runs with
    another. An unknown kernel is a ValueError; one that cannot run on the model's device fails at
    its first call, naming the reason."""
    check_graph_kernel(kernel)
    blocks = [m for m in unwrapped_modules(model) if isinstance(m, _GraphTransformerBase)]
    for block in blocks:
        block.graph_kernel = kernel
    return len(blocks)
