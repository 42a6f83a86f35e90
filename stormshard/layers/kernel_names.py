"""The sliding-window attention kernels' names (torch-free, so that a config validates without torch).

``model.processor.attention_kernel`` takes one of :data:`ATTENTION_KERNELS`; what each runs is in
:mod:`stormshard.layers.window`.
"""

from __future__ import annotations

from typing import Literal, get_args

__all__ = ["AttentionKernel", "ATTENTION_KERNELS"]

AttentionKernel = Literal["auto", "banded", "flex", "flash"]
ATTENTION_KERNELS: tuple[str, ...] = get_args(AttentionKernel)
