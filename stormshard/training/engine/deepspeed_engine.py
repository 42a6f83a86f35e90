"""The DeepSpeed engine: ``deepspeed.initialize`` with ``mpu=groups`` (data parallelism = world /
gpus_per_model, ZeRO 0-2), the config :func:`~stormshard.training.engine.deepspeed_config.resolve_deepspeed_config`
generates, and stormshard's schedule as its ``lr_scheduler``.

With PowerSGD (ZeRO 0, fp32) DeepSpeed's backward all-reduce is switched off and
:class:`~stormshard.parallel.compression.PowerSGDCompressor` reduces the gradients over the
data-parallel group at the accumulation boundary, before DeepSpeed clips and steps.

With model sharding the replicated gradients are summed over the model group (:mod:`.grad_sum`) in one
flat all-reduce: at ZeRO 0 on ``.grad`` after backward (before PowerSGD), at ZeRO 1/2 on the reduced
gradient partition before ``step`` (:mod:`.zero_grad_sum`), or by per-parameter hooks where asked for
or where the partition sum cannot run.

``precision="bf16"``: at ZeRO 1/2 DeepSpeed's bf16 optimizer (bf16 parameters, fp32 master weights
and AdamW moments, gradient reduction in ``communication_data_type``), the model casting its fp32
inputs to its parameters' dtype; at ZeRO 0 (where DeepSpeed 0.19 keeps no fp32 master for bf16) fp32 parameters and
optimizer with the forward under bf16 autocast (hooks inside the module's call). Floating outputs come back fp32 (see :mod:`.precision`).
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from stormshard.parallel.compression import PowerSGDCompressor
from stormshard.parallel.grads import reduce_model_parallel_gradients, register_model_parallel_grad_hooks
from stormshard.parallel.shapes import group_size
from stormshard.parallel.topology import ProcessGroups
from stormshard.training.engine.adamw import FlatAdamW, LeanAdamW, build_adamw
from stormshard.training.engine.base import TrainingEngine, arg_names, check_state_keys
from stormshard.training.engine.deepspeed_config import deepspeed_bf16
from stormshard.training.engine.deepspeed_multi_tensor import install_multi_tensor_steps
from stormshard.training.engine.grad_sum import Placement, model_group_sum_placement
from stormshard.training.engine.precision import autocast_inside_forward, cast_floating, compute_device_type
from stormshard.training.engine.settings import EngineSettings
from stormshard.training.engine.zero_grad_sum import ZeroPartitionGradSum, partition_sum_blocker
from stormshard.training.schedule import build_scheduler

__all__ = ["DeepSpeedEngine", "on_cpu_accelerator", "disable_cpu_shm_build", "import_muon_without_compiling",
           "import_triton_ops_without_triton"]


class DeepSpeedEngine(TrainingEngine):
    """``deepspeed.initialize`` with ``mpu=groups``; PowerSGD (ZeRO 0) replaces its gradient all-reduce."""

    def __init__(self, module: nn.Module, groups: ProcessGroups, settings: EngineSettings, config: dict[str, Any],
                 hooks: list | None = None) -> None:
        import deepspeed

        self.groups, self.settings, self.config = groups, settings, config
        self._hooks = hooks or []
        if settings.bf16 and not deepspeed_bf16(settings):  # ZeRO 0: autocast over fp32 parameters
            autocast_inside_forward(module, compute_device_type(module))
        params = [p for p in module.parameters() if p.requires_grad]
        schedule = settings.schedule
        zero = int(config.get("zero_optimization", {}).get("stage", 0))
        adamw = settings.adamw_kwargs()
        offload = config.get("zero_optimization", {}).get("offload_optimizer") or {}
        if isinstance(offload, dict) and offload.get("device", "none") not in ("none", None):
            adamw["foreach"] = True  # DeepSpeed hands the optimizer CPU partitions: not the GPU's fused kernel
        import_muon_without_compiling()
        import_triton_ops_without_triton()
        register_zero_optimizers()
        self.ds, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=module, model_parameters=params, config=config, mpu=groups,
            # torch's AdamW (.adamw): flat buffers at ZeRO 0; at ZeRO 1/2 DeepSpeed hands it flat partitions
            optimizer=lambda ps: build_adamw(ps, flat=zero == 0, **adamw),
            lr_scheduler=lambda opt: build_scheduler(opt, schedule),
        )
        # DeepSpeed's per-step gradient norms, clipping and bf16 non-finite check as multi-tensor kernels (same answers)
        self.multi_tensor_steps = install_multi_tensor_steps(self.ds)
        self.module = self.ds.module
        self._params = [p for p in self.module.parameters() if p.requires_grad]
        self.grad_sum_placement, self._zero_sum = self._model_group_sum(params)
        self.compressor = None
        if settings.compression is not None:
            self.ds.enable_backward_allreduce = False
            trainable = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
            self.compressor = PowerSGDCompressor(trainable, groups.data_parallel_group, settings.compression)

    def _model_group_sum(self, params: list[Tensor]) -> tuple[Placement, ZeroPartitionGradSum | None]:
        """The model-group sum's placement (:mod:`.grad_sum`): at ZeRO 1/2 on DeepSpeed's gradient partition,
        or, where that cannot run (:func:`.zero_grad_sum.partition_sum_blocker`), per-parameter hooks."""
        placement = model_group_sum_placement(self.settings, self.groups.layout)
        if placement != "zero_partition":
            return placement, None
        if partition_sum_blocker(self.ds.optimizer, params, self.groups.layout.data_parallel_size) is None:
            return placement, ZeroPartitionGradSum(self.ds.optimizer, self.groups.model_group)
        self._hooks = register_model_parallel_grad_hooks(self.module, self.groups.model_group)
        return "hooks", None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """DeepSpeed's forward. With bf16 at ZeRO 1/2 (DeepSpeed's bf16 mode) the inputs go in fp32 and the
        model computes in its bf16 parameters' dtype; at ZeRO 0 it runs under bf16 autocast over fp32
        parameters (hooks on the module, :func:`.precision.autocast_inside_forward`). Outputs come back fp32."""
        out = self.ds(*args, **kwargs)  # the model casts its inputs to its parameters' dtype
        return cast_floating(out, torch.float32) if self.settings.bf16 else out

    def backward(self, loss: Tensor) -> None:
        """DeepSpeed's backward; at the accumulation boundary then the model-group sum of the replicated
        gradients (:mod:`.grad_sum`): on ``.grad`` at ZeRO 0, on DeepSpeed's reduced partition at ZeRO 1/2."""
        self.ds.backward(loss)
        if self.ds.is_gradient_accumulation_boundary():
            if self.grad_sum_placement == "after_backward":
                reduce_model_parallel_gradients(self._params, self.groups.model_group, self.settings.bucket_cap_mb)
            elif self._zero_sum is not None:
                self._zero_sum()

    def step(self) -> bool:
        boundary = self.ds.is_gradient_accumulation_boundary()
        if boundary:
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

    def fp32_master_views(self) -> dict[int, Tensor]:
        """bf16 at ZeRO 1/2 with one data-parallel rank: DeepSpeed's fp32 master of each parameter, a view into its
        flat partition (DeepSpeed's ``_hp_mapping`` fragment), which that rank holds whole. Empty otherwise: fp32 and
        ZeRO 0 parameters are the master; with several data-parallel ranks each holds a part of it."""
        if not deepspeed_bf16(self.settings) or group_size(self.groups.data_parallel_group) != 1:
            return {}
        views: dict[int, Tensor] = {}
        for p in self._params:
            mapping = getattr(p, "_hp_mapping", None)
            fragment = None if mapping is None else mapping.get_hp_fragment()
            if fragment is None or fragment.numel() != p.numel() or fragment.dtype != torch.float32:
                return {}
            views[id(p)] = fragment.view(p.shape)
        return views

    @property
    def skipped_steps(self) -> int:
        """DeepSpeed's count of skipped optimizer steps (an overflow its loss scaler or bf16 check found)."""
        return int(self.ds.skipped_steps)

    @property
    def micro_batch_size(self) -> int:
        """DeepSpeed's ``train_micro_batch_size_per_gpu`` (generated from ``micro_batch_size``)."""
        return int(self.ds.train_micro_batch_size_per_gpu())

    @property
    def accumulation(self) -> int:
        """DeepSpeed's ``gradient_accumulation_steps`` (generated from the engine-neutral field)."""
        return int(self.ds.gradient_accumulation_steps())

    def is_accumulation_boundary(self) -> bool:
        return bool(self.ds.is_gradient_accumulation_boundary())

    def _partitioned_optimizer(self) -> bool:
        """Whether DeepSpeed wrapped the optimizer (ZeRO 1/2, bf16): its state is per rank."""
        return "state_dict_list" in arg_names(self.ds.optimizer.load_state_dict)

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
        check_state_keys(state, ("module", "optimizer", "scheduler", "global_steps", "micro_steps"))
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


def register_zero_optimizers() -> None:
    """Let DeepSpeed's ZeRO take stormshard's AdamW classes as it takes ``torch.optim.AdamW`` (they are
    torch's AdamW with the same steps, :mod:`.adamw`); otherwise it asks for ``zero_allow_untested_optimizer``."""
    from deepspeed.runtime.zero import utils

    for kind in (LeanAdamW, FlatAdamW):
        if kind not in utils.ZERO_SUPPORTED_OPTIMIZERS:
            utils.ZERO_SUPPORTED_OPTIMIZERS.append(kind)


_MUON = "deepspeed.runtime.zero.muon.muon_optimizer"


def import_muon_without_compiling() -> None:
    """Import DeepSpeed's Muon optimizer module with its ``torch.compile`` deferred to first use.

    DeepSpeed's ZeRO imports that module at start-up (its optimizer check) and in every backward (the
    gradient averaging), although stormshard never runs Muon; the module applies ``torch.compile`` to its
    update functions at import, which loads ``torch._dynamo`` and sympy (~75 MiB resident per rank).
    Imported here first, under a ``torch.compile`` that compiles each function at its first call, it
    is the same module (compiled if it is ever used) and no compiler is loaded when it is not."""
    if _MUON in sys.modules or "torch._dynamo" in sys.modules:
        return
    compile_now = torch.compile
    torch.compile = _compile_at_first_call(compile_now)
    try:
        importlib.import_module(_MUON)
    except ImportError:  # a DeepSpeed without Muon: nothing to defer
        pass
    finally:
        torch.compile = compile_now


def _compile_at_first_call(compile_now: Callable[..., Any]) -> Callable[..., Any]:
    """A ``torch.compile`` that returns a function compiling ``fn`` with ``compile_now`` when first called."""

    def deferred(fn: Callable[..., Any] | None = None, **kwargs: Any) -> Any:
        if fn is None:  # @torch.compile(mode=...)
            return lambda f: deferred(f, **kwargs)
        compiled: list[Callable[..., Any]] = []

        @functools.wraps(fn)
        def call(*args: Any, **kw: Any) -> Any:
            if not compiled:
                compiled.append(compile_now(fn, **kwargs))
            return compiled[0](*args, **kw)

        return call

    return deferred


_TRITON_OPS = "deepspeed.ops.triton_ops._triton"


def import_triton_ops_without_triton() -> None:
    """On DeepSpeed's CPU accelerator, import DeepSpeed's Triton availability check with Triton hidden.

    DeepSpeed 0.19's engine imports its Triton ops at start-up whether or not expert parallelism is on
    (``_configure_expert_parallel`` imports ``auto_ep_layer`` before it reads the config). Their shared
    check imports Triton (~71 MiB resident per rank) and then finds no active GPU backend on a CPU, so
    DeepSpeed's Triton kernels are off there either way. Imported here with ``triton`` hidden, the check
    takes its no-Triton branch: the same answer (``_TRITON_AVAILABLE`` False) without loading Triton
    (on a machine with a GPU that runs DeepSpeed on its CPU accelerator anyway the check would have
    said True; the CPU accelerator never runs those CUDA kernels).
    Nothing changes where Triton is imported already (stormshard's kernels under the interpreter), where
    the check was imported, or on a GPU accelerator."""
    if "triton" in sys.modules or _TRITON_OPS in sys.modules or not on_cpu_accelerator():
        return
    sys.modules["triton"] = None  # type: ignore[assignment]  # `import triton` raises ImportError
    try:
        importlib.import_module(_TRITON_OPS)
    except ImportError:  # a DeepSpeed without Triton ops: nothing to hide
        pass
    finally:
        if "triton" in sys.modules and sys.modules["triton"] is None:
            del sys.modules["triton"]


def on_cpu_accelerator() -> bool:
    """Whether DeepSpeed runs on its CPU accelerator (``DS_ACCELERATOR=cpu``)."""
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name() == "cpu"


def disable_cpu_shm_build() -> None:
    """DeepSpeed's CPU backend JIT-compiles a shared-memory op used only by inference all-reduce;
    mark it unavailable so training starts without a C++ build (gloo does the collectives)."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
