"""A DeepSpeed JSON file's optimizer entry, read for ``--deepspeed_config``: its AdamW settings move to
the config's engine-neutral fields (:func:`~stormshard.training.config.merge_deepspeed_file` applies
the moves). Torch-free, like :mod:`stormshard.training.config`."""

from __future__ import annotations

from typing import Any

from stormshard.training.config_file import ConfigError

__all__ = ["OPTIMIZER_PARAM_FIELDS", "deepspeed_optimizer_moves", "same_value"]

# DeepSpeed's AdamW params -> the config field that holds them
OPTIMIZER_PARAM_FIELDS = {"lr": "training.lr", "betas": "optimizer.betas", "eps": "optimizer.eps",
                           "weight_decay": "optimizer.weight_decay"}


def deepspeed_optimizer_moves(opt: Any, source: str) -> list[tuple[str, str, Any]]:
    """``(deepspeed key, config field, value)`` for a DeepSpeed ``optimizer`` entry (AdamW only)."""
    if not isinstance(opt, dict):
        raise ConfigError(f"{source}: optimizer must be an object like {{'type': 'AdamW', 'params': {{...}}}}, "
                          f"got {opt!r}")
    params = dict(opt.get("params") or {})
    kind = str(opt.get("type", "AdamW")).lower()
    adam_w_mode = params.pop("adam_w_mode", kind == "adamw")
    if kind not in ("adamw", "adam") or adam_w_mode is not True:
        raise ConfigError(
            f"{source}: optimizer {opt!r} is not AdamW: every engine uses AdamW so that they take the same step; "
            "use type 'AdamW' (its betas, eps and weight_decay go to the config's optimizer section)"
        )
    unknown = sorted(set(params) - set(OPTIMIZER_PARAM_FIELDS))
    if unknown:
        raise ConfigError(
            f"{source}: optimizer.params {unknown} are not AdamW settings stormshard takes (it builds the "
            f"optimizer: torch's AdamW on the CPU accelerator, DeepSpeed's fused AdamW on GPUs): remove them; "
            f"the known ones are {sorted(OPTIMIZER_PARAM_FIELDS)}"
        )
    return [(f"optimizer.params.{k}", OPTIMIZER_PARAM_FIELDS[k], v) for k, v in params.items()]


def same_value(a: Any, b: Any) -> bool:
    """Whether a DeepSpeed value equals the config's (a list and a tuple of the same items do)."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return list(a) == list(b)
    return a == b
