"""DeepSpeed's per-step gradient norms, clipping and non-finite checks, as multi-tensor operations.

At every optimizer step DeepSpeed 0.19 walks the gradients one tensor at a time:

- ZeRO 1/2 (``DeepSpeedZeroOptimizer``, not offloaded), for the clipping norm
  (``get_grad_norm_direct``): a float64 copy of every gradient (``g.to(torch.double)``) and a norm of it,
  one pair of kernels per tensor;
- ZeRO 1/2 in bf16, the non-finite check (``has_overflow_partitioned_grads_serial``): ``amax``, ``amin``
  and two ``isfinite`` per gradient (about ten kernels each, as ``isfinite`` decomposes into four);
- ZeRO 0 in fp32 (the engine's ``clip_fp32_gradients``, DeepSpeed's ``clip_grad_norm_``): a norm per
  gradient, then a multiplication per gradient by the clipping coefficient.

On a GPU that is one to two thousand small launches per step of an AIFS-class model (about 250
gradient tensors) and, at ZeRO 1/2, a float64 copy of every gradient (the "dtype copies" of the
profile); on a CPU the same loops are about 900 operator calls of a 74-tensor model.
:func:`install_multi_tensor_steps` replaces these methods on one engine and its optimizer instance
with the same computations done per (device, dtype) group by torch's multi-tensor kernels
(:func:`stormshard.parallel.grads.multi_tensor_norms`, which the torch engines' clipping uses too):

- the norms: ``torch._foreach_norm`` (ZeRO 1/2: ``dtype=float64``, each norm accumulated in float64 from
  the gradient as it is, no float64 copy; ZeRO 0: float32, as ``.float().norm()``), then DeepSpeed's own
  reduction of the per-tensor norms (stack, square, sum, the all-reduces over its model-parallel and
  data-parallel groups, the square root, at ZeRO 1/2 the ``-1`` sentinel for a non-finite norm); the
  same tensors count (DeepSpeed's filters for zero padding, pipeline-replicated and model-parallel
  parameters are kept);
- the clipping at ZeRO 0: ``torch._foreach_mul_`` by DeepSpeed's coefficient ``min(1, max_norm / (norm +
  1e-6))``, a device tensor (no host sync);
- the non-finite check: the L1 norm of every gradient (``_foreach_norm(grads, 1)``: a NaN anywhere makes
  it NaN and an infinity infinite, by IEEE arithmetic alone), one ``isfinite`` over their stack; where a
  group's gradients are views of one flat partition (DeepSpeed's compact buffers) that partition's one norm
  (its zero padding adds nothing).

The answers are DeepSpeed's: the same norms and clipped gradients up to the order of summation (equal to
the bit on a CPU, where torch's multi-tensor kernels run the per-tensor ones), the same overflow flag.
Nothing else in DeepSpeed changes; an engine or optimizer without these methods (another DeepSpeed,
offloading) is left alone. Communicates what DeepSpeed does (its all-reduces of one scalar per group).
"""

from __future__ import annotations

import types
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from stormshard.parallel.grads import multi_tensor_norms

__all__ = ["install_multi_tensor_steps", "any_non_finite", "clip_grad_norm_like_deepspeed"]

#: the DeepSpeedZeroOptimizer methods replaced
_METHODS = ("get_grad_norm_direct", "has_overflow_partitioned_grads_serial")


def any_non_finite(tensors: Iterable[Tensor], device: torch.device | str) -> Tensor:
    """A ``(1,)`` bool tensor on ``device``: whether any element of ``tensors`` is NaN or infinite (no host sync).
    Each tensor's L1 norm is NaN or infinite exactly when it holds such an element (or its finite values sum
    past the float range, far beyond any gradient)."""
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return torch.zeros(1, dtype=torch.bool, device=device)
    norms = [n.to(device=device, dtype=torch.float32) for n in multi_tensor_norms(tensors, 1.0)]
    return torch.isfinite(torch.stack(norms)).logical_not().any().reshape(1)


def _grad_norm_direct(self: Any, gradients: list[Tensor], params: list[Tensor], norm_type: float = 2) -> Tensor:
    """``DeepSpeedZeroOptimizer.get_grad_norm_direct`` for the 2-norm with multi-tensor norms (module docstring);
    another norm goes to DeepSpeed's own method."""
    if float(norm_type) != 2.0:
        return type(self).get_grad_norm_direct(self, gradients, params, norm_type)
    from deepspeed import comm as dist
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.constants import PIPE_REPLICATED
    from deepspeed.runtime.utils import is_model_parallel_parameter, mask_nan_or_inf_with_val_inplace
    from deepspeed.runtime.zero.utils import get_norm_dtype

    counted = []
    # DeepSpeed's pairing, kept as it is: gradients without zero padding, zipped with the parameters
    for g, p in zip((g for g in gradients if not getattr(g, "_zero_padding", False)), params):  # noqa: B905
        if hasattr(p, PIPE_REPLICATED) and p.ds_pipe_replicated:
            continue
        if is_model_parallel_parameter(p) or self.model_parallel_rank == 0:
            counted.append(g.detach())
    device = get_accelerator().current_device_name()
    if counted:
        norms = [n.to(device) for n in multi_tensor_norms(counted, 2.0, dtype=get_norm_dtype())]
        total = torch.stack(norms).pow(2.0).sum().float()
    else:
        total = torch.tensor(0.0, dtype=torch.float32).to(self.device)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.dp_process_group)
    self._model_parallel_all_reduce(tensor=total, op=dist.ReduceOp.SUM)
    total = total.pow(1.0 / 2.0)
    mask_nan_or_inf_with_val_inplace(total, device=self.device)
    return total


def _has_overflow_partitioned(self: Any) -> Tensor:
    """``DeepSpeedZeroOptimizer.has_overflow_partitioned_grads_serial`` by :func:`any_non_finite`: a ``(1,)``
    bool tensor on the accelerator, over the averaged gradients of every parameter group."""
    from deepspeed.accelerator import get_accelerator

    grads: list[Tensor] = []
    for i in range(len(self.bit16_groups)):
        group = self.averaged_gradients.get(i)
        flat = getattr(group, "flat_partition", None)  # the group's gradients are views of one flat partition
        grads += [flat] if isinstance(flat, Tensor) else [g for g in (group or []) if g is not None]
    return any_non_finite(grads, get_accelerator().current_device_name())


def clip_grad_norm_like_deepspeed(parameters: Iterable[Tensor], max_norm: float, mpu: Any = None) -> Tensor:
    """DeepSpeed's ``runtime.utils.clip_grad_norm_`` for the 2-norm with multi-tensor norms and one
    ``_foreach_mul_`` (module docstring): the total norm over the model-parallel group, averaged over the
    data-parallel group, and every gradient scaled by ``min(1, max_norm / (norm + 1e-6))``. Returns the norm."""
    from deepspeed import comm as dist
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.utils import is_model_parallel_parameter
    from deepspeed.utils import groups

    parameters = [p for p in parameters if p.grad is not None]
    counted = [p.grad.detach() for p in parameters
               if mpu is None or mpu.get_model_parallel_rank() == 0 or is_model_parallel_parameter(p)]
    device = get_accelerator().current_device_name()
    if counted:
        norms = multi_tensor_norms(counted, 2.0, dtype=torch.float32)
        total = torch.stack([n.to(device) for n in norms]).pow(2.0).sum().float()
    else:
        total = get_accelerator().FloatTensor([0.0])
    total = total.to(device)
    if mpu is not None:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=mpu.get_model_parallel_group())
    total = total.pow(1.0 / 2.0)
    data_parallel = groups._get_data_parallel_group()
    total = total * 1.0 / float(dist.get_world_size(group=data_parallel))
    dist.all_reduce(total, group=data_parallel)
    total = total.to(parameters[0].device)
    coef = torch.min(torch.tensor([1.0], device=total.device),
                     torch.tensor([float(max_norm)], device=total.device) / (total + 1e-6))
    grads: dict[tuple[torch.device, torch.dtype], list[Tensor]] = defaultdict(list)
    for p in parameters:
        grads[(p.grad.device, p.grad.dtype)].append(p.grad.data)
    for group in grads.values():
        torch._foreach_mul_(group, coef.to(group[0].device).reshape(()))
    return total


def _clip_fp32_gradients(self: Any) -> None:
    """``DeepSpeedEngine.clip_fp32_gradients`` by :func:`clip_grad_norm_like_deepspeed`."""
    clip_grad_norm_like_deepspeed(self.module.parameters(), self.gradient_clipping(), mpu=self.mpu)


def install_multi_tensor_steps(engine: Any) -> tuple[str, ...]:
    """Replace, on this DeepSpeed ``engine`` instance and its ZeRO 1/2 optimizer only, DeepSpeed's per-tensor
    gradient norms, clipping and non-finite check with multi-tensor ones (module docstring). Returns the
    names of the methods replaced (none for an engine or optimizer that lacks a method or field read)."""
    done: list[str] = []
    try:
        from deepspeed.runtime.engine import DeepSpeedEngine
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    except ImportError:
        return ()
    if isinstance(engine, DeepSpeedEngine) and callable(getattr(type(engine), "clip_fp32_gradients", None)) and \
            all(hasattr(engine, f) for f in ("module", "mpu", "gradient_clipping")):
        engine.clip_fp32_gradients = types.MethodType(_clip_fp32_gradients, engine)
        done.append("clip_fp32_gradients")
    optimizer = getattr(engine, "optimizer", None)
    fields = ("averaged_gradients", "bit16_groups", "model_parallel_rank", "dp_process_group", "device")
    if isinstance(optimizer, DeepSpeedZeroOptimizer) and all(hasattr(optimizer, f) for f in fields) and \
            all(callable(getattr(type(optimizer), m, None)) for m in (*_METHODS, "_model_parallel_all_reduce")) and \
            isinstance(optimizer.averaged_gradients, dict):
        optimizer.get_grad_norm_direct = types.MethodType(_grad_norm_direct, optimizer)
        optimizer.has_overflow_partitioned_grads_serial = types.MethodType(_has_overflow_partitioned, optimizer)
        done += list(_METHODS)
    return tuple(done)
