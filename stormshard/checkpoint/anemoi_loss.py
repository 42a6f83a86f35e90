"""The training loss of an imported anemoi model, as stormshard's ``training.loss`` and ``training.loss_scaling``.

anemoi-training names its loss in the checkpoint's config, ``training.training_loss`` (per dataset,
``training_loss.datasets.<dataset>``, since anemoi-training 0.17), by its class: ``MSELoss``, ``MAELoss``,
``HuberLoss`` (with ``delta``), ``LogCoshLoss``, ``RMSELoss``, or the ``Weighted...`` names of
anemoi-training before 0.4. Each is stormshard's pointwise loss of the same name with the same grid and
variable weighting (:class:`~stormshard.training.losses.WeightedPointwiseLoss`), so a fine-tuning run of an
imported bundle (its ``finetune_config.json``) minimises the loss anemoi-training minimised. Any other loss
(``CombinedLoss``, the CRPS and spectral losses, ...) has no stormshard equivalent: the import keeps
``mse`` for fine-tuning and says so (:attr:`TrainingLoss.note`, in the bundle's metadata and as a warning).

The per-variable weights (:func:`anemoi_variable_weights`) are the product of the variable scalers the loss
lists (``training_loss.scalers``; ``"*"`` all of ``training.scalers``, ``"!name"`` excluded), computed as
anemoi-training computes them: ``GeneralVariableLossScaler`` (``weights`` by the variable's parameter, else
``default``) and the variable-level scalers ``ReluVariableLevelScaler`` (``max(y_intercept, slope * level)``),
``LinearVariableLevelScaler``, ``PolynomialVariableLevelScaler`` and ``NoVariableLevelScaler`` on the
variables of their ``group`` (``training.variable_groups``). A variable's parameter, level and group come from
the dataset's ``variables_metadata`` (its MARS ``param`` / ``levelist`` / ``levtype``) where anemoi trusts it,
else from the name (``t_850``: parameter ``t``, level 850). The import writes them as explicit per-variable
weights (``loss_scaling.variables``), so fine-tuning weighs each variable as anemoi did. The grid scalers are
:mod:`stormshard.checkpoint.anemoi_node_weights`'; ``UniformTimeStepScaler`` and ``NaNMaskScaler`` change
nothing stormshard computes (it skips NaN targets itself); any other scaler (the tendency scalers, which need
statistics of the tendencies the checkpoint does not carry, ...) is left out with a note. Scaler ``norm``
options only scale the loss by a constant (stormshard's loss divides by the sum of the weights). Configs before
``training.scalers`` (anemoi-training 0.1-0.5, the AIFS 1.x checkpoints) are read by their own rules
(:func:`_older_scalers`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from stormshard.checkpoint.anemoi_crps_loss import CRPS_LOSSES, crps_alpha, single_scale_loss
from stormshard.checkpoint.anemoi_layouts import dataset_and_hidden_names, model_config_json

__all__ = ["TrainingLoss", "VariableWeights", "anemoi_training_loss", "anemoi_variable_weights", "loss_scalers"]

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
    crps_alpha: float | None = None  # an ensemble model's CRPS (its training.loss stays the default)

    def training_section(self) -> dict[str, Any]:
        """The ``training`` keys of a fine-tuning config."""
        if self.crps_alpha is not None:
            return {"crps_alpha": self.crps_alpha}
        return {"loss": self.kind, **({"huber_delta": self.huber_delta} if self.kind == "huber" else {})}

    def as_metadata(self) -> dict[str, Any]:
        """What the bundle's ``metadata.json`` records (``anemoi.training_loss``)."""
        return {"anemoi": self.anemoi, **self.training_section(), "note": self.note}


def _training_section(metadata: dict[str, Any], key: str) -> Any:
    """``config.training.<key>`` of the checkpoint's dataset (``.datasets.<dataset>`` since anemoi-training 0.17)."""
    config = metadata.get("config") if isinstance(metadata, dict) else None
    training = config.get("training") if isinstance(config, dict) else None
    section = training.get(key) if isinstance(training, dict) else None
    if isinstance(section, dict) and isinstance(section.get("datasets"), dict):
        section = section["datasets"].get(dataset_and_hidden_names(metadata)[0])
    return single_scale_loss(section) if key == "training_loss" else section


def loss_scalers(metadata: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``{name: scaler config}`` of the scalers anemoi-training applied to the training loss (its ``scalers``
    list resolved as anemoi resolves it; none when the loss lists none)."""
    loss = _training_section(metadata, "training_loss")
    defined = _training_section(metadata, "scalers")
    defined = {k: v for k, v in defined.items() if isinstance(v, dict)} if isinstance(defined, dict) else {}
    names = loss.get("scalers") if isinstance(loss, dict) else None
    if not isinstance(names, list):
        return _older_scalers(metadata, loss) if not defined else {}
    if "*" in names:
        names = [k for k in defined if f"!{k}" not in names]
    return {str(k): defined[k] for k in names if k in defined}


#: the private kind of anemoi-training 0.1-0.3's ``variable_loss_scaling: {default, pl: {...}, sfc: {...}}``
_PL_SFC = "stormshard.older_layout.PlSfcVariableScaling"


def _older_scalers(metadata: dict[str, Any], loss: Any) -> dict[str, dict[str, Any]]:
    """The variable scalers of configs before ``training.scalers`` (anemoi-training 0.1-0.5), as scaler configs.

    0.1-0.3: ``variable_loss_scaling`` (``loss_scaling`` before it) ``{default, pl: {param: w}, sfc: {name: w}}``
    with ``pressure_level_scaler`` (``Relu`` / ``Linear`` / ``Polynomial`` / ``NoPressureLevelScaler``, ``slope``,
    ``minimum``), always applied. 0.4-0.5: ``variable_loss_scaling`` ``{default, <param or name>: w}`` (the
    ``GeneralVariableLossScaler`` rule) and ``additional_scalars`` (each with a ``name``), applied when the
    loss's ``scalars`` list names them (``"variable"`` for the first; every one without a list)."""
    training = ((metadata.get("config") or {}).get("training") or {}) if isinstance(metadata, dict) else {}
    table = training.get("variable_loss_scaling", training.get("loss_scaling"))
    if not isinstance(table, dict):
        return {}
    if isinstance(table.get("pl"), dict) or isinstance(table.get("sfc"), dict):
        return {"variable_loss_scaling": {"_target_": _PL_SFC, "table": table,
                                          "pressure_level_scaler": training.get("pressure_level_scaler") or {}}}
    chosen = loss.get("scalars") if isinstance(loss, dict) else None
    found: dict[str, dict[str, Any]] = {}
    if not isinstance(chosen, list) or "variable" in chosen:
        found["variable"] = {"_target_": "GeneralVariableLossScaler", "weights": table}
    extra = training.get("additional_scalars")
    for scaler in extra if isinstance(extra, list) else []:
        if isinstance(scaler, dict) and (not isinstance(chosen, list) or scaler.get("name") in chosen):
            found[str(scaler.get("name"))] = scaler
    return found


def anemoi_training_loss(metadata: dict[str, Any]) -> TrainingLoss:
    """The training loss the config of an anemoi checkpoint's ``metadata`` names, as stormshard's."""
    loss = _training_section(metadata, "training_loss")
    target = loss.get("_target_") if isinstance(loss, dict) else None
    if not isinstance(target, str):
        return TrainingLoss(note="the checkpoint's config names no training loss: fine-tuning trains mse")
    name = target.rsplit(".", 1)[-1]
    inner = model_config_json(metadata).get("model")
    if isinstance(inner, dict) and str(inner.get("_target_", "")).endswith("AnemoiEnsModelEncProcDec"):
        return _ensemble_loss(loss, name, target)
    kind = _KINDS.get(name)
    if kind is None:
        return TrainingLoss(anemoi=target, note=f"anemoi trained with {name}, which stormshard has no equivalent of: "
                                                "finetune_config.json trains mse (set training.loss to choose)")
    delta = loss.get("delta", 1.0) if kind == "huber" else 1.0
    if isinstance(delta, bool) or not isinstance(delta, int | float) or not delta > 0:
        return TrainingLoss(anemoi=target, note=f"anemoi's {name} has delta={delta!r}, not a positive number: "
                                                "finetune_config.json trains mse (set training.loss to choose)")
    return TrainingLoss(kind, float(delta), target)


def _ensemble_loss(loss: dict[str, Any], name: str, target: str) -> TrainingLoss:
    """An ensemble model's loss: anemoi's CRPS as ``training.crps_alpha`` (:mod:`anemoi_crps_loss`); stormshard's
    ensemble trains only the almost-fair CRPS, so any other loss keeps its default alpha, with a note."""
    if name not in CRPS_LOSSES:
        return TrainingLoss(anemoi=target, crps_alpha=0.95,
                            note=f"anemoi trained the ensemble with {name}; stormshard's ensemble trains the almost-fair "
                                 "CRPS: finetune_config.json trains it with crps_alpha 0.95 (set training.crps_alpha)")
    alpha, why = crps_alpha(loss)
    if alpha is None:
        return TrainingLoss(anemoi=target, crps_alpha=0.95,
                            note=f"{why}: finetune_config.json trains crps_alpha 0.95 (set training.crps_alpha)")
    return TrainingLoss(anemoi=target, crps_alpha=alpha)


_LEVEL_SCALERS = ("ReluVariableLevelScaler", "LinearVariableLevelScaler", "PolynomialVariableLevelScaler",
                  "NoVariableLevelScaler")
#: scalers that weigh the grid (anemoi_node_weights) or change nothing stormshard's loss computes
_NOT_VARIABLE = ("GraphNodeAttributeScaler", "ReweightedGraphNodeAttributeScaler", "UniformTimeStepScaler",
                 "NaNMaskScaler")


@dataclass(frozen=True)
class VariableWeights:
    """``weights``: output variable -> anemoi's loss weight (the product of its variable scalers); ``applied``:
    the scalers in it; ``notes``: scalers left out and why."""

    weights: dict[str, float]
    applied: tuple[str, ...]
    notes: tuple[str, ...]

    def loss_scaling(self) -> dict[str, Any] | None:
        """``training.loss_scaling`` of a fine-tuning config: the weights, one per output variable (None when
        every weight is 1: stormshard's default)."""
        if all(w == 1.0 for w in self.weights.values()):
            return None
        return {"variables": dict(self.weights), "default_weight": 1.0}


def _crack(name: str) -> tuple[str, int | None]:
    """anemoi's name split: ``"t_850"`` -> ``("t", 850)``; a name without a trailing ``_<digits>`` is its own
    parameter, without level."""
    head, sep, tail = name.rpartition("_")
    return (head, int(tail)) if sep and head and tail.isdigit() else (name, None)


class _VariableInfo:
    """A variable's parameter, level and group, as anemoi-training's ``ExtractVariableGroupAndLevel`` finds them."""

    def __init__(self, groups: dict[str, Any], variables_metadata: dict[str, Any]) -> None:
        self.default = str(groups.get("default", "sfc"))
        self.groups = {k: v for k, v in groups.items() if k != "default"}
        self.meta = {k: v.get("mars", {}) if isinstance(v, dict) and isinstance(v.get("mars"), dict) else {}
                     for k, v in variables_metadata.items() if isinstance(v, dict)}

    def _trusted(self, name: str) -> bool:
        if name not in self.meta:
            return False
        levtype = self.meta[name].get("levtype")
        surface = None if levtype is None else levtype == "sfc"
        return (not surface) ^ (self.meta[name].get("levelist") is None)

    def param(self, name: str) -> str:
        return str(self.meta[name].get("param", name)) if self._trusted(name) else _crack(name)[0]

    def level(self, name: str) -> float | None:
        level = self.meta[name].get("levelist") if self._trusted(name) else _crack(name)[1]
        return None if level is None else float(level)

    def group(self, name: str) -> str:
        """Raises ``ValueError`` for a group specification anemoi needs metadata for and the variable has none."""
        for group, spec in self.groups.items():
            if isinstance(spec, list | str):
                if self.param(name) in (spec if isinstance(spec, list) else [spec]):
                    return group
            elif isinstance(spec, dict):
                if name not in self.meta:
                    if set(spec) != {"param"}:
                        raise ValueError(f"variable_groups.{group} selects by {sorted(spec)} and {name} has no "
                                         "variables_metadata")
                    values = spec["param"] if isinstance(spec["param"], list) else [spec["param"]]
                    if self.param(name) in values:
                        return group
                elif all(self._attribute(name, k) in (v if isinstance(v, list) else [v]) for k, v in spec.items()):
                    return group
        return self.default

    def _attribute(self, name: str, key: str) -> Any:
        """What anemoi's ``Variable`` of the metadata answers for ``key``: ``param``, ``level``, ``name`` or
        ``is_surface_level`` / ``is_pressure_level`` / ``is_model_level`` (None without a levtype); ``ValueError``
        for any other attribute."""
        mars = self.meta[name]
        levtype = mars.get("levtype")
        answers = {"param": mars.get("param", name), "level": mars.get("levelist"), "name": name,
                   **{f"is_{kind}_level": None if levtype is None else levtype == code
                      for kind, code in (("surface", "sfc"), ("pressure", "pl"), ("model", "ml"))}}
        if key not in answers:
            raise ValueError(f"a variable_groups specification by {key!r} (stormshard reads param, level, name, "
                             "is_surface_level, is_pressure_level and is_model_level)")
        return answers[key]


def anemoi_variable_weights(metadata: dict[str, Any], output_names: list[str] | tuple[str, ...]) -> VariableWeights:
    """anemoi-training's per-variable loss weights of the checkpoint's training loss (module docstring)."""
    weights = dict.fromkeys(output_names, 1.0)
    applied: list[str] = []
    notes: list[str] = []
    groups = _training_section(metadata, "variable_groups")
    dataset = (metadata.get("dataset") or {}) if isinstance(metadata.get("dataset"), dict) else {}
    ds = dataset.get(dataset_and_hidden_names(metadata)[0], dataset)
    vm = ds.get("variables_metadata") if isinstance(ds, dict) else None
    info = _VariableInfo(groups if isinstance(groups, dict) else {"default": "sfc"}, vm if isinstance(vm, dict) else {})
    for name, scaler in loss_scalers(metadata).items():
        kind = str(scaler.get("_target_", "")).rsplit(".", 1)[-1]
        if kind in _NOT_VARIABLE:
            continue
        try:
            factors = _scaler_factors(kind, scaler, output_names, info)
        except (TypeError, ValueError) as err:
            notes.append(f"training.scalers.{name} ({kind}) could not be read ({err}): left out of loss_scaling")
            continue
        if factors is None:
            notes.append(f"training.scalers.{name} ({kind or 'no _target_'}) has no stormshard equivalent: "
                         "left out of loss_scaling")
            continue
        weights = {v: w * factors[v] for v, w in weights.items()}
        applied.append(name)
    return VariableWeights(weights, tuple(applied), tuple(notes))


def _scaler_factors(kind: str, scaler: dict[str, Any], output_names: list[str] | tuple[str, ...],
                    info: _VariableInfo) -> dict[str, float] | None:
    """One variable scaler's weight per output variable, or None for a kind stormshard does not compute."""
    if kind == _PL_SFC.rsplit(".", 1)[-1]:
        return _pl_sfc_factors(scaler, output_names)
    if kind == "GeneralVariableLossScaler":
        table = scaler.get("weights") or {}
        default = float(table.get("default", 1.0))
        return {v: float(table.get(info.param(v), default)) for v in output_names}
    if kind not in _LEVEL_SCALERS:
        return None
    slope, intercept = float(scaler.get("slope", 0.0)), float(scaler.get("y_intercept", 0.0))
    factors = dict.fromkeys(output_names, 1.0)
    if kind == "NoVariableLevelScaler":
        return factors
    for v in output_names:
        if info.group(v) != scaler.get("group"):  # first, as anemoi: a group it cannot decide is an error
            continue
        level = info.level(v)
        if level is None:
            continue
        factors[v] = (max(intercept, level * slope) if kind == "ReluVariableLevelScaler" else
                      level * slope + intercept if kind == "LinearVariableLevelScaler" else
                      (slope * level) ** 2 + intercept)
    return factors


#: stormshard ``training.loss`` -> anemoi-training's loss class
_TARGETS = {"mse": "MSELoss", "mae": "MAELoss", "huber": "HuberLoss", "logcosh": "LogCoshLoss", "rmse": "RMSELoss"}
#: stormshard ``loss_scaling.pressure_level.type`` -> anemoi-training's variable-level scaler
_LEVEL_TARGETS = {"relu": "ReluVariableLevelScaler", "linear": "LinearVariableLevelScaler",
                  "polynomial": "PolynomialVariableLevelScaler"}
_SCALER_MODULE = "anemoi.training.losses.scalers"
#: the group the exported level scaler applies to (``training.variable_groups``)
LEVEL_GROUP = "stormshard_levels"


def anemoi_loss_config(training: dict[str, Any], output_names: list[str] | tuple[str, ...], *, ensemble: bool = False
                       ) -> tuple[dict[str, Any], tuple[str, ...]]:
    """anemoi-training's ``training_loss``, ``scalers`` and ``variable_groups`` (for dataset ``data``) of a stormshard
    run's ``training`` section (``loss``, ``huber_delta``, ``loss_scaling``), and notes on what they cannot say.

    The per-variable weights become a ``GeneralVariableLossScaler`` by parameter (anemoi weighs every level of a
    parameter alike, so a weight given to one full name ``t_850`` must equal its parameter's others) and the
    pressure-level scaling a ``Relu`` / ``Linear`` / ``PolynomialVariableLevelScaler`` on a group of the
    parameters it applies to (``constant`` is folded into the parameter weights); the grid is weighted by the
    graph's ``area_weight`` (``unit-sum``), as the import reads it. :func:`anemoi_variable_weights` reads them
    back to the same weights. An ``ensemble`` model's loss is anemoi-training's ``CRPS`` with ``alpha`` =
    ``crps_alpha`` (0.95 unless set)."""
    from stormshard.models.loss_weights import LossScalingSettings, level_weight, variable_loss_weights

    kind = str(training.get("loss") or "mse")
    loss: dict[str, Any] = {"_target_": f"anemoi.training.losses.{_TARGETS[kind]}",
                            "scalers": ["general_variable", "node_weights"], "ignore_nans": True}
    if kind == "huber":
        loss["delta"] = float(training.get("huber_delta", 1.0))
    if ensemble:
        loss = {**loss, "_target_": "anemoi.training.losses.CRPS", "alpha": float(training.get("crps_alpha", 0.95))}
    scalers: dict[str, Any] = {"node_weights": {"_target_": f"{_SCALER_MODULE}.GraphNodeAttributeScaler",
                                                "nodes_attribute_name": "area_weight", "norm": "unit-sum"}}
    groups: dict[str, Any] = {"default": "sfc"}
    notes: list[str] = []
    settings = LossScalingSettings.model_validate(training.get("loss_scaling") or {})
    level = settings.pressure_level
    base = variable_loss_weights(output_names, settings.model_copy(update={"pressure_level": None}))
    leveled: dict[str, float] = {}  # output -> its anemoi level, where the level scaler applies
    if level is not None:
        for name in output_names:
            param, lvl = _crack(name)
            if lvl is not None and (level.params is None or param in level.params):
                leveled[name] = float(lvl)
    by_param: dict[str, set[float]] = {}
    for name, w in zip(output_names, base, strict=True):
        w = float(w) * (level_weight(leveled[name], level) if level is not None and level.type == "constant"
                        and name in leveled else 1.0)
        by_param.setdefault(_crack(name)[0], set()).add(w)
    mixed = sorted(p for p, ws in by_param.items() if len(ws) > 1)
    if mixed:
        notes.append(f"training.loss_scaling weighs levels of {mixed} differently through full variable names, which "
                     "anemoi's GeneralVariableLossScaler cannot: its weights are left at 1")
    else:
        scalers["general_variable"] = {"_target_": f"{_SCALER_MODULE}.GeneralVariableLossScaler",
                                       "weights": {"default": 1.0, **{p: ws.pop() for p, ws in by_param.items()}}}
    if level is not None and level.type != "constant" and leveled:
        unparsed = [n for n in output_names if n not in leveled and _level_of(n) is not None
                    and (level.params is None or _level_of(n)[0] in level.params)]
        if unparsed:
            notes.append(f"training.loss_scaling.pressure_level applies to {unparsed}, whose levels anemoi does not "
                         "read from the name (not whole numbers): the exported level scaler leaves them out")
        groups[LEVEL_GROUP] = sorted({_crack(n)[0] for n in leveled})
        scalers["pressure_level"] = {"_target_": f"{_SCALER_MODULE}.{_LEVEL_TARGETS[level.type]}",
                                     "group": LEVEL_GROUP, "slope": level.slope, "y_intercept": level.y_intercept}
        loss["scalers"].insert(1, "pressure_level")
    if "general_variable" not in scalers:
        loss["scalers"].remove("general_variable")
    return ({"training_loss": {"datasets": {"data": loss}}, "scalers": {"datasets": {"data": scalers}},
             "variable_groups": {"datasets": {"data": groups}}}, tuple(notes))


def _level_of(name: str) -> tuple[str, float] | None:
    """stormshard's reading of a level from the name (``t_0.5`` too), for the note on what anemoi cannot read."""
    from stormshard.models.loss_weights import split_level

    return split_level(name)


def _pl_sfc_factors(scaler: dict[str, Any], output_names: list[str] | tuple[str, ...]) -> dict[str, float]:
    """anemoi-training 0.1-0.3's weights (its ``get_variable_scaling``): a name ``<a>_..._<digits>`` is a pressure
    level of parameter ``<a>`` (the text before the first underscore), weighted ``pl[a] * level scaler`` when ``pl``
    names it; any other name ``sfc[name]``; else ``default``."""
    table, level = scaler["table"], scaler["pressure_level_scaler"]
    default = float(table.get("default", 1.0))
    pl, sfc = table.get("pl") or {}, table.get("sfc") or {}
    kind = str(level.get("_target_", "")).rsplit(".", 1)[-1]
    slope = float(level.get("slope", 0.0 if kind == "NoPressureLevelScaler" else 1.0 / 1000))
    minimum = float(level.get("minimum", 1.0 if kind == "NoPressureLevelScaler" else 0.0))
    scale = {"ReluPressureLevelScaler": lambda p: max(minimum, p * slope),
             "LinearPressureLevelScaler": lambda p: p * slope + minimum,
             "PolynomialPressureLevelScaler": lambda p: (slope * p) ** 2 + minimum,
             "NoPressureLevelScaler": lambda p: 1.0}.get(kind)
    if scale is None:
        raise ValueError(f"pressure_level_scaler {kind or 'without _target_'} is not one of anemoi-training's")
    factors = {}
    for name in output_names:
        split = name.split("_")
        if len(split) > 1 and split[-1].isdigit():
            factors[name] = float(pl[split[0]]) * scale(int(split[-1])) if split[0] in pl else default
        else:
            factors[name] = float(sfc.get(name, default))
    return factors
