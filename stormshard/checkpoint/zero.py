"""DeepSpeed ZeRO 1/2 optimizer state <-> per-parameter AdamW state.

ZeRO 1/2 flatten the trainable parameters of a rank (its model-rank slices, in parameter order)
into one buffer per parameter group, pad it to a multiple of ``2 x dp`` elements and give each
of the ``dp`` data-parallel ranks an equal contiguous partition. A rank's optimizer
``state_dict()`` (DeepSpeed 0.19, non-elastic) holds:

- ``base_optimizer_state``: the torch AdamW state of its partition (padded: ``exp_avg``,
  ``exp_avg_sq`` of the partition size; ``step``);
- ``single_partition_of_fp32_groups``: its fp32 master partition, without the padding (ZeRO 1/2) or
  with it (DeepSpeed's bf16 optimizer, which bf16 at ZeRO 0 uses: the same layout otherwise);
- ``group_paddings`` (padding in this partition: only the last one has any),
  ``param_alignment_paddings`` (per-parameter padding: all 0 unless ``parameter_alignment``),
  ``partition_count``, ``param_slice_mappings``, the loss scaler and ``ds_version``.

:func:`unflatten_zero` turns the ``dp`` states of one model rank into per-parameter tensors;
:func:`flatten_zero` builds the state one target rank loads (``load_from_fp32_weights=True``).
Supported: one parameter group, no ``parameter_alignment``, no ``round_robin_gradients``
(all are DeepSpeed's defaults); anything else raises :class:`ConversionError` naming it.

bf16 at ZeRO 0 uses DeepSpeed's mixed-precision optimizer (``FP16_Optimizer`` with bf16), which
does not partition: every data-parallel rank holds ``fp32_groups_flat`` (the fp32 master of all its
parameters, one flat buffer per group, no padding) and ``optimizer_state_dict`` (torch AdamW over
that flat buffer). :func:`unflatten_flat_master` / :func:`flatten_flat_master` convert it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from stormshard.checkpoint.errors import ConversionError

__all__ = ["is_zero_state", "unflatten_zero", "flatten_zero", "zero_extras", "ALIGNMENT_FACTOR",
           "is_flat_master_state", "unflatten_flat_master", "flatten_flat_master", "flat_master_extras"]

ALIGNMENT_FACTOR = 2  # DeepSpeed's nccl_start_alignment_factor: the flat buffer is padded to 2 x dp
_KEYS = ("base_optimizer_state", "single_partition_of_fp32_groups", "group_paddings", "partition_count")
_EXTRAS = ("loss_scaler", "dynamic_loss_scale", "overflow", "clip_grad", "ds_version", "zero_stage")


def is_zero_state(opt: Any) -> bool:
    """Whether ``opt`` is a DeepSpeed ZeRO 1/2 optimizer state dict."""
    return isinstance(opt, Mapping) and all(k in opt for k in _KEYS)


def zero_extras(opt: Mapping[str, Any]) -> dict[str, Any]:
    """The layout-independent fields (loss scaler, clipping, version, stage) of a ZeRO state."""
    return {k: opt[k] for k in _EXTRAS if k in opt}


def _check(opt: Mapping[str, Any], where: str) -> None:
    groups = opt["single_partition_of_fp32_groups"]
    if len(groups) != 1:
        raise ConversionError(f"{where}: the ZeRO state has {len(groups)} parameter groups; one is supported",
                              fix="train with a single optimizer parameter group")
    paddings = opt.get("param_alignment_paddings") or [[]]
    if any(any(p) for p in paddings):
        raise ConversionError(f"{where}: ZeRO parameter_alignment padding is not supported",
                              fix="train with deepspeed.zero_optimization.parameter_alignment=false")


def unflatten_zero(states: Sequence[Mapping[str, Any]], rows: Sequence[Mapping[str, Any]], where: str
                   ) -> tuple[dict[str, dict[str, Any]], dict[str, Tensor], list[dict[str, Any]]]:
    """Per-parameter AdamW state, fp32 master weights and param-group hyper-parameters of one
    model rank from the ZeRO states of its ``dp`` data-parallel ranks (in data-parallel order).
    ``rows``: the rank's parameter table (names and local shapes, in parameter order)."""
    dp = len(states)
    for d, s in enumerate(states):
        _check(s, where)
        if list(s["partition_count"]) != [dp]:
            raise ConversionError(f"{where}: data-parallel rank {d} has partition_count {s['partition_count']}, "
                                  f"but {dp} ranks share this model slice", fix="convert an intact checkpoint")
    order = [n for s in states for n in (s.get("param_slice_mappings") or [{}])[0]]
    seen = list(dict.fromkeys(order))
    names = [r["name"] for r in rows]
    if seen and seen != names:
        raise ConversionError(f"{where}: the ZeRO flat buffer orders the parameters differently from the model "
                              "(round_robin_gradients?)", fix="train with deepspeed.zero_optimization."
                              "round_robin_gradients=false")
    base = [s["base_optimizer_state"] for s in states]
    elastic = isinstance(base[0], list)
    flat: dict[str, list[Tensor]] = {"master": []}
    scalars: dict[str, Any] = {}
    for d, s in enumerate(states):
        pad = int(s["group_paddings"][0])
        group_state = base[d][0] if elastic else base[d]["state"][0]
        moments = [v for v in group_state.values() if isinstance(v, Tensor) and v.dim() > 0]
        master = s["single_partition_of_fp32_groups"][0]
        if master.dtype != torch.float32:
            raise ConversionError(f"{where}: data-parallel rank {d}'s master partition is {master.dtype}, not fp32",
                                  fix="convert a checkpoint written by DeepSpeed's ZeRO or bf16 optimizer")
        if pad and moments and not elastic and master.numel() == moments[0].numel():
            master = master[: master.numel() - pad]  # the bf16 optimizer keeps the padding in its master too
        flat["master"].append(master)
        for key, value in group_state.items():
            if isinstance(value, Tensor) and value.dim() > 0:
                lean = value if elastic else value[: value.numel() - pad]
                flat.setdefault(key, []).append(lean)
            else:
                scalars[key] = value
    joined = {k: torch.cat(v) for k, v in flat.items()}
    total = sum(math.prod(r["shape"]) for r in rows)
    bad = {k: v.numel() for k, v in joined.items() if v.numel() != total}
    if bad:
        raise ConversionError(f"{where}: the ZeRO partitions hold {bad} elements, the parameters {total}",
                              fix="convert an intact checkpoint with all data-parallel ranks")
    state: dict[str, dict[str, Any]] = {}
    master: dict[str, Tensor] = {}
    offset = 0
    for r in rows:
        n = math.prod(r["shape"])
        entry = dict(scalars)
        for key, v in joined.items():
            piece = v[offset: offset + n].reshape(r["shape"]).clone()
            if key == "master":
                master[r["name"]] = piece
            else:
                entry[key] = piece
        state[r["name"]] = entry
        offset += n
    groups = [] if elastic else [{k: v for k, v in g.items() if k != "params"} for g in base[0]["param_groups"]]
    return state, master, groups


def flatten_zero(extras: Mapping[str, Any], hyper: Sequence[Mapping[str, Any]], names: Sequence[str],
                 master: Mapping[str, Tensor], state: Mapping[str, Mapping[str, Any]], dp: int, d: int
                 ) -> dict[str, Any]:
    """The ZeRO 1/2 optimizer state of data-parallel rank ``d`` of ``dp`` for the local
    parameters ``names`` (in parameter order), from their full-precision ``master`` weights and
    per-parameter AdamW ``state``."""
    from deepspeed.utils.tensor_fragment import fragment_address

    total = sum(master[n].numel() for n in names)
    align = ALIGNMENT_FACTOR * dp
    padded = int(math.ceil(total / align)) * align
    size = padded // dp
    start, stop = d * size, (d + 1) * size
    pad = max(0, stop - max(total, start))

    def partition(pieces: list[Tensor]) -> Tensor:
        flat = torch.cat([p.reshape(-1).float() for p in pieces])
        flat = torch.cat([flat, flat.new_zeros(padded - total)])
        return flat[start:stop].clone()

    tensor_keys = [k for k, v in state[names[0]].items() if isinstance(v, Tensor) and v.dim() > 0]
    scalars = {k: v for k, v in state[names[0]].items() if k not in tensor_keys}
    group_state = {**scalars, **{k: partition([state[n][k] for n in names]) for k in tensor_keys}}
    fp32 = partition([master[n] for n in names])
    mapping, offset = {}, 0
    for n in names:
        lo, hi = max(offset, start), min(offset + master[n].numel(), stop, total)
        if lo < hi:
            mapping[n] = fragment_address(numel=hi - lo, start=lo - start)
        offset += master[n].numel()
    groups = [{**dict(h), "params": [0]} for h in (hyper or [{}])]
    return {
        **dict(extras),
        "base_optimizer_state": {"state": {0: group_state}, "param_groups": groups},
        "single_partition_of_fp32_groups": [fp32[: size - pad]],
        "group_paddings": [pad],
        "param_alignment_paddings": [[0] * len(names)],
        "partition_count": [dp],
        "param_slice_mappings": [mapping],
    }


# ---- bf16 at ZeRO 0: DeepSpeed's FP16_Optimizer / FP16_UnfusedOptimizer in bf16, an unpartitioned fp32 master

_FLAT_EXTRAS = ("clip_grad", "dynamic_loss_scale", "cur_scale", "cur_iter", "last_overflow_iter", "scale_factor",
                "scale_window")
_LAYOUT = "fp32_master_layout"  # extras key: "flat" (fused optimizer) or "per_parameter" (unfused)


def is_flat_master_state(opt: Any) -> bool:
    """Whether ``opt`` is the state of DeepSpeed's unpartitioned mixed-precision optimizer (bf16 at
    ZeRO 0): ``fp32_groups_flat`` (fused Adam, GPUs) or ``fp32_groups`` (torch Adam, CPU)."""
    return isinstance(opt, Mapping) and "optimizer_state_dict" in opt and \
        ("fp32_groups_flat" in opt or "fp32_groups" in opt)


def flat_master_extras(opt: Mapping[str, Any]) -> dict[str, Any]:
    """Its layout-independent fields (clipping, loss-scale settings) and which master layout it has."""
    return {**{k: opt[k] for k in _FLAT_EXTRAS if k in opt},
            _LAYOUT: "flat" if "fp32_groups_flat" in opt else "per_parameter"}


def unflatten_flat_master(opt: Mapping[str, Any], rows: Sequence[Mapping[str, Any]], where: str
                          ) -> tuple[dict[str, dict[str, Any]], dict[str, Tensor], list[dict[str, Any]]]:
    """Per-parameter AdamW state, fp32 master weights and param-group hyper-parameters of one rank's
    unpartitioned mixed-precision optimizer state; ``rows``: the rank's parameters in order."""
    inner = opt["optimizer_state_dict"]
    names = [r["name"] for r in rows]
    total = sum(math.prod(r["shape"]) for r in rows)
    if len(inner.get("param_groups", [])) != 1:
        raise ConversionError(f"{where}: the bf16 optimizer state has {len(inner.get('param_groups', []))} parameter "
                              "groups; one is supported", fix="train with a single optimizer parameter group")
    state: dict[str, dict[str, Any]] = {}
    master: dict[str, Tensor] = {}
    if "fp32_groups_flat" in opt:  # one flat fp32 buffer, the torch state of that one tensor
        flat = opt["fp32_groups_flat"][0]
        group_state = inner["state"].get(0, {})
        tensors = {k: v for k, v in group_state.items() if isinstance(v, Tensor) and v.dim() > 0}
        scalars = {k: v for k, v in group_state.items() if k not in tensors}
        sizes = {"fp32 master": (flat.numel(), flat.dtype), **{k: (v.numel(), v.dtype) for k, v in tensors.items()}}
        offset = 0
        pieces = []
        for r in rows:
            n = math.prod(r["shape"])
            pieces.append((r, offset, n))
            offset += n
        if any(n != total or dt != torch.float32 for n, dt in sizes.values()):
            raise ConversionError(f"{where}: the flat fp32 buffers hold {sizes}, the parameters {total} fp32 elements",
                                  fix="convert an intact checkpoint")
        for r, offset, n in pieces:
            master[r["name"]] = flat[offset: offset + n].reshape(r["shape"]).clone()
            state[r["name"]] = {**scalars, **{k: v[offset: offset + n].reshape(r["shape"]).clone()
                                              for k, v in tensors.items()}}
    else:  # one fp32 tensor per parameter, the torch state keyed by parameter position
        params = [t for group in opt["fp32_groups"] for t in group]
        shapes = [list(t.shape) for t in params]
        if shapes != [list(r["shape"]) for r in rows] or any(t.dtype != torch.float32 for t in params):
            raise ConversionError(f"{where}: the fp32 master holds {len(params)} tensors of shapes {shapes[:4]}..., "
                                  f"the parameters are {len(rows)} of shapes {[list(r['shape']) for r in rows][:4]}...",
                                  fix="convert an intact checkpoint")
        for i, (name, t) in enumerate(zip(names, params, strict=True)):
            master[name] = t.clone()
            state[name] = {k: (v.clone() if isinstance(v, Tensor) else v) for k, v in inner["state"].get(i, {}).items()}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in inner["param_groups"]]
    return state, master, groups


def flatten_flat_master(extras: Mapping[str, Any], hyper: Sequence[Mapping[str, Any]], names: Sequence[str],
                        master: Mapping[str, Tensor], state: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The unpartitioned mixed-precision optimizer state (bf16 at ZeRO 0) of one rank for its local
    parameters ``names`` (in parameter order) from their fp32 ``master`` and AdamW ``state``, in the
    master layout recorded in ``extras``."""
    fields = {k: v for k, v in extras.items() if k != _LAYOUT}
    if extras.get(_LAYOUT) == "per_parameter":
        groups = [{**dict(h), "params": list(range(len(names)))} for h in (hyper or [{}])]
        inner_state = {i: {k: (v.clone() if isinstance(v, Tensor) else v) for k, v in state[n].items()}
                       for i, n in enumerate(names)}
        return {**fields, "optimizer_state_dict": {"state": inner_state, "param_groups": groups},
                "fp32_groups": [[master[n].float().clone() for n in names]]}
    tensor_keys = [k for k, v in state[names[0]].items() if isinstance(v, Tensor) and v.dim() > 0]
    scalars = {k: v for k, v in state[names[0]].items() if k not in tensor_keys}
    flat = {k: torch.cat([state[n][k].reshape(-1).float() for n in names]) for k in tensor_keys}
    groups = [{**dict(h), "params": [0]} for h in (hyper or [{}])]
    return {**fields, "optimizer_state_dict": {"state": {0: {**scalars, **flat}}, "param_groups": groups},
            "fp32_groups_flat": [torch.cat([master[n].reshape(-1).float() for n in names])]}
