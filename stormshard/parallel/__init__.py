"""Parallel building blocks (knows nothing of weather): the layout and its process groups, shard
context (:class:`SequenceShard`, :class:`GraphShardPlan`), anemoi-named autograd collectives,
sequence parallelism (halos, head all-to-all), tensor-parallel linears, gradient reduction and
PowerSGD compression, communication accounting. Everything else stays in its module
(e.g. :mod:`stormshard.parallel.anemoi_compat` for anemoi's edge-sorting helpers)."""

from __future__ import annotations

from stormshard.parallel.comm import (
    copy_tensor,
    gather_tensor,
    reduce_shard_tensor,
    reduce_tensor,
    shard_tensor,
    sync_tensor,
)
from stormshard.parallel.compression import PowerSGDCompressor, PowerSGDConfig, register_powersgd_hook
from stormshard.parallel.counter import CommCounter
from stormshard.parallel.grads import clip_grad_norm_, reduce_model_parallel_gradients
from stormshard.parallel.graph import GraphShardPlan
from stormshard.parallel.halo_projection import halo_linear
from stormshard.parallel.random import TrackedDropout, tensor_parallel_rng_tracker
from stormshard.parallel.sequence import (
    HaloPlan,
    add_halos,
    halo_exchange,
    remove_halos,
    shard_heads,
    shard_sequence,
)
from stormshard.parallel.shapes import balanced_sizes, get_shape_shards
from stormshard.parallel.shard import SequenceShard, check_shard_sizes
from stormshard.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    full_state_dict,
    load_full_state_dict,
)
from stormshard.parallel.topology import (
    LayoutError,
    ParallelLayout,
    ProcessGroups,
    batch_arithmetic,
    build_process_groups,
)

__all__ = [
    "ParallelLayout", "LayoutError", "ProcessGroups", "build_process_groups", "batch_arithmetic",
    "SequenceShard", "check_shard_sizes", "balanced_sizes", "get_shape_shards", "shard_tensor",
    "gather_tensor", "reduce_tensor", "copy_tensor", "sync_tensor", "reduce_shard_tensor", "shard_heads",
    "shard_sequence", "add_halos", "remove_halos", "halo_exchange", "HaloPlan", "ColumnParallelLinear",
    "RowParallelLinear", "full_state_dict", "load_full_state_dict", "tensor_parallel_rng_tracker",
    "TrackedDropout", "GraphShardPlan", "halo_linear", "reduce_model_parallel_gradients", "clip_grad_norm_",
    "PowerSGDConfig", "PowerSGDCompressor", "register_powersgd_hook", "CommCounter",
]
