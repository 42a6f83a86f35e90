"""The one place that chooses a kernel: sliding-window attention and graph attention.

Layers call :func:`sliding_window_attention` and :func:`graph_attention_kernel` with the kernel their
config names; this module knows each kernel's limits (device, dtype, head dim, installed packages),
answers the checks that run before any work (:func:`attention_kernel_problem`,
:func:`graph_kernel_problem`) and resolves ``"auto"`` per call. The kernels themselves live in their
own modules and import nothing from here:

- window attention, layout ``(batch, heads, seq, dim)``: ``"banded"`` (:mod:`~stormshard.kernels.banded`,
  every device, forward and backward, any dtype), ``"flash"`` (:mod:`~stormshard.kernels.flash`,
  flash-attn's window kernel, CUDA, fp16/bf16), ``"flex"`` (:mod:`~stormshard.kernels.flex`, torch's flex
  attention with a band block mask; CUDA trains with it, a CPU only runs its forward) and ``"auto"``:
  on CUDA flash where it applies, else flex for bf16 / fp16 with head dims of at least 16, else banded
  (a fallback is logged once); on a CPU banded (measured, ``benchmarks/bench_gpu.py --cpu``: flex's
  forward is 0.6-1.1x banded's on CPU and costs a compile);
- graph attention, node layout ``(nodes, *batch, heads, d)``: ``"csr"`` (:mod:`~stormshard.kernels.graph_csr`,
  sparse CSR products, every device, computed in fp32 or float64), ``"triton"``
  (:mod:`~stormshard.kernels.graph_triton`, one Triton program per destination node, bf16/fp16/fp32
  inputs with fp32 statistics; CUDA, or a CPU under ``TRITON_INTERPRET=1``) and ``"auto"``: Triton on
  CUDA when it imports, else csr.

Nothing is communicated here.
"""

from __future__ import annotations

import logging
import math

import torch
from torch import Tensor

from stormshard.kernels.banded import banded_window_attention
from stormshard.kernels.flash import (
    flash_attn_window_func,
    flash_problem,
    flash_unusable,
    flash_window_attention,
)
from stormshard.kernels.flex import (
    flex_attention_unavailable,
    flex_kernel_options_ready,
    flex_problem,
    flex_unusable,
    flex_window_attention,
)
from stormshard.kernels.graph_csr import fused_graph_attention
from stormshard.kernels.names import ATTENTION_KERNELS, GRAPH_KERNELS, AttentionKernel, GraphKernel
from stormshard.kernels.reference import check_window_inputs

__all__ = [
    "sliding_window_attention", "check_attention_kernel", "resolve_attention_kernel", "prepare_attention_kernels",
    "attention_kernel_problem", "flex_unusable", "AttentionKernel", "ATTENTION_KERNELS",
    "GraphKernel", "GRAPH_KERNELS", "check_graph_kernel", "graph_kernel_problem", "resolve_graph_kernel",
    "graph_attention_kernel",
]

_log = logging.getLogger(__name__)


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
        return flex_problem(device_type, precision=precision, head_dim=head_dim, backward=backward)
    if kernel == "flash":
        return flash_problem(device_type, precision=precision)
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
        reason = flash_unusable(q, k, v, shift, window_size)
        if reason is not None:
            raise ValueError(f"attention_kernel 'flash' cannot run: {reason}; use attention_kernel 'auto' or 'banded'")
        return "flash"
    if kernel == "flex":
        return "flex"
    if not q.is_cuda:
        return "banded"
    reason = flash_unusable(q, k, v, shift, window_size)
    if reason is None:
        return "flash"
    flex_reason = flex_unusable(q, v)
    if flex_reason is None and q.dtype not in (torch.bfloat16, torch.float16):
        flex_reason = (f"{q.dtype}: flex runs under 'auto' for bf16 / fp16 only (measured on an H100, flex in fp32 "
                       "without TF32 ran at 0.22x the banded kernel at the AIFS shape)")
    if flex_reason is None:
        _log_fallback_once(f"attention_kernel 'auto': flex attention instead of flash-attn ({reason})")
        return "flex"
    _log_fallback_once(f"attention_kernel 'auto': the banded kernel ({reason}; {flex_reason})")
    return "banded"

def prepare_attention_kernels() -> None:
    """Probe flash-attn, flex attention and Triton now (outside any compiled region): ``torch.compile``
    then only reads the answers (:func:`stormshard.models.compile.compile_blocks` calls it)."""
    flash_attn_window_func()
    flex_attention_unavailable()
    flex_kernel_options_ready()
    _triton_unavailable("cuda" if torch.cuda.is_available() else "cpu")


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
        block_size: queries per block of the banded path (default :func:`~stormshard.kernels.banded.default_block_size`).
        kernel: ``"auto"``, ``"banded"``, ``"flex"`` or ``"flash"`` (module docstring); a kernel asked
            for by name that cannot run here is a ValueError saying why and what to use instead.

    Returns ``(batch, heads, Lq, dim)``; rows whose window holds no key are zero.
    """
    check_window_inputs(q, k, v, window_size, block_size)
    check_attention_kernel(kernel)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    shift = int(q_offset) - int(k_offset)
    num_q, num_k = q.shape[-2], k.shape[-2]
    # a window that reaches every key from every query is dense: clip it (fewer, larger blocks)
    window_size = min(window_size, max(abs(shift + num_q - 1), abs(shift - num_k + 1), 0))
    chosen = resolve_attention_kernel(kernel, q, k, v, shift, window_size)
    if chosen == "flash":  # pragma: no cover - needs a GPU with flash-attn
        return flash_window_attention(q, k, v, window_size, shift, scale)
    if chosen == "flex":
        return flex_window_attention(q, k, v, window_size, shift, 0, scale=scale)
    return banded_window_attention(q, k, v, window_size, shift, scale, block_size)


# --------------------------------------------------------------------------------------------
# graph attention
# --------------------------------------------------------------------------------------------


_TRITON_PROBE: dict[str, str | None] = {}  # device type -> reason or None, once probed


def _triton_unavailable(device_type: str) -> str | None:
    """:func:`~stormshard.kernels.graph_triton.triton_graph_unavailable`, probed once per device type (the
    module, and Triton, load only when a graph kernel is resolved)."""
    if device_type not in _TRITON_PROBE:
        from stormshard.kernels.graph_triton import triton_graph_unavailable

        _TRITON_PROBE[device_type] = triton_graph_unavailable(device_type)
    return _TRITON_PROBE[device_type]


def check_graph_kernel(kernel: object) -> None:
    """ValueError unless ``kernel`` is one of :data:`GRAPH_KERNELS`."""
    if kernel not in GRAPH_KERNELS:
        raise ValueError(f"graph_kernel must be one of {', '.join(map(repr, GRAPH_KERNELS))}, got {kernel!r}")


def graph_kernel_problem(kernel: str, device_type: str) -> str | None:
    """Why the graph-attention ``kernel`` cannot run on ``device_type`` (``"cuda"``, ``"cpu"``, ...); None
    when it can. The rule behind the checks before any work and the per-call dispatch
    (:func:`resolve_graph_kernel`): ``"csr"`` and ``"auto"`` run everywhere, ``"triton"`` needs Triton and
    CUDA (or, on a CPU, Triton's interpreter: ``TRITON_INTERPRET=1``)."""
    if kernel not in GRAPH_KERNELS:
        return f"{kernel!r} is unknown: use one of {', '.join(GRAPH_KERNELS)}"
    if kernel == "triton":
        return _triton_unavailable(device_type)
    return None


def resolve_graph_kernel(kernel: GraphKernel, device_type: str, dtype: torch.dtype | None = None) -> str:
    """The graph kernel that computes a call on ``device_type`` with node tensors of ``dtype`` (None: not
    known): ``"csr"`` or ``"triton"``.

    ``"auto"``: Triton on CUDA when it imports (a fallback to csr is logged once), except for float64 (a
    reference precision, where speed does not matter: csr, whose float64 path is proven on CUDA), csr
    elsewhere. A kernel named explicitly that cannot run is a ValueError naming the reason and the fix."""
    if kernel == "csr":
        return "csr"
    if kernel == "triton":
        reason = _triton_unavailable(device_type)
        if reason is not None:
            raise ValueError(f"graph_kernel 'triton' cannot run: {reason}; use graph_kernel 'auto' or 'csr'")
        return "triton"
    check_graph_kernel(kernel)
    if device_type != "cuda" or dtype == torch.float64:
        return "csr"
    reason = _triton_unavailable(device_type)
    if reason is None:
        return "triton"
    _log_fallback_once(f"graph_kernel 'auto': the csr kernel ({reason})")
    return "csr"


def graph_attention_kernel(kernel: GraphKernel, query: Tensor, key: Tensor, value: Tensor, edge_attr: Tensor,
                           edge_weight: Tensor, edge_bias: Tensor | None, edge_index: Tensor,
                           num_dst: int | None = None) -> Tensor:
    """Graph attention by ``kernel`` (:func:`resolve_graph_kernel`): every destination attends its incoming
    edges, the edge embedding ``edge_attr @ edge_weight.T + edge_bias`` added to keys and values (never
    formed per edge).

    ``query`` ``(num_dst, *batch, heads, d)``, ``key`` / ``value`` ``(num_src, *batch, heads, d)``,
    ``edge_attr`` ``(E, F)`` or ``(E, *batch, F)``, ``edge_weight`` ``(heads * d, F)``, ``edge_bias``
    ``(heads * d,)`` or None, ``edge_index`` ``(2, E)`` (row 0 source, row 1 destination). Returns
    ``(num_dst, *batch, heads, d)`` in query's dtype. Logits, softmax statistics and sums are fp32 (float64
    for float64 inputs) whatever the compute dtype: the Triton kernel reads bf16 / fp16 / fp32 inputs as
    they are and accumulates in fp32; the csr kernel computes on fp32 copies (autocast off).
    """
    if resolve_graph_kernel(kernel, query.device.type, query.dtype) == "triton":
        from stormshard.kernels.graph_triton import triton_graph_attention

        return triton_graph_attention(query, key, value, edge_attr, edge_weight, edge_bias, edge_index, num_dst)
    acc = torch.promote_types(query.dtype, torch.float32)
    with torch.autocast(device_type=query.device.type, enabled=False):
        out = fused_graph_attention(query.to(acc), key.to(acc), value.to(acc), edge_attr.to(acc), edge_weight.to(acc),
                                    None if edge_bias is None else edge_bias.to(acc), edge_index, num_dst)
    return out.to(query.dtype)
