"""bf16 end to end: one precision setting for every engine, fp32 data / targets / loss around a bf16
model, bf16 vs fp32 loss curves, layout independence, bit-exact resume, DeepSpeed's
communication_data_type, and the layers in bf16 against a float64 reference.

Tolerances (bf16 has an 8-bit significand: one rounding is at most 2^-9 = 0.2% relative):

- layers: bf16 inputs and weights, compared with the float64 layer on the same (bf16-representable)
  values, relative max-norm error (``|out - ref|_max / |ref|_max``) below 3e-2: a handful of
  bf16 roundings of activations (each <= 0.2%) through 2-3 matmuls, layer norms and a softmax, plus
  the rounding of the output;
- training: the same config in bf16 and fp32 (same seed, data and initial weights); the loss curves'
  mean relative difference over 20 steps is below 2e-2 (measured 6.5e-4 with DeepSpeed bf16 ZeRO 1,
  3.0e-4 with local autocast; max 3e-3), each step below 5e-2: bf16 perturbs every step's update by ~0.2-1% of its size and the curves drift apart
  slowly, while a broken bf16 path (targets or loss in bf16, fp32 master weights lost, a wrong
  cast) moves them by more than 10% or stops the loss from falling;
- layouts: the bf16 loss curve at (world 2, gpus_per_model 2) and (world 4, gpus_per_model 2)
  against world 1 within 2e-2 relative per step: the model's compute in bf16 is not associative
  (reductions split over ranks round differently), so layouts agree to bf16 accuracy, not bit for
  bit as in fp32 (tests/test_training.py); measured 1.4e-4 and 2.0e-4;
- resume: bit for bit (``==``), as in fp32.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from torch import nn

from stormshard.training.config import ConfigError, load_experiment_config, merge_deepspeed_file
from stormshard.training.engine import EngineSettings, resolve_deepspeed_config
from stormshard.training.engine.precision import cast_floating
from stormshard.training.launch import run_training
from tests.distributed import run_distributed
from tests.tiny_run import tiny_config

BF16 = {"training.precision": "bf16"}


def _train(rank, world, cfg, resume=False):  # noqa: ANN001
    return run_training(cfg, resume=resume).losses


def _rel(a: list[float], b: list[float]) -> list[float]:
    return [abs(x - y) / abs(y) for x, y in zip(a, b, strict=True)]


# ------------------------------------------------------------------------------ the precision setting


def test_precision_is_one_setting():
    base = {"training": {"max_steps": 5, "warmup_steps": 1}}
    cfg = load_experiment_config({**base, "training": {**base["training"], "precision": "bf16"}})
    settings = cfg.engine_settings(5)
    assert settings.precision == "bf16" and settings.bf16
    # DeepSpeed's bf16 section is generated from it: DeepSpeed's bf16 mode at ZeRO 1/2; at ZeRO 0 (no fp32
    # master weights in DeepSpeed's bf16 mode there) fp32 parameters and the engine's bf16 autocast
    assert resolve_deepspeed_config(settings, 1)["bf16"] == {"enabled": False}
    stage1 = EngineSettings(precision="bf16", deepspeed={"zero_optimization": {"stage": 1}})
    assert resolve_deepspeed_config(stage1, 1)["bf16"] == {"enabled": True}
    assert "bf16" not in resolve_deepspeed_config(EngineSettings(), 1)
    # a deepspeed.bf16 (a deprecated spelling) that disagrees with training.precision names both places
    with pytest.raises(ConfigError, match=r"deepspeed.bf16.enabled=True but training.precision='fp32'"):
        load_experiment_config({**base, "training": {**base["training"], "precision": "fp32"},
                                "deepspeed": {"bf16": {"enabled": True}}})
    agree = {**base, "training": {**base["training"], "precision": "bf16"}, "deepspeed": {"bf16": {"enabled": True}}}
    assert load_experiment_config(agree).training.precision == "bf16"
    # a DeepSpeed JSON file's bf16 moves to training.precision (and a conflicting value is an error)
    assert load_experiment_config(base, deepspeed_config={"bf16": {"enabled": True}}).training.precision == "bf16"
    with pytest.raises(ConfigError, match="training.precision"):
        merge_deepspeed_file({"training": {"precision": "fp32"}}, {"bf16": {"enabled": True}})
    # EngineSettings take the precision only from their precision field: a bf16.enabled is an error
    with pytest.raises(ValueError, match="deepspeed.bf16.enabled=True is set next to precision='fp32'"):
        EngineSettings(deepspeed={"bf16": {"enabled": True}})
    with pytest.raises(ValueError, match="deepspeed.bf16.enabled=False is set next to precision='bf16'"):
        EngineSettings(precision="bf16", deepspeed={"bf16": {"enabled": False}})


@pytest.mark.parametrize("kwargs, match", [
    ({"deepspeed": {"communication_data_type": "fp16"}}, r"communication_data_type='fp16' is not supported"),
    ({"engine": "ddp", "deepspeed": {"communication_data_type": "bf16"}}, "read by engine 'deepspeed' only"),
    ({"precision": "bf16", "compression": {}}, "compression with precision='bf16'"),
    ({"deepspeed": {"bf16": True}}, "deepspeed.bf16 must be an object"),
    ({"precision": "fp16"}, "precision"),
])
def test_bad_precision_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineSettings(**kwargs)


def test_cast_floating_keeps_structure_and_integers():
    x, i = torch.ones(2), torch.arange(3)
    out = cast_floating({"a": (x, i), "b": [x], "c": 3}, torch.bfloat16)
    assert out["a"][0].dtype == torch.bfloat16 and out["a"][1] is i and out["b"][0].dtype == torch.bfloat16
    assert out["c"] == 3


def test_local_engine_autocast_keeps_fp32_master_weights_and_outputs():
    """The local engine in bf16: the linear computes in bf16 (its output is bf16-rounded), the output
    comes back fp32, parameters, gradients and the AdamW moments stay fp32."""
    from stormshard.parallel.topology import ParallelLayout, build_process_groups
    from stormshard.training.engine import build_engine

    groups = build_process_groups(ParallelLayout(world_size=1, gpus_per_model=1))
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    x = torch.randn(3, 8)
    engine = build_engine(model, groups, EngineSettings(engine="local", precision="bf16"))
    out = engine(x)
    assert out.dtype == torch.float32
    ref = nn.functional.linear(x.bfloat16(), model.weight.bfloat16(), model.bias.bfloat16()).float()
    assert torch.equal(out, ref)
    engine.backward(out.square().mean())
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())
    engine.step()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(v.dtype == torch.float32 for s in engine.optimizer.state.values() for k, v in s.items()
               if k != "step")


def _read_path_dtypes(rank, world, cfg):  # noqa: ANN001
    from stormshard.training.loop import Trainer
    from stormshard.training.tasks import NoiseKey

    trainer = Trainer(load_experiment_config(cfg))
    batch = trainer.read_batch(trainer.train_samples, [0, 1])
    pred = trainer.task.predict(trainer.engine, batch, NoiseKey(step=0, micro=0))
    loss = trainer.task.forecast_loss(trainer.engine, batch)
    params = {p.dtype for p in trainer.engine.module.parameters()}
    return batch.dtype, pred.dtype, loss.dtype, params


def test_read_path_and_predictions_stay_fp32(dataset, tmp_path):
    """In a bf16 run the normalised batch (inputs and targets), the prediction handed to the loss and
    the loss are fp32; only the model computes in bf16."""
    # DeepSpeed's bf16 mode (bf16 parameters) at ZeRO 1; fp32 parameters under autocast at ZeRO 0 and locally
    for engine, stage, param_dtype in (("deepspeed", 1, torch.bfloat16), ("deepspeed", 0, torch.float32),
                                       ("local", None, torch.float32)):
        extra = {"deepspeed": {"zero_optimization": {"stage": stage}} if stage is not None else {}}
        cfg = tiny_config(dataset, tmp_path / f"{engine}{stage}", engine=engine, **BF16, **extra)
        batch, pred, loss, params = run_distributed(_read_path_dtypes, 1, cfg)[0]
        assert (batch, pred, loss) == (torch.float32,) * 3
        assert params == {param_dtype}, (engine, stage)


# ------------------------------------------------------------------------------ training curves


@pytest.mark.parametrize("engine, stage", [("deepspeed", 1), ("deepspeed", 0), ("local", None)])
def test_bf16_loss_curve_follows_fp32(dataset, tmp_path, engine, stage):
    """20 steps of the same config in fp32 and bf16 (DeepSpeed's bf16 mode at ZeRO 1, autocast over fp32
    parameters at ZeRO 0 and locally)."""
    extra = {"deepspeed.zero_optimization": {"stage": stage}} if engine == "deepspeed" else {"deepspeed": {}}
    changes = {"engine": engine, "training.max_steps": 20, "training.lr": 3e-3, **extra}
    fp32 = _train(0, 1, tiny_config(dataset, tmp_path / "fp32", **changes))
    bf16 = _train(0, 1, tiny_config(dataset, tmp_path / "bf16", **changes, **BF16))
    rel = _rel(bf16, fp32)
    print(f"{engine}: bf16 vs fp32 mean relative difference {sum(rel) / len(rel):.2e}, max {max(rel):.2e}")
    assert sum(rel) / len(rel) < 2e-2 and max(rel) < 5e-2, (bf16, fp32)
    # bf16 really ran: its rounding moves the very first loss by far more than fp32 summation order
    # would (DeepSpeed's forward once silently switched an outer autocast off: 6e-9 on an H100)
    assert rel[0] > 1e-6, (bf16[0], fp32[0])
    assert bf16[-1] < 0.8 * bf16[0]  # and it learns


LAYOUTS = [(2, 2, 2), (4, 2, 1)]  # (world, gpus_per_model, micro batch): effective batch 2 as at world 1


def test_bf16_loss_is_layout_independent(dataset, tmp_path):
    """DeepSpeed bf16 ZeRO 1 at world 1 vs (2, gpus_per_model 2) and (4, gpus_per_model 2)."""
    changes = {"training.max_steps": 3, "deepspeed.zero_optimization": {"stage": 1}, **BF16}
    reference = _train(0, 1, tiny_config(dataset, tmp_path / "w1", **changes))
    for world, gpm, micro in LAYOUTS:
        cfg = tiny_config(dataset, tmp_path / f"w{world}", **changes, **{
            "parallel.gpus_per_model": gpm, "training.micro_batch_size": micro})
        out = run_distributed(_train, world, cfg)
        assert all(o == out[0] for o in out), "ranks disagree on the logged loss"
        rel = _rel(out[0], reference)
        print(f"world {world} gpus_per_model {gpm}: max relative difference to world 1 {max(rel):.2e}")
        assert max(rel) < 2e-2, (world, out[0], reference)


@pytest.mark.parametrize("engine, stage", [("deepspeed", 2), ("local", None)])
def test_bf16_resume_is_bit_exact(dataset, tmp_path, engine, stage):
    """A bf16 run interrupted after step 2 and resumed from its step-2 checkpoint gives the
    uninterrupted curve bit for bit (fp32 master weights, moments and RNG restored)."""
    extra = {"deepspeed.zero_optimization": {"stage": stage}} if stage is not None else {"deepspeed": {}}
    changes = {"engine": engine, "training.max_steps": 4, "training.checkpoint_interval": 2,
               "parallel.gpus_per_model": 2, **BF16, **extra}
    full = run_distributed(_train, 2, tiny_config(dataset, tmp_path / "full", **changes))[0]
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(tmp_path / "full" / "checkpoints" / "step_00000002",
                    resumed_dir / "checkpoints" / "step_00000002")
    (resumed_dir / "checkpoints" / "latest").write_text("step_00000002\n")
    resumed = run_distributed(_train, 2, tiny_config(dataset, resumed_dir, **changes), True)[0]
    assert resumed == full[2:]


# ------------------------------------------------------------------------------ communication_data_type


def _reduction_dtypes(rank, world, cfg):  # noqa: ANN001
    """Train ``cfg`` and record the dtypes of the gradient reductions DeepSpeed issues (tensors
    with at least 64 elements through all_reduce / reduce_scatter / reduce)."""
    import torch.distributed as dist

    seen: set[str] = set()
    originals = {}

    def spy(name):  # noqa: ANN001, ANN202
        fn = originals[name] = getattr(dist, name)

        def wrapped(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
            tensors += [t for a in args if isinstance(a, list) for t in a if isinstance(t, torch.Tensor)]
            seen.update(str(t.dtype) for t in tensors if t.is_floating_point() and t.numel() >= 64)
            return fn(*args, **kwargs)
        return wrapped

    names = ("all_reduce", "reduce_scatter", "reduce_scatter_tensor", "reduce")
    for name in names:
        setattr(dist, name, spy(name))
    try:
        losses = run_training(cfg).losses
    finally:
        for name in names:
            setattr(dist, name, originals[name])
    return losses, sorted(seen)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_communication_data_type(dataset, tmp_path, stage):
    """bf16 on 2 data-parallel replicas: gradients are reduced in bf16 by default and in fp32 with
    ``communication_data_type: "fp32"``; both train to the same curve within bf16 tolerance."""
    curves = {}
    for comm in ("bf16", "fp32"):
        cfg = tiny_config(dataset, tmp_path / comm, **BF16, **{
            "training.max_steps": 3, "training.micro_batch_size": 1,
            "deepspeed": {"zero_optimization": {"stage": stage}, "communication_data_type": comm}})
        out = run_distributed(_reduction_dtypes, 2, cfg)
        losses, dtypes = out[0]
        want = "torch.bfloat16" if comm == "bf16" else "torch.float32"
        assert want in dtypes, (comm, dtypes)
        if comm == "fp32":
            assert "torch.bfloat16" not in dtypes, dtypes
        curves[comm] = losses
    assert max(_rel(curves["bf16"], curves["fp32"])) < 2e-2, curves


# ------------------------------------------------------------------------------ layers in bf16 vs float64

LAYER_TOL = 3e-2  # relative max-norm error of bf16 compute against float64 on the same bf16 values


def _rel_max(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).abs().max() / ref.abs().max())


def _layers():
    """(name, module, inputs) on one process, small shapes."""
    from stormshard.layers.attention import SlidingWindowAttention
    from stormshard.layers.gnn import GNNMapperBlock, GNNProcessorBlock
    from stormshard.layers.graph_transformer import (
        GraphTransformerMapperBlock,
        GraphTransformerProcessorBlock,
    )
    from stormshard.layers.transformer import TransformerBlock
    from stormshard.parallel.graph import GraphShardPlan

    g = torch.Generator().manual_seed(0)
    n_src, n_dst, e = 30, 20, 90
    bip = torch.stack([torch.randint(0, n_src, (e,), generator=g), torch.randint(0, n_dst, (e,), generator=g)])
    one = torch.stack([torch.randint(0, n_dst, (e,), generator=g), torch.randint(0, n_dst, (e,), generator=g)])
    plan_bip, plan_one = GraphShardPlan.build(bip, (n_src, n_dst)), GraphShardPlan.build(one, n_dst)
    attr_bip = plan_bip.shard_edges(torch.randn(e, 3, generator=g))
    attr_one = plan_one.shard_edges(torch.randn(e, 3, generator=g))
    x_src, x_dst = torch.randn(n_src, 2, 16, generator=g), torch.randn(n_dst, 2, 16, generator=g)
    torch.manual_seed(1)
    return [
        ("window attention", SlidingWindowAttention(16, 4, 5), (torch.randn(2, 40, 16, generator=g),)),
        ("transformer block", TransformerBlock(16, 4, 5, mlp_ratio=2), (torch.randn(2, 40, 16, generator=g),)),
        ("graph-transformer mapper", GraphTransformerMapperBlock(16, 16, 3, 4, plan_bip), (x_src, x_dst, attr_bip)),
        ("graph-transformer processor", GraphTransformerProcessorBlock(16, 3, 4, plan_one), (x_dst, attr_one)),
        ("gnn mapper", GNNMapperBlock(16, 16, 3, plan_bip), (x_src, x_dst, attr_bip)),
        ("gnn processor", GNNProcessorBlock(16, 3, plan_one), (x_dst, attr_one)),
        # anemoi's qk_norm and gated MLPs (mlp_implementation), drawn last
        ("transformer block, qk_norm + swiglu", TransformerBlock(16, 4, 5, mlp_ratio=2.5, qk_norm=True,
                                                                  mlp_kind="swiglu"),
         (torch.randn(2, 40, 16, generator=g),)),
        ("graph-transformer mapper, qk_norm + geglu", GraphTransformerMapperBlock(16, 16, 3, 4, plan_bip, qk_norm=True,
                                                                                  mlp_kind="geglu"),
         (x_src, x_dst, attr_bip)),
    ]


def _first(out):  # noqa: ANN001, ANN202
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("mode", ["bf16 weights", "autocast"])
def test_layers_in_bf16_match_float64(mode):
    """Each layer with bf16-representable weights and inputs: computed in bf16 (bf16 parameters as in
    DeepSpeed bf16, fp32 edge attributes as DeepSpeed leaves buffers; or torch.autocast over fp32
    parameters) against float64 on the same values: outputs and input gradients."""
    import copy

    for name, module, inputs in _layers():
        module = module.to(torch.bfloat16).float()  # bf16-representable weights
        inputs = tuple(t.bfloat16().float() for t in inputs)
        ref_module = copy.deepcopy(module).double()
        ref_in = [t.double().requires_grad_() for t in inputs]
        ref = _first(ref_module(*ref_in))
        ref.square().sum().backward()
        if mode == "bf16 weights":
            test_module = copy.deepcopy(module).to(torch.bfloat16)
            test_in = [t.bfloat16().requires_grad_() if i < len(inputs) - 1 or t.shape[-1] != 3 else t.clone()
                       for i, t in enumerate(inputs)]  # edge attributes stay fp32, as DeepSpeed leaves buffers
            out = _first(test_module(*test_in))
        else:
            test_module = copy.deepcopy(module)
            test_in = [t.clone().requires_grad_() for t in inputs]
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = _first(test_module(*test_in))
        assert out.dtype in (torch.bfloat16, torch.float32)
        out.float().square().sum().backward()
        err = _rel_max(out, ref)
        assert err < LAYER_TOL, f"{name} ({mode}): output error {err:.2e}"
        grad_err = _rel_max(test_in[0].grad, ref_in[0].grad)
        assert grad_err < 2 * LAYER_TOL, f"{name} ({mode}): input-gradient error {grad_err:.2e}"


def test_kernels_accumulate_softmax_in_fp32():
    """The window kernel and graph attention in bf16 (also under autocast) against float64: their
    softmax statistics are fp32, so the error is that of rounding inputs and the output to bf16
    (at most ~2^-8 relative), not of a bf16 softmax."""
    from stormshard.kernels.dispatch import sliding_window_attention
    from stormshard.kernels.reference import dense_window_attention, graph_attention

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 64, 16, generator=g).bfloat16() for _ in range(3))
    ref = dense_window_attention(q.double(), k.double(), v.double(), 9, q_offset=5, k_offset=0)
    for autocast_on in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast_on):
            out = sliding_window_attention(q, k, v, 9, q_offset=5, k_offset=0)
        assert out.dtype == torch.bfloat16 and _rel_max(out, ref) < 8e-3
    n_src, n_dst, e = 40, 10, 400  # 40 edges per destination: a bf16 sum would lose ~1e-2
    index = torch.stack([torch.randint(0, n_src, (e,), generator=g), torch.arange(e) % n_dst])
    qd = torch.randn(n_dst, 2, 8, generator=g).bfloat16()
    kd, vd = (torch.randn(n_src, 2, 8, generator=g).bfloat16() for _ in range(2))
    emb = torch.randn(e, 2, 8, generator=g).bfloat16()
    ref = graph_attention(qd.double(), kd.double(), vd.double(), emb.double(), index, n_dst)
    out = graph_attention(qd, kd, vd, emb, index, n_dst)
    assert out.dtype == torch.bfloat16 and _rel_max(out, ref) < 8e-3
