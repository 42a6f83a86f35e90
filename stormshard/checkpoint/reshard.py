"""Reshard a checkpoint to another layout (``gpus_per_model`` K, shard strategy S): a training
checkpoint from which ``launch/train.py --resume`` continues on ``K x replicas`` processes.

Steps: consolidate (or read a consolidated checkpoint), rewrite the stored config's ``parallel``
section (:func:`retarget_config`: plain JSON, checked below training: the model and graph sections,
the strategy over the new model group, the layout), lay out the target model rank by rank on the
meta device (the layers say which parameters they slice, see :mod:`stormshard.checkpoint.groups`),
check the full tensors against it (missing, extra, wrong shapes: one error lists them), slice
weights and AdamW moments along each target partition, and write the per-rank files of the
checkpoint format (:mod:`stormshard.checkpoint.format`: ``rank_NNNNN.pt`` with the engine state,
data position and RNG, as tensors plus JSON; ``rank_NNNNN.safetensors``; ``metadata.json`` with
each file's sha256; ``latest``) into a temporary
directory that is renamed at the end: nothing is written on failure. The written config holds the
strategy as ``parallel.shard_strategy`` (an old ``model.processor.shard_strategy`` is dropped).

The number of data-parallel replicas stays the same (the data position is per replica); the
engine and its precision stay the same. Supported engine states: ``local`` and ``ddp`` (fp32 or
bf16 autocast: fp32 parameters), ``deepspeed`` ZeRO 0 fp32 (a torch optimizer state) and
DeepSpeed's flat fp32 master (ZeRO 1/2 partitions in fp32 or bf16; bf16 at ZeRO 0), without PowerSGD
state. The target ranks get the consolidated fp32 master weights and moments, re-partitioned
(:func:`~stormshard.checkpoint.zero.flatten_zero`); DeepSpeed loads them with
``load_from_fp32_weights=True`` (and a bf16 module rounds the same fp32 weights), so nothing is
lost in a bf16 run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import Tensor

from stormshard.checkpoint.averaged_weights import AVERAGE_STATE_KEY
from stormshard.checkpoint.consolidate import (
    ConsolidatedCheckpoint,
    atomic_directory,
    check_output_path,
    load_any,
    resolve_checkpoint,
    save_safetensors,
)
from stormshard.checkpoint.errors import ConversionError
from stormshard.checkpoint.format import (
    FORMAT_VERSION,
    LATEST,
    METADATA,
    parameter_table,
    rank_name,
    step_name,
)
from stormshard.checkpoint.groups import model_on_meta
from stormshard.checkpoint.integrity import FILES, record_files
from stormshard.checkpoint.sources import full_shapes, model_sources, state_differences
from stormshard.checkpoint.state_codec import write_state_file
from stormshard.checkpoint.stored_config import (
    StoredConfig,
    check_checkpoint_builder,
    stored_layout,
    stored_shard_strategy,
)
from stormshard.checkpoint.zero import flatten_flat_master, flatten_zero
from stormshard.errors import kept_until_replaced
from stormshard.models.parallelize import check_parallel_strategy
from stormshard.parallel.partition import Partition, get_partition
from stormshard.parallel.shard import SHARD_STRATEGIES
from stormshard.parallel.tensor import slice_partition
from stormshard.progress import note

__all__ = ["retarget_config", "reshard_checkpoint", "check_reshard_out"]


def retarget_config(config: Mapping[str, Any], gpus_per_model: int, shard_strategy: str | None) -> StoredConfig:
    """The stored experiment config ``config`` for ``gpus_per_model`` ranks per model and processor
    strategy ``shard_strategy`` (None: the stored one), written as ``parallel.gpus_per_model`` and
    ``parallel.shard_strategy``; validated: its sections, and the strategy over the new group size."""
    if isinstance(gpus_per_model, bool) or not isinstance(gpus_per_model, int) or gpus_per_model < 1:
        raise ConversionError(f"--gpus-per-model must be a positive integer, got {gpus_per_model!r}")
    if shard_strategy is not None and shard_strategy not in SHARD_STRATEGIES:
        raise ConversionError(f"--shard-strategy {shard_strategy!r} is unknown: use one of {SHARD_STRATEGIES}")
    raw = json.loads(json.dumps(dict(config)))
    strategy = shard_strategy or stored_shard_strategy(raw)
    par = dict(raw.get("parallel") or {})
    par["gpus_per_model"] = gpus_per_model
    par.pop("tensor_model_parallel_size", None)  # an old spelling of gpus_per_model (and "tensor")
    if par.get("read_group_size") is not None and gpus_per_model % par["read_group_size"]:
        par["read_group_size"] = None
    par["shard_strategy"] = strategy
    raw["parallel"] = par
    processor = (raw.get("model") or {}).get("processor")
    if isinstance(processor, dict):
        processor.pop("shard_strategy", None)  # the old spelling; parallel.shard_strategy holds it now
    stored = StoredConfig.read(raw)
    try:
        check_parallel_strategy(stored.model, strategy, gpus_per_model)
    except ValueError as exc:
        raise ConversionError(f"the target layout is not valid for this model: {exc}",
                              fix="choose --gpus-per-model / --shard-strategy the model can be split into") from None
    return stored


def _slice(full: Tensor, part: Partition | None) -> Tensor:
    return full.clone() if part is None else slice_partition(full, part).clone()


def _optimizer_for_rank(opt: dict[str, Any], names: list[str], parts: dict[str, Partition | None],
                        shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """A torch optimizer state dict for one target rank (positions = its parameter order)."""
    position = {n: i for i, n in enumerate(names)}
    state = {}
    for name in names:
        entry = {}
        for key, value in opt["state"][name].items():
            if isinstance(value, Tensor) and value.dim() > 0 and tuple(value.shape) == shapes[name]:
                entry[key] = _slice(value, parts[name])
            else:
                entry[key] = value.clone() if isinstance(value, Tensor) else value
        state[position[name]] = entry
    groups = []
    for g in opt["param_groups"]:
        hyper = {k: v for k, v in g.items() if k != "param_names"}
        hyper["params"] = [position[n] for n in g["param_names"]]
        groups.append(hyper)
    return {"state": state, "param_groups": groups}


def _check_engine(ckpt: ConsolidatedCheckpoint, cfg: StoredConfig) -> None:
    engine = ckpt.engine.get("engine")
    if ckpt.optimizer is None:
        stage = ckpt.engine.get("zero_stage")
        raise ConversionError(
            f"cannot reshard a checkpoint of engine {engine!r} at ZeRO stage {stage}: {ckpt.optimizer_note}",
            fix="resume the source run for a step with a supported engine state (local, ddp, or DeepSpeed ZeRO "
                "0-2, fp32 or bf16) and reshard that checkpoint; `consolidate` and `export` work on this one "
                "(weights only)")
    if engine == "deepspeed" and ckpt.engine.get("zero_stage", 0) > 0 and "zero_extras" not in ckpt.engine:
        raise ConversionError(f"the ZeRO stage {ckpt.engine.get('zero_stage')} checkpoint lacks its DeepSpeed "
                              "optimizer fields", fix="consolidate the training checkpoint again")
    if ckpt.engine.get("compressor") is not None:
        raise ConversionError(
            "the checkpoint holds PowerSGD compressor state (error feedback per data-parallel rank): reshard does "
            "not convert it", fix="reshard a checkpoint of a run without compression")
    if engine == "deepspeed" and cfg.raw.get("engine") != "deepspeed" or engine not in ("deepspeed", "local", "ddp"):
        raise ConversionError(f"unknown engine state {engine!r} in the checkpoint")


RESUME_CONFIG = "resume_config.json"


def check_reshard_out(out: str | os.PathLike, overwrite: bool = False) -> None:
    """A :class:`ConversionError` naming ``--out`` when, without ``overwrite``, the checkpoints directory
    ``out`` already holds a checkpoint (a ``step_NNNNNNNN``, ``latest``) or a ``resume_config.json``:
    resharding there would repoint another run's ``latest`` and replace its files. Other files stay
    allowed (reshard writes beside them). An ``out`` that is a file (or a link to one) is an error even with
    ``overwrite``: reshard writes into a directory."""
    p = Path(out)
    if (p.exists() or p.is_symlink()) and not p.is_dir():
        raise ConversionError(f"--out {out} is a file, not a checkpoints directory: reshard writes step_NNNNNNNN, "
                              f"{LATEST} and {RESUME_CONFIG} into a directory",
                              fix="choose a directory (e.g. runs/NEW/checkpoints) for --out")
    if overwrite or not p.is_dir():
        return
    taken = sorted(c.name for c in p.iterdir() if c.name in (LATEST, RESUME_CONFIG) or c.name.startswith("step_"))
    if taken:
        raise ConversionError(f"--out {out} already holds {', '.join(taken[:4])}{' ...' if len(taken) > 4 else ''}: "
                              f"reshard would replace its {LATEST} and {RESUME_CONFIG}",
                              fix="choose a new --out (e.g. runs/NEW/checkpoints) or pass --overwrite")


def reshard_checkpoint(source: str | os.PathLike, out: str | os.PathLike, gpus_per_model: int,
                       shard_strategy: str | None = None, *, world_size: int | None = None,
                       dataset: str | os.PathLike | None = None, graph: str | os.PathLike | None = None,
                       overwrite: bool = False, trust_model_code: bool = False) -> Path:
    """Write a training checkpoint for ``gpus_per_model`` (and ``shard_strategy``) into the
    checkpoints directory ``out`` (``out/step_NNNNNNNN``, ``out/latest`` and
    ``out/resume_config.json``, the config to resume with). ``world_size`` defaults to
    ``gpus_per_model x`` the source's replicas, which it must keep; ``trust_model_code``: the stored
    config may name a builder module to import. Returns the step directory."""
    check_output_path(source, out, overwrite)
    check_reshard_out(out, overwrite)  # before the checkpoint is read
    check_checkpoint_builder(source, trust_model_code)
    ckpt = load_any(source)
    cfg = retarget_config(ckpt.config, gpus_per_model, shard_strategy)
    _check_engine(ckpt, cfg)
    replicas = len(ckpt.replicas)
    world = gpus_per_model * replicas if world_size is None else world_size
    layout = stored_layout(cfg.raw, world)
    if layout.data_parallel_size != replicas:
        raise ConversionError(
            f"the target world {world} / gpus_per_model {gpus_per_model} gives {layout.data_parallel_size} "
            f"data-parallel replicas, the checkpoint has {replicas}: the data position is kept per replica",
            fix=f"use --world-size {gpus_per_model * replicas}")
    src = model_sources(cfg, resolve_checkpoint(source), dataset, graph)

    # ---- lay out the target, check the tensors against it (before anything is written)
    targets = [model_on_meta(cfg.model, cfg.shard_strategy, src.graph, src.variables, r, gpus_per_model)
               for r in range(gpus_per_model)]
    shapes = full_shapes(targets[0])
    problems = state_differences(ckpt.model, shapes)
    if ckpt.average is not None:
        problems += [f"{p} (weight average)" for p in state_differences(ckpt.average, shapes)]
    if ckpt.optimizer is not None:
        have = set(ckpt.optimizer["state"])
        problems += [f"{n}: no optimizer state" for n in sorted(set(shapes) - have)]
        problems += [f"{n}: optimizer state for a tensor the model does not have" for n in sorted(have - set(shapes))]
    if problems:
        raise ConversionError(f"{source} does not match the model of its config:", problems,
                              fix="convert with the config, dataset and graph the checkpoint was trained with")

    step = ckpt.step
    config_json = cfg.raw
    layout_json = dataclasses.asdict(layout)
    tables = [parameter_table(t) for t in targets]
    out = Path(out)
    # with --overwrite, what it writes again (the step, latest, resume_config.json) stays until all is written
    replaced = [out / step_name(step), out / LATEST, out / RESUME_CONFIG] if overwrite else []
    with kept_until_replaced(replaced):
        with atomic_directory(out / step_name(step), overwrite) as tmp:
            for rank in range(world):
                note(f"checkpoint: writing rank {rank + 1}/{world} of {out / step_name(step)}", throttle=rank > 0)
                model_rank, replica = rank % gpus_per_model, rank // gpus_per_model
                target = targets[model_rank]
                names = [n for n, _ in target.named_parameters()]
                parts = {n: get_partition(p) for n, p in target.named_parameters()}
                module = {n: _slice(ckpt.model[n], parts[n]) for n in names}
                engine = dict(ckpt.engine)
                engine["module"] = module
                if "zero_extras" in ckpt.engine:  # DeepSpeed ZeRO 1/2: flat partitions over the replicas
                    local = {n: {k: (_slice(t, parts[n]) if isinstance(t, Tensor) and t.dim() > 0 and
                                     tuple(t.shape) == shapes[n] else t) for k, t in ckpt.optimizer["state"][n].items()}
                             for n in names}
                    hyper = [{k: v for k, v in g.items() if k != "param_names"} for g in ckpt.optimizer["param_groups"]]
                    engine.pop("zero_extras")
                    engine["optimizer"] = flatten_zero(ckpt.engine["zero_extras"], hyper, names, module, local,
                                                       replicas, replica)
                elif "flat_master_extras" in ckpt.engine:  # bf16 at ZeRO 0: the unpartitioned fp32 master
                    local = {n: {k: (_slice(t, parts[n]) if isinstance(t, Tensor) and t.dim() > 0 and
                                     tuple(t.shape) == shapes[n] else t) for k, t in ckpt.optimizer["state"][n].items()}
                             for n in names}
                    hyper = [{k: v for k, v in g.items() if k != "param_names"} for g in ckpt.optimizer["param_groups"]]
                    engine.pop("flat_master_extras")
                    engine["optimizer"] = flatten_flat_master(ckpt.engine["flat_master_extras"], hyper, names, module,
                                                              local)
                else:
                    engine["optimizer"] = _optimizer_for_rank(ckpt.optimizer, names, parts, shapes)
                rep = ckpt.replicas[replica]
                state = {"engine": engine, "data": rep["data"], "step": step}
                if ckpt.average is not None:  # training.weight_averaging: sliced as its parameters are
                    state[AVERAGE_STATE_KEY] = {**ckpt.average_info,
                                                "tensors": {n: _slice(ckpt.average[n], parts[n]) for n in names}}
                payload = {"format": FORMAT_VERSION, "step": step, "rank": rank, "world": world, "state": state,
                           "rng": rep["rng"]}
                name = rank_name(rank)
                write_state_file(payload, tmp / f"{name}.pt")
                save_safetensors(module, tmp / f"{name}.safetensors", {"step": str(step), "rank": str(rank)})
                (tmp / f"{name}.json").write_text(json.dumps({"rank": rank, "parameters": tables[model_rank]}))
            metadata = {"format": FORMAT_VERSION, "step": step, "world_size": world, "time": time.time(),
                        "layout": layout_json, "config": config_json,
                        "ranks": [{"rank": r, "parameters": tables[r % gpus_per_model]} for r in range(world)],
                        "resharded_from": {"layout": ckpt.source_layout, "path": str(source)}}
            metadata[FILES] = record_files(sorted(tmp.iterdir()))
            (tmp / METADATA).write_text(json.dumps(metadata, indent=1))
        (out / f"{LATEST}.part").write_text(step_name(step) + "\n")
        os.replace(out / f"{LATEST}.part", out / LATEST)
        resume = dict(config_json)
        if out.name == "checkpoints":
            resume["training"] = {**resume["training"], "output_dir": str(out.parent)}
        (out / f"{RESUME_CONFIG}.part").write_text(json.dumps(resume, indent=1))  # never rewritten in place
        os.replace(out / f"{RESUME_CONFIG}.part", out / RESUME_CONFIG)
        return out / step_name(step)
