"""Checkpoint conversion of bf16 runs is lossless: checkpoints written by real DeepSpeed bf16 runs
(ZeRO 0, 1 and 2, two data-parallel replicas, so the fp32 master and the AdamW moments are
partitioned) consolidate to the engine's fp32 master weights and fp32 moments **exactly** (not the
bf16 module copies), reshard to another layout and resume with that same fp32 master, and export
the fp32 master."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from stormshard.checkpoint.consolidate import consolidate_checkpoint, load_consolidated, save_consolidated
from stormshard.checkpoint.reshard import reshard_checkpoint
from stormshard.data.synthetic import generate_synthetic_dataset
from stormshard.training.config import load_experiment_config
from tests.distributed import run_distributed
from tests.tiny_run import tiny_config

STAGES = (0, 1, 2)

def _fp32_state(trainer) -> dict[str, dict[str, torch.Tensor]]:  # noqa: ANN001
    """The DeepSpeed engine's fp32 master weight and AdamW moments of every parameter of this rank,
    read from the optimizer itself: ZeRO 1/2 partitions gathered over the data-parallel group
    (every rank must call it), or, for bf16 at ZeRO 0, the unpartitioned flat fp32 master."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    opt = trainer.engine.ds.optimizer
    named = list(trainer.engine.module.named_parameters())
    out = {}
    if all(p.dtype == torch.float32 for _, p in named) and not hasattr(opt, "fp32_groups"):
        # bf16 at ZeRO 0: fp32 parameters (the master) under bf16 autocast, torch's AdamW states
        torch_opt = getattr(opt, "optimizer", opt)
        for name, p in named:
            st = torch_opt.state[p]
            out[name] = {"master": p.detach().clone(), "module": p.detach().clone(),
                         "exp_avg": st["exp_avg"].clone(), "exp_avg_sq": st["exp_avg_sq"].clone()}
        return out
    if hasattr(opt, "fp32_groups") and not hasattr(opt, "bit16_groups"):  # bf16 at ZeRO 0, torch Adam (CPU)
        masters = [t for g in opt.fp32_groups for t in g]
        for (name, p), m in zip(named, masters, strict=True):
            st = opt.optimizer.state[m]
            out[name] = {"master": m.detach().clone(), "module": p.detach().clone(),
                         "exp_avg": st["exp_avg"].clone(), "exp_avg_sq": st["exp_avg_sq"].clone()}
        return out
    if hasattr(opt, "fp32_groups_flat"):  # bf16 at ZeRO 0, fused Adam (GPUs): one flat fp32 master
        flat = opt.fp32_groups_flat[0]
        moments = opt.optimizer.state[flat]
        offset = 0
        for name, p in named:
            n = p.numel()
            out[name] = {"master": flat[offset: offset + n].view_as(p).clone(), "module": p.detach().clone(),
                         **{k: moments[k][offset: offset + n].view_as(p).clone() for k in ("exp_avg", "exp_avg_sq")}}
            offset += n
        return out
    if hasattr(opt, "_lazy_init_hp_params_optimizer_state"):  # ZeRO links the moments at the first step
        opt._lazy_init_hp_params_optimizer_state()
    for name, p in named:
        out[name] = {"master": safe_get_full_fp32_param(p).clone(), "module": p.detach().clone(),
                     "exp_avg": safe_get_full_optimizer_state(p, "exp_avg").clone(),
                     "exp_avg_sq": safe_get_full_optimizer_state(p, "exp_avg_sq").clone()}
    return out

def _train_and_read(rank, world, cfg, resume=False):  # noqa: ANN001
    """Train (or only resume, with ``max_steps`` equal to the checkpoint's step) and return the
    engine's fp32 state and loss curve."""
    from stormshard.training.loop import Trainer

    trainer = Trainer(load_experiment_config(cfg), resume=resume)
    if resume:
        trainer._maybe_resume()
        return _fp32_state(trainer), []
    result = trainer.fit()
    return _fp32_state(trainer), result.losses

@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """3 steps of DeepSpeed bf16 at ZeRO 0, 1, 2 on 2 data-parallel replicas: checkpoints + engine state."""
    root = tmp_path_factory.mktemp("bf16_conversion")
    dataset = root / "synthetic.zarr"
    generate_synthetic_dataset(dataset, grid="o8", steps=64, seed=1)
    out = {"root": root, "dataset": str(dataset)}
    for stage in STAGES:
        cfg = tiny_config(str(dataset), root / f"zero{stage}", **{
            "training.precision": "bf16", "training.micro_batch_size": 1, "data.validation_samples": 2,
            "deepspeed.zero_optimization": {"stage": stage}})
        state, losses = run_distributed(_train_and_read, 2, cfg)[0]
        out[stage] = (root / f"zero{stage}" / "checkpoints" / "step_00000003", cfg, state, losses)
    return out

@pytest.mark.parametrize("stage", STAGES)
def test_consolidate_keeps_the_fp32_master_and_moments(runs, stage, tmp_path):
    step_dir, _, engine, _ = runs[stage]
    ckpt = consolidate_checkpoint(step_dir)
    assert ckpt.optimizer is not None, ckpt.optimizer_note
    rounded = 0
    for name, ref in engine.items():
        w = ckpt.model[name]
        assert w.dtype == torch.float32 and torch.equal(w, ref["master"]), name
        if stage == 0:  # fp32 parameters under bf16 autocast: the module holds the master itself
            assert ref["module"].dtype == torch.float32 and torch.equal(w, ref["module"])
        else:  # DeepSpeed's bf16 mode: a bf16 module copy of the fp32 master
            assert ref["module"].dtype == torch.bfloat16 and torch.equal(w.bfloat16(), ref["module"])
        rounded += int(not torch.equal(w, ref["module"].float()))
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(ckpt.optimizer["state"][name][key], ref[key]), (name, key)
    if stage > 0:
        assert rounded > 0, "the fp32 master should carry more precision than the bf16 module copy"
    # saving and loading the consolidated form keeps it exactly
    saved = load_consolidated(save_consolidated(ckpt, tmp_path / "full"))
    assert all(torch.equal(saved.model[n], ckpt.model[n]) for n in engine)

@pytest.mark.parametrize("stage", [0, 2])
def test_reshard_resumes_with_the_same_fp32_master(runs, stage, tmp_path):
    """2 replicas x gpus_per_model 1 -> 2 replicas x gpus_per_model 2 (world 4, tensor slices for
    nothing but the layout): every target rank's engine, after loading the resharded checkpoint,
    holds the consolidated fp32 master and moments of its model slice exactly."""
    step_dir, cfg, engine, _ = runs[stage]
    target = reshard_checkpoint(step_dir, tmp_path / "k2" / "checkpoints", 2)
    resume_cfg = json.loads((target.parent / "resume_config.json").read_text())
    resumed = run_distributed(_train_and_read, 4, resume_cfg, True)
    ckpt = consolidate_checkpoint(step_dir)

    for rank_state in resumed:
        state, _ = rank_state
        for name, got in state.items():
            assert torch.equal(got["master"], ckpt.model[name]), name
            assert torch.equal(got["exp_avg_sq"], ckpt.optimizer["state"][name]["exp_avg_sq"]), name

def test_reshard_same_layout_resumes_bit_for_bit(runs, tmp_path):
    """Consolidate + reshard to the source's own layout, then resume: the loss curve of the
    uninterrupted run, bit for bit (nothing of the fp32 state is lost on the way)."""
    dataset = runs["dataset"]
    changes = {"training.precision": "bf16", "training.micro_batch_size": 1, "data.validation_samples": 2,
               "deepspeed.zero_optimization": {"stage": 1}, "training.max_steps": 4,
               "training.checkpoint_interval": 2}
    full_cfg = tiny_config(dataset, tmp_path / "full", **changes)
    _, full = run_distributed(_train_and_read, 2, full_cfg)[0]
    target = reshard_checkpoint(tmp_path / "full" / "checkpoints" / "step_00000002",
                                tmp_path / "resharded" / "checkpoints", 1)
    resume_cfg = json.loads((target.parent / "resume_config.json").read_text())
    from tests.tiny_run import train_losses

    resumed = run_distributed(train_losses, 2, resume_cfg, True)[0]
    assert resumed == full[2:]

def test_export_holds_the_fp32_master(runs, tmp_path):
    from safetensors.torch import load_file

    from stormshard.checkpoint.export import export_bundle, load_model

    step_dir, _, engine, _ = runs[1]
    bundle = export_bundle(step_dir, tmp_path / "bundle")
    weights = {}
    for f in Path(bundle).glob("*.safetensors"):
        weights.update(load_file(str(f)))
    for name, ref in engine.items():
        assert weights[name].dtype == torch.float32 and torch.equal(weights[name], ref["master"]), name
    model = load_model(bundle).model
    assert all(torch.equal(p, engine[n]["master"]) for n, p in model.named_parameters())
