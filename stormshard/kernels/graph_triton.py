"""Graph attention as Triton kernels: one program per (destination node, head group, batch entry).

The same computation as :func:`stormshard.kernels.graph_csr.fused_graph_attention`, with the edge
embedding kept factored: per head ``W = [W_e | b_e]`` ``(H, d, F + 1)`` and attributes with a ones
column ``a = [attr, 1]``, the logit of edge ``j -> i`` is ``scale * (q_i . k_j + u_i . a_ji)`` with
``u = W^T q`` and the output ``sum_j alpha_ji v_j + W agg_i`` with ``agg_i = sum_j alpha_ji a_ji``:
no ``(E, heads, d)`` tensor is ever formed (anemoi's Triton kernel reads one: 3.3 GB at the AIFS
decoder in bf16) and the ones column is never stored (the kernels set it on load).

Layouts (contiguous): ``q`` / output ``(Nd, B, H, d)``, ``k`` / ``v`` ``(Ns, B, H, d)`` (``B`` the
batch dims flattened), attributes ``(E, F)`` shared by the batch or ``(E, B, F)`` in the caller's
edge order, ``W`` as ``(F + 1, H * d)`` (tiny). Everything but the edge structure is per head, so a
node's heads are split into ``G`` groups of ``HP`` (:func:`tile_config`: ``HP * d`` about 256, a
512-byte bf16 run of each neighbour row), one program each, and the launch grid's first axis is
``node * G + group`` (a node's groups run side by side and share its edge ids and attributes in the
cache). Kernels (:mod:`~stormshard.kernels.graph_triton_kernels`):

- every kernel's grid is ``(ceil(N / NPP) G, B)``: a program owns ``NPP`` nodes (1 unless a tile sweep asks
  for more, :class:`Tiles`), one after the other; below, one node;
- forward, grid ``(Nd G, B)``: a program loads its heads of ``q[i, b]`` ``[HP, DP]`` (``DP`` the
  power of two at or above ``d``, padding masked), computes ``u = W^T q`` in registers, walks the
  node's CSR range ``BLOCK_E`` edges at a time as ``[BLOCK_E, HP, DP]`` tiles with an online softmax
  (running max and sum per head), and writes the output (``+ W agg`` in registers) and the
  log-sum-exp per head. Per (node, batch entry) rather than per node: each neighbour row segment
  ``k[j, b, heads]`` is one contiguous run, the register tile does not grow with the batch and the
  grid has ``B`` times more programs for small graphs; batch entries and head groups sharing a node's
  edges re-read only its int32 ids and ``F`` attributes per edge.
- backward, destination side, grid ``(Nd G, B)``, one pass over the node's edges: recomputes ``alpha``
  from the log-sum-exp, ``dalpha = go . v_j + gu . a_j`` (``gu = W^T go``) and ``delta = sum_j
  alpha_j dalpha_j`` alongside ``sum_j alpha_j dalpha_j x_j`` and ``sum_j alpha_j x_j`` (``x`` = ``k``,
  ``a``), so ``sum_j ds_j x_j`` with ``ds = alpha (dalpha - delta) scale`` needs no second pass;
  writes ``dq = sum_j ds_j k_j + W de`` (``de = sum_j ds_j a_j``) and per (node, head) ``u``, ``gu``,
  ``agg``, ``de``, ``delta`` (``F + 1`` columns: small) for the source side and the weight gradient.
  ``delta`` is not flash attention's ``go . out``: with a bf16 output that rounding (2^-9 of
  ``|go| |out|``, in every ``ds`` of the node) made the query and key gradients 5-10x less accurate
  than the csr kernel's on the same inputs (measured under the interpreter, whose bf16 conversion
  truncates; about half that when rounding to nearest); summed in fp32 it costs two accumulators, and
  the output is not saved;
- backward, source side, grid ``(Ns G, B)``, over the transposed CSR (a source's out-edges in a
  fixed order): ``dk = sum ds q_dst``, ``dv = sum alpha go_dst`` and each edge's attribute gradient
  over the group's heads ``sum_h alpha gu + ds u`` (every (edge, batch entry, head group) has one
  source program; the groups' parts, and for shared attributes the batch, are summed outside in a
  fixed order);
- the edge projection's gradient ``dW = sum_nodes go (x) agg + q (x) de``: a Triton reduction per
  (head, split of the nodes) whose partial sums are added outside in a fixed order.

No atomics anywhere: every output element is written by one program and sums run in a fixed order,
so the backward is deterministic (bit-identical gradients run to run). Logits, softmax statistics
and sums are fp32 (fp64 for fp64 inputs) whatever the input dtypes; bf16 / fp16 / fp32 inputs and
fp32 attributes or weights (autocast) are converted on load, never copied; the kernels run with
autocast off.

Read per edge (``s`` the input element size, ``H d`` channels): forward ``2 H d s`` (``k``, ``v``
rows) ``+ F s_attr + 8`` (int32 source and edge ids); destination side the same; source side
``2 H d s`` (``q``, ``go`` rows) ``+ 2 H (F + 1) 4`` (``u``, ``gu``) ``+ 2 H 4`` (log-sum-exp,
``delta``) ``+ F s_attr + 8``; written per edge only the attribute gradient (``F`` values per head
group, when the attributes need one). Saved for backward: ``q``, ``k``, ``v``, the attributes, the weights and the
log-sum-exp ``(Nd, B, H)``; of edge size only the cached int32 structure (16 bytes per edge) and the
caller's attributes (``4 F`` bytes per edge at fp32), against ``2 H d`` bytes per edge for anemoi's
bf16 ``[E, heads, d]`` edge tensor (2048 at 16 x 64), which its backward also writes as a gradient.

The sorted structure (destination CSR: row pointers, source ids, edge ids; source CSR: pointers,
destination ids, edge ids; int32 where sizes allow; stable sorts: deterministic) is built once per
``edge_index`` tensor and cached (keyed by identity, storage and version, dropped with the tensor),
so a call sorts nothing and does not sync with the host once cached. Forward and backward are torch
custom ops (``stormshard::triton_graph_attention`` and ``..._backward``), opaque to torch.compile
(no graph break); eager calls take an autograd Function running the same functions.

Triton is imported lazily: this module imports without it (:func:`triton_graph_unavailable` says
why the kernel cannot run). Nothing is communicated here.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from stormshard.kernels.attention_ops import use_registered_op
from stormshard.kernels.kept_outputs import kept_or_computed
from stormshard.kernels.reference import graph_operands

__all__ = ["triton_graph_attention", "triton_graph_unavailable", "triton_graph_structure", "TritonGraphStructure",
           "structure_builds", "tile_config", "weight_tile_config", "Tiles", "tile_override"]


def triton_graph_unavailable(device_type: str) -> str | None:
    """None when the Triton kernel can run on ``device_type`` (``"cuda"``, ``"cpu"``, ...), else why not
    and the fix (one sentence, no final period)."""
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed: `pip install triton` (or the CUDA build of torch, which ships it)"
    try:
        import triton  # noqa: F401
    except Exception as err:  # noqa: BLE001 - a broken install is a reason, not a crash
        return f"Triton does not import ({type(err).__name__}: {err}): reinstall it with `pip install triton`"
    if device_type != "cuda" and not _interpreting():
        return (f"Triton kernels run on CUDA devices, not {device_type!r}: set TRITON_INTERPRET=1 before "
                "triton is imported to run them in Triton's interpreter (slow: tests only)")
    if device_type == "cuda" and not _interpreting() and torch.cuda.is_available() and \
            torch.cuda.get_device_capability() < (7, 0):
        return (f"Triton needs a GPU of compute capability 7.0 or newer, this one is "
                f"{'.'.join(map(str, torch.cuda.get_device_capability()))}")
    return None


def _interpreting() -> bool:
    """Whether the kernels run in Triton's interpreter: the environment when they were decorated (the
    kernels module is imported), else the environment now."""
    kernels = sys.modules.get("stormshard.kernels.graph_triton_kernels")
    if kernels is not None:
        return type(kernels.graph_attention_fwd).__name__ == "InterpretedFunction"
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _kernels():  # noqa: ANN202 - the kernels module (imports triton)
    from stormshard.kernels import graph_triton_kernels

    return graph_triton_kernels


# --------------------------------------------------------------------------------------------
# sorted structure, cached per edge_index tensor
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class TritonGraphStructure:
    """The edges of a graph sorted by destination and by source (stable sorts).

    ``dst_ptr`` ``(Nd + 1,)``: destination ``i``'s edges are positions ``dst_ptr[i]:dst_ptr[i + 1]`` of
    ``dst_nbr`` (their sources) and ``dst_eid`` (their ids in the caller's edge order); ``src_ptr``
    ``(Ns + 1,)``, ``src_nbr`` (destinations) and ``src_eid`` likewise by source. int32 where the
    sizes allow, else int64."""

    num_src: int
    num_dst: int
    num_edges: int
    dst_ptr: Tensor
    dst_nbr: Tensor
    dst_eid: Tensor
    src_ptr: Tensor
    src_nbr: Tensor
    src_eid: Tensor


_BUILDS = 0
_STRUCTURES: dict[tuple, tuple[weakref.ref, TritonGraphStructure]] = {}
_MAX_STRUCTURES = 1024  # entries also go with their edge index tensor (weakref)


def structure_builds() -> int:
    """How many :class:`TritonGraphStructure` were built in this process (cache misses)."""
    return _BUILDS


def _sorted_by(rows: Tensor, cols: Tensor, num_rows: int, index_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """``(ptr, cols in row order, edge ids in row order)`` of the edges ``rows -> cols`` (stable)."""
    order = torch.argsort(rows, stable=True)
    ptr = torch.zeros(num_rows + 1, dtype=torch.long, device=rows.device)
    torch.cumsum(torch.bincount(rows, minlength=num_rows), 0, out=ptr[1:])
    return ptr.to(index_dtype), cols[order].to(index_dtype), order.to(index_dtype)


def _build(edge_index: Tensor, num_src: int, num_dst: int) -> TritonGraphStructure:
    global _BUILDS
    src, dst = edge_index[0].long(), edge_index[1].long()
    if src.numel() and bool(((src < 0) | (src >= num_src) | (dst < 0) | (dst >= num_dst)).any()):  # first build only
        raise ValueError(
            f"edge_index holds sources in [{int(src.min())}, {int(src.max())}] and destinations in "
            f"[{int(dst.min())}, {int(dst.max())}], outside [0, {num_src}) x [0, {num_dst}] (num_src, num_dst): "
            "fix the graph or pass the node counts it was built for"
        )
    small = max(src.numel(), num_src, num_dst) < 2**31 - 1
    index_dtype = torch.int32 if small else torch.int64
    _BUILDS += 1
    return TritonGraphStructure(num_src, num_dst, src.numel(), *_sorted_by(dst, src, num_dst, index_dtype),
                                *_sorted_by(src, dst, num_src, index_dtype))


def triton_graph_structure(edge_index: Tensor, num_src: int, num_dst: int) -> TritonGraphStructure:
    """The (cached) :class:`TritonGraphStructure` of ``edge_index`` ``(2, E)`` (row 0 sources ``<
    num_src``, row 1 destinations ``< num_dst``). Cached per tensor: identity, storage, version (an
    in-place change rebuilds), shape and node counts; an entry goes when its tensor goes."""
    key = (id(edge_index), edge_index.data_ptr(), edge_index._version, tuple(edge_index.shape),
           tuple(edge_index.stride()), edge_index.dtype, edge_index.device, num_src, num_dst)
    entry = _STRUCTURES.get(key)
    if entry is not None and entry[0]() is edge_index:
        return entry[1]
    structure = _build(edge_index, num_src, num_dst)
    while len(_STRUCTURES) >= _MAX_STRUCTURES:  # oldest first
        _STRUCTURES.pop(next(iter(_STRUCTURES)))
    _STRUCTURES[key] = (weakref.ref(edge_index, lambda _ref, key=key: _STRUCTURES.pop(key, None)), structure)
    return structure


# --------------------------------------------------------------------------------------------
# launches
# --------------------------------------------------------------------------------------------


def tile_config(heads: int, head_dim: int, features: int, mean_degree: float | None = None) -> dict[str, int]:
    """The launch configuration: ``HP`` heads per program (a power of two; ``G`` = ``ceil(heads / HP)``
    programs share a node, one head group each), ``DP`` / ``FP`` (``head_dim`` / ``features + 1``
    padded to powers of two), ``BLOCK_E`` (edges per ``[BLOCK_E, HP, DP]`` tile), ``num_warps`` and ``NPP``
    (nodes per program, one after the other: 1 here; :func:`tile_override` sweeps more).

    ``HP * DP`` at most 256 (a 512-byte bf16 run of each neighbour row per program: four 128-byte
    lines), tiles of about 2K elements, 8 per thread. Chosen from what ptxas makes of the kernels for
    sm_90 (``benchmarks/triton_registers.py``), not yet from timings: at 16 heads of 64 the three
    kernels take 64-123 registers and 16-32 resident warps per SM, where one program per node (a
    ``[8, 16, 64]`` tile on 8 warps, the first choice) took 177-254 registers and held 8 warps per SM.

    ``mean_degree`` (edges per program's node: ``E / N`` of the side the kernel walks, known without a
    look at the edges) caps ``BLOCK_E`` at the power of two at or above it, and the warps with it: a node
    with 3 edges (the decoder's data nodes; the encoder's, walked by source in the backward) walks one
    4-edge tile on 4 warps instead of an 8-edge tile five-eighths masked on 8 (ptxas: 64-127 registers, no
    spill, 16-32 warps per SM)."""
    hp_all, dp, fp = (1 << max(n - 1, 0).bit_length() for n in (heads, head_dim, features + 1))
    hp = max(1, min(hp_all, 256 // dp))
    block_e = min(64, max(2, 2048 // (hp * dp)))
    if mean_degree is not None and mean_degree > 0:
        block_e = min(block_e, max(2, 1 << max(math.ceil(mean_degree) - 1, 0).bit_length()))
    warps = max(2, min(8, block_e * hp * dp // 256))
    npp = 1
    if _TILES is not None:  # a benchmark's sweep (tile_override)
        hp, block_e, warps = min(_TILES.heads_per_program, hp_all), _TILES.block_e, _TILES.num_warps
        npp = _TILES.nodes_per_program
    return dict(HP=hp, G=-(-heads // hp), DP=dp, FP=fp, BLOCK_E=block_e, num_warps=warps, NPP=npp)


@dataclass(frozen=True)
class Tiles:
    """A launch configuration for :func:`tile_override`: heads per program, edges per tile, warps and nodes per
    program (powers of two)."""

    heads_per_program: int
    block_e: int
    num_warps: int
    nodes_per_program: int = 1  # a program's nodes, one after the other (its slice of W loaded once for all)

    def __post_init__(self) -> None:
        for name, value in (("heads_per_program", self.heads_per_program), ("block_e", self.block_e),
                            ("num_warps", self.num_warps), ("nodes_per_program", self.nodes_per_program)):
            if not (isinstance(value, int) and value >= 1 and value & (value - 1) == 0):
                raise ValueError(f"Tiles.{name} = {value!r}: must be a power of two (1, 2, 4, ...)")


_TILES: Tiles | None = None


@contextmanager
def tile_override(tiles: Tiles) -> Iterator[None]:
    """Launch the kernels with ``tiles`` instead of :func:`tile_config`'s choice inside the block (the
    timed tile sweep of ``benchmarks/bench_gpu_vs_anemoi.py --triton-tiles``). Every configuration
    computes the same function; the sums run in another order, so results differ in rounding."""
    global _TILES
    previous, _TILES = _TILES, tiles
    try:
        yield
    finally:
        _TILES = previous


def weight_tile_config(columns: int, head_dim: int) -> dict[str, int]:
    """The weight-gradient kernel's ``FP`` / ``DP`` (``columns`` = ``F + 1`` and ``head_dim`` padded to
    powers of two), ``BLOCK_R`` rows per ``[BLOCK_R, FP, DP]`` tile (about 4K elements, 16 per thread)
    and ``num_warps`` (8): at head size 64 with 3 and 11 edge features ptxas (sm_90) gives 79 and 53
    registers, no spills, where 8K-element tiles on 4 warps took 236 and 168."""
    fp, dp = (1 << max(n - 1, 0).bit_length() for n in (columns, head_dim))
    return dict(FP=fp, DP=dp, BLOCK_R=min(128, max(2, 4096 // (fp * dp))), num_warps=8)


def _programs(nodes: int, cfg: dict[str, int]) -> int:
    """The launch grid's first axis: ``G`` head groups for every block of ``NPP`` nodes."""
    return -(-nodes // cfg["NPP"]) * cfg["G"]


def _acc_dtype(*tensors: Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _triton_dtype(dtype: torch.dtype):  # noqa: ANN202
    import triton.language as tl

    return tl.float64 if dtype == torch.float64 else tl.float32


def _weights(w_e: Tensor, b_e: Tensor) -> Tensor:
    """``(F + 1, H * d)``: column ``f`` of every head's ``[W_e | b_e]`` as one contiguous row."""
    return torch.cat([w_e.t(), b_e.unsqueeze(0).to(w_e.dtype)], 0).contiguous()


def _forward(q: Tensor, k: Tensor, v: Tensor, attr3: Tensor, w_e: Tensor, b_e: Tensor,
             edge_index: Tensor) -> tuple[Tensor, Tensor]:
    """``(out (Nd, B, H, d) in q's dtype, lse (Nd, B, H) in the accumulation dtype)``; ``q`` / ``k`` /
    ``v`` ``(N, B, H, d)``, ``attr3`` ``(E, 1 | B, F)``, ``w_e`` ``(H d, F)``, ``b_e`` ``(H d,)``."""
    nd, batch, heads, d = q.shape
    st = triton_graph_structure(edge_index, k.shape[0], nd)
    acc = _acc_dtype(q, k, v)
    out = torch.empty_like(q)
    lse = torch.empty((nd, batch, heads), dtype=acc, device=q.device)
    if nd * batch:
        cfg = tile_config(heads, d, attr3.shape[-1], st.num_edges / nd)
        _kernels().graph_attention_fwd[(_programs(nd, cfg), batch)](
            q, k, v, attr3, _weights(w_e, b_e), out, lse, st.dst_ptr, st.dst_nbr, st.dst_eid, nd, batch,
            H=heads, D=d, F=attr3.shape[-1], SHARED=attr3.shape[1] == 1, ACC=_triton_dtype(acc), **cfg)
    return out, lse


def _backward(go: Tensor, q: Tensor, k: Tensor, v: Tensor, attr3: Tensor, w_e: Tensor, b_e: Tensor, lse: Tensor,
              edge_index: Tensor, needs: list[bool]) -> list[Tensor | None]:
    """Gradients of ``(q, k, v, attr3, w_e, b_e)`` (None where ``needs`` is False) from the output
    gradient ``go`` ``(Nd, B, H, d)`` and what the forward saved."""
    nd, batch, heads, d = q.shape
    ns, (num_edges, attr_batch, fdim) = k.shape[0], attr3.shape
    st = triton_graph_structure(edge_index, ns, nd)
    acc = _acc_dtype(q, k, v)
    go = go.contiguous()
    w = _weights(w_e, b_e)
    cfg = tile_config(heads, d, fdim, num_edges / max(nd, 1))  # the destination side's; the source side's below
    common = dict(H=heads, D=d, F=fdim, SHARED=attr_batch == 1, ACC=_triton_dtype(acc), **cfg)
    src_common = {**common, **tile_config(heads, d, fdim, num_edges / max(ns, 1))}
    groups = cfg["G"]
    need_q, need_k, need_v, need_a, need_w, need_b = needs
    dq = torch.empty_like(q)
    u, gu, agg, de = (torch.empty((nd, batch, heads, fdim + 1), dtype=acc, device=q.device) for _ in range(4))
    delta = torch.empty((nd, batch, heads), dtype=acc, device=q.device)
    kernels = _kernels()
    if nd * batch:
        kernels.graph_attention_bwd_dst[(_programs(nd, common), batch)](
            q, k, v, attr3, w, go, lse, st.dst_ptr, st.dst_nbr, st.dst_eid, dq, u, gu, agg, de, delta, nd, batch,
            **common)
    dk = dv = da = None
    if need_k or need_v or need_a:
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        # per (head group, edge, batch entry): the groups' parts are summed below in a fixed order, and
        # shared attributes sum it over the batch
        direct = groups == 1 and attr_batch == batch
        da = torch.empty((groups, num_edges if need_a else 0, batch, fdim), dtype=attr3.dtype if direct else acc,
                         device=q.device)
        if ns * batch:
            kernels.graph_attention_bwd_src[(_programs(ns, src_common), batch)](
                q, k, v, attr3, go, lse, delta, u, gu, st.src_ptr, st.src_nbr, st.src_eid, dk, dv, da, ns, batch,
                da[0].numel(), NEED_DA=need_a, **src_common)
        da = da[0] if groups == 1 else da.sum(0)
        if need_a and attr_batch != batch:
            da = da.sum(1, keepdim=True)
        da = da.to(attr3.dtype)
    dw = db = None
    if need_w or need_b:
        per_head = _weight_gradient(kernels, agg, go, de, q, acc)  # (F + 1, H d): [dW_e^T | db_e] per head
        dw, db = per_head[:fdim].t().contiguous().to(w_e.dtype), per_head[fdim].to(b_e.dtype)
    return [dq if need_q else None, dk if need_k else None, dv if need_v else None, da if need_a else None,
            dw if need_w else None, db if need_b else None]  # as the fake: the ones asked for


def _weight_gradient(kernels, agg: Tensor, go: Tensor, de: Tensor, q: Tensor, acc: torch.dtype) -> Tensor:  # noqa: ANN001
    """``(F + 1, H * d)`` in ``acc``: ``sum_rows agg^T go + de^T q`` per head, read from ``go`` / ``q`` in their
    own dtype (no fp32 copy of a node tensor); rows split over programs (about 1,024 each, at most 256
    splits: 4,096 programs at 16 heads) whose partial sums are added here in a fixed order: deterministic."""
    nd, batch, heads, d = q.shape
    f1, rows = agg.shape[-1], nd * batch
    splits = max(1, min(256, -(-rows // 1024)))
    rows_per = -(-rows // splits)
    partial = torch.zeros((splits, f1, heads, d), dtype=acc, device=q.device)
    if rows:
        kernels.graph_attention_bwd_weight[(heads, splits)](
            agg, go, de, q, partial, rows, rows_per, H=heads, D=d, F1=f1, ACC=_triton_dtype(acc),
            **weight_tile_config(f1, d))
    return partial.sum(0).reshape(f1, heads * d)


# --------------------------------------------------------------------------------------------
# custom ops (torch.compile) and the eager autograd Function
# --------------------------------------------------------------------------------------------


def _run_forward(q: Tensor, k: Tensor, v: Tensor, attr3: Tensor, w_e: Tensor, b_e: Tensor,
                 edge_index: Tensor) -> tuple[Tensor, Tensor]:
    with torch.autocast(q.device.type, enabled=False):
        return _forward(q, k, v, attr3, w_e, b_e, edge_index)


def _run_backward(go: Tensor, saved: tuple[Tensor, ...], needs: list[bool]) -> list[Tensor | None]:
    with torch.autocast(go.device.type, enabled=False):
        return _backward(go, *saved, list(needs))


@torch.library.custom_op("stormshard::triton_graph_attention", mutates_args=())
def _attention_op(q: Tensor, k: Tensor, v: Tensor, attr3: Tensor, w_e: Tensor, b_e: Tensor,
                  edge_index: Tensor) -> tuple[Tensor, Tensor]:
    return _run_forward(q, k, v, attr3, w_e, b_e, edge_index)


@_attention_op.register_fake
def _attention_fake(q: Tensor, k: Tensor, v: Tensor, attr3: Tensor, w_e: Tensor, b_e: Tensor,
                    edge_index: Tensor) -> tuple[Tensor, Tensor]:
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=_acc_dtype(q, k, v))


@torch.library.custom_op("stormshard::triton_graph_attention_backward", mutates_args=())
def _attention_backward_op(go: Tensor, q: Tensor, k: Tensor, v: Tensor, attr3: Tensor, w_e: Tensor, b_e: Tensor,
                           lse: Tensor, edge_index: Tensor,
                           needs: list[bool]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    grads = _run_backward(go, (q, k, v, attr3, w_e, b_e, lse, edge_index), needs)
    # gradients not asked for are empty tensors (an op returns tensors only)
    return tuple(q.new_empty(0) if g is None else g.contiguous() for g in grads)


@_attention_backward_op.register_fake
def _attention_backward_fake(go: Tensor, q: Tensor, k: Tensor, v: Tensor, attr3: Tensor, w_e: Tensor, b_e: Tensor,
                             lse: Tensor, edge_index: Tensor,
                             needs: list[bool]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    like = (q, k, v, attr3, w_e, b_e)
    return tuple(t.new_empty(t.shape) if need else q.new_empty(0) for t, need in zip(like, needs, strict=True))


def _setup(ctx, inputs: tuple, output: tuple) -> None:  # noqa: ANN001
    q, k, v, attr3, w_e, b_e, edge_index = inputs
    _out, lse = output
    ctx.save_for_backward(q, k, v, attr3, w_e, b_e, lse, edge_index)


def _op_backward(ctx, grad_out: Tensor, _grad_lse: Tensor) -> tuple:  # noqa: ANN001
    needs = [bool(n) for n in ctx.needs_input_grad[:6]]
    grads = torch.ops.stormshard.triton_graph_attention_backward(grad_out, *ctx.saved_tensors, needs)
    return (*(g if need else None for g, need in zip(grads, needs, strict=True)), None)


_attention_op.register_autograd(_op_backward, setup_context=_setup)


class _EagerAttention(torch.autograd.Function):
    """The ops' forward and backward for eager calls, without torch.library's dispatch (same functions,
    same saved tensors, same numbers)."""

    @staticmethod
    def forward(ctx, q, k, v, attr3, w_e, b_e, edge_index):  # noqa: ANN001, ANN205
        out = kept_or_computed(lambda: _run_forward(q, k, v, attr3, w_e, b_e, edge_index), q, k, v, attr3)
        _setup(ctx, (q, k, v, attr3, w_e, b_e, edge_index), out)
        ctx.mark_non_differentiable(out[1])
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out, _grad_lse):  # noqa: ANN001, ANN205
        needs = [bool(n) for n in ctx.needs_input_grad[:6]]
        return (*_run_backward(grad_out, ctx.saved_tensors, needs), None)


# --------------------------------------------------------------------------------------------
# entry point
# --------------------------------------------------------------------------------------------


def triton_graph_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    edge_attr: Tensor,
    edge_weight: Tensor,
    edge_bias: Tensor | None,
    edge_index: Tensor,
    num_dst: int | None = None,
) -> Tensor:
    """Graph attention with the edge embedding ``edge_attr @ edge_weight.T + edge_bias`` added to keys
    and values, by the Triton kernels (module docstring); the contract of
    :func:`~stormshard.kernels.graph_csr.fused_graph_attention`:

    - ``query`` ``(num_dst, *batch, heads, d)``, ``key`` / ``value`` ``(num_src, *batch, heads, d)``
      (bf16, fp16, fp32 or fp64; 1-16 heads and head sizes 8-64 are the tested range);
    - ``edge_attr`` ``(E, F)`` (shared by the batch) or ``(E, *batch, F)``;
    - ``edge_weight`` ``(heads * d, F)`` and ``edge_bias`` ``(heads * d,)`` or None (an
      ``nn.Linear(F, heads * d)``'s parameters, output channels ordered ``(head, d)``), any float dtype;
    - ``edge_index`` ``(2, E)``, row 0 source (``< num_src``), row 1 destination (``< num_dst``), any
      order, duplicates allowed.

    Returns ``(num_dst, *batch, heads, d)`` in query's dtype; a destination without incoming edges gets
    zeros. Differentiable in every tensor argument (not twice); deterministic.
    """
    ops = graph_operands(query, key, value, edge_attr, edge_weight, edge_index, num_dst)
    num_dst, heads, d, num_edges = ops.num_dst, ops.heads, ops.head_dim, ops.num_edges
    batch_shape = ops.batch_shape
    attr3 = ops.attr3.contiguous()
    if edge_bias is None:
        edge_bias = edge_weight.new_zeros(heads * d)
    batch = math.prod(batch_shape)
    if batch > 65535:  # the launch grid's second axis
        raise ValueError(f"the batch dims {batch_shape} hold {batch} entries, more than the Triton kernel's 65535: "
                         "split the batch or use graph_kernel 'csr'")
    q = query.reshape(num_dst, batch, heads, d).contiguous()
    k = key.reshape(key.shape[0], batch, heads, d).contiguous()
    v = value.reshape(value.shape[0], batch, heads, d).contiguous()
    if num_edges == 0:  # keeps every input in the graph (zero gradients)
        out = q.new_zeros(q.shape) + 0 * (q.sum() + k.sum() + v.sum() + attr3.sum() + edge_weight.sum()
                                          + edge_bias.sum()).to(q.dtype)
        return out.reshape(query.shape)
    op = _attention_op if use_registered_op() else _EagerAttention.apply
    out = op(q, k, v, attr3, edge_weight.contiguous(), edge_bias.contiguous(), edge_index)[0]
    return out.reshape(query.shape)
