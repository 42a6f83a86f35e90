"""Linear projections of halo-extended source rows, with the halo exchange hidden behind them.

A sharded graph layer needs, for every edge, linear maps of its source node's features (keys
and values in graph attention, the source term of a GNN's edge MLP). With destination-node
sharding those sources are this rank's rows plus a halo of remote rows
(:meth:`GraphShardPlan.exchange_halo`). Exchanging the rows and then projecting them serialises
the all-to-all and the matrix products; :func:`halo_linear` overlaps them:

- forward: the rows other ranks need leave in an asynchronous row exchange
  (:func:`~stormshard.parallel.comm.start_all_to_all_rows`, one ``all_to_all_single``) while the
  local rows are projected; the (small) halo is projected when it arrives;
- backward: the halo rows' input gradients are computed first and leave in an asynchronous
  row exchange while the local rows' input and weight gradients are computed; the gradients that
  come back are added to the rows they were sent from.

The bytes are those of :meth:`GraphShardPlan.exchange_halo` (one exchange of the un-projected
rows each way), whatever the number of projections. With one rank, or a layout without halos,
it is a plain ``F.linear`` per weight.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from stormshard.parallel.comm import start_all_to_all_rows
from stormshard.parallel.graph import GraphShardPlan

__all__ = ["halo_linear"]


class _HaloLinear(torch.autograd.Function):
    """``[cat(x, halo(x)) @ w.T + b for w, b]``; the all-to-alls overlap the local products.

    ``x`` ``(N_local, *batch, C)``; outputs ``(N_local + num_halo, *batch, out_i)``.
    """

    @staticmethod
    def forward(ctx, x: Tensor, plan: GraphShardPlan, num: int, *params: Tensor):  # noqa: ANN001
        weights, biases = params[:num], params[num:]
        n_local, n_halo = x.shape[0], plan.num_halo
        batch, c = tuple(x.shape[1:-1]), x.shape[-1]
        xf = x.reshape(-1, c)
        send_index = plan.send_index.to(x.device)
        rows = x.index_select(0, send_index).contiguous()
        pending = start_all_to_all_rows(rows, plan.send_counts, plan.recv_counts, plan.group)
        outs = []
        for w, b in zip(weights, biases, strict=True):
            out = x.new_empty((n_local + n_halo,) + batch + (w.shape[0],))
            local = out[:n_local].view(-1, w.shape[0])
            if b.numel():
                torch.addmm(b, xf, w.t(), out=local)
            else:
                torch.mm(xf, w.t(), out=local)
            outs.append(out)
        halo = pending.wait()
        hf = halo.view(-1, c)
        for out, w, b in zip(outs, weights, biases, strict=True):
            far = out[n_local:].view(-1, w.shape[0])
            if b.numel():
                torch.addmm(b, hf, w.t(), out=far)
            else:
                torch.mm(hf, w.t(), out=far)
        ctx.save_for_backward(x, halo, *weights)
        ctx.plan, ctx.num, ctx.has_bias = plan, num, [b.numel() > 0 for b in biases]
        return tuple(outs)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads: Tensor):  # noqa: ANN001
        x, halo, *weights = ctx.saved_tensors
        plan: GraphShardPlan = ctx.plan
        n_local, c = x.shape[0], x.shape[-1]
        xf, hf = x.reshape(-1, c), halo.reshape(-1, c)
        g_local = [g[:n_local].reshape(-1, g.shape[-1]) for g in grads]
        g_far = [g[n_local:].reshape(-1, g.shape[-1]) for g in grads]

        # the halo rows' input gradient leaves first ...
        g_halo = g_far[0] @ weights[0]
        for g, w in zip(g_far[1:], weights[1:], strict=True):
            g_halo.addmm_(g, w)
        pending = start_all_to_all_rows(g_halo.view(halo.shape), plan.recv_counts, plan.send_counts, plan.group)
        # ... while the local rows' gradients are computed
        gx = g_local[0] @ weights[0]
        for g, w in zip(g_local[1:], weights[1:], strict=True):
            gx.addmm_(g, w)
        need_w = ctx.needs_input_grad[3:3 + ctx.num]
        need_b = ctx.needs_input_grad[3 + ctx.num:]
        gws, gbs = [], []
        for i, (gl, gf) in enumerate(zip(g_local, g_far, strict=True)):
            gws.append((gl.t() @ xf).addmm_(gf.t(), hf) if need_w[i] else None)
            gbs.append(gl.sum(0) + gf.sum(0) if ctx.has_bias[i] and need_b[i] else None)
        back = pending.wait()
        gx = gx.view(x.shape)
        gx.index_add_(0, plan.send_index.to(x.device), back)
        return (gx, None, None, *gws, *gbs)


def halo_linear(
    plan: GraphShardPlan,
    x_src: Tensor,
    weights: Sequence[Tensor],
    biases: Sequence[Tensor | None],
) -> list[Tensor]:
    """``[F.linear(plan.exchange_halo(x_src), w, b) for w, b in zip(weights, biases)]``, overlapped.

    ``x_src`` ``(num_src_local, *batch, C)`` (this rank's source rows), ``weights`` ``(out_i, C)``,
    ``biases`` ``(out_i,)`` or None. Returns ``(num_src_local + num_halo, *batch, out_i)`` per
    weight: this rank's rows then its halo rows, in the plan's order (``plan.edge_index[0]``
    indexes them). Communicates exactly what :meth:`GraphShardPlan.exchange_halo` does (one
    ``all_to_all_single`` of the raw rows forward, one of their gradients backward), each
    overlapped with the local rows' products (under torch.compile: the exchange, then the products). Under
    autocast the products run in the autocast dtype, as ``F.linear`` would.
    """
    if len(weights) != len(biases) or not weights:
        raise ValueError(f"halo_linear needs one bias (or None) per weight, got {len(weights)} weights "
                         f"and {len(biases)} biases")
    for w in weights:
        if w.dim() != 2 or w.shape[1] != x_src.shape[-1]:
            raise ValueError(f"weights must be (out, {x_src.shape[-1]}) for x_src {tuple(x_src.shape)}, "
                             f"got {tuple(w.shape)}")
    plan.check_source_rows(x_src)
    if sum(plan.halo_per_rank) == 0:  # one rank, or no rank needs a halo: nothing to exchange
        return [F.linear(x_src, w, b) for w, b in zip(weights, biases, strict=True)]
    if torch.compiler.is_compiling():
        # dynamo misread _HaloLinear's arguments on the GNN's split weight (its plan taken for a tensor), and
        # inside a compiled graph the exchange is issued synchronously anyway (comm.start_all_to_all_rows): the
        # same exchange and products, composed
        x_all = plan.exchange_halo(x_src)
        return [F.linear(x_all, w, b) for w, b in zip(weights, biases, strict=True)]
    device_type = x_src.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        x_src = x_src.to(dtype)
        weights = [w.to(dtype) for w in weights]
        biases = [None if b is None else b.to(dtype) for b in biases]
    dtype = torch.promote_types(x_src.dtype, weights[0].dtype)  # result_type of two tensors (traceable by dynamo)
    x_src, weights = x_src.to(dtype), [w.to(dtype) for w in weights]
    biases = [x_src.new_empty(0) if b is None else b.to(dtype) for b in biases]
    with torch.autocast(device_type, enabled=False):
        outs = _HaloLinear.apply(x_src.contiguous(), plan, len(weights), *weights, *biases)
    return list(outs)
