"""Fused graph kernels: CSR graph attention and sum aggregation without per-edge feature tensors.

The straightforward graph attention (:func:`stormshard.layers.graph_transformer.graph_attention`)
gathers keys, values and queries per edge, ``(E, heads, d)`` each, adds the projected edge
embedding ``(E, heads, d)``, and lets autograd keep several of them per layer. On a CPU every
such tensor is a fresh ``E x channels`` allocation (34 MB at 33k edges x 256 channels, above
glibc's mmap threshold, so page-faulted on every call) and one memory pass per op.

:func:`fused_graph_attention` computes the same thing with the graph as a sparse CSR matrix whose
rows are ``(destination node, head)`` pairs and whose columns are ``(source node, head)`` pairs
(a block-diagonal-per-head adjacency; ``nnz = E x heads``):

- logits: one sampled dense-dense product (``torch.sparse.sampled_addmm``, SDDMM) of the queries
  and keys; the edge-embedding term ``q_i . (W_e a_ji + b_e)`` is ``(W_e^T q_i) . a_ji + q_i . b_e``,
  so the edge embedding ``(E, channels)`` is never formed: only ``(E x heads, edge_channels)``;
- softmax over each row (the edges into one node, per head) with ``torch.segment_reduce``;
- output: one sparse-dense product (SpMM) ``alpha @ values`` plus ``W_e (sum_j alpha_ji a_ji) + b_e``.

The backward is written out (SDDMM for the gradient of the weights, SpMM with the transposed
pattern for keys and values) and autograd keeps only the queries, keys, values (node tensors),
the edge attributes and the ``E x heads`` attention weights: nothing of size ``E x channels``.
Forward and backward are torch custom ops (``stormshard::fused_graph_attention`` and its
``_backward``), opaque to torch.compile: a compiled graph block has no graph break here, and the
CSR structure below is looked up inside the op.

:func:`segment_sum` sums edge rows into destination nodes (``index_add_``; its backward is a
gather), the aggregation of the GNN blocks.

The CSR structure of a graph (row pointers, column ids, the transposed pattern and the maps
between them) depends only on ``edge_index``, the node counts and the number of heads; it is
cached per ``edge_index`` tensor (keyed by the tensor's identity, storage and version, so an
in-place change or a new tensor rebuilds it).
"""

from __future__ import annotations

import math
import warnings
import weakref
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from stormshard.kernels.attention_ops import use_registered_op
from stormshard.kernels.kept_outputs import kept_or_computed
from stormshard.kernels.reference import graph_operands

__all__ = ["fused_graph_attention", "segment_sum", "csr_structure", "cached_structures", "CsrStructure", "csr_matrix",
           "csr_index", "spmm"]


# --------------------------------------------------------------------------------------------
# CSR structure of a graph with heads
# --------------------------------------------------------------------------------------------


def csr_matrix(crow: Tensor, col: Tensor, values: Tensor, shape: tuple[int, int]) -> Tensor:
    """A ``shape`` CSR tensor (no invariant check: the structures below build valid ones)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "Sparse CSR tensor support is in beta state"
        return torch.sparse_csr_tensor(crow, col, values, shape, check_invariants=False)


def csr_index(index: Tensor, nnz: int, size: int) -> Tensor:
    """``index`` as the dtype of CSR row pointers and column ids: int32 when ``nnz`` and the
    matrix sizes fit (MKL's sparse kernels take 32-bit indices: with int64 ones every product
    first copies them to int32), else int64."""
    return index.int() if max(nnz, size) < 2**31 - 1 else index.long()


def spmm(matrix: Tensor, dense: Tensor) -> Tensor:
    """``matrix @ dense`` for a CSR ``matrix`` ``(R, S)`` and a dense ``(S, d)``: ``(R, d)``.

    Written into a fresh output by ``addmm(out, matrix, dense, beta=0, out=out)`` (``beta=0``: the
    output's contents are ignored): the same products and sums as ``matrix @ dense``, without the
    zero-filled ``input`` and its copy into the result that ``@`` goes through on a CPU."""
    out = dense.new_empty((matrix.shape[0], dense.shape[1]))
    return torch.addmm(out, matrix, dense, beta=0.0, out=out)


@dataclass(frozen=True, eq=False)
class CsrStructure:
    """The head-expanded adjacency of a graph, in CSR form, and its transpose.

    Rows of ``A`` are ``row = dst * heads + g``, columns ``src * heads + g`` (``g`` the head; a
    batch dimension is folded into the heads). ``crow``, ``col``, ``crow_t`` and ``col_t`` are
    int32 where the sizes allow (:func:`csr_index`), the other index tensors int64. Entry ``i`` of ``A`` (CSR order: by row, then by
    source id) belongs to edge ``edge_of[i]`` (an id in the caller's ``edge_index`` order) and
    head ``head_of[i]``. ``crow_t``, ``col_t`` describe ``A^T`` with ``perm_t`` mapping its
    entries to ``A``'s (``values_t = values[perm_t]``).
    """

    num_src: int
    num_dst: int
    heads: int
    num_edges: int
    crow: Tensor
    col: Tensor
    row_of: Tensor
    edge_of: Tensor
    head_of: Tensor
    lengths: Tensor
    crow_t: Tensor
    col_t: Tensor
    perm_t: Tensor
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def nnz(self) -> int:
        return self.num_edges * self.heads

    def matrix(self, values: Tensor) -> Tensor:
        """``A`` with ``values`` (CSR order) as a ``(num_dst * heads, num_src * heads)`` CSR tensor."""
        return csr_matrix(self.crow, self.col, values, (self.num_dst * self.heads, self.num_src * self.heads))

    def matrix_t(self, values: Tensor) -> Tensor:
        """``A^T`` with ``A``'s ``values`` (CSR order of ``A``), as a CSR tensor."""
        return csr_matrix(self.crow_t, self.col_t, values.index_select(0, self.perm_t),
                    (self.num_src * self.heads, self.num_dst * self.heads))

    def segment_sum(self, x: Tensor) -> Tensor:
        """Sum of entry rows ``x`` ``(nnz, ...)`` over each row of ``A``: ``(num_dst * heads, ...)``."""
        if x.dim() == 1:
            return torch.segment_reduce(x, "sum", lengths=self.lengths, unsafe=True)
        out = x.new_zeros((self.num_dst * self.heads,) + tuple(x.shape[1:]))
        return out.index_add_(0, self.row_of, x)  # faster than segment_reduce on rows

    def pattern(self, dtype: torch.dtype) -> Tensor:
        """``A``'s sparsity pattern (zero values) for ``sampled_addmm`` (cached per dtype)."""
        key = ("pattern", dtype)
        if key not in self._cache:
            self._cache[key] = self.matrix(torch.zeros(self.nnz, dtype=dtype, device=self.crow.device))
        return self._cache[key]

    def edge_maps(self) -> tuple[Tensor, Tensor]:
        """``(dst_of_edge (E,), entry_index (nnz,))`` (cached): each edge's destination node (the
        caller's edge order) and, for every entry of ``A``, its position ``edge * heads + head`` in
        an ``(E, heads)`` per-edge, per-head tensor."""
        if "edge_maps" not in self._cache:
            dst_of_edge = torch.empty(self.num_edges, dtype=torch.long, device=self.crow.device)
            dst_of_edge[self.edge_of] = torch.div(self.row_of, self.heads, rounding_mode="floor")
            self._cache["edge_maps"] = (dst_of_edge, self.edge_of * self.heads + self.head_of)
        return self._cache["edge_maps"]

    def edge_pattern(self, attr_batch: int) -> EdgePattern:
        """The entry -> edge-attribute-row incidence for attributes ``(E, attr_batch, F)`` (cached)."""
        key = ("edges", attr_batch)
        if key not in self._cache:
            self._cache[key] = EdgePattern.build(self, attr_batch)
        return self._cache[key]


@dataclass(frozen=True, eq=False)
class EdgePattern:
    """``B``: the ``(num_dst * heads, E * attr_batch)`` incidence of ``A``'s entries and the edge
    attribute rows they read (entry ``i`` of row ``r`` reads row ``col[i]``; same row pointers as
    ``A``, entries in ``A``'s order), and its transpose (``crow_t``, ``col_t``; ``perm_t`` maps
    its entries to ``B``'s). ``B(alpha) @ attr`` sums the attributes of a row's edges weighted by
    ``alpha``; ``B^T(alpha) @ u`` sums, for every edge, its entries' rows of ``u``.
    """

    num_rows: int
    num_attr_rows: int
    crow: Tensor
    col: Tensor
    crow_t: Tensor
    col_t: Tensor
    perm_t: Tensor

    @classmethod
    def build(cls, st: CsrStructure, attr_batch: int) -> EdgePattern:
        if attr_batch == 1:
            col = st.edge_of
        else:  # the batch is folded into the heads (b * heads_per_batch + g): entry reads batch b
            col = st.edge_of * attr_batch + st.head_of // (st.heads // attr_batch)
        num_attr_rows = st.num_edges * attr_batch
        perm_t = torch.argsort(col, stable=True)  # by attribute row, then entry order (= ascending row)
        crow_t = torch.zeros(num_attr_rows + 1, dtype=torch.long, device=col.device)
        crow_t[1:] = torch.cumsum(torch.bincount(col, minlength=num_attr_rows), 0)
        num_rows = st.num_dst * st.heads
        size = max(num_rows, num_attr_rows)
        return cls(num_rows, num_attr_rows, csr_index(st.crow, st.nnz, size), csr_index(col, st.nnz, size), csr_index(crow_t, st.nnz, size),
                   csr_index(st.row_of[perm_t], st.nnz, size), perm_t)

    def matrix(self, values: Tensor) -> Tensor:
        """``B`` with ``values`` (``A``'s entry order), ``(num_dst * heads, E * attr_batch)``."""
        return csr_matrix(self.crow, self.col, values, (self.num_rows, self.num_attr_rows))

    def matrix_t(self, values: Tensor) -> Tensor:
        """``B^T`` with ``values`` in ``A``'s entry order, ``(E * attr_batch, num_dst * heads)``."""
        return csr_matrix(self.crow_t, self.col_t, values.index_select(0, self.perm_t), (self.num_attr_rows, self.num_rows))


def _build_structure(edge_index: Tensor, num_src: int, num_dst: int, heads: int) -> CsrStructure:
    src, dst = edge_index[0].long(), edge_index[1].long()
    num_edges = src.numel()
    device = src.device
    # edges sorted by (destination, source), stable: CSR rows with ascending column ids
    order = torch.argsort(dst * max(num_src, 1) + src, stable=True)
    s, t = src[order], dst[order]
    g = torch.arange(heads, device=device)

    def positions(rows: Tensor, sorted_rows: Tensor, num_rows: int) -> tuple[Tensor, Tensor]:
        deg = torch.bincount(sorted_rows, minlength=num_rows)
        ptr = torch.zeros(num_rows + 1, dtype=torch.long, device=device)
        ptr[1:] = torch.cumsum(deg, 0)
        j = torch.arange(rows.numel(), device=device) - ptr[sorted_rows]
        # entry (edge p, head g) of row (r, g) sits at ptr[r] * heads + g * deg[r] + j
        pos = (ptr[sorted_rows] * heads + j).unsqueeze(1) + g.unsqueeze(0) * deg[sorted_rows].unsqueeze(1)
        lengths = deg.repeat_interleave(heads)
        crow = torch.zeros(num_rows * heads + 1, dtype=torch.long, device=device)
        crow[1:] = torch.cumsum(lengths, 0)
        return pos, crow, lengths

    nnz = num_edges * heads
    pos, crow, lengths = positions(t, t, num_dst)
    col = torch.empty(nnz, dtype=torch.long, device=device)
    col[pos.flatten()] = (s.unsqueeze(1) * heads + g).flatten()
    row_of = torch.empty(nnz, dtype=torch.long, device=device)
    row_of[pos.flatten()] = (t.unsqueeze(1) * heads + g).flatten()
    edge_of = torch.empty(nnz, dtype=torch.long, device=device)
    edge_of[pos.flatten()] = order.unsqueeze(1).expand(-1, heads).flatten()
    head_of = torch.empty(nnz, dtype=torch.long, device=device)
    head_of[pos.flatten()] = g.unsqueeze(0).expand(num_edges, -1).flatten()

    # transpose: the same entries sorted by (source, destination)
    order_t = torch.argsort(s * max(num_dst, 1) + t, stable=True)
    s_t, t_t = s[order_t], t[order_t]
    pos_t, crow_t, _ = positions(s_t, s_t, num_src)
    col_t = torch.empty(nnz, dtype=torch.long, device=device)
    col_t[pos_t.flatten()] = (t_t.unsqueeze(1) * heads + g).flatten()
    perm_t = torch.empty(nnz, dtype=torch.long, device=device)
    perm_t[pos_t.flatten()] = pos[order_t].flatten()
    size = max(num_src, num_dst) * heads
    crow, col, crow_t, col_t = (csr_index(t, nnz, size) for t in (crow, col, crow_t, col_t))
    return CsrStructure(num_src, num_dst, heads, num_edges, crow, col, row_of, edge_of, head_of, lengths,
                        crow_t, col_t, perm_t)


_CACHE: dict[tuple, tuple[weakref.ref, CsrStructure]] = {}
_CACHE_SIZE = 1024  # entries also go with their edge index tensor (weakref)


def csr_structure(edge_index: Tensor, num_src: int, num_dst: int, heads: int) -> CsrStructure:
    """The (cached) :class:`CsrStructure` of ``edge_index`` ``(2, E)`` with ``heads`` heads."""
    key = (id(edge_index), edge_index.data_ptr(), edge_index._version, tuple(edge_index.shape),
           tuple(edge_index.stride()), edge_index.dtype, edge_index.device, num_src, num_dst, heads)
    hit = _CACHE.get(key)
    if hit is not None and hit[0]() is edge_index:
        return hit[1]
    structure = _build_structure(edge_index, num_src, num_dst, heads)
    if len(_CACHE) >= _CACHE_SIZE:
        for k in list(_CACHE)[: _CACHE_SIZE // 2]:  # oldest first
            del _CACHE[k]
    # the entry goes when the edge index tensor goes (per-call index tensors, e.g. edge chunks)
    _CACHE[key] = (weakref.ref(edge_index, lambda _ref, key=key: _CACHE.pop(key, None)), structure)
    return structure


def cached_structures() -> int:
    """How many :class:`CsrStructure` the cache of :func:`csr_structure` holds (an entry goes with
    its edge index tensor)."""
    return len(_CACHE)


# --------------------------------------------------------------------------------------------
# fused graph attention
# --------------------------------------------------------------------------------------------


def _segment_softmax(logits: Tensor, st: CsrStructure) -> Tensor:
    """Softmax of the entries of every row of ``A`` (the edges into one node, one head)."""
    row_max = torch.segment_reduce(logits, "max", lengths=st.lengths, unsafe=True)
    ex = torch.exp(logits - row_max.index_select(0, st.row_of))
    total = torch.segment_reduce(ex, "sum", lengths=st.lengths, unsafe=True)
    return ex.div_(total.index_select(0, st.row_of))


def _block_diag(w: Tensor) -> Tensor:
    """``(H * d, H * F)`` block-diagonal matrix of per-head matrices ``w`` ``(H, d, F)``: the
    per-head products with ``w`` become one GEMM over all heads."""
    return torch.block_diag(*w.unbind(0))


def _diagonal_blocks(full: Tensor, heads: int) -> Tensor:
    """``(H, d, F)`` diagonal blocks of a ``(H * d, H * F)`` matrix."""
    d, f = full.shape[0] // heads, full.shape[1] // heads
    return torch.stack([full[i * d:(i + 1) * d, i * f:(i + 1) * f] for i in range(heads)])


def _with_ones(attr3: Tensor) -> Tensor:
    """``(E * B_attr, F + 1)``: the edge attributes and a column of ones (the edge bias's input)."""
    e, b, f = attr3.shape
    out = attr3.new_ones((e, b, f + 1))
    out[..., :f] = attr3
    return out.view(e * b, f + 1)


def _edge_term(u: Tensor, a: Tensor, st: CsrStructure) -> Tensor:
    """``u[row] . a[attribute row]`` for every entry of ``A`` (``(nnz,)``, ``A``'s order).

    ``u`` ``(num_dst * heads, F + 1)`` per (node, head) (heads = batch x heads), ``a`` ``(E *
    attr_batch, F + 1)``. Computed per edge (one gather of the destination's rows, ``(E, heads, F +
    1)``, and a batched product with the edge's attributes), then put in entry order: cheaper than
    gathering both operands per entry."""
    dst_of_edge, entry_index = st.edge_maps()
    f1 = u.shape[1]
    attr_batch = a.shape[0] // st.num_edges
    per_edge = u.view(st.num_dst, -1).index_select(0, dst_of_edge)  # (E, heads * (F + 1))
    # (E * attr_batch, heads / attr_batch, F + 1) @ (E * attr_batch, F + 1, 1): all heads of a batch entry
    term = torch.bmm(per_edge.view(st.num_edges * attr_batch, -1, f1), a.view(-1, f1, 1))
    return term.view(-1).index_select(0, entry_index)


def _attention_forward(q: Tensor, k: Tensor, v: Tensor, attr3: Tensor, w_e: Tensor, b_e: Tensor, st: CsrStructure,
                       heads: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(out, alpha, wb, u, agg)``: the attention output ``(Nd, B, H, d)`` and what the backward reads.

    The edge embedding enters through ``W = [W_e | b_e]`` per head ``(H, d, F + 1)`` and the
    attributes with a ones column ``a = [attr, 1]``: ``q . (W_e attr + b_e) = (W^T q) . a`` and
    ``sum_j alpha_j (W_e attr_j + b_e) = W (sum_j alpha_j a_j)``; the sums over a row's edges are
    sparse products with the entry -> attribute incidence ``B`` (:class:`EdgePattern`).
    ``q`` (Nd, B, H, d), ``k`` / ``v`` (Ns, B, H, d), ``attr3`` (E, 1|B, F), ``w_e`` (H, d, F), ``b_e`` (H, d)."""
    nd, batch, _, d = q.shape
    scale = 1.0 / math.sqrt(d)
    qf, kf, vf = q.reshape(-1, d), k.reshape(-1, d), v.reshape(-1, d)
    ep = st.edge_pattern(attr3.shape[1])
    a = _with_ones(attr3)  # (E * B_attr, F + 1)
    f1 = a.shape[1]
    wb = _block_diag(torch.cat([w_e, b_e.unsqueeze(-1)], -1))  # (H d, H (F + 1))
    u = (q.reshape(nd * batch, -1) @ wb).view(-1, f1)  # W^T q per (node, head)
    logits = torch.sparse.sampled_addmm(st.pattern(q.dtype), qf, kf.t(), beta=0.0).values()
    logits += _edge_term(u, a, st)
    alpha = _segment_softmax(logits.mul_(scale), st)
    out = spmm(st.matrix(alpha), vf)
    agg = spmm(ep.matrix(alpha), a)  # sum_j alpha_j a_j per (node, head)
    out = out.view(nd * batch, -1).addmm_(agg.view(nd * batch, -1), wb.t())
    return out.view(nd, batch, heads, d), alpha, wb, u, agg


def _attention_backward(grad_out: Tensor, saved: tuple[Tensor, ...], st: CsrStructure, heads: int,
                        needs: list[bool]) -> list[Tensor | None]:
    """Gradients of ``(q, k, v, attr3, w_e, b_e)`` (None where ``needs`` is False) from ``grad_out``
    and the forward's ``saved = (q, k, v, attr3, alpha, wb, u, agg)``."""
    q, k, v, attr3, alpha, wb, u, agg = saved
    nd, batch, _, d = q.shape
    ns = k.shape[0]
    scale = 1.0 / math.sqrt(d)
    go = grad_out.contiguous()
    gof, qf, kf, vf = go.view(-1, d), q.reshape(-1, d), k.reshape(-1, d), v.reshape(-1, d)
    ep = st.edge_pattern(attr3.shape[1])
    a = _with_ones(attr3)
    f1 = a.shape[1]
    need_q, need_k, need_v, need_a, need_w, need_b = needs

    # output = A_alpha @ v + W (B_alpha @ a)
    gu = (go.view(nd * batch, -1) @ wb).view(-1, f1)  # W^T go per (node, head)
    dalpha = torch.sparse.sampled_addmm(st.pattern(q.dtype), gof, vf.t(), beta=0.0).values()
    dalpha += _edge_term(gu, a, st)
    dv = spmm(st.matrix_t(alpha), gof).view(ns, batch, heads, d) if need_v else None

    # softmax backward, then logits = scale * (q . k + u . a)
    t = st.segment_sum(alpha * dalpha)
    ds = alpha.mul(dalpha - t.index_select(0, st.row_of)).mul_(scale)
    dq = dk = da = dw = db = None
    de = spmm(ep.matrix(ds), a) if (need_q or need_w or need_b) else None
    if need_q:
        dq = spmm(st.matrix(ds), kf).view(nd * batch, -1).addmm_(de.view(nd * batch, -1), wb.t())
        dq = dq.view(nd, batch, heads, d)
    if need_k:
        dk = spmm(st.matrix_t(ds), qf).view(ns, batch, heads, d)
    if need_w or need_b:
        full = go.view(nd * batch, -1).t() @ agg.view(nd * batch, -1)
        full.addmm_(q.reshape(nd * batch, -1).t(), de.view(nd * batch, -1))
        dwb = _diagonal_blocks(full, heads)  # (H, d, F + 1)
        dw, db = dwb[..., :-1], dwb[..., -1]
    if need_a:
        da = spmm(ep.matrix_t(alpha), gu)
        da += spmm(ep.matrix_t(ds), u)
        da = da[:, :-1].reshape(attr3.shape)
    return [dq, dk, dv, da, dw, db]


# The kernel is a torch custom op (opaque to torch.compile: dynamo neither traces the sparse CSR
# products nor the structure cache, so a compiled block has no graph break here), with its
# backward registered as a second op. Eager calls run the same functions as an autograd Function
# (_EagerGraphAttention), without torch.library's dispatch.


def _structure_of(edge_index: Tensor, q: Tensor, k: Tensor, heads: int) -> CsrStructure:
    """The cached CSR structure for ``q`` (Nd, B, H, d) and ``k`` (Ns, B, H, d): B x H rows per node."""
    return csr_structure(edge_index, k.shape[0], q.shape[0], q.shape[1] * heads)


@torch.library.custom_op("stormshard::fused_graph_attention", mutates_args=())
def _graph_attention_op(q: Tensor, k: Tensor, v: Tensor, attr3: Tensor, w_e: Tensor, b_e: Tensor, edge_index: Tensor,
                        heads: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return _forward_outputs(q, k, v, attr3, w_e, b_e, edge_index, heads)


def _forward_outputs(q: Tensor, k: Tensor, v: Tensor, attr3: Tensor, w_e: Tensor, b_e: Tensor, edge_index: Tensor,
                     heads: int) -> tuple[Tensor, ...]:
    """``(out, alpha, wb, u, agg)`` (contiguous) of :func:`_attention_forward` on the cached structure:
    the op's and the eager Function's forward."""
    out = _attention_forward(q, k, v, attr3, w_e, b_e, _structure_of(edge_index, q, k, heads), heads)
    return tuple(t.contiguous() for t in out)


def _grads_from_saved(grad_out: Tensor, saved: tuple[Tensor, ...], heads: int, needs: list[bool]) -> list[Tensor | None]:
    """:func:`_attention_backward` from what the forward saved, ``(q, k, v, attr3, w_e, alpha, wb, u, agg,
    edge_index)``: the backward op's and the eager Function's backward."""
    q, k, v, attr3, _w_e, alpha, wb, u, agg, edge_index = saved
    return _attention_backward(grad_out, (q, k, v, attr3, alpha, wb, u, agg), _structure_of(edge_index, q, k, heads),
                               heads, needs)


@_graph_attention_op.register_fake
def _graph_attention_fake(q: Tensor, k: Tensor, v: Tensor, attr3: Tensor, w_e: Tensor, b_e: Tensor,
                          edge_index: Tensor, heads: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    nd, batch, _, d = q.shape
    f1, rows = attr3.shape[-1] + 1, nd * batch * heads
    return (q.new_empty(q.shape), q.new_empty(edge_index.shape[1] * batch * heads), q.new_empty(heads * d, heads * f1),
            q.new_empty(rows, f1), q.new_empty(rows, f1))


@torch.library.custom_op("stormshard::fused_graph_attention_backward", mutates_args=())
def _graph_attention_backward_op(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, attr3: Tensor, w_e: Tensor,
                                 alpha: Tensor, wb: Tensor, u: Tensor, agg: Tensor, edge_index: Tensor, heads: int,
                                 needs: list[bool]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    grads = _grads_from_saved(grad_out, (q, k, v, attr3, w_e, alpha, wb, u, agg, edge_index), heads, list(needs))
    # gradients not asked for are empty tensors (an op returns tensors only)
    return tuple(q.new_empty(0) if g is None else g.contiguous() for g in grads)


@_graph_attention_backward_op.register_fake
def _graph_attention_backward_fake(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, attr3: Tensor, w_e: Tensor,
                                   alpha: Tensor, wb: Tensor, u: Tensor, agg: Tensor, edge_index: Tensor, heads: int,
                                   needs: list[bool]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    shapes = (q.shape, k.shape, v.shape, attr3.shape, w_e.shape, w_e.shape[:2])
    return tuple(q.new_empty(shape if need else (0,)) for shape, need in zip(shapes, needs, strict=True))


def _graph_attention_setup(ctx, inputs: tuple, output: tuple) -> None:  # noqa: ANN001
    q, k, v, attr3, w_e, _b_e, edge_index, heads = inputs
    _out, alpha, wb, u, agg = output
    ctx.save_for_backward(q, k, v, attr3, w_e, alpha, wb, u, agg, edge_index)
    ctx.heads = heads


def _graph_attention_grad(ctx, grad_out: Tensor, *_aux: Tensor) -> tuple:  # noqa: ANN001
    needs = [bool(n) for n in ctx.needs_input_grad[:6]]
    grads = torch.ops.stormshard.fused_graph_attention_backward(grad_out, *ctx.saved_tensors, ctx.heads, needs)
    return (*(g if need else None for g, need in zip(grads, needs, strict=True)), None, None)


_graph_attention_op.register_autograd(_graph_attention_grad, setup_context=_graph_attention_setup)


class _EagerGraphAttention(torch.autograd.Function):
    """The op's forward and backward without torch.library's dispatch, for eager calls: the same
    functions and saved tensors, so the same numbers, with less per-call overhead and no import of
    ``torch._dynamo`` (a custom op's kernel is wrapped in ``torch._disable_dynamo``, which imports it:
    ~70 MiB of resident memory per process that an eager run does not need)."""

    @staticmethod
    def forward(ctx, q, k, v, attr3, w_e, b_e, edge_index, heads):  # noqa: ANN001, ANN205
        out = kept_or_computed(lambda: _forward_outputs(q, k, v, attr3, w_e, b_e, edge_index, heads), q, k, v, attr3)
        _graph_attention_setup(ctx, (q, k, v, attr3, w_e, b_e, edge_index, heads), out)
        ctx.mark_non_differentiable(*out[1:])
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out, *_aux):  # noqa: ANN001, ANN205
        needs = [bool(n) for n in ctx.needs_input_grad[:6]]
        grads = _grads_from_saved(grad_out, ctx.saved_tensors, ctx.heads, needs)
        return (*(g.contiguous() if need else None for g, need in zip(grads, needs, strict=True)), None, None)


def fused_graph_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    edge_attr: Tensor,
    edge_weight: Tensor,
    edge_bias: Tensor | None,
    edge_index: Tensor,
    num_dst: int | None = None,
) -> Tensor:
    """Graph attention with the edge embedding ``edge_attr @ edge_weight.T + edge_bias`` added to
    keys and values, without forming any ``(E, heads, d)`` tensor.

    Equal (in exact arithmetic) to ``graph_attention(query, key, value, emb, edge_index,
    num_dst)`` with ``emb = (edge_attr @ edge_weight.T + edge_bias)`` split into heads:

    - ``query`` ``(num_dst, *batch, heads, d)``, ``key`` / ``value`` ``(num_src, *batch, heads, d)``;
    - ``edge_attr`` ``(E, F)`` (shared by the batch) or ``(E, *batch, F)``;
    - ``edge_weight`` ``(heads * d, F)`` and ``edge_bias`` ``(heads * d,)`` or None (an
      ``nn.Linear(F, heads * d)``'s weight and bias, output channels ordered ``(head, d)``);
    - ``edge_index`` ``(2, E)``, row 0 source (``< num_src``), row 1 destination (``< num_dst``),
      any order, duplicates allowed.

    Returns ``(num_dst, *batch, heads, d)``; a destination without incoming edges gets zeros.
    Differentiable in every tensor argument (not twice).
    """
    ops = graph_operands(query, key, value, edge_attr, edge_weight, edge_index, num_dst)
    num_dst, heads, d, batch, attr3 = ops.num_dst, ops.heads, ops.head_dim, ops.batch, ops.attr3
    fdim, num_edges = edge_attr.shape[-1], ops.num_edges
    if edge_bias is None:
        edge_bias = torch.zeros(heads * d, dtype=query.dtype, device=query.device)

    q = query.reshape(num_dst, batch, heads, d).contiguous()
    k = key.reshape(key.shape[0], batch, heads, d).contiguous()
    v = value.reshape(value.shape[0], batch, heads, d).contiguous()
    w_e = edge_weight.view(heads, d, fdim)
    b_e = edge_bias.view(heads, d)
    if num_edges == 0:  # keeps every input in the graph (zero gradients)
        out = q.new_zeros(q.shape) + 0 * (q.sum() + k.sum() + v.sum() + attr3.sum() + w_e.sum() + b_e.sum())
        return out.reshape(query.shape)
    # the CSR structure is looked up (cached) inside the op, out of torch.compile's sight; eager
    # calls skip torch.library's dispatch (same functions) unless selective checkpointing watches
    op = _graph_attention_op if use_registered_op() else _EagerGraphAttention.apply
    out = op(q, k, v, attr3.contiguous(), w_e.contiguous(), b_e.contiguous(), edge_index, heads)[0]
    return out.reshape(query.shape)


# --------------------------------------------------------------------------------------------
# sum aggregation
# --------------------------------------------------------------------------------------------


class _SegmentSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, index, num_rows: int):  # noqa: ANN001
        ctx.save_for_backward(index)
        out = x.new_zeros((num_rows,) + tuple(x.shape[1:]))
        return out.index_add_(0, index, x)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):  # noqa: ANN001
        (index,) = ctx.saved_tensors
        return grad.index_select(0, index), None, None


def segment_sum(x: Tensor, index: Tensor, num_rows: int) -> Tensor:
    """``out[index[e]] += x[e]``: ``(num_rows, ...)`` from edge rows ``x`` ``(E, ...)``.

    ``index_add_`` forward, a gather backward; autograd keeps only ``index`` (no copy of ``x``). Under
    torch.compile the out-of-place ``index_add`` (whose own backward is the same gather): dynamo in torch
    2.11 gave wrong gradients for a Function whose forward adds into a tensor it made.
    """
    if torch.compiler.is_compiling():
        return x.new_zeros((num_rows,) + tuple(x.shape[1:])).index_add(0, index, x)
    return _SegmentSum.apply(x, index, num_rows)
