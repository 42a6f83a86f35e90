"""The loss weights of an imported anemoi model's grid: the node attribute its training loss weighs
the grid with, normalised as anemoi-training's loss scaler normalises it.

anemoi-training 0.17 weighs the grid with the ``node_weights`` scaler of its training loss
(``training.scalers.datasets.<dataset>.node_weights``, listed in ``training.training_loss``'s
``scalers``): ``GraphNodeAttributeScaler`` reads the attribute ``nodes_attribute_name`` (default
``area_weight``: the graph's spherical-Voronoi areas, ``unit-max``) of the dataset's nodes in the
graph the checkpoint stores, and ``BaseScaler.normalise`` divides it by its sum (``unit-sum``, the
default, or ``l1``) or its mean (``unit-mean``), or keeps it (``None``).
``ReweightedGraphNodeAttributeScaler`` first sets the nodes of a boolean mask attribute to the
weight that makes their share of the total ``weight_frac_of_total``. Older configs name it
``training.node_loss_weights`` (``GraphNodeAttribute`` / ``ReweightedGraphNodeAttribute``, normalised
by the sum). :func:`loss_node_weights` returns those values, float32 as anemoi computes them; the
import stores them as the data nodes' ``area_weight``, so a fine-tuning loss (stormshard's weighted
mean, whatever the scale of the weights) and forecast scores weigh the grid as anemoi-training did.

A checkpoint whose graph lacks the attribute (or has no graph) gets stormshard's own spherical
Voronoi areas of the data nodes, and the bundle's metadata says so (``anemoi.loss_node_weights``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from stormshard.checkpoint.anemoi_layouts import dataset_and_hidden_names, stored_graph
from stormshard.checkpoint.anemoi_pickle import AnemoiCheckpoint
from stormshard.checkpoint.errors import ConversionError
from stormshard.graphs.attributes import area_weights

__all__ = ["NodeWeights", "loss_node_weights"]

_SCALERS = ("GraphNodeAttributeScaler", "ReweightedGraphNodeAttributeScaler",  # anemoi-training 0.5+
            "GraphNodeAttribute", "ReweightedGraphNodeAttribute")  # node_loss_weights of older configs
_NORMS = (None, "unit-sum", "l1", "unit-mean")
_FIX = "import a checkpoint whose loss weighs the grid by a node attribute of its graph (anemoi's default area_weight)"


@dataclass(frozen=True)
class NodeWeights:
    """``weights`` ``(data nodes,)`` float32; ``source``: where they came from (the bundle's metadata)."""

    weights: Tensor
    source: str


def _short(target: Any) -> str:
    return str(target or "").rsplit(".", 1)[-1]


def _per_dataset(section: Any, dataset: str) -> Any:
    """``section["datasets"][dataset]`` (anemoi-training 0.17), else ``section`` (older configs)."""
    if isinstance(section, dict) and isinstance(section.get("datasets"), dict):
        return section["datasets"].get(dataset)
    return section


def _scaler_config(metadata: dict[str, Any], dataset: str) -> tuple[str, dict[str, Any]] | None:
    """``(where, config)`` of the grid scaler the training loss uses, or None when the config names none."""
    training = (metadata.get("config") or {}).get("training") if isinstance(metadata.get("config"), dict) else None
    if not isinstance(training, dict):
        return None
    scalers = _per_dataset(training.get("scalers"), dataset)
    loss = _per_dataset(training.get("training_loss"), dataset)
    used = loss.get("scalers") if isinstance(loss, dict) else None
    if isinstance(scalers, dict):
        for name, config in scalers.items():
            if isinstance(config, dict) and _short(config.get("_target_")) in _SCALERS[:2] \
                    and (used is None or name in used):
                return f"training.scalers.{name}", config
    old = training.get("node_loss_weights")
    if isinstance(old, dict) and _short(old.get("_target_")) in _SCALERS[2:]:
        return "training.node_loss_weights", {**old, "norm": "unit-sum", "nodes_attribute_name": old.get("node_attribute"),
                                               "scaling_mask_attribute_name": old.get("scaled_attribute")}
    return None


def _node_attribute(graph: Any, nodes: str, name: str) -> Tensor | None:
    store = (getattr(graph, "__dict__", {}).get("_node_store_dict") or {}).get(nodes)
    mapping = getattr(store, "__dict__", {}).get("_mapping")
    value = mapping.get(name) if isinstance(mapping, dict) else None
    return value if isinstance(value, Tensor) else None


def _normalise(values: Tensor, norm: str | None) -> Tensor:
    """anemoi-training's ``BaseScaler.normalise``."""
    if norm in ("unit-sum", "l1"):
        return values / torch.sum(values)
    if norm == "unit-mean":
        return values / torch.mean(values)
    return values


def loss_node_weights(ckpt: AnemoiCheckpoint, latlon: Tensor) -> NodeWeights:
    """The data nodes' loss weights of ``ckpt`` (see the module docstring); ``latlon`` ``(nodes, 2)``
    radians: the data nodes, for their spherical areas when the graph has no weights."""
    dataset, _ = dataset_and_hidden_names(ckpt.metadata)
    n = latlon.shape[0]
    found = _scaler_config(ckpt.metadata, dataset)
    where, config = found if found else ("anemoi-training's default node_weights", {})
    attribute = str(config.get("nodes_attribute_name") or "area_weight")
    norm = config.get("norm", "unit-sum") if found else "unit-sum"
    if norm not in _NORMS:
        raise ConversionError(f"{ckpt.path}: {where}.norm={norm!r} is not one of anemoi's {list(_NORMS)}", fix=_FIX)
    graph = stored_graph(ckpt)
    values = _node_attribute(graph, dataset, attribute)
    if values is None:
        areas = area_weights(latlon[:, 0].double().numpy(), latlon[:, 1].double().numpy(), clip_factor=None)
        source = (f"spherical Voronoi areas of the data nodes (computed by stormshard: the checkpoint's graph has no "
                  f"{attribute!r} on its {dataset!r} nodes), normalised {norm}")
        return NodeWeights(_normalise(torch.from_numpy(areas.astype(np.float32)), norm), source)
    values = values.float().squeeze().clone()
    if values.dim() != 1 or values.shape[0] != n:
        raise ConversionError(f"{ckpt.path}: the graph's {dataset!r} nodes have {attribute!r} of shape "
                              f"{tuple(values.shape)}, but the model has {n} data nodes", fix=_FIX)
    if config.get("inverse"):
        values = (~values.bool()).float()
    mask_name = config.get("scaling_mask_attribute_name")
    if _short(config.get("_target_")).startswith("Reweighted") and mask_name:
        mask = _node_attribute(graph, dataset, str(mask_name))
        frac = float(config.get("weight_frac_of_total") or 0.0)
        if mask is None or mask.numel() != n or not 0.0 <= frac < 1.0:
            raise ConversionError(f"{ckpt.path}: {where} reweights the nodes of {mask_name!r} to "
                                  f"weight_frac_of_total={frac}, but the graph has no such {n}-node mask "
                                  "(or the fraction is outside [0, 1))", fix=_FIX)
        mask = mask.bool().reshape(-1)
        values[mask] = frac / (1 - frac) * torch.sum(values[~mask]) / mask.sum()  # anemoi's reweight_attribute_values
    weights = _normalise(values, norm)
    if not bool(torch.isfinite(weights).all()) or bool((weights < 0).any()) or not bool((weights > 0).any()):
        raise ConversionError(f"{ckpt.path}: the loss weights from the graph's {attribute!r} ({where}, {norm}) are "
                              "not finite and non-negative with a positive sum", fix=_FIX)
    return NodeWeights(weights, f"the graph's {attribute!r} of the {dataset!r} nodes ({where}), normalised {norm}")
