"""The keys of the ``deepspeed`` section: what DeepSpeed 0.19 accepts, and what stormshard can honour.

DeepSpeed reads its config with ``dict.get`` and ignores any key it does not look up, so a typo
(``train_micro_batch_size_per_gpuu``) would silently train with the default. The tables here list
the top-level keys ``deepspeed.runtime.config.DeepSpeedConfig`` reads in DeepSpeed 0.19 and the
fields of its ``zero_optimization``, ``bf16`` and ``fp16`` models (their aliases included);
``tests/test_launch.py`` re-derives them from the installed package and fails when they drift.

:func:`check_deepspeed_section` raises ``ValueError`` for

- a key DeepSpeed does not know (with the closest known spelling), or one it has removed;
- a key DeepSpeed knows but stormshard cannot honour (it owns the schedule, the data loader, the
  checkpoints, tensor and pipeline parallelism: :data:`NOT_HONOURED` names the field to use);
- ZeRO-3-only ``zero_optimization`` keys (stage 3 is not supported);
- any ``deepspeed`` section when the engine is ``ddp`` or ``local`` (they would ignore it).
"""

from __future__ import annotations

import difflib
from typing import Any

__all__ = ["DEEPSPEED_KEYS", "DEEPSPEED_SUBSECTION_KEYS", "REMOVED_KEYS", "NOT_HONOURED", "ZERO3_ONLY_KEYS",
           "check_deepspeed_section"]

# every top-level key DeepSpeed 0.19's DeepSpeedConfig reads (removed ones excluded)
DEEPSPEED_KEYS: frozenset[str] = frozenset({
    "activation_checkpointing", "aio", "autotuning", "bf16", "bfloat16", "checkpoint", "comet", "comms_logger",
    "communication_data_type", "compile", "csv_monitor", "data_efficiency", "data_types", "dataloader_drop_last",
    "datastates_ckpt", "disable_allgather", "disable_python_gc", "dump_state", "expert_parallel", "flops_profiler",
    "fp16", "gradient_accumulation_steps", "gradient_allreduce_op", "gradient_clipping", "gradient_predivide_factor",
    "hybrid_engine", "log_level", "managed_gradient_accumulation", "memory_breakdown", "optimizer", "pipeline",
    "prescale_gradients", "scheduler", "seq_parallel_communication_data_type", "steps_per_print", "tensor_parallel",
    "tensorboard", "timers", "torch_autocast", "train_batch_size", "train_micro_batch_size_per_gpu",
    "use_data_before_expert_parallelism", "wall_clock_breakdown", "wandb", "weight_quantization",
    "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "zero_optimization",
})

# keys DeepSpeed 0.19 rejects as removed features
REMOVED_KEYS: frozenset[str] = frozenset({
    "amp", "compression_training", "curriculum_learning", "eigenvalue", "elasticity", "graph_harvesting", "nebula",
    "progressive_layer_drop", "quantize_training", "sparse_attention", "sparse_gradients",
})
REMOVED_ZERO_KEYS: frozenset[str] = frozenset({"mics_shard_size", "mics_hierarchical_params_gather",
                                               "zeropp_loco_param"})

DEEPSPEED_SUBSECTION_KEYS: dict[str, frozenset[str]] = {
    "zero_optimization": frozenset({
        "allgather_bucket_size", "allgather_partitions", "allgather_sequential", "compute_grad_norm",
        "contiguous_gradients", "cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory",
        "elastic_checkpoint", "enable_sanity_checks", "gather_16bit_weights_on_model_save",
        "ignore_unused_parameters", "leaf_module", "legacy_stage1", "load_from_fp32_weights",
        "log_trace_cache_warnings", "max_live_parameters", "max_reuse_distance", "memory_efficient_linear",
        "model_persistence_threshold", "module_granularity_threshold", "offload_optimizer", "offload_param",
        "overlap_comm", "override_module_apply", "param_persistence_threshold", "parameter_alignment",
        "pipeline_loading_checkpoint", "prefetch_bucket_size", "reduce_bucket_size", "reduce_scatter",
        "round_robin_gradients", "save_muon_momentum_buffer_in_memory", "stage", "stage3_allgather_sequential",
        "stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
        "stage3_max_live_parameters", "stage3_max_reuse_distance", "stage3_model_persistence_threshold",
        "stage3_module_granularity_threshold", "stage3_param_persistence_threshold", "stage3_prefetch_bucket_size",
        "stage3_use_all_reduce_for_fetch_params", "sub_group_size", "use_all_reduce_for_fetch_params",
        "use_multi_rank_bucket_allreduce", "zenflow", "zero_hpz_partition_size", "zero_quantized_gradients",
        "zero_quantized_nontrainable_weights", "zero_quantized_weights",
    }),
    "bf16": frozenset({"bf16_master_weights_and_grads", "bf16_optimizer_states", "check_grad_overflow", "enabled",
                       "immediate_grad_update"}),
    "fp16": frozenset({"auto_cast", "consecutive_hysteresis", "enabled", "fp16_master_weights_and_grads",
                       "hysteresis", "initial_scale_power", "loss_scale", "loss_scale_window", "min_loss_scale"}),
}

# known to DeepSpeed, but a stormshard run would not do what they ask: key -> what to use instead
NOT_HONOURED: dict[str, str] = {
    "bfloat16": "it is DeepSpeed's old spelling of bf16; set training.precision='bf16' (deepspeed.bf16 is "
                "generated from it)",
    "pipeline": "stormshard has no pipeline parallelism; shard the model with parallel.gpus_per_model",
    "tensor_parallel": "DeepSpeed's AutoTP would clash with stormshard's sharding; set parallel.shard_strategy="
                       "'tensor' (tensor parallelism over parallel.gpus_per_model)",
    "expert_parallel": "stormshard models have no mixture-of-experts layers",
    "hybrid_engine": "it serves RLHF generation, which stormshard does not run",
    "checkpoint": "stormshard writes its own checkpoints; set training.checkpoint_interval and "
                  "training.keep_checkpoints",
    "datastates_ckpt": "stormshard writes its own checkpoints; set training.checkpoint_interval",
    "dataloader_drop_last": "stormshard reads the data itself (no DeepSpeed data loader); windows that do not fill "
                            "a batch are never drawn",
    "data_efficiency": "stormshard reads the data itself (no DeepSpeed data sampler)",
    "autotuning": "autotuning needs DeepSpeed's `--autotuning` launcher mode, which stormshard does not support",
}

# zero_optimization keys read only at ZeRO stage 3 (not supported: it clashes with model sharding)
ZERO3_ONLY_KEYS: frozenset[str] = frozenset({
    "offload_param", "cpu_offload_param", "max_live_parameters", "max_reuse_distance", "prefetch_bucket_size",
    "param_persistence_threshold", "model_persistence_threshold", "gather_16bit_weights_on_model_save",
    "zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_nontrainable_weights",
    "module_granularity_threshold", "use_all_reduce_for_fetch_params",
})


def _suggest(key: str, known: frozenset[str]) -> str:
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.75)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _check_subsection(name: str, section: Any) -> None:
    if not isinstance(section, dict):
        raise ValueError(f"deepspeed.{name} must be an object, got {section!r}")
    known = DEEPSPEED_SUBSECTION_KEYS[name]
    for key in section:
        if name == "zero_optimization" and key in REMOVED_ZERO_KEYS:
            raise ValueError(f"deepspeed.zero_optimization.{key} was removed from DeepSpeed 0.19: remove it")
        if key not in known:
            raise ValueError(
                f"deepspeed.{name}.{key} is not a key DeepSpeed 0.19 accepts{_suggest(key, known)}: fix the spelling "
                f"or remove it (the keys are {', '.join(sorted(known))})"
            )
        if name == "zero_optimization" and (key in ZERO3_ONLY_KEYS or key.startswith("stage3_")):
            raise ValueError(
                f"deepspeed.zero_optimization.{key} is read only at ZeRO stage 3, which stormshard does not "
                "support (it clashes with model sharding): remove it"
            )


def check_deepspeed_section(engine: str, deepspeed: dict[str, Any]) -> None:
    """Every key of the ``deepspeed`` section is one DeepSpeed 0.19 accepts and stormshard honours,
    and the section is empty unless ``engine == "deepspeed"``. Raises ``ValueError`` naming the key
    and the fix (see the module docstring)."""
    if not isinstance(deepspeed, dict):
        raise ValueError(f"deepspeed must be an object of DeepSpeed settings, got {deepspeed!r}")
    for key, value in deepspeed.items():
        if key in REMOVED_KEYS:
            raise ValueError(f"deepspeed.{key} was removed from DeepSpeed 0.19 (it would be rejected there): remove it")
        if key not in DEEPSPEED_KEYS:
            moved = {"train_micro_batch_size_per_gpu": "training.micro_batch_size",
                     "gradient_accumulation_steps": "training.gradient_accumulation_steps",
                     "gradient_clipping": "training.gradient_clipping"}
            hint = _suggest(key, DEEPSPEED_KEYS)
            for ds_key, field in moved.items():
                if ds_key in hint:
                    hint += f"; that one is set as {field} in the experiment config"
            raise ValueError(
                f"deepspeed.{key} is not a key DeepSpeed 0.19 accepts{hint}: fix the spelling or remove it "
                "(DeepSpeed would ignore it without a word)"
            )
        if key in NOT_HONOURED:
            raise ValueError(f"deepspeed.{key} is not honoured by stormshard: {NOT_HONOURED[key]}; remove it")
        if key in DEEPSPEED_SUBSECTION_KEYS:
            _check_subsection(key, value)
    if deepspeed and engine != "deepspeed":
        raise ValueError(
            f"the deepspeed section holds {sorted(deepspeed)} but engine={engine!r} does not read it (only engine "
            f"'deepspeed' does): remove the deepspeed section, or set engine 'deepspeed'. Engine-neutral settings "
            "(training.precision, training.micro_batch_size, ...) apply to every engine"
        )
