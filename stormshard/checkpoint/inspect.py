"""Describe a checkpoint (training, consolidated, or an inference bundle) from its metadata:
layout, step, parameter names, local and full shapes, partitions and sizes, and its weight average
(``training.weight_averaging``) where it has one. Reads no tensors."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from stormshard.checkpoint.consolidate import CONSOLIDATED_FORMAT, checked_metadata, resolve_checkpoint
from stormshard.checkpoint.errors import ConversionError
from stormshard.checkpoint.integrity import FILES, checkpoint_problems, file_problems
from stormshard.checkpoint.stored_config import stored_shard_strategy

__all__ = ["inspect_checkpoint", "format_inspection", "human_bytes", "verify_checkpoint"]

_ITEMSIZE = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4, "bool": 1}


def human_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _numel(shape: list[int]) -> int:
    out = 1
    for s in shape:
        out *= int(s)
    return out


def _files(path: Path) -> dict[str, int]:
    return {f.name: f.stat().st_size for f in sorted(path.iterdir()) if f.is_file()}


def _bundle_metadata(path: Path) -> dict[str, Any] | None:
    """The ``metadata.json`` of the bundle ``path``; None for anything else (a checkpoint, read after). A
    ``metadata.json`` that is not JSON is a :class:`ConversionError` naming it."""
    file = path / "metadata.json"
    if not file.is_file():
        return None
    try:
        meta = json.loads(file.read_text())
    except (OSError, ValueError) as exc:  # ValueError: not JSON, or not UTF-8
        raise ConversionError(f"{file} cannot be read ({exc}): the bundle or checkpoint is damaged",
                              fix="export or copy it again") from None
    return meta if isinstance(meta, dict) and meta.get("format") == "stormshard-bundle" else None


def inspect_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """A JSON-able summary: kind, step, layout, parameters (name, shape, full shape, partition),
    parameter count, bytes of the full model and of the files on disk."""
    p = Path(path)
    meta = _bundle_metadata(p)
    if meta is not None:
        params = [{"name": r["name"], "shape": r["shape"], "full_shape": r["shape"], "partition": None}
                  for r in meta["parameters"]]
        kind, layout, world = "inference bundle", {"world_size": 1, "gpus_per_model": 1}, 1
        model, experiment = meta["model"], meta.get("experiment") or {"model": meta["model"]}
    else:
        p = resolve_checkpoint(p)
        meta = checked_metadata(p)
        experiment = meta.get("config", {})
        model = experiment.get("model", {})
        if meta.get("format") == CONSOLIDATED_FORMAT:
            kind, layout, world = "consolidated", {"world_size": 1, "gpus_per_model": 1}, 1
            params = [{"name": r["name"], "shape": r["shape"], "full_shape": r["shape"], "partition": None,
                       "dtype": r["dtype"]} for r in meta["parameters"]]
        else:
            if "ranks" not in meta or not meta["ranks"]:
                raise ConversionError(f"{p}/metadata.json has no rank tables: not a stormshard training checkpoint")
            kind, layout, world = "training", meta["layout"], int(meta["world_size"])
            params = [dict(r) for r in meta["ranks"][0]["parameters"]]
    average = _weight_average(kind, meta, experiment)
    numel = sum(_numel(r["full_shape"]) for r in params)
    nbytes = sum(_numel(r["full_shape"]) * _ITEMSIZE.get(r.get("dtype", "float32"), 4) for r in params)
    files = _files(p)
    return {
        "path": str(p), "kind": kind, "step": meta.get("step"), "world_size": world, "layout": layout,
        "model": {"name": model.get("name"), "shard_strategy": stored_shard_strategy(experiment),
                  "num_channels": model.get("num_channels")},
        "engine": meta.get("config", {}).get("engine") if kind == "training" else None,
        "zero_stage": ((meta.get("config", {}).get("deepspeed") or {}).get("zero_optimization") or {}).get("stage")
        if kind == "training" else None,
        "num_parameters": numel, "model_bytes": nbytes,
        "partitioned": sum(1 for r in params if r.get("partition")),
        "parameters": params, "files": files, "files_bytes": sum(files.values()), "weight_average": average,
    }


def _weight_average(kind: str, meta: dict[str, Any], experiment: dict[str, Any]) -> dict[str, Any] | None:
    """What the metadata says of a weight average (``training.weight_averaging``), None when there is none:
    ``{"where", "settings"}`` plus ``updates`` / ``last_step`` where recorded (consolidated, bundle). A training
    checkpoint's rank files hold one when its run's config (saved with it) has the setting on."""
    if kind == "inference bundle":
        info = meta.get("weight_average") if meta.get("weights") == "averaged" else None
        return None if not isinstance(info, dict) else {"where": "model.safetensors (the bundle's weights)", **info}
    if kind == "consolidated":
        info = meta.get("weight_average")
        return None if not isinstance(info, dict) else {"where": "average.safetensors", **info}
    settings = (experiment.get("training") or {}).get("weight_averaging")
    return {"where": "the rank files", "settings": settings} if isinstance(settings, dict) else None


def _describe_average(average: dict[str, Any]) -> str:
    settings = average.get("settings") or {}
    parts = [str(settings.get("kind", "?")).upper()]
    if settings.get("kind") == "ema" and "decay" in settings:
        parts.append(f"decay {settings['decay']}")
    if "start_step" in settings:
        parts.append(f"from step {settings['start_step']}, every {settings.get('every_n_steps', 1)} step(s)")
    text = f"{parts[0]} ({', '.join(parts[1:])})" if len(parts) > 1 else parts[0]
    if "updates" in average:
        text += f", {average['updates']} updates (last at step {average.get('last_step')})"
    return f"{text}, in {average['where']}"


def format_inspection(info: dict[str, Any], parameters: bool = True) -> str:
    """Human-readable text of :func:`inspect_checkpoint`'s summary."""
    lay = info["layout"]
    lines = [
        f"{info['kind']} checkpoint {info['path']}",
        f"  step {info['step']}; world {info['world_size']}, gpus_per_model {lay.get('gpus_per_model')}"
        + (f", engine {info['engine']} (ZeRO {info['zero_stage']})" if info["engine"] else ""),
        f"  model {info['model']['name']} ({info['model']['shard_strategy']}), {info['model']['num_channels']} "
        f"channels; {info['num_parameters']:,} parameters = {human_bytes(info['model_bytes'])}; "
        f"{info['partitioned']} tensors sliced per rank",
        f"  files: {len(info['files'])}, {human_bytes(info['files_bytes'])} on disk",
    ]
    average = info.get("weight_average")
    if average is not None:
        lines.append(f"  weight average: {_describe_average(average)}" + (
            "; export, consolidate, reshard and forecasts take it (--weights trained: the trained weights)"
            if info["kind"] != "inference bundle" else ""))
    elif info["kind"] == "inference bundle":
        lines.append("  weights: as trained (no weight average)")
    if info.get("verified"):
        v = info["verified"]
        lines.append(f"  verified: {v['files']} files, {human_bytes(v['bytes'])}: sizes and sha256 as recorded")
    if parameters:
        width = max((len(r["name"]) for r in info["parameters"]), default=10)
        lines.append(f"  {'name':<{width}}  {'full shape':<16} {'rank 0 shape':<16} partition")
        for r in info["parameters"]:
            part = r.get("partition")
            ptxt = f"dim {part['dim']} / {part['parts']} parts" if part else "replicated"
            lines.append(f"  {r['name']:<{width}}  {str(r['full_shape']):<16} {str(r['shape']):<16} {ptxt}")
    return "\n".join(lines)


def verify_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Every file of a bundle, a consolidated or a training checkpoint (a checkpoints directory: its latest
    complete step) against the size and sha256 recorded when it was written (``inspect --verify``): ``{"path",
    "kind", "files", "bytes"}`` when all match; a :class:`ConversionError` listing each damaged file otherwise,
    or naming the files when nothing was recorded (written before checksums)."""
    p = Path(path)
    bundle = _bundle_metadata(p)
    if bundle is None:
        p = resolve_checkpoint(p)
        meta = checked_metadata(p)
        kind = "consolidated" if meta.get("format") == CONSOLIDATED_FORMAT else "training"
    else:
        meta, kind = bundle, "inference bundle"
    records = meta.get(FILES)
    if not isinstance(records, dict) or not records:
        raise ConversionError(f"{p}: no checksums were recorded (a {kind} written before they were): its files cannot "
                              "be verified", fix="write it again (export, consolidate or save) to record them")
    problems = checkpoint_problems(p, contents=True) if kind == "training" else file_problems(p, records)
    if problems:
        raise ConversionError(f"{p}: damaged {kind}:", problems,
                              fix="copy it again from where it was written, or use an earlier checkpoint")
    return {"path": str(p), "kind": kind, "files": len(records),
            "bytes": sum(int(r.get("bytes", 0)) for r in records.values() if isinstance(r, dict))}
