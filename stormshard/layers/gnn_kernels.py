"""The fused, row-blocked GNN kernels (CPU, float32 / float64): the edge MLP and the node MLP.

The GNN blocks (:mod:`stormshard.layers.gnn`) split the first linear of the edge MLP on
``[x_j, x_i, e_ji]`` into per-node projections ``p_src``, ``p_dst`` (N rows, gathered per edge)
plus the edge part ``W_e e_ji``. On CPU in float32 / float64 without autocast the per-edge work
(the edge embedding, the edge MLP, the aggregation) runs in :class:`_FusedEdgeMLP` and a
:class:`~stormshard.layers.gnn.GNNMLP` in :class:`_FusedMLP`: one pass over cache-sized row
blocks forward and backward, keeping only the pre-activations for the backward (GELU outputs and
embedded edges are recomputed), the large buffers recycled from step to step. Elsewhere the
blocks run plain autograd on the same math, and so do they under ``torch.compile``
(``training.compile``): inductor fuses that path itself, and no graph breaks on these kernels.

Public entry points: :func:`fusable` (can the fused path run?), :func:`fused_edge_mlp` and
:func:`fused_mlp`. How they run (block size, recycling) and where their buffers come from:
:mod:`stormshard.layers.gnn_kernel_settings`. Nothing here communicates.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from stormshard.layers.gnn_kernel_settings import EdgeBufferPool, EdgeKernelOptions

__all__ = ["fusable", "fused_edge_mlp", "fused_mlp"]

_FUSED_DTYPES = (torch.float32, torch.float64)


class _Kernel(NamedTuple):
    """A fused path's options and pool, passed into the autograd Functions."""

    options: EdgeKernelOptions
    pool: EdgeBufferPool

    def empty(self, shape: tuple[int, ...], like: Tensor, zero: bool = False) -> Tensor:
        return self.pool.empty(shape, like, self.options, zero)

    def rows(self, width: int, like: Tensor) -> int:
        """Rows of one block of ``width`` channels (``options.block_bytes``, at least 16)."""
        return max(16, self.options.block_bytes // (width * like.element_size()))


def _mlp_parts(mlp: nn.Sequential) -> tuple[list[nn.Linear], nn.LayerNorm] | None:
    """``(linears, layer_norm)`` when ``mlp`` is :func:`~stormshard.layers.gnn.gnn_mlp`'s Linear,
    GELU, ..., Linear, LayerNorm (exact GELU, affine LayerNorm over the last dimension), else None."""
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


def fusable(mlp: nn.Sequential | None, options: EdgeKernelOptions, *tensors: Tensor) -> bool:
    """Whether ``mlp`` (None: nothing to check) can run in the fused kernels on ``tensors``: a
    :func:`~stormshard.layers.gnn.gnn_mlp` (exact GELU, affine LayerNorm), ``options.fused``, no
    autocast, everything on CPU in one of float32 / float64, not under torch.compile (eager-mode
    kernels: their python block loops and buffer pool stay out of a compiled graph, where the
    plain path runs and inductor fuses it)."""
    if mlp is None:
        return True
    if torch.compiler.is_compiling():
        return False
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
    """:class:`~stormshard.layers.gnn.GNNMLP` on rows ``x`` ``(R, C_in)``, in row blocks of
    ``kernel.options.block_bytes`` (as :class:`_FusedEdgeMLP` without gathers and aggregation): ``(R, C_out)``."""

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
    """``[w0, b0, ln_w, ln_b, w1, b1, ...]`` of a :func:`~stormshard.layers.gnn.gnn_mlp`;
    ``w_first`` replaces the first linear's weight and drops its bias (a message MLP's bias sits in ``p_dst``)."""
    linears, norm = _mlp_parts(mlp)
    w0, b0 = (linears[0].weight, linears[0].bias) if w_first is None else (w_first, None)
    return [w0, b0, norm.weight, norm.bias, *[t for lin in linears[1:] for t in (lin.weight, lin.bias)]]


def fused_edge_mlp(
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
    options: EdgeKernelOptions,
    pool: EdgeBufferPool,
) -> tuple[Tensor, Tensor]:
    """:class:`_FusedEdgeMLP` with the message MLP ``mlp`` (its first linear's edge part ``w_attr``)
    and the edge ``embedding`` (or None), its blocks sized by ``options`` and its large buffers
    from ``pool``. Rows: ``attr`` ``(E, C_attr)``, ``p_src`` / ``p_dst`` ``(N, hidden)`` (the
    nodes' projections, gathered per edge by ``src`` / ``dst`` ``(E,)``), ``dst_local`` ``(E,)``
    the aggregation row of each edge in ``[0, num_agg)``. Returns ``(y (E, C) if want_edges else
    an empty tensor, agg (num_agg, C))``."""
    emb = [] if embedding is None else _mlp_params(embedding)
    params = [*emb, *_mlp_params(mlp, w_attr)]
    # keep the pre-activations only when a backward can follow
    save = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (attr, p_src, p_dst, *params))
    eps_emb = 0.0 if embedding is None else embedding[-1].eps
    return _FusedEdgeMLP.apply(attr, p_src, p_dst, src, dst, dst_local, num_agg, aggregate, want_edges, save,
                               len(emb), eps_emb, mlp[-1].eps, _Kernel(options, pool), *params)


def fused_mlp(mlp: nn.Sequential, x: Tensor, options: EdgeKernelOptions, pool: EdgeBufferPool) -> Tensor:
    """:class:`_FusedMLP`: the :func:`~stormshard.layers.gnn.gnn_mlp`-shaped ``mlp`` on ``x``
    ``(..., C_in)`` -> ``(..., C_out)``, in row blocks sized by ``options``, its large buffers from
    ``pool``; keeps the pre-activations only when a backward can follow."""
    params = _mlp_params(mlp)
    save = torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params))
    out = _FusedMLP.apply(x.reshape(-1, x.shape[-1]), save, mlp[-1].eps, _Kernel(options, pool), *params)
    return out.reshape(*x.shape[:-1], out.shape[-1])
