"""Gradient reduction inside a model group, and gradient clipping that counts each slice once.

With model sharding every rank of a model group computes the loss on its slice of the nodes and
the loss is summed over the group with ``reduce_tensor`` (backward: identity). So:

- a *replicated* parameter (no :class:`~stormshard.parallel.partition.Partition`) receives only
  the part of its gradient that comes from this rank's slice: it must be **summed** over the
  model group;
- a *partitioned* (tensor-parallel slice) parameter's gradient is already complete.

Averaging over the data-parallel group is a separate step (DeepSpeed, DDP or the compressor does
it). Both sums are linear, so their order does not matter for exact all-reduce; a compressor is not
linear, so the model-group sum must come first.

The tools (where each engine uses which: :mod:`stormshard.training.engine.grad_sum`):

- :func:`all_reduce_flat_`: sum a list of tensors over a group with one flat all-reduce per dtype
  (optionally in buckets of ``bucket_cap_mb``);
- :func:`reduce_model_parallel_gradients`: that, on the replicated parameters' ``.grad`` after backward;
- :func:`register_model_parallel_grad_hooks`: a tensor hook per replicated parameter that sums its
  gradient during backward, before it is accumulated into ``.grad`` (one blocking all-reduce per
  parameter: the slow fallback that works inside any engine's own hooks).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from stormshard.parallel.comm import all_reduce_, all_reduce_sum
from stormshard.parallel.partition import get_partition
from stormshard.parallel.shapes import group_size

__all__ = [
    "replicated_parameters",
    "partitioned_parameters",
    "reduce_model_parallel_gradients",
    "all_reduce_flat_",
    "register_model_parallel_grad_hooks",
    "grad_norm",
    "clip_grad_norm_",
    "multi_tensor_norms",
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
    all_reduce_flat_([p.grad for p in replicated], model_group, bucket_cap_mb)


def all_reduce_flat_(tensors: Sequence[Tensor], group: object | None, bucket_cap_mb: float | None = None) -> int:
    """Sum ``tensors`` over ``group`` in place with as few all-reduces as possible: they are packed into
    one flat buffer per dtype and device (split into buckets of at most ``bucket_cap_mb`` MiB when
    given), all-reduced, and copied back. Every rank of the group must pass tensors of the same
    shapes in the same order. Returns the number of all-reduce calls (0 for a 1-rank group).

    Communicates: one all-reduce (sum) per bucket over ``group``.
    """
    if bucket_cap_mb is not None and not bucket_cap_mb > 0:
        raise ValueError(f"bucket_cap_mb must be > 0 or None (one bucket), got {bucket_cap_mb}")
    if group_size(group) == 1 or not tensors:
        return 0
    by_kind: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    calls = 0
    for (dtype, _), members in by_kind.items():
        itemsize = torch.empty((), dtype=dtype).element_size()
        cap = None if bucket_cap_mb is None else max(1, int(bucket_cap_mb * 2**20) // itemsize)
        for bucket in _buckets(members, cap):
            if len(bucket) == 1 and bucket[0].is_contiguous():
                all_reduce_(bucket[0], group)  # in place, no copy
            else:
                flat = torch.cat([t.reshape(-1) for t in bucket])
                all_reduce_(flat, group)
                parts = flat.split([t.numel() for t in bucket])
                torch._foreach_copy_(bucket, [part.view(t.shape) for part, t in zip(parts, bucket, strict=True)])
            calls += 1
    return calls


def _buckets(tensors: list[Tensor], cap_numel: int | None) -> list[list[Tensor]]:
    if cap_numel is None:
        return [tensors]
    out: list[list[Tensor]] = [[]]
    size = 0
    for t in tensors:
        if out[-1] and size + t.numel() > cap_numel:
            out.append([])
            size = 0
        out[-1].append(t)
        size += t.numel()
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


def grad_norm(params: Iterable[Tensor], model_group: object | None, multi_tensor: bool | None = None) -> Tensor:
    """Euclidean norm of the full model's gradient: partitioned gradients' squares are summed over
    the model group, replicated ones counted once. Returns a float32 (float64 for float64 gradients) scalar, the same on every rank.

    ``multi_tensor`` (None: where the gradients are not on a CPU): the squares by multi-tensor norm
    kernels and the two sums by one ``stack`` and ``sum`` each, a handful of kernel launches per step
    instead of two per parameter (the GPU's host time); the same norm up to fp32 rounding. On a CPU
    each square is summed in parameter order (the pinned CPU loss curves hold its bits).

    Communicates: one all-reduce of a scalar over the model group (when it has several ranks).
    """
    params = [p for p in _trainable(params) if p.grad is not None]
    if not params:
        return torch.zeros(())
    first = params[0].grad
    acc = torch.float64 if any(p.grad.dtype == torch.float64 for p in params) else torch.float32
    if multi_tensor is None:
        multi_tensor = all(p.grad.device.type != "cpu" for p in params)
    grads = [p.grad.detach() for p in params]
    squares = _multi_tensor_squares(grads, acc) if multi_tensor else _squared_sums(grads, acc)
    kinds = [get_partition(p) is None for p in params]
    if multi_tensor:
        local, replicated = (torch.stack([sq for sq, rep in zip(squares, kinds, strict=True) if rep is want]).sum()
                             if want in kinds else first.new_zeros((), dtype=acc) for want in (False, True))
    else:
        local = first.new_zeros((), dtype=acc)
        replicated = first.new_zeros((), dtype=acc)
        for sq, rep in zip(squares, kinds, strict=True):
            if rep:
                replicated = replicated + sq
            else:
                local = local + sq
    if group_size(model_group) > 1:
        local = all_reduce_sum(local, model_group)
    return (local + replicated).sqrt()


def multi_tensor_norms(tensors: Sequence[Tensor], ord: float, dtype: torch.dtype | None = None) -> list[Tensor]:
    """The ``ord``-norm of each tensor (0-dim, in ``dtype``, else the tensor's dtype), in order: one
    ``torch._foreach_norm`` per (device, dtype) group (a multi-tensor kernel per chunk on a GPU; accumulated
    in ``dtype``, no copy of a tensor). On a CPU torch runs the per-tensor norm: the same bits."""
    out: list[Tensor | None] = [None] * len(tensors)
    kinds: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        kinds.setdefault((t.device, t.dtype), []).append(i)
    for index in kinds.values():
        for i, norm in zip(index, torch._foreach_norm([tensors[i] for i in index], ord, dtype=dtype), strict=True):
            out[i] = norm
    return out  # type: ignore[return-value]


def _multi_tensor_squares(grads: list[Tensor], acc: torch.dtype) -> list[Tensor]:
    """``|g|^2`` in ``acc`` of every gradient, in order (:func:`multi_tensor_norms`, squared by one
    ``_foreach_mul``)."""
    norms = multi_tensor_norms(grads, 2.0, dtype=acc)
    return list(torch._foreach_mul(norms, norms))


def clip_grad_norm_(params: Iterable[Tensor], max_norm: float, model_group: object | None) -> Tensor:
    """Scale all gradients by ``max_norm / (norm + 1e-6)`` when the full model's norm exceeds
    ``max_norm`` (torch's rule); returns the norm before clipping. See :func:`grad_norm`."""
    if not max_norm > 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm}")
    params = [p for p in _trainable(params) if p.grad is not None]
    norm = grad_norm(params, model_group)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    by_kind: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for p in params:
        by_kind.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad.detach())
    for (dtype, device), grads in by_kind.items():
        torch._foreach_mul_(grads, coef.to(device=device, dtype=dtype))  # one kernel launch per kind
    return norm


# the squares of at most this many gradient elements exist at once in _squared_sums (64 MiB in fp32)
_SQUARES_CHUNK_NUMEL = 1 << 24


def _squared_sums(grads: list[Tensor], acc: torch.dtype) -> list[Tensor]:
    """``g.to(acc).pow(2).sum()`` of every gradient, in order and with the same values: gradients
    already in ``acc`` are squared by multi-tensor kernels, a chunk at a time (2 ops per tensor
    instead of 3, and no per-tensor dispatch of the square)."""
    out: list[Tensor] = []
    chunk: list[Tensor] = []
    size = 0

    def flush() -> None:
        nonlocal size
        if chunk:
            out.extend(t.sum() for t in torch._foreach_pow(chunk, 2))
            chunk.clear()
            size = 0

    for g in grads:
        same_kind = not chunk or (g.device == chunk[0].device)
        if g.dtype != acc or not same_kind or size + g.numel() > _SQUARES_CHUNK_NUMEL:
            flush()
        if g.dtype != acc:
            out.append(g.to(acc).pow(2).sum())
            continue
        chunk.append(g)
        size += g.numel()
    flush()
    return out
