"""The attention kernels as the operators a dispatch mode sees: what selective checkpointing keeps.

Selective activation checkpointing (``model.activation_checkpointing: "selective"``,
:class:`stormshard.layers.checkpointing.ActivationCheckpoint` with ``mode="selective"``) keeps, for
the backward, the outputs of the attention operators named here (the attention output and its
softmax statistics) and recomputes the rest of a block: norms, products, activations. The
recompute then runs no attention forward: at the AIFS size that is the window attention's
5.8 TFLOP per step, for one ``(tokens, channels)`` output per layer.

Built in (:data:`ATTENTION_OPERATORS`):

- stormshard's kernels: ``stormshard::banded_window_attention`` (the banded window kernel),
  ``stormshard::fused_graph_attention`` (the CSR graph kernel), ``stormshard::triton_graph_attention``
  (the Triton graph kernel);
- torch's flex attention, the higher-order operator ``flex_attention`` (inside compiled blocks:
  ``training.compile``, the CUDA default; an eager flex call is a compiled function the mode cannot
  see, and is recomputed);
- torch's fused attention kernels behind ``scaled_dot_product_attention`` (flash, efficient, cuDNN,
  the CPU flash kernel) and flash-attn's forward (``flash_attn::_flash_attn_forward``, flash-attn >=
  2.6 registers it), for blocks of a user's own architecture.

:func:`register_attention_op` adds a user's operator (a ``torch.library`` custom op, or any operator
with a schema). Operators are matched by their schema name, so every overload counts, and a name
may be registered before its library is loaded.

Eager calls of stormshard's kernels skip torch.library's dispatch (an autograd Function: less
Python per call). While selective checkpointing records or replays a block
(:func:`selective_checkpoint_watching`), :func:`use_registered_op` tells them to call their
registered op instead, so that the checkpoint sees one operator and can keep its outputs.

Nothing is communicated here.
"""

from __future__ import annotations

import torch

__all__ = ["ATTENTION_OPERATORS", "STORMSHARD_ATTENTION_OPERATORS", "keeps_outputs", "operator_name",
           "register_attention_op", "registered_attention_ops", "registry_generation", "selective_checkpoint_watching",
           "use_registered_op"]

#: stormshard's own kernels: their eager calls also keep their outputs without a dispatch mode
#: (:mod:`stormshard.kernels.kept_outputs`)
STORMSHARD_ATTENTION_OPERATORS: frozenset[str] = frozenset({
    "stormshard::banded_window_attention",
    "stormshard::fused_graph_attention",
    "stormshard::triton_graph_attention",
})

#: the schema names (and, for torch's higher-order operators, the names) of the built-in attention operators
ATTENTION_OPERATORS: frozenset[str] = STORMSHARD_ATTENTION_OPERATORS | frozenset({
    "flex_attention",
    "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "flash_attn::_flash_attn_forward",
    "flash_attn::_flash_attn_varlen_forward",
})

_REGISTERED: set[str] = set()
_GENERATION = [0]  # how many registrations have changed the set

try:  # the two modes of torch's selective checkpointing (torch >= 2.4): recording, then replaying
    from torch.utils.checkpoint import _CachedTorchDispatchMode, _CachingTorchDispatchMode

    _SELECTIVE_MODES: tuple[type, ...] = (_CachingTorchDispatchMode, _CachedTorchDispatchMode)
except ImportError:  # pragma: no cover - an older torch: eager calls keep their autograd Function
    _SELECTIVE_MODES = ()


def operator_name(op: object) -> str | None:
    """``op``'s schema name (``"ns::name"``, any overload), a higher-order operator's name, or None."""
    if isinstance(op, torch._ops.OpOverload):
        return op._schema.name
    if isinstance(op, torch._ops.OpOverloadPacket):
        return op._qualified_op_name
    if isinstance(op, torch._ops.HigherOrderOperator):
        return op.name()
    qualname = getattr(op, "_qualname", None)  # the object torch.library.custom_op returns
    return qualname if isinstance(qualname, str) and "::" in qualname else None


def register_attention_op(op: object) -> str:
    """Keep ``op``'s outputs under selective checkpointing too; returns the name it is matched by.

    ``op``: a torch operator (``torch.ops.ns.name``, any overload, or the object ``torch.library.custom_op``
    returns), or its schema name ``"ns::name"``. Raise TypeError for anything else."""
    name = op if isinstance(op, str) else operator_name(op)
    if not name or (isinstance(op, str) and "::" not in op):
        raise TypeError(f"register_attention_op needs a torch operator (torch.ops.<namespace>.<name>, or a "
                        f"torch.library.custom_op) or its schema name 'namespace::name', got {op!r}")
    if name not in _REGISTERED:
        _REGISTERED.add(name)
        _GENERATION[0] += 1
    return name


def registered_attention_ops() -> frozenset[str]:
    """The names selective checkpointing keeps: the built-in ones and those registered."""
    return ATTENTION_OPERATORS | frozenset(_REGISTERED)


def registry_generation() -> int:
    """A number that changes whenever :func:`register_attention_op` adds a name (what a block learned about its
    operators is stale then)."""
    return _GENERATION[0]


def keeps_outputs(op: object) -> bool:
    """Whether selective checkpointing keeps ``op``'s outputs (an attention operator, built in or registered)."""
    name = operator_name(op)
    return name is not None and (name in ATTENTION_OPERATORS or name in _REGISTERED)


def selective_checkpoint_watching() -> bool:
    """Whether torch's selective checkpointing is recording or replaying the code running now."""
    if not _SELECTIVE_MODES or torch._C._len_torch_dispatch_stack() == 0:
        return False
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return any(isinstance(mode, _SELECTIVE_MODES) for mode in _get_current_dispatch_mode_stack())


def use_registered_op() -> bool:
    """Whether a kernel call should go through its registered torch.library op: inside torch.compile (an
    opaque op in the graph) and while selective checkpointing watches (one operator whose outputs it keeps);
    otherwise eager calls take the same functions as an autograd Function."""
    return torch.compiler.is_compiling() or selective_checkpoint_watching()
