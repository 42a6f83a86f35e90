"""Engine settings: the engine-neutral knobs every engine reads, and the DeepSpeed section's own.

One place per knob. Every engine (``deepspeed``, ``ddp``, ``local``) takes these from the same fields:

- ``micro_batch_size``: samples per model replica per micro-step;
- ``gradient_accumulation_steps``: micro-steps per optimizer step;
- ``gradient_clipping``: max global gradient norm (0: off);
- ``optimizer``: :class:`AdamWSettings` (``betas``, ``eps``, ``weight_decay``; the learning rate
  comes from ``schedule``);
- ``compression``: a :class:`~stormshard.parallel.compression.PowerSGDConfig` (the one PowerSGD schema),
  written ``{"type": "powersgd", ...its fields}`` in a config;
- ``precision``: ``"fp32"`` or ``"bf16"``, the one precision setting (``training.precision`` in a
  config). bf16 runs the model's compute in bfloat16 and keeps fp32 master weights and optimizer
  moments: DeepSpeed's bf16 optimizer (``deepspeed.bf16.enabled`` is generated from it), or
  ``torch.autocast(bfloat16)`` over fp32 parameters for ``ddp`` and ``local``. Inputs, targets, the
  loss and the returned predictions stay fp32 (see :mod:`.precision`).

The ``deepspeed`` dict holds only what is DeepSpeed's own (``zero_optimization``,
``communication_data_type``, ``bf16`` tuning keys other than ``enabled``, ``train_batch_size`` as a
cross-check, ...). DeepSpeed's spellings of the engine-neutral knobs (``train_micro_batch_size_per_gpu``,
``gradient_accumulation_steps``, ``gradient_clipping``, ``optimizer``), ``scheduler`` and
``bf16.enabled`` / ``fp16.enabled`` are errors there that name the field to use;
:func:`~stormshard.training.engine.deepspeed_config.resolve_deepspeed_config` writes them into the
config handed to DeepSpeed.

The checks, one function per rule set: :func:`check_engine_sections` (layout-independent: the
engine choice, the DeepSpeed section, compression, and :func:`check_precision`, every precision
rule) runs when settings are validated; :func:`check_train_batch_size` (``deepspeed.train_batch_size``
against the data-parallel size) is called by
:func:`~stormshard.training.engine.build.check_engine_layout` and the DeepSpeed config generator.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    field_validator,
    model_validator,
)

from stormshard.parallel.compression_plan import PowerSGDConfig
from stormshard.training.schedule import LRScheduleSettings

__all__ = [
    "EngineError",
    "AdamWSettings",
    "EngineSettings",
    "CompressionSection",
    "MOVED_DEEPSPEED_KEYS",
    "check_engine_sections",
    "zero_stage",
    "section_enabled",
    "check_precision",
    "check_train_batch_size",
    "COMMUNICATION_DTYPES",
]

# deepspeed.communication_data_type values (the dtype of DeepSpeed's gradient reduction)
COMMUNICATION_DTYPES = ("fp32", "bf16")


class EngineError(ValueError):
    """Engine settings that cannot work with this model or layout; the message names the fix."""


# DeepSpeed key -> (EngineSettings field, experiment-config field) that replaces it
MOVED_DEEPSPEED_KEYS: dict[str, tuple[str, str]] = {
    "train_micro_batch_size_per_gpu": ("micro_batch_size", "training.micro_batch_size"),
    "gradient_accumulation_steps": ("gradient_accumulation_steps", "training.gradient_accumulation_steps"),
    "gradient_clipping": ("gradient_clipping", "training.gradient_clipping"),
    "optimizer": ("optimizer", "optimizer"),
}


class AdamWSettings(BaseModel):
    """The optimizer every engine builds: AdamW (torch's semantics; DeepSpeed's AdamW in DeepSpeed).

    The learning rate is not here: the schedule (``training.lr``, ``lr_min``, ``warmup_steps``) sets it.
    Defaults are torch's.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["adamw"] = Field("adamw", description="AdamW only: every engine takes the same step")
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.01, ge=0, description="decoupled weight decay")

    @field_validator("type", mode="before")
    @classmethod
    def _lower(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

    @field_validator("betas", mode="before")
    @classmethod
    def _two_betas(cls, value: Any) -> Any:
        if isinstance(value, (list, tuple)) and len(value) != 2:
            raise ValueError(f"optimizer.betas needs two values (beta1, beta2), got {list(value)}: use e.g. "
                             "[0.9, 0.999]")
        return value

    @model_validator(mode="after")
    def _check(self) -> AdamWSettings:
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"optimizer.betas must lie in [0, 1), got {self.betas}: use e.g. [0.9, 0.95]")
        return self


def _parse_compression(value: Any) -> PowerSGDConfig | None:
    """``{"type": "powersgd", <PowerSGDConfig fields>}`` (``type`` optional) -> :class:`PowerSGDConfig`."""
    if value is None or isinstance(value, PowerSGDConfig):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"compression must be an object like {{'type': 'powersgd', 'rank': 4}} or null, got {value!r}")
    body = dict(value)
    kind = body.pop("type", "powersgd")
    if kind != "powersgd":
        raise ValueError(f"compression.type={kind!r} is not known: the one compressor is 'powersgd'")
    known = [f.name for f in fields(PowerSGDConfig)]
    unknown = sorted(set(body) - set(known))
    if unknown:
        raise ValueError(f"compression: unknown key(s) {unknown}: the keys are type, {', '.join(known)}")
    try:
        return PowerSGDConfig(**body)
    except TypeError as err:
        raise ValueError(f"compression: {err}") from None


# the config's ``compression`` section: parsed into the PowerSGDConfig dataclass, dumped with its type tag
CompressionSection = Annotated[
    PowerSGDConfig | None,
    PlainValidator(_parse_compression),
    PlainSerializer(lambda c: None if c is None else {"type": "powersgd", **c.as_dict()}),
]


def section_enabled(section: Any) -> bool:
    """Whether a DeepSpeed sub-section like ``{"enabled": true}`` is on."""
    return isinstance(section, dict) and bool(section.get("enabled", False))


def zero_stage(deepspeed: dict[str, Any]) -> Any:
    """``deepspeed.zero_optimization.stage`` (0 when absent)."""
    zero = deepspeed.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise ValueError(f"deepspeed.zero_optimization must be a dict like {{'stage': 0}}, got {zero!r}")
    return zero.get("stage", 0)


def check_engine_sections(engine: str, deepspeed: dict[str, Any], compression: PowerSGDConfig | None,
                          precision: str, precision_field: str = "precision") -> None:
    """Layout-independent checks of the engine choice, the DeepSpeed section, compression and the
    precision (:func:`check_precision`; ``precision_field`` names the precision in messages).

    Raises ``ValueError`` naming the field and the fix (pydantic validators turn it into their error).
    """
    for key, (field, config_field) in MOVED_DEEPSPEED_KEYS.items():
        if key in deepspeed:
            raise ValueError(
                f"deepspeed.{key} is not read from the deepspeed section: it is an engine-neutral setting; set "
                f"{config_field} in the experiment config (EngineSettings.{field}) and remove deepspeed.{key} "
                "(a DeepSpeed JSON file given with --deepspeed_config may keep it: see the README)"
            )
    if "scheduler" in deepspeed:
        raise ValueError(
            "deepspeed.scheduler is set, but stormshard owns the learning-rate schedule: remove it and "
            "set training.{lr, lr_min, warmup_steps} (EngineSettings.schedule)"
        )
    stage = zero_stage(deepspeed)
    if stage not in (0, 1, 2):
        raise ValueError(
            f"deepspeed.zero_optimization.stage={stage!r} is not supported: use 0, 1 or 2 (ZeRO 3 "
            "partitions parameters, which clashes with model sharding)"
        )
    check_precision(engine, precision, deepspeed, compression, precision_field)
    comm = deepspeed.get("communication_data_type")
    if comm is not None and comm not in COMMUNICATION_DTYPES:
        raise ValueError(f"deepspeed.communication_data_type={comm!r} is not supported: use one of "
                         f"{list(COMMUNICATION_DTYPES)} (the dtype of the gradient all-reduce / reduce-scatter)")
    if comm is not None and engine != "deepspeed":
        raise ValueError(f"deepspeed.communication_data_type={comm!r} is read by engine 'deepspeed' only, but the "
                         f"engine is {engine!r}: remove it (ddp and local reduce gradients in their parameters' fp32)")
    if compression is None:
        return
    if engine == "local":
        raise ValueError(
            "compression is set but engine='local' has no data parallelism to compress: use engine "
            "'deepspeed' or 'ddp', or set compression to null"
        )
    if engine != "deepspeed":
        return
    if stage != 0:
        raise ValueError(
            f"compression (PowerSGD) needs deepspeed.zero_optimization.stage=0, got {stage}: DeepSpeed "
            "fails in engine.step() at ZeRO 1/2 once its own gradient all-reduce is off; set stage 0 "
            "or compression null"
        )
    if "communication_data_type" in deepspeed:
        raise ValueError(
            "deepspeed.communication_data_type and compression are both set: with compression DeepSpeed's "
            "all-reduce is off, so choose one"
        )


def check_precision(engine: str, precision: str, deepspeed: dict[str, Any], compression: PowerSGDConfig | None,
                    field: str = "precision") -> None:
    """Every precision rule, in one place: ``precision`` (``field``, ``training.precision`` in a config)
    is the one setting, so the DeepSpeed section may not carry its own (``bf16.enabled``, an enabled
    ``fp16``), and DeepSpeed's bf16 optimizer cannot run under PowerSGD. Raises ``ValueError`` naming
    the field and the fix."""
    if section_enabled(deepspeed.get("fp16")):
        raise ValueError(f"deepspeed.fp16 is not supported (no loss scaling here): remove it and use "
                         f"{field}='bf16' instead")
    bf16 = deepspeed.get("bf16")
    if bf16 is not None and not isinstance(bf16, dict):
        raise ValueError(f"deepspeed.bf16 must be an object of DeepSpeed's bf16 settings, got {bf16!r}: "
                         f"better, remove it and set {field}='bf16'")
    if isinstance(bf16, dict) and "enabled" in bf16:
        raise ValueError(
            f"deepspeed.bf16.enabled={bf16['enabled']!r} is set next to {field}={precision!r}: the precision is set "
            f"in one place, {field} ('fp32' or 'bf16', read by every engine), and deepspeed.bf16.enabled is "
            f"generated from it; remove deepspeed.bf16.enabled"
        )
    if precision == "bf16" and engine == "deepspeed" and compression is not None:
        raise ValueError(
            f"compression with {field}='bf16' on engine 'deepspeed': DeepSpeed's bf16 optimizer copies gradients "
            f"into its fp32 buffers inside backward, before the compressor could reduce them; use {field} "
            "'fp32' with compression, engine 'ddp' (bf16 autocast + PowerSGD), or "
            "deepspeed.communication_data_type='bf16' instead of compression"
        )


def check_train_batch_size(settings: EngineSettings, data_parallel_size: int) -> None:
    """``deepspeed.train_batch_size``, when given, equals micro batch x accumulation x ``data_parallel_size``
    (it is generated from them). Raises :class:`EngineError` naming the fields and the fix."""
    if settings.engine != "deepspeed" or "train_batch_size" not in settings.deepspeed:
        return
    given = settings.deepspeed["train_batch_size"]
    micro, acc = settings.micro_batch_size, settings.accumulation
    expected = micro * acc * data_parallel_size
    if given != expected:
        raise EngineError(
            f"deepspeed.train_batch_size={given!r} but training.micro_batch_size {micro} x "
            f"training.gradient_accumulation_steps {acc} x data-parallel size {data_parallel_size} = {expected}: "
            "remove train_batch_size (it is generated), or set training.micro_batch_size (a --deepspeed_config "
            "file sets it with train_micro_batch_size_per_gpu)"
        )


class EngineSettings(BaseModel):
    """How the model is trained in parallel. Validated on construction (:func:`check_engine_sections`);
    the layout-dependent checks are :func:`~stormshard.training.engine.build.check_engine_layout`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    engine: Literal["deepspeed", "ddp", "local"] = "deepspeed"
    micro_batch_size: int = Field(1, ge=1, strict=True, description="samples per model replica per micro-step")
    gradient_accumulation_steps: int = Field(1, ge=1, strict=True, description="micro-steps per optimizer step")
    gradient_clipping: float = Field(0.0, ge=0, description="max global gradient norm, 0 = off")
    optimizer: AdamWSettings = Field(default_factory=AdamWSettings)
    schedule: LRScheduleSettings = Field(default_factory=LRScheduleSettings)
    deepspeed: dict[str, Any] = Field(default_factory=dict, description="DeepSpeed's own settings (ZeRO, bf16, ...)")
    bucket_cap_mb: float = Field(25.0, gt=0, description="DDP bucket size; also the model-group sum's buckets after backward")
    broadcast_buffers: bool = Field(True, description="DDP: broadcast rank 0's buffers every forward")
    compression: CompressionSection = None
    model_parallel_grad_reduction: Literal["auto", "hooks", "bucketed"] = Field(
        "auto", description="where replicated gradients are summed over the model group: 'auto' (one flat "
                            "all-reduce where each engine allows; stormshard.training.engine.grad_sum), 'hooks' "
                            "(one all-reduce per parameter during backward), 'bucketed' (after backward)")
    precision: Literal["fp32", "bf16"] = Field(
        "fp32", description="compute precision of the model; bf16 keeps fp32 master weights and moments")

    @model_validator(mode="after")
    def _check(self) -> EngineSettings:
        check_engine_sections(self.engine, self.deepspeed, self.compression, self.precision)
        return self

    @property
    def bf16(self) -> bool:
        """Whether the model computes in bfloat16 (``precision == "bf16"``)."""
        return self.precision == "bf16"

    @property
    def accumulation(self) -> int:
        return self.gradient_accumulation_steps

    @property
    def clipping(self) -> float:
        return self.gradient_clipping

    @property
    def zero_stage(self) -> int:
        return zero_stage(self.deepspeed)

    def adamw_kwargs(self) -> dict[str, Any]:
        """``lr``, ``betas``, ``eps``, ``weight_decay`` of the AdamW every engine builds."""
        opt = self.optimizer
        return {"lr": self.schedule.lr, "betas": tuple(opt.betas), "eps": opt.eps, "weight_decay": opt.weight_decay}
