"""The float64 references the kernels are tested against: the definitions, written out.

- :func:`dense_window_attention`: sliding-window attention as a dense ``(Lq, Lk)`` masked softmax
  (quadratic: tests and baselines only);
- :func:`graph_attention`: graph attention per edge (torch-geometric ``softmax`` and ``scatter``),
  with the edge embedding formed as an ``(E, heads, d)`` tensor.

Nothing is communicated here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["check_window_inputs", "dense_window_attention", "graph_attention", "GraphOperands", "graph_operands"]


def check_window_inputs(q: Tensor, k: Tensor, v: Tensor, window_size: int, block_size: int | None) -> None:
    """ValueError unless ``q`` ``(batch, heads, Lq, dim)``, ``k`` / ``v`` ``(batch, heads, Lk, dim)``,
    ``window_size`` and ``block_size`` describe a valid window attention call."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, k, v must be (batch, heads, seq, dim); got shapes {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)}"
        )
    if k.shape[:-1] != v.shape[:-1] or q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} disagree: k and v need the same "
            "(batch, heads, Lk), q the same (batch, heads) and the same dim as k"
        )
    if not isinstance(window_size, int) or isinstance(window_size, bool) or window_size < 0:
        raise ValueError(f"window_size must be a non-negative int, got {window_size!r}")
    if block_size is not None and (not isinstance(block_size, int) or block_size < 1):
        raise ValueError(f"block_size must be a positive int or None, got {block_size!r}")


def dense_window_attention(
    q: Tensor, k: Tensor, v: Tensor, window_size: int, q_offset: int = 0, k_offset: int = 0,
    *, scale: float | None = None,
) -> Tensor:
    """Reference from the definition: a dense ``(Lq, Lk)`` masked softmax (quadratic; tests and baselines).

    Same layout and semantics as :func:`stormshard.kernels.dispatch.sliding_window_attention`, rows without keys are zero.
    """
    check_window_inputs(q, k, v, window_size, None)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    pos_q = torch.arange(q.shape[-2], device=q.device) + q_offset
    pos_k = torch.arange(k.shape[-2], device=q.device) + k_offset
    mask = (pos_q[:, None] - pos_k[None, :]).abs() <= window_size
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.matmul(p, v)


def graph_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    edge_emb: Tensor,
    edge_index: Tensor,
    num_dst: int,
) -> Tensor:
    """Attention of each destination node over its incoming edges.

    ``query`` ``(num_dst, *batch, heads, d)``, ``key``/``value`` ``(num_src, *batch, heads, d)``,
    ``edge_emb`` ``(E, *batch or 1s, heads, d)`` (added to keys and values), ``edge_index``
    ``(2, E)``. Returns ``(num_dst, *batch, heads, d)`` in ``value``'s dtype; a destination without
    incoming edges gets zeros. The logits, the softmax statistics (max and sum per destination) and
    the weighted sum over edges are computed in fp32 whatever the input dtype (bf16 included).
    """
    # imported here: the kernels never load torch-geometric (~100 MB resident)
    from torch_geometric.utils import scatter, softmax

    src, dst = edge_index[0], edge_index[1]
    acc = torch.promote_types(value.dtype, torch.float32)
    k_j = key.index_select(0, src) + edge_emb
    v_j = value.index_select(0, src) + edge_emb
    q_i = query.index_select(0, dst)
    logits = (q_i.to(acc) * k_j.to(acc)).sum(dim=-1) / math.sqrt(query.shape[-1])  # (E, heads)
    weights = softmax(logits, dst, num_nodes=num_dst)
    out = scatter(weights.unsqueeze(-1) * v_j.to(acc), dst, dim=0, dim_size=num_dst, reduce="sum")
    return out.to(v_j.dtype)


@dataclass(frozen=True)
class GraphOperands:
    """A graph-attention call's sizes, checked once for every graph kernel (:func:`graph_operands`)."""

    num_dst: int
    heads: int
    head_dim: int
    batch_shape: tuple[int, ...]
    num_edges: int
    attr3: Tensor  # edge_attr as (E, 1 | prod(batch), F), a view where the layout allows

    @property
    def batch(self) -> int:
        return math.prod(self.batch_shape)


def graph_operands(query: Tensor, key: Tensor, value: Tensor, edge_attr: Tensor, edge_weight: Tensor,
                   edge_index: Tensor, num_dst: int | None) -> GraphOperands:
    """The checks every graph kernel makes on its inputs (the contract of
    :func:`stormshard.kernels.dispatch.graph_attention_kernel`), and the sizes they imply: ``query``
    ``(num_dst, *batch, heads, d)``, ``key`` / ``value`` ``(num_src, *batch, heads, d)``, ``edge_attr`` ``(E, F)``
    or ``(E, *batch, F)``, ``edge_weight`` ``(heads * d, F)``, ``edge_index`` an integer ``(2, E)``. A
    ValueError names the argument, the shapes and the fix."""
    num_dst = query.shape[0] if num_dst is None else num_dst
    if query.shape[0] != num_dst:
        raise ValueError(f"query has {query.shape[0]} rows but num_dst is {num_dst}: pass num_dst=query.shape[0]")
    if query.dim() < 3 or key.shape != value.shape or key.shape[1:] != query.shape[1:]:
        raise ValueError(
            f"query (num_dst, *batch, heads, d) and key/value (num_src, *batch, heads, d) must agree, got "
            f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )
    heads, d = query.shape[-2:]
    batch_shape = tuple(query.shape[1:-2])
    fdim = edge_attr.shape[-1]
    if edge_weight.shape != (heads * d, fdim):
        raise ValueError(f"edge_weight must be ({heads * d}, {fdim}) (heads * d, edge features), got "
                         f"{tuple(edge_weight.shape)}")
    if edge_index.device != query.device:
        raise ValueError(f"edge_index is on {edge_index.device} but query on {query.device}: move the edge index "
                         "(or the block holding it: block.to(device)) to the nodes' device")
    if edge_index.dim() != 2 or edge_index.shape[0] != 2 or edge_index.dtype.is_floating_point:
        raise ValueError(f"edge_index must be an integer (2, E) tensor, got {edge_index.dtype} "
                         f"{tuple(edge_index.shape)}")
    num_edges = edge_index.shape[1]
    if edge_attr.shape[0] != num_edges:
        raise ValueError(f"edge_attr has {edge_attr.shape[0]} rows but edge_index has {num_edges} edges")
    if edge_attr.dim() == 2:
        attr3 = edge_attr.unsqueeze(1)
    elif tuple(edge_attr.shape[1:-1]) == batch_shape:
        attr3 = edge_attr.reshape(num_edges, math.prod(batch_shape), fdim)
    elif all(s == 1 for s in edge_attr.shape[1:-1]):
        attr3 = edge_attr.reshape(num_edges, 1, fdim)
    else:
        raise ValueError(f"edge_attr batch dims {tuple(edge_attr.shape[1:-1])} do not match {batch_shape}: pass "
                         "edge_attr as (E, F) (shared by the batch) or (E, *batch, F)")
    return GraphOperands(num_dst, heads, d, batch_shape, num_edges, attr3)
