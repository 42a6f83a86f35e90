"""Activation checkpointing of one block, applied once by the parallelize step, names unchanged.

:class:`ActivationCheckpoint` wraps a block (any ``nn.Module`` whose ``forward`` takes
positional tensors: a transformer block ``(x)``, a conditional block ``(x, cond)``, a graph block
``(x, edge_attr)``). While gradients are recorded (``torch.is_grad_enabled()``) the block runs
under :func:`torch.utils.checkpoint.checkpoint` (non-reentrant): its inner activations are freed
after forward and recomputed, communication included, in backward. Under ``torch.no_grad()``
(validation, inference) it is a plain call. This is the only checkpointing guard of the processors.

Two modes (``model.activation_checkpointing``: ``true`` is ``"full"``, ``"selective"``):

- ``"full"``: only the block's inputs stay; backward recomputes the whole block.
- ``"selective"``: the outputs of the block's attention operators stay too (the attention output and
  its softmax statistics: :mod:`stormshard.kernels.attention_ops`, through torch's selective
  checkpointing); backward recomputes the norms, products and activations and runs no attention
  forward again. Per transformer layer this keeps one more ``(tokens, channels)`` tensor (and
  ``(heads, tokens)`` statistics) and saves the attention forward of the recompute: at the AIFS size
  16 x 85 MB (bf16 output, fp32 statistics) for 5.8 TFLOP of window attention per step. The sharded blocks recompute
  their communication in both modes. A block without an attention operator (a GNN block)
  recomputes everything, as in ``"full"``.

  Eager calls: the first is watched by torch's dispatch modes (Python on every operator); when it shows
  that the block's only attention operators are stormshard's kernels (banded, CSR, Triton graph), the
  later calls let those kernels keep and replay their own outputs (:mod:`stormshard.kernels.kept_outputs`)
  and run every other operator unwatched. Compiled calls use torch's modes inside the graph.

The wrapper adopts the block's parameters, buffers and children instead of holding the block as
a child, so parameter and state-dict names do not change: ``processor.blocks.0.attention.lin_qkv.weight``
stays that name whether or not block 0 is wrapped (checkpoints, resharding and conversion rely on
these names). The block itself stays reachable as ``.block``, and its plain attributes read
through the wrapper. Nothing is communicated here.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any, Literal, get_args

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from stormshard.kernels.attention_ops import (
    STORMSHARD_ATTENTION_OPERATORS,
    keeps_outputs,
    operator_name,
    registry_generation,
)
from stormshard.kernels.kept_outputs import keeping_outputs

__all__ = ["ActivationCheckpoint", "CheckpointMode", "CHECKPOINT_MODES", "checkpoint_blocks", "checkpoint_mode",
           "keep_attention_outputs", "unwrap_block", "unwrapped_modules"]

CheckpointMode = Literal["full", "selective"]
CHECKPOINT_MODES: tuple[str, ...] = get_args(CheckpointMode)


def checkpoint_mode(setting: bool | str) -> CheckpointMode | None:
    """The mode of ``model.activation_checkpointing`` (``false`` -> None, ``true`` -> ``"full"``, ``"selective"``)."""
    if setting is False:
        return None
    if setting is True:
        return "full"
    if setting in CHECKPOINT_MODES:
        return setting  # type: ignore[return-value]
    raise ValueError(f"activation checkpointing {setting!r} is not one of false, true, 'full', 'selective'")


def keep_attention_outputs(ctx: object, op: object, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Selective checkpointing's policy: keep the attention operators' outputs, recompute every other operator."""
    return CheckpointPolicy.MUST_SAVE if keeps_outputs(op) else CheckpointPolicy.PREFER_RECOMPUTE


_SELECTIVE_CONTEXTS = functools.partial(create_selective_checkpoint_contexts, keep_attention_outputs)


class ActivationCheckpoint(nn.Module):
    """``forward(*args) -> block(*args)``, recomputed in backward when gradients are enabled.

    ``mode``: ``"full"`` (recompute the block) or ``"selective"`` (keep its attention operators'
    outputs, recompute the rest; module docstring). ``own_keeping`` (selective, eager calls): once the
    first call, watched by torch's selective checkpointing, shows that the block's only attention
    operators are stormshard's kernels, later calls let the kernels keep their outputs themselves
    (:mod:`stormshard.kernels.kept_outputs`) instead of a dispatch mode watching every operator; False:
    always torch's mode. Compiled calls always use torch's mode (inside the compiled graph it costs nothing).

    Shares the block's ``_parameters``, ``_buffers`` and ``_modules`` (the same dict objects),
    so ``state_dict()``, ``named_parameters()``, ``load_state_dict`` and ``.to()`` see exactly the
    block's tree. ``train()`` / ``eval()`` reach the block too.
    """

    def __init__(self, block: nn.Module, mode: CheckpointMode = "full", *, own_keeping: bool = True) -> None:
        if isinstance(block, ActivationCheckpoint):
            raise TypeError("block is already wrapped in ActivationCheckpoint: wrap each block once")
        if not isinstance(block, nn.Module):
            raise TypeError(f"block must be an nn.Module, got {type(block).__name__}")
        if mode not in CHECKPOINT_MODES:
            raise ValueError(f"mode must be one of {CHECKPOINT_MODES}, got {mode!r}")
        super().__init__()
        self.mode = mode
        self.own_keeping = own_keeping
        # (registry generation, whether the block's kept operators are all stormshard's), from its first eager call
        self._learned: tuple[int, bool] | None = None
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

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001, ANN202 - nn.Module's signature
        """The block's own ``_apply`` on the shared tree: ``.to(device)`` / ``.cuda()`` also move what the block
        holds besides parameters and buffers (a graph block's plan and edge chunks,
        :class:`~stormshard.layers.graph_inputs.PlanFollowsModule`), which the wrapper's would leave behind."""
        self.block._apply(fn, recurse)
        return self

    def _get_name(self) -> str:
        return f"ActivationCheckpoint[{self.block._get_name()}]"

    def extra_repr(self) -> str:
        inner = self.block.extra_repr()
        return f"mode={self.mode}" + (f", {inner}" if inner else "")

    def forward(self, *args: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.block(*args)
        if self.mode == "full":
            return checkpoint(self.block, *args, use_reentrant=False)
        if torch.compiler.is_compiling() or not self.own_keeping:
            return checkpoint(self.block, *args, use_reentrant=False, context_fn=_SELECTIVE_CONTEXTS)
        if self.keeps_own_outputs():
            return checkpoint(self.block, *args, use_reentrant=False, context_fn=keeping_outputs)
        return self._watched_call(*args)

    def keeps_own_outputs(self) -> bool:
        """Whether an eager selective call keeps the attention outputs through the kernels themselves
        (:mod:`stormshard.kernels.kept_outputs`, no dispatch mode): true once a call watched by torch's
        selective checkpointing found no attention operator in the block but stormshard's kernels, and no
        operator was registered since (:func:`~stormshard.kernels.attention_ops.register_attention_op`)."""
        return (self.own_keeping and self._learned is not None and self._learned[0] == registry_generation()
                and self._learned[1])

    def _watched_call(self, *args: Any) -> Any:
        """The block under torch's selective checkpointing, noting which kept operators it runs."""
        generation, seen = registry_generation(), set()

        def policy(ctx: Any, op: object, *op_args: Any, **op_kwargs: Any) -> CheckpointPolicy:
            decision = keep_attention_outputs(ctx, op, *op_args, **op_kwargs)
            if decision == CheckpointPolicy.MUST_SAVE and not ctx.is_recompute:
                seen.add(operator_name(op))
            return decision

        out = checkpoint(self.block, *args, use_reentrant=False,
                         context_fn=functools.partial(create_selective_checkpoint_contexts, policy))
        self._learned = (generation, seen <= STORMSHARD_ATTENTION_OPERATORS)
        return out


def checkpoint_blocks(blocks: nn.ModuleList, mode: CheckpointMode = "full") -> None:
    """Wrap every block of ``blocks`` in :class:`ActivationCheckpoint` of ``mode``, in place (names unchanged).

    Blocks that are already wrapped are left as they are, so applying it twice is harmless.
    """
    for i, block in enumerate(blocks):
        if not isinstance(block, ActivationCheckpoint):
            blocks[i] = ActivationCheckpoint(block, mode)


def unwrap_block(block: nn.Module) -> nn.Module:
    """The block inside an :class:`ActivationCheckpoint`, or ``block`` itself when it is not wrapped."""
    return block.block if isinstance(block, ActivationCheckpoint) else block


def unwrapped_modules(model: nn.Module) -> Iterator[nn.Module]:
    """``model.modules()`` with every :class:`ActivationCheckpoint` replaced by the block it wraps (the
    wrapper adopts the block's children, so ``modules()`` alone never yields a wrapped block itself)."""
    for module in model.modules():
        yield unwrap_block(module)
