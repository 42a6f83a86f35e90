"""Parallel building blocks (knows nothing of weather): the layout and its process groups, shard
context (:class:`SequenceShard`, :class:`GraphShardPlan`), the collectives (anemoi-named autograd
collectives and the one row exchange, all in :mod:`stormshard.parallel.comm`), sequence
parallelism (halos, head all-to-all), tensor-parallel linears, gradient reduction and PowerSGD
compression, communication accounting. Everything else stays in its module (e.g.
:mod:`stormshard.parallel.anemoi_compat` for anemoi's edge-sorting helpers)."""

from __future__ import annotations

from stormshard.lazy import lazy_exports

# name -> module: loaded on first use, so that importing a torch-free module of the package (the
# shard strategies, the PowerSGD settings: read by the experiment config) does not load torch
_EXPORTS: dict[str, str] = {
    **dict.fromkeys(("copy_tensor", "gather_tensor", "reduce_shard_tensor", "reduce_tensor", "shard_tensor",
                     "sync_tensor"), "comm"),
    **dict.fromkeys(("PowerSGDCompressor", "register_powersgd_hook"), "compression"),
    "PowerSGDConfig": "compression_plan",
    "CommCounter": "counter",
    **dict.fromkeys(("clip_grad_norm_", "reduce_model_parallel_gradients"), "grads"),
    "GraphShardPlan": "graph",
    "halo_linear": "halo_projection",
    **dict.fromkeys(("TrackedDropout", "tensor_parallel_rng_tracker"), "random"),
    **dict.fromkeys(("HaloPlan", "add_halos", "halo_exchange", "remove_halos", "shard_heads", "shard_sequence"),
                    "sequence"),
    **dict.fromkeys(("balanced_sizes", "get_shape_shards"), "shapes"),
    **dict.fromkeys(("SequenceShard", "check_shard_sizes"), "shard"),
    **dict.fromkeys(("ColumnParallelLinear", "RowParallelLinear", "full_state_dict", "load_full_state_dict"),
                    "tensor"),
    **dict.fromkeys(("LayoutError", "ParallelLayout", "ProcessGroups", "batch_arithmetic", "build_process_groups"),
                    "topology"),
}

__all__ = [
    "ParallelLayout", "LayoutError", "ProcessGroups", "build_process_groups", "batch_arithmetic",
    "SequenceShard", "check_shard_sizes", "balanced_sizes", "get_shape_shards", "shard_tensor",
    "gather_tensor", "reduce_tensor", "copy_tensor", "sync_tensor", "reduce_shard_tensor", "shard_heads",
    "shard_sequence", "add_halos", "remove_halos", "halo_exchange", "HaloPlan", "ColumnParallelLinear",
    "RowParallelLinear", "full_state_dict", "load_full_state_dict", "tensor_parallel_rng_tracker",
    "TrackedDropout", "GraphShardPlan", "halo_linear", "reduce_model_parallel_gradients", "clip_grad_norm_",
    "PowerSGDConfig", "PowerSGDCompressor", "register_powersgd_hook", "CommCounter",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__)
