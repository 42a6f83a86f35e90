"""Message-passing GNN blocks (interaction network): edge MLP, sum aggregation, node MLP, residuals.

For an edge ``j -> i`` with features ``e_ji``::

    m_ji = MLP_e([x_j, x_i, e_ji])          (edge_channels)
    x_i <- x_i + MLP_n([x_i, sum_j m_ji])   (sum over the edges into i: index_add_)
    e_ji <- e_ji + m_ji

Each MLP is Linear, GELU, Linear, LayerNorm by default; ``mlp_hidden_layers`` hidden (Linear,
GELU) pairs before the output Linear in general (:func:`gnn_mlp`). Layouts: node features
``(num_nodes, [*batch,] channels)``, ``edge_attr`` ``(num_edges, edge_channels)`` (or
``(num_edges, *batch, edge_channels)``), edges numbered by the block's plan.

Options (defaults: the formulas above):

- ``mlp_hidden_layers``: the depth of every MLP of the block (hidden layers before the output
  linear; 1 by default). anemoi-models' GNN with ``mlp_extra_layers=m`` is ``m + 2``.
- ``edge_in_channels``: the block's ``edge_attr`` input has this many channels and is embedded
  to ``edge_channels`` first, ``e_ji <- MLP_emb(e_ji)`` (an MLP of the same shape), e.g. raw edge
  attributes (length, direction) lifted to the node width; anemoi embeds the edges so in its
  first GNN processor layer and in its GNN mappers.
- ``aggregate_updated_edges``: sum the updated edges, ``x_i <- x_i + MLP_n([x_i, sum_j (e_ji +
  m_ji)])``, instead of the messages (anemoi's ``GraphConv``; needs ``edge_channels`` equal to the
  aggregated width, as always).

- :class:`GNNMapperBlock`: bipartite (encoder data -> hidden, decoder hidden -> data);
  ``forward(x_src, x_dst, edge_attr)`` returns the updated destinations only, like every mapper
  block (the edge update is not computed: a mapper's edges feed nothing after it).
- :class:`GNNProcessorBlock`: one node set (hidden -> hidden); ``forward(x, edge_attr)`` returns
  ``(x', edge_attr')`` like every processor block, so that the processor chains edge updates.

Graph and shard context: the block takes its :class:`~stormshard.parallel.graph.GraphShardPlan`
once, at construction (edge index and process group; ``GraphShardPlan.build(edge_index,
num_nodes)`` for one process). Node inputs are this rank's slices, ``edge_attr`` the plan's local
edges in plan order (``plan.shard_edges``); the source features cross one halo exchange over the
plan's group (forward and backward), overlapped with the local rows' projection
(:func:`~stormshard.parallel.halo_projection.halo_linear`: only the projected sources are used),
and the outputs are this rank's destination slice (and local edges, plan order). ``num_chunks > 1`` processes the edges in destination-node chunks with
activation checkpointing per chunk; results are equal.

Implementation: the first linear of the edge MLP on ``[x_j, x_i, e_ji]`` is split into per-node
projections (N rows) gathered per edge plus the edge part. On CPU in float32 / float64 (no
autocast), the per-edge work (the edge embedding, the edge MLP, the aggregation) runs in
:class:`_FusedEdgeMLP`: one pass over cache-sized edge blocks forward and backward, keeping only
the pre-activations for the backward (GELU outputs and embedded edges are recomputed), its large
buffers recycled from step to step. Elsewhere (GPU, bf16, autocast, ``fused=False``) plain
autograd runs the same math.

Kernel settings are bound at construction, never read from globals (every block, and
:func:`gnn_mlp`, takes them as keywords):

- ``kernel_options``: an :class:`EdgeKernelOptions` (None: the defaults): ``fused`` (the fused
  paths on or off), ``block_bytes`` (edge-block size), ``recycle``, ``recycle_min_bytes``,
  ``recycle_max_age`` (buffer recycling);
- ``buffer_pool``: the :class:`EdgeBufferPool` the recycled buffers come from (None: a pool of
  the block's own). Pass one pool to every block of a model, so that layers reuse each other's
  buffers (the models do); ``pool.release()`` frees its buffers not in use.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from stormshard.layers.chunking import check_num_chunks, map_destination_chunks
from stormshard.layers.graph_kernels import segment_sum
from stormshard.layers.graph_transformer import (
    _check_positive,
    check_local_rows,
    check_node_and_edge_shapes,
    check_plan,
)
from stormshard.parallel.graph import GraphShardPlan
from stormshard.parallel.halo_projection import halo_linear

__all__ = ["GNNMapperBlock", "GNNProcessorBlock", "GNNMLP", "gnn_mlp", "EdgeKernelOptions", "EdgeBufferPool"]


class GNNMLP(nn.Sequential):
    """The GNN blocks' MLP (:func:`gnn_mlp`): an ``nn.Sequential`` of Linear, GELU, ..., Linear,
    LayerNorm on the last dimension. On CPU in float32 / float64 (no autocast) its forward and
    backward run row-blocked (:class:`_FusedMLP`: cache-sized blocks, only the pre-activations
    kept for the backward); elsewhere, or with ``EdgeKernelOptions(fused=False)``, the modules in
    turn. ``kernel_options`` (None: the defaults) and ``buffer_pool`` (None: a pool of its own)
    are bound here; slices (``mlp[1:]``) share them."""

    def __init__(
        self, *layers: nn.Module, kernel_options: EdgeKernelOptions | None = None,
        buffer_pool: EdgeBufferPool | None = None,
    ) -> None:
        super().__init__(*layers)
        self.kernel_options, self.buffer_pool = _check_kernel_args(kernel_options, buffer_pool)

    def __getitem__(self, idx):  # noqa: ANN001, ANN204
        out = super().__getitem__(idx)
        if isinstance(out, GNNMLP) and out is not self:  # a slice: the same options and pool
            out.kernel_options, out.buffer_pool = self.kernel_options, self.buffer_pool
        return out

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() < 2 or x.numel() == 0 or not _fusable(self, self.kernel_options, x):
            return super().forward(x)
        params = _mlp_params(self)
        save = torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params))
        kernel = _Kernel(self.kernel_options, self.buffer_pool)
        out = _FusedMLP.apply(x.reshape(-1, x.shape[-1]), save, self[-1].eps, kernel, *params)
        return out.reshape(*x.shape[:-1], out.shape[-1])


def gnn_mlp(
    in_channels: int, hidden: int, out_channels: int, hidden_layers: int = 1, *,
    kernel_options: EdgeKernelOptions | None = None, buffer_pool: EdgeBufferPool | None = None,
) -> GNNMLP:
    """``hidden_layers`` (Linear, GELU) pairs (the first ``in_channels -> hidden``, the others
    ``hidden -> hidden``), then Linear ``hidden -> out_channels`` and LayerNorm: the GNN blocks'
    MLP. ``hidden_layers=1`` is Linear, GELU, Linear, LayerNorm; anemoi-models' ``MLP`` with
    ``n_extra_layers=n`` is ``hidden_layers=n + 1``. ``kernel_options`` / ``buffer_pool``: see
    :class:`GNNMLP`."""
    _check_positive("hidden_layers", hidden_layers)
    layers: list[nn.Module] = [nn.Linear(in_channels, hidden), nn.GELU()]
    for _ in range(hidden_layers - 1):
        layers += [nn.Linear(hidden, hidden), nn.GELU()]
    return GNNMLP(*layers, nn.Linear(hidden, out_channels), nn.LayerNorm(out_channels),
                  kernel_options=kernel_options, buffer_pool=buffer_pool)


# --------------------------------------------------------------------------------------------
# kernel options and the recycled-buffer pool (bound to the blocks at construction)
# --------------------------------------------------------------------------------------------

_FUSED_DTYPES = (torch.float32, torch.float64)


@dataclass(frozen=True)
class EdgeKernelOptions:
    """How the GNN blocks and :class:`GNNMLP` run their per-edge (per-row) work on CPU; bound at
    construction (``kernel_options=``), never read from globals. The defaults are the measured
    best; the results do not depend on them (up to rounding order).

    - ``fused``: run the fused, row-blocked paths (:class:`_FusedEdgeMLP`, :class:`_FusedMLP`) on
      CPU in float32 / float64 without autocast; False runs plain autograd (the other devices'
      and dtypes' path, and the tests' reference).
    - ``block_bytes``: bytes of one ``(rows, channels)`` block tensor of the fused paths (a few
      live at once: sized for the core's L2 cache; 1 MiB measured best for C 256 on AMD EPYC).
      A block has at least 16 rows (``block_bytes=1``: blocks of 16 rows).
    - ``recycle``: take the fused paths' large buffers (kept pre-activations, outputs, gradients)
      from the block's :class:`EdgeBufferPool` instead of allocating fresh memory (a fresh
      multi-MB allocation is a fresh mapping whose first touch page-faults: 10-15% of a CPU
      training step).
    - ``recycle_min_bytes``: only buffers of at least this many bytes are recycled (0: all).
    - ``recycle_max_age``: when the pool allocates, it drops the free buffers not handed out in
      the last ``recycle_max_age`` requests (sizes no longer used).
    """

    fused: bool = True
    block_bytes: int = 1 << 20
    recycle: bool = True
    recycle_min_bytes: int = 1 << 22
    recycle_max_age: int = 10_000

    def __post_init__(self) -> None:
        for name in ("fused", "recycle"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"EdgeKernelOptions.{name} must be True or False, got {value!r} "
                                f"({type(value).__name__}): pass a bool")
        for name, low, fix in (
            ("block_bytes", 1, "bytes of one edge-block tensor: the default 1 << 20 (1 MiB) suits a 1-2 MiB L2 "
                               "cache; 1 gives the smallest blocks (16 rows)"),
            ("recycle_min_bytes", 0, "the smallest buffer size recycled, in bytes: 0 recycles every buffer, "
                                     "the default is 1 << 22 (4 MiB)"),
            ("recycle_max_age", 0, "the number of pool requests after which an unused free buffer is dropped: "
                                   "0 keeps only the size just requested, the default is 10000"),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"EdgeKernelOptions.{name} must be an int, got {value!r} ({type(value).__name__}): "
                                f"pass an int, {fix}")
            if value < low:
                kind = "positive" if low == 1 else "non-negative"
                raise ValueError(f"EdgeKernelOptions.{name} must be {kind} (>= {low}), got {value}: {fix}")


def _check_kernel_args(
    kernel_options: EdgeKernelOptions | None, buffer_pool: EdgeBufferPool | None
) -> tuple[EdgeKernelOptions, EdgeBufferPool]:
    """``(options, pool)``: the defaults (a new pool) for None; TypeError for other types."""
    if kernel_options is None:
        kernel_options = EdgeKernelOptions()
    elif not isinstance(kernel_options, EdgeKernelOptions):
        raise TypeError(f"kernel_options must be an EdgeKernelOptions (or None for the defaults), got "
                        f"{type(kernel_options).__name__}: build one, e.g. EdgeKernelOptions(fused=False)")
    if buffer_pool is None:
        buffer_pool = EdgeBufferPool()
    elif not isinstance(buffer_pool, EdgeBufferPool):
        raise TypeError(f"buffer_pool must be an EdgeBufferPool (or None for a pool of the block's own), got "
                        f"{type(buffer_pool).__name__}: pass EdgeBufferPool() (one may be shared by many blocks)")
    return kernel_options, buffer_pool


def _storage_refs(t: Tensor) -> int:
    """References to ``t``'s storage (C++ use count, plus one for the query's own storage object)."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


try:
    _FREE_REFS = _storage_refs(torch.empty(1))  # a tensor referenced once (plus the query's own reference)
except (AttributeError, RuntimeError, TypeError):  # pragma: no cover - private API gone: allocate fresh
    _FREE_REFS = None


class EdgeBufferPool:
    """The recycled large buffers of the fused GNN paths (see ``EdgeKernelOptions.recycle``).

    Each GNN block (and each :func:`gnn_mlp`) gets a pool of its own unless one is passed
    (``buffer_pool=``); a model passes one pool to all its GNN blocks, so that a buffer freed by
    one layer serves the next (the backward's temporaries of every layer share buffers). The
    pool holds, per size, up to the peak number of simultaneously live buffers.

    A buffer is handed out only once nothing else references its storage, so values are never
    shared: the free test is the storage's use count, read with ``torch._C._storage_Use_Count``
    (a private function, the one torch itself uses for this in ``torch._inductor``; torch 2.13 has
    no public storage use count: ``Tensor._use_count`` counts references to a tensor object, not
    to its storage, so it misses the aliases handed out here). Where that function is missing the
    pool allocates fresh memory every time (:attr:`available` is False). Not thread-safe: one
    pool per thread of execution. Copies (``copy.deepcopy``, pickling) get an empty pool.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[int, torch.dtype], list[list]] = {}  # size -> [[buffer, last request], ...]
        self._requests = 0

    #: whether buffers can be recycled with this torch (see the class docstring)
    available = _FREE_REFS is not None

    def __deepcopy__(self, memo: dict) -> EdgeBufferPool:
        return EdgeBufferPool()

    def __reduce__(self):  # noqa: ANN204 - pickled as an empty pool: buffers are process-local scratch
        return (EdgeBufferPool, ())

    def __len__(self) -> int:
        """The number of cached buffers (free or in use)."""
        return sum(len(entries) for entries in self._buffers.values())

    def __repr__(self) -> str:
        return f"EdgeBufferPool({len(self)} buffers, {self.nbytes} bytes, {self.num_free()} free)"

    @property
    def nbytes(self) -> int:
        """Bytes of the cached buffers (free or in use)."""
        return sum(n * d.itemsize * len(e) for (n, d), e in self._buffers.items())

    def sizes(self) -> set[tuple[int, torch.dtype]]:
        """The ``(numel, dtype)`` of the cached buffers."""
        return set(self._buffers)

    def num_free(self) -> int:
        """The number of cached buffers not in use."""
        return sum(_storage_refs(b[0]) == _FREE_REFS for entries in self._buffers.values() for b in entries)

    def release(self) -> None:
        """Free the cached buffers not in use (those in use stay cached)."""
        self._drop_free()

    def _drop_free(self, max_age: int = -1) -> None:
        """Forget the cached buffers not in use (and, with ``max_age >= 0``, not handed out in the
        last ``max_age`` requests)."""
        now = self._requests
        for key, entries in list(self._buffers.items()):
            kept = [b for b in entries if _storage_refs(b[0]) != _FREE_REFS or (max_age >= 0 and now - b[1] <= max_age)]
            if kept:
                self._buffers[key] = kept
            else:
                del self._buffers[key]

    def empty(self, shape: tuple[int, ...], like: Tensor, options: EdgeKernelOptions, zero: bool = False) -> Tensor:
        """``like.new_empty(shape)`` (``new_zeros`` if ``zero``), a recycled buffer when ``options``
        recycle and it is large (``recycle_min_bytes``) and on CPU."""
        numel = 1
        for n in shape:
            numel *= n
        if (not options.recycle or _FREE_REFS is None or numel * like.element_size() < options.recycle_min_bytes
                or like.device.type != "cpu"):
            return like.new_zeros(shape) if zero else like.new_empty(shape)
        self._requests += 1
        key = (numel, like.dtype)
        entry = next((b for b in self._buffers.get(key, ()) if _storage_refs(b[0]) == _FREE_REFS), None)
        if entry is None:
            self._drop_free(options.recycle_max_age)  # sizes no longer requested
            entry = [like.new_empty(numel), 0]
            self._buffers.setdefault(key, []).append(entry)
        entry[1] = self._requests
        # an alias of the buffer's storage, not a view: the outputs of an autograd Function must not be views
        out = like.new_empty(0).set_(entry[0].untyped_storage(), 0, shape)
        return out.zero_() if zero else out


class _Kernel(NamedTuple):
    """A fused path's options and pool, passed into the autograd Functions."""

    options: EdgeKernelOptions
    pool: EdgeBufferPool

    def empty(self, shape: tuple[int, ...], like: Tensor, zero: bool = False) -> Tensor:
        return self.pool.empty(shape, like, self.options, zero)

    def rows(self, width: int, like: Tensor) -> int:
        """Rows of one block of ``width`` channels (``options.block_bytes``, at least 16)."""
        return max(16, self.options.block_bytes // (width * like.element_size()))


# --------------------------------------------------------------------------------------------
# fused, edge-blocked edge MLP (CPU, float32 / float64)
# --------------------------------------------------------------------------------------------

def _mlp_parts(mlp: nn.Sequential) -> tuple[list[nn.Linear], nn.LayerNorm] | None:
    """``(linears, layer_norm)`` when ``mlp`` is :func:`gnn_mlp`'s Linear, GELU, ..., Linear,
    LayerNorm (exact GELU, affine LayerNorm over the last dimension), else None."""
    mods = list(mlp)
    norm = mods[-1] if mods else None
    if len(mods) < 4 or not isinstance(norm, nn.LayerNorm) or len(norm.normalized_shape) != 1:
        return None
    if norm.weight is None or norm.bias is None or len(mods) % 2 != 0:
        return None
    for i, m in enumerate(mods[:-1]):
        if i % 2 == 0 and not (isinstance(m, nn.Linear) and m.bias is not None):
            return None
        if i % 2 == 1 and not (isinstance(m, nn.GELU) and m.approximate == "none"):
            return None
    return mods[:-1:2], norm


def _fusable(mlp: nn.Sequential | None, options: EdgeKernelOptions, *tensors: Tensor) -> bool:
    """Whether ``mlp`` (None: nothing to check) can run in :class:`_FusedEdgeMLP` on ``tensors``."""
    if mlp is None:
        return True
    if not options.fused or _mlp_parts(mlp) is None or torch.is_autocast_enabled("cpu"):
        return False
    dtype = tensors[0].dtype
    if dtype not in _FUSED_DTYPES or any(t.device.type != "cpu" or t.dtype != dtype for t in tensors):
        return False
    return all(p.dtype == dtype and p.device.type == "cpu" for p in mlp.parameters())


class _MLP:
    """One MLP's tensors inside :class:`_FusedEdgeMLP`: ``w0`` (first linear, on the edge rows),
    ``b0`` (or None), ``ws`` / ``bs`` (the next linears), the LayerNorm ``ln_w``, ``ln_b``,
    ``eps``; ``hs`` (its pre-activations ``(E, width)``) and ``stats`` (LayerNorm mean and rstd
    ``(E, 1)``) when kept for the backward."""

    def __init__(self, params: Sequence[Tensor | None], eps: float) -> None:
        self.w0, self.b0, self.ln_w, self.ln_b = params[:4]
        self.ws, self.bs = list(params[4::2]), list(params[5::2])
        self.eps, self.hs, self.stats = eps, None, None
        self.out = self.ws[-1].shape[0]

    def allocate(self, num_edges: int, like: Tensor, kernel: _Kernel) -> None:
        widths = [self.w0.shape[0], *[w.shape[0] for w in self.ws]]
        self.hs = [kernel.empty((num_edges, w), like) for w in widths]
        self.stats = (like.new_empty(num_edges, 1), like.new_empty(num_edges, 1))

    def saved(self) -> list[Tensor]:
        return [*self.hs, *self.stats]

    def restore(self, tensors: Sequence[Tensor]) -> None:
        self.hs, self.stats = list(tensors[:-2]), tuple(tensors[-2:])

    def forward(self, a: Tensor, base: Tensor | None, s: int, e: int) -> Tensor:
        """Rows ``[s, e)``: ``LayerNorm(... GELU(base + a W0^T + b0) ...)``; the pre-activations
        are written to ``hs`` when allocated."""
        keep = self.hs is not None
        out = self.hs[0][s:e] if keep else None
        if base is not None:
            if self.b0 is not None:
                base = base.add_(self.b0)
            h = torch.addmm(base, a, self.w0.t(), out=out)
        elif self.b0 is not None:
            h = torch.addmm(self.b0, a, self.w0.t(), out=out)
        else:
            h = torch.mm(a, self.w0.t(), out=out)
        for k, (w, b) in enumerate(zip(self.ws, self.bs, strict=True)):
            h = torch.addmm(b, F.gelu(h), w.t(), out=self.hs[k + 1][s:e] if keep else None)
        m, mean, rstd = torch.native_layer_norm(h, [self.out], self.ln_w, self.ln_b, self.eps)
        if keep:
            self.stats[0][s:e], self.stats[1][s:e] = mean, rstd
        return m

    def output(self, s: int, e: int) -> Tensor:
        """The forward's output rows ``[s, e)`` again (the same op on the kept pre-LayerNorm rows:
        the same values)."""
        return torch.native_layer_norm(self.hs[-1][s:e], [self.out], self.ln_w, self.ln_b, self.eps)[0]

    def backward(self, g_m: Tensor, a: Tensor, s: int, e: int, grads: list[Tensor | None]) -> Tensor:
        """Gradient of the first pre-activation ``h_0`` (rows ``[s, e)``) from that of the output;
        adds the parameter gradients (``a``: the first linear's input rows) to ``grads`` (in
        ``params`` order, None where not needed)."""
        mask = [True, grads[2] is not None, grads[3] is not None]
        g_h, g_lw, g_lb = torch.ops.aten.native_layer_norm_backward(
            g_m, self.hs[-1][s:e], [self.out], self.stats[0][s:e], self.stats[1][s:e], self.ln_w, self.ln_b, mask)
        if grads[2] is not None:
            grads[2] += g_lw
        if grads[3] is not None:
            grads[3] += g_lb
        for k in range(len(self.ws) - 1, -1, -1):
            h_in = self.hs[k][s:e]
            if grads[4 + 2 * k] is not None:
                grads[4 + 2 * k].addmm_(g_h.t(), F.gelu(h_in))  # GELU recomputed, not kept
            if grads[5 + 2 * k] is not None:
                grads[5 + 2 * k] += g_h.sum(0)
            g_h = torch.ops.aten.gelu_backward(g_h.mm(self.ws[k]), h_in)
        if grads[0] is not None:
            grads[0].addmm_(g_h.t(), a)
        if grads[1] is not None:
            grads[1] += g_h.sum(0)
        return g_h


class _FusedEdgeMLP(torch.autograd.Function):
    """The GNN edge MLP (and the edge embedding before it, if any) over edge blocks, forward and
    backward written out.

    Per edge ``e`` (rows of ``attr``)::

        a_e = Emb(attr_e)  (the embedding MLP, if any; else attr_e)
        h_0 = p_src[src_e] + p_dst[dst_e] + W_0 a_e                 (the bias sits in p_dst)
        h_k = W_k GELU(h_{k-1}) + b_k                              (k = 1 .. K)
        m_e = LayerNorm(h_K);   y_e = a_e + m_e
        agg[dst_local_e] += m_e ("msg") or y_e ("edges")

    returning ``(y (E, C) if want_edges else an empty tensor, agg (num_agg, C))``. The edges are
    processed in blocks of ``kernel.options.block_bytes``: the block temporaries (gathers, activations,
    embedded edges, gradients) stay cache-sized and are never allocated at full size, and only
    the pre-activations (and the LayerNorm statistics) are kept for the backward, which
    recomputes ``GELU(h_k)`` and the embedded edges instead of keeping them: per MLP, K + 1
    tensors ``(E, width)`` instead of autograd's 2K + 2 (plus the embedded edges and their
    gradient). The large buffers come from ``kernel.pool`` (``kernel``: a :class:`_Kernel`).
    """

    #: arguments of ``forward`` before ``params``
    NUM_ARGS = 14

    @staticmethod
    def forward(ctx, attr, p_src, p_dst, src, dst, dst_local, num_agg, aggregate, want_edges, save, n_emb,  # noqa: ANN001
                eps_emb, eps, kernel, *params):
        num_edges = attr.shape[0]
        emb = _MLP(params[:n_emb], eps_emb) if n_emb else None
        mlp = _MLP(params[n_emb:], eps)
        if save:
            for net in (emb, mlp):
                if net is not None:
                    net.allocate(num_edges, p_dst, kernel)
        y_all = kernel.empty((num_edges, mlp.out), p_dst) if want_edges else p_dst.new_empty(0)
        agg = kernel.empty((num_agg, mlp.out), p_dst, zero=True)
        width = max(mlp.w0.shape[0], mlp.out, emb.w0.shape[0] if emb else 0)
        rows = kernel.rows(width, p_dst)
        for s in range(0, num_edges, rows):
            e = min(num_edges, s + rows)
            a = attr[s:e] if emb is None else emb.forward(attr[s:e], None, s, e)
            base = p_src.index_select(0, src[s:e]).add_(p_dst.index_select(0, dst[s:e]))
            m = mlp.forward(a, base, s, e)
            if aggregate == "msg":
                agg.index_add_(0, dst_local[s:e], m)
            if want_edges:
                m = torch.add(m, a, out=y_all[s:e])
            elif aggregate == "edges":
                m = m.add_(a)
            if aggregate == "edges":
                agg.index_add_(0, dst_local[s:e], m)
        ctx.set_materialize_grads(False)
        ctx.flags = (aggregate, want_edges, n_emb, eps_emb, eps, rows, p_src.shape[0], p_dst.shape[0])
        ctx.kernel = kernel
        if save:
            kept = [*(emb.saved() if emb else []), *mlp.saved()]
            ctx.save_for_backward(attr, src, dst, dst_local, *params, *kept)
        return y_all, agg

    @staticmethod
    @once_differentiable
    def backward(ctx, g_edges, g_agg):  # noqa: ANN001
        aggregate, want_edges, n_emb, eps_emb, eps, rows, num_src, num_dst = ctx.flags
        saved = ctx.saved_tensors
        attr, src, dst, dst_local = saved[:4]
        kernel, num_args = ctx.kernel, _FusedEdgeMLP.NUM_ARGS
        n_params = len(ctx.needs_input_grad) - num_args
        params, kept = saved[4:4 + n_params], saved[4 + n_params:]
        emb = _MLP(params[:n_emb], eps_emb) if n_emb else None
        mlp = _MLP(params[n_emb:], eps)
        n_kept_emb = len(emb.ws) + 3 if emb else 0
        if emb:
            emb.restore(kept[:n_kept_emb])
        mlp.restore(kept[n_kept_emb:])
        need = ctx.needs_input_grad
        grads = [torch.zeros_like(p) if p is not None and need[num_args + i] else None for i, p in enumerate(params)]
        g_emb, g_mlp = grads[:n_emb], grads[n_emb:]
        g_attr = kernel.empty(tuple(attr.shape), attr) if need[0] else None
        g_ps = kernel.empty((num_src, mlp.w0.shape[0]), attr, zero=True) if need[1] else None
        g_pd = kernel.empty((num_dst, mlp.w0.shape[0]), attr, zero=True) if need[2] else None
        if not want_edges:
            g_edges = None
        for s in range(0, attr.shape[0], rows):
            e = min(attr.shape[0], s + rows)
            a = attr[s:e] if emb is None else emb.output(s, e)
            # gradients of y = a + m (the edges out) and of m (the last LayerNorm's output)
            g_y = None if g_edges is None else g_edges[s:e]
            gathered = None if g_agg is None else g_agg.index_select(0, dst_local[s:e])
            if aggregate == "edges" and gathered is not None:
                g_y = gathered if g_y is None else gathered.add_(g_y)
            g_m = g_y
            if aggregate == "msg" and gathered is not None:
                g_m = gathered if g_m is None else gathered.add_(g_m)
            if g_m is None:
                g_m = a.new_zeros(e - s, mlp.out)
            g_h = mlp.backward(g_m, a, s, e, g_mlp)
            if g_ps is not None:
                g_ps.index_add_(0, src[s:e], g_h)
            if g_pd is not None:
                g_pd.index_add_(0, dst[s:e], g_h)
            if emb is None and g_attr is None:
                continue
            out = g_attr[s:e] if emb is None else None
            g_a = torch.mm(g_h, mlp.w0, out=out) if g_y is None else torch.addmm(g_y, g_h, mlp.w0, out=out)
            if emb is not None:
                g_h = emb.backward(g_a, attr[s:e], s, e, g_emb)
                if g_attr is not None:
                    torch.mm(g_h, emb.w0, out=g_attr[s:e])
        return (g_attr, g_ps, g_pd, *([None] * (num_args - 3)), *grads)


class _FusedMLP(torch.autograd.Function):
    """:class:`GNNMLP` on rows ``x`` ``(R, C_in)``, in row blocks of ``kernel.options.block_bytes``
    (as :class:`_FusedEdgeMLP` without gathers and aggregation): ``(R, C_out)``."""

    @staticmethod
    def forward(ctx, x, save, eps, kernel, *params):  # noqa: ANN001
        mlp = _MLP(params, eps)
        if save:
            mlp.allocate(x.shape[0], x, kernel)
        out = kernel.empty((x.shape[0], mlp.out), x)
        width = max(mlp.w0.shape[0], mlp.out)
        rows = kernel.rows(width, x)
        for s in range(0, x.shape[0], rows):
            e = min(x.shape[0], s + rows)
            out[s:e] = mlp.forward(x[s:e], None, s, e)
        ctx.rows, ctx.eps, ctx.kernel = rows, eps, kernel
        if save:
            ctx.save_for_backward(x, *params, *mlp.saved())
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, g_out):  # noqa: ANN001
        n_params = len(ctx.needs_input_grad) - 4
        saved = ctx.saved_tensors
        x, params = saved[0], saved[1:1 + n_params]
        mlp = _MLP(params, ctx.eps)
        mlp.restore(saved[1 + n_params:])
        need = ctx.needs_input_grad
        grads = [torch.zeros_like(p) if need[4 + i] else None for i, p in enumerate(params)]
        g_x = ctx.kernel.empty(tuple(x.shape), x) if need[0] else None
        for s in range(0, x.shape[0], ctx.rows):
            e = min(x.shape[0], s + ctx.rows)
            g_h = mlp.backward(g_out[s:e], x[s:e], s, e, grads)
            if g_x is not None:
                torch.mm(g_h, mlp.w0, out=g_x[s:e])
        return (g_x, None, None, None, *grads)


def _mlp_params(mlp: nn.Sequential, w_first: Tensor | None = None) -> list[Tensor | None]:
    """``[w0, b0, ln_w, ln_b, w1, b1, ...]`` of a :func:`gnn_mlp`; ``w_first`` replaces the first
    linear's weight and drops its bias (a message MLP's bias sits in ``p_dst``)."""
    linears, norm = _mlp_parts(mlp)
    w0, b0 = (linears[0].weight, linears[0].bias) if w_first is None else (w_first, None)
    return [w0, b0, norm.weight, norm.bias, *[t for lin in linears[1:] for t in (lin.weight, lin.bias)]]


def _fused_edge_mlp(
    mlp: nn.Sequential,
    embedding: nn.Sequential | None,
    attr: Tensor,
    p_src: Tensor,
    p_dst: Tensor,
    w_attr: Tensor,
    src: Tensor,
    dst: Tensor,
    dst_local: Tensor,
    num_agg: int,
    aggregate: str,
    want_edges: bool,
    kernel: _Kernel,
) -> tuple[Tensor, Tensor]:
    """:class:`_FusedEdgeMLP` with the message MLP ``mlp`` (its first linear's edge part ``w_attr``)
    and the edge ``embedding`` (or None), its buffers from ``kernel``."""
    emb = [] if embedding is None else _mlp_params(embedding)
    params = [*emb, *_mlp_params(mlp, w_attr)]
    # keep the pre-activations only when a backward can follow
    save = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (attr, p_src, p_dst, *params))
    eps_emb = 0.0 if embedding is None else embedding[-1].eps
    return _FusedEdgeMLP.apply(attr, p_src, p_dst, src, dst, dst_local, num_agg, aggregate, want_edges, save,
                               len(emb), eps_emb, mlp[-1].eps, kernel, *params)


class _GNNBase(nn.Module):
    def __init__(
        self,
        src_channels: int,
        dst_channels: int,
        edge_channels: int,
        mlp_ratio: float,
        num_chunks: int,
        mlp_hidden_layers: int = 1,
        edge_in_channels: int | None = None,
        aggregate_updated_edges: bool = False,
        kernel_options: EdgeKernelOptions | None = None,
        buffer_pool: EdgeBufferPool | None = None,
    ) -> None:
        super().__init__()
        for name, value in (("src_channels", src_channels), ("dst_channels", dst_channels),
                            ("edge_channels", edge_channels), ("mlp_hidden_layers", mlp_hidden_layers)):
            _check_positive(name, value)
        if edge_in_channels is not None:
            _check_positive("edge_in_channels", edge_in_channels)
        if not mlp_ratio > 0:
            raise ValueError(f"mlp_ratio must be positive, got {mlp_ratio}")
        self.src_channels, self.dst_channels, self.edge_channels = src_channels, dst_channels, edge_channels
        self.edge_in_channels = edge_in_channels
        self.aggregate_updated_edges = bool(aggregate_updated_edges)
        self.num_chunks = check_num_chunks(num_chunks)
        # plain attributes, not state: the kernel options and the (possibly shared) buffer pool
        self.kernel_options, self.buffer_pool = _check_kernel_args(kernel_options, buffer_pool)
        kernel = dict(kernel_options=self.kernel_options, buffer_pool=self.buffer_pool)
        edge_hidden = max(1, round(edge_channels * mlp_ratio))
        edge_in = src_channels + dst_channels + edge_channels
        self.edge_mlp = gnn_mlp(edge_in, edge_hidden, edge_channels, mlp_hidden_layers, **kernel)
        self.node_mlp = gnn_mlp(dst_channels + edge_channels, max(1, round(dst_channels * mlp_ratio)), dst_channels,
                                mlp_hidden_layers, **kernel)
        # registered only when used: the default block's parameters (and state_dict keys) are unchanged
        if edge_in_channels is not None:
            self.edge_embedding = gnn_mlp(edge_in_channels, edge_hidden, edge_channels, mlp_hidden_layers, **kernel)
        else:
            self.edge_embedding = None

    def _check_channels(self, x_src: Tensor, x_dst: Tensor, edge_attr: Tensor) -> None:
        edge_in = self.edge_channels if self.edge_in_channels is None else self.edge_in_channels
        check_node_and_edge_shapes(x_src, x_dst, edge_attr, self.src_channels, self.dst_channels, edge_in)

    def _fused(self, *tensors: Tensor) -> bool:
        """Whether the fused edge MLP (:class:`_FusedEdgeMLP`) runs: CPU, float32 / float64, the
        blocks' own MLPs."""
        options = self.kernel_options
        return _fusable(self.edge_mlp, options, *tensors) and _fusable(self.edge_embedding, options, *tensors)

    def _fused_chunk(
        self, p_src: Tensor, p_dst: Tensor, w_attr: Tensor, x_dst: Tensor, attr: Tensor, src: Tensor, dst: Tensor,
        first: int, end: int, update_edges: bool,
    ) -> tuple[Tensor, ...]:
        """The chunk's edges through :class:`_FusedEdgeMLP` (the embedding too, if any), then the node
        MLP. Batch dims ``(*batch)`` of the nodes become rows: node ``n``, batch entry ``b`` is row
        ``n * B + b`` (edges the same); edge attributes shared by the batch are expanded (so with
        ``B > 1`` the edge embedding runs per batch entry)."""
        batch = tuple(x_dst.shape[1:-1])
        num_edges, num_rows = attr.shape[0], end - first
        nb = 1
        for b in batch:
            nb *= b
        dst_local = dst - first if first else dst
        if nb != 1:
            ar = torch.arange(nb, device=src.device)
            src, dst, dst_local = ((i.unsqueeze(1) * nb + ar).reshape(-1) for i in (src, dst, dst_local))
        width = attr.shape[-1]
        if attr.dim() == 2 and batch:  # edges shared by every batch entry
            attr = attr.reshape((num_edges,) + (1,) * len(batch) + (width,)).expand((num_edges, *batch, width))
        hidden = p_src.shape[-1]
        edges, agg = _fused_edge_mlp(
            self.edge_mlp, self.edge_embedding, attr.reshape(-1, width), p_src.reshape(-1, hidden),
            p_dst.reshape(-1, hidden), w_attr, src, dst, dst_local, num_rows * nb,
            "edges" if self.aggregate_updated_edges else "msg", update_edges,
            _Kernel(self.kernel_options, self.buffer_pool),
        )
        x = x_dst[first:end]
        c = self.edge_channels
        x = x + self.node_mlp(torch.cat([x, agg.reshape((num_rows, *batch, c))], dim=-1))
        return (x, edges.reshape((num_edges, *batch, c))) if update_edges else (x,)

    def _message_pass(
        self, x_src: Tensor, x_dst: Tensor, edge_attr: Tensor, update_edges: bool
    ) -> tuple[Tensor, Tensor | None]:
        """``(x_dst', edge_attr' or None)``; ``x_src`` ``(num_src_local, [*batch,] C_src)`` (this
        rank's rows: the halo is exchanged here, overlapped with their projection); the edge update
        only when ``update_edges``."""
        num_dst = x_dst.shape[0]
        edge_index = self.plan.edge_index.to(x_dst.device)
        # edge attributes are often a module buffer, which bf16 engines leave in fp32: compute in the nodes' dtype
        edge_attr = edge_attr.to(x_dst.dtype)
        # the edge MLP's first linear on [x_j, x_i, e_ji] is W_s x_j + W_d x_i + W_e e_ji: project
        # the nodes once (N rows) and gather the projections, instead of a GEMM over E concatenated rows.
        # Only the sources' projection needs the halo: the raw halo rows are exchanged behind the
        # local rows' product (halo_linear: the bytes of exchange_halo) and used nowhere else
        first_linear = self.edge_mlp[0]
        w_src, w_dst, w_attr = first_linear.weight.split([self.src_channels, self.dst_channels, self.edge_channels], 1)
        p_src = halo_linear(self.plan, x_src, (w_src,), (None,))[0]
        p_dst = F.linear(x_dst, w_dst, first_linear.bias)

        def chunk(ids: Tensor | None, first: int, end: int) -> tuple[Tensor, ...]:
            index, attr = (edge_index, edge_attr) if ids is None else (edge_index[:, ids], edge_attr[ids])
            src, dst = index[0], index[1]
            if self._fused(x_src, x_dst, attr, p_src, p_dst):
                return self._fused_chunk(p_src, p_dst, w_attr, x_dst, attr, src, dst, first, end, update_edges)
            if self.edge_embedding is not None:  # inside the chunk: checkpointed chunks recompute it
                attr = self.edge_embedding(attr)
            hidden = p_src.index_select(0, src) + p_dst.index_select(0, dst)
            attr_b = attr.reshape(attr.shape[:1] + (1,) * (hidden.dim() - attr.dim()) + attr.shape[1:])
            hidden = hidden + F.linear(attr_b, w_attr)  # broadcast: edges shared by every batch entry
            attr_b = attr_b.expand(hidden.shape[:-1] + attr.shape[-1:])
            msg = self.edge_mlp[1:](hidden)
            new_edges = attr_b + msg if update_edges or self.aggregate_updated_edges else None
            summed = new_edges if self.aggregate_updated_edges else msg
            acc = torch.promote_types(summed.dtype, torch.float32)  # the sum over edges accumulates in fp32
            agg = segment_sum(summed.to(acc), dst - first if first else dst, end - first).to(summed.dtype)
            x = x_dst[first:end]
            x = x + self.node_mlp(torch.cat([x, agg], dim=-1))
            return (x, new_edges) if update_edges else (x,)

        outs, order = map_destination_chunks(chunk, edge_index, num_dst, self.num_chunks)
        if order is None:
            return outs[0][0], outs[0][1] if update_edges else None
        nodes = torch.cat([o[0] for o in outs], dim=0)
        if not update_edges:
            return nodes, None
        # per-edge outputs come chunk by chunk: put them back in edge order
        return nodes, torch.cat([o[1] for o in outs], dim=0)[torch.argsort(order)]


class GNNMapperBlock(_GNNBase):
    """Bipartite GNN block, built with the graph's ``plan`` (``num_nodes=(num_source,
    num_destination)``). ``forward(x_src (N_src_local, [*batch,] src_channels), x_dst
    (N_dst_local, [*batch,] dst_channels), edge_attr (E_local, edge_channels))`` returns the
    updated destinations ``(N_dst_local, [*batch,] dst_channels)``. Communicates one halo exchange
    of the sources over the plan's group, overlapped with their projection.
    ``kernel_options`` / ``buffer_pool``: see the module docstring."""

    def __init__(
        self,
        src_channels: int,
        dst_channels: int,
        edge_channels: int,
        plan: GraphShardPlan,
        mlp_ratio: float = 1.0,
        num_chunks: int = 1,
        *,
        mlp_hidden_layers: int = 1,
        edge_in_channels: int | None = None,
        aggregate_updated_edges: bool = False,
        kernel_options: EdgeKernelOptions | None = None,
        buffer_pool: EdgeBufferPool | None = None,
    ) -> None:
        super().__init__(src_channels, dst_channels, edge_channels, mlp_ratio, num_chunks, mlp_hidden_layers,
                         edge_in_channels, aggregate_updated_edges, kernel_options, buffer_pool)
        self.plan = check_plan(plan, processor=False)

    def forward(self, x_src: Tensor, x_dst: Tensor, edge_attr: Tensor) -> Tensor:
        self._check_channels(x_src, x_dst, edge_attr)
        check_local_rows(self.plan, x_src.shape[0], x_dst.shape[0], edge_attr)
        return self._message_pass(x_src, x_dst, edge_attr, update_edges=False)[0]


class GNNProcessorBlock(_GNNBase):
    """GNN block on one node set, built with the graph's ``plan`` (``num_nodes=<int>``).
    ``forward(x (N_local, [*batch,] channels), edge_attr (E_local, [*batch,] edge_channels))``
    returns ``(x', edge_attr')``, the edges ``(E_local, [*batch,] edge_channels)`` in plan order.
    Communicates one halo exchange of the nodes over the plan's group, overlapped with their
    projection. ``kernel_options`` / ``buffer_pool``: see the module docstring."""

    def __init__(
        self,
        channels: int,
        edge_channels: int,
        plan: GraphShardPlan,
        mlp_ratio: float = 1.0,
        num_chunks: int = 1,
        *,
        mlp_hidden_layers: int = 1,
        edge_in_channels: int | None = None,
        aggregate_updated_edges: bool = False,
        kernel_options: EdgeKernelOptions | None = None,
        buffer_pool: EdgeBufferPool | None = None,
    ) -> None:
        super().__init__(channels, channels, edge_channels, mlp_ratio, num_chunks, mlp_hidden_layers,
                         edge_in_channels, aggregate_updated_edges, kernel_options, buffer_pool)
        self.plan = check_plan(plan, processor=True)

    def forward(self, x: Tensor, edge_attr: Tensor) -> tuple[Tensor, Tensor]:
        self._check_channels(x, x, edge_attr)
        check_local_rows(self.plan, x.shape[0], x.shape[0], edge_attr)
        return self._message_pass(x, x, edge_attr, update_edges=True)
