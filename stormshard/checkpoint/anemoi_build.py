"""Build anemoi's own model from an :class:`~stormshard.checkpoint.anemoi_plan.AnemoiExportPlan` and
save it as anemoi-training's checkpoint callback does (needs anemoi-models, anemoi-utils, torch-geometric).

:func:`build_anemoi_interface` constructs ``anemoi.models.interface.AnemoiModelInterface`` from the
plan's config (hydra instantiates anemoi's encoder, processor, decoder, graph providers, normaliser,
bounding and residual as in training), the plan's graph as a torch-geometric ``HeteroData`` and
anemoi's ``IndexCollection`` of the variables, then writes every parameter's value (each anemoi
parameter must be planned, with the shape anemoi built) and checks the normaliser against stormshard's. :func:`save_anemoi_checkpoint`
writes it the way ``AnemoiCheckpoint._save_checkpoint`` does: ``torch.save`` of the interface (its
``config``, ``metadata`` and ``supporting_arrays`` set to None for the pickle), then
``anemoi.utils.checkpoints.save_metadata`` adds ``anemoi-metadata/anemoi.json`` and the supporting arrays
(latitudes, longitudes) to the zip. Written to a temporary file, then renamed.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stormshard.checkpoint.anemoi_plan import AnemoiExportPlan
from stormshard.checkpoint.errors import ConversionError

__all__ = ["build_anemoi_interface", "save_anemoi_checkpoint", "verify_anemoi_model", "require_anemoi", "ANEMOI_INSTALL"]

#: how to install what export needs next to stormshard (anemoi pins an older torch: --no-deps)
ANEMOI_INSTALL = ("pip install --no-deps anemoi-models==0.19.0 anemoi-utils==0.5.14 anemoi-graphs==0.9.8 && "
                  "pip install hydra-core omegaconf torch-geometric (as ../shared/anemoi-training/setup.sh does)")


def require_anemoi(why: str) -> None:
    """A :class:`ConversionError` saying what export needs when anemoi-models is not importable."""
    try:
        import anemoi.models.interface  # noqa: F401
        import anemoi.utils.checkpoints  # noqa: F401
        import omegaconf  # noqa: F401
        import torch_geometric  # noqa: F401
    except ImportError as err:
        raise ConversionError(f"{why}; building anemoi's model needs anemoi-models 0.19 importable, and this python "
                              f"lacks it ({err})", fix=f"install it: {ANEMOI_INSTALL}") from None


def _plain(obj: Any) -> Any:
    """Tensors, numpy values and tuples in anemoi's index dicts as JSON values."""
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if isinstance(obj, np.ndarray | np.generic):
        return obj.tolist()
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_plain(v) for v in obj]
    return obj


def _metadata_inference(plan: AnemoiExportPlan, indices: Any) -> dict[str, Any]:
    """``metadata_inference`` as anemoi-training's datamodule and task fill it (``shapes`` comes from the model)."""
    meta = plan.metadata
    data_in = indices.data.input.todict()
    names = {int(i): n for n, i in data_in["name_to_index"].items()}
    m = plan.multistep
    return {
        "seed": meta["seed"], "base_seed": meta["base_seed"], "run_id": meta["run_id"], "dataset_names": ["data"],
        "task": meta["task"],
        "data": {"data_indices": {"input": dict(indices.model.input.name_to_index),
                                  "output": dict(indices.model.output.name_to_index)},
                 "variable_types": {role: [names[int(i)] for i in data_in[role]]
                                    for role in ("forcing", "target", "prognostic", "diagnostic")},
                 "timesteps": {"relative_date_indices_training": list(range(m + 1)),
                               "input_relative_date_indices": list(range(m)), "output_relative_date_indices": [m],
                               "timestep": meta["config"]["task"]["timestep"]}},
    }


def _graph_data(plan: AnemoiExportPlan) -> Any:
    from torch_geometric.data import HeteroData

    graph = HeteroData()
    for name, store in plan.nodes.items():
        for key, value in store.items():
            graph[name][key] = value
        graph[name].node_type = "StormshardNodes"
    for edge_type, store in plan.edges.items():
        for key, value in store.items():
            graph[edge_type][key] = value
        graph[edge_type].edge_type = "StormshardEdges"
    return graph


def _load_parameters(model: torch.nn.Module, plan: AnemoiExportPlan, source: Path) -> None:
    """Every planned value into anemoi's parameter of that name (aliases included: a mapper's
    ``layer_norm_attention_dest`` is its ``layer_norm_attention``); every anemoi parameter must get one."""
    theirs = dict(model.named_parameters(remove_duplicate=False))
    problems = [f"{n}: planned but anemoi's model has no such parameter" for n in plan.parameters if n not in theirs]
    problems += [f"{n}: stormshard {tuple(w.shape)} vs anemoi {tuple(theirs[n].shape)}"
                 for n, w in plan.parameters.items() if n in theirs and tuple(w.shape) != tuple(theirs[n].shape)]
    written = {id(theirs[n]) for n in plan.parameters if n in theirs}
    problems += [f"{n}: anemoi parameter with no stormshard value" for n, p in model.named_parameters()
                 if id(p) not in written]
    if problems:
        raise ConversionError(f"{source}: stormshard's weights do not fit the anemoi model built from its config:",
                              problems, fix="report this: the export's mapping does not cover this model")
    with torch.no_grad():
        for name, value in plan.parameters.items():
            theirs[name].copy_(value.to(theirs[name].dtype))


def build_anemoi_interface(plan: AnemoiExportPlan, source: Path) -> tuple[torch.nn.Module, dict[str, Any]]:
    """anemoi's ``AnemoiModelInterface`` holding the plan's model (eval mode, fp32), and the full metadata 2.0."""
    require_anemoi(f"{source} did not come from an anemoi inference checkpoint")
    from anemoi.models.data_indices.collection import IndexCollection
    from anemoi.models.interface import AnemoiModelInterface
    from anemoi.utils.provenance import gather_provenance_info
    from omegaconf import OmegaConf

    config = OmegaConf.create(plan.config)
    v = plan.variables
    indices = IndexCollection(config.data.datasets.data, {n: i for i, n in enumerate(v.variables)})
    if list(indices.model.input.name_to_index) != list(v.input_names) or \
            list(indices.model.output.name_to_index) != list(v.output_names):
        raise ConversionError(f"{source}: anemoi orders the variables {list(indices.model.input.name_to_index)} -> "
                              f"{list(indices.model.output.name_to_index)}, stormshard {list(v.input_names)} -> "
                              f"{list(v.output_names)}", fix="train with the variables in dataset order")
    metadata = dict(plan.metadata)
    metadata["data_indices"] = {"data": _plain(indices.todict())}
    metadata["metadata_inference"] = _metadata_inference(plan, indices)
    metadata["provenance_training"] = _plain(gather_provenance_info())
    statistics = {"data": {k: np.asarray(a, dtype=np.float64) for k, a in plan.statistics.items()}}
    torch.manual_seed(0)  # the unused mapper norms: anemoi's default initialisation
    model = AnemoiModelInterface(config=config, n_step_input=plan.multistep, n_step_output=1,
                                 graph_data=_graph_data(plan), statistics=statistics, data_indices={"data": indices},
                                 metadata=metadata, supporting_arrays=plan.supporting_arrays)
    _load_parameters(model, plan, source)
    norm = model.pre_processors["data"].processors["normalizer"]
    mul, add = norm._norm_mul.double().numpy(), norm._norm_add.double().numpy()
    if not (np.allclose(mul, plan.norm_mul, rtol=1e-6, atol=0) and
            np.allclose(add, plan.norm_add, rtol=1e-6, atol=1e-6 * np.abs(plan.norm_add).max())):
        raise ConversionError(f"{source}: anemoi's normaliser (mul {mul.tolist()}, add {add.tolist()}) differs from "
                              f"stormshard's (mul {plan.norm_mul.tolist()}, add {plan.norm_add.tolist()})",
                              fix="report this: the normalisation methods do not map")
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    metadata["model"] = {"model": type(model).__name__, "trainable_parameters": trainable,
                         "total_parameters": sum(p.numel() for p in model.parameters())}
    model.metadata = metadata
    return model.float().eval(), metadata


def save_anemoi_checkpoint(model: torch.nn.Module, metadata: dict[str, Any], plan: AnemoiExportPlan,
                           out: Path) -> Path:
    """``torch.save(model)`` + ``save_metadata`` (anemoi-training's inference checkpoint), atomically."""
    from anemoi.utils.checkpoints import save_metadata

    out.parent.mkdir(parents=True, exist_ok=True)
    kept = model.config, model.metadata, model.supporting_arrays
    with tempfile.TemporaryDirectory(prefix=".export-anemoi-", dir=out.parent) as tmp:
        path = Path(tmp) / out.name  # the zip's folder is named after the file
        model.config = model.metadata = model.supporting_arrays = None
        try:
            torch.save(model, path)
        finally:
            model.config, model.metadata, model.supporting_arrays = kept
        save_metadata(str(path), metadata, supporting_arrays=plan.supporting_arrays)
        os.replace(path, out)
    return out


def verify_anemoi_model(model: torch.nn.Module, predict: Callable[..., torch.Tensor], plan: AnemoiExportPlan, source: Path,
                        tolerance: float = 1e-4) -> float:
    """Run anemoi's ``predict_step`` and stormshard's ``predict`` (``(batch, multistep, grid, inputs)``
    physical -> ``(batch, grid, outputs)``) on one random state (normalised N(0, 1) per variable); the
    largest error relative to each output variable's spread, a :class:`ConversionError` above ``tolerance``.
    An ensemble model runs one member at the forecast step 1 with the same noise ``(1, hidden, noise_channels)`` in
    both (``predict(x, noise, step=1)``)."""
    g = torch.Generator().manual_seed(0)
    v = plan.variables
    idx = list(v.input_idx)
    z = torch.randn(1, plan.multistep, plan.nodes["data"]["x"].shape[0], len(idx), generator=g, dtype=torch.float64)
    x = ((z - torch.from_numpy(plan.norm_add[idx])) / torch.from_numpy(plan.norm_mul[idx])).float()
    injector = getattr(model.model, "noise_injector", None)
    if injector is None:
        with torch.no_grad():
            theirs = model.predict_step({"data": x.clone()})["data"]
        ours = predict(x.clone())
    else:  # anemoi's ensemble model: one member with stormshard's noise (its noise MLP's input replaced), fcstep 1
        noise = torch.randn(1, plan.nodes["hidden"]["x"].shape[0], injector.noise_channels, generator=g)
        noise = noise * float(injector.noise_std)
        hook = injector.noise_mlp.register_forward_pre_hook(lambda _m, args: (noise[0].to(args[0].dtype),))
        try:
            with torch.no_grad():
                theirs = model.predict_step({"data": x.clone()}, fcstep=1)["data"]
        finally:
            hook.remove()
        ours = predict(x.clone(), noise, step=1)
    theirs = theirs[:, 0, 0] if theirs.ndim == 5 else theirs
    diff = (theirs.double() - ours.double()).abs().amax(dim=(0, 1))
    spread = theirs.double().std(dim=(0, 1)).clamp_min(1e-30)
    errors = (diff / spread).tolist()
    worst = max(errors)
    if not worst <= tolerance:
        bad = [f"{n}: max error {e:.3g} of its spread" for n, e in zip(v.output_names, errors, strict=True) if not e <= tolerance]
        raise ConversionError(f"{source}: anemoi's predict_step of the exported model differs from stormshard's predict "
                              f"(tolerance {tolerance:g} of each output variable's spread); nothing written:", bad,
                              fix="report this: the export's mapping does not reproduce this model")
    return worst
