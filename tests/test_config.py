"""The experiment config: one place per knob (engine-neutral micro batch, accumulation, clipping,
optimizer), the --deepspeed_config merge rule, the schedule checks that replaced silent clamps, and
the one PowerSGD schema."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from stormshard.parallel.compression import PowerSGDConfig
from stormshard.training.config import (
    ConfigDeprecationWarning,
    ConfigError,
    ExperimentConfig,
    load_experiment_config,
    merge_deepspeed_file,
)
from stormshard.training.engine import EngineSettings

CONFIGS = Path(__file__).resolve().parent.parent / "configs"

KNOBS = {
    "training": {"max_steps": 20, "lr": 2e-3, "lr_min": 1e-4, "warmup_steps": 5, "micro_batch_size": 3,
                 "gradient_accumulation_steps": 2, "gradient_clipping": 0.5},
    "optimizer": {"type": "AdamW", "betas": [0.8, 0.9], "eps": 1e-6, "weight_decay": 0.2},
}


@pytest.mark.parametrize("engine", ["deepspeed", "ddp", "local"])
def test_engine_neutral_knobs_reach_the_engine_settings(engine):
    deepspeed = {"zero_optimization": {"stage": 1}} if engine == "deepspeed" else {}  # read by engine deepspeed only
    cfg = load_experiment_config({**KNOBS, "engine": engine, "deepspeed": deepspeed})
    assert cfg.micro_batch == 3
    s = cfg.engine_settings(20)
    assert (s.engine, s.micro_batch_size, s.accumulation, s.clipping) == (engine, 3, 2, 0.5)
    assert s.adamw_kwargs() == {"lr": 2e-3, "betas": (0.8, 0.9), "eps": 1e-6, "weight_decay": 0.2}
    assert (s.schedule.lr, s.schedule.lr_min, s.schedule.warmup_steps, s.schedule.total_steps) == (2e-3, 1e-4, 5, 20)
    assert s.deepspeed == deepspeed


def test_defaults():
    cfg = load_experiment_config({})
    s = cfg.engine_settings(100)
    assert cfg.micro_batch == 1 and s.accumulation == 1 and s.clipping == 0.0 and cfg.deepspeed == {}
    assert s.adamw_kwargs() == {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}


@pytest.mark.parametrize(
    "deepspeed, field",
    [
        ({"train_micro_batch_size_per_gpu": 2}, "training.micro_batch_size"),
        ({"gradient_accumulation_steps": 2}, "training.gradient_accumulation_steps"),
        ({"gradient_clipping": 1.0}, "training.gradient_clipping"),
        ({"optimizer": {"type": "AdamW", "params": {"weight_decay": 0.0}}}, "optimizer"),
    ],
)
def test_old_spelling_in_the_deepspeed_section_names_the_new_field(deepspeed, field):
    key = next(iter(deepspeed))
    for engine in ("deepspeed", "ddp"):
        with pytest.raises(ConfigError, match=f"deepspeed.{key} is not read from the deepspeed section.*set {field} "):
            load_experiment_config({"engine": engine, "deepspeed": deepspeed})
    # also as a top-level override (only --deepspeed_config files get the merge rule)
    with pytest.raises(ConfigError, match=f"set {field} "):
        load_experiment_config({}, overrides={"deepspeed": deepspeed})


@pytest.mark.parametrize(
    "training, match",
    [
        ({"max_steps": 10, "lr": 1e-3, "lr_min": 1e-2},
         r"training.lr_min=0.01 is above training.lr=0.001: .*set training.lr_min to at most 0.001"),
        ({"max_steps": 10, "warmup_steps": 20},
         "training.warmup_steps=20 exceeds training.max_steps=10: .*set training.warmup_steps to at most 10"),
        ({"max_steps": 10, "lr": float("inf")}, "training.lr must be finite"),
        ({"max_steps": 10, "micro_batch_size": 0}, "training.micro_batch_size"),
        ({"max_steps": 10, "micro_batch_size": 1.5}, "training.micro_batch_size"),
        ({"max_steps": 10, "gradient_accumulation_steps": 0}, "training.gradient_accumulation_steps"),
        ({"max_steps": 10, "gradient_clipping": -1}, "training.gradient_clipping"),
    ],
)
def test_schedule_and_batch_errors_name_the_field(training, match):
    with pytest.raises(ConfigError, match=match):
        load_experiment_config({"training": training})


def test_warmup_longer_than_an_epoch_run_is_an_error():
    """With epochs the step count is known once the data is read: engine_settings raises then."""
    cfg = load_experiment_config({"training": {"epochs": 2, "warmup_steps": 30}})
    assert cfg.engine_settings(30).schedule.warmup_steps == 30  # equal is fine (all warm-up)
    with pytest.raises(ConfigError, match=r"training.warmup_steps=30 exceeds the run's 12 optimizer steps "
                                          r"\(training.epochs=2 of this data\).*at most 12"):
        cfg.engine_settings(12)


def test_optimizer_section():
    assert load_experiment_config({"optimizer": {"type": "adamw"}}).optimizer.type == "adamw"
    for bad, match in [({"type": "sgd"}, "optimizer.type"), ({"lr": 0.1}, "optimizer.lr"),
                       ({"betas": [0.9, 1.0]}, "optimizer.betas must lie in"), ({"weight_decay": -1}, "weight_decay")]:
        with pytest.raises(ConfigError, match=match):
            load_experiment_config({"optimizer": bad})


# ------------------------------------------------------------------------------ --deepspeed_config


def test_deepspeed_file_moves_the_engine_neutral_keys(tmp_path):
    ds_file = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3, "gradient_clipping": 2.0,
               "optimizer": {"type": "AdamW", "params": {"lr": 5e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}},
               "bf16": {"enabled": True}, "zero_optimization": {"stage": 1}, "train_batch_size": 24}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds_file))
    base = {"training": {"max_steps": 10, "lr_min": 1e-5}, "deepspeed": {"zero_optimization": {"stage": 2}}}
    cfg = load_experiment_config(base, deepspeed_config=path)
    t = cfg.training
    assert (t.micro_batch_size, t.gradient_accumulation_steps, t.gradient_clipping, t.lr) == (4, 3, 2.0, 5e-4)
    assert cfg.optimizer.betas == (0.9, 0.95) and cfg.optimizer.weight_decay == 0.1 and cfg.optimizer.eps == 1e-8
    # the file replaces the section; DeepSpeed's own keys stay, bf16.enabled moves to training.precision
    assert cfg.deepspeed == {"zero_optimization": {"stage": 1}, "train_batch_size": 24}
    assert t.precision == "bf16"
    # equal values in both places are fine
    same = {"training": {"max_steps": 10, "micro_batch_size": 4}, "optimizer": {"weight_decay": 0.1}}
    assert load_experiment_config(same, deepspeed_config=ds_file).training.micro_batch_size == 4
    # the raw config passed in is not modified
    assert merge_deepspeed_file(base, ds_file)["training"]["micro_batch_size"] == 4
    assert "micro_batch_size" not in base["training"]


@pytest.mark.parametrize(
    "config, ds_file, match",
    [
        ({"training": {"max_steps": 10, "micro_batch_size": 2}}, {"train_micro_batch_size_per_gpu": 4},
         "sets train_micro_batch_size_per_gpu=4 but the config sets training.micro_batch_size=2"),
        ({"training": {"max_steps": 10, "gradient_clipping": 1.0}}, {"gradient_clipping": 32.0},
         "sets gradient_clipping=32.0 but the config sets training.gradient_clipping=1.0"),
        ({"optimizer": {"weight_decay": 0.0}}, {"optimizer": {"type": "AdamW", "params": {"weight_decay": 0.1}}},
         "sets optimizer.params.weight_decay=0.1 but the config sets optimizer.weight_decay=0.0"),
        ({"training": {"max_steps": 10, "lr": 1e-3}}, {"optimizer": {"type": "AdamW", "params": {"lr": 0.5}}},
         "sets optimizer.params.lr=0.5 but the config sets training.lr=0.001"),
        ({}, {"optimizer": {"type": "Lamb"}}, "is not AdamW"),
        ({}, {"optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}}, "is not AdamW"),
        ({}, {"optimizer": {"type": "AdamW", "params": {"torch_adam": False}}}, r"\['torch_adam'\] are not AdamW"),
        ({}, {"scheduler": {"type": "WarmupLR"}}, "owns the learning-rate schedule"),
        ({}, {"zero_optimization": {"stage": 3}}, "stage=3 is not supported"),
    ],
)
def test_deepspeed_file_conflicts_name_both_places(config, ds_file, match):
    with pytest.raises(ConfigError, match=match):
        load_experiment_config(config, deepspeed_config=ds_file)


def test_deepspeed_file_adam_with_adam_w_mode_is_adamw():
    ds_file = {"optimizer": {"type": "Adam", "params": {"adam_w_mode": True, "eps": 1e-7}}}
    assert load_experiment_config({}, deepspeed_config=ds_file).optimizer.eps == 1e-7


def test_missing_deepspeed_file(tmp_path):
    with pytest.raises(ConfigError, match="DeepSpeed config .*nope.json does not exist"):
        load_experiment_config({}, deepspeed_config=tmp_path / "nope.json")


# ------------------------------------------------------------------------------ old spellings: one home per choice

TRAINING = {"max_steps": 10, "warmup_steps": 1}

OLD_AND_NEW = {
    "processor strategy": (
        {"model": {"processor": {"num_heads": 4, "shard_strategy": "shard_heads"}}, "parallel": {"gpus_per_model": 2}},
        {"model": {"processor": {"num_heads": 4}}, "parallel": {"gpus_per_model": 2, "shard_strategy": "shard_heads"}},
        ["model.processor.shard_strategy='shard_heads'", "parallel.shard_strategy='shard_heads'"]),
    "processor strategy, new key equal": (
        {"model": {"processor": {"shard_strategy": "tensor"}}, "parallel": {"gpus_per_model": 2,
                                                                           "shard_strategy": "tensor"}},
        {"parallel": {"gpus_per_model": 2, "shard_strategy": "tensor"}},
        ["model.processor.shard_strategy='tensor'", "parallel.shard_strategy='tensor'"]),
    "tensor_model_parallel_size": (
        {"parallel": {"tensor_model_parallel_size": 2}},
        {"parallel": {"gpus_per_model": 2, "shard_strategy": "tensor"}},
        ["parallel.tensor_model_parallel_size=2", "parallel.gpus_per_model=2 and parallel.shard_strategy='tensor'"]),
    "tensor_model_parallel_size 1": (
        {"parallel": {"tensor_model_parallel_size": 1, "shard_strategy": "shard_heads"}},
        {"parallel": {"gpus_per_model": 1, "shard_strategy": "shard_heads"}},
        ["parallel.tensor_model_parallel_size=1", "parallel.gpus_per_model=1"]),
    "deepspeed.bf16": (
        {"deepspeed": {"bf16": {"enabled": True}, "zero_optimization": {"stage": 1}}},
        {"training": {**TRAINING, "precision": "bf16"}, "deepspeed": {"zero_optimization": {"stage": 1}}},
        ["deepspeed.bf16.enabled=true", "training.precision='bf16'"]),
    "deepspeed.bf16 disabled, DeepSpeed's own bf16 keys stay": (
        {"deepspeed": {"bf16": {"enabled": False, "immediate_grad_update": True}}},
        {"training": {**TRAINING, "precision": "fp32"}, "deepspeed": {"bf16": {"immediate_grad_update": True}}},
        ["deepspeed.bf16.enabled=false", "training.precision='fp32'"]),
    "deepspeed.fp16 disabled": (
        {"deepspeed": {"fp16": {"enabled": False, "loss_scale": 0}, "zero_optimization": {"stage": 1}}},
        {"deepspeed": {"zero_optimization": {"stage": 1}}},
        ["deepspeed.fp16 (disabled)", "training.precision"]),
}


@pytest.mark.parametrize("old, new, names", OLD_AND_NEW.values(), ids=OLD_AND_NEW.keys())
def test_old_spelling_is_read_once_with_a_message_as_the_new_one(old, new, names):
    old = {"training": dict(TRAINING), **old}
    new = {"training": dict(TRAINING), **new}
    with pytest.warns(ConfigDeprecationWarning) as caught:
        from_old = load_experiment_config(old)
    assert len(caught) == 1, [str(w.message) for w in caught]  # read once: one message
    for name in names:  # the message names the old key and the new one
        assert name in str(caught[0].message), str(caught[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigDeprecationWarning)
        from_new = load_experiment_config(new)
        # the validated config holds the new spelling only: its dump loads back without a message
        assert ExperimentConfig(**from_old.model_dump(mode="json")) == from_old
    assert from_old == from_new
    assert from_old.model_dump(mode="json") == from_new.model_dump(mode="json")
    assert "shard_strategy" not in from_old.model_dump()["model"]["processor"]
    assert "tensor_model_parallel_size" not in from_old.model_dump()["parallel"]
    assert "enabled" not in from_old.deepspeed.get("bf16", {})


def test_shard_strategy_is_always_concrete():
    assert load_experiment_config({}).parallel.shard_strategy == "shard_sequence"
    stored = {"parallel": {"gpus_per_model": 2, "shard_strategy": None}}  # how older versions stored "unset"
    assert load_experiment_config(stored).parallel.shard_strategy == "shard_sequence"
    with pytest.raises(ConfigError, match="parallel.shard_strategy"):
        load_experiment_config({"parallel": {"shard_strategy": "shard_rows"}})


CONFLICTS = [
    ({"model": {"processor": {"shard_strategy": "shard_heads"}}, "parallel": {"shard_strategy": "tensor"}},
     ["model.processor.shard_strategy='shard_heads'", "parallel.shard_strategy='tensor'"]),
    ({"model": {"processor": {"shard_strategy": "shard_heads"}}, "parallel": {"tensor_model_parallel_size": 2}},
     ["model.processor.shard_strategy='shard_heads'", "parallel.tensor_model_parallel_size=2"]),
    ({"parallel": {"tensor_model_parallel_size": 2, "shard_strategy": "shard_sequence"}},
     ["parallel.tensor_model_parallel_size=2", "parallel.shard_strategy='shard_sequence'"]),
    ({"parallel": {"tensor_model_parallel_size": 2, "gpus_per_model": 4}},
     ["parallel.tensor_model_parallel_size=2", "parallel.gpus_per_model=4"]),
    ({"training": {**TRAINING, "precision": "fp32"}, "deepspeed": {"bf16": {"enabled": True}}},
     ["deepspeed.bf16.enabled=True", "training.precision='fp32'"]),
    ({"training": {**TRAINING, "precision": "bf16"}, "deepspeed": {"bf16": {"enabled": False}}},
     ["deepspeed.bf16.enabled=False", "training.precision='bf16'"]),
    ({"deepspeed": {"fp16": {"enabled": True}}}, ["deepspeed.fp16.enabled=True", "training.precision='bf16'"]),
    ({"engine": "ddp", "deepspeed": {"bf16": {"enabled": True}}},
     ["deepspeed.bf16.enabled=True", "engine='ddp'", "training.precision='bf16'"]),
]


@pytest.mark.parametrize("config, names", CONFLICTS, ids=[c[1][0] + " / " + c[1][1] for c in CONFLICTS])
def test_old_and_new_spellings_that_disagree_name_both_keys(config, names):
    with pytest.raises(ConfigError) as err:
        load_experiment_config(config)
    for name in names:
        assert name in str(err.value), str(err.value)


def test_deepspeed_precision_one_reader_for_the_section_and_the_file():
    """deepspeed.bf16 in the config's section (deprecated: a message) and in a --deepspeed_config file
    (DeepSpeed's format: no message) go through the same function and give the same config."""
    with pytest.warns(ConfigDeprecationWarning, match="deepspeed.bf16.enabled=true"):
        from_section = load_experiment_config({"training": TRAINING, "deepspeed": {"bf16": {"enabled": True}}})
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigDeprecationWarning)
        from_file = load_experiment_config({"training": TRAINING}, deepspeed_config={"bf16": {"enabled": True}})
    assert from_section == from_file and from_file.training.precision == "bf16" and from_file.deepspeed == {}
    # the same rule for a disagreement, named with the file
    with pytest.raises(ConfigError, match=r"bf16.enabled of --deepspeed_config=True but training.precision='fp32'"):
        merge_deepspeed_file({"training": {"precision": "fp32"}}, {"bf16": {"enabled": True}})
    # EngineSettings, built by hand, take the precision from their one field only
    with pytest.raises(ValueError, match="deepspeed.bf16.enabled=True is set next to precision"):
        EngineSettings(deepspeed={"bf16": {"enabled": True}})


# ------------------------------------------------------------------------------ compression


def test_compression_section_is_the_powersgd_config():
    cfg = load_experiment_config({"engine": "ddp", "compression": {"type": "powersgd", "rank": 2, "start_iter": 0}})
    assert cfg.compression == PowerSGDConfig(rank=2, start_iter=0)
    assert cfg.engine_settings(100).compression is cfg.compression
    dumped = cfg.model_dump(mode="json")["compression"]
    assert dumped == {"type": "powersgd", **PowerSGDConfig(rank=2, start_iter=0).as_dict()}
    # the dump loads back to the same config (resume_config.json)
    assert ExperimentConfig(**cfg.model_dump(mode="json")) == cfg
    assert load_experiment_config({"engine": "ddp", "compression": {"rank": 3}}).compression.rank == 3
    for bad, match in [({"type": "topk"}, "compression.type='topk'"), ({"ranks": 2}, r"unknown key\(s\) \['ranks'\]"),
                       ({"rank": 0}, "PowerSGDConfig.rank must be at least 1"),
                       ({"rank": 2.5}, "PowerSGDConfig.rank must be an int"), ("powersgd", "must be an object")]:
        with pytest.raises(ConfigError, match=match):
            load_experiment_config({"engine": "ddp", "compression": bad})


# ------------------------------------------------------------------------------ shipped configs


def test_shipped_configs_use_the_engine_neutral_fields():
    paths = sorted(CONFIGS.glob("*.json"))
    assert len(paths) >= 8, f"expected the shipped configs in {CONFIGS}"
    for path in paths:
        with warnings.catch_warnings():
            warnings.simplefilter("error", ConfigDeprecationWarning)  # no shipped config uses an old spelling
            cfg = load_experiment_config(path)
        raw = json.loads(path.read_text())
        assert "micro_batch_size" in raw["training"], path.name
        if cfg.engine != "deepspeed":
            assert "deepspeed" not in raw, f"{path.name}: engine {cfg.engine!r} carries a deepspeed section"
        total = cfg.training.max_steps
        assert cfg.engine_settings(total).micro_batch_size == cfg.micro_batch
    ddp = load_experiment_config(CONFIGS / "quickstart_ddp_powersgd.json")
    assert ddp.engine == "ddp" and ddp.deepspeed == {} and ddp.training.gradient_clipping == 1.0
