"""The model-group gradient sum inside DeepSpeed ZeRO 1/2: on the reduced gradient partition.

ZeRO 1/2 take every gradient inside backward (stage 2 in its own post-accumulation hooks, both in
the epilogue that ``engine.backward`` runs): a bucketed sum of ``.grad`` after backward comes too
late, and a per-parameter pre-hook costs one blocking all-reduce per tensor. But the data-parallel
average and the model-group sum are both linear, so their order does not matter: DeepSpeed
reduce-scatters over the data-parallel group as usual, and :class:`ZeroPartitionGradSum` then sums
the replicated parameters' elements of this rank's gradient partition (``averaged_gradients``) over
the model group in one flat all-reduce, before DeepSpeed's ``step`` computes the clipping norm.

Why the partitions line up: the ranks of one model group share their data-parallel rank, flatten
the same parameters in the same order (each rank holds the whole replicated parameters, and its
slice of each partitioned one), and so hold the same partition of the same flat layout, as long as
every parameter has the same shape on every rank of the group. Partitioned (tensor-parallel)
parameters are left out of the sum. When their slices differ in size between the ranks (an uneven
split) with more than one data-parallel rank, the partition boundaries differ too:
:func:`partition_sum_blocker` says so and the engine falls back to per-parameter hooks.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from stormshard.parallel.grads import all_reduce_flat_
from stormshard.parallel.partition import Partition, get_partition
from stormshard.parallel.shapes import group_size

__all__ = ["ZeroPartitionGradSum", "partition_sum_blocker", "even_partitions"]


def even_partitions(params: list[Tensor]) -> bool:
    """Whether every partitioned parameter among ``params`` has a slice of the same size on every rank
    of its group (``full_size`` divisible by ``parts``): then all ranks of a model group flatten the same
    shapes. No communication."""
    for p in params:
        part: Partition | None = get_partition(p)
        if part is not None and part.full_size % part.parts:
            return False
    return True


def partition_sum_blocker(optimizer: Any, params: list[Tensor], data_parallel_size: int) -> str | None:
    """Why :class:`ZeroPartitionGradSum` cannot serve ``optimizer`` (None: it can).

    It needs DeepSpeed's ZeRO 1/2 optimizer (``DeepSpeedZeroOptimizer``; DeepSpeed's ``BF16_Optimizer``,
    which stage 1 uses with ``data_types.grad_accum_dtype: fp32``, keeps its gradients elsewhere), no CPU
    offload, and partitions that line up across the model group (see the module docstring).
    """
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if not isinstance(optimizer, DeepSpeedZeroOptimizer):
        return f"the DeepSpeed optimizer is {type(optimizer).__name__}, not DeepSpeedZeroOptimizer"
    if getattr(optimizer, "cpu_offload", False):
        return "ZeRO CPU offload keeps the gradient partition in its own buffer"
    if data_parallel_size > 1 and not even_partitions(params):
        return "tensor-parallel slices of unequal size give the model-group ranks different ZeRO partitions"
    return None


class ZeroPartitionGradSum:
    """Sums the replicated parameters' part of a ZeRO 1/2 gradient partition over ``model_group``.

    Call it at the accumulation boundary, after DeepSpeed's backward (its reduce-scatter) and before
    ``engine.step()`` (``DeepSpeedEngine.backward`` does). Check :func:`partition_sum_blocker` first.

    Communicates: one all-reduce (sum) over the model group of the replicated elements of this
    rank's gradient partition (the whole partition when no parameter is partitioned), per
    parameter group.
    """

    def __init__(self, optimizer: Any, model_group: object | None) -> None:
        self.optimizer, self.model_group = optimizer, model_group
        # per parameter group: whether parameter j of params_in_partition is replicated
        self._replicated = [[get_partition(p) is None for p in group] for group in optimizer.params_in_partition]
        self._all_replicated = [all(flags) for flags in self._replicated]
        self.calls_last_step = 0

    def __call__(self) -> None:
        if group_size(self.model_group) == 1:
            return
        calls = 0
        grads = self.optimizer.averaged_gradients
        for i, flags in enumerate(self._replicated):
            pieces = grads.get(i)
            if pieces is None:
                raise RuntimeError(
                    f"DeepSpeed's gradient partition of parameter group {i} is empty: call the model-group sum "
                    "after engine.backward() at the accumulation boundary and before engine.step()"
                )
            flat = getattr(pieces, "flat_partition", None)
            if flat is not None and self._all_replicated[i]:
                calls += all_reduce_flat_([flat], self.model_group)
                continue
            # one piece per parameter in the partition, in order; padding (zeros on every rank) is marked
            # `_zero_padding`, except the unpadded layout's one trailing zero buffer
            real = [t for t in pieces if not getattr(t, "_zero_padding", False)]
            if len(real) not in (len(flags), len(flags) + 1):
                raise RuntimeError(
                    f"DeepSpeed's gradient partition of parameter group {i} has {len(real)} pieces for "
                    f"{len(flags)} parameters: this DeepSpeed version lays the partition out differently; set "
                    "model_parallel_grad_reduction='hooks'"
                )
            chosen = [t for t, keep in zip(real[: len(flags)], flags, strict=True) if keep]
            calls += all_reduce_flat_(chosen, self.model_group)
        self.calls_last_step = calls
