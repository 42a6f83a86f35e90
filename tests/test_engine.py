"""Gradient reduction inside a model group and the training engines (local, DDP, DeepSpeed ZeRO 0-2,
PowerSGD): one sharded / data-parallel step equals the single-process step with the same batch."""

from __future__ import annotations

import copy
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(os.path.dirname(os.path.dirname(__file__)), ".cache",
                                                           "torch_extensions"))

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from pydantic import ValidationError  # noqa: E402
from torch import nn  # noqa: E402

from stormshard.parallel.comm import reduce_tensor  # noqa: E402
from stormshard.parallel.compression import PowerSGDCompressor  # noqa: E402
from stormshard.parallel.counter import CommCounter  # noqa: E402
from stormshard.parallel.grads import (  # noqa: E402
    clip_grad_norm_,
    grad_norm,
    reduce_model_parallel_gradients,
    register_model_parallel_grad_hooks,
)
from stormshard.parallel.partition import Partition, set_partition  # noqa: E402
from stormshard.parallel.shapes import balanced_sizes  # noqa: E402
from stormshard.parallel.topology import ParallelLayout, ProcessGroups, build_process_groups  # noqa: E402
from stormshard.training.engine import (  # noqa: E402
    EngineError,
    EngineSettings,
    build_engine,
    resolve_deepspeed_config,
)
from stormshard.training.schedule import build_scheduler  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402

NODES, CHANNELS, HIDDEN = 7, 3, 5


# --------------------------------------------------------------------------------------------
# a small node-sharded model: per-node MLP (replicated weights) and a per-node gain (partitioned)
# --------------------------------------------------------------------------------------------


class NodeModel(nn.Module):
    """``(batch, nodes, channels) -> (batch, nodes, channels)``: Linear, LayerNorm, GELU, dropout,
    Linear on every node, times a per-node gain. Holds ``nodes`` of the ``NODES`` nodes."""

    def __init__(self, nodes: int = NODES, dropout: float = 0.0, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.lin1 = nn.Linear(CHANNELS, HIDDEN, dtype=dtype)
        self.norm = nn.LayerNorm(HIDDEN, dtype=dtype)
        self.drop = nn.Dropout(dropout)
        self.lin2 = nn.Linear(HIDDEN, CHANNELS, dtype=dtype)
        self.gain = nn.Parameter(torch.ones(nodes, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.lin1.weight.dtype)  # like stormshard's models: DeepSpeed's bf16 mode makes the weights bf16
        h = self.drop(F.gelu(self.norm(self.lin1(x))))
        return self.lin2(h) * self.gain[:, None]


def make_model(seed: int, dropout: float = 0.0, dtype: torch.dtype = torch.float32, nodes: int = NODES) -> NodeModel:
    torch.manual_seed(seed)
    model = NodeModel(nodes, dropout, dtype)
    with torch.no_grad():
        model.gain.copy_(1 + 0.5 * torch.randn(nodes, dtype=dtype))
        model.norm.weight.add_(0.3 * torch.randn(HIDDEN, dtype=dtype))
    return model


def shard_model(full: NodeModel, parts: int, index: int) -> NodeModel:
    """This model-group rank's copy: all weights replicated, the gain sliced (with Partition)."""
    nodes = full.gain.numel()
    sizes = balanced_sizes(nodes, parts)
    start = sum(sizes[:index])
    local = NodeModel(sizes[index], full.drop.p, full.gain.dtype)
    state = {k: v.clone() for k, v in full.state_dict().items()}
    state["gain"] = state["gain"][start : start + sizes[index]].clone()
    local.load_state_dict(state)
    if parts > 1:
        set_partition(local.gain, Partition(dim=0, parts=parts, index=index, full_size=nodes))
    return local


def node_slice(x: torch.Tensor, parts: int, index: int) -> torch.Tensor:
    sizes = balanced_sizes(x.shape[1], parts)
    return x[:, sum(sizes[:index]) : sum(sizes[: index + 1])]


def sharded_loss(model: nn.Module, x: torch.Tensor, target: torch.Tensor, groups: ProcessGroups) -> torch.Tensor:
    """Mean squared error over the full batch and all nodes; each model rank sees its node slice."""
    k, r = groups.layout.gpus_per_model, groups.model_rank
    out = model(node_slice(x, k, r))
    local = (out - node_slice(target, k, r)).pow(2).sum() / (x.shape[0] * x.shape[1] * CHANNELS)
    return reduce_tensor(local, groups.model_group)


def batch(step: int, size: int, dtype: torch.dtype = torch.float32, nodes: int = NODES
          ) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(size, nodes, CHANNELS, generator=g, dtype=dtype)
    return x, torch.sin(x) + 0.1 * torch.randn(x.shape, generator=g, dtype=dtype)


def groups_for(world: int, gpus_per_model: int) -> ProcessGroups:
    return build_process_groups(ParallelLayout(world_size=world, gpus_per_model=gpus_per_model))


# --------------------------------------------------------------------------------------------
# grads.py: model-group sum (bucketed and hooks) and clipping
# --------------------------------------------------------------------------------------------


def _check_model_parallel_grads(rank: int, world: int) -> None:
    dtype = torch.float64
    groups = groups_for(world, world)
    full = make_model(3, dtype=dtype)
    x, target = batch(0, 2, dtype)
    ref = copy.deepcopy(full)
    ((ref(x) - target).pow(2).sum() / (2 * NODES * CHANNELS)).backward()
    sizes = balanced_sizes(NODES, world)
    start = sum(sizes[:rank])

    def expect_close(local: NodeModel) -> None:
        for name, p in local.named_parameters():
            want = ref.get_parameter(name).grad
            if name == "gain":
                want = want[start : start + sizes[rank]]
            torch.testing.assert_close(p.grad, want, rtol=1e-12, atol=1e-14, msg=name)

    # without reduction the replicated gradients are partial (the test can fail)
    local = shard_model(full, world, rank)
    sharded_loss(local, x, target, groups).backward()
    assert not torch.allclose(local.lin1.weight.grad, ref.lin1.weight.grad)

    for cap in (None, 1e-4):  # one flat bucket; buckets of ~13 float64 elements
        local = shard_model(full, world, rank)
        sharded_loss(local, x, target, groups).backward()
        with CommCounter() as counter:
            reduce_model_parallel_gradients(local.parameters(), groups.model_group, bucket_cap_mb=cap)
        # buckets: all 48 elements; or [15], [5, 5], [5], [15], [3] (at most 13 elements unless one tensor)
        bucket_numels = [48] if cap is None else [15, 10, 5, 15, 3]
        assert counter.calls("all_reduce") == len(bucket_numels)
        assert counter.bytes("all_reduce") == sum(n * 8 * 2 * (world - 1) // world for n in bucket_numels)
        expect_close(local)

    local = shard_model(full, world, rank)
    handles = register_model_parallel_grad_hooks(local, groups.model_group)
    assert len(handles) == 6  # lin1, norm, lin2 weights and biases; the gain is partitioned
    for _ in range(2):  # two accumulated backwards: twice the gradient
        sharded_loss(local, x, target, groups).backward()
    for p in local.parameters():
        p.grad.div_(2)
    expect_close(local)
    # the full model's gradient norm, and clipping, equal the single-process ones
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e-3)
    # the multi-tensor squares (the default on GPUs) give the same norm
    multi = grad_norm(local.parameters(), groups.model_group, multi_tensor=True)
    torch.testing.assert_close(multi, ref_norm, rtol=1e-12, atol=0)
    norm = clip_grad_norm_(local.parameters(), 1e-3, groups.model_group)
    torch.testing.assert_close(norm, ref_norm, rtol=1e-12, atol=0)
    expect_close(local)
    assert grad_norm(local.parameters(), groups.model_group) <= 1e-3 * (1 + 1e-6)
    for h in handles:
        h.remove()


@pytest.mark.parametrize("world", [2, 3, 4])
def test_model_parallel_gradient_reduction(world):
    run_distributed(_check_model_parallel_grads, world)


def test_grads_bad_input():
    model = make_model(0)
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        reduce_model_parallel_gradients(model.parameters(), None, bucket_cap_mb=0)
    with pytest.raises(TypeError, match="nn.Module"):
        register_model_parallel_grad_hooks([1, 2], None)
    with pytest.raises(ValueError, match="max_norm"):
        clip_grad_norm_(model.parameters(), 0.0, None)


# --------------------------------------------------------------------------------------------
# engines: parity with one single-process step
# --------------------------------------------------------------------------------------------

MICRO, STEPS = 2, 2
SCHEDULE = {"lr": 0.02, "lr_min": 0.001, "warmup_steps": 1, "total_steps": 3}


def _settings(engine: str, stage: int = 0, accumulation: int = 2, powersgd: bool = False,
              mode: str | None = None, clip: float = 0.05, broadcast_buffers: bool = True,
              precision: str = "fp32") -> EngineSettings:
    """The engine's settings; ``mode`` None: the default ``model_parallel_grad_reduction``."""
    return EngineSettings(
        engine=engine,
        micro_batch_size=MICRO,
        deepspeed={"zero_optimization": {"stage": stage}} if engine == "deepspeed" else {},
        gradient_accumulation_steps=accumulation,
        gradient_clipping=clip,
        optimizer={"betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1},
        schedule=SCHEDULE,
        bucket_cap_mb=1.0,
        broadcast_buffers=broadcast_buffers,
        compression=({"rank": 1, "start_iter": 0, "min_numel": 0, "min_compression_rate": 0.0} if powersgd else None),
        precision=precision,
        **({} if mode is None else {"model_parallel_grad_reduction": mode}),
    )


def _reference(settings: EngineSettings, data_parallel: int, nodes: int = NODES) -> tuple[NodeModel, list[float]]:
    """Single process, fp32, the whole effective batch per step; PowerSGD (if any) on the mean gradient."""
    model = make_model(7, nodes=nodes)
    opt = torch.optim.AdamW(model.parameters(), **settings.adamw_kwargs())
    sched = build_scheduler(opt, settings.schedule)
    compressor = None
    if settings.compression is not None:
        compressor = PowerSGDCompressor(list(model.named_parameters()), None, settings.compression)
    effective = MICRO * settings.accumulation * data_parallel
    lrs = []
    for step in range(STEPS):
        x, target = batch(step, effective, nodes=nodes)
        ((model(x) - target).pow(2).sum() / x.numel()).backward()
        if compressor is not None:
            compressor.reduce_gradients()
        torch.nn.utils.clip_grad_norm_(model.parameters(), settings.clipping)
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
        opt.zero_grad()
    return model, lrs


def _train(engine, groups: ProcessGroups, settings: EngineSettings, nodes: int = NODES) -> list[float]:
    """STEPS optimizer steps; replica d takes its consecutive micro-batches of each effective batch."""
    acc, dp = settings.accumulation, groups.layout.data_parallel_size
    lrs = []
    for step in range(STEPS):
        x, target = batch(step, MICRO * acc * dp, nodes=nodes)
        lrs.append(engine.lr)
        for micro in range(acc):
            start = (groups.data_parallel_rank * acc + micro) * MICRO
            loss = sharded_loss(engine, x[start : start + MICRO], target[start : start + MICRO], groups)
            engine.backward(loss)
            assert engine.is_accumulation_boundary() == (micro == acc - 1)
            assert engine.step() == (micro == acc - 1)
    assert engine.global_step == STEPS and engine.micro_steps == STEPS * acc
    return lrs


# cases without "mode" run the default model_parallel_grad_reduction ("auto"); "hooks" / "bucketed" the old modes
CASES = [
    ("local", {"engine": "local"}),
    ("local hooks", {"engine": "local", "mode": "hooks"}),
    ("ddp", {"engine": "ddp"}),
    ("ddp hooks", {"engine": "ddp", "mode": "hooks"}),
    ("ddp bucketed", {"engine": "ddp", "mode": "bucketed", "broadcast_buffers": False}),
    ("ddp powersgd", {"engine": "ddp", "powersgd": True, "accumulation": 1}),
    ("ddp powersgd hooks", {"engine": "ddp", "powersgd": True, "accumulation": 1, "mode": "hooks"}),
    ("zero0", {"engine": "deepspeed", "stage": 0}),
    ("zero0 hooks", {"engine": "deepspeed", "stage": 0, "mode": "hooks"}),
    ("zero1", {"engine": "deepspeed", "stage": 1}),
    ("zero1 hooks", {"engine": "deepspeed", "stage": 1, "mode": "hooks"}),
    ("zero2", {"engine": "deepspeed", "stage": 2}),
    ("zero2 hooks", {"engine": "deepspeed", "stage": 2, "mode": "hooks"}),
    ("zero0 powersgd", {"engine": "deepspeed", "stage": 0, "powersgd": True, "accumulation": 1}),
    ("zero0 powersgd hooks", {"engine": "deepspeed", "stage": 0, "powersgd": True, "accumulation": 1,
                              "mode": "hooks"}),
]


def _expected_placement(kwargs: dict, gpus_per_model: int, dp: int, nodes: int) -> str:
    """Where the engine of a CASES entry sums over the model group (grad_sum's table)."""
    mode = kwargs.get("mode", "auto")
    if gpus_per_model == 1:
        return "none"
    if mode != "auto":
        return {"hooks": "hooks", "bucketed": "after_backward"}[mode]
    if kwargs["engine"] == "deepspeed" and kwargs.get("stage", 0) > 0:
        # the gain (the partitioned parameter) splits unevenly over 7 nodes: with data parallelism the ZeRO
        # partitions of the two model ranks differ, and the engine falls back to hooks
        return "zero_partition" if dp == 1 or nodes % gpus_per_model == 0 else "hooks"
    if kwargs["engine"] == "ddp" and kwargs.get("powersgd"):
        return "compression_hook"
    return "after_backward"


def _check_engines(rank: int, world: int, layouts: list[int], names: list[str] | None = None,
                   nodes: int = NODES) -> list[str]:
    done = []
    for gpus_per_model in layouts:
        groups = groups_for(world, gpus_per_model)
        dp = groups.layout.data_parallel_size
        for name, kwargs in CASES:
            if (kwargs["engine"] == "local" and dp > 1) or (names is not None and name not in names):
                continue
            settings = _settings(**kwargs)
            ref, ref_lrs = _reference(settings, dp, nodes)
            local = shard_model(make_model(7, nodes=nodes), gpus_per_model, groups.model_rank)
            engine = build_engine(local, groups, settings)
            assert engine.grad_sum_placement == _expected_placement(kwargs, gpus_per_model, dp, nodes), name
            lrs = _train(engine, groups, settings, nodes)
            assert lrs == pytest.approx(ref_lrs, rel=1e-12), (name, lrs, ref_lrs)
            if engine.grad_sum_placement == "zero_partition":
                assert engine._zero_sum.calls_last_step == 1, name  # one flat all-reduce per step
            for pname, p in engine.module.named_parameters():
                want = ref.get_parameter(pname).detach()
                if pname == "gain":
                    want = node_slice(want[None, :, None], gpus_per_model, groups.model_rank)[0, :, 0]
                torch.testing.assert_close(p.detach(), want, rtol=2e-5, atol=2e-6,
                                           msg=lambda m, n=name, q=pname, k=gpus_per_model: f"{n} gpus_per_model={k} {q}: {m}")
            done.append(f"{gpus_per_model}:{name}")
    return done


def test_engines_match_single_process_world2():
    """(world 2, data-parallel 2) and (world 2, gpus_per_model 2), every engine with the default
    model-group sum and the old modes."""
    done = run_distributed(_check_engines, 2, [1, 2], timeout=300)[0]
    assert len(done) == 2 * len(CASES) - 2


def test_engines_match_single_process_world4():
    """(world 4, gpus_per_model 2): data-parallel 2 over model groups of 2."""
    done = run_distributed(_check_engines, 4, [2], timeout=300)[0]
    assert len(done) == len(CASES) - 2


def test_zero_partition_sum_with_data_parallelism():
    """ZeRO 1/2 at (world 4, gpus_per_model 2) with an evenly split partitioned parameter (8 nodes): the
    model-group sum runs on DeepSpeed's gradient partition (one flat all-reduce), the gain untouched."""
    names = ["zero1", "zero2"]
    assert run_distributed(_check_engines, 4, [2], names, 8, timeout=300)[0] == ["2:zero1", "2:zero2"]


BF16_CASES = [(n, kw) for n, kw in CASES if n in ("local", "ddp", "zero0", "zero1", "zero2")]


def _check_bf16_engines(rank: int, world: int, layouts: list[int], nodes: int) -> list[str]:
    """bf16 (DeepSpeed's bf16 mode at ZeRO 1/2, autocast elsewhere) with the default model-group sum: the
    update of every parameter after STEPS steps against the fp32 single-process one, within bf16 accuracy.
    A missing or doubled model-group sum, or a summed partitioned gain, turns AdamW's update around."""
    done = []
    for gpus_per_model in layouts:
        groups = groups_for(world, gpus_per_model)
        dp = groups.layout.data_parallel_size
        for name, kwargs in BF16_CASES:
            if kwargs["engine"] == "local" and dp > 1:
                continue
            settings = _settings(**kwargs, precision="bf16")
            ref, _ = _reference(settings, dp, nodes)
            start = make_model(7, nodes=nodes)
            local = shard_model(start, gpus_per_model, groups.model_rank)
            before = {n: q.detach().clone() for n, q in local.named_parameters()}
            engine = build_engine(local, groups, settings)
            assert engine.grad_sum_placement == _expected_placement(kwargs, gpus_per_model, dp, nodes), name
            _train(engine, groups, settings, nodes)
            for pname, p in engine.module.named_parameters():
                want = ref.get_parameter(pname).detach() - start.get_parameter(pname).detach()
                if pname == "gain":
                    want = node_slice(want[None, :, None], gpus_per_model, groups.model_rank)[0, :, 0]
                got = p.detach().float() - before[pname]
                # updates are ~lr x steps = 4e-2; bf16 parameters round at 2^-9 relative (4e-3 near 2)
                torch.testing.assert_close(got, want, rtol=0, atol=1e-2,
                                           msg=lambda m, n=name, q=pname, k=gpus_per_model: f"bf16 {n} gpus_per_model={k} {q}: {m}")
            done.append(f"{gpus_per_model}:{name}")
    return done


@pytest.mark.parametrize("world, layouts, nodes", [(2, [2], 7), (4, [2], 8)])
def test_bf16_engines_match_single_process(world, layouts, nodes):
    """bf16 with the default model-group sum at (world 2, gpus_per_model 2) and (world 4, gpus_per_model 2)."""
    done = run_distributed(_check_bf16_engines, world, layouts, nodes, timeout=300)[0]
    assert len(done) == len(BF16_CASES) - (1 if world > 2 else 0)


# --------------------------------------------------------------------------------------------
# bad settings
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"engine": "horovod"}, "engine"),
        ({"unknown": 1}, "unknown"),
        ({"deepspeed": {"zero_optimization": {"stage": 3}}}, "stage=3"),
        ({"deepspeed": {"scheduler": {"type": "WarmupLR"}}}, "owns the learning-rate schedule"),
        ({"deepspeed": {"fp16": {"enabled": True}}}, "fp16"),
        ({"deepspeed": {"zero_optimization": {"stage": 2}}, "compression": {}}, "needs deepspeed.zero_optimization.stage=0"),
        ({"deepspeed": {"communication_data_type": "bf16"}, "compression": {}}, "choose one"),
        ({"precision": "bf16", "compression": {}}, "bf16 optimizer copies gradients"),
        # the precision is one field: DeepSpeed's bf16.enabled is generated from it, never given
        ({"deepspeed": {"bf16": {"enabled": True}}}, "deepspeed.bf16.enabled=True is set next to precision='fp32'"),
        ({"engine": "local", "compression": {}}, "no data parallelism"),
        ({"compression": {"rank": 0}}, "rank must be at least 1"),
        ({"compression": {"ranks": 2}}, "ranks"),
        # DeepSpeed's spellings of the engine-neutral knobs name the field to use
        ({"gradient_accumulation_steps": 2, "deepspeed": {"gradient_accumulation_steps": 4}},
         "deepspeed.gradient_accumulation_steps is not read .* set training.gradient_accumulation_steps"),
        ({"deepspeed": {"train_micro_batch_size_per_gpu": 2}},
         "deepspeed.train_micro_batch_size_per_gpu .* set training.micro_batch_size .*EngineSettings.micro_batch_size"),
        ({"deepspeed": {"gradient_clipping": 1.0}}, "set training.gradient_clipping"),
        ({"deepspeed": {"optimizer": {"type": "AdamW", "params": {"lr": 0.5}}}}, "deepspeed.optimizer .* set optimizer"),
        ({"optimizer": {"weight_decay": 0.1}, "deepspeed": {"optimizer": {"type": "AdamW",
                                                                           "params": {"weight_decay": 0.2}}}},
         "deepspeed.optimizer is not read"),
        ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps"),
        ({"micro_batch_size": 0}, "micro_batch_size"),
        ({"micro_batch_size": True}, "micro_batch_size"),
        ({"gradient_clipping": -1.0}, "gradient_clipping"),
        ({"optimizer": {"type": "Lamb"}}, "adamw"),
        ({"optimizer": {"lr": 0.5}}, "optimizer.lr"),
        ({"optimizer": {"betas": (0.9, 1.5)}}, "betas"),
        ({"optimizer": {"eps": 0.0}}, "eps"),
        ({"schedule": {"lr": 1e-3, "lr_min": 1e-2}}, "lr_min"),
        ({"bucket_cap_mb": 0}, "bucket_cap_mb"),
        ({"model_parallel_grad_reduction": "ring"}, "model_parallel_grad_reduction"),
    ],
)
def test_bad_engine_settings(kwargs, match):
    with pytest.raises(ValidationError, match=match):
        EngineSettings(**kwargs)


def test_settings_resolution():
    s = EngineSettings(gradient_accumulation_steps=3, gradient_clipping=1.0, optimizer={"weight_decay": 0.05})
    assert s.accumulation == 3 and s.clipping == 1.0
    assert s.adamw_kwargs() == {"lr": s.schedule.lr, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.05}
    assert EngineSettings().accumulation == 1 and EngineSettings().clipping == 0.0
    assert EngineSettings().micro_batch_size == 1
    assert EngineSettings().adamw_kwargs() == {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}


KNOBS = dict(micro_batch_size=3, gradient_accumulation_steps=2, gradient_clipping=0.5,
             optimizer={"betas": (0.8, 0.9), "eps": 1e-6, "weight_decay": 0.2},
             schedule={"lr": 0.02, "lr_min": 0.001, "warmup_steps": 1, "total_steps": 3})


def test_generated_deepspeed_config():
    """DeepSpeed's batch, clipping and optimizer keys come from the engine-neutral fields; the section
    keeps DeepSpeed's own keys."""
    own = {"bf16": {"immediate_grad_update": True}, "zero_optimization": {"stage": 1}, "communication_data_type": "bf16"}
    settings = EngineSettings(deepspeed=own, precision="bf16", **KNOBS)
    expected = {**own, "bf16": {"immediate_grad_update": True, "enabled": True}, "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2,
                "gradient_clipping": 0.5, "train_batch_size": 3 * 2 * 4,
                # ZeRO 1 partitions no gradients: no copy into a contiguous buffer unless asked for
                "zero_optimization": {"stage": 1, "contiguous_gradients": False}}
    # no optimizer section: the engine hands DeepSpeed torch's AdamW (no JIT build of DeepSpeed's fused Adam)
    assert resolve_deepspeed_config(settings, 4) == expected
    assert settings.deepspeed == own  # the settings are not modified
    asked = EngineSettings(deepspeed={"zero_optimization": {"stage": 1, "contiguous_gradients": True}}, **KNOBS)
    assert resolve_deepspeed_config(asked, 4)["zero_optimization"] == {"stage": 1, "contiguous_gradients": True}
    stage2 = EngineSettings(deepspeed={"zero_optimization": {"stage": 2}}, **KNOBS)
    assert resolve_deepspeed_config(stage2, 4)["zero_optimization"] == {"stage": 2}
    # an explicit train_batch_size is a cross-check; zero_optimization defaults to stage 0
    plain = EngineSettings(deepspeed={"train_batch_size": 6}, **KNOBS)
    assert resolve_deepspeed_config(plain, 1)["zero_optimization"] == {"stage": 0}
    with pytest.raises(EngineError, match="train_batch_size=6 but training.micro_batch_size 3 x training.gradient_accumulation_steps 2 x "
                                         "data-parallel size 2"):
        resolve_deepspeed_config(plain, 2)


def _check_knobs_reach_engines(rank: int, world: int) -> list[str]:
    """micro batch, accumulation, clipping and AdamW settings as each engine sees them."""
    seen = []
    for engine, gpus_per_model in (("local", world), ("ddp", 1), ("deepspeed", 1)):
        settings = EngineSettings(engine=engine, deepspeed={"zero_optimization": {"stage": 0}} if engine == "deepspeed"
                                  else {}, **KNOBS)
        built = build_engine(shard_model(make_model(0), gpus_per_model, rank if gpus_per_model > 1 else 0),
                             groups_for(world, gpus_per_model), settings)
        assert built.micro_batch_size == 3 and built.accumulation == 2, engine
        if engine == "deepspeed":
            assert built.ds.train_micro_batch_size_per_gpu() == 3 and built.ds.gradient_accumulation_steps() == 2
            assert built.ds.gradient_clipping() == 0.5 and built.ds.train_batch_size() == 3 * 2 * world
            groups = built.ds.optimizer.param_groups
        else:
            assert built.settings.clipping == 0.5
            groups = built.optimizer.param_groups
        for group in groups:
            assert tuple(group["betas"]) == (0.8, 0.9) and group["eps"] == 1e-6 and group["weight_decay"] == 0.2, engine
        assert built.lr == pytest.approx(0.02)  # a warm-up of 1 step reaches the peak at step 0
        seen.append(engine)
    return seen


def test_engine_neutral_knobs_reach_every_engine():
    assert run_distributed(_check_knobs_reach_engines, 2, timeout=300)[0] == ["local", "ddp", "deepspeed"]


def _check_layout_errors(rank: int, world: int) -> None:
    data_parallel = groups_for(world, 1)
    sharded = groups_for(world, world)
    with pytest.raises(EngineError, match="engine='local' has no data parallelism"):
        build_engine(make_model(0), data_parallel, EngineSettings(engine="local"))
    with pytest.raises(EngineError, match=r"use 'auto' \(the default"):
        build_engine(make_model(0), sharded, EngineSettings(deepspeed={"zero_optimization": {"stage": 1}},
                                                           model_parallel_grad_reduction="bucketed"))
    with pytest.raises(EngineError, match="bf16 optimizer takes the gradients inside backward"):
        build_engine(make_model(0), sharded, EngineSettings(precision="bf16", model_parallel_grad_reduction="bucketed"))
    with pytest.raises(EngineError, match=r"use 'auto' \(the default"):
        build_engine(make_model(0), sharded, EngineSettings(engine="ddp", compression={},
                                                           model_parallel_grad_reduction="bucketed"))
    with pytest.raises(EngineError, match="train_batch_size=5"):
        build_engine(make_model(0), data_parallel, EngineSettings(micro_batch_size=2, deepspeed={"train_batch_size": 5}))
    frozen = make_model(0).requires_grad_(False)
    with pytest.raises(EngineError, match="no trainable parameter"):
        build_engine(frozen, data_parallel, EngineSettings(engine="ddp"))
    assert dist.is_initialized()


def test_bad_engine_layouts():
    run_distributed(_check_layout_errors, 2)
    with pytest.raises(TypeError, match="ProcessGroups"):
        build_engine(make_model(0), object(), EngineSettings(engine="local"))
    with pytest.raises(EngineError, match="needs torch.distributed"):
        build_engine(make_model(0), build_process_groups(ParallelLayout(world_size=1)), EngineSettings(engine="ddp"))


def _adamw_steps(model: nn.Module, opt: torch.optim.Optimizer, steps: range, drop_grad_of: str | None = None) -> None:
    for step in steps:
        x, target = batch(step, 2)
        (model(x) - target).pow(2).mean().backward()
        if drop_grad_of is not None and step == steps[-1]:
            dict(model.named_parameters())[drop_grad_of].grad = None  # a parameter without a gradient
        opt.step()
        opt.zero_grad()


def test_flat_adamw_matches_torch_and_skips_dynamo():
    """The torch engines' AdamW (flat buffers on a CPU, no torch._dynamo import) takes the same steps as
    torch's default per-tensor AdamW, bit for bit: with two param groups, across state dicts in both
    directions and when a parameter has no gradient (the group goes to torch's path); its state dict is
    torch's layout, in compact tensors."""
    import subprocess
    import sys

    from stormshard.training.engine.adamw import FlatAdamW, build_adamw

    kwargs = {"lr": 0.01, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}

    def groups(model: nn.Module) -> list[dict]:
        named = list(model.named_parameters())
        return [{"params": [p for n, p in named if "norm" not in n]},
                {"params": [p for n, p in named if "norm" in n], "lr": 0.003, "weight_decay": 0.0}]

    ours, ref = make_model(3), make_model(3)
    opt, ref_opt = build_adamw(groups(ours), **kwargs), torch.optim.AdamW(groups(ref), **kwargs)
    assert isinstance(opt, FlatAdamW) and opt.defaults["foreach"] is True
    for model, o in ((ours, opt), (ref, ref_opt)):
        _adamw_steps(model, o, range(3))
    assert all(opt._flat[id(g)] is not None for g in opt.param_groups)  # both groups took the flat path
    for a, b in zip(ours.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b)
    saved = opt.state_dict()
    for entry in saved["state"].values():  # compact copies, not views of the flat buffers
        for value in entry.values():
            assert value.untyped_storage().nbytes() == value.numel() * value.element_size()
    ref_saved = ref_opt.state_dict()
    for i, entry in ref_saved["state"].items():
        for key, value in entry.items():
            assert torch.equal(saved["state"][i][key], value), (i, key)
    # torch's state into ours, ours into torch's: the next steps stay equal
    resumed, resumed_ref = make_model(0), make_model(0)
    resumed.load_state_dict(ref.state_dict())
    resumed_ref.load_state_dict(ours.state_dict())
    opt2, ref_opt2 = build_adamw(groups(resumed), **kwargs), torch.optim.AdamW(groups(resumed_ref), **kwargs)
    opt2.load_state_dict(ref_saved)
    ref_opt2.load_state_dict(saved)
    for model, o in ((resumed, opt2), (resumed_ref, ref_opt2), (ours, opt), (ref, ref_opt)):
        _adamw_steps(model, o, range(3, 5), drop_grad_of="gain")
    assert opt._flat[id(opt.param_groups[0])] is None  # "gain" had no gradient: torch's path from then on
    for a, b, c, d in zip(ours.parameters(), ref.parameters(), resumed.parameters(), resumed_ref.parameters(), strict=True):
        assert torch.equal(a, b) and torch.equal(c, b) and torch.equal(d, b)
    code = ("import sys, torch; from stormshard.training.engine.adamw import build_adamw; "
            "p = [torch.nn.Parameter(torch.ones(3))]; o = build_adamw(p, lr=0.1); p[0].grad = torch.ones(3); "
            "o.step(); o.zero_grad(); o.load_state_dict(o.state_dict()); print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "False", out


def test_multi_tensor_grad_norm_equals_the_per_parameter_sums():
    """The GPU's gradient norm (multi-tensor norms, one stack and sum per kind) equals the CPU's per-parameter
    sums in order: fp32 and bf16 gradients mixed (accumulated in fp32), partitioned and replicated ones,
    and clipping with either scales the gradients alike."""
    from stormshard.parallel.partition import Partition, set_partition

    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(40, 3)), nn.Parameter(torch.randn(7).bfloat16()),
              nn.Parameter(torch.randn(1000)), nn.Parameter(torch.randn(2, 2, 2).bfloat16())]
    set_partition(params[2], Partition(dim=0, parts=1, index=0, full_size=1000))
    for p in params:
        p.grad = torch.randn_like(p) * 3
    ref = grad_norm(params, None, multi_tensor=False)
    multi = grad_norm(params, None, multi_tensor=True)
    assert multi.dtype == ref.dtype == torch.float32
    torch.testing.assert_close(multi, ref, rtol=2e-6, atol=0)
    exact = sum(p.grad.double().square().sum() for p in params).sqrt()
    torch.testing.assert_close(multi.double(), exact, rtol=2e-6, atol=0)
    assert grad_norm(params[1:2], None, multi_tensor=True).dtype == torch.float32


def test_adamw_is_fused_on_cuda_parameters_only():
    """``build_adamw`` picks torch's fused kernel for CUDA parameters (one launch per step, the step count
    on the device) and the flat ``foreach`` path elsewhere; an explicit ``fused`` / ``foreach`` is kept.
    The fused kernel's arithmetic is torch's AdamW's: on a CPU it takes the same steps within 1e-6
    (``tests/gpu/test_cuda_training.py`` checks the CUDA choice and its steps)."""
    from stormshard.training.engine.adamw import build_adamw, fused_capable

    kwargs = {"lr": 0.01, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    ours, ref = make_model(3), make_model(3)
    assert not fused_capable(ours.parameters()) and not fused_capable([])
    assert not fused_capable([{"params": [torch.zeros(2, device="meta")]}])
    opt = build_adamw(ours.parameters(), **kwargs)
    assert opt.defaults["foreach"] is True and not opt.defaults["fused"]
    fused = build_adamw(ref.parameters(), fused=True, **kwargs)
    assert fused.defaults["fused"] is True and not fused.defaults["foreach"]
    for model, o in ((ours, opt), (ref, fused)):
        _adamw_steps(model, o, range(3))
    for a, b in zip(ours.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    # a saved state carries the kernel of the run that wrote it: loading keeps this optimizer's own
    # (a GPU run's fused state resumed on a CPU takes the flat path, a CPU run's state on a GPU stays fused)
    on_cpu = build_adamw(make_model(0).parameters(), **kwargs)
    on_cpu.load_state_dict(fused.state_dict())
    assert all(g["foreach"] is True and not g["fused"] for g in on_cpu.param_groups)
    assert all(s["step"].device.type == "cpu" for s in on_cpu.state.values())
    _adamw_steps(ours, opt, range(3, 4))
    resumed = make_model(0)
    resumed.load_state_dict(ref.state_dict())
    on_cpu = build_adamw(resumed.parameters(), **kwargs)
    on_cpu.load_state_dict(fused.state_dict())
    _adamw_steps(resumed, on_cpu, range(3, 4))
    assert all(on_cpu._flat[id(g)] is not None for g in on_cpu.param_groups)  # the flat CPU path
    as_fused = build_adamw(make_model(0).parameters(), fused=True, **kwargs)
    as_fused.load_state_dict(opt.state_dict())
    assert all(g["fused"] is True and not g["foreach"] for g in as_fused.param_groups)


def test_deepspeed_zero_steps_import_no_compiler():
    """A DeepSpeed ZeRO 1 engine trains without loading torch._dynamo, sympy or Triton: it is handed torch's
    AdamW (not DeepSpeed's, whose constructor imports the compiler), DeepSpeed's Muon module is imported with
    its torch.compile deferred and its Triton ops' availability check with Triton hidden (on the CPU
    accelerator it finds no GPU backend either way); the same steps, bit for bit, as DeepSpeed building torch's AdamW itself
    (the engines' parity tests)."""
    import subprocess
    import sys

    code = """
import os, sys, socket, torch, torch.distributed as dist
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
from stormshard.parallel.topology import ParallelLayout, build_process_groups
from stormshard.training.engine import EngineSettings, build_engine
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 4))
settings = EngineSettings(engine="deepspeed", micro_batch_size=2, deepspeed={"zero_optimization": {"stage": 1}},
                          gradient_clipping=1.0, schedule={"lr": 0.01, "lr_min": 0.001, "warmup_steps": 1, "total_steps": 3})
engine = build_engine(model, build_process_groups(ParallelLayout(world_size=1)), settings)
for step in range(2):
    engine.backward(engine.forward(torch.randn(2, 4)).pow(2).mean())
    engine.step()
    engine.zero_grad()
import deepspeed.runtime.zero.muon.muon_optimizer  # imported by DeepSpeed, compiler deferred
from deepspeed.ops.triton_ops import _triton  # imported by DeepSpeed's engine, Triton hidden on the CPU
assert _triton.is_triton_available() is False
print(type(engine.ds.optimizer.optimizer).__name__, sorted(m for m in ("torch._dynamo", "sympy", "triton") if m in sys.modules))
import triton  # hidden only while DeepSpeed's check was imported
dist.destroy_process_group()
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().splitlines()[-1] == "LeanAdamW []", run.stdout[-2000:]


def test_deferred_compile_compiles_at_first_call():
    """The torch.compile that DeepSpeed's Muon module is imported under: nothing compiled until a call, then
    the function compiled once with its options, with and without the decorator's parentheses."""
    from stormshard.training.engine.deepspeed_engine import _compile_at_first_call

    compiled = []

    def fake_compile(fn, **kwargs):
        compiled.append((fn.__name__, kwargs))
        return lambda *a: ("compiled", fn(*a))

    deferred = _compile_at_first_call(fake_compile)

    @deferred
    def plain(x):
        return x + 1

    @deferred(mode="max-autotune")
    def tuned(x):
        return x * 2

    assert compiled == [] and plain.__name__ == "plain"
    assert plain(1) == ("compiled", 2) and plain(2) == ("compiled", 3) and tuned(3) == ("compiled", 6)
    assert compiled == [("plain", {}), ("tuned", {"mode": "max-autotune"})]
