"""The kernels' names (torch-free, so that a config validates without torch).

``model.processor.attention_kernel`` takes one of :data:`ATTENTION_KERNELS` (the sliding-window
attention), ``model.graph_kernel`` one of :data:`GRAPH_KERNELS` (the graph-transformer attention of
encoder, processor and decoder); what each runs, and which ``auto`` picks, is in
:mod:`stormshard.kernels.dispatch`.
"""

from __future__ import annotations

from typing import Literal, get_args

__all__ = ["AttentionKernel", "ATTENTION_KERNELS", "GraphKernel", "GRAPH_KERNELS"]

AttentionKernel = Literal["auto", "banded", "flex", "flash"]
ATTENTION_KERNELS: tuple[str, ...] = get_args(AttentionKernel)

GraphKernel = Literal["auto", "csr", "triton"]
GRAPH_KERNELS: tuple[str, ...] = get_args(GraphKernel)
