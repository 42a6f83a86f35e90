"""The compute kernels, one module each, and the one module that chooses among them.

- :mod:`~stormshard.kernels.dispatch`: which kernel computes a call (device, dtype, shapes, installed
  packages) and the checks that run before any work; ``sliding_window_attention`` and
  ``graph_attention_kernel`` are the entry points the layers call;
- sliding-window attention ``(batch, heads, seq, dim)``: :mod:`~stormshard.kernels.banded` (every
  device), :mod:`~stormshard.kernels.flex` (torch's flex attention), :mod:`~stormshard.kernels.flash`
  (flash-attn);
- graph attention ``(nodes, *batch, heads, d)``: :mod:`~stormshard.kernels.graph_csr` (sparse CSR
  products, every device) and :mod:`~stormshard.kernels.graph_triton` (Triton, CUDA or Triton's
  interpreter);
- :mod:`~stormshard.kernels.reference`: the definitions written out (float64 test references);
- :mod:`~stormshard.kernels.names`: the kernels' names, torch-free (read by the model config).

Layers import kernels, never the reverse; nothing here communicates.
"""

from __future__ import annotations

from stormshard.lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    **dict.fromkeys(("sliding_window_attention", "graph_attention_kernel", "resolve_attention_kernel",
                     "resolve_graph_kernel", "attention_kernel_problem", "graph_kernel_problem"), "dispatch"),
    **dict.fromkeys(("dense_window_attention", "graph_attention"), "reference"),
    "fused_graph_attention": "graph_csr",
    "triton_graph_attention": "graph_triton",
    "set_flex_kernel_options": "flex",
    **dict.fromkeys(("ATTENTION_KERNELS", "AttentionKernel", "GRAPH_KERNELS", "GraphKernel"), "names"),
}
__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__)
