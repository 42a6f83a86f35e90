"""``build_engine``: check the settings against the layout, then wrap the model in its engine.

:func:`check_engine_layout` holds the rules that need the layout (no data parallelism on the local
engine, what the explicit ``model_parallel_grad_reduction='bucketed'`` cannot run with (``'auto'``, the
default, runs everywhere), ``deepspeed.train_batch_size``);
:func:`~stormshard.training.preflight.preflight` calls it before anything is created, and
:func:`build_engine` calls it for callers that build an engine directly.

What each engine communicates per optimizer step (see :mod:`stormshard.training.engine`): the model
group sums the gradients of replicated parameters (by default one flat all-reduce where each engine
allows it, :mod:`.grad_sum`; or hooks during backward); the data-parallel group averages them
(DeepSpeed, DDP buckets, or PowerSGD).
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from stormshard.parallel.compression import register_powersgd_hook
from stormshard.parallel.grads import partitioned_parameters, register_model_parallel_grad_hooks
from stormshard.parallel.topology import ParallelLayout, ProcessGroups
from stormshard.training.engine.base import TrainingEngine, arg_names
from stormshard.training.engine.deepspeed_config import resolve_deepspeed_config
from stormshard.training.engine.deepspeed_engine import (
    DeepSpeedEngine,
    disable_cpu_shm_build,
    on_cpu_accelerator,
)
from stormshard.training.engine.grad_sum import model_group_sum_placement
from stormshard.training.engine.settings import EngineError, EngineSettings, check_train_batch_size
from stormshard.training.engine.torch_engines import DDPEngine, LocalEngine

__all__ = ["build_engine", "check_engine_layout"]


def build_engine(model: nn.Module, groups: ProcessGroups, settings: EngineSettings) -> TrainingEngine:
    """Wrap ``model`` (already sharded for ``groups``) in the engine ``settings.engine`` selects.

    All checks run before anything is built. Partitioned parameters are marked
    ``tensor_model_parallel=True`` (DeepSpeed counts them once per slice in its gradient norm).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(groups, ProcessGroups):
        raise TypeError(f"groups must be ProcessGroups (build_process_groups(layout)), got {type(groups).__name__}")
    if not isinstance(settings, EngineSettings):
        raise TypeError(f"settings must be EngineSettings, got {type(settings).__name__}")
    layout = groups.layout
    if not any(p.requires_grad for p in model.parameters()):
        raise EngineError("the model has no trainable parameter: nothing to train")
    check_engine_layout(settings, layout)
    if settings.engine != "local" and layout.world_size > 1 and not dist.is_initialized():
        raise EngineError(f"engine={settings.engine!r} needs torch.distributed initialised (world {layout.world_size})")
    if settings.engine == "ddp" and not dist.is_initialized():
        raise EngineError("engine='ddp' needs torch.distributed initialised: initialise a 1-rank group or use 'local'")
    placement = model_group_sum_placement(settings, layout)  # where replicated gradients are summed
    for p in partitioned_parameters(model.parameters()):
        p.tensor_model_parallel = True

    hooks = register_model_parallel_grad_hooks(model, groups.model_group) if placement == "hooks" else []
    if settings.engine == "local":
        return LocalEngine(model, model, groups, settings, hooks=hooks)
    if settings.engine == "ddp" and layout.data_parallel_size == 1 and settings.compression is None:
        # one replica: DDP would only copy every gradient into its buckets and back around an all-reduce
        # over one rank (an exact no-op), so the module runs unwrapped; the same steps, bit for bit
        return DDPEngine(model, model, groups, settings, hooks=hooks)
    if settings.engine == "ddp":
        device = next(model.parameters()).device
        # torch >= 2.13 names the per-forward buffer broadcast `forward_sync_buffers` (buffers are
        # still synchronised once at construction, which changes nothing for identical replicas)
        buffers_kw = ("forward_sync_buffers" if "forward_sync_buffers" in arg_names(
            nn.parallel.DistributedDataParallel.__init__) else "broadcast_buffers")
        ddp = nn.parallel.DistributedDataParallel(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            process_group=groups.data_parallel_group if groups.data_parallel_group is not None else dist.group.WORLD,
            bucket_cap_mb=settings.bucket_cap_mb,
            **{buffers_kw: settings.broadcast_buffers},
        )
        compressor = None
        if settings.compression is not None:
            compressor = register_powersgd_hook(
                ddp, settings.compression, groups.data_parallel_group,
                model_group=groups.model_group if placement == "compression_hook" else None).compressor
        return DDPEngine(model, ddp, groups, settings, compressor=compressor, hooks=hooks)
    config = resolve_deepspeed_config(settings, layout.data_parallel_size)
    if on_cpu_accelerator():
        disable_cpu_shm_build()
    return DeepSpeedEngine(model, groups, settings, config, hooks=hooks)


def check_engine_layout(settings: EngineSettings, layout: ParallelLayout) -> None:
    """The engine settings against the layout (no process group needed); raises :class:`EngineError`
    naming the fields and the fix."""
    if settings.engine == "local" and layout.data_parallel_size > 1:
        raise EngineError(
            f"engine='local' has no data parallelism but world {layout.world_size} / gpus_per_model "
            f"{layout.gpus_per_model} gives data-parallel size {layout.data_parallel_size}: use engine 'deepspeed' "
            f"or 'ddp', or launch {layout.gpus_per_model} processes"
        )
    if layout.gpus_per_model > 1 and settings.model_parallel_grad_reduction == "bucketed":
        if settings.engine == "deepspeed" and settings.zero_stage > 0:
            raise EngineError(
                f"model_parallel_grad_reduction='bucketed' with ZeRO stage {settings.zero_stage} and gpus_per_model "
                f"{layout.gpus_per_model}: ZeRO 1/2 reduce and partition gradients during backward, before a bucketed "
                "sum could run; use 'auto' (the default: it sums where the engine allows)"
            )
        if settings.engine == "deepspeed" and settings.bf16:
            raise EngineError(
                f"model_parallel_grad_reduction='bucketed' with precision='bf16' on engine 'deepspeed' and "
                f"gpus_per_model {layout.gpus_per_model}: DeepSpeed's bf16 optimizer takes the gradients inside "
                "backward, before a bucketed sum could run; use 'auto' (the default: it sums where the engine allows)"
            )
        if settings.compression is not None and settings.engine == "ddp":
            raise EngineError(
                "model_parallel_grad_reduction='bucketed' with compression on the ddp engine: the PowerSGD hook "
                "compresses during backward, before the model-group sum (compression is not linear); use 'auto' (the default: it sums where the engine allows)"
            )
    check_train_batch_size(settings, layout.data_parallel_size)
