"""Ensemble training with members spread over ranks equals one process holding all members.

``gpus_per_ensemble > gpus_per_model`` spreads the members of one initial state over the model
groups of an ensemble group (and, with ``gpus_per_model > 1``, each member's grid over a model
group). Member ``g`` draws the same noise at every layout, so a single process with
``ensemble_size_per_device`` = all members is the reference: the loss and every parameter's
gradient after one backward must match it, and so must a short training run's loss curve.
"""

from __future__ import annotations

import pytest
import torch

from stormshard.training.config import load_experiment_config
from stormshard.training.launch import run_training
from stormshard.training.loop import Trainer
from stormshard.training.tasks import EnsembleForecastTask
from tests.distributed import run_distributed
from tests.tiny_run import tiny_config

MEMBERS = 4  # members of one initial state


def _ensemble_config(dataset: str, out, world: int, gpus_per_model: int, **changes) -> dict:
    per_device = MEMBERS * gpus_per_model // world  # one ensemble group over the whole world
    return tiny_config(dataset, out, **{
        "model.name": "ensemble", "model.ensemble": {"noise_channels": 2}, "training.rollout": 2,
        "parallel.gpus_per_model": gpus_per_model, "parallel.gpus_per_ensemble": world,
        "parallel.ensemble_size_per_device": per_device, "training.micro_batch_size": 1, **changes})


def _loss_and_gradients(rank, world, cfg):
    """One forward + backward of the first micro-batch: the loss and every parameter's full gradient."""
    trainer = Trainer(load_experiment_config(cfg))
    assert isinstance(trainer.task, EnsembleForecastTask)
    batch = trainer.read_batch(trainer.train_samples, trainer._next_indices())
    loss = trainer.task.forecast_loss(trainer.engine, batch, step=0, micro=0)
    trainer.engine.backward(loss * trainer.task.loss_scale)
    grads = {name: p.grad.detach().double().clone() for name, p in trainer.engine.module.named_parameters()
             if p.grad is not None}
    return float(loss.detach()), grads


def _losses(rank, world, cfg):
    return run_training(cfg).losses


LAYOUTS = [(2, 1), (4, 2)]  # (world, gpus_per_model), gpus_per_ensemble = world


@pytest.mark.parametrize("world, gpus_per_model", LAYOUTS, ids=[f"world{w}-gpm{g}" for w, g in LAYOUTS])
def test_members_over_ranks_match_single_process_gradients(dataset, tmp_path, world, gpus_per_model):
    reference_cfg = _ensemble_config(dataset, tmp_path / "single", 1, 1, engine="ddp", deepspeed={})
    ref_loss, ref_grads = run_distributed(_loss_and_gradients, 1, reference_cfg)[0]
    out = run_distributed(_loss_and_gradients, world, _ensemble_config(
        dataset, tmp_path / "spread", world, gpus_per_model, engine="ddp", deepspeed={}))
    assert len(ref_grads) > 10
    # fp32 noise is relative to the largest gradient. The fused graph-attention kernel sums through sparse
    # products whose order depends on the layout: the conditional norms' gradients (sums over every node
    # and member, with cancellation) then differ by up to ~6e-5 of the largest one. Exactness is proven in
    # float64 (tests/test_graph_kernels.py, tests/test_models.py); a wrong gradient is off by O(1).
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    for rank, (loss, grads) in enumerate(out):
        assert loss == pytest.approx(ref_loss, rel=1e-6), f"rank {rank}"
        assert grads.keys() == ref_grads.keys()
        for name, ref in ref_grads.items():
            torch.testing.assert_close(grads[name], ref, rtol=1e-5, atol=2e-4 * scale,
                                       msg=lambda m, n=name, r=rank: f"rank {r}, {n}: {m}")
        assert any(float(g.abs().max()) > 0 for g in grads.values())


def test_members_over_ranks_match_single_process_training(dataset, tmp_path):
    reference = run_distributed(_losses, 1, _ensemble_config(dataset, tmp_path / "single", 1, 1))[0]
    assert len(reference) == 3
    for world, gpm in LAYOUTS:
        out = run_distributed(_losses, world, _ensemble_config(dataset, tmp_path / f"w{world}", world, gpm))
        assert all(o == out[0] for o in out), "ranks disagree on the logged loss"
        assert out[0] == pytest.approx(reference, rel=2e-5), f"world {world}, gpus_per_model {gpm}"


def _noise(rank, world, cfg):
    from stormshard.training.tasks import NoiseKey

    task = Trainer(load_experiment_config(cfg)).task
    return task.first_member, task.noise(1, NoiseKey(step=3, micro=0, rollout=1), task.members)


def test_noise_depends_on_the_member_not_the_layout(dataset, tmp_path):
    """Every member of an initial state gets its own noise; member g the same at every layout."""
    first, reference = run_distributed(_noise, 1, _ensemble_config(dataset, tmp_path / "a", 1, 1, engine="ddp", deepspeed={}))[0]
    assert first == 0 and reference.shape[0] == MEMBERS
    for i in range(MEMBERS):
        for j in range(i):
            assert not torch.equal(reference[i], reference[j]), (i, j)
    spread = run_distributed(_noise, 2, _ensemble_config(dataset, tmp_path / "b", 2, 1, engine="ddp", deepspeed={}))
    for first, noise in spread:
        assert torch.equal(noise, reference[first:first + noise.shape[0]])
