"""Training engines: DeepSpeed, torch DDP or local, behind one interface.

``build_engine(model, groups, settings)`` wraps ``model`` for the parallel layout of ``groups``:

- gradients of replicated parameters are **summed over the model group** (see
  :mod:`stormshard.parallel.grads`; ``model_parallel_grad_reduction`` = ``"hooks"`` during backward,
  or ``"bucketed"``: one flat all-reduce before the optimizer step);
- then **averaged over the data-parallel group** (size ``world / gpus_per_model``): by DeepSpeed
  (``mpu=groups``, ZeRO 0-2), by torch DDP (``process_group=groups.data_parallel_group``), or by the
  PowerSGD compressor (DeepSpeed ZeRO 0 with its backward all-reduce switched off, or a DDP
  communication hook);
- then clipped (the norm counts each tensor-parallel slice once), stepped with AdamW and the
  warm-up + cosine schedule of :mod:`stormshard.training.schedule`.

Every engine follows DeepSpeed's calling convention, once per micro-batch::

    loss = loss_fn(engine(batch))
    engine.backward(loss)   # scales by 1 / gradient_accumulation_steps
    engine.step()           # optimizer + scheduler step only at the accumulation boundary

``engine: "local"`` has no data parallelism (world == gpus_per_model): tests and one-process runs.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import Tensor, nn
from torch.optim.lr_scheduler import LambdaLR

from stormshard.parallel.compression import PowerSGDCompressor, PowerSGDConfig, register_powersgd_hook
from stormshard.parallel.grads import (
    clip_grad_norm_,
    partitioned_parameters,
    reduce_model_parallel_gradients,
    register_model_parallel_grad_hooks,
)
from stormshard.parallel.shapes import group_size
from stormshard.parallel.topology import ProcessGroups
from stormshard.training.schedule import LRScheduleSettings, build_scheduler

__all__ = [
    "EngineError",
    "AdamWSettings",
    "PowerSGDSettings",
    "EngineSettings",
    "TrainingEngine",
    "LocalEngine",
    "DDPEngine",
    "DeepSpeedEngine",
    "build_engine",
    "resolve_deepspeed_config",
]


class EngineError(ValueError):
    """Engine settings that cannot work with this model or layout; the message names the fix."""


# --------------------------------------------------------------------------------------------
# settings
# --------------------------------------------------------------------------------------------


class AdamWSettings(BaseModel):
    """AdamW hyper-parameters (the learning rate comes from the schedule). None: take the
    DeepSpeed section's ``optimizer.params`` value, else torch's default."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    betas: tuple[float, float] | None = None
    eps: float | None = Field(None, gt=0)
    weight_decay: float | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _check(self) -> AdamWSettings:
        if self.betas is not None and not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"optimizer.betas must lie in [0, 1), got {self.betas}: use e.g. [0.9, 0.95]")
        return self


_TORCH_ADAMW_DEFAULTS: dict[str, Any] = {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}


class PowerSGDSettings(BaseModel):
    """PowerSGD gradient compression over the data-parallel group (see
    :class:`stormshard.parallel.compression.PowerSGDConfig` for each field)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["powersgd"] = "powersgd"
    rank: int = 4
    start_iter: int = 10
    min_compression_rate: float = 2.0
    min_numel: int = 4096
    warm_start: bool = True
    use_error_feedback: bool = True
    orthogonalisation_eps: float = 1e-8
    seed: int = 0
    overlap: bool = True

    @model_validator(mode="after")
    def _check(self) -> PowerSGDSettings:
        try:
            self.to_config()
        except TypeError as err:
            raise ValueError(f"compression: {err}") from err
        return self

    def to_config(self) -> PowerSGDConfig:
        return PowerSGDConfig(**self.model_dump(exclude={"type"}))


class EngineSettings(BaseModel):
    """How the model is trained in parallel. Validated on construction; layout-dependent checks run
    in :func:`build_engine` before anything is created."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    engine: Literal["deepspeed", "ddp", "local"] = "deepspeed"
    deepspeed: dict[str, Any] = Field(default_factory=dict, description="DeepSpeed config section")
    gradient_accumulation_steps: int | None = Field(None, ge=1, description="None: DeepSpeed section's, else 1")
    gradient_clipping: float | None = Field(None, ge=0, description="max gradient norm, 0 = off")
    optimizer: AdamWSettings = Field(default_factory=AdamWSettings)
    schedule: LRScheduleSettings = Field(default_factory=LRScheduleSettings)
    bucket_cap_mb: float = Field(25.0, gt=0, description="DDP bucket size; also the bucketed model-group sum")
    broadcast_buffers: bool = Field(True, description="DDP: broadcast rank 0's buffers every forward")
    compression: PowerSGDSettings | None = None
    model_parallel_grad_reduction: Literal["hooks", "bucketed"] = "hooks"

    @model_validator(mode="after")
    def _check(self) -> EngineSettings:
        ds = self.deepspeed
        stage = _zero_stage(ds)
        if stage not in (0, 1, 2):
            raise ValueError(
                f"deepspeed.zero_optimization.stage={stage!r} is not supported: use 0, 1 or 2 (ZeRO 3 "
                "partitions parameters, which clashes with model sharding)"
            )
        if "scheduler" in ds:
            raise ValueError(
                "deepspeed.scheduler is set, but stormshard owns the learning-rate schedule: remove it and "
                "set schedule.{lr, lr_min, warmup_steps, total_steps}"
            )
        if _enabled(ds.get("fp16")):
            raise ValueError("deepspeed.fp16 is not supported (no loss scaling here): use bf16.enabled=true instead")
        if self.compression is not None:
            if self.engine == "local":
                raise ValueError(
                    "compression is set but engine='local' has no data parallelism to compress: use engine "
                    "'deepspeed' or 'ddp', or set compression to null"
                )
            if self.engine == "deepspeed" and stage != 0:
                raise ValueError(
                    f"compression (PowerSGD) needs deepspeed.zero_optimization.stage=0, got {stage}: DeepSpeed "
                    "fails in engine.step() at ZeRO 1/2 once its own gradient all-reduce is off; set stage 0 "
                    "or compression null"
                )
            if self.engine == "deepspeed" and _enabled(ds.get("bf16")):
                raise ValueError(
                    "compression with deepspeed.bf16: DeepSpeed's bf16 optimizer copies gradients into its fp32 "
                    "buffers inside backward, before the compressor could reduce them; drop bf16 (fp32 + PowerSGD), "
                    "or use deepspeed.communication_data_type='bf16' instead of compression"
                )
            if self.engine == "deepspeed" and "communication_data_type" in ds:
                raise ValueError(
                    "deepspeed.communication_data_type and compression are both set: with compression DeepSpeed's "
                    "all-reduce is off, so choose one"
                )
        _resolve(ds, "gradient_accumulation_steps", self.gradient_accumulation_steps, 1)
        _resolve(ds, "gradient_clipping", self.gradient_clipping, 0.0)
        opt = ds.get("optimizer")
        if opt is not None:
            if not isinstance(opt, dict) or str(opt.get("type", "")).lower() not in ("adamw", "adam"):
                raise ValueError(
                    f"deepspeed.optimizer.type must be 'AdamW', got {opt!r}: every engine uses AdamW so that "
                    "they take the same step"
                )
            params = opt.get("params", {})
            if str(opt.get("type")).lower() == "adam" and not params.get("adam_w_mode", False):
                raise ValueError("deepspeed.optimizer.type 'Adam' without adam_w_mode=true is not AdamW: use 'AdamW'")
            if "lr" in params and not math.isclose(float(params["lr"]), self.schedule.lr, rel_tol=1e-12):
                raise ValueError(
                    f"deepspeed.optimizer.params.lr={params['lr']} differs from schedule.lr={self.schedule.lr}: the "
                    "schedule sets the learning rate; remove params.lr or make them equal"
                )
            for name in ("betas", "eps", "weight_decay"):
                _resolve(params, name, getattr(self.optimizer, name), None, prefix="deepspeed.optimizer.params.",
                         ours_prefix="optimizer.")
        return self

    # ---- resolved values (our field, else the DeepSpeed section's, else the default) --------
    @property
    def accumulation(self) -> int:
        return int(_resolve(self.deepspeed, "gradient_accumulation_steps", self.gradient_accumulation_steps, 1))

    @property
    def clipping(self) -> float:
        return float(_resolve(self.deepspeed, "gradient_clipping", self.gradient_clipping, 0.0))

    @property
    def zero_stage(self) -> int:
        return _zero_stage(self.deepspeed)

    def adamw_kwargs(self) -> dict[str, Any]:
        """lr, betas, eps, weight_decay of the AdamW every engine builds."""
        params = (self.deepspeed.get("optimizer") or {}).get("params", {})
        out: dict[str, Any] = {"lr": self.schedule.lr}
        for name, default in _TORCH_ADAMW_DEFAULTS.items():
            value = getattr(self.optimizer, name)
            out[name] = tuple(value) if name == "betas" and value is not None else value
            if out[name] is None:
                out[name] = tuple(params[name]) if name == "betas" and name in params else params.get(name, default)
        return out


def _enabled(section: Any) -> bool:
    return isinstance(section, dict) and bool(section.get("enabled", False))


def _zero_stage(ds: dict[str, Any]) -> Any:
    zero = ds.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise ValueError(f"deepspeed.zero_optimization must be a dict like {{'stage': 0}}, got {zero!r}")
    return zero.get("stage", 0)


def _resolve(section: dict[str, Any], key: str, ours: Any, default: Any, prefix: str = "deepspeed.",
             ours_prefix: str = "") -> Any:
    """Our value if set, else the section's, else ``default``; both set and different -> error."""
    theirs = section.get(key)
    if ours is not None and theirs is not None:
        same = list(ours) == list(theirs) if isinstance(ours, (tuple, list)) else ours == theirs
        if not same:
            raise ValueError(
                f"{ours_prefix}{key}={ours!r} and {prefix}{key}={theirs!r} disagree: set it in one place "
                "(or make them equal)"
            )
    if ours is not None:
        return ours
    return theirs if theirs is not None else default


# --------------------------------------------------------------------------------------------
# engines
# --------------------------------------------------------------------------------------------


class TrainingEngine(ABC):
    """One interface over DeepSpeed, DDP and local training (DeepSpeed's calling convention)."""

    module: nn.Module
    groups: ProcessGroups
    settings: EngineSettings
    compressor: PowerSGDCompressor | None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    @abstractmethod
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the (wrapped) module."""

    @abstractmethod
    def backward(self, loss: Tensor) -> None:
        """Backward of ``loss / gradient_accumulation_steps``; reductions as configured."""

    @abstractmethod
    def step(self) -> bool:
        """Count one micro-batch; at the accumulation boundary reduce, clip, step the optimizer and
        the schedule and zero the gradients. Returns whether an optimizer step was taken."""

    @abstractmethod
    def zero_grad(self) -> None: ...

    @property
    @abstractmethod
    def lr(self) -> float:
        """Learning rate the next optimizer step uses."""

    @property
    @abstractmethod
    def global_step(self) -> int:
        """Optimizer steps taken so far."""

    @property
    @abstractmethod
    def micro_steps(self) -> int:
        """Micro-batches stepped so far."""

    @property
    def accumulation(self) -> int:
        return self.settings.accumulation

    def is_accumulation_boundary(self) -> bool:
        """Whether the current micro-batch (the next one ``step()`` counts) ends an accumulation window."""
        return (self.micro_steps + 1) % self.accumulation == 0

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """This rank's model, optimizer, scheduler, compressor and counters."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def train(self, mode: bool = True) -> TrainingEngine:
        self.module.train(mode)
        return self

    def eval(self) -> TrainingEngine:
        return self.train(False)


def _check_counters(state: dict[str, Any], keys: tuple[str, ...]) -> None:
    missing = [k for k in keys if k not in state]
    if missing:
        raise KeyError(f"engine state lacks {missing}: it was not written by this engine's state_dict()")


class _TorchEngine(TrainingEngine):
    """AdamW + schedule + our clipping over a plain or DDP-wrapped module."""

    def __init__(self, module: nn.Module, wrapped: nn.Module, groups: ProcessGroups, settings: EngineSettings,
                 compressor: PowerSGDCompressor | None = None, hooks: list | None = None) -> None:
        self.module, self._wrapped, self.groups, self.settings = module, wrapped, groups, settings
        self.compressor = compressor
        self._hooks = hooks or []
        params = [p for p in module.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, **settings.adamw_kwargs())
        self.scheduler: LambdaLR = build_scheduler(self.optimizer, settings.schedule)
        self._global_step = 0
        self._micro_steps = 0

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._wrapped(*args, **kwargs)

    def backward(self, loss: Tensor) -> None:
        scale = self.accumulation
        (loss / scale if scale > 1 else loss).backward()

    def step(self) -> bool:
        boundary = self.is_accumulation_boundary()
        self._micro_steps += 1
        if not boundary:
            return False
        params = [p for p in self.module.parameters() if p.requires_grad]
        if self.settings.model_parallel_grad_reduction == "bucketed":
            reduce_model_parallel_gradients(params, self.groups.model_group, self.settings.bucket_cap_mb)
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
        _check_counters(state, ("module", "optimizer", "scheduler", "global_step", "micro_steps"))
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
    """torch DDP over the data-parallel group; optional PowerSGD communication hook."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # DDP's no_sync(), without a context manager: skip the all-reduce inside an accumulation window
        self._wrapped.require_backward_grad_sync = self.is_accumulation_boundary()
        return self._wrapped(*args, **kwargs)


class DeepSpeedEngine(TrainingEngine):
    """``deepspeed.initialize`` with ``mpu=groups``; PowerSGD (ZeRO 0) replaces its gradient all-reduce."""

    def __init__(self, module: nn.Module, groups: ProcessGroups, settings: EngineSettings, config: dict[str, Any],
                 hooks: list | None = None) -> None:
        import deepspeed

        self.groups, self.settings, self.config = groups, settings, config
        self._hooks = hooks or []
        params = [p for p in module.parameters() if p.requires_grad]
        schedule = settings.schedule
        self.ds, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=module, model_parameters=params, config=config, mpu=groups,
            lr_scheduler=lambda opt: build_scheduler(opt, schedule),
        )
        self.module = self.ds.module
        self.compressor = None
        if settings.compression is not None:
            self.ds.enable_backward_allreduce = False
            trainable = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
            self.compressor = PowerSGDCompressor(trainable, groups.data_parallel_group, settings.compression.to_config())

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.ds(*args, **kwargs)

    def backward(self, loss: Tensor) -> None:
        self.ds.backward(loss)

    def step(self) -> bool:
        boundary = self.ds.is_gradient_accumulation_boundary()
        if boundary:
            params = [p for p in self.module.parameters() if p.requires_grad]
            if self.settings.model_parallel_grad_reduction == "bucketed":
                reduce_model_parallel_gradients(params, self.groups.model_group, self.settings.bucket_cap_mb)
            if self.compressor is not None:
                self.compressor.reduce_gradients()
        self.ds.step()
        return boundary

    def zero_grad(self) -> None:
        self.ds.zero_grad()

    @property
    def lr(self) -> float:
        return float(self.scheduler.get_last_lr()[0])

    @property
    def global_step(self) -> int:
        return int(self.ds.global_steps)

    @property
    def micro_steps(self) -> int:
        return int(self.ds.micro_steps)

    def is_accumulation_boundary(self) -> bool:
        return bool(self.ds.is_gradient_accumulation_boundary())

    def _partitioned_optimizer(self) -> bool:
        """Whether DeepSpeed wrapped the optimizer (ZeRO 1/2, bf16): its state is per rank."""
        return "state_dict_list" in _arg_names(self.ds.optimizer.load_state_dict)

    def state_dict(self) -> dict[str, Any]:
        return {
            "engine": "deepspeed",
            "zero_stage": self.settings.zero_stage,
            "module": self.module.state_dict(),
            "optimizer": self.ds.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "compressor": None if self.compressor is None else self.compressor.state_dict(),
            "global_steps": int(self.ds.global_steps),
            "global_samples": int(self.ds.global_samples),
            "micro_steps": int(self.ds.micro_steps),
            "skipped_steps": int(self.ds.skipped_steps),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_counters(state, ("module", "optimizer", "scheduler", "global_steps", "micro_steps"))
        if state.get("engine") != "deepspeed" or state.get("zero_stage") != self.settings.zero_stage:
            raise ValueError(
                f"engine state was written by engine {state.get('engine')!r} at ZeRO stage "
                f"{state.get('zero_stage')!r}; this is deepspeed at ZeRO stage {self.settings.zero_stage}: "
                "resume with the settings the checkpoint was written with"
            )
        self.module.load_state_dict(state["module"])
        if self._partitioned_optimizer():
            # each rank saved its own partition; the list is indexed by data-parallel rank
            dp = group_size(self.groups.data_parallel_group)
            self.ds.optimizer.load_state_dict([state["optimizer"]] * dp, load_optimizer_states=True,
                                              load_from_fp32_weights=True)
        else:
            self.ds.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.compressor is not None:
            if state.get("compressor") is None:
                raise ValueError("this engine compresses gradients but the state holds no compressor state")
            self.compressor.load_state_dict(state["compressor"])
        self.ds.global_steps = int(state["global_steps"])
        self.ds.global_samples = int(state.get("global_samples", 0))
        self.ds.micro_steps = int(state["micro_steps"])
        self.ds.skipped_steps = int(state.get("skipped_steps", 0))


def _arg_names(fn: Callable) -> tuple[str, ...]:
    code = getattr(fn, "__code__", None)
    return code.co_varnames[: code.co_argcount] if code is not None else ()


# --------------------------------------------------------------------------------------------
# construction
# --------------------------------------------------------------------------------------------


def _on_cpu_accelerator() -> bool:
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name() == "cpu"


def resolve_deepspeed_config(settings: EngineSettings, data_parallel_size: int, on_cpu: bool) -> dict[str, Any]:
    """The DeepSpeed config handed to ``deepspeed.initialize``: the ``deepspeed`` section with the
    accumulation, clipping and AdamW settings filled in (``torch_adam`` on CPU: no JIT build)."""
    cfg = {k: (dict(v) if isinstance(v, dict) else v) for k, v in settings.deepspeed.items()}
    micro = cfg.get("train_micro_batch_size_per_gpu")
    if isinstance(micro, bool) or not isinstance(micro, int) or micro < 1:
        raise EngineError(
            f"deepspeed.train_micro_batch_size_per_gpu must be a positive integer, got {micro!r}: set it in the "
            "deepspeed section (samples per model replica per micro-step)"
        )
    cfg["gradient_accumulation_steps"] = settings.accumulation
    cfg["gradient_clipping"] = settings.clipping
    expected = micro * settings.accumulation * data_parallel_size
    if "train_batch_size" in cfg and cfg["train_batch_size"] != expected:
        raise EngineError(
            f"deepspeed.train_batch_size={cfg['train_batch_size']} but micro batch {micro} x accumulation "
            f"{settings.accumulation} x data-parallel size {data_parallel_size} = {expected}: remove it or set {expected}"
        )
    cfg["train_batch_size"] = expected
    opt = dict(cfg.get("optimizer") or {"type": "AdamW"})
    params = dict(opt.get("params", {}))
    kwargs = settings.adamw_kwargs()
    params.update(lr=kwargs["lr"], betas=list(kwargs["betas"]), eps=kwargs["eps"], weight_decay=kwargs["weight_decay"])
    if on_cpu:
        if params.get("torch_adam") is False:
            raise EngineError(
                "deepspeed.optimizer.params.torch_adam=false on the CPU accelerator would JIT-compile DeepSpeed's "
                "fused Adam: set torch_adam to true (or remove it)"
            )
        params["torch_adam"] = True
    opt["params"] = params
    cfg["optimizer"] = opt
    cfg.setdefault("zero_optimization", {"stage": 0})
    return cfg


def _disable_cpu_shm_build() -> None:
    """DeepSpeed's CPU backend JIT-compiles a shared-memory op used only by inference all-reduce;
    mark it unavailable so training starts without a C++ build (gloo does the collectives)."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


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
    sharded = layout.gpus_per_model > 1
    mode = settings.model_parallel_grad_reduction
    if settings.engine == "local" and layout.data_parallel_size > 1:
        raise EngineError(
            f"engine='local' has no data parallelism but the layout has data-parallel size "
            f"{layout.data_parallel_size} (world {layout.world_size} / gpus_per_model {layout.gpus_per_model}): "
            "use engine 'deepspeed' or 'ddp', or launch gpus_per_model processes"
        )
    if settings.engine != "local" and layout.world_size > 1 and not dist.is_initialized():
        raise EngineError(f"engine={settings.engine!r} needs torch.distributed initialised (world {layout.world_size})")
    if settings.engine == "ddp" and not dist.is_initialized():
        raise EngineError("engine='ddp' needs torch.distributed initialised: initialise a 1-rank group or use 'local'")
    if sharded and mode == "bucketed":
        if settings.engine == "deepspeed" and settings.zero_stage > 0:
            raise EngineError(
                f"model_parallel_grad_reduction='bucketed' with ZeRO stage {settings.zero_stage} and gpus_per_model "
                f"{layout.gpus_per_model}: ZeRO 1/2 reduce and partition gradients during backward, before a bucketed "
                "sum could run; use 'hooks'"
            )
        if settings.engine == "deepspeed" and _enabled(settings.deepspeed.get("bf16")):
            raise EngineError(
                f"model_parallel_grad_reduction='bucketed' with deepspeed.bf16 and gpus_per_model "
                f"{layout.gpus_per_model}: DeepSpeed's bf16 optimizer takes the gradients inside backward, before a "
                "bucketed sum could run; use 'hooks'"
            )
        if settings.compression is not None and settings.engine == "ddp":
            raise EngineError(
                "model_parallel_grad_reduction='bucketed' with compression on the ddp engine: the PowerSGD hook "
                "compresses during backward, before the model-group sum (compression is not linear); use 'hooks'"
            )
    for p in partitioned_parameters(model.parameters()):
        p.tensor_model_parallel = True

    hooks = register_model_parallel_grad_hooks(model, groups.model_group) if sharded and mode == "hooks" else []
    if settings.engine == "local":
        return LocalEngine(model, model, groups, settings, hooks=hooks)
    if settings.engine == "ddp":
        device = next(model.parameters()).device
        # torch >= 2.13 names the per-forward buffer broadcast `forward_sync_buffers` (buffers are
        # still synchronised once at construction, which changes nothing for identical replicas)
        buffers_kw = ("forward_sync_buffers" if "forward_sync_buffers" in _arg_names(
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
            compressor = register_powersgd_hook(ddp, settings.compression.to_config(), groups.data_parallel_group).compressor
        return DDPEngine(model, ddp, groups, settings, compressor=compressor, hooks=hooks)
    on_cpu = _on_cpu_accelerator()
    config = resolve_deepspeed_config(settings, layout.data_parallel_size, on_cpu)
    if on_cpu:
        _disable_cpu_shm_build()
    return DeepSpeedEngine(model, groups, settings, config, hooks=hooks)
