"""Sliding-window attention kernel: exact, banded, linear in the sequence length.

Layout: ``q`` is ``(batch, heads, Lq, dim)``, ``k`` and ``v`` are ``(batch, heads, Lk, dim)``.
Query ``i`` sits at global position ``q_offset + i``, key ``j`` at ``k_offset + j``; a query
attends a key exactly when ``|pos_q - pos_k| <= window_size`` (flash-attn's symmetric window,
the one AIFS uses). A query with no key in reach (possible only with offsets) returns zeros.

The CPU (and fallback) path walks the queries block by block; each block of ``B`` queries only
sees the ``B + 2 * window_size`` keys that can reach it, so time and memory grow linearly with
the sequence instead of quadratically as with a dense masked SDPA. It is a custom autograd
Function in the style of flash attention: the forward keeps only the output and the per-query
log-sum-exp, and the backward recomputes each block's scores, so no ``(Lq, Lk)`` matrix is
ever held. On CUDA, with ``flash_attn`` importable and half-precision inputs, flash-attn's
windowed kernel runs instead (same definition, via an asymmetric window that absorbs the offsets).

Nothing is communicated here.
"""

from __future__ import annotations

import math

import einops
import torch
from torch import Tensor

__all__ = ["sliding_window_attention", "dense_window_attention", "default_block_size"]


def default_block_size(window_size: int) -> int:
    """Query block length: about half the window (so a block sees ~1.25x the keys it needs), 64..512."""
    return int(min(512, max(64, window_size // 2)))


def _key_range(block_start: int, block_stop: int, shift: int, window_size: int, num_keys: int) -> tuple[int, int]:
    """Local key indices ``[lo, hi)`` that queries ``[block_start, block_stop)`` can reach.

    ``shift = q_offset - k_offset`` maps query ``i`` to key-local position ``i + shift``.
    """
    lo = max(0, block_start + shift - window_size)
    hi = min(num_keys, block_stop - 1 + shift + window_size + 1)
    return lo, max(lo, hi)


def _band_mask(block_start: int, block_stop: int, lo: int, hi: int, shift: int, window_size: int,
               device: torch.device) -> Tensor:
    """``(block, keys)`` bool mask, True where the query may attend the key."""
    rows = torch.arange(block_start, block_stop, device=device) + shift
    cols = torch.arange(lo, hi, device=device)
    return (rows[:, None] - cols[None, :]).abs() <= window_size


def _scores(q_blk: Tensor, k_blk: Tensor, mask: Tensor, scale: float) -> Tensor:
    """Masked scores ``(batch, heads, block, keys)``; float32 at least (half inputs are upcast)."""
    s = torch.matmul(q_blk, k_blk.transpose(-1, -2))
    if s.dtype in (torch.float16, torch.bfloat16):
        s = s.float()
    s = s * scale
    return s.masked_fill(~mask, float("-inf"))


class _BandedWindowAttention(torch.autograd.Function):
    """Flash-style banded attention: saves (q, k, v, out, lse); recomputes scores in backward."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, window_size: int, shift: int, block: int,  # noqa: ANN001
                scale: float) -> Tensor:
        num_q, num_k = q.shape[-2], k.shape[-2]
        out = q.new_zeros(q.shape[:-1] + (v.shape[-1],))
        lse = q.new_full(q.shape[:-1], float("-inf"), dtype=torch.float32 if q.element_size() < 4 else q.dtype)
        for start in range(0, num_q, block):
            stop = min(num_q, start + block)
            lo, hi = _key_range(start, stop, shift, window_size, num_k)
            if hi <= lo:
                continue
            mask = _band_mask(start, stop, lo, hi, shift, window_size, q.device)
            s = _scores(q[..., start:stop, :], k[..., lo:hi, :], mask, scale)
            m = s.amax(dim=-1, keepdim=True)
            m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # rows without keys
            p = torch.exp(s - m)
            denom = p.sum(dim=-1, keepdim=True)
            o = torch.matmul(p.to(v.dtype), v[..., lo:hi, :])
            safe = torch.where(denom > 0, denom, torch.ones_like(denom))
            out[..., start:stop, :] = (o / safe.to(o.dtype)).to(out.dtype)
            lse[..., start:stop] = (m + torch.log(denom)).squeeze(-1).to(lse.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.window_size, ctx.shift, ctx.block, ctx.scale = window_size, shift, block, scale
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):  # noqa: ANN001
        q, k, v, out, lse = ctx.saved_tensors
        window_size, shift, block, scale = ctx.window_size, ctx.shift, ctx.block, ctx.scale
        num_q, num_k = q.shape[-2], k.shape[-2]
        grad_out = grad_out.contiguous()
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        # D_i = sum_d dO_id O_id: the softmax Jacobian's diagonal correction, per query
        delta = (grad_out.to(lse.dtype) * out.to(lse.dtype)).sum(dim=-1)
        for start in range(0, num_q, block):
            stop = min(num_q, start + block)
            lo, hi = _key_range(start, stop, shift, window_size, num_k)
            if hi <= lo:
                continue
            mask = _band_mask(start, stop, lo, hi, shift, window_size, q.device)
            q_blk, k_blk, v_blk = q[..., start:stop, :], k[..., lo:hi, :], v[..., lo:hi, :]
            s = _scores(q_blk, k_blk, mask, scale)
            row_lse = lse[..., start:stop, None]
            row_lse = torch.where(torch.isfinite(row_lse), row_lse, torch.full_like(row_lse, float("inf")))
            p = torch.exp(s - row_lse.to(s.dtype))  # exp(-inf) = 0 for masked keys and empty rows
            go_blk = grad_out[..., start:stop, :]
            dv[..., lo:hi, :] += torch.matmul(p.transpose(-1, -2).to(v.dtype), go_blk)
            dp = torch.matmul(go_blk, v_blk.transpose(-1, -2)).to(p.dtype)
            ds = p * (dp - delta[..., start:stop, None].to(p.dtype)) * scale
            ds = ds.to(q.dtype)
            dq[..., start:stop, :] += torch.matmul(ds, k_blk)
            dk[..., lo:hi, :] += torch.matmul(ds.transpose(-1, -2), q_blk)
        return dq, dk, dv, None, None, None, None


def _flash_attn_func():  # pragma: no cover - needs a GPU with flash-attn
    try:
        from flash_attn import flash_attn_func
    except ImportError:
        return None
    return flash_attn_func


def _flash_window(shift: int, num_q: int, num_k: int, window_size: int) -> tuple[int, int] | None:
    """flash-attn's ``window_size=(left, right)`` that reproduces our window with offsets.

    flash-attn (non-causal, ``Lq != Lk``) aligns query ``i`` with key ``i + Lk - Lq`` and lets it
    see keys ``[i + Lk - Lq - left, i + Lk - Lq + right]``; we need ``[i + shift - w, i + shift + w]``.
    Returns None when that needs a negative side (then the banded path runs).
    """
    extra = shift - (num_k - num_q)
    left, right = window_size - extra, window_size + extra
    if left < 0 or right < 0:
        return None
    return left, right


def _use_flash(q: Tensor, k: Tensor, v: Tensor) -> bool:
    return (
        q.is_cuda
        and q.dtype in (torch.float16, torch.bfloat16)
        and k.dtype == q.dtype
        and v.dtype == q.dtype
        and q.shape[-1] == v.shape[-1]
        and _flash_attn_func() is not None
    )


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, window_size: int, block_size: int | None) -> None:
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


def sliding_window_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    window_size: int,
    q_offset: int = 0,
    k_offset: int = 0,
    *,
    scale: float | None = None,
    block_size: int | None = None,
) -> Tensor:
    """Exact sliding-window attention ``softmax(q k^T * scale + band) v`` in linear time and memory.

    Args:
        q: ``(batch, heads, Lq, dim)``; query ``i`` at global position ``q_offset + i``.
        k, v: ``(batch, heads, Lk, dim)``; key ``j`` at global position ``k_offset + j``.
        window_size: a query attends keys with ``|pos_q - pos_k| <= window_size`` (0: itself only).
        scale: score scale, ``1 / sqrt(dim)`` by default.
        block_size: queries per block of the banded path (default :func:`default_block_size`).

    Returns ``(batch, heads, Lq, dim)``; rows whose window holds no key are zero.
    """
    _check_inputs(q, k, v, window_size, block_size)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    shift = int(q_offset) - int(k_offset)
    num_q, num_k = q.shape[-2], k.shape[-2]
    # a window that reaches every key from every query is dense: clip it (fewer, larger blocks)
    window_size = min(window_size, max(abs(shift + num_q - 1), abs(shift - num_k + 1), 0))
    if _use_flash(q, k, v):  # pragma: no cover - needs a GPU with flash-attn
        sides = _flash_window(shift, num_q, num_k, window_size)
        if sides is not None and 0 <= shift and shift + num_q <= num_k:
            flash = _flash_attn_func()
            qt, kt, vt = (einops.rearrange(t, "b h s d -> b s h d") for t in (q, k, v))
            out = flash(qt, kt, vt, softmax_scale=scale, causal=False, window_size=sides)
            return einops.rearrange(out, "b s h d -> b h s d")
    block = block_size or default_block_size(window_size)
    return _BandedWindowAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), window_size, shift,
                                        block, scale)


def dense_window_attention(
    q: Tensor, k: Tensor, v: Tensor, window_size: int, q_offset: int = 0, k_offset: int = 0,
    *, scale: float | None = None,
) -> Tensor:
    """Reference from the definition: a dense ``(Lq, Lk)`` masked softmax (quadratic; tests and baselines).

    Same layout and semantics as :func:`sliding_window_attention`, rows without keys are zero.
    """
    _check_inputs(q, k, v, window_size, None)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    pos_q = torch.arange(q.shape[-2], device=q.device) + q_offset
    pos_k = torch.arange(k.shape[-2], device=q.device) + k_offset
    mask = (pos_q[:, None] - pos_k[None, :]).abs() <= window_size
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.matmul(p, v)
