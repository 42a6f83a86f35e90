"""DeepSpeed ZeRO 1/2 optimizer state <-> per-parameter AdamW state.

ZeRO 1/2 flatten the trainable parameters of a rank (its model-rank slices, in parameter order)
into one buffer per parameter group, pad it to a multiple of ``2 x dp`` elements and give each
of the ``dp`` data-parallel ranks an equal contiguous partition. A rank's optimizer
``state_dict()`` (DeepSpeed 0.19, non-elastic) holds:

- ``base_optimizer_state``: the torch AdamW state of its partition (padded: ``exp_avg``,
  ``exp_avg_sq`` of the partition size; ``step``);
- ``single_partition_of_fp32_groups``: its fp32 master partition without the padding;
- ``group_paddings`` (padding in this partition: only the last one has any),
  ``param_alignment_paddings`` (per-parameter padding: all 0 unless ``parameter_alignment``),
  ``partition_count``, ``param_slice_mappings``, the loss scaler and ``ds_version``.

:func:`unflatten_zero` turns the ``dp`` states of one model rank into per-parameter tensors;
:func:`flatten_zero` builds the state one target rank loads (``load_from_fp32_weights=True``).
Supported: one parameter group, no ``parameter_alignment``, no ``round_robin_gradients``
(all are DeepSpeed's defaults); anything else raises :class:`ConversionError` naming it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from stormshard.checkpoint.errors import ConversionError

__all__ = ["is_zero_state", "unflatten_zero", "flatten_zero", "zero_extras", "ALIGNMENT_FACTOR"]

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
        flat["master"].append(s["single_partition_of_fp32_groups"][0].float())
        group_state = base[d][0] if elastic else base[d]["state"][0]
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
