"""anemoi-models' output boundings, both ways: an anemoi checkpoint's bounding list as stormshard's
``relu_bounded`` / ``model.bounding`` (:class:`~stormshard.models.config.BoundingConfig`), and back as anemoi's
bounding config for ``export-anemoi``.

Read from the pickled model (each bounding module's ``variables`` as its ``data_index`` applies them,
``min_val`` / ``max_val``, the fraction's ``total_variable`` index resolved by its ``name_to_index``, the
normalized kinds' ``norm_min_val`` buffer) or from the training config's ``model.bounding`` list (Lightning
``last.ckpt``, older layouts). A normalized kind's thresholds are then the ``norm_min_val`` tensor of the state
dict (a persistent buffer since anemoi-models 0.9.6), else, for the older files that kept it as a plain
attribute, recomputed from the config's ``min_val`` / ``normalizer`` and the checkpoint's dataset statistics with
anemoi's own float32 arithmetic (:func:`anemoi_norm_min_val`).

Variables are handled as anemoi handles them: anemoi-models 0.9.6 to 0.18 skip, silently, a bounded variable
that is not a model output (``_create_index`` keeps the ``name_to_index`` entries named; the normalized kinds do
so from 0.17 with their ``min_val`` / ``normalizer`` entries): the import drops it, and a bounding left without
variables (a no-op in anemoi) is dropped. anemoi applies the elementwise kinds in ``name_to_index`` order and the
normalized kinds in config order (matching ``norm_min_val``); stormshard selects columns by name and pairs the
thresholds with the variables in the config's order, which is the same map. A fraction's total that is not an
output (anemoi's model fails on it) or that is one of its own variables (anemoi multiplies by the total after
clamping it, stormshard by the total before) is refused both ways.

A list of ReluBoundings only stays ``relu_bounded`` (as before this module); any other list becomes
``model.bounding`` in anemoi's order. The normalized kinds' thresholds are stored normalised (what anemoi's
buffer holds); export writes them as anemoi's physical ``min_val`` with the variable's normalisation as
``normalizer`` (``mean-std``: ``mean + t * stdev``; ``std``: ``t * stdev``; the only two anemoi can evaluate on
a dataset's statistics) and checks that anemoi's formula gives the thresholds back.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from stormshard.checkpoint.errors import ConversionError
from stormshard.models.config import BoundingConfig

__all__ = ["ANEMOI_BOUNDINGS", "AnemoiBounding", "pickled_bounding", "config_bounding", "stormshard_boundings",
           "anemoi_bounding_config", "check_same_boundings", "checkpoint_statistics", "anemoi_norm_min_val",
           "EXPORT_NORMALIZERS"]

#: anemoi's bounding classes -> stormshard's kinds
ANEMOI_BOUNDINGS = {
    "ReluBounding": "relu", "LeakyReluBounding": "leaky_relu", "NormalizedReluBounding": "normalized_relu",
    "NormalizedLeakyReluBounding": "normalized_leaky_relu", "HardtanhBounding": "hardtanh",
    "LeakyHardtanhBounding": "leaky_hardtanh", "FractionBounding": "fraction", "LeakyFractionBounding": "leaky_fraction",
}
_CLASSES = {kind: cls for cls, kind in ANEMOI_BOUNDINGS.items()}
_PREFIX = "anemoi.models.layers.bounding."
#: the normalisations export writes as a normalized kind's ``normalizer``: anemoi's NormalizedReluBounding also
#: names ``min-max`` and ``max``, but reads them from ``statistics["min"]`` / ``["max"]``, keys a dataset's
#: statistics (``minimum`` / ``maximum``) do not have
EXPORT_NORMALIZERS = ("mean-std", "std")


@dataclass(frozen=True)
class AnemoiBounding:
    """One anemoi bounding as the file gives it: the class name, its variables and its settings (``None`` when it
    has none; ``thresholds``: the normalized kinds' ``norm_min_val``, None when not read yet; ``physical_min`` /
    ``normalizer``: the normalized kinds' config, from which anemoi computed the thresholds; ``index``: the
    output variables' ``name_to_index`` the pickled module applies its variables with, None from a config)."""

    cls: str
    variables: tuple[str, ...]
    min_val: float | None = None
    max_val: float | None = None
    total_var: str | None = None
    thresholds: tuple[float, ...] | None = None
    physical_min: tuple[float, ...] | None = None
    normalizer: tuple[str, ...] | str | None = None
    index: tuple[str, ...] | None = None


def _float(value: Any) -> float | None:
    return None if value is None else float(value)


def _is_normalized(cls: str) -> bool:
    return cls.startswith("Normalized")


def _bounded(cls: str) -> bool:
    return cls.endswith(("HardtanhBounding", "FractionBounding"))


def _floats(value: Any) -> tuple[float, ...] | None:
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return tuple(float(v) for v in value)
    return (float(value),)


def _normalizer(value: Any) -> tuple[str, ...] | str | None:
    if value is None or isinstance(value, str):
        return value
    return tuple(str(v) for v in value)


def pickled_bounding(module: Any, cls: str, plain: Any) -> AnemoiBounding:
    """The bounding module ``module`` (an inert stub of anemoi's class ``cls``) of a pickled model; ``plain``
    turns its omegaconf containers into plain values. The variables are those its ``data_index`` applies
    (the config's, less those absent from ``name_to_index``)."""
    d = module.__dict__
    names = dict(plain(d.get("name_to_index")) or {})
    by_index = {int(i): str(n) for n, i in names.items()}
    variables = tuple(str(v) for v in plain(d.get("variables")) or ())
    index = d.get("data_index")
    if names and isinstance(index, Tensor):
        applied = [by_index.get(int(i), "?") for i in index.reshape(-1).tolist()]
        kept = tuple(dict.fromkeys(v for v in variables if v in names))
        # the elementwise kinds apply name_to_index order, the normalized kinds the config's: same set, by name
        variables = kept if set(kept) == set(applied) and len(kept) == len(applied) else tuple(applied)
    total = None
    if cls.endswith("FractionBounding"):
        t = d.get("total_variable")
        try:
            total = by_index[int(t.reshape(-1)[0]) if isinstance(t, Tensor) else int(t)]
        except (KeyError, TypeError, ValueError, IndexError, RuntimeError):
            total = "?"  # no index: anemoi's forward fails on it (refused with the name)
    thresholds = None
    if _is_normalized(cls):
        buffer = (d.get("_buffers") or {}).get("norm_min_val")
        if not isinstance(buffer, Tensor):  # anemoi-models before 0.9.6: a plain attribute
            buffer = d.get("norm_min_val")
        thresholds = tuple(float(v) for v in buffer.reshape(-1).tolist()) if isinstance(buffer, Tensor) else None
    return AnemoiBounding(cls, variables, _float(d.get("min_val")) if _bounded(cls) else None,
                          _float(d.get("max_val")) if _bounded(cls) else None, total, thresholds,
                          _floats(plain(d.get("min_val"))) if _is_normalized(cls) else None,
                          _normalizer(plain(d.get("normalizer"))) if _is_normalized(cls) else None,
                          tuple(names) if names else None)


def config_bounding(section: Mapping[str, Any]) -> AnemoiBounding:
    """A bounding of a training config's ``model.bounding`` list (its ``_target_`` and fields)."""
    cls = str(section.get("_target_", "?")).rsplit(".", 1)[-1]
    normalized = _is_normalized(cls)
    return AnemoiBounding(cls, tuple(str(v) for v in section.get("variables") or ()),
                          _float(section.get("min_val")) if _bounded(cls) else None,
                          _float(section.get("max_val")) if _bounded(cls) else None,
                          str(section["total_var"]) if section.get("total_var") is not None else None,
                          physical_min=_floats(section.get("min_val")) if normalized else None,
                          normalizer=_normalizer(section.get("normalizer")) if normalized else None)


def checkpoint_statistics(root: Any, dataset: str) -> dict[str, Any] | None:
    """The dataset statistics an anemoi checkpoint was built with (what its boundings were given): a Lightning
    file's ``hyper_parameters["statistics"]``, a pickled model interface's ``statistics`` (per dataset since
    anemoi-models 0.12, the only dataset's or ``dataset``'s); None when absent."""
    if isinstance(root, dict):
        stats = (root.get("hyper_parameters") or {}).get("statistics") if isinstance(root.get("hyper_parameters"),
                                                                                      dict) else None
    else:
        stats = getattr(root, "__dict__", {}).get("statistics")
    if not isinstance(stats, dict):
        return None
    if "mean" not in stats:
        stats = stats.get(dataset, next(iter(stats.values())) if len(stats) == 1 else None)
    return stats if isinstance(stats, dict) else None


def anemoi_norm_min_val(b: AnemoiBounding, statistics: Mapping[str, Any], stat_index: Mapping[str, int],
                        where: str) -> tuple[float, ...]:
    """``norm_min_val`` as anemoi's NormalizedReluBounding computes it from its ``min_val``, ``normalizer``,
    ``statistics`` and ``name_to_index_stats`` (the dataset's ``name_to_index``), with the same float32 tensor
    and arithmetic: a list of normalizers (anemoi-models 0.4.2+), or the first version's single
    ``normalizer`` string (``mean-std`` only: ``min_val - mean`` stored, then times ``1 / stdev``)."""
    mins, norms = b.physical_min or (), b.normalizer
    single = isinstance(norms, str)
    norms = (norms,) * len(b.variables) if single else tuple(norms or ())
    if len(mins) != len(b.variables) or len(norms) != len(b.variables):
        raise ConversionError(f"{where}: {b.cls} of {list(b.variables)} has {len(mins)} min_val and {len(norms)} "
                              "normalizer entries", fix="check the checkpoint's bounding config")
    out = torch.zeros(len(b.variables))
    for ii, (variable, min_val, norm) in enumerate(zip(b.variables, mins, norms, strict=True)):
        need = {"mean-std": ("mean", "stdev"), "std": ("stdev",), "min-max": ("min", "max"), "max": ("max",)}.get(norm)
        if need is None or (single and norm != "mean-std"):
            raise ConversionError(f"{where}: {b.cls} of {variable!r} has normalizer {norm!r}, which anemoi's "
                                  "NormalizedReluBounding does not take", fix="check the checkpoint's bounding config")
        missing = [k for k in need if k not in statistics]
        if missing:
            raise ConversionError(f"{where}: {b.cls} of {variable!r} (normalizer {norm!r}) needs the statistics "
                                  f"{missing}, which the checkpoint's statistics ({sorted(statistics)}) lack: anemoi "
                                  "could not have built it", fix="import the inference checkpoint written with it")
        s = {k: np.asarray(statistics[k])[stat_index[variable]] for k in need}  # numpy scalars, as anemoi's
        with np.errstate(divide="ignore", invalid="ignore"):  # a zero statistic: anemoi's inf / NaN, silently
            if single:
                out[ii] = min_val - s["mean"]
                out[ii] *= 1.0 / s["stdev"]
            elif norm == "mean-std":
                out[ii] = (min_val - s["mean"]) / s["stdev"]
            elif norm == "min-max":
                out[ii] = (min_val - s["min"]) / (s["max"] - s["min"])
            elif norm == "max":
                out[ii] = min_val / s["max"]
            else:
                out[ii] = min_val / s["stdev"]
    return tuple(float(v) for v in out.tolist())


def _state_thresholds(tensors: Mapping[str, Tensor], i: int) -> list[str]:
    pattern = re.compile(rf"(^|\.)boundings\.([^.]+\.)?{i}\.norm_min_val$")
    return [k for k in tensors if pattern.search(k)]


def stormshard_boundings(boundings: Sequence[AnemoiBounding], tensors: Mapping[str, Tensor], where: str,
                         outputs: Sequence[str] | None = None, statistics: Mapping[str, Any] | None = None,
                         dataset_variables: Sequence[str] | None = None
                         ) -> tuple[tuple[str, ...], tuple[BoundingConfig, ...]]:
    """``(relu_bounded, bounding)`` of anemoi's list: all ReluBoundings -> ``relu_bounded``; else every bounding,
    in order, as ``model.bounding``. ``outputs``: the model's output variables (anemoi's ``name_to_index`` of the
    boundings; a pickled module's own when None), variables outside it skipped as anemoi skips them. A normalized
    kind without its ``norm_min_val`` in the pickled module takes it from ``tensors``
    (``...boundings[.<dataset>].<i>.norm_min_val``), else computes it from ``statistics`` (indexed by
    ``dataset_variables``). ConversionError naming ``where`` otherwise."""
    kept: list[tuple[int, AnemoiBounding, tuple[str, ...], tuple[int, ...]]] = []
    for i, b in enumerate(boundings):
        known = outputs if outputs is not None else b.index
        names = set(b.variables if known is None else known)
        keep = tuple(j for j, v in enumerate(b.variables) if v in names)
        absent = known is not None and b.total_var not in names
        if b.cls.endswith("FractionBounding") and (absent or b.total_var in b.variables):
            why = ("is not an output variable (anemoi's forward fails on it)" if absent else
                   "is one of its own variables (anemoi multiplies by the total after clamping it, stormshard by "
                   "the total before)")
            raise ConversionError(f"{where}: output bounding {i} ({b.cls} of {list(b.variables)}): its total_var "
                                  f"{b.total_var!r} {why}", fix="a fraction's total must be another output variable")
        if keep:  # a bounding whose variables are all skipped does nothing in anemoi
            kept.append((i, b, tuple(dict.fromkeys(b.variables[j] for j in keep)), keep))
    if all(b.cls == "ReluBounding" for _, b, _, _ in kept):
        return tuple(dict.fromkeys(v for _, _, variables, _ in kept for v in variables)), ()
    out = []
    for i, b, variables, keep in kept:
        thresholds = b.thresholds
        if _is_normalized(b.cls) and thresholds is None:
            keys = _state_thresholds(tensors, i)
            if len(keys) == 1:
                thresholds = tuple(float(v) for v in tensors[keys[0]].reshape(-1).tolist())
            elif statistics is not None and dataset_variables is not None and b.physical_min is not None:
                sub = AnemoiBounding(b.cls, variables, physical_min=tuple(b.physical_min[j] for j in keep)
                                     if len(b.physical_min) == len(b.variables) else b.physical_min,
                                     normalizer=b.normalizer if isinstance(b.normalizer, str) or b.normalizer is None
                                     or len(b.normalizer) != len(b.variables)
                                     else tuple(b.normalizer[j] for j in keep))
                thresholds = anemoi_norm_min_val(sub, statistics, {v: k for k, v in enumerate(dataset_variables)},
                                                 where)
            else:
                raise ConversionError(f"{where}: output bounding {i} ({b.cls} of {list(b.variables)}) has no "
                                      "norm_min_val tensor to read its normalised thresholds from, and the checkpoint "
                                      "no statistics to compute them from",
                                      fix="import the inference checkpoint written with it")
            if len(thresholds) != len(variables):
                raise ConversionError(f"{where}: output bounding {i} ({b.cls}): {len(thresholds)} norm_min_val "
                                      f"values for the variables {list(variables)}",
                                      fix="check the checkpoint's bounding config")
        try:
            out.append(BoundingConfig(kind=ANEMOI_BOUNDINGS[b.cls], variables=variables, min_val=b.min_val,
                                      max_val=b.max_val, total_variable=b.total_var, thresholds=thresholds))
        except ValueError as err:  # pydantic's, naming the field
            raise ConversionError(f"{where}: output bounding {i} ({b.cls}) cannot be read: {err}",
                                  fix="check the checkpoint's bounding settings") from None
    return (), tuple(out)


def anemoi_bounding_config(relu_bounded: Sequence[str], bounding: Sequence[BoundingConfig],
                           variables: Sequence[str], statistics: Mapping[str, Any],
                           methods: Mapping[str, str], where: str = "") -> list[dict[str, Any]]:
    """anemoi's ``model.bounding`` list for ``relu_bounded`` then ``bounding``. ``statistics`` (``mean`` /
    ``stdev`` over ``variables``, the statistics the exported checkpoint gives anemoi) and ``methods`` (each
    variable's normalisation) give the normalized kinds' physical ``min_val`` and ``normalizer``; anemoi's formula
    on them must give the thresholds back (to a float32 rounding). ConversionError for a variable normalised
    otherwise than :data:`EXPORT_NORMALIZERS`, or a fraction of its own variable (the message starts with
    ``where``, the bundle)."""
    at = f"{where}: " if where else ""
    out: list[dict[str, Any]] = []
    if relu_bounded:
        out.append({"_target_": _PREFIX + "ReluBounding", "variables": list(relu_bounded)})
    mean, stdev = (np.asarray(statistics[k], dtype=np.float64) for k in ("mean", "stdev"))
    index = {v: i for i, v in enumerate(variables)}
    for spec in bounding:
        entry: dict[str, Any] = {"_target_": _PREFIX + _CLASSES[spec.kind], "variables": list(spec.variables)}
        if spec.min_val is not None:
            entry |= {"min_val": spec.min_val, "max_val": spec.max_val}
        if spec.total_variable is not None:
            if spec.total_variable in spec.variables:
                raise ConversionError(f"{at}model.bounding {spec.kind} of {list(spec.variables)}: its total_variable "
                                      f"{spec.total_variable!r} is one of its own variables, which anemoi multiplies "
                                      "by after clamping it (stormshard before)",
                                      fix="bound the fraction by another output variable")
            entry["total_var"] = spec.total_variable
        if spec.thresholds is not None:
            physical, normalizer = [], []
            for name, t in zip(spec.variables, spec.thresholds, strict=True):
                method, i = methods[name], index[name]
                if method not in EXPORT_NORMALIZERS:
                    raise ConversionError(
                        f"{at}model.bounding {spec.kind} of {name!r}: the variable is normalised with {method!r}; anemoi's "
                        f"NormalizedReluBounding rebuilds its threshold only for {' / '.join(EXPORT_NORMALIZERS)} "
                        "(its min-max and max read statistics keys a dataset does not have)",
                        fix="normalise the variable with mean-std or std, or bound it with a plain relu / hardtanh")
                physical.append(float(t * stdev[i] + (mean[i] if method == "mean-std" else 0.0)))
                normalizer.append(method)
            rebuilt = anemoi_norm_min_val(
                AnemoiBounding(_CLASSES[spec.kind], spec.variables, physical_min=tuple(physical),
                               normalizer=tuple(normalizer)), {"mean": mean, "stdev": stdev}, index,
                f"{at}model.bounding {spec.kind}")
            for name, t, r in zip(spec.variables, spec.thresholds, rebuilt, strict=True):
                t32 = np.float32(t)
                if not abs(np.float32(r) - t32) <= np.spacing(abs(t32)):  # NaN too (a zero stdev)
                    raise ConversionError(
                        f"{at}model.bounding {spec.kind} of {name!r}: anemoi rebuilds the threshold {t!r} as {r!r} "
                        f"from min_val {physical[spec.variables.index(name)]!r} and the statistics",
                        fix="check the variable's statistics (stdev) are finite and not zero")
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
