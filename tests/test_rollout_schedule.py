"""Rollout schedule (int or {start, increase_every, unit, maximum}), resumable and logged; the
activation-memory warning; validation RMSE per lead time against persistence; date splits."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from stormshard.data.anemoi_layout import AnemoiDataset
from stormshard.training.config import ConfigError, load_experiment_config
from stormshard.training.launch import run_training
from stormshard.training.preflight import activation_estimate, check_activation_memory
from stormshard.training.rollout_schedule import RolloutSchedule, max_rollout, rollout_at
from tests.tiny_run import tiny_config


def test_rollout_at():
    s = RolloutSchedule(start=1, increase_every=2, maximum=3)
    assert [rollout_at(k, s) for k in range(8)] == [1, 1, 2, 2, 3, 3, 3, 3]
    e = RolloutSchedule(start=2, increase_every=1, unit="epochs", maximum=4)
    assert [rollout_at(k, e, steps_per_epoch=3) for k in range(10)] == [2, 2, 2, 3, 3, 3, 4, 4, 4, 4]
    assert rollout_at(5, 3) == 3 and max_rollout(3) == 3 and max_rollout(s) == 3
    with pytest.raises(ValueError, match="maximum=1 is below training.rollout.start=2"):
        RolloutSchedule(start=2, increase_every=1, maximum=1)


def test_bad_rollout_config_names_the_field(dataset, tmp_path):
    for value, fragment in ((0, "training.rollout=0"), ({"start": 1, "maximum": 2}, "increase_every")):
        with pytest.raises(ConfigError, match=fragment):
            load_experiment_config(tiny_config(dataset, tmp_path / "x", **{"training.rollout": value}))


def test_schedule_trains_logs_and_resumes_bit_for_bit(dataset, tmp_path):
    """Steps 0-1 at rollout 1, 2-3 at 2, then 3; the log says which; a run resumed at step 2
    (reader worker processes, prefetch 2) reproduces the uninterrupted curve exactly."""
    changes = {"training.max_steps": 5, "training.rollout": {"start": 1, "increase_every": 2, "maximum": 3},
               "training.checkpoint_interval": 2, "training.keep_checkpoints": 5, "data.num_workers": 2,
               "data.worker_type": "processes"}
    full = run_training(tiny_config(dataset, tmp_path / "full", **changes))
    assert full.rollouts == [1, 1, 2, 2, 3]
    logged = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout"] for r in logged if "loss" in r] == [1, 1, 2, 2, 3]
    assert all(r["data_wait"] >= 0 for r in logged if "loss" in r)
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(tmp_path / "full" / "checkpoints" / "step_00000002", resumed_dir / "checkpoints" / "step_00000002")
    resumed = run_training(tiny_config(dataset, resumed_dir, **{**changes, "data.num_workers": 0}), resume=True)
    assert resumed.losses == full.losses[2:] and resumed.rollouts == [2, 2, 3]


def test_activation_memory_grows_with_rollout_and_warns(dataset, tmp_path):
    cfg = load_experiment_config(tiny_config(dataset, tmp_path / "mem", **{
        "training.rollout": {"start": 1, "increase_every": 10, "maximum": 12}}))
    est = activation_estimate(cfg, 544, 1, 1)
    assert est.rollout == 12 and est.total == 12 * est.per_step + est.transient > 0 and est.transient > 0
    half = activation_estimate(cfg, 544, 2, 1)
    assert half.per_step < est.per_step  # a larger model group holds less per rank
    assert check_activation_memory(cfg, 544, 1, 1, device_bytes=est.total + 1) is None
    warning = check_activation_memory(cfg, 544, 1, 1, device_bytes=est.total // 2)
    assert "rollout reaches 12" in warning and "activation_checkpointing" in warning


def test_validation_rmse_per_lead_time_against_persistence(dataset, tmp_path):
    """Persistence RMSE per lead equals a direct computation from the store; the model's RMSE
    grows with the lead time; metrics.jsonl holds every lead."""
    cfg = tiny_config(dataset, tmp_path / "val", **{"training.validation_rollout": 3, "data.validation_samples": 3,
                                                    "engine": "local", "deepspeed": {}})
    result = run_training(cfg)
    by_lead = result.validation["persistence_by_lead"]
    assert list(by_lead) == ["6h", "12h", "18h"]
    assert result.validation["rmse"] == result.validation["rmse_by_lead"]["6h"]
    ds = AnemoiDataset.open(dataset)
    from stormshard.graphs.builder import load_graph

    area = load_graph(tmp_path / "val" / "graph.pt")["data"].area_weight.double().numpy()
    start = int(np.searchsorted(ds.dates, np.datetime64("2020-01-11T00")))
    i = ds.variables.index("tracer_1")
    for r, lead in enumerate(by_lead):
        sq = [((ds.read([start + k + 1])[0, i, 0] - ds.read([start + k + 1 + r + 1])[0, i, 0]).astype(np.float64) ** 2
               * area).sum() for k in range(3)]
        assert by_lead[lead]["tracer_1"] == pytest.approx(np.sqrt(sum(sq) / (3 * area.sum())), rel=1e-5)
    logged = [json.loads(line) for line in (tmp_path / "val" / "metrics.jsonl").read_text().splitlines()]
    assert any("val_rmse/tracer_1/18h" in r and "val_persistence/tracer_1/18h" in r for r in logged)


@pytest.mark.parametrize("changes, fragment", [
    ({"data.validation": {"start": "2020-01-10T00"}}, "data.train (2020-01-01T00:00:00 to 2020-01-10T18:59:59) and "
                                                      "data.validation (2020-01-10T00:00:00"),
    ({"data.train": {}, "data.validation": {"start": "2020-01-12"}}, "overlap"),
    ({"data.validation": {"start": "2020-01-11", "end": "2020-01-13"}, "data.test": {"start": "2020-01-13T06"}},
     "data.validation (2020-01-11T00:00:00 to 2020-01-13T23:59:59) and data.test"),
])
def test_overlapping_splits_fail_before_anything_is_created(dataset, tmp_path, changes, fragment):
    out = tmp_path / "run"
    with pytest.raises(ConfigError) as err:
        run_training(tiny_config(dataset, out, **changes))
    assert fragment in str(err.value) and "disjoint" in str(err.value)
    assert not out.exists()


def test_explicit_test_range_is_evaluated(dataset, tmp_path):
    cfg = tiny_config(dataset, tmp_path / "t", **{"data.validation": {"start": "2020-01-11", "end": "2020-01-12T18"},
                                                  "data.test": {"start": "2020-01-13"}, "engine": "local",
                                                  "deepspeed": {}, "training.max_steps": 1, "training.warmup_steps": 0})
    result = run_training(cfg)
    assert set(result.test["rmse"]) == set(result.validation["rmse"]) and result.test["rmse"] != result.validation["rmse"]


def test_gnn_activation_memory_counts_its_edges(dataset, tmp_path):
    """A ``gnn`` model's estimate comes from its blocks' edges and widths: anemoi's options (edges embedded to the
    node width, deeper MLPs) hold several times the plain GNN's activations (measured against simulated steps in
    ``tests/test_memory_simulation.py``)."""
    plain = load_experiment_config(tiny_config(dataset, tmp_path / "gnn", **{"model.name": "gnn"}))
    section = {"edge_embedding": True, "mlp_hidden_layers": 2, "aggregate_updated_edges": True}
    anemoi = load_experiment_config(tiny_config(dataset, tmp_path / "gnn", **{
        "model.name": "gnn", "model.processor": section, "model.encoder": section, "model.decoder": section}))
    assert activation_estimate(anemoi, 544, 1, 1).per_step > 3 * activation_estimate(plain, 544, 1, 1).per_step
