"""Consolidate a training checkpoint of any layout into one full-model checkpoint.

Driven by the metadata every training checkpoint carries (``metadata.json``: the layout and, per
rank, each parameter's local shape, full shape and :class:`~stormshard.parallel.partition.Partition`):

- a partitioned (tensor-parallel) parameter is the concatenation, along its partition ``dim``, of
  the slices of the ``parts`` ranks of its model group, in ``index`` order; every slice must be
  there with its balanced size;
- a replicated parameter is taken from the model group's first rank, and every other rank of the
  group must hold an identical copy;
- data-parallel replicas (model groups) must hold identical full tensors.

Optimizer state (AdamW ``exp_avg`` / ``exp_avg_sq``, any per-parameter tensor of the parameter's
shape) follows its parameter's partition; scalars (``step``) are taken from the first rank.
Supported formats: a torch ``state_dict`` keyed by parameter position (engines ``local``, ``ddp``
and ``deepspeed`` at ZeRO 0, fp32; ``local`` / ``ddp`` in bf16, whose parameters are fp32), and
DeepSpeed's flat fp32 partitions over the data-parallel group, ZeRO 1/2 in fp32 or bf16, and the
unpartitioned flat fp32 master of bf16 at ZeRO 0 (unflattened per model rank first, see
:mod:`stormshard.checkpoint.zero`).

Weights of DeepSpeed runs come from the optimizer's **fp32 master** partitions, not from the
module: in a bf16 run the module holds bf16 copies, and the consolidated fp32 weights equal the
engine's fp32 master exactly (and the AdamW moments are its fp32 moments). Each module tensor must
equal its master rounded to the module's dtype, else the checkpoint is refused as inconsistent.
Any other optimizer format keeps the module weights and leaves the optimizer state out
(``optimizer_note`` says why); :func:`~stormshard.checkpoint.reshard.reshard_checkpoint` then
refuses it with an error naming the stage and the fix.

The consolidated checkpoint on disk (:func:`save_consolidated`)::

    <out>/metadata.json     format "stormshard-consolidated", version 2, step, config, source layout,
                            parameters, files (size and sha256 of the others)
    <out>/model.safetensors full tensors, the keys and shapes of the single-process model
    <out>/optimizer.pt      {"param_groups": [...], "state": {name: {"step", "exp_avg", ...}}} (if any)
    <out>/trainer.pt        scheduler, engine counters, per-replica data position and RNG states

``optimizer.pt`` and ``trainer.pt`` hold tensors plus a JSON skeleton
(:mod:`stormshard.checkpoint.state_codec`, ``torch.load(weights_only=True)``); version 1 pickled
them and is read only by ``convert_checkpoint.py upgrade``.

Conversion never writes into its source: ``--out`` equal to or inside the source, or (with
``--overwrite``) a source inside ``--out``, is refused before anything is read or written
(:func:`check_output_path`).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from stormshard.checkpoint.averaged_weights import AVERAGE_STATE_KEY, average_info
from stormshard.checkpoint.conversion_output import atomic_directory, check_output_free, save_safetensors
from stormshard.checkpoint.errors import ConversionError, check_metadata
from stormshard.checkpoint.format import FORMAT_VERSION as TRAINING_FORMAT
from stormshard.checkpoint.format import (
    METADATA,
    PICKLED_FORMAT,
    CheckpointError,
    latest_checkpoint,
    pickled_format_error,
    rank_name,
    read_metadata,
)
from stormshard.checkpoint.integrity import FILES, checkpoint_problems, file_problems, record_files
from stormshard.checkpoint.state_codec import read_state_file, write_state_file
from stormshard.checkpoint.zero import (
    flat_master_extras,
    is_flat_master_state,
    is_zero_state,
    unflatten_flat_master,
    unflatten_zero,
    zero_extras,
)
from stormshard.parallel.partition import Partition
from stormshard.parallel.topology import ParallelLayout
from stormshard.progress import note as progress_note
from stormshard.progress import phase

__all__ = [
    "CONSOLIDATED_FORMAT",
    "ConsolidatedCheckpoint",
    "resolve_checkpoint",
    "checked_metadata",
    "load_rank_payloads",
    "consolidate_checkpoint",
    "save_consolidated",
    "load_consolidated",
    "load_any",
    "atomic_directory",
    "check_output_path",
    "check_output_free",
]

CONSOLIDATED_FORMAT = "stormshard-consolidated"
CONSOLIDATED_VERSION = 2  # 1: optimizer.pt / trainer.pt pickled (read only by `convert_checkpoint.py upgrade`)
_ZERO_FIX = ("re-run (or resume) the source for one step with deepspeed.zero_optimization.stage=0 to get a "
             "convertible optimizer state, or use `consolidate`/`export`, which keep the weights")


@dataclass
class ConsolidatedCheckpoint:
    """A full (single-process) model state plus what resuming needs, independent of the layout."""

    step: int
    config: dict[str, Any]
    source_layout: dict[str, Any]
    model: dict[str, Tensor]
    optimizer: dict[str, Any] | None  # {"param_groups": [...], "state": {name: {...}}}
    optimizer_note: str = ""
    engine: dict[str, Any] = field(default_factory=dict)  # engine name, zero stage, counters, scheduler
    replicas: list[dict[str, Any]] = field(default_factory=list)  # per model group: {"data", "rng"}
    average: dict[str, Tensor] | None = None  # training.weight_averaging's full fp32 tensors, by parameter name
    average_info: dict[str, Any] = field(default_factory=dict)  # its settings and counters (averaged_weights)


# --------------------------------------------------------------------------------------------
# reading
# --------------------------------------------------------------------------------------------


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A checkpoint step directory (``step_NNNNNNNN``), a checkpoints directory (its latest
    complete checkpoint) or a consolidated checkpoint directory."""
    p = Path(path)
    if (p / METADATA).is_file():
        return p
    if p.is_dir():
        latest = latest_checkpoint(p)
        if latest is not None:
            return latest
    raise ConversionError(f"{p} is not a checkpoint: no {METADATA} in it and no complete step_NNNNNNNN below it",
                          fix="pass a step_NNNNNNNN directory or the run's checkpoints directory")


def checked_metadata(path: Path) -> dict[str, Any]:
    """The ``metadata.json`` of a training or consolidated checkpoint; foreign, missing or mistyped keys
    are named here (:func:`~stormshard.checkpoint.errors.check_metadata`), not met later as KeyError."""
    try:
        meta = read_metadata(path)
    except CheckpointError as exc:
        raise ConversionError(str(exc)) from None
    if isinstance(meta, dict) and (meta.get("format") == PICKLED_FORMAT or meta.get("format") ==
                                   CONSOLIDATED_FORMAT and meta.get("version") == 1):
        check_metadata(meta, str(path / METADATA), CONSOLIDATED_FORMAT, PICKLED_FORMAT)  # foreign keys first
        raise ConversionError(str(pickled_format_error(path)))
    return check_metadata(meta, str(path / METADATA), CONSOLIDATED_FORMAT, TRAINING_FORMAT)


def _rank_file(path: Path, rank: int) -> Path:
    return path / f"{rank_name(rank)}.pt"


def load_rank_payloads(path: Path, metadata: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every rank's ``rank_NNNNN.pt``; one error lists all missing, extra, unreadable or foreign files."""
    world = int(metadata["world_size"])
    problems = []
    if len(metadata.get("ranks", [])) != world:
        problems.append(f"metadata.json lists {len(metadata.get('ranks', []))} rank tables for world_size {world}")
    present = {p.name for p in path.glob("rank_*.pt")}
    expected = {_rank_file(path, r).name for r in range(world)}
    problems += [f"{name}: missing (world_size {world})" for name in sorted(expected - present)]
    problems += [f"{name}: extra rank file (world_size is {world})" for name in sorted(present - expected)]
    recorded = checkpoint_problems(path, contents=True) if isinstance(metadata.get(FILES), dict) else []
    missing = {str(path / name) for name in expected - present}  # listed above
    problems += [p.removeprefix(f"{path}/") for p in recorded if p.split(": ")[0] not in missing]
    payloads: list[dict[str, Any]] = []
    for r in range(world):
        f = _rank_file(path, r)
        if not f.is_file():
            continue
        progress_note(f"checkpoint: reading {f.name} ({r + 1}/{world})", throttle=True)
        try:
            payload = read_state_file(f)
        except CheckpointError as exc:
            problems.append(f"{f.name}: unreadable: {str(exc).removeprefix(str(f)).strip()}")
            continue
        if not isinstance(payload, dict) or payload.get("rank") != r or payload.get("step") != metadata["step"]:
            got = (payload.get("rank"), payload.get("step")) if isinstance(payload, dict) else type(payload).__name__
            problems.append(f"{f.name}: holds (rank, step) {got}, expected ({r}, {metadata['step']})")
            continue
        payloads.append(payload)
    if problems:
        raise ConversionError(f"checkpoint {path} is incomplete or damaged:", problems,
                              fix="convert an intact checkpoint (an older step_NNNNNNNN, or re-save)")
    return payloads


# --------------------------------------------------------------------------------------------
# gathering
# --------------------------------------------------------------------------------------------


def _partition(row: Mapping[str, Any]) -> Partition | None:
    p = row.get("partition")
    return None if p is None else Partition(**p)


def _gather_group(name: str, tables: list[dict[str, dict]], values: list[Tensor], problems: list[str],
                  what: str = "") -> Tensor | None:
    """The full tensor of ``name`` from its slices (or copies) on the ranks of one model group."""
    label = f"{name}{what}"
    rows = [t[name] for t in tables]
    parts = [_partition(row) for row in rows]
    if all(p is None for p in parts):
        first = values[0]
        for i, v in enumerate(values[1:], start=1):
            if v.shape != first.shape or not torch.equal(v, first):
                diff = (v.double() - first.double()).abs().max().item() if v.shape == first.shape else "shape"
                problems.append(f"{label}: replicated, but model rank {i} differs from rank 0 (max diff {diff})")
                return None
        return first
    if any(p is None for p in parts):
        problems.append(f"{label}: partitioned on some model ranks and replicated on others")
        return None
    p0 = parts[0]
    if len(parts) != p0.parts or sorted(p.index for p in parts) != list(range(p0.parts)) or \
            any((p.dim, p.parts, p.full_size) != (p0.dim, p0.parts, p0.full_size) for p in parts):
        problems.append(f"{label}: incomplete shards: the model group holds indices {[p.index for p in parts]} of "
                        f"{p0.parts} parts ({[(p.dim, p.full_size) for p in parts]})")
        return None
    ordered = sorted(zip(parts, values, strict=True), key=lambda pv: pv[0].index)
    for p, v in ordered:
        if v.dim() <= p.dim or v.shape[p.dim] != p.sizes[p.index]:
            problems.append(f"{label}: shard {p.index} has shape {tuple(v.shape)}, expected size "
                            f"{p.sizes[p.index]} along dim {p.dim}")
            return None
    return torch.cat([v for _, v in ordered], dim=p0.dim)


def _check_local(rank: int, table: dict[str, dict], state: Mapping[str, Tensor], problems: list[str]) -> None:
    missing = sorted(set(table) - set(state))
    extra = sorted(set(state) - set(table))
    problems += [f"rank {rank}: {n}: in metadata.json but missing from the weights" for n in missing]
    problems += [f"rank {rank}: {n}: in the weights but not in metadata.json" for n in extra]
    for name in sorted(set(table) & set(state)):
        want = list(table[name]["shape"])
        if list(state[name].shape) != want:
            problems.append(f"rank {rank}: {name}: shape {list(state[name].shape)}, metadata.json says {want}")


def _check_safetensors(path: Path, module: Mapping[str, Tensor], problems: list[str]) -> None:
    """The rank's weights file (when written) must hold exactly the engine state's weights."""
    if not path.is_file():
        return
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            keys = set(f.keys())
            if keys != set(module):
                problems.append(f"{path.name}: holds {sorted(keys ^ set(module))[:5]} unlike the engine state")
                return
            differ = [k for k in sorted(keys) if not torch.equal(f.get_tensor(k), module[k])]
    except Exception as exc:  # noqa: BLE001 - a header or data error means a damaged file
        problems.append(f"{path.name}: unreadable ({type(exc).__name__}: {str(exc)[:120]}): corrupted or truncated")
        return
    if differ:
        problems.append(f"{path.name}: {differ[:5]} differ from the engine state: the file is stale or corrupted")


def _optimizer_kind(opt: Any) -> str:
    if isinstance(opt, Mapping) and "state" in opt and "param_groups" in opt:
        return "torch"
    return "partitioned"


def consolidate_checkpoint(path: str | os.PathLike) -> ConsolidatedCheckpoint:
    """Read a training checkpoint (any layout) and return its full model and optimizer state.

    Raises :class:`ConversionError` listing every problem (missing/extra rank files, unreadable
    files, tensors missing or extra against metadata.json, wrong shapes, incomplete shards,
    replicas that disagree); nothing is written.
    """
    src = resolve_checkpoint(path)
    metadata = checked_metadata(src)
    if metadata.get("format") == CONSOLIDATED_FORMAT:
        raise ConversionError(f"{src} is already consolidated", fix="pass it to reshard or export directly")
    with phase(f"checkpoint: read {metadata['world_size']} rank file(s) of {src}"):
        payloads = load_rank_payloads(src, metadata)
    layout = ParallelLayout(**metadata["layout"])
    tables = [{row["name"]: row for row in rank["parameters"]} for rank in metadata["ranks"]]
    engines = [p["state"]["engine"] for p in payloads]
    problems: list[str] = []
    for r, (table, eng) in enumerate(zip(tables, engines, strict=True)):
        _check_local(r, table, eng["module"], problems)
        _check_safetensors(src / f"{rank_name(r)}.safetensors", eng["module"], problems)
    if problems:
        raise ConversionError(f"checkpoint {src} does not match its own metadata:", problems,
                              fix="the checkpoint is damaged: convert an intact one")
    names = [row["name"] for row in metadata["ranks"][0]["parameters"]]

    # ---- weights
    replicas_full: list[dict[str, Tensor]] = []
    for ranks in layout.model_groups():
        group_tables = [tables[r] for r in ranks]
        full = {}
        for name in names:
            value = _gather_group(name, group_tables, [engines[r]["module"][name] for r in ranks], problems)
            if value is not None:
                full[name] = value
        replicas_full.append(full)
    for d, full in enumerate(replicas_full[1:], start=1):
        for name in names:
            a, b = replicas_full[0].get(name), full.get(name)
            if a is not None and b is not None and not torch.equal(a, b):
                problems.append(f"{name}: data-parallel replica {d} differs from replica 0 "
                                f"(max diff {(a.double() - b.double()).abs().max().item():.3g})")
    if problems:
        raise ConversionError(f"cannot consolidate {src}:", problems,
                              fix="convert an intact checkpoint written by one training run")

    # ---- optimizer (and, for DeepSpeed's flat partitions, the fp32 master weights)
    optimizer, note, master = _consolidate_optimizer(layout, tables, engines, names, problems)
    if problems:
        raise ConversionError(f"cannot consolidate the optimizer state of {src}:", problems)
    if master is not None:
        replicas_full[0] = _master_weights(replicas_full[0], master, problems)
        if problems:
            raise ConversionError(f"the module weights of {src} disagree with its fp32 master weights:", problems,
                                  fix="the checkpoint is damaged: convert an intact one")

    average, info = _consolidate_average(layout, tables, [p["state"].get(AVERAGE_STATE_KEY) for p in payloads], src)
    first = engines[0]
    engine = {k: v for k, v in first.items() if k not in ("module", "optimizer")}
    if is_zero_state(first["optimizer"]):
        engine["zero_extras"] = zero_extras(first["optimizer"])
    elif is_flat_master_state(first["optimizer"]):
        engine["flat_master_extras"] = flat_master_extras(first["optimizer"])
    replicas = [{"data": payloads[g[0]]["state"].get("data"), "rng": payloads[g[0]].get("rng")}
                for g in layout.model_groups()]
    return ConsolidatedCheckpoint(int(metadata["step"]), metadata["config"], metadata["layout"], replicas_full[0],
                                  optimizer, note, engine, replicas, average, info)


def _consolidate_average(layout: ParallelLayout, tables: list[dict[str, dict]], stored: list[Any],
                         src: Path) -> tuple[dict[str, Tensor] | None, dict[str, Any]]:
    """The full weight average (``training.weight_averaging``) from every rank's slices, gathered by the
    parameters' partitions (data-parallel replicas must agree), and its settings; ``(None, {})`` without one."""
    if all(s is None for s in stored):
        return None, {}
    problems = [f"rank {r}: holds no weight average, unlike rank {stored.index(next(s for s in stored if s))}"
                for r, s in enumerate(stored) if s is None]
    full: list[dict[str, Tensor]] = []
    for ranks in ([] if problems else layout.model_groups()):
        group = [tables[r] for r in ranks]
        values = {n: _gather_group(n, group, [stored[r]["tensors"].get(n) for r in ranks], problems, " (average)")
                  for n in tables[ranks[0]] if all(n in stored[r]["tensors"] for r in ranks)}
        full.append({n: v for n, v in values.items() if v is not None})
        problems += [f"{n}: no weight average on a rank of model group {ranks}" for n in tables[ranks[0]]
                     if n not in values]
    problems += [f"{n} (average): data-parallel replica {d} differs from replica 0" for d, f in enumerate(full[1:], 1)
                 for n in f if not torch.equal(f[n], full[0][n])]
    if problems:
        raise ConversionError(f"cannot consolidate the weight average of {src}:", problems,
                              fix="the checkpoint is damaged: convert an intact one")
    return full[0], average_info(stored[0])


def _master_weights(module: dict[str, Tensor], master: dict[str, Tensor], problems: list[str]) -> dict[str, Tensor]:
    """The fp32 ``master`` weights in place of the ``module`` ones (bf16 copies in a bf16 run), after
    checking that every module tensor is its master rounded to the module's dtype."""
    out = {}
    for name, weight in module.items():
        fp32 = master.get(name)
        if fp32 is None:  # frozen (training.freeze): no optimizer master, the module's weight is it
            out[name] = weight
            continue
        if fp32.shape != weight.shape or not torch.equal(fp32.to(weight.dtype), weight):
            diff = "shape" if fp32.shape != weight.shape else \
                f"{(fp32.double() - weight.double()).abs().max().item():.3g}"
            problems.append(f"{name}: the module's {weight.dtype} weights are not its fp32 master rounded (max diff {diff})")
            continue
        out[name] = fp32
    return out


def _consolidate_optimizer(layout: ParallelLayout, tables: list[dict[str, dict]], engines: list[dict[str, Any]],
                           names: list[str], problems: list[str]
                           ) -> tuple[dict[str, Any] | None, str, dict[str, Tensor] | None]:
    """``(optimizer, note, master)``: the full per-parameter optimizer state (None with a ``note``
    when the format is unknown) and, for DeepSpeed's flat partitions, the full fp32 master weights."""
    first = engines[0]
    per_rank: dict[int, dict[str, dict[str, Any]]] = {}
    masters: dict[int, dict[str, Tensor]] = {}
    hyper: list[dict[str, Any]] = []
    group0 = layout.model_groups()[0]
    frozen = [n for n in names if not tables[0][n].get("trainable", True)]  # training.freeze: no optimizer state
    trained = [n for n in names if n not in frozen]
    if is_zero_state(first["optimizer"]):
        # ZeRO 1/2: model rank m's flat buffer is partitioned over its data-parallel group
        for m, dp_ranks in enumerate(layout.data_parallel_groups()):
            rows = [tables[dp_ranks[0]][n] for n in trained]
            states = [engines[r]["optimizer"] for r in dp_ranks]
            if not all(is_zero_state(s) for s in states):
                problems.append(f"ranks {dp_ranks}: mixed optimizer state formats")
                return None, "", None
            try:
                per_rank[group0[m]], masters[group0[m]], hyper = unflatten_zero(
                    states, rows, f"model rank {m} (ranks {dp_ranks})")
            except ConversionError as exc:
                problems.extend(exc.problems or [str(exc)])
                return None, "", None
        hyper = [{**h, "param_names": list(trained)} for h in hyper] or [{"param_names": list(trained)}]
    elif is_flat_master_state(first["optimizer"]):
        # bf16 at ZeRO 0: every data-parallel replica holds the same unpartitioned fp32 master
        for m, dp_ranks in enumerate(layout.data_parallel_groups()):
            states = [engines[r]["optimizer"] for r in dp_ranks]
            if not all(is_flat_master_state(s) for s in states):
                problems.append(f"ranks {dp_ranks}: mixed optimizer state formats")
                return None, "", None
            rows = [tables[dp_ranks[0]][n] for n in trained]
            try:
                unflat = [unflatten_flat_master(st, rows, f"model rank {m} (rank {r})")
                          for r, st in zip(dp_ranks, states, strict=True)]
            except ConversionError as exc:
                problems.extend(exc.problems or [str(exc)])
                return None, "", None
            per_rank[group0[m]], masters[group0[m]], hyper = unflat[0]
            for r, (_, other, _) in zip(dp_ranks[1:], unflat[1:], strict=True):
                differ = [n for n in trained if not torch.equal(other[n], masters[group0[m]][n])]
                if differ:
                    problems.append(f"rank {r}: its fp32 master of {differ[:3]} differs from data-parallel replica 0 "
                                    f"(rank {dp_ranks[0]})")
        if problems:
            return None, "", None
        hyper = [{**h, "param_names": list(trained)} for h in hyper] or [{"param_names": list(trained)}]
    elif _optimizer_kind(first["optimizer"]) == "torch":
        for r in group0:
            opt = engines[r]["optimizer"]
            indices = [i for g in opt["param_groups"] for i in g["params"]]
            # metadata order = named_parameters order; the optimizer's: the trained ones in that order
            order = [n for n in tables[r] if tables[r][n].get("trainable", True)]
            if sorted(indices) != list(range(len(order))):
                problems.append(f"rank {r}: the optimizer covers {len(indices)} parameter positions of the "
                                f"{len(order)} trained parameters: extra parameters are not supported")
                continue
            per_rank[r] = {order[i]: opt["state"].get(i, {}) for i in range(len(order))}
        for g in first["optimizer"]["param_groups"]:
            hyper.append({**{k: v for k, v in g.items() if k != "params"},
                          "param_names": [trained[i] for i in g["params"]]})
    else:
        return None, (f"engine {first.get('engine')!r} (ZeRO stage {first.get('zero_stage')}) writes an optimizer "
                      "state this converter does not know; only the weights were consolidated"), None
    if problems:
        return None, "", None
    for r in per_rank:
        for name in frozen:
            per_rank[r].setdefault(name, {})
    state: dict[str, dict[str, Any]] = {}
    for name in names:
        entry: dict[str, Any] = {}
        keys = set(per_rank[0][name])
        for key in sorted(keys):
            ranks = group0
            vals = [per_rank[r][name].get(key) for r in ranks]
            v0 = vals[0]
            local_shape = tuple(tables[0][name]["shape"])
            if isinstance(v0, Tensor) and tuple(v0.shape) == local_shape and v0.dim() > 0:
                full = _gather_group(name, [tables[r] for r in ranks], vals, problems, what=f" (optimizer {key})")
                entry[key] = full
            else:
                entry[key] = v0
        state[name] = entry
    master = None
    if masters:
        master = {}
        for name in trained:
            full = _gather_group(name, [tables[r] for r in group0], [masters[r][name] for r in group0], problems,
                                 what=" (fp32 master)")
            if full is not None:
                master[name] = full
    return {"param_groups": hyper, "state": state}, "", master


# --------------------------------------------------------------------------------------------
# writing / reading the consolidated form
# --------------------------------------------------------------------------------------------


def check_output_path(source: str | os.PathLike, out: str | os.PathLike, overwrite: bool = False) -> None:
    """Conversion never writes into its source: ``out`` equal to or inside ``source`` (the path given
    and the checkpoint it resolves to), or with ``overwrite`` a ``source`` inside ``out``, is a
    :class:`ConversionError` before anything is read or written."""
    target = Path(out).resolve()
    given = Path(source).resolve()
    sources = {given}
    try:
        sources.add(resolve_checkpoint(given).resolve())
    except ConversionError:
        pass
    for src in sorted(sources):
        if target == src or src in target.parents:
            raise ConversionError(f"--out {out} is {'the source' if target == src else 'inside the source'} "
                                  f"{src}: conversion never writes into its source",
                                  fix="choose an --out outside the checkpoint being converted")
        if overwrite and target in src.parents:
            raise ConversionError(f"--out {out} holds the source {src}, and --overwrite would replace it",
                                  fix="choose an --out that does not contain the checkpoint being converted")


def save_consolidated(ckpt: ConsolidatedCheckpoint, out: str | os.PathLike, overwrite: bool = False) -> Path:
    """Write ``ckpt`` as a consolidated checkpoint directory (atomically: temp dir, then rename)."""
    meta = {
        "format": CONSOLIDATED_FORMAT, "version": CONSOLIDATED_VERSION, "step": ckpt.step, "time": time.time(),
        "config": ckpt.config, "source_layout": ckpt.source_layout,
        "parameters": [{"name": n, "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
                       for n, t in ckpt.model.items()],
        "optimizer": ckpt.optimizer is not None, "optimizer_note": ckpt.optimizer_note,
        "weight_average": ckpt.average_info if ckpt.average is not None else None,
    }
    with atomic_directory(out, overwrite) as tmp:
        save_safetensors(ckpt.model, tmp / "model.safetensors", {"step": str(ckpt.step)})
        if ckpt.optimizer is not None:
            write_state_file(ckpt.optimizer, tmp / "optimizer.pt")
        if ckpt.average is not None:  # training.weight_averaging: full fp32 tensors, the model's names
            save_safetensors(ckpt.average, tmp / "average.safetensors", {"step": str(ckpt.step)})
        write_state_file({"engine": ckpt.engine, "replicas": ckpt.replicas}, tmp / "trainer.pt")
        meta[FILES] = record_files(sorted(tmp.iterdir()))
        (tmp / METADATA).write_text(json.dumps(meta, indent=1))
    return Path(out)


def load_consolidated(path: str | os.PathLike) -> ConsolidatedCheckpoint:
    """Read what :func:`save_consolidated` wrote; damaged files raise :class:`ConversionError`."""
    from safetensors.torch import load_file

    p = Path(path)
    meta = checked_metadata(p)
    if meta.get("format") != CONSOLIDATED_FORMAT:
        raise ConversionError(f"{p} is not a consolidated checkpoint (format {meta.get('format')!r})")
    damaged = file_problems(p, meta[FILES]) if isinstance(meta.get(FILES), dict) else []
    if damaged:
        raise ConversionError(f"the consolidated checkpoint {p} is damaged:", damaged,
                              fix="consolidate the training checkpoint again")
    try:
        model = load_file(str(p / "model.safetensors"))
        optimizer = read_state_file(p / "optimizer.pt") if meta["optimizer"] else None
        trainer = read_state_file(p / "trainer.pt")
        average = load_file(str(p / "average.safetensors")) if meta.get("weight_average") else None
    except Exception as exc:  # noqa: BLE001 - a damaged file, named by the reader or here
        raise ConversionError(f"{p}: a file cannot be read ({type(exc).__name__}: {str(exc)[:240]})",
                              fix="the consolidated checkpoint is damaged: consolidate again") from None
    problems = []
    want = {row["name"]: row["shape"] for row in meta["parameters"]}
    problems += [f"{n}: listed in metadata.json, missing from model.safetensors" for n in sorted(set(want) - set(model))]
    problems += [f"{n}: in model.safetensors, not in metadata.json" for n in sorted(set(model) - set(want))]
    problems += [f"{n}: shape {list(model[n].shape)}, metadata.json says {want[n]}"
                 for n in sorted(set(want) & set(model)) if list(model[n].shape) != want[n]]
    problems += [f"{n}: average.safetensors holds {list(t.shape)}, metadata.json says {want.get(n)}"
                 for n, t in (average or {}).items() if list(t.shape) != want.get(n)]
    if problems:
        raise ConversionError(f"{p} does not match its metadata:", problems)
    return ConsolidatedCheckpoint(int(meta["step"]), meta["config"], meta["source_layout"], model, optimizer,
                                  meta.get("optimizer_note", ""), trainer["engine"], trainer["replicas"], average,
                                  meta.get("weight_average") or {})


def load_any(path: str | os.PathLike) -> ConsolidatedCheckpoint:
    """A consolidated checkpoint, or a training checkpoint consolidated on the fly."""
    src = resolve_checkpoint(path)
    if checked_metadata(src).get("format") == CONSOLIDATED_FORMAT:
        return load_consolidated(src)
    return consolidate_checkpoint(src)
