"""Gradient reduction inside a model group, and gradient clipping that counts each slice once.

With model sharding every rank of a model group computes the loss on its slice of the nodes and
the loss is summed over the group with ``reduce_tensor`` (backward: identity). So:

- a *replicated* parameter (no :class:`~stormshard.parallel.partition.Partition`) receives only
  the part of its gradient that comes from this rank's slice: it must be **summed** over the
  model group;
- a *partitioned* (tensor-parallel slice) parameter's gradient is already complete.

Averaging over the data-parallel group is a separate, later step (DeepSpeed, DDP or the
compressor does it). Both sums are linear, so their order does not matter for exact all-reduce;
a compressor is not linear, so the model-group sum must come first (use the hooks then).

Two ways to do the model-group sum:

- :func:`reduce_model_parallel_gradients` after backward: one flat all-reduce per gradient dtype
  (optionally split into buckets of ``bucket_cap_mb``);
- :func:`register_model_parallel_grad_hooks`: a tensor hook per replicated parameter that sums its
  gradient during backward, before it is accumulated into ``.grad`` (works when DeepSpeed ZeRO 1/2
  or DDP reduce and partition gradients in their own hooks).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from stormshard.parallel.comm import all_reduce_sum
from stormshard.parallel.partition import get_partition
from stormshard.parallel.shapes import group_size

__all__ = [
    "replicated_parameters",
    "partitioned_parameters",
    "reduce_model_parallel_gradients",
    "register_model_parallel_grad_hooks",
    "grad_norm",
    "clip_grad_norm_",
]


def _trainable(params: Iterable[Tensor]) -> list[Tensor]:
    out = list(params)
    for p in out:
        if not isinstance(p, Tensor):
            raise TypeError(f"expected parameters (tensors), got {type(p).__name__}: pass model.parameters()")
    return [p for p in out if p.requires_grad]


def replicated_parameters(params: Iterable[Tensor]) -> list[Tensor]:
    """Trainable parameters without partition metadata (replicated over the model group)."""
    return [p for p in _trainable(params) if get_partition(p) is None]


def partitioned_parameters(params: Iterable[Tensor]) -> list[Tensor]:
    """Trainable parameters that carry a :class:`Partition` (one slice per model-group rank)."""
    return [p for p in _trainable(params) if get_partition(p) is not None]


def reduce_model_parallel_gradients(
    params: Iterable[Tensor], model_group: object | None, bucket_cap_mb: float | None = None
) -> None:
    """Sum the gradients of the replicated ``params`` over ``model_group``, in place.

    The gradients are flattened into one buffer per dtype and device (split into buckets of at
    most ``bucket_cap_mb`` MiB when given) and all-reduced. A replicated parameter whose ``.grad``
    is None on this rank contributes zeros and receives the sum (every rank of the group must
    send the same buffers). No-op for a 1-rank group.

    Communicates: all-reduce (sum) of every replicated gradient over the model group.
    """
    if bucket_cap_mb is not None and not bucket_cap_mb > 0:
        raise ValueError(f"bucket_cap_mb must be > 0 or None (one bucket), got {bucket_cap_mb}")
    replicated = replicated_parameters(params)
    if group_size(model_group) == 1 or not replicated:
        return
    for p in replicated:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    by_kind: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for p in replicated:
        by_kind.setdefault((p.grad.dtype, p.grad.device), []).append(p)
    for (dtype, _), members in by_kind.items():
        itemsize = torch.empty((), dtype=dtype).element_size()
        cap = None if bucket_cap_mb is None else max(1, int(bucket_cap_mb * 2**20) // itemsize)
        for bucket in _buckets(members, cap):
            flat = torch.cat([p.grad.reshape(-1) for p in bucket])
            total = all_reduce_sum(flat, model_group)
            offset = 0
            for p in bucket:
                n = p.grad.numel()
                p.grad.copy_(total[offset : offset + n].view_as(p.grad))
                offset += n


def _buckets(params: list[Tensor], cap_numel: int | None) -> list[list[Tensor]]:
    if cap_numel is None:
        return [params]
    out: list[list[Tensor]] = [[]]
    size = 0
    for p in params:
        if out[-1] and size + p.numel() > cap_numel:
            out.append([])
            size = 0
        out[-1].append(p)
        size += p.numel()
    return out


def register_model_parallel_grad_hooks(model: nn.Module, model_group: object | None) -> list[RemovableHandle]:
    """Register, on every replicated trainable parameter of ``model``, a hook that sums its
    gradient over ``model_group`` before it is accumulated into ``.grad``.

    Returns the handles (``handle.remove()`` undoes it); none for a 1-rank group. The hooks fire
    in autograd order, which is the same on every rank of a model group (same graph).

    Communicates: one all-reduce (sum) per replicated parameter per backward.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if group_size(model_group) == 1:
        return []

    def hook(grad: Tensor) -> Tensor:
        return all_reduce_sum(grad, model_group)

    return [p.register_hook(hook) for p in replicated_parameters(model.parameters())]


def grad_norm(params: Iterable[Tensor], model_group: object | None) -> Tensor:
    """Euclidean norm of the full model's gradient: partitioned gradients' squares are summed over
    the model group, replicated ones counted once. Returns a float32 (float64 for float64 gradients) scalar, the same on every rank.

    Communicates: one all-reduce of a scalar over the model group (when it has several ranks).
    """
    params = [p for p in _trainable(params) if p.grad is not None]
    if not params:
        return torch.zeros(())
    first = params[0].grad
    acc = torch.float64 if any(p.grad.dtype == torch.float64 for p in params) else torch.float32
    local = first.new_zeros((), dtype=acc)
    replicated = first.new_zeros((), dtype=acc)
    for p in params:
        sq = p.grad.detach().to(acc).pow(2).sum()
        if get_partition(p) is None:
            replicated = replicated + sq
        else:
            local = local + sq
    if group_size(model_group) > 1:
        local = all_reduce_sum(local, model_group)
    return (local + replicated).sqrt()


def clip_grad_norm_(params: Iterable[Tensor], max_norm: float, model_group: object | None) -> Tensor:
    """Scale all gradients by ``max_norm / (norm + 1e-6)`` when the full model's norm exceeds
    ``max_norm`` (torch's rule); returns the norm before clipping. See :func:`grad_norm`."""
    if not max_norm > 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm}")
    params = [p for p in _trainable(params) if p.grad is not None]
    norm = grad_norm(params, model_group)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in params:
        p.grad.detach().mul_(coef.to(p.grad.dtype))
    return norm
