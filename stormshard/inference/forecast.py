"""Forecasts: sharded rollout, anemoi zarr / netCDF output, scores and plots.

``run_forecast(source, dataset, dates, steps, out, gpus_per_model=K, ...)`` in one process or on
every rank of an initialised process group (``torchrun`` / ``deepspeed`` / ``srun``):

1. checks the whole request (:func:`~stormshard.inference.request.check_request`) on every rank
   before any group, model or file exists;
2. builds the model groups (K consecutive ranks hold one model; ``world / K`` replicas) and this
   rank's shard of the model with its slice of the weights (:mod:`stormshard.inference.loader`:
   an exported bundle, or a training checkpoint of any layout), in the precision the model
   trained in or ``precision``;
3. rank 0 creates one anemoi-layout store per initial date (``<dir>/forecast.zarr``, ``dir`` =
   ``out`` for one date, ``out/<YYYYmmddTHHMM>`` for each of several), then each replica rolls out
   its (date, member) tasks (:mod:`stormshard.inference.runner`) on its ranks' grid slices,
   reading only those slices, and every rank writes whole chunks of each lead time
   (:class:`~stormshard.inference.outputs.ChunkExchange`: no rank gathers the state);
4. per initial date (dates dealt over the ranks): netCDF (``forecast.nc``), scores against the
   dataset (:mod:`stormshard.inference.verification`: RMSE and ACC of model, persistence and a
   training-period climatology; CRPS and spread/skill for ensembles) into ``scores.json``, maps;
5. rank 0 combines the dates' scores into ``out/scores.json``, plots them
   (``out/plots/scores_<variable>.png``) and prints a table.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from einops import rearrange

from stormshard.checkpoint.export import InferenceModel
from stormshard.data.anemoi_layout import AnemoiDataset, parse_frequency
from stormshard.env import check_environment
from stormshard.errors import kept_until_replaced, no_partial_output
from stormshard.inference.loader import PRECISIONS, ModelSource, build_forecaster, open_model_source
from stormshard.inference.output_paths import OUTPUT_NAMES, DateOutputs, RunOutputs
from stormshard.inference.outputs import (
    ChunkExchange,
    ForecastStore,
    StoreStatistics,
    reduce_statistics,
    variable_units,
    write_netcdf,
)
from stormshard.inference.plots import plot_maps, plot_scores
from stormshard.inference.request import (
    ForecastRequest,
    check_forecast_attention_kernel,
    check_request,
    default_members,
    forecast_outputs,
)
from stormshard.inference.runner import member_generator, member_noise, replica_tasks, rollout_steps
from stormshard.inference.verification import Climatology, combine_scores, compute_climatology, score_forecast
from stormshard.kernels.flex import flex_options_from_env
from stormshard.layers.attention import set_attention_kernel, window_attention_layers
from stormshard.layers.graph_transformer import set_graph_kernel
from stormshard.models.parallelize import check_graph_kernel_for_device, check_parallel_strategy
from stormshard.models.registry import build_model
from stormshard.parallel.topology import ParallelLayout, build_process_groups, rank_device
from stormshard.progress import format_duration, note, phase, reporting

__all__ = ["ForecastResult", "run_forecast", "format_scores", "OUTPUT_NAMES"]


@dataclass
class ForecastResult:
    """What a forecast wrote. ``scores``: combined over the initial dates (rank 0; ``{}`` elsewhere
    or without verification); ``per_date``: each date's scores (the dates this rank verified)."""

    request: ForecastRequest
    stores: list[Path]
    lead_hours: list[float]
    scores: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    per_date: dict[str, dict[str, dict[str, list[float]]]] = field(default_factory=dict)
    files: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)  # rollout_s (all ranks), steps_per_s (all replicas)

    def read(self, date: int = 0) -> np.ndarray:
        """The forecast of initial date ``date`` from its store: ``(members, steps, grid, variables)``."""
        store = AnemoiDataset.open(self.stores[date])
        return rearrange(np.asarray(store.data[:]), "t v e c -> e t c v")


@dataclass(frozen=True)
class _Model:
    """What the run needs to know of the model before it is built."""

    source: ModelSource | None
    prebuilt: InferenceModel | None
    variables: Any
    graph: Any
    timestep: str | None
    metadata: dict[str, Any]
    name: str
    multistep: int
    precision: str
    train_range: tuple[Any, Any]


def _describe(source: str | os.PathLike | InferenceModel, dataset: Any, graph: Any, trust_model_code: bool,
              weights: str | None = None) -> _Model:
    if isinstance(source, InferenceModel):
        dtype = next(source.model.parameters()).dtype
        precision = next(k for k, v in PRECISIONS.items() if v == dtype)
        train = ((source.metadata.get("experiment") or {}).get("data") or {}).get("train") or {}
        return _Model(None, source, source.variables, source.graph, source.timestep, source.metadata,
                      source.config.name, source.multistep_input, precision, (train.get("start"), train.get("end")))
    src = open_model_source(source, dataset=dataset, graph=graph, trust_model_code=trust_model_code, weights=weights)
    return _Model(src, None, src.variables, src.graph, src.timestep, src.metadata, src.config.name,
                  src.config.multistep_input, src.precision, src.train_range)


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def run_forecast(source: str | os.PathLike | InferenceModel, dataset: str | os.PathLike,
                 dates: Any | Sequence[Any], steps: int, out: str | os.PathLike, *, gpus_per_model: int = 1,
                 members: int | None = None, seed: int = 0, precision: str | None = None,
                 formats: Sequence[str] = ("zarr",), plot_variables: Sequence[str] | None = None,
                 plot_steps: Sequence[int] | None = None, verify: bool = True, cells_per_chunk: int | None = None,
                 graph: str | os.PathLike | None = None, overwrite: bool = False, verbose: bool = True,
                 attention_kernel: str | None = None, graph_kernel: str | None = None,
                 trust_model_code: bool = False, weights: str | None = None) -> ForecastResult:
    """Forecast ``steps`` lead times from each of ``dates`` (the last input state) and write the
    outputs under ``out`` (see the module docstring). Call it on every rank of the process group.

    ``source``: a bundle or checkpoint path (or, in one process, a loaded :class:`InferenceModel`);
    ``members``: ensemble members per date (None: the ensemble size the model trained with; 1 for
    deterministic models); ``precision``: ``fp32``, ``bf16``, ``fp16`` or ``fp64`` (None: the
    training precision); ``formats``: ``zarr`` (always written) and ``netcdf``; ``cells_per_chunk``:
    cells per zarr chunk (None: the largest grid slice); ``attention_kernel``: the sliding-window
    kernel for this forecast (``auto``, ``banded``, ``flex``, ``flash``; None: the model's own); ``graph_kernel``: the
    graph-transformer attention kernel (``auto``, ``csr``, ``triton``; None: the model's own); ``trust_model_code``:
    a bundle or checkpoint whose stored config names its builder as ``"package.module:attribute"`` may
    import that module (refused otherwise, before any work); ``verify``: scores and plots; ``verbose``:
    rank 0 prints its progress (a line per phase, per forecast step at most every few seconds, on
    standard error) and the scores table. ``weights``: a checkpoint's ``"averaged"`` weights (its
    ``training.weight_averaging`` average, the default where it has one) or ``"trained"`` ones.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    # a failure (a full disk included, named with out) leaves no partial forecast: rank 0 removes what it wrote,
    # and puts back what an --overwrite forecast was writing again (`replaced`, entered once the checks passed)
    with reporting(verbose and rank == 0), no_partial_output(out, OUTPUT_NAMES, remove=rank == 0), \
            contextlib.ExitStack() as replaced:
        return _run_forecast(source, dataset, dates, steps, out, gpus_per_model=gpus_per_model, members=members,
                             seed=seed, precision=precision, formats=formats, plot_variables=plot_variables,
                             plot_steps=plot_steps, verify=verify, cells_per_chunk=cells_per_chunk, graph=graph,
                             overwrite=overwrite, verbose=verbose, attention_kernel=attention_kernel,
                             graph_kernel=graph_kernel, trust_model_code=trust_model_code, replaced=replaced,
                             weights=weights)


def _lacks_window_attention(info: Any) -> bool:
    """Whether the model of ``info`` has no sliding-window attention layer, known before any work: a loaded
    model is looked at; a model of the user's own builder is built on the meta device (no memory, no
    weights; if that build fails, False: the real build reports it). A built-in model's config says it
    (:func:`~stormshard.inference.request.check_forecast_attention_kernel`)."""
    if info.prebuilt is not None:
        return not window_attention_layers(info.prebuilt.model)
    source = info.source
    if source is None or source.config.is_builtin:
        return False
    try:
        with torch.device("meta"):
            probe = build_model(source.config, source.graph, source.variables, None,
                                shard_strategy=source.shard_strategy)
    except Exception:  # noqa: BLE001 - the real build, later, raises it with its context
        return False
    return not window_attention_layers(probe)


def _run_forecast(source: str | os.PathLike | InferenceModel, dataset: str | os.PathLike,
                  dates: Any | Sequence[Any], steps: int, out: str | os.PathLike, *, gpus_per_model: int,
                  members: int | None, seed: int, precision: str | None, formats: Sequence[str],
                  plot_variables: Sequence[str] | None, plot_steps: Sequence[int] | None, verify: bool,
                  cells_per_chunk: int | None, graph: str | os.PathLike | None, overwrite: bool, verbose: bool,
                  attention_kernel: str | None = None, graph_kernel: str | None = None,
                  trust_model_code: bool = False, replaced: contextlib.ExitStack | None = None,
                  weights: str | None = None) -> ForecastResult:
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    check_environment()  # every STORMSHARD_* variable, before any work (an EnvError names it)
    flex_options_from_env()
    if attention_kernel is not None:
        check_forecast_attention_kernel(attention_kernel, device_type, precision)
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    with phase(f"forecast: opened the model {source if not isinstance(source, InferenceModel) else '(loaded)'}"):
        info = _describe(source, dataset, graph, trust_model_code, weights)
    ds = AnemoiDataset.open(dataset)
    date_list = [dates] if isinstance(dates, (str, np.datetime64)) or not isinstance(dates, Sequence) else list(dates)
    if info.prebuilt is not None and (world > 1 or gpus_per_model != 1 or precision not in (None, info.precision)):
        raise ValueError("a loaded InferenceModel runs in one process as loaded: pass the bundle or checkpoint path "
                         "for gpus_per_model > 1, several processes or another precision")
    ensemble = info.name == "ensemble"
    req = check_request(
        dataset=dataset, ds=ds, graph=info.graph, variables=info.variables, timestep=info.timestep,
        multistep=info.multistep, ensemble=ensemble, default_member_count=default_members(info.metadata, ensemble),
        dates=date_list, steps=steps, out=out, members=members, world_size=world, gpus_per_model=gpus_per_model,
        precision=precision or info.precision, formats=formats, plot_variables=plot_variables or [],
        plot_steps=plot_steps, cells_per_chunk=cells_per_chunk, verify=verify, seed=seed, overwrite=overwrite,
        model_name=info.name, train_range=info.train_range,
        model=None if isinstance(source, InferenceModel) else source)
    if attention_kernel is not None:
        model_config = info.source.config if info.source is not None else info.prebuilt.config
        check_forecast_attention_kernel(attention_kernel, device_type, req.precision,
                                        model_config.num_channels // max(1, model_config.processor.num_heads),
                                        model=model_config)
    model_config = info.source.config if info.source is not None else info.prebuilt.config
    if graph_kernel is not None:
        model_config = model_config.model_copy(update={"graph_kernel": graph_kernel})
    check_graph_kernel_for_device(model_config, device_type,  # the model's own kernel, or --graph-kernel's
                                  "--graph-kernel" if graph_kernel is not None else
                                  "the model's stored graph_kernel (override it with --graph-kernel)")
    if info.source is not None:  # the model's split over --gpus-per-model ranks, before any group is made
        try:
            check_parallel_strategy(info.source.config, info.source.shard_strategy, req.gpus_per_model)
        except ValueError as exc:
            raise ValueError(f"--gpus-per-model {req.gpus_per_model}: {exc} (here the forecast's --gpus-per-model; "
                             f"the model keeps its strategy {info.source.shard_strategy!r})") from None
    if attention_kernel not in (None, "auto") and _lacks_window_attention(info):
        raise ValueError(f"--attention-kernel {attention_kernel!r}: the model ({info.name}) has no sliding-window "
                         "attention layer to run it: leave --attention-kernel out")
    if verbose and rank == 0:
        for warning in req.warnings:  # e.g. in-sample scores
            print(warning, file=sys.stderr, flush=True)
    _barrier()  # every rank has checked before rank 0 creates anything
    if rank == 0 and overwrite and replaced is not None:  # what it writes again stays until the forecast is done
        replaced.enter_context(kept_until_replaced(forecast_outputs(
            req.out, req.date_dirs, req.formats, req.verify, req.plot_variables, req.plot_steps,
            info.variables.output_names)))

    layout = ParallelLayout(world_size=world, gpus_per_model=req.gpus_per_model)
    groups = build_process_groups(layout)
    with phase(f"forecast: built the model ({req.gpus_per_model} rank(s) per model, {world // req.gpus_per_model} "
               f"replica(s), {req.precision})"):
        # on this rank's GPU where there is one: the kernel checks above assumed it, and NCCL (the backend of a
        # CUDA machine) takes no CPU tensor
        forecaster = info.prebuilt or build_forecaster(info.source, groups.model_group, PRECISIONS[req.precision],
                                                       device=rank_device())
        if attention_kernel is not None and not set_attention_kernel(forecaster.model, attention_kernel) and \
                attention_kernel != "auto":  # a custom model without sliding-window attention: nothing to switch
            raise ValueError(f"--attention-kernel {attention_kernel!r}: the model ({info.name}) has no sliding-window "
                             "attention layer to run it: leave --attention-kernel out")
        if graph_kernel is not None:
            set_graph_kernel(forecaster.model, graph_kernel)
    plan = forecaster.model.plan
    exchange = ChunkExchange(plan.data_sizes, req.cells_per_chunk or max(plan.data_sizes), groups.model_group)
    v = forecaster.variables
    names = list(v.output_names)
    frequency = parse_frequency(req.step_text)
    stores = [DateOutputs(d).store for d in req.date_dirs]
    valid = [ds.dates[req.indices(i)[req.multistep:]] for i in range(len(stores))]
    if rank == 0:
        for i, path in enumerate(stores):
            path.parent.mkdir(parents=True, exist_ok=True)
            ForecastStore.create(
                path, valid_dates=valid[i], latitudes=ds.latitudes, longitudes=ds.longitudes, variables=names,
                members=req.members, frequency=frequency, cells_per_chunk=exchange.chunk,
                attributes={"initial_date": str(req.init_dates[i]), "source": "stormshard forecast",
                            "ensemble_members": req.members, "model_step": info.metadata.get("step"),
                            "precision": req.precision, "description": "forecast: data[k] is valid at dates[k]"})
    _barrier()

    # ---- the sharded rollout, written chunk by chunk
    stats = [StoreStatistics(len(names)) for _ in stores]
    handles = [ForecastStore(p) for p in stores]
    cells = plan.data_slice
    ds_cols = [ds.variables.index(n) for n in v.variables]
    _barrier()
    start = time.perf_counter()
    for d, member_ids in replica_tasks(len(stores), req.members, layout.data_parallel_size, groups.data_parallel_rank):
        raw = ds.read(req.indices(d), cells=cells)[:, ds_cols, 0]  # (time, model's dataset variables, cells_local)
        data = torch.from_numpy(rearrange(raw.astype(np.float64), "t v c -> t c v"))
        b = len(member_ids)
        states = data[: req.multistep][..., v.input_idx].unsqueeze(0).expand(b, -1, -1, -1)
        forcings = data[req.multistep: req.multistep + req.steps - 1][..., v.input_idx].unsqueeze(0)
        forcings = forcings.expand(b, -1, -1, -1)
        noise = None
        if ensemble:
            device = next(forecaster.model.parameters()).device
            gens = [member_generator(req.seed, req.init_dates[d], m, device) for m in member_ids]
            noise = member_noise(forecaster.model, gens)
        task = f"forecast {req.init_dates[d]}" + (f" members {member_ids[0]}-{member_ids[-1]}" if len(member_ids) > 1
                                                  else f" member {member_ids[0]}" if req.members > 1 else "")
        tic = time.perf_counter()
        for k, pred in enumerate(rollout_steps(forecaster, states.to(device=_device(forecaster)),
                                               forcings.to(device=_device(forecaster)), noise)):
            owned = exchange.exchange(rearrange(pred.float(), "b c v -> c b v")).cpu().numpy()  # (owned, b, v)
            for j, m in enumerate(member_ids):
                values = owned[:, j].T  # (variables, owned cells)
                handles[d].write(k, m, exchange.owned, values)
                stats[d].add(values)
            last = k + 1 == req.steps
            note(f"{task}: step {k + 1}/{req.steps} ({format_duration(time.perf_counter() - tic)})", throttle=not last)
    _barrier()
    rollout_s = time.perf_counter() - start
    note(f"forecast: rollout of {len(stores)} date(s) x {req.members} member(s) x {req.steps} step(s) done in "
         f"{format_duration(rollout_s)}" + (f" (replica 0 of {layout.data_parallel_size} shown)"
                                             if layout.data_parallel_size > 1 else ""))
    reduce_statistics(stats)
    for i, h in enumerate(handles):
        if i % world == rank:
            h.finalise(stats[i])
    _barrier()

    lead_hours = [float((t - req.init_dates[0]) / np.timedelta64(1, "h")) for t in valid[0]]
    result = ForecastResult(req, stores, lead_hours)
    total = len(stores) * req.members * req.steps
    result.timings = {"rollout_s": rollout_s, "forecast_steps": total, "steps_per_s": total / rollout_s}
    _postprocess(req, info, ds, forecaster, result, valid, names, rank, world, verbose)
    return result


def _device(forecaster: InferenceModel) -> torch.device:
    return next(forecaster.model.parameters()).device


def _postprocess(req: ForecastRequest, info: _Model, ds: AnemoiDataset, forecaster: InferenceModel,
                 result: ForecastResult, valid: list[np.ndarray], names: list[str], rank: int, world: int,
                 verbose: bool) -> None:
    """netCDF, scores and maps per date (dates dealt over the ranks); combined scores on rank 0."""
    run = RunOutputs(req.out)
    clim_path = run.climatology
    if req.verify:
        if rank == 0:
            with phase(f"forecast: climatology of the training period {clim_path}"):
                compute_climatology(ds, names, *info.train_range).save(clim_path)
        _barrier()
        clim = Climatology.load(clim_path)
    units = variable_units(ds)
    weights = forecaster.graph["data"].area_weight.double().numpy()
    out_cols = [ds.variables.index(n) for n in names]
    files: dict[str, Any] = {"forecast": result.stores, "netcdf": [], "maps": [], "scores": []}
    for i, path in enumerate(result.stores):
        if i % world != rank:
            continue
        date = DateOutputs(req.date_dirs[i])
        when = req.init_dates[i]
        if "netcdf" in req.formats:
            with phase(f"forecast {when}: wrote {date.netcdf}"):
                files["netcdf"].append(write_netcdf(path, date.netcdf, init_date=when,
                                                    units=units, attributes={"members": req.members}))
        if not (req.verify or req.plot_variables):
            continue
        members = result.read(i)
        idx = req.indices(i)
        obs = rearrange(ds.read(idx[req.multistep - 1:])[:, out_cols, 0].astype(np.float64), "t v c -> t c v")
        truth, persistence = obs[1:], obs[0]
        if req.verify:
            with phase(f"forecast {when}: scored, {date.scores}"):
                scores = score_forecast(members.astype(np.float64), truth, persistence, clim.at(valid[i]), weights,
                                        names)
                result.per_date[str(when)] = scores
                date.scores.write_text(json.dumps(
                    _report(req, [when], valid[i], result.lead_hours, scores, clim), indent=1))
                files["scores"].append(date.scores)
        if req.plot_variables:
            with phase(f"forecast {when}: maps in {date.maps}"):
                files["maps"] += plot_maps(members.mean(axis=0), truth, names, list(req.plot_variables),
                                           list(req.plot_steps), ds.latitudes, ds.longitudes, when,
                                           valid[i], date.maps)
    _barrier()
    if req.verify and rank == 0:
        per_date = [json.loads(DateOutputs(d).scores.read_text())["scores"] for d in req.date_dirs]
        result.per_date = {str(d): s for d, s in zip(req.init_dates, per_date, strict=True)}
        result.scores = combine_scores(per_date, req.members)
        report = _report(req, list(req.init_dates), valid[0] if len(valid) == 1 else None, result.lead_hours,
                         result.scores, clim)
        if len(req.date_dirs) > 1:
            run.summary.write_text(json.dumps(report, indent=1))
        title = f"{len(req.init_dates)} initial date(s), {req.members} member(s)"
        with phase(f"forecast: score plots in {run.plots}"):
            files["plots"] = plot_scores(result.scores, result.lead_hours, run.plots, title)
        files["summary"] = run.summary
        if verbose:
            print(format_scores(report))
    result.files = files


def _report(req: ForecastRequest, inits: list[np.datetime64], valid: np.ndarray | None, lead_hours: list[float],
            scores: dict[str, dict[str, list[float]]], clim: Climatology) -> dict[str, Any]:
    out = {"init_dates": [str(d) for d in inits], "members": req.members, "lead_hours": lead_hours,
           "precision": req.precision, "gpus_per_model": req.gpus_per_model,
           "climatology": {"period": list(clim.period), "dates": clim.samples, "hours": clim.hours},
           "scores": scores}
    if valid is not None:
        out["valid_dates"] = [str(d) for d in valid]
    return out


def format_scores(report: dict[str, Any]) -> str:
    """Table per variable and lead time: RMSE model / persistence / climatology and ACC (and CRPS,
    spread/skill for ensembles)."""
    leads = report["lead_hours"]
    inits = report["init_dates"]
    head_init = inits[0] if len(inits) == 1 else f"{len(inits)} initial dates"
    lines = [f"scores against the dataset, {head_init}, {report['members']} member(s)"]
    head = f"{'variable':<16}{'score':<18}" + "".join(f"{f'+{h:g}h':>11}" for h in leads)
    lines += [head, "-" * len(head)]
    for name, s in report["scores"].items():
        for key in ("rmse", "rmse_persistence", "rmse_climatology", "acc", "acc_persistence", "crps", "spread_skill"):
            if key in s:
                lines.append(f"{name:<16}{key:<18}" + "".join(f"{x:>11.4g}" for x in s[key]))
    return "\n".join(lines)
