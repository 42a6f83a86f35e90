"""anemoi-training's ensemble (CRPS) losses, as stormshard's ``training.crps_alpha``.

stormshard's ensemble model trains the almost-fair CRPS ``alpha * fCRPS + (1 - alpha) * CRPS`` of all members of an
initial state (:func:`stormshard.training.losses.almost_fair_crps`), weighted as the pointwise losses are. anemoi-
training names its kernel CRPS by class, per version:

- ``CRPS`` (0.17; ``alpha``, default 0.95): 0 the standard, 1 the fair CRPS, between them the almost-fair one;
- ``AlmostFairKernelCRPS`` (before 0.17; ``alpha``, default 1.0): the same formula;
- ``KernelCRPS`` (before 0.17; ``fair``, default True): the fair (``alpha`` 1) or the standard (``alpha`` 0) CRPS;

each the same pointwise value as stormshard's at that alpha (``tests/test_anemoi_ensemble.py`` holds the formulas
equal), so the import writes ``training.crps_alpha``. anemoi-training 0.17's ensemble config wraps the CRPS in a
``MultiscaleLossWrapper``; one scale without smoothing (``multiscale_config: null``, no loss matrices, ``weights``
of length 1) is its ``per_scale_loss`` times that weight, so :func:`single_scale_loss` unwraps it (a weight other than
1 scales the loss by a constant). Any other wrapper stays what it is (no stormshard equivalent).
"""

from __future__ import annotations

from typing import Any

__all__ = ["CRPS_LOSSES", "single_scale_loss", "crps_alpha"]

#: anemoi-training's kernel-CRPS classes
CRPS_LOSSES = ("CRPS", "AlmostFairKernelCRPS", "KernelCRPS")


def _name(loss: Any) -> str:
    target = loss.get("_target_") if isinstance(loss, dict) else None
    return target.rsplit(".", 1)[-1] if isinstance(target, str) else ""


def single_scale_loss(loss: Any) -> Any:
    """``loss`` with a one-scale ``MultiscaleLossWrapper`` (no smoothing) replaced by its ``per_scale_loss``."""
    if _name(loss) != "MultiscaleLossWrapper" or not isinstance(loss.get("per_scale_loss"), dict):
        return loss
    weights = loss.get("weights")
    smoothing = any(loss.get(k) for k in ("multiscale_config", "loss_matrices", "loss_matrices_path"))
    if smoothing or not isinstance(weights, list) or len(weights) != 1:
        return loss
    inner = dict(loss["per_scale_loss"])
    if "scalers" not in inner and isinstance(loss.get("scalers"), list):
        inner["scalers"] = loss["scalers"]
    return inner


def crps_alpha(loss: dict[str, Any]) -> tuple[float | None, str | None]:
    """(stormshard's ``crps_alpha`` of anemoi's CRPS loss ``loss``, None) or (None, why it does not map)."""
    name = _name(loss)
    if name == "KernelCRPS":
        fair = loss.get("fair", True)
        if not isinstance(fair, bool):
            return None, f"anemoi's KernelCRPS has fair={fair!r}, not a boolean"
        return (1.0 if fair else 0.0), None
    alpha = loss.get("alpha", 0.95 if name == "CRPS" else 1.0)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not 0.0 <= alpha <= 1.0:
        return None, f"anemoi's {name} has alpha={alpha!r}, not a number in [0, 1]"
    return float(alpha), None
