"""The config handed to ``deepspeed.initialize``, generated from :class:`EngineSettings`.

The ``deepspeed`` section carries only DeepSpeed's own keys; this module writes DeepSpeed's
spellings of the engine-neutral knobs into a copy of it:

=================================  ==========================================================
DeepSpeed key                      from
=================================  ==========================================================
``train_micro_batch_size_per_gpu``  ``micro_batch_size``
``gradient_accumulation_steps``     ``gradient_accumulation_steps``
``gradient_clipping``               ``gradient_clipping``
``train_batch_size``                micro batch x accumulation x data-parallel size (a value in
                                    the section must equal it)
``optimizer``                       not written (and removed from the section): the engine hands
                                    DeepSpeed torch's AdamW as its client optimizer, built with
                                    ``lr``, ``betas``, ``eps``, ``weight_decay`` and ``foreach``
                                    (:func:`~stormshard.training.engine.adamw.build_adamw`: the same
                                    steps as torch's AdamW, bit for bit, no JIT build of DeepSpeed's
                                    fused Adam, and no ``torch._dynamo`` import)
``zero_optimization``               ``{"stage": 0}`` unless the section sets it
``bf16``                            ``{"enabled": precision == "bf16" and ZeRO stage >= 1}``
                                    (DeepSpeed's other ``bf16`` keys in the section kept). At ZeRO 0 DeepSpeed
                                    0.19 has no fp32 master weights for bf16 (its DDP_BFLOAT16
                                    path steps AdamW on bf16 weights), so there the parameters stay
                                    fp32 and the engine runs the forward under bf16 autocast
=================================  ==========================================================
"""

from __future__ import annotations

from typing import Any

from stormshard.training.engine.settings import EngineSettings, check_train_batch_size

__all__ = ["resolve_deepspeed_config", "deepspeed_bf16"]


def deepspeed_bf16(settings: EngineSettings) -> bool:
    """Whether DeepSpeed's own bf16 mode (bf16 parameters, fp32 master in its ZeRO optimizer) runs:
    ``precision="bf16"`` at ZeRO 1 or 2. At ZeRO 0 the engine autocasts over fp32 parameters instead."""
    return settings.bf16 and settings.zero_stage > 0


def resolve_deepspeed_config(settings: EngineSettings, data_parallel_size: int) -> dict[str, Any]:
    """The DeepSpeed config for ``settings`` at ``data_parallel_size`` replicas (a new dict)."""
    cfg = {k: (dict(v) if isinstance(v, dict) else v) for k, v in settings.deepspeed.items()}
    check_train_batch_size(settings, data_parallel_size)
    micro, accumulation = settings.micro_batch_size, settings.accumulation
    expected = micro * accumulation * data_parallel_size
    cfg.pop("optimizer", None)  # the engine passes its AdamW to deepspeed.initialize (DeepSpeedEngine)
    cfg.update(
        train_micro_batch_size_per_gpu=micro,
        gradient_accumulation_steps=accumulation,
        gradient_clipping=settings.clipping,
        train_batch_size=expected,
    )
    cfg.setdefault("zero_optimization", {"stage": 0})
    if cfg["zero_optimization"].get("stage") == 1:
        # ZeRO 1 partitions no gradients: copying each into DeepSpeed's contiguous buffer as it is
        # produced only costs time (gt O16, one process: backward 29 -> 24 ms); a config may still set it
        cfg["zero_optimization"] = {"contiguous_gradients": False, **cfg["zero_optimization"]}
    if settings.bf16 or "bf16" in cfg:
        cfg["bf16"] = {**cfg.get("bf16", {}), "enabled": deepspeed_bf16(settings)}
    return cfg
