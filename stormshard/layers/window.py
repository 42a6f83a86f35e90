"""Sliding-window attention kernel: exact, banded, linear in the sequence length.

Layout: ``q`` is ``(batch, heads, Lq, dim)``, ``k`` and ``v`` are ``(batch, heads, Lk, dim)``.
Query ``i`` sits at global position ``q_offset + i``, key ``j`` at ``k_offset + j``; a query
attends a key exactly when ``|pos_q - pos_k| <= window_size`` (flash-attn's symmetric window,
the one AIFS uses). A query with no key in reach (possible only with offsets) returns zeros.

The CPU (and fallback) path walks the queries block by block; each block of ``B`` queries only
sees the ``B + 2 * window_size`` keys that can reach it, so time and memory grow linearly with
the sequence instead of quadratically as with a dense masked SDPA. It is a torch custom op
with a backward op (``stormshard::banded_window_attention``: opaque to torch.compile, no graph
break), in the style of flash attention: the forward keeps only the output and the per-query
log-sum-exp, and the backward recomputes each block's scores, so no ``(Lq, Lk)`` matrix is
ever held. On CUDA, with ``flash_attn`` (>= 2.3, the first with ``window_size``) importable and
half-precision inputs, flash-attn's windowed kernel can run instead (same definition, via an asymmetric
window that absorbs the offsets); the import and the version check run once per process.

Kernels (``kernel=``, the model's ``processor.attention_kernel``): ``"banded"`` (the kernel above,
every device, forward and backward), ``"flash"`` (flash-attn, CUDA, fp16/bf16), ``"flex"``
(:mod:`stormshard.layers.flex_window`: torch's flex attention with a block mask; CUDA trains with it,
a CPU only runs its forward) and ``"auto"``: on CUDA flash where it applies, else flex for bf16 /
fp16 with head dims of at least 16, else banded (a fallback is logged once); on a CPU banded (measured, ``benchmarks/bench_gpu.py --cpu``: flex's
forward is 0.6-1.1x banded's on CPU and costs a compile).

Precision: the banded path computes scores, the softmax statistics (running max and log-sum-exp)
and the output in fp32 for fp16/bf16 inputs (in float64 for float64), with ``torch.autocast``
switched off inside, and returns the input dtype; flash-attn keeps its softmax statistics in fp32.

Nothing is communicated here.
"""

from __future__ import annotations

import logging
import math
import re
import warnings

import einops
import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from stormshard.layers.kernel_names import ATTENTION_KERNELS, AttentionKernel

__all__ = [
    "sliding_window_attention", "dense_window_attention", "default_block_size", "flash_attn_window_func",
    "flash_window_sides", "AttentionKernel", "ATTENTION_KERNELS", "check_attention_kernel", "resolve_attention_kernel",
    "prepare_attention_kernels", "attention_kernel_problem",
]

_log = logging.getLogger(__name__)


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


def _band_bias(rows_start: int, num_rows: int, lo: int, hi: int, window_size: int, like: Tensor) -> Tensor:
    """``(rows, keys)`` additive mask: 0 where key-local row position ``rows_start + r`` may attend key ``lo + c``, -inf elsewhere."""
    rows = torch.arange(rows_start, rows_start + num_rows, device=like.device)
    cols = torch.arange(lo, hi, device=like.device)
    allowed = (rows[:, None] - cols[None, :]).abs() <= window_size
    return torch.zeros(allowed.shape, dtype=like.dtype, device=like.device).masked_fill_(~allowed, float("-inf"))


def _blocks(num_q: int, num_k: int, shift: int, window_size: int, block: int, like: Tensor):
    """Yield ``(start, stop, lo, hi, bias)`` per query block; interior blocks share one cached bias."""
    cache: dict[tuple[int, int, int], Tensor] = {}
    for start in range(0, num_q, block):
        stop = min(num_q, start + block)
        lo, hi = _key_range(start, stop, shift, window_size, num_k)
        if hi <= lo:
            continue
        key = (start + shift - lo, stop - start, hi - lo)  # the bias only depends on the relative layout
        if key not in cache:
            cache[key] = _band_bias(key[0], key[1], 0, key[2], window_size, like)
        yield start, stop, lo, hi, cache[key]


def _banded_forward(q: Tensor, k: Tensor, v: Tensor, window_size: int, shift: int, block: int,
                    scale: float) -> tuple[Tensor, Tensor]:
    """``(out (BH, Lq, dv), lse (BH, Lq, 1))`` of the banded kernel, scores and statistics in q's dtype."""
    with torch.autocast(q.device.type, enabled=False):  # scores and statistics in q's dtype (fp32/fp64)
        num_q, num_k = q.shape[1], k.shape[1]
        out = q.new_zeros(q.shape[:2] + (v.shape[-1],))
        lse = q.new_full(q.shape[:2] + (1,), float("-inf"))
        for start, stop, lo, hi, bias in _blocks(num_q, num_k, shift, window_size, block, q):
            s = torch.baddbmm(bias, q[:, start:stop], k[:, lo:hi].transpose(1, 2), alpha=scale)
            m = s.amax(dim=-1, keepdim=True)
            m.masked_fill_(m == float("-inf"), 0.0)  # rows without keys: keep exp() finite
            p = s.sub_(m).exp_()
            denom = p.sum(dim=-1, keepdim=True)
            out[:, start:stop] = torch.bmm(p, v[:, lo:hi]).div_(denom.masked_fill(denom == 0, 1.0))
            lse[:, start:stop] = m + denom.log()
        return out, lse


def _banded_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, window_size: int,
                     shift: int, block: int, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)``: each block's scores recomputed from ``q``, ``k`` and the forward's ``lse``."""
    with torch.autocast(grad_out.device.type, enabled=False):
        grad_out = grad_out.to(q.dtype).contiguous()
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        # D_i = sum_d dO_id O_id: the softmax Jacobian's diagonal correction, per query
        delta = (grad_out * out).sum(dim=-1, keepdim=True)
        lse = lse.masked_fill(lse == float("-inf"), float("inf"))  # rows without keys: p = exp(-inf) = 0
        for start, stop, lo, hi, bias in _blocks(q.shape[1], k.shape[1], shift, window_size, block, q):
            q_blk, k_blk, v_blk, go_blk = q[:, start:stop], k[:, lo:hi], v[:, lo:hi], grad_out[:, start:stop]
            p = torch.baddbmm(bias, q_blk, k_blk.transpose(1, 2), alpha=scale).sub_(lse[:, start:stop]).exp_()
            dv[:, lo:hi] += torch.bmm(p.transpose(1, 2), go_blk)
            ds = torch.bmm(go_blk, v_blk.transpose(1, 2)).sub_(delta[:, start:stop]).mul_(p)
            dq[:, start:stop] += torch.bmm(ds, k_blk).mul_(scale)
            dk[:, lo:hi] += torch.bmm(ds.transpose(1, 2), q_blk).mul_(scale)
        return dq, dk, dv


# torch custom ops: torch.compile keeps the python block loop opaque (one op in the graph, no
# graph break, no unrolled loop to compile); eager calls run the same functions (_EagerBanded)
@torch.library.custom_op("stormshard::banded_window_attention", mutates_args=())
def _banded_op(q: Tensor, k: Tensor, v: Tensor, window_size: int, shift: int, block: int,
               scale: float) -> tuple[Tensor, Tensor]:
    return _banded_forward(q, k, v, window_size, shift, block, scale)


@_banded_op.register_fake
def _banded_fake(q: Tensor, k: Tensor, v: Tensor, window_size: int, shift: int, block: int,
                 scale: float) -> tuple[Tensor, Tensor]:
    return q.new_empty(q.shape[:2] + (v.shape[-1],)), q.new_empty(q.shape[:2] + (1,))


@torch.library.custom_op("stormshard::banded_window_attention_backward", mutates_args=())
def _banded_backward_op(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, window_size: int,
                        shift: int, block: int, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    return _banded_backward(grad_out, q, k, v, out, lse, window_size, shift, block, scale)


@_banded_backward_op.register_fake
def _banded_backward_fake(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                          window_size: int, shift: int, block: int, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _banded_setup(ctx, inputs: tuple, output: tuple) -> None:  # noqa: ANN001
    q, k, v, window_size, shift, block, scale = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.window_size, ctx.shift, ctx.block, ctx.scale = window_size, shift, block, scale


def _banded_grad(ctx, grad_out: Tensor, _grad_lse: Tensor) -> tuple:  # noqa: ANN001
    saved = ctx.saved_tensors  # read once (activation checkpointing unpacks each saved tensor once)
    dq, dk, dv = torch.ops.stormshard.banded_window_attention_backward(
        grad_out, *saved, ctx.window_size, ctx.shift, ctx.block, ctx.scale)
    return dq, dk, dv, None, None, None, None


_banded_op.register_autograd(_banded_grad, setup_context=_banded_setup)


class _EagerBanded(torch.autograd.Function):
    """The op's forward and backward without torch.library's dispatch, for eager calls (same
    functions, same numbers; no import of ``torch._dynamo``, which a custom op's kernel wrapper does)."""

    @staticmethod
    def forward(ctx, q, k, v, window_size, shift, block, scale):  # noqa: ANN001, ANN205
        out = _banded_forward(q, k, v, window_size, shift, block, scale)
        _banded_setup(ctx, (q, k, v, window_size, shift, block, scale), out)
        ctx.mark_non_differentiable(out[1])
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out, _grad_lse):  # noqa: ANN001, ANN205
        saved = ctx.saved_tensors
        dq, dk, dv = _banded_backward(grad_out, *saved, ctx.window_size, ctx.shift, ctx.block, ctx.scale)
        return dq, dk, dv, None, None, None, None


class _BandedWindowAttention:
    """Flash-style banded attention on ``(batch * heads, seq, dim)``: saves (q, k, v, out, lse), recomputes
    scores in backward. ``apply(q, k, v, window_size, shift, block, scale) -> out``; under torch.compile
    the kernel is the custom op ``stormshard::banded_window_attention`` (and its backward op), opaque
    to the compiler; eager calls run the same functions as an autograd Function."""

    @staticmethod
    def apply(q: Tensor, k: Tensor, v: Tensor, window_size: int, shift: int, block: int, scale: float) -> Tensor:
        op = _banded_op if torch.compiler.is_compiling() else _EagerBanded.apply
        return op(q, k, v, window_size, shift, block, scale)[0]


FLASH_ATTN_MIN_VERSION = (2, 3)  # flash_attn_func gained window_size in 2.3


def _version_tuple(version: str) -> tuple[int, ...]:
    """``"2.6.3+cu12"`` -> ``(2, 6, 3)``: the leading dotted integers of a version string."""
    match = re.match(r"\d+(?:\.\d+)*", version.strip())
    return tuple(int(x) for x in match.group(0).split(".")) if match else ()


_FLASH_PROBE: list = []  # [flash_attn_func or None] once probed (a list, not lru_cache: torch.compile reads it)


def flash_attn_window_func():
    """flash-attn's ``flash_attn_func`` if importable and new enough (>= 2.3), else None; decided once
    per process (a failed import is not retried on every call). An installed flash-attn older than
    2.3 gets one warning naming the version and the fix; the banded kernel runs instead."""
    if not _FLASH_PROBE:
        _FLASH_PROBE.append(_probe_flash_attn())
    return _FLASH_PROBE[0]


def prepare_attention_kernels() -> None:
    """Probe flash-attn and flex attention now (outside any compiled region): ``torch.compile``
    then only reads the answers (:func:`stormshard.models.compile.compile_blocks` calls it)."""
    from stormshard.layers.flex_window import flex_attention_unavailable, flex_kernel_options_ready

    flash_attn_window_func()
    flex_attention_unavailable()
    flex_kernel_options_ready()


def _probe_flash_attn():  # noqa: ANN202 - flash-attn's function or None
    try:
        import flash_attn
        from flash_attn import flash_attn_func
    except ImportError:
        return None
    version = getattr(flash_attn, "__version__", "0")
    if _version_tuple(version) < FLASH_ATTN_MIN_VERSION:
        warnings.warn(
            f"flash-attn {version} is installed but has no window_size (added in 2.3): sliding-window attention "
            "uses the banded kernel instead; upgrade with `pip install 'flash-attn>=2.3'`", stacklevel=2)
        return None
    return flash_attn_func


def flash_window_sides(shift: int, num_q: int, num_k: int, window_size: int) -> tuple[int, int] | None:
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


def _flash_unusable(q: Tensor, k: Tensor, v: Tensor, shift: int, window_size: int) -> str | None:
    """None when flash-attn's window kernel can compute this call, else why not."""
    num_q, num_k = q.shape[-2], k.shape[-2]
    if not q.is_cuda:
        return f"flash-attn runs on CUDA only, these tensors are on {q.device.type}"
    if q.dtype not in (torch.float16, torch.bfloat16) or k.dtype != q.dtype or v.dtype != q.dtype:
        return (f"flash-attn needs fp16/bf16 q, k, v, got {q.dtype}, {k.dtype}, {v.dtype} "
                "(train with training.precision 'bf16')")
    if q.shape[-1] != v.shape[-1] or q.shape[-1] % 8 != 0 or q.shape[-1] > 256:
        return f"flash-attn needs a head dim that is a multiple of 8 up to 256, got {q.shape[-1]}"
    if not (0 <= shift and shift + num_q <= num_k) or flash_window_sides(shift, num_q, num_k, window_size) is None:
        return (f"flash-attn's window cannot express queries at offset {shift} over {num_k} keys "
                "(a halo narrower than the window)")
    if flash_attn_window_func() is None:
        return "flash-attn >= 2.3 is not importable (pip install 'flash-attn>=2.3', CUDA only)"
    return None


def check_attention_kernel(kernel: object) -> None:
    """ValueError unless ``kernel`` is one of :data:`ATTENTION_KERNELS`."""
    if kernel not in ATTENTION_KERNELS:
        raise ValueError(f"attention_kernel must be one of {', '.join(map(repr, ATTENTION_KERNELS))}, got {kernel!r}")


def attention_kernel_problem(kernel: str, device_type: str, *, precision: str | None, head_dim: int | None,
                             backward: bool) -> str | None:
    """Why ``kernel`` cannot run on ``device_type`` (``"cuda"``, ``"cpu"``, ...) at ``precision``
    (``"fp32"``, ``"bf16"``, ``"fp16"``, ``"fp64"``; None: not known yet) with heads of ``head_dim``
    (None: not known), with a backward (training) or forward only; None when it can. The one rule
    behind the training and forecast checks, before any work; the same limits as the per-call
    dispatch (:func:`resolve_attention_kernel`)."""
    if kernel not in ATTENTION_KERNELS:
        return f"{kernel!r} is unknown: use one of {', '.join(ATTENTION_KERNELS)}"
    if kernel == "flex":
        from stormshard.layers.flex_window import flex_attention_unavailable

        unavailable = flex_attention_unavailable()
        if unavailable is not None:
            return unavailable
        if device_type == "cuda" and head_dim is not None and head_dim < 16:
            return (f"flex attention on CUDA needs a head dim of at least 16 (Triton's dot), got num_channels / "
                    f"num_heads = {head_dim}: use fewer heads")
        if device_type != "cuda" and backward:
            return (f"torch's flex attention has no backward on {device_type}: train there with 'auto' or 'banded' "
                    "(a forecast can run flex: launch/forecast.py --attention-kernel flex)")
        if device_type == "cpu" and precision == "fp64":
            return "flex attention on a CPU computes in fp32, bf16 or fp16, not fp64: use fp32, or 'banded' for fp64"
    if kernel == "flash":
        if device_type != "cuda":
            return f"flash-attn needs CUDA, this runs on {device_type}"
        if precision is not None and precision not in ("bf16", "fp16"):
            return f"flash-attn computes in bf16 / fp16, the precision is {precision!r}: use bf16"
        if flash_attn_window_func() is None:
            return "flash-attn >= 2.3 is not importable: pip install 'flash-attn>=2.3'"
    return None


_LOGGED: set[str] = set()


def _log_fallback_once(message: str) -> None:
    if torch.compiler.is_compiling() or message in _LOGGED:  # no logging (a side effect) inside a compiled graph
        return
    _LOGGED.add(message)
    _log.info(message)


def resolve_attention_kernel(kernel: AttentionKernel, q: Tensor, k: Tensor, v: Tensor, shift: int,
                             window_size: int) -> str:
    """The kernel that computes this call: ``"banded"``, ``"flex"`` or ``"flash"``.

    ``"auto"``: on CUDA flash where it applies, else flex for bf16 / fp16 with head dims of at least 16,
    else banded (a fallback is logged once per reason); elsewhere banded. A kernel named explicitly that cannot compute this
    call is a ValueError naming the reason and the fix.
    """
    if kernel == "banded":
        return "banded"
    if kernel == "flash":
        reason = _flash_unusable(q, k, v, shift, window_size)
        if reason is not None:
            raise ValueError(f"attention_kernel 'flash' cannot run: {reason}; use attention_kernel 'auto' or 'banded'")
        return "flash"
    if kernel == "flex":
        return "flex"
    if not q.is_cuda:
        return "banded"
    reason = _flash_unusable(q, k, v, shift, window_size)
    if reason is None:
        return "flash"
    from stormshard.layers.flex_window import flex_unusable

    flex_reason = flex_unusable(q, v)
    if flex_reason is None and q.dtype not in (torch.bfloat16, torch.float16):
        flex_reason = (f"{q.dtype}: flex runs under 'auto' for bf16 / fp16 only (measured on an H100, flex in fp32 "
                       "without TF32 ran at 0.22x the banded kernel at the AIFS shape)")
    if flex_reason is None:
        _log_fallback_once(f"attention_kernel 'auto': flex attention instead of flash-attn ({reason})")
        return "flex"
    _log_fallback_once(f"attention_kernel 'auto': the banded kernel ({reason}; {flex_reason})")
    return "banded"


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
    kernel: AttentionKernel = "auto",
) -> Tensor:
    """Exact sliding-window attention ``softmax(q k^T * scale + band) v`` in linear time and memory.

    Args:
        q: ``(batch, heads, Lq, dim)``; query ``i`` at global position ``q_offset + i``.
        k, v: ``(batch, heads, Lk, dim)``; key ``j`` at global position ``k_offset + j``.
        window_size: a query attends keys with ``|pos_q - pos_k| <= window_size`` (0: itself only).
        scale: score scale, ``1 / sqrt(dim)`` by default.
        block_size: queries per block of the banded path (default :func:`default_block_size`).
        kernel: ``"auto"``, ``"banded"``, ``"flex"`` or ``"flash"`` (module docstring); a kernel asked
            for by name that cannot run here is a ValueError saying why and what to use instead.

    Returns ``(batch, heads, Lq, dim)``; rows whose window holds no key are zero.
    """
    _check_inputs(q, k, v, window_size, block_size)
    check_attention_kernel(kernel)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    shift = int(q_offset) - int(k_offset)
    num_q, num_k = q.shape[-2], k.shape[-2]
    # a window that reaches every key from every query is dense: clip it (fewer, larger blocks)
    window_size = min(window_size, max(abs(shift + num_q - 1), abs(shift - num_k + 1), 0))
    chosen = resolve_attention_kernel(kernel, q, k, v, shift, window_size)
    if chosen == "flash":  # pragma: no cover - needs a GPU with flash-attn
        sides = flash_window_sides(shift, num_q, num_k, window_size)
        flash = flash_attn_window_func()
        qt, kt, vt = (einops.rearrange(t, "b h s d -> b s h d") for t in (q, k, v))
        out = flash(qt, kt, vt, softmax_scale=scale, causal=False, window_size=sides)
        return einops.rearrange(out, "b s h d -> b h s d")
    if chosen == "flex":
        from stormshard.layers.flex_window import flex_window_attention

        return flex_window_attention(q, k, v, window_size, shift, 0, scale=scale)
    block = block_size or default_block_size(window_size)
    # half precision computes in float32; (batch, heads) fold into one batch dimension for bmm
    compute = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    b, h = q.shape[:2]
    q3, k3, v3 = (einops.rearrange(t.to(compute), "b h s d -> (b h) s d").contiguous() for t in (q, k, v))
    out = _BandedWindowAttention.apply(q3, k3, v3, window_size, shift, block, scale)
    return einops.rearrange(out, "(b h) s d -> b h s d", b=b, h=h).to(q.dtype)


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
