"""The torch engines: torch AdamW, the warm-up + cosine schedule and stormshard's clipping over a
plain module (:class:`LocalEngine`) or a torch DDP wrapper (:class:`DDPEngine`).

At the accumulation boundary ``backward()`` ends with the model-group sum of the replicated gradients
(one flat all-reduce, placement ``"after_backward"`` of :mod:`.grad_sum`: the default), and ``step()`` runs,
in order: clipping to ``gradient_clipping`` (the norm counts each tensor-parallel slice once; all-reduced over the model
group), the AdamW step, the schedule step. Data-parallel averaging happens inside backward (DDP's
buckets, or the PowerSGD communication hook, which sums over the model group before it compresses).

``precision="bf16"``: the forward runs under ``torch.autocast(bfloat16)`` over fp32 parameters (fp32
master weights, fp32 gradients, all-reduce and AdamW); its floating outputs are returned in fp32.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.optim.lr_scheduler import LambdaLR

from stormshard.parallel.compression import PowerSGDCompressor
from stormshard.parallel.grads import clip_grad_norm_, reduce_model_parallel_gradients
from stormshard.parallel.topology import ProcessGroups
from stormshard.training.engine.adamw import build_adamw
from stormshard.training.engine.base import TrainingEngine, check_state_keys
from stormshard.training.engine.grad_sum import Placement, model_group_sum_placement
from stormshard.training.engine.precision import autocast, cast_floating, compute_device_type
from stormshard.training.engine.settings import EngineSettings
from stormshard.training.schedule import build_scheduler

__all__ = ["LocalEngine", "DDPEngine"]


class _TorchEngine(TrainingEngine):
    """AdamW + schedule + our clipping over a plain or DDP-wrapped module."""

    def __init__(self, module: nn.Module, wrapped: nn.Module, groups: ProcessGroups, settings: EngineSettings,
                 compressor: PowerSGDCompressor | None = None, hooks: list | None = None) -> None:
        self.module, self._wrapped, self.groups, self.settings = module, wrapped, groups, settings
        self.compressor = compressor
        self._hooks = hooks or []
        self.grad_sum_placement: Placement = model_group_sum_placement(settings, groups.layout)
        params = [p for p in module.parameters() if p.requires_grad]
        self._params = params
        # torch's AdamW with foreach kernels, without importing torch._dynamo (.adamw): bit-identical steps
        self.optimizer = build_adamw(params, **settings.adamw_kwargs())
        self.scheduler: LambdaLR = build_scheduler(self.optimizer, settings.schedule)
        self._global_step = 0
        self._micro_steps = 0
        self._device_type = compute_device_type(module)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped module's output; under bf16 autocast with ``precision="bf16"`` (outputs in fp32)."""
        if not self.settings.bf16:
            return self._wrapped(*args, **kwargs)
        with autocast(True, self._device_type):
            out = self._wrapped(*args, **kwargs)
        return cast_floating(out, torch.float32)

    def backward(self, loss: Tensor) -> None:
        """Backward of ``loss / accumulation``; at the accumulation boundary the replicated gradients are then
        summed over the model group (placement ``"after_backward"``), so ``.grad`` is complete on return."""
        scale = self.accumulation
        (loss / scale if scale > 1 else loss).backward()
        if self.grad_sum_placement == "after_backward" and self.is_accumulation_boundary():
            reduce_model_parallel_gradients(self._params, self.groups.model_group, self.settings.bucket_cap_mb)

    def step(self) -> bool:
        boundary = self.is_accumulation_boundary()
        self._micro_steps += 1
        if not boundary:
            return False
        params = self._params
        if self.settings.clipping > 0:
            clip_grad_norm_(params, self.settings.clipping, self.groups.model_group)
        self.optimizer.step()
        self.scheduler.step()
        self.zero_grad()
        self._global_step += 1
        return True

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    @property
    def global_step(self) -> int:
        return self._global_step

    @property
    def micro_steps(self) -> int:
        return self._micro_steps

    def state_dict(self) -> dict[str, Any]:
        return {
            "engine": self.settings.engine,
            "module": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "compressor": None if self.compressor is None else self.compressor.state_dict(),
            "global_step": self._global_step,
            "micro_steps": self._micro_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_state_keys(state, ("module", "optimizer", "scheduler", "global_step", "micro_steps"))
        if state.get("engine") not in (None, self.settings.engine):
            raise ValueError(f"engine state was written by engine {state.get('engine')!r}, this is {self.settings.engine!r}")
        self.module.load_state_dict(state["module"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.compressor is not None:
            if state.get("compressor") is None:
                raise ValueError("this engine compresses gradients but the state holds no compressor state")
            self.compressor.load_state_dict(state["compressor"])
        self._global_step = int(state["global_step"])
        self._micro_steps = int(state["micro_steps"])


class LocalEngine(_TorchEngine):
    """No data parallelism: the model group is the whole world (or a single process)."""


class DDPEngine(_TorchEngine):
    """torch DDP over the data-parallel group; optional PowerSGD communication hook. With one replica
    (data-parallel size 1) and no compression :func:`~stormshard.training.engine.build.build_engine`
    hands it the bare module: nothing to average."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # DDP's no_sync(), without a context manager: skip the all-reduce inside an accumulation window
        if isinstance(self._wrapped, nn.parallel.DistributedDataParallel):
            self._wrapped.require_backward_grad_sync = self.is_accumulation_boundary()
        return super().forward(*args, **kwargs)
