"""Where each engine sums the replicated parameters' gradients over the model group.

With model sharding every rank of a model group holds the part of a replicated parameter's gradient
that comes from its slice of the nodes; the parts are summed over the model group (see
:mod:`stormshard.parallel.grads`), partitioned (tensor-parallel) parameters are left alone, and the
data-parallel group then averages (or compresses) as usual. Both sums are linear, so with exact
all-reduce their order is free; a compressor is not linear, so the model-group sum comes first.

``model_group_sum_placement(settings, layout)`` turns ``EngineSettings.model_parallel_grad_reduction``
into a :data:`Placement`:

==================  ==============================================================================
``"none"``          ``gpus_per_model`` 1: nothing to sum
``"after_backward"`` one flat all-reduce of the replicated ``.grad`` at the end of the accumulation
                    boundary's ``backward()``, before PowerSGD, clipping and the optimizer (``local``,
                    ``ddp``, DeepSpeed ZeRO 0 with or without PowerSGD)
``"compression_hook"`` ``ddp`` with PowerSGD: one flat all-reduce inside the communication hook, once
                    DDP has handed every bucket and before the compressor runs
``"zero_partition"`` DeepSpeed ZeRO 1/2: one flat all-reduce of the replicated elements of the
                    reduced gradient partition before DeepSpeed's step (:mod:`.zero_grad_sum`); the
                    engine falls back to ``"hooks"`` where that cannot run (see
                    :func:`~stormshard.training.engine.zero_grad_sum.partition_sum_blocker`)
``"hooks"``         one blocking all-reduce per replicated parameter during backward (tensor hooks)
==================  ==============================================================================

``"auto"`` (the default) is the fast placement of each engine: ``after_backward``,
``compression_hook`` or ``zero_partition``. ``"bucketed"`` is ``after_backward`` everywhere (refused
where it cannot run: ZeRO 1/2, DeepSpeed bf16, ddp with PowerSGD), ``"hooks"`` the per-parameter
hooks; both are kept for comparison.
"""

from __future__ import annotations

from typing import Literal

from stormshard.parallel.topology import ParallelLayout
from stormshard.training.engine.settings import EngineSettings

__all__ = ["Placement", "model_group_sum_placement"]

Placement = Literal["none", "after_backward", "compression_hook", "zero_partition", "hooks"]


def model_group_sum_placement(settings: EngineSettings, layout: ParallelLayout) -> Placement:
    """Where the engine ``settings.engine`` sums replicated gradients over the model group at ``layout``."""
    if layout.gpus_per_model == 1:
        return "none"
    mode = settings.model_parallel_grad_reduction
    if mode == "hooks":
        return "hooks"
    if mode == "bucketed":
        return "after_backward"
    if settings.engine == "deepspeed" and settings.zero_stage > 0:
        return "zero_partition"
    if settings.engine == "ddp" and settings.compression is not None:
        return "compression_hook"
    return "after_backward"
