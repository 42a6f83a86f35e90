"""Activation checkpointing of one block, applied once by the parallelize step, names unchanged.

:class:`ActivationCheckpoint` wraps a block (any ``nn.Module`` whose ``forward`` takes
positional tensors: a transformer block ``(x)``, a conditional block ``(x, cond)``, a graph block
``(x, edge_attr)``). While gradients are recorded (``torch.is_grad_enabled()``) the block runs
under :func:`torch.utils.checkpoint.checkpoint` (non-reentrant): its inner activations are freed
after forward and recomputed, communication included, in backward. Under ``torch.no_grad()``
(validation, inference) it is a plain call. This is the only checkpointing guard of the processors.

The wrapper adopts the block's parameters, buffers and children instead of holding the block as
a child, so parameter and state-dict names do not change: ``processor.blocks.0.attention.lin_qkv.weight``
stays that name whether or not block 0 is wrapped (checkpoints, resharding and conversion rely on
these names). The block itself stays reachable as ``.block``, and its plain attributes read
through the wrapper. Nothing is communicated here.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["ActivationCheckpoint", "checkpoint_blocks", "unwrap_block"]


class ActivationCheckpoint(nn.Module):
    """``forward(*args) -> block(*args)``, recomputed in backward when gradients are enabled.

    Shares the block's ``_parameters``, ``_buffers`` and ``_modules`` (the same dict objects),
    so ``state_dict()``, ``named_parameters()``, ``load_state_dict`` and ``.to()`` see exactly the
    block's tree. ``train()`` / ``eval()`` reach the block too.
    """

    def __init__(self, block: nn.Module) -> None:
        if isinstance(block, ActivationCheckpoint):
            raise TypeError("block is already wrapped in ActivationCheckpoint: wrap each block once")
        if not isinstance(block, nn.Module):
            raise TypeError(f"block must be an nn.Module, got {type(block).__name__}")
        super().__init__()
        # adopt the block's tree: same dicts, so every traversal yields the block's own names
        self._parameters = block._parameters
        self._buffers = block._buffers
        self._non_persistent_buffers_set = block._non_persistent_buffers_set
        self._modules = block._modules
        self.__dict__["block"] = block  # not registered: it would add a "block." prefix to every name
        self.training = block.training

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)  # parameters, buffers, children (the block's)
        except AttributeError:
            block = self.__dict__.get("block")
            if block is None:
                raise
            return getattr(block, name)

    def train(self, mode: bool = True) -> ActivationCheckpoint:
        super().train(mode)
        self.block.training = mode
        return self

    def _get_name(self) -> str:
        return f"ActivationCheckpoint[{self.block._get_name()}]"

    def extra_repr(self) -> str:
        return self.block.extra_repr()

    def forward(self, *args: Any) -> Any:
        if torch.is_grad_enabled():
            return checkpoint(self.block, *args, use_reentrant=False)
        return self.block(*args)


def checkpoint_blocks(blocks: nn.ModuleList) -> None:
    """Wrap every block of ``blocks`` in :class:`ActivationCheckpoint`, in place (names unchanged).

    Blocks that are already wrapped are left as they are, so applying it twice is harmless.
    """
    for i, block in enumerate(blocks):
        if not isinstance(block, ActivationCheckpoint):
            blocks[i] = ActivationCheckpoint(block)


def unwrap_block(block: nn.Module) -> nn.Module:
    """The block inside an :class:`ActivationCheckpoint`, or ``block`` itself when it is not wrapped."""
    return block.block if isinstance(block, ActivationCheckpoint) else block
