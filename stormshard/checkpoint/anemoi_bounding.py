"""anemoi-models' output boundings, both ways: an anemoi checkpoint's bounding list as stormshard's
``relu_bounded`` / ``model.bounding`` (:class:`~stormshard.models.config.BoundingConfig`), and back as anemoi's
bounding config for ``export-anemoi``.

Read from the pickled model (each bounding module's ``variables``, ``min_val`` / ``max_val``, the fraction's
``total_variable`` index resolved by its ``name_to_index``, the normalized kinds' ``norm_min_val`` buffer) or
from the training config's ``model.bounding`` list (Lightning ``last.ckpt``, older layouts; the normalized kinds'
thresholds from the ``norm_min_val`` tensors of the state dict). A list of ReluBoundings only stays
``relu_bounded`` (as before this module); any other list becomes ``model.bounding`` in anemoi's order.
The normalized kinds' thresholds are stored normalised (what anemoi's buffer holds); export turns them back into
anemoi's physical ``min_val`` with the bundle's normaliser (``x = (t - add) / mul``) and the method name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch import Tensor

from stormshard.checkpoint.errors import ConversionError
from stormshard.models.config import BoundingConfig

__all__ = ["ANEMOI_BOUNDINGS", "AnemoiBounding", "pickled_bounding", "config_bounding", "stormshard_boundings",
           "anemoi_bounding_config", "check_same_boundings"]

#: anemoi's bounding classes -> stormshard's kinds
ANEMOI_BOUNDINGS = {
    "ReluBounding": "relu", "LeakyReluBounding": "leaky_relu", "NormalizedReluBounding": "normalized_relu",
    "NormalizedLeakyReluBounding": "normalized_leaky_relu", "HardtanhBounding": "hardtanh",
    "LeakyHardtanhBounding": "leaky_hardtanh", "FractionBounding": "fraction", "LeakyFractionBounding": "leaky_fraction",
}
_CLASSES = {kind: cls for cls, kind in ANEMOI_BOUNDINGS.items()}
_PREFIX = "anemoi.models.layers.bounding."


@dataclass(frozen=True)
class AnemoiBounding:
    """One anemoi bounding as the file gives it: the class name, its variables and its settings (``None`` when it
    has none; ``thresholds``: the normalized kinds' ``norm_min_val``, None when not read yet)."""

    cls: str
    variables: tuple[str, ...]
    min_val: float | None = None
    max_val: float | None = None
    total_var: str | None = None
    thresholds: tuple[float, ...] | None = None


def _float(value: Any) -> float | None:
    return None if value is None else float(value)


def pickled_bounding(module: Any, cls: str, plain: Any) -> AnemoiBounding:
    """The bounding module ``module`` (an inert stub of anemoi's class ``cls``) of a pickled model; ``plain``
    turns its omegaconf containers into plain values."""
    d = module.__dict__
    variables = tuple(str(v) for v in plain(d.get("variables")) or ())
    total = None
    if cls.endswith("FractionBounding"):
        index = d.get("total_variable")
        names = {int(i): str(n) for n, i in dict(plain(d.get("name_to_index")) or {}).items()}
        try:
            total = names[int(index.reshape(-1)[0]) if isinstance(index, Tensor) else int(index)]
        except (KeyError, TypeError, ValueError, IndexError):
            total = "?"
    thresholds = None
    if cls.startswith("Normalized"):
        buffer = (d.get("_buffers") or {}).get("norm_min_val")
        thresholds = tuple(float(v) for v in buffer.reshape(-1).tolist()) if isinstance(buffer, Tensor) else None
    bounded = cls.endswith(("HardtanhBounding", "FractionBounding"))
    return AnemoiBounding(cls, variables, _float(d.get("min_val")) if bounded else None,
                          _float(d.get("max_val")) if bounded else None, total, thresholds)


def config_bounding(section: Mapping[str, Any]) -> AnemoiBounding:
    """A bounding of a training config's ``model.bounding`` list (its ``_target_`` and fields)."""
    cls = str(section.get("_target_", "?")).rsplit(".", 1)[-1]
    bounded = cls.endswith(("HardtanhBounding", "FractionBounding"))
    return AnemoiBounding(cls, tuple(str(v) for v in section.get("variables") or ()),
                          _float(section.get("min_val")) if bounded else None,
                          _float(section.get("max_val")) if bounded else None,
                          str(section["total_var"]) if section.get("total_var") is not None else None)


def stormshard_boundings(boundings: Sequence[AnemoiBounding], tensors: Mapping[str, Tensor], where: str
                         ) -> tuple[tuple[str, ...], tuple[BoundingConfig, ...]]:
    """``(relu_bounded, bounding)`` of anemoi's list: all ReluBoundings -> ``relu_bounded``; else every bounding,
    in order, as ``model.bounding``. A normalized kind without its ``norm_min_val`` in the pickled module takes it
    from ``tensors`` (``...boundings[.data].<i>.norm_min_val``). ConversionError naming ``where`` otherwise."""
    if all(b.cls == "ReluBounding" for b in boundings):
        return tuple(v for b in boundings for v in b.variables), ()
    out = []
    for i, b in enumerate(boundings):
        thresholds = b.thresholds
        if b.cls.startswith("Normalized") and thresholds is None:
            keys = [k for k in tensors if k.endswith((f"boundings.data.{i}.norm_min_val", f"boundings.{i}.norm_min_val"))]
            if len(keys) != 1:
                raise ConversionError(f"{where}: output bounding {i} ({b.cls} of {list(b.variables)}) has no "
                                      "norm_min_val tensor to read its normalised thresholds from",
                                      fix="import the inference checkpoint written with it")
            thresholds = tuple(float(v) for v in tensors[keys[0]].reshape(-1).tolist())
        try:
            out.append(BoundingConfig(kind=ANEMOI_BOUNDINGS[b.cls], variables=b.variables, min_val=b.min_val,
                                      max_val=b.max_val, total_variable=b.total_var, thresholds=thresholds))
        except ValueError as err:  # pydantic's, naming the field
            raise ConversionError(f"{where}: output bounding {i} ({b.cls}) cannot be read: {err}",
                                  fix="check the checkpoint's bounding settings") from None
    return (), tuple(out)


def anemoi_bounding_config(relu_bounded: Sequence[str], bounding: Sequence[BoundingConfig],
                           variables: Sequence[str], mul: np.ndarray, add: np.ndarray,
                           methods: Mapping[str, str]) -> list[dict[str, Any]]:
    """anemoi's ``model.bounding`` list for ``relu_bounded`` then ``bounding``. ``mul`` / ``add`` (anemoi's
    normaliser over ``variables``: ``normalised = x * mul + add``) and ``methods`` (each variable's normalisation)
    give the
    normalized kinds' physical ``min_val`` and ``normalizer``; a variable normalised with ``none`` has no anemoi
    normalizer: ConversionError."""
    out: list[dict[str, Any]] = []
    if relu_bounded:
        out.append({"_target_": _PREFIX + "ReluBounding", "variables": list(relu_bounded)})
    for spec in bounding:
        entry: dict[str, Any] = {"_target_": _PREFIX + _CLASSES[spec.kind], "variables": list(spec.variables)}
        if spec.min_val is not None:
            entry |= {"min_val": spec.min_val, "max_val": spec.max_val}
        if spec.total_variable is not None:
            entry["total_var"] = spec.total_variable
        if spec.thresholds is not None:
            physical, normalizer = [], []
            for name, t in zip(spec.variables, spec.thresholds, strict=True):
                method = methods[name]
                if method not in ("mean-std", "std", "min-max", "max"):
                    raise ConversionError(
                        f"model.bounding {spec.kind} of {name!r}: the variable is normalised with {method!r}, which "
                        "anemoi's NormalizedReluBounding does not take (mean-std, std, min-max, max)",
                        fix="normalise it with one of those, or use a plain relu / hardtanh bounding")
                i = list(variables).index(name)
                physical.append(float((t - add[i]) / mul[i]))
                normalizer.append(method)
            entry |= {"min_val": physical, "normalizer": normalizer}
        out.append(entry)
    return out


def check_same_boundings(boundings: Sequence[AnemoiBounding], tensors: Mapping[str, Tensor],
                         relu_bounded: Sequence[str], bounding: Sequence[BoundingConfig], where: str) -> None:
    """A ConversionError unless the bundle's ``relu_bounded`` / ``bounding`` are what the anemoi model's pickled
    ``boundings`` import to (``export-anemoi`` writes a bundle's weights into the anemoi checkpoint it descends from,
    whose pickled boundings stay as they are)."""
    theirs = stormshard_boundings(boundings, tensors, where)
    if (tuple(relu_bounded), tuple(bounding)) != theirs:
        raise ConversionError(
            f"{where}: the model's output boundings (relu_bounded={list(relu_bounded)}, bounding="
            f"{[b.model_dump(exclude_none=True) for b in bounding]}) are not those of the anemoi checkpoint it "
            f"descends from ({[b.cls for b in boundings]}): writing the weights into it would change the forecast",
            fix="export by building anemoi's model instead: copy the bundle without its anemoi_source.ckpt and "
                "metadata anemoi.template")
