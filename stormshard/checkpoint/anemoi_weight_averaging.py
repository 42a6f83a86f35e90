"""anemoi-training's ``training.weight_averaging`` <-> stormshard's ``training.weight_averaging`` (plain JSON).

anemoi-training 0.17 instantiates a Lightning callback from ``training.weight_averaging`` (``_target_`` plus its
arguments): anemoi's ``EMAWeightAveraging`` / ``SWAWeightAveraging`` (``decay``, ``update_every_n_steps``,
``update_starting_at_step``, ``update_starting_at_epoch``), Lightning's ``EMAWeightAveraging`` (the same
arguments; its ``ema.yaml``, decay 0.999) or Lightning's epoch-wise ``StochasticWeightAveraging`` (its
``swa.yaml``: ``swa_lrs``, ``swa_epoch_start``). Import (:func:`stormshard_weight_averaging`) maps them onto
``{"kind": "ema" | "swa", "decay", "start_step", "every_n_steps"}`` for the bundle's ``finetune_config.json``;
what has no stormshard equivalent (a start in epochs, Lightning SWA's per-epoch averaging and learning-rate
switch) is said in a note. Export (:func:`anemoi_weight_averaging`) writes stormshard's setting back as anemoi's
own callback. Nothing here imports torch or training.
"""

from __future__ import annotations

from typing import Any

__all__ = ["stormshard_weight_averaging", "anemoi_weight_averaging", "ANEMOI_EMA", "ANEMOI_SWA"]

ANEMOI_EMA = "anemoi.training.diagnostics.callbacks.weight_averaging.EMAWeightAveraging"
ANEMOI_SWA = "anemoi.training.diagnostics.callbacks.weight_averaging.SWAWeightAveraging"


def _int(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def stormshard_weight_averaging(config: dict[str, Any] | None) -> tuple[dict[str, Any] | None, str | None]:
    """``(settings, note)``: the stormshard ``training.weight_averaging`` of an anemoi checkpoint's config (its
    ``config`` metadata; None or no ``weight_averaging``: ``(None, None)``), and a note on what did not map."""
    section = ((config or {}).get("training") or {}).get("weight_averaging")
    if not isinstance(section, dict):
        return None, None
    target = str(section.get("_target_", ""))
    name = target.rsplit(".", 1)[-1]
    start, every = section.get("update_starting_at_step"), section.get("update_every_n_steps")
    settings: dict[str, Any] = {"start_step": max(0, _int(start, 0)), "every_n_steps": max(1, _int(every, 1))}
    note = None
    if section.get("update_starting_at_epoch") is not None:
        note = (f"training.weight_averaging: anemoi's update_starting_at_epoch={section['update_starting_at_epoch']} "
                "counts epochs; stormshard's start_step counts optimizer steps: set it for fine-tuning (now "
                f"{settings['start_step']})")
    if name == "EMAWeightAveraging":
        decay = section.get("decay", 0.999)
        ok = isinstance(decay, (int, float)) and not isinstance(decay, bool) and 0 < decay < 1
        return {"kind": "ema", "decay": float(decay) if ok else 0.999, **settings}, note
    if name == "SWAWeightAveraging":
        return {"kind": "swa", **settings}, note
    if name == "StochasticWeightAveraging":
        return {"kind": "swa", "start_step": 0, "every_n_steps": 1}, (
            "training.weight_averaging: Lightning's StochasticWeightAveraging averages once per epoch from "
            f"swa_epoch_start ({section.get('swa_epoch_start', 0.8)}) and switches the learning rate to swa_lrs "
            f"({section.get('swa_lrs')}); stormshard's swa averages after every optimizer step from start_step and "
            "keeps the schedule as configured: set training.weight_averaging.start_step for fine-tuning")
    return None, (f"training.weight_averaging: the callback {target or '(no _target_)'} has no stormshard "
                  "equivalent (ema or swa): fine-tuning keeps no average")


def anemoi_weight_averaging(settings: dict[str, Any] | None) -> dict[str, Any] | None:
    """anemoi-training's ``training.weight_averaging`` (anemoi's own callback) for stormshard's ``settings`` (the
    stored JSON of ``training.weight_averaging``; None: None)."""
    if not isinstance(settings, dict) or settings.get("kind") not in ("ema", "swa"):
        return None
    out: dict[str, Any] = {"_target_": ANEMOI_EMA if settings["kind"] == "ema" else ANEMOI_SWA}
    if settings["kind"] == "ema":
        out["decay"] = settings.get("decay") or 0.999
    out["update_every_n_steps"] = settings.get("every_n_steps", 1)
    out["update_starting_at_step"] = settings.get("start_step", 0)
    return out
