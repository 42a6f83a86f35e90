"""The ``@triton.jit`` kernels of :mod:`stormshard.kernels.graph_triton` (imported lazily by it).

Layouts (all contiguous, row-major; ``N`` nodes, ``B`` batch entries, ``H`` heads, ``D`` head size,
``F`` edge features, ``F1 = F + 1`` with the edge bias as a last column of ones):

- ``q`` ``(Nd, B, H, D)``, ``k`` / ``v`` ``(Ns, B, H, D)``, ``out`` / ``go`` (output gradient) like ``q``;
- ``attr`` ``(E, F)`` (shared by the batch: ``SHARED``) or ``(E, B, F)``, edges in the caller's order;
  its gradient ``dattr`` ``(G, E, B, F)``, one part per head group (the groups, and the batch when
  shared, summed outside);
- ``w`` ``(F1, H, D)``: column ``f`` of every head's ``[W_e | b_e]`` as one contiguous ``H * D`` run;
- per (node, batch entry, head) statistics ``lse`` / ``delta`` ``(Nd, B, H)`` and per (node, batch
  entry, head, column) ``u`` / ``gu`` / ``agg`` / ``de`` ``(Nd, B, H, F1)``, in the accumulation dtype;
- the destination CSR ``ptr`` ``(Nd + 1)``, ``nbr`` (source of each edge, ``(E,)``), ``eid`` (the
  edge's position in the caller's order, ``(E,)``); the source CSR likewise with destinations.

Every program owns ``NPP`` nodes (one after the other; 1 by default) of one head group and batch entry:
``program_id(0) = (node // NPP) * G + group``, ``program_id(1)`` the batch entry; the group's heads ``group * HP ...`` of the node's row are one
``[HP, DP]`` tile (``HP`` a power of two, ``DP`` / ``FP`` the powers of two at or above ``D`` /
``F1``; heads past ``H`` and padding masked), its edges are walked ``BLOCK_E`` at a time from the
CSR range as ``[BLOCK_E, HP, DP]`` tiles (each neighbour row segment one contiguous ``HP * D`` run).
The source side writes each edge's attribute gradient over its group's heads at ``group *
DA_GROUP_STRIDE`` (the caller sums the groups). Everything is
accumulated in ``ACC`` (fp32, or fp64 for fp64 inputs) whatever the input dtypes (converted on
load); results are converted to the output pointer's dtype on store. No atomics: every output
element is written by exactly one program, sums run in a fixed order (deterministic).

The kernels call one ``@triton.jit`` helper, :func:`_edge_block` (an edge block's CSR positions,
neighbour rows and attributes, the same in the three node kernels); the program prologue, the scores and
``W^T x`` / ``W y`` are written out in each kernel, each piece marked by a comment, and sums are
``tl.reduce(x, axis, _sum)`` (``tl.sum``'s own reduction) and zeros ``tl.full``. A GPU compiler inlines
calls (ptxas reports the same registers with the helper as without), but under ``TRITON_INTERPRET=1``
every nested ``@triton.jit`` call (``tl.sum`` and ``tl.zeros`` included) re-patches ``triton.language``:
small helpers everywhere took about half the interpreted time before; the one per edge block costs
nothing measurable (one ``tl.max`` per forward edge block is left too).
"""

from __future__ import annotations

import triton
import triton.language as tl

# ``tl.sum(x, axis)`` is ``tl.reduce(x, axis, _sum)`` behind a nested @jit call: the same reduction, bit
# for bit, compiled or interpreted (numpy's sum), without the interpreter's per-call patching
_sum = tl.standard._sum_combine

__all__ = ["graph_attention_fwd", "graph_attention_bwd_dst", "graph_attention_bwd_src", "graph_attention_bwd_weight"]


@triton.jit
def _node(ptr_ptr, n, N, B, b, hd, hd_mask, offs_h, H: tl.constexpr):
    """Node ``n`` of a program (past ``N`` when the last block of nodes is short): ``n``, its row node (batch
    entry ``b``), the masks of its ``[HP, DP]`` tile and ``[HP]`` heads (empty past ``N``) and its CSR range
    ``start, end`` (empty past ``N``)."""
    valid = n < N
    start = tl.load(ptr_ptr + n, mask=valid, other=0)
    end = tl.load(ptr_ptr + n + 1, mask=valid, other=0)
    # block masks from block comparisons: Triton's interpreter cannot and a block mask with a 0-d one
    return n, n * B + b, hd_mask & (hd * 0 + n < N), (offs_h < H) & (offs_h * 0 + n < N), start, end


@triton.jit
def _edge_block(nbr_ptr, eid_ptr, attr_ptr, e0, end, b, B, hd, hd_mask, offs_e, offs_f,
                H: tl.constexpr, D: tl.constexpr, F: tl.constexpr, SHARED: tl.constexpr, ACC: tl.constexpr):
    """The edge block at CSR positions ``e0 .. e0 + BLOCK_E`` below ``end`` of batch entry ``b``: its mask
    ``[BLOCK_E]``, edge ids, neighbours' row nodes, the offsets and mask of the neighbours' ``[BLOCK_E, HP, DP]``
    rows, and the attributes ``[BLOCK_E, FP]`` (row ``eid``, or ``(eid, b)`` unless ``SHARED``) with the ones
    column ``F``, in ``ACC``."""
    idx = e0 + offs_e
    emask = idx < end
    nbr = tl.load(nbr_ptr + idx, mask=emask, other=0).to(tl.int64)
    eid = tl.load(eid_ptr + idx, mask=emask, other=0).to(tl.int64)
    nbr_node = nbr * B + b
    rows = (nbr_node * (H * D))[:, None, None] + hd[None, :, :]
    rmask = emask[:, None, None] & hd_mask[None, :, :]
    if SHARED:
        row = eid
    else:
        row = eid * B + b
    a = tl.load(attr_ptr + row[:, None] * F + offs_f[None, :], mask=emask[:, None] & (offs_f[None, :] < F),
                other=0.0).to(ACC)
    a = tl.where(offs_f[None, :] == F, 1.0, a)
    return emask, eid, nbr_node, rows, rmask, a


@triton.jit
def graph_attention_fwd(
    q_ptr, k_ptr, v_ptr, attr_ptr, w_ptr, out_ptr, lse_ptr, ptr_ptr, nbr_ptr, eid_ptr,
    N, B,
    H: tl.constexpr, D: tl.constexpr, F: tl.constexpr, SHARED: tl.constexpr, HP: tl.constexpr, G: tl.constexpr,
    DP: tl.constexpr, FP: tl.constexpr, BLOCK_E: tl.constexpr, ACC: tl.constexpr, NPP: tl.constexpr,
):
    """Forward for destination ``program_id(0) // G`` (its head group ``program_id(0) % G``), batch entry
    ``program_id(1)``: ``out`` (``sum_j
    alpha_j v_j + W agg``) and ``lse`` (``max + log(sum)`` of the logits per head; 0 without edges)."""
    # program: nodes NPP * (pid // G) ... (below N), head group pid % G, batch entry b; the [HP, DP] tile of
    # the group's heads and its [HP, FP, DP] slice of W (w[f, h, :]), loaded once for the program's nodes
    pid = tl.program_id(0).to(tl.int64)
    first = (pid // G) * NPP
    b = tl.program_id(1).to(tl.int64)
    offs_h = (pid % G) * HP + tl.arange(0, HP)
    offs_d = tl.arange(0, DP)
    offs_f = tl.arange(0, FP)
    offs_e = tl.arange(0, BLOCK_E)
    hd = offs_h[:, None] * D + offs_d[None, :]
    hd_mask = (offs_h[:, None] < H) & (offs_d[None, :] < D)
    scale = 1.0 / tl.sqrt(tl.full([1], D, ACC))
    hfd = offs_f[None, :, None] * (H * D) + hd[:, None, :]
    w = tl.load(w_ptr + hfd, mask=(offs_f[None, :, None] < F + 1) & hd_mask[:, None, :], other=0.0).to(ACC)
    for i in range(NPP):
        # node first + i (none past N: its range is empty and nothing is stored)
        n, node, node_hd, node_h, start, end = _node(ptr_ptr, first + i, N, B, b, hd, hd_mask, offs_h, H)
        q = tl.load(q_ptr + node * (H * D) + hd, mask=node_hd, other=0.0).to(ACC)
        # project: u = W^T q per head [HP, FP] (u[h, f] = sum_d q[h, d] w[f, h, d])
        u = tl.reduce(w * q[:, None, :], 2, _sum)

        m_i = tl.full((HP,), float("-inf"), ACC)
        l_i = tl.full((HP,), 0, ACC)
        acc = tl.full((HP, DP), 0, ACC)
        agg = tl.full((HP, FP), 0, ACC)
        for e0 in range(start, end, BLOCK_E):
            # edge block: its mask, ids, source rows [BLOCK_E, HP, DP] and attributes [BLOCK_E, FP]
            emask, eid, nbr_node, rows, rmask, a = _edge_block(nbr_ptr, eid_ptr, attr_ptr, e0, end, b, B, hd, hd_mask,
                                                               offs_e, offs_f, H, D, F, SHARED, ACC)
            k = tl.load(k_ptr + rows, mask=rmask, other=0.0).to(ACC)
            # scores: scale * (k . q + a . u) per (edge, head) [BLOCK_E, HP]
            s = (tl.reduce(k * q[None, :, :], 2, _sum) + tl.reduce(a[:, None, :] * u[None, :, :], 2, _sum)) * scale
            s = tl.where(emask[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 0))
            corr = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[None, :])
            l_i = l_i * corr + tl.reduce(p, 0, _sum)
            v = tl.load(v_ptr + rows, mask=rmask, other=0.0).to(ACC)
            acc = acc * corr[:, None] + tl.reduce(p[:, :, None] * v, 0, _sum)
            agg = agg * corr[:, None] + tl.reduce(p[:, :, None] * a[:, None, :], 0, _sum)
            m_i = m_new

        has = l_i > 0
        l_safe = tl.where(has, l_i, 1.0)
        inv = tl.where(has, 1.0 / l_safe, 0.0)
        # expand: out = acc / l + W (agg / l) per head (out[h, :] += sum_f y[h, f] w[f, h, :])
        out = acc * inv[:, None] + tl.reduce((agg * inv[:, None])[:, :, None] * w, 1, _sum)
        tl.store(out_ptr + node * (H * D) + hd, out, mask=node_hd)
        tl.store(lse_ptr + node * H + offs_h, tl.where(has, m_i + tl.log(l_safe), 0.0), mask=node_h)


@triton.jit
def graph_attention_bwd_dst(
    q_ptr, k_ptr, v_ptr, attr_ptr, w_ptr, go_ptr, lse_ptr, ptr_ptr, nbr_ptr, eid_ptr,
    dq_ptr, u_ptr, gu_ptr, agg_ptr, de_ptr, delta_ptr,
    N, B,
    H: tl.constexpr, D: tl.constexpr, F: tl.constexpr, SHARED: tl.constexpr, HP: tl.constexpr, G: tl.constexpr,
    DP: tl.constexpr, FP: tl.constexpr, BLOCK_E: tl.constexpr, ACC: tl.constexpr, NPP: tl.constexpr,
):
    """Backward, destination side, for destination ``program_id(0) // G`` (head group ``program_id(0) % G``),
    batch entry ``program_id(1)``.

    One pass over the node's edges: ``alpha`` recomputed from ``lse``, ``dalpha = go . v_j + gu . a_j``
    (``gu = W^T go``); with ``delta = sum_j alpha_j dalpha_j`` (exact in ``ACC``: not ``go . out``
    from a rounded output) ``ds_j = alpha_j (dalpha_j - delta) scale``, so ``sum_j ds_j x_j = scale
    (sum_j alpha_j dalpha_j x_j - delta sum_j alpha_j x_j)``. Writes ``dq = sum_j ds_j k_j + W de``
    and what the source side and the weight gradient read: ``u = W^T q``, ``gu``, ``agg = sum_j
    alpha_j a_j``, ``de = sum_j ds_j a_j``, ``delta``."""
    # program: nodes NPP * (pid // G) ... (below N), head group pid % G, batch entry b; the [HP, DP] tile of
    # the group's heads (W is read a column at a time, [HP, DP] per column: a whole [HP, FP, DP] slice held
    # across the edge loop took 188 registers at 11 edge features on 4 warps, against 103)
    pid = tl.program_id(0).to(tl.int64)
    first = (pid // G) * NPP
    b = tl.program_id(1).to(tl.int64)
    offs_h = (pid % G) * HP + tl.arange(0, HP)
    offs_d = tl.arange(0, DP)
    offs_f = tl.arange(0, FP)
    offs_e = tl.arange(0, BLOCK_E)
    hd = offs_h[:, None] * D + offs_d[None, :]
    hd_mask = (offs_h[:, None] < H) & (offs_d[None, :] < D)
    scale = 1.0 / tl.sqrt(tl.full([1], D, ACC))
    hmask = offs_h < H
    for i in range(NPP):
        # node first + i (none past N: its range is empty and nothing is stored)
        n, node, node_hd, node_h, start, end = _node(ptr_ptr, first + i, N, B, b, hd, hd_mask, offs_h, H)
        q = tl.load(q_ptr + node * (H * D) + hd, mask=node_hd, other=0.0).to(ACC)
        go = tl.load(go_ptr + node * (H * D) + hd, mask=node_hd, other=0.0).to(ACC)
        lse = tl.load(lse_ptr + node * H + offs_h, mask=node_h, other=0.0).to(ACC)
        # project: u = W^T q and gu = W^T go per head [HP, FP], one column f of W at a time
        u = tl.full((HP, FP), 0, ACC)
        gu = tl.full((HP, FP), 0, ACC)
        for f in tl.static_range(F + 1):
            wf = tl.load(w_ptr + f * (H * D) + hd, mask=hd_mask, other=0.0).to(ACC)
            u += tl.where(offs_f[None, :] == f, tl.reduce(q * wf, 1, _sum)[:, None], 0.0)
            gu += tl.where(offs_f[None, :] == f, tl.reduce(go * wf, 1, _sum)[:, None], 0.0)

        delta = tl.full((HP,), 0, ACC)
        k_dal = tl.full((HP, DP), 0, ACC)  # sum_j alpha_j dalpha_j k_j
        k_sum = tl.full((HP, DP), 0, ACC)  # sum_j alpha_j k_j
        a_dal = tl.full((HP, FP), 0, ACC)  # sum_j alpha_j dalpha_j a_j
        agg = tl.full((HP, FP), 0, ACC)  # sum_j alpha_j a_j
        for e0 in range(start, end, BLOCK_E):
            # edge block: its mask, ids, source rows [BLOCK_E, HP, DP] and attributes [BLOCK_E, FP]
            emask, eid, nbr_node, rows, rmask, a = _edge_block(nbr_ptr, eid_ptr, attr_ptr, e0, end, b, B, hd, hd_mask,
                                                               offs_e, offs_f, H, D, F, SHARED, ACC)
            k = tl.load(k_ptr + rows, mask=rmask, other=0.0).to(ACC)
            v = tl.load(v_ptr + rows, mask=rmask, other=0.0).to(ACC)
            # scores: scale * (k . q + a . u) and dalpha = v . go + a . gu per (edge, head) [BLOCK_E, HP]
            s = (tl.reduce(k * q[None, :, :], 2, _sum) + tl.reduce(a[:, None, :] * u[None, :, :], 2, _sum)) * scale
            alpha = tl.where(emask[:, None] & hmask[None, :], tl.exp(s - lse[None, :]), 0.0)
            dalpha = tl.reduce(v * go[None, :, :], 2, _sum) + tl.reduce(a[:, None, :] * gu[None, :, :], 2, _sum)
            weighted = alpha * dalpha
            delta += tl.reduce(weighted, 0, _sum)
            k_dal += tl.reduce(weighted[:, :, None] * k, 0, _sum)
            k_sum += tl.reduce(alpha[:, :, None] * k, 0, _sum)
            a_dal += tl.reduce(weighted[:, :, None] * a[:, None, :], 0, _sum)
            agg += tl.reduce(alpha[:, :, None] * a[:, None, :], 0, _sum)

        de = (a_dal - delta[:, None] * agg) * scale
        # expand: dq = (k_dal - delta k_sum) scale + W de per head (dq[h, :] += sum_f de[h, f] w[f, h, :])
        dq = (k_dal - delta[:, None] * k_sum) * scale
        for f in tl.static_range(F + 1):
            wf = tl.load(w_ptr + f * (H * D) + hd, mask=hd_mask, other=0.0).to(ACC)
            dq += tl.reduce(tl.where(offs_f[None, :] == f, de, 0.0), 1, _sum)[:, None] * wf
        tl.store(dq_ptr + node * (H * D) + hd, dq, mask=node_hd)
        hf = offs_h[:, None] * (F + 1) + offs_f[None, :]  # the [HP, FP] column tile
        hf_mask = (offs_h[:, None] < H) & (offs_f[None, :] < F + 1) & (hf * 0 + n < N)
        cols = node * (H * (F + 1)) + hf
        tl.store(u_ptr + cols, u, mask=hf_mask)
        tl.store(gu_ptr + cols, gu, mask=hf_mask)
        tl.store(agg_ptr + cols, agg, mask=hf_mask)
        tl.store(de_ptr + cols, de, mask=hf_mask)
        tl.store(delta_ptr + node * H + offs_h, delta, mask=node_h)


@triton.jit
def graph_attention_bwd_src(
    q_ptr, k_ptr, v_ptr, attr_ptr, go_ptr, lse_ptr, delta_ptr, u_ptr, gu_ptr, ptr_ptr, nbr_ptr, eid_ptr,
    dk_ptr, dv_ptr, dattr_ptr,
    N, B, DA_GROUP_STRIDE,
    H: tl.constexpr, D: tl.constexpr, F: tl.constexpr, SHARED: tl.constexpr, HP: tl.constexpr, G: tl.constexpr,
    DP: tl.constexpr, FP: tl.constexpr, BLOCK_E: tl.constexpr, ACC: tl.constexpr, NEED_DA: tl.constexpr,
    NPP: tl.constexpr,
):
    """Backward, source side, for source ``program_id(0) // G`` (head group ``program_id(0) % G``), batch
    entry ``program_id(1)``, over its out-edges (source CSR: ``nbr`` are destinations): ``dk = sum_j
    ds_j q_dst``, ``dv = sum_j alpha_j go_dst``, with ``alpha`` / ``ds`` recomputed from the
    destination side's ``lse``, ``delta``, ``u``, ``gu``; when ``NEED_DA`` each edge's attribute
    gradient over the group's heads ``sum_h alpha gu + ds u`` (columns ``< F``) into ``dattr``
    ``(G, E, B, F)`` at ``(group, eid, b)`` (every (edge, batch entry, head group) has one source
    program: no two programs write one element)."""
    # program: nodes NPP * (pid // G) ... (below N), head group pid % G, batch entry b; the [HP, DP] tile of
    # the group's heads
    pid = tl.program_id(0).to(tl.int64)
    first = (pid // G) * NPP
    b = tl.program_id(1).to(tl.int64)
    offs_h = (pid % G) * HP + tl.arange(0, HP)
    offs_d = tl.arange(0, DP)
    offs_f = tl.arange(0, FP)
    offs_e = tl.arange(0, BLOCK_E)
    hd = offs_h[:, None] * D + offs_d[None, :]
    hd_mask = (offs_h[:, None] < H) & (offs_d[None, :] < D)
    scale = 1.0 / tl.sqrt(tl.full([1], D, ACC))
    hmask = offs_h < H
    hf = offs_h[:, None] * (F + 1) + offs_f[None, :]  # the [HP, FP] column tile
    hf_mask = (offs_h[:, None] < H) & (offs_f[None, :] < F + 1)
    for i in range(NPP):
        # node first + i (none past N: its range is empty and nothing is stored)
        n, node, node_hd, _node_h, start, end = _node(ptr_ptr, first + i, N, B, b, hd, hd_mask, offs_h, H)
        k = tl.load(k_ptr + node * (H * D) + hd, mask=node_hd, other=0.0).to(ACC)
        v = tl.load(v_ptr + node * (H * D) + hd, mask=node_hd, other=0.0).to(ACC)

        dk = tl.full((HP, DP), 0, ACC)
        dv = tl.full((HP, DP), 0, ACC)
        for e0 in range(start, end, BLOCK_E):
            # edge block: its mask, ids, destination rows [BLOCK_E, HP, DP] and attributes [BLOCK_E, FP]
            emask, eid, dnode, rows, rmask, a = _edge_block(nbr_ptr, eid_ptr, attr_ptr, e0, end, b, B, hd, hd_mask,
                                                            offs_e, offs_f, H, D, F, SHARED, ACC)
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
            # scores: scale * (q . k + u . a) and dalpha = go . v + gu . a per (edge, head) [BLOCK_E, HP]
            s = (tl.reduce(q * k[None, :, :], 2, _sum) + tl.reduce(u * a[:, None, :], 2, _sum)) * scale
            alpha = tl.where(smask, tl.exp(s - lse), 0.0)
            dalpha = tl.reduce(go * v[None, :, :], 2, _sum) + tl.reduce(gu * a[:, None, :], 2, _sum)
            ds = alpha * (dalpha - delta) * scale
            dk += tl.reduce(ds[:, :, None] * q, 0, _sum)
            dv += tl.reduce(alpha[:, :, None] * go, 0, _sum)
            if NEED_DA:
                da = tl.reduce(alpha[:, :, None] * gu + ds[:, :, None] * u, 1, _sum)  # [BLOCK_E, FP]
                dptrs = dattr_ptr + (pid % G) * DA_GROUP_STRIDE + (eid * B + b)[:, None] * F + offs_f[None, :]
                tl.store(dptrs, da, mask=emask[:, None] & (offs_f[None, :] < F))

        tl.store(dk_ptr + node * (H * D) + hd, dk, mask=node_hd)
        tl.store(dv_ptr + node * (H * D) + hd, dv, mask=node_hd)


@triton.jit
def graph_attention_bwd_weight(
    agg_ptr, go_ptr, de_ptr, q_ptr, out_ptr,
    R, ROWS_PER,
    H: tl.constexpr, D: tl.constexpr, F1: tl.constexpr, FP: tl.constexpr, DP: tl.constexpr,
    BLOCK_R: tl.constexpr, ACC: tl.constexpr,
):
    """The edge projection's gradient, head ``program_id(0)``, rows ``[s * ROWS_PER, (s + 1) * ROWS_PER)`` of
    split ``s = program_id(1)``: ``out[s, f, h, :] = sum_r agg[r, h, f] go[r, h, :] + de[r, h, f] q[r, h, :]``
    (``r`` a (node, batch entry) row), accumulated in ``ACC`` whatever ``go`` and ``q``'s dtype; the splits
    are summed outside, in a fixed order."""
    h = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    offs_f = tl.arange(0, FP)
    offs_d = tl.arange(0, DP)
    fmask = offs_f < F1
    dmask = offs_d < D
    first = s * ROWS_PER
    last = tl.minimum(first + ROWS_PER, R)
    acc = tl.full((FP, DP), 0, ACC)
    for r0 in range(first, last, BLOCK_R):
        r = r0 + offs_r
        rmask = r < last
        # per (row, column) statistics [BLOCK_R, FP] and per (row, d) node rows [BLOCK_R, DP] of head h
        small = (r[:, None] * H + h) * F1 + offs_f[None, :]
        smask = rmask[:, None] & fmask[None, :]
        big = (r[:, None] * H + h) * D + offs_d[None, :]
        bmask = rmask[:, None] & dmask[None, :]
        a = tl.load(agg_ptr + small, mask=smask, other=0.0).to(ACC)
        g = tl.load(go_ptr + big, mask=bmask, other=0.0).to(ACC)
        e = tl.load(de_ptr + small, mask=smask, other=0.0).to(ACC)
        x = tl.load(q_ptr + big, mask=bmask, other=0.0).to(ACC)
        acc += tl.reduce(a[:, :, None] * g[:, None, :] + e[:, :, None] * x[:, None, :], 0, _sum)
    out = out_ptr + ((s * F1 + offs_f[:, None]) * H + h) * D + offs_d[None, :]
    tl.store(out, acc, mask=fmask[:, None] & dmask[None, :])
