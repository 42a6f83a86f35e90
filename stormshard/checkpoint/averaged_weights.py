"""A checkpoint's weight average (``training.weight_averaging``: EMA or SWA) and the choice of weights.

A training checkpoint of a run with weight averaging holds, in each rank file's state under
:data:`AVERAGE_STATE_KEY`, ``{"settings", "updates", "last_step", "tensors": {name: fp32 tensor}}``: the rank's
average of each of its parameters, with the parameter's local shape, so the parameter table's partition
metadata gathers it (consolidate) and slices it (reshard) exactly as it does the parameter. A consolidated
checkpoint keeps it as ``average.safetensors`` (full tensors) and ``metadata.json``'s ``weight_average`` (the
settings and counters).

Export, consolidate, reshard, forecasts and ``training.init_weights`` take the **averaged** weights by default when
a checkpoint has them (anemoi / Lightning copy the average into the model at the end of training), the trained
ones with ``weights="trained"``; ``weights="averaged"`` on a checkpoint without an average is an error
(:func:`choose_weights`). Imports nothing from training.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from torch import Tensor

from stormshard.checkpoint.errors import ConversionError

__all__ = ["AVERAGE_STATE_KEY", "WEIGHT_CHOICES", "WeightChoice", "average_info", "choose_weights",
           "check_weight_choice"]

#: the key of the average in a rank's checkpoint state (beside "engine", "data", "step")
AVERAGE_STATE_KEY = "weight_average"
WeightChoice = Literal["averaged", "trained"]
#: the values of ``--weights``
WEIGHT_CHOICES: tuple[str, ...] = ("averaged", "trained")


def average_info(state: Mapping[str, Any]) -> dict[str, Any]:
    """The settings and counters of a stored average (its ``tensors`` left out): JSON."""
    return {k: v for k, v in state.items() if k != "tensors"}


def check_weight_choice(weights: str | None, option: str = "--weights") -> None:
    """A :class:`ConversionError` naming ``option`` unless ``weights`` is None, ``"averaged"`` or ``"trained"``."""
    if weights is not None and weights not in WEIGHT_CHOICES:
        raise ConversionError(f"{option} {weights!r} is not one of {', '.join(WEIGHT_CHOICES)}",
                              fix=f"pass {option} averaged (the weight average, the default where there is one) or "
                                  f"{option} trained (the weights the optimizer trained)")


def choose_weights(model: Mapping[str, Tensor], average: Mapping[str, Tensor] | None, weights: str | None,
                   source: str, option: str = "--weights") -> tuple[dict[str, Tensor], str]:
    """``(tensors, which)``: ``model``'s full tensors with the averaged ones in place of their parameters
    (``weights`` ``"averaged"``, or None where ``average`` exists) or as trained (``"trained"``, or None without an
    average); ``which`` is ``"averaged"`` or ``"trained"``. ``"averaged"`` without an average is a
    :class:`ConversionError` naming ``source`` and ``option``. The averaged tensors take the model tensor's dtype."""
    check_weight_choice(weights, option)
    if weights == "averaged" and average is None:
        raise ConversionError(f"{option} averaged: {source} holds no weight average (its run had no "
                              "training.weight_averaging)", fix=f"pass {option} trained, or leave {option} out")
    if weights == "trained" or average is None:
        return dict(model), "trained"
    missing = sorted(set(average) - set(model))
    if missing:
        raise ConversionError(f"{source}: its weight average holds tensors the model does not have: {missing[:5]}",
                              fix="the checkpoint is damaged: convert an intact one")
    out = dict(model)
    for name, t in average.items():
        out[name] = t.to(model[name].dtype)
    return out, "averaged"
