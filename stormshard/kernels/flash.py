"""flash-attn's window kernel (CUDA, fp16 / bf16, flash-attn >= 2.3): probed once per process.

Same definition as the banded kernel (:mod:`stormshard.kernels.banded`): the halo offsets become an
asymmetric ``window_size=(left, right)`` (:func:`flash_window_sides`). Layout ``(batch, heads, seq,
dim)`` in and out. Nothing is communicated here.
"""

from __future__ import annotations

import re
import warnings

import einops
import torch
from torch import Tensor

__all__ = ["FLASH_ATTN_MIN_VERSION", "flash_problem", "flash_attn_window_func", "flash_window_sides", "flash_unusable",
           "flash_window_attention"]


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


def flash_problem(device_type: str, *, precision: str | None) -> str | None:
    """Why flash-attn's window kernel cannot run on ``device_type`` at ``precision`` (None: not known);
    None when it can."""
    if device_type != "cuda":
        return f"flash-attn needs CUDA, this runs on {device_type}"
    if precision is not None and precision not in ("bf16", "fp16"):
        return f"flash-attn computes in bf16 / fp16, the precision is {precision!r}: use bf16"
    if flash_attn_window_func() is None:
        return "flash-attn >= 2.3 is not importable: pip install 'flash-attn>=2.3'"
    return None


def flash_unusable(q: Tensor, k: Tensor, v: Tensor, shift: int, window_size: int) -> str | None:
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


def flash_window_attention(q: Tensor, k: Tensor, v: Tensor, window_size: int, shift: int,
                           scale: float) -> Tensor:  # pragma: no cover - needs a GPU with flash-attn
    """flash-attn's window kernel on ``(batch, heads, seq, dim)`` tensors (the caller checked that it
    applies: :func:`stormshard.kernels.dispatch.resolve_attention_kernel`)."""
    sides = flash_window_sides(shift, q.shape[-2], k.shape[-2], window_size)
    qt, kt, vt = (einops.rearrange(t, "b h s d -> b s h d") for t in (q, k, v))
    out = flash_attn_window_func()(qt, kt, vt, softmax_scale=scale, causal=False, window_size=sides)
    return einops.rearrange(out, "b s h d -> b h s d")
