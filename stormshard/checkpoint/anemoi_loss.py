"""The training loss of an imported anemoi model, as stormshard's ``training.loss``.

anemoi-training names its loss in the checkpoint's config, ``training.training_loss`` (per dataset,
``training_loss.datasets.<dataset>``, since anemoi-training 0.17), by its class: ``MSELoss``, ``MAELoss``,
``HuberLoss`` (with ``delta``), ``LogCoshLoss``, ``RMSELoss``, or the ``Weighted...`` names of
anemoi-training before 0.4. Each is stormshard's pointwise loss of the same name with the same grid and
variable weighting (:class:`~stormshard.training.losses.WeightedPointwiseLoss`), so a fine-tuning run of an
imported bundle (its ``finetune_config.json``) minimises the loss anemoi-training minimised. Any other loss
(``CombinedLoss``, the CRPS and spectral losses, ...) has no stormshard equivalent: the import keeps
``mse`` for fine-tuning and says so (:attr:`TrainingLoss.note`, in the bundle's metadata and as a warning).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from stormshard.checkpoint.anemoi_layouts import dataset_and_hidden_names

__all__ = ["TrainingLoss", "anemoi_training_loss"]

#: anemoi-training loss class -> stormshard ``training.loss``
_KINDS = {
    "MSELoss": "mse", "WeightedMSELoss": "mse",
    "MAELoss": "mae", "WeightedMAELoss": "mae",
    "HuberLoss": "huber", "WeightedHuberLoss": "huber",
    "LogCoshLoss": "logcosh", "WeightedLogCoshLoss": "logcosh",
    "RMSELoss": "rmse", "WeightedRMSELoss": "rmse",
}


@dataclass(frozen=True)
class TrainingLoss:
    """``kind`` / ``huber_delta``: stormshard's ``training.loss`` for fine-tuning; ``anemoi``: the class the
    checkpoint's config names (None: it names none); ``note``: why ``kind`` is not anemoi's loss, or None."""

    kind: str = "mse"
    huber_delta: float = 1.0
    anemoi: str | None = None
    note: str | None = None

    def training_section(self) -> dict[str, Any]:
        """The ``training`` keys of a fine-tuning config."""
        return {"loss": self.kind, **({"huber_delta": self.huber_delta} if self.kind == "huber" else {})}

    def as_metadata(self) -> dict[str, Any]:
        """What the bundle's ``metadata.json`` records (``anemoi.training_loss``)."""
        return {"anemoi": self.anemoi, **self.training_section(), "note": self.note}


def anemoi_training_loss(metadata: dict[str, Any]) -> TrainingLoss:
    """The training loss the config of an anemoi checkpoint's ``metadata`` names, as stormshard's."""
    config = metadata.get("config") if isinstance(metadata, dict) else None
    training = config.get("training") if isinstance(config, dict) else None
    loss = training.get("training_loss") if isinstance(training, dict) else None
    if isinstance(loss, dict) and isinstance(loss.get("datasets"), dict):
        loss = loss["datasets"].get(dataset_and_hidden_names(metadata)[0])
    target = loss.get("_target_") if isinstance(loss, dict) else None
    if not isinstance(target, str):
        return TrainingLoss(note="the checkpoint's config names no training loss: fine-tuning trains mse")
    name = target.rsplit(".", 1)[-1]
    kind = _KINDS.get(name)
    if kind is None:
        return TrainingLoss(anemoi=target, note=f"anemoi trained with {name}, which stormshard has no equivalent of: "
                                                "finetune_config.json trains mse (set training.loss to choose)")
    delta = loss.get("delta", 1.0) if kind == "huber" else 1.0
    if isinstance(delta, bool) or not isinstance(delta, int | float) or not delta > 0:
        return TrainingLoss(anemoi=target, note=f"anemoi's {name} has delta={delta!r}, not a positive number: "
                                                "finetune_config.json trains mse (set training.loss to choose)")
    return TrainingLoss(kind, float(delta), target)
