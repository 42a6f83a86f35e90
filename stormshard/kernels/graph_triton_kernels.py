"""The ``@triton.jit`` kernels of :mod:`stormshard.kernels.graph_triton` (imported lazily by it).

Layouts (all contiguous, row-major; ``N`` nodes, ``B`` batch entries, ``H`` heads, ``D`` head size,
``F`` edge features, ``F1 = F + 1`` with the edge bias as a last column of ones):

- ``q`` ``(Nd, B, H, D)``, ``k`` / ``v`` ``(Ns, B, H, D)``, ``out`` / ``go`` (output gradient) like ``q``;
- ``attr`` ``(E, F)`` (shared by the batch: ``SHARED``) or ``(E, B, F)``, edges in the caller's order;
  its gradient ``dattr`` ``(E, B, F)`` (summed over the batch outside when shared);
- ``w`` ``(F1, H, D)``: column ``f`` of every head's ``[W_e | b_e]`` as one contiguous ``H * D`` run;
- per (node, batch entry, head) statistics ``lse`` / ``delta`` ``(Nd, B, H)`` and per (node, batch
  entry, head, column) ``u`` / ``gu`` / ``agg`` / ``de`` ``(Nd, B, H, F1)``, in the accumulation dtype;
- the destination CSR ``ptr`` ``(Nd + 1)``, ``nbr`` (source of each edge, ``(E,)``), ``eid`` (the
  edge's position in the caller's order, ``(E,)``); the source CSR likewise with destinations.

Every program owns one (node, batch entry) pair and all its heads: the node's rows are one
``[HP, DP]`` tile (``HP`` / ``DP`` / ``FP`` the powers of two at or above ``H`` / ``D`` / ``F1``,
padding masked), its edges are walked ``BLOCK_E`` at a time from the CSR range as
``[BLOCK_E, HP, DP]`` tiles (each neighbour row one contiguous ``H * D`` run). Everything is
accumulated in ``ACC`` (fp32, or fp64 for fp64 inputs) whatever the input dtypes (converted on
load); results are converted to the output pointer's dtype on store. No atomics: every output
element is written by exactly one program, sums run in a fixed order (deterministic).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["graph_attention_fwd", "graph_attention_bwd_dst", "graph_attention_bwd_src"]


@triton.jit
def _program(ptr_ptr, B, H: tl.constexpr, D: tl.constexpr, F: tl.constexpr, HP: tl.constexpr, DP: tl.constexpr,
             FP: tl.constexpr, BLOCK_E: tl.constexpr, ACC: tl.constexpr):
    """This program's node ``n`` (``program_id(0)``), batch entry ``b`` (``program_id(1)``), its row
    ``node = n * B + b``, the offsets and masks of a ``[HP, DP]`` head tile (``hd``) and an ``[HP, FP]``
    column tile (``hf``), the edge lanes, the logit scale and the node's CSR range ``start .. end``."""
    n = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    offs_h = tl.arange(0, HP)
    offs_d = tl.arange(0, DP)
    offs_f = tl.arange(0, FP)
    hd = offs_h[:, None] * D + offs_d[None, :]
    hd_mask = (offs_h[:, None] < H) & (offs_d[None, :] < D)
    hf = offs_h[:, None] * (F + 1) + offs_f[None, :]
    hf_mask = (offs_h[:, None] < H) & (offs_f[None, :] < F + 1)
    scale = 1.0 / tl.sqrt(tl.full([1], D, ACC))
    start = tl.load(ptr_ptr + n)
    end = tl.load(ptr_ptr + n + 1)
    return n * B + b, b, offs_h, offs_f, hd, hd_mask, hf, hf_mask, tl.arange(0, BLOCK_E), scale, start, end


@triton.jit
def _project(x, w_ptr, hd, hd_mask, offs_f, H: tl.constexpr, D: tl.constexpr, F: tl.constexpr,
             HP: tl.constexpr, FP: tl.constexpr, ACC: tl.constexpr):
    """``W^T x`` per head: ``[HP, FP]`` from ``x`` ``[HP, DP]`` (column ``f`` = ``sum_d x[h, d] w[f, h, d]``)."""
    res = tl.zeros((HP, FP), ACC)
    for f in tl.static_range(F + 1):
        wf = tl.load(w_ptr + f * (H * D) + hd, mask=hd_mask, other=0.0).to(ACC)
        res += tl.where(offs_f[None, :] == f, tl.sum(x * wf, 1)[:, None], 0.0)
    return res


@triton.jit
def _expand(acc, y, w_ptr, hd, hd_mask, offs_f, H: tl.constexpr, D: tl.constexpr, F: tl.constexpr,
            ACC: tl.constexpr):
    """``acc + W y`` per head: ``acc`` ``[HP, DP]`` plus ``sum_f y[h, f] w[f, h, :]`` for ``y`` ``[HP, FP]``."""
    for f in tl.static_range(F + 1):
        wf = tl.load(w_ptr + f * (H * D) + hd, mask=hd_mask, other=0.0).to(ACC)
        acc += tl.sum(tl.where(offs_f[None, :] == f, y, 0.0), 1)[:, None] * wf
    return acc


@triton.jit
def _edge_attributes(attr_ptr, eid, emask, b, B, offs_f, F: tl.constexpr, SHARED: tl.constexpr, ACC: tl.constexpr):
    """``[BLOCK_E, FP]`` attributes of the edges ``eid`` for batch entry ``b`` (row ``eid`` of ``(E, F)``
    attributes when ``SHARED``, else row ``(eid, b)`` of ``(E, B, F)``), with the ones column ``F``."""
    if SHARED:
        row = eid
    else:
        row = eid * B + b
    ptrs = attr_ptr + row[:, None] * F + offs_f[None, :]
    a = tl.load(ptrs, mask=emask[:, None] & (offs_f[None, :] < F), other=0.0).to(ACC)
    return tl.where(offs_f[None, :] == F, 1.0, a)


@triton.jit
def _edge_block(nbr_ptr, eid_ptr, attr_ptr, e0, end, b, B, offs_e, offs_f, hd, hd_mask, H: tl.constexpr,
                D: tl.constexpr, F: tl.constexpr, SHARED: tl.constexpr, ACC: tl.constexpr):
    """The CSR positions ``e0 .. e0 + BLOCK_E`` (below ``end``): ``(emask [BLOCK_E], eid, nbr_node (the
    neighbour's (node, b) row), rows [BLOCK_E, HP, DP] offsets of the neighbour's heads, rmask, attributes
    [BLOCK_E, FP])``."""
    idx = e0 + offs_e
    emask = idx < end
    nbr = tl.load(nbr_ptr + idx, mask=emask, other=0).to(tl.int64)
    eid = tl.load(eid_ptr + idx, mask=emask, other=0).to(tl.int64)
    nbr_node = nbr * B + b
    rows = (nbr_node * (H * D))[:, None, None] + hd[None, :, :]
    rmask = emask[:, None, None] & hd_mask[None, :, :]
    a = _edge_attributes(attr_ptr, eid, emask, b, B, offs_f, F, SHARED, ACC)
    return emask, eid, nbr_node, rows, rmask, a


@triton.jit
def _scores(x, y, a, u, scale):
    """``scale * (x . y + a . u)`` per (edge, head), ``[BLOCK_E, HP]``: node rows ``x`` / ``y`` and
    columns ``a`` / ``u`` broadcast to ``[BLOCK_E, HP, DP]`` / ``[BLOCK_E, HP, FP]``."""
    return (tl.sum(x * y, 2) + tl.sum(a * u, 2)) * scale


@triton.jit
def graph_attention_fwd(
    q_ptr, k_ptr, v_ptr, attr_ptr, w_ptr, out_ptr, lse_ptr, ptr_ptr, nbr_ptr, eid_ptr,
    B,
    H: tl.constexpr, D: tl.constexpr, F: tl.constexpr, SHARED: tl.constexpr, HP: tl.constexpr, DP: tl.constexpr,
    FP: tl.constexpr, BLOCK_E: tl.constexpr, ACC: tl.constexpr,
):
    """Forward for destination ``program_id(0)``, batch entry ``program_id(1)``: ``out`` (``sum_j
    alpha_j v_j + W agg``) and ``lse`` (``max + log(sum)`` of the logits per head; 0 without edges)."""
    node, b, offs_h, offs_f, hd, hd_mask, hf, hf_mask, offs_e, scale, start, end = _program(
        ptr_ptr, B, H, D, F, HP, DP, FP, BLOCK_E, ACC)
    q = tl.load(q_ptr + node * (H * D) + hd, mask=hd_mask, other=0.0).to(ACC)
    u = _project(q, w_ptr, hd, hd_mask, offs_f, H, D, F, HP, FP, ACC)  # W^T q  [HP, FP]

    m_i = tl.full((HP,), float("-inf"), ACC)
    l_i = tl.zeros((HP,), ACC)
    acc = tl.zeros((HP, DP), ACC)
    agg = tl.zeros((HP, FP), ACC)
    for e0 in range(start, end, BLOCK_E):
        emask, eid, _, rows, rmask, a = _edge_block(nbr_ptr, eid_ptr, attr_ptr, e0, end, b, B, offs_e, offs_f, hd,
                                                    hd_mask, H, D, F, SHARED, ACC)
        k = tl.load(k_ptr + rows, mask=rmask, other=0.0).to(ACC)
        s = _scores(k, q[None, :, :], a[:, None, :], u[None, :, :], scale)
        s = tl.where(emask[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        corr = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[None, :])
        l_i = l_i * corr + tl.sum(p, 0)
        v = tl.load(v_ptr + rows, mask=rmask, other=0.0).to(ACC)
        acc = acc * corr[:, None] + tl.sum(p[:, :, None] * v, 0)
        agg = agg * corr[:, None] + tl.sum(p[:, :, None] * a[:, None, :], 0)
        m_i = m_new

    has = l_i > 0
    l_safe = tl.where(has, l_i, 1.0)
    inv = tl.where(has, 1.0 / l_safe, 0.0)
    out = _expand(acc * inv[:, None], agg * inv[:, None], w_ptr, hd, hd_mask, offs_f, H, D, F, ACC)
    tl.store(out_ptr + node * (H * D) + hd, out, mask=hd_mask)
    tl.store(lse_ptr + node * H + offs_h, tl.where(has, m_i + tl.log(l_safe), 0.0), mask=offs_h < H)


@triton.jit
def graph_attention_bwd_dst(
    q_ptr, k_ptr, v_ptr, attr_ptr, w_ptr, go_ptr, lse_ptr, ptr_ptr, nbr_ptr, eid_ptr,
    dq_ptr, u_ptr, gu_ptr, agg_ptr, de_ptr, delta_ptr,
    B,
    H: tl.constexpr, D: tl.constexpr, F: tl.constexpr, SHARED: tl.constexpr, HP: tl.constexpr,
    DP: tl.constexpr, FP: tl.constexpr, BLOCK_E: tl.constexpr, ACC: tl.constexpr,
):
    """Backward, destination side, for destination ``program_id(0)``, batch entry ``program_id(1)``.

    One pass over the node's edges: ``alpha`` recomputed from ``lse``, ``dalpha = go . v_j + gu . a_j``
    (``gu = W^T go``); with ``delta = sum_j alpha_j dalpha_j`` (exact in ``ACC``: not ``go . out``
    from a rounded output) ``ds_j = alpha_j (dalpha_j - delta) scale``, so ``sum_j ds_j x_j = scale
    (sum_j alpha_j dalpha_j x_j - delta sum_j alpha_j x_j)``. Writes ``dq = sum_j ds_j k_j + W de``
    and what the source side and the weight gradient read: ``u = W^T q``, ``gu``, ``agg = sum_j
    alpha_j a_j``, ``de = sum_j ds_j a_j``, ``delta``."""
    node, b, offs_h, offs_f, hd, hd_mask, hf, hf_mask, offs_e, scale, start, end = _program(
        ptr_ptr, B, H, D, F, HP, DP, FP, BLOCK_E, ACC)
    hmask = offs_h < H
    q = tl.load(q_ptr + node * (H * D) + hd, mask=hd_mask, other=0.0).to(ACC)
    go = tl.load(go_ptr + node * (H * D) + hd, mask=hd_mask, other=0.0).to(ACC)
    lse = tl.load(lse_ptr + node * H + offs_h, mask=hmask, other=0.0).to(ACC)
    u = _project(q, w_ptr, hd, hd_mask, offs_f, H, D, F, HP, FP, ACC)
    gu = _project(go, w_ptr, hd, hd_mask, offs_f, H, D, F, HP, FP, ACC)

    delta = tl.zeros((HP,), ACC)
    k_dal = tl.zeros((HP, DP), ACC)  # sum_j alpha_j dalpha_j k_j
    k_sum = tl.zeros((HP, DP), ACC)  # sum_j alpha_j k_j
    a_dal = tl.zeros((HP, FP), ACC)  # sum_j alpha_j dalpha_j a_j
    agg = tl.zeros((HP, FP), ACC)  # sum_j alpha_j a_j
    for e0 in range(start, end, BLOCK_E):
        emask, eid, _, rows, rmask, a = _edge_block(nbr_ptr, eid_ptr, attr_ptr, e0, end, b, B, offs_e, offs_f, hd,
                                                    hd_mask, H, D, F, SHARED, ACC)
        k = tl.load(k_ptr + rows, mask=rmask, other=0.0).to(ACC)
        v = tl.load(v_ptr + rows, mask=rmask, other=0.0).to(ACC)
        s = _scores(k, q[None, :, :], a[:, None, :], u[None, :, :], scale)
        alpha = tl.where(emask[:, None] & hmask[None, :], tl.exp(s - lse[None, :]), 0.0)
        dalpha = _scores(v, go[None, :, :], a[:, None, :], gu[None, :, :], 1.0)
        weighted = alpha * dalpha
        delta += tl.sum(weighted, 0)
        k_dal += tl.sum(weighted[:, :, None] * k, 0)
        k_sum += tl.sum(alpha[:, :, None] * k, 0)
        a_dal += tl.sum(weighted[:, :, None] * a[:, None, :], 0)
        agg += tl.sum(alpha[:, :, None] * a[:, None, :], 0)

    de = (a_dal - delta[:, None] * agg) * scale
    dq = _expand((k_dal - delta[:, None] * k_sum) * scale, de, w_ptr, hd, hd_mask, offs_f, H, D, F, ACC)
    tl.store(dq_ptr + node * (H * D) + hd, dq, mask=hd_mask)
    cols = node * (H * (F + 1)) + hf
    tl.store(u_ptr + cols, u, mask=hf_mask)
    tl.store(gu_ptr + cols, gu, mask=hf_mask)
    tl.store(agg_ptr + cols, agg, mask=hf_mask)
    tl.store(de_ptr + cols, de, mask=hf_mask)
    tl.store(delta_ptr + node * H + offs_h, delta, mask=hmask)


@triton.jit
def graph_attention_bwd_src(
    q_ptr, k_ptr, v_ptr, attr_ptr, go_ptr, lse_ptr, delta_ptr, u_ptr, gu_ptr, ptr_ptr, nbr_ptr, eid_ptr,
    dk_ptr, dv_ptr, dattr_ptr,
    B,
    H: tl.constexpr, D: tl.constexpr, F: tl.constexpr, SHARED: tl.constexpr, HP: tl.constexpr, DP: tl.constexpr,
    FP: tl.constexpr, BLOCK_E: tl.constexpr, ACC: tl.constexpr, NEED_DA: tl.constexpr,
):
    """Backward, source side, for source ``program_id(0)``, batch entry ``program_id(1)``, over its
    out-edges (source CSR: ``nbr`` are destinations): ``dk = sum_j ds_j q_dst``, ``dv = sum_j alpha_j
    go_dst``, with ``alpha`` / ``ds`` recomputed from the destination side's ``lse``, ``delta``,
    ``u``, ``gu``; when ``NEED_DA`` each edge's attribute gradient ``sum_h alpha gu + ds u`` (columns
    ``< F``) into ``dattr`` ``(E, B, F)`` row ``(eid, b)`` (every (edge, batch entry) has one source
    program: no two programs write one element)."""
    node, b, offs_h, offs_f, hd, hd_mask, hf, hf_mask, offs_e, scale, start, end = _program(
        ptr_ptr, B, H, D, F, HP, DP, FP, BLOCK_E, ACC)
    hmask = offs_h < H
    k = tl.load(k_ptr + node * (H * D) + hd, mask=hd_mask, other=0.0).to(ACC)
    v = tl.load(v_ptr + node * (H * D) + hd, mask=hd_mask, other=0.0).to(ACC)

    dk = tl.zeros((HP, DP), ACC)
    dv = tl.zeros((HP, DP), ACC)
    for e0 in range(start, end, BLOCK_E):
        emask, eid, dnode, rows, rmask, a = _edge_block(nbr_ptr, eid_ptr, attr_ptr, e0, end, b, B, offs_e, offs_f, hd,
                                                        hd_mask, H, D, F, SHARED, ACC)
        q = tl.load(q_ptr + rows, mask=rmask, other=0.0).to(ACC)
        go = tl.load(go_ptr + rows, mask=rmask, other=0.0).to(ACC)
        cols = (dnode * (H * (F + 1)))[:, None, None] + hf[None, :, :]
        cmask = emask[:, None, None] & hf_mask[None, :, :]
        u = tl.load(u_ptr + cols, mask=cmask, other=0.0).to(ACC)
        gu = tl.load(gu_ptr + cols, mask=cmask, other=0.0).to(ACC)
        stats = dnode[:, None] * H + offs_h[None, :]
        smask = emask[:, None] & hmask[None, :]
        lse = tl.load(lse_ptr + stats, mask=smask, other=0.0).to(ACC)
        delta = tl.load(delta_ptr + stats, mask=smask, other=0.0).to(ACC)
        s = _scores(q, k[None, :, :], u, a[:, None, :], scale)
        alpha = tl.where(smask, tl.exp(s - lse), 0.0)
        dalpha = _scores(go, v[None, :, :], gu, a[:, None, :], 1.0)
        ds = alpha * (dalpha - delta) * scale
        dk += tl.sum(ds[:, :, None] * q, 0)
        dv += tl.sum(alpha[:, :, None] * go, 0)
        if NEED_DA:
            da = tl.sum(alpha[:, :, None] * gu + ds[:, :, None] * u, 1)  # [BLOCK_E, FP]
            dptrs = dattr_ptr + (eid * B + b)[:, None] * F + offs_f[None, :]
            tl.store(dptrs, da, mask=emask[:, None] & (offs_f[None, :] < F))

    tl.store(dk_ptr + node * (H * D) + hd, dk, mask=hd_mask)
    tl.store(dv_ptr + node * (H * D) + hd, dv, mask=hd_mask)
