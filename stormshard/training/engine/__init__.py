"""Training engines: DeepSpeed, torch DDP or local, behind one interface.

``build_engine(model, groups, settings)`` wraps ``model`` for the parallel layout of ``groups``:

- gradients of replicated parameters are **summed over the model group** (see
  :mod:`stormshard.parallel.grads`): by default (``model_parallel_grad_reduction="auto"``) one flat
  all-reduce per optimizer step where each engine allows it (:mod:`.grad_sum`; inside DeepSpeed ZeRO
  1/2 on its reduced gradient partition, :mod:`.zero_grad_sum`), or the old ``"hooks"`` (one
  all-reduce per parameter during backward) / ``"bucketed"`` (after backward);
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

Modules, one job each: :mod:`.settings` (the engine-neutral settings and their checks),
:mod:`.base` (the interface), :mod:`.torch_engines` (local and DDP), :mod:`.adamw` (their optimizer),
:mod:`.deepspeed_engine`, :mod:`.deepspeed_config` (the generated DeepSpeed config), :mod:`.grad_sum`
and :mod:`.zero_grad_sum` (the model-group gradient sum) and :mod:`.build` (``build_engine``).
"""

from __future__ import annotations

from stormshard.lazy import lazy_exports

# name -> module, loaded on first use: importing the package (e.g. the torch-free engine settings, read by
# the experiment config) does not load torch or DeepSpeed
_EXPORTS: dict[str, str] = {
    "TrainingEngine": "base",
    "build_engine": "build",
    "resolve_deepspeed_config": "deepspeed_config",
    "DeepSpeedEngine": "deepspeed_engine",
    **dict.fromkeys(("AdamWSettings", "EngineError", "EngineSettings"), "settings"),
    **dict.fromkeys(("DDPEngine", "LocalEngine"), "torch_engines"),
}
__all__ = [
    "EngineError",
    "AdamWSettings",
    "EngineSettings",
    "TrainingEngine",
    "LocalEngine",
    "DDPEngine",
    "DeepSpeedEngine",
    "build_engine",
    "resolve_deepspeed_config",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__)
