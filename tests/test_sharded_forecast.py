"""Model-sharded forecasts equal the single-process forecast: 2 and 4 ranks, uneven grid slices
(541 cells), several initial dates over data-parallel replicas, ensemble members over ranks,
from an exported bundle and directly from a tensor-parallel training checkpoint; the zarr store
is written in chunk regions by every rank (ChunkExchange)."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
import torch.distributed as dist

from stormshard.checkpoint.export import export_bundle
from stormshard.data.anemoi_layout import AnemoiDataset, write_anemoi_dataset
from stormshard.data.synthetic import generate_synthetic_dataset
from stormshard.inference.forecast import run_forecast
from stormshard.inference.outputs import ChunkExchange
from stormshard.inference.runner import replica_tasks
from stormshard.training.launch import run_training
from tests.distributed import run_distributed
from tests.tiny_run import BASE, train_losses

DATES = ["2020-01-12T00", "2020-01-12T06", "2020-01-13T00"]


def _config(dataset: str, out, **model) -> dict:
    cfg = copy.deepcopy(BASE)
    cfg["data"]["path"] = dataset
    cfg["training"].update(output_dir=str(out), max_steps=2)
    cfg["engine"] = "local"
    cfg.pop("deepspeed", None)
    cfg["model"].update(model)
    return cfg


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded_forecast")
    full = root / "o8.zarr"
    generate_synthetic_dataset(full, grid="o8", steps=64, seed=3)
    ds = AnemoiDataset.open(full)
    keep = 541  # uneven over 2, 3 and 4 ranks
    dataset = root / "cut.zarr"
    write_anemoi_dataset(dataset, ds.read(slice(None))[..., :keep], ds.dates, ds.latitudes[:keep],
                         ds.longitudes[:keep], ds.variables, frequency="6h",
                         attributes={"variables_metadata": {"tracer_1": {"units": "K"}}})
    # a tensor-parallel checkpoint (2 ranks), and its bundle
    cfg = _config(str(dataset), root / "tp", processor={**BASE["model"]["processor"], "shard_strategy": "tensor"})
    cfg["parallel"] = {"gpus_per_model": 2, "shard_strategy": "tensor"}
    run_distributed(train_losses, 2, cfg)
    bundle = export_bundle(root / "tp" / "checkpoints", root / "bundle")
    # an ensemble model (one process) and its bundle
    ens = _config(str(dataset), root / "ens", name="ensemble", ensemble={"noise_channels": 2})
    ens["parallel"]["ensemble_size_per_device"] = 2
    run_training(ens)
    ens_bundle = export_bundle(root / "ens" / "checkpoints", root / "ens_bundle")
    reference = run_forecast(bundle, dataset, DATES, 3, root / "ref", precision="fp64", verbose=False)
    ens_reference = run_forecast(ens_bundle, dataset, DATES[:2], 2, root / "ens_ref", members=3, seed=7,
                                 precision="fp64", verbose=False)
    return {"root": root, "dataset": str(dataset), "bundle": bundle, "checkpoint": root / "tp" / "checkpoints",
            "ens_bundle": ens_bundle, "reference": reference, "ens_reference": ens_reference}


def _forecast(rank: int, world: int, source: str, dataset: str, dates: list[str], steps: int, out: str,
              kwargs: dict) -> dict:
    kwargs = {"precision": "fp64", **kwargs}
    result = run_forecast(source, dataset, dates, steps, out, verbose=False, **kwargs)
    return {"stores": [str(s) for s in result.stores], "scores": result.scores, "per_date": result.per_date}


def _assert_same_stores(ref, stores: list[str], tolerance: float = 1e-6) -> None:
    assert len(stores) == len(ref.stores)
    for i, path in enumerate(stores):
        got = AnemoiDataset.open(path)
        want = AnemoiDataset.open(ref.stores[i])
        a, b = np.asarray(got.data[:]), np.asarray(want.data[:])
        assert not np.isnan(a).any()  # every region was written
        np.testing.assert_allclose(a, b, rtol=tolerance, atol=tolerance)
        np.testing.assert_array_equal(got.dates, want.dates)
        stats_rtol = 1e-9 if tolerance <= 1e-6 else tolerance  # fp64 reference vs fp64: tight
        np.testing.assert_allclose(got.statistics.mean, want.statistics.mean, rtol=stats_rtol)
        np.testing.assert_allclose(got.statistics.maximum, want.statistics.maximum, rtol=stats_rtol)


def _assert_same_scores(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        for key in a[name]:
            np.testing.assert_allclose(a[name][key], b[name][key], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("world,k", [(2, 2), (4, 4), (4, 2)])
def test_sharded_forecast_equals_one_process(setup, tmp_path, world, k):
    out = str(tmp_path / "fc")
    results = run_distributed(_forecast, world, str(setup["bundle"]), setup["dataset"], DATES, 3, out,
                              {"gpus_per_model": k, "cells_per_chunk": 64})
    _assert_same_stores(setup["reference"], results[0]["stores"])
    _assert_same_scores(results[0]["scores"], setup["reference"].scores)
    assert json.loads((tmp_path / "fc" / "scores.json").read_text())["gpus_per_model"] == k


def test_forecast_from_tensor_parallel_checkpoint_at_another_k(setup, tmp_path):
    """Trained at gpus_per_model 2 with tensor-parallel slices; forecast at K = 4 and K = 1."""
    out = str(tmp_path / "fc")
    results = run_distributed(_forecast, 4, str(setup["checkpoint"]), setup["dataset"], DATES, 3, out,
                              {"gpus_per_model": 4})
    _assert_same_stores(setup["reference"], results[0]["stores"])
    single = run_forecast(setup["checkpoint"], setup["dataset"], DATES, 3, tmp_path / "one", precision="fp64",
                          verbose=False)
    _assert_same_stores(setup["reference"], [str(s) for s in single.stores])


def test_sharded_ensemble_members_over_ranks(setup, tmp_path):
    ref = setup["ens_reference"]
    out = str(tmp_path / "fc")
    results = run_distributed(_forecast, 4, str(setup["ens_bundle"]), setup["dataset"], DATES[:2], 2, out,
                              {"gpus_per_model": 2, "members": 3, "seed": 7})
    _assert_same_stores(ref, results[0]["stores"])
    members = ref.read(0)
    assert members.shape == (3, 2, 541, 4)
    assert not np.allclose(members[0], members[1])
    scores = results[0]["scores"]["tracer_1"]
    assert {"crps", "spread", "spread_skill"} <= scores.keys() and all(c > 0 for c in scores["crps"])


def test_replica_tasks_cover_every_date_and_member_once():
    for dates, members, replicas in [(3, 1, 2), (1, 5, 2), (2, 3, 4), (5, 2, 3)]:
        seen = [(d, m) for r in range(replicas) for d, ms in replica_tasks(dates, members, replicas, r) for m in ms]
        assert sorted(seen) == [(d, m) for d in range(dates) for m in range(members)]
    assert replica_tasks(3, 1, 2, 0) == [(0, [0]), (2, [0])]  # dates spread first


def test_chunk_exchange_plan():
    plan = ChunkExchange((136, 135, 135, 135), 100)
    owned = []
    for r in range(4):
        counts = plan.counts
        owned.append(sum(row[r] for row in counts))
    assert sum(owned) == 541 and sum(map(sum, plan.counts)) == 541
    # slices start at 0, 136, 271, 406; chunks start at 0, 100, ..., 500 -> owners 0, 0, 1, 2, 2, 3
    assert owned == [200, 100, 200, 41]
    assert ChunkExchange((5,), 3).owned == slice(0, 5)


def _exchange(rank: int, world: int, sizes: tuple[int, ...], chunk: int) -> tuple[list[float], slice]:
    plan = ChunkExchange(sizes, chunk, dist.group.WORLD)
    start = sum(sizes[:rank])
    x = torch.arange(start, start + sizes[rank], dtype=torch.float64)[:, None].repeat(1, 3)
    y = plan.exchange(x)
    return y[:, 0].tolist(), plan.owned


@pytest.mark.parametrize("world,sizes,chunk", [(2, (271, 270), 50), (4, (3, 3, 2, 2), 4), (4, (3, 3, 2, 2), 1)])
def test_chunk_exchange_moves_cells_to_chunk_owners(world, sizes, chunk):
    results = run_distributed(_exchange, world, sizes, chunk)
    cells = []
    for values, owned in results:
        assert values == list(range(owned.start, owned.stop))
        assert owned.start % chunk == 0 and (owned.stop % chunk == 0 or owned.stop == sum(sizes))
        cells += values
    assert cells == list(range(sum(sizes)))


def test_bad_layouts_fail_before_anything_is_written(setup, tmp_path):
    out = tmp_path / "bad"
    with pytest.raises(ValueError, match="gpus_per_model=2 does not divide the 1 launched"):
        run_forecast(setup["bundle"], setup["dataset"], DATES[0], 2, out, gpus_per_model=2)
    with pytest.raises(ValueError, match="use at most 208"):
        run_forecast(setup["bundle"], setup["dataset"], DATES[0], 2, out, gpus_per_model=600)
    assert not out.exists()


def _forecast_error(rank: int, world: int, source: str, dataset: str, out: str, k: int) -> str:
    try:
        run_forecast(source, dataset, DATES[0], 2, out, gpus_per_model=k, verbose=False)
    except ValueError as exc:
        return str(exc)
    return ""


def test_a_strategy_that_cannot_split_the_model_fails_before_anything_is_written(setup, tmp_path):
    """The tensor-parallel model (4 heads) over 3 ranks: every rank stops with the strategy's error before a
    process group or a file is made."""
    out = tmp_path / "bad3"
    errors = run_distributed(_forecast_error, 3, str(setup["bundle"]), setup["dataset"], str(out), 3)
    assert all(e.startswith("--gpus-per-model 3: model.processor.num_heads=4 is not divisible") for e in errors), errors
    assert not out.exists()


@pytest.mark.parametrize("world,k", [(1, 1), (2, 2)])
def test_forecast_with_the_flex_kernel_equals_the_banded_one(setup, tmp_path, world, k):
    """``--attention-kernel flex`` (the forward of torch's flex attention, which runs on a CPU in fp32) over
    the tensor-parallel model at one process and over 2 ranks gives the banded
    fp32 forecast of one process, within fp32 round-off."""
    banded = run_forecast(setup["bundle"], setup["dataset"], DATES, 3, tmp_path / "banded", precision="fp32",
                          attention_kernel="banded", verbose=False)
    out = str(tmp_path / "fc")
    kwargs = {"gpus_per_model": k, "attention_kernel": "flex", "precision": "fp32"}
    if world == 1:
        results = [_forecast(0, 1, str(setup["bundle"]), setup["dataset"], DATES, 3, out, kwargs)]
    else:
        results = run_distributed(_forecast, world, str(setup["bundle"]), setup["dataset"], DATES, 3, out, kwargs,
                                  timeout=600)  # flex: a cold inductor compile per rank
    _assert_same_stores(banded, results[0]["stores"], tolerance=2e-5)


def test_forecast_attention_kernel_errors(setup, tmp_path):
    with pytest.raises(ValueError, match="attention_kernel 'fast' cannot run this forecast .*'fast' is unknown: use one of auto, banded, flex, flash"):
        run_forecast(setup["bundle"], setup["dataset"], DATES[0], 2, tmp_path / "x", attention_kernel="fast")
    with pytest.raises(ValueError, match=r"attention_kernel 'flex' cannot run this forecast \(cpu, fp64\): flex attention on a CPU computes in fp32, bf16 or fp16, not fp64"):
        run_forecast(setup["bundle"], setup["dataset"], DATES[0], 2, tmp_path / "x", attention_kernel="flex",
                     precision="fp64")
    with pytest.raises(ValueError, match=r"attention_kernel 'flash' cannot run this forecast \(cpu.*flash-attn needs CUDA, this runs on cpu"):
        run_forecast(setup["bundle"], setup["dataset"], DATES[0], 2, tmp_path / "x", attention_kernel="flash")
    assert not (tmp_path / "x").exists()


def test_attention_kernel_for_a_model_without_window_attention_is_refused_before_the_build(setup, tmp_path,
                                                                                          monkeypatch):
    """A model of the user's own builder is looked at on the meta device before any work: without a
    sliding-window attention layer ``--attention-kernel banded`` is one error, before the model is built
    (here a build would fail the test) and before anything is written. Built on meta: a builder's model with
    window attention, one without, one whose meta build fails (left to the real build), and a loaded model."""
    from types import SimpleNamespace

    from torch import nn

    from stormshard.inference import forecast
    from stormshard.inference.loader import open_model_source
    from stormshard.layers.attention import SlidingWindowAttention
    from stormshard.models.registry import MODEL_REGISTRY

    def plain(config, graph, variables, plan):  # noqa: ANN001, ANN202
        return nn.Linear(3, 3)

    def windowed(config, graph, variables, plan):  # noqa: ANN001, ANN202
        return nn.Sequential(nn.Linear(8, 8), SlidingWindowAttention(8, num_heads=2, window_size=2))

    def broken(config, graph, variables, plan):  # noqa: ANN001, ANN202
        raise RuntimeError("this builder needs real tensors")

    source = open_model_source(setup["bundle"])
    for name, builder, lacks in (("t_plain", plain, True), ("t_windowed", windowed, False), ("t_broken", broken, False)):
        monkeypatch.setitem(MODEL_REGISTRY, name, builder)
        custom = SimpleNamespace(prebuilt=None, source=SimpleNamespace(
            config=source.config.model_copy(update={"name": name}), graph=source.graph, variables=source.variables,
            shard_strategy=source.shard_strategy))
        assert forecast._lacks_window_attention(custom) is lacks, name
    loaded = SimpleNamespace(prebuilt=SimpleNamespace(model=plain(None, None, None, None)), source=None)
    assert forecast._lacks_window_attention(loaded) is True
    assert forecast._lacks_window_attention(SimpleNamespace(prebuilt=None, source=source)) is False  # built-in

    def no_build(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("the model was built before the refusal")

    monkeypatch.setattr(forecast, "build_forecaster", no_build)
    monkeypatch.setattr(forecast, "_lacks_window_attention", lambda info: True)
    with pytest.raises(ValueError, match=r"--attention-kernel 'banded': the model \(.*\) has no sliding-window "
                                         r"attention layer to run it: leave --attention-kernel out"):
        run_forecast(setup["bundle"], setup["dataset"], DATES[0], 2, tmp_path / "y", attention_kernel="banded")
    assert not (tmp_path / "y").exists()


def test_forecast_builds_the_model_and_its_normalisers_on_the_cuda_device(setup, tmp_path, monkeypatch):
    """With CUDA, a forecast builds the model on this rank's GPU, where its kernel checks assumed it runs and where
    NCCL (a CUDA machine's backend) takes its tensors: it was built on the CPU, so a multi-rank forecast on GPUs
    sent CPU tensors to NCCL and a stored ``graph_kernel: "triton"`` passed the check, then failed on CPU tensors.
    The normalisers go with the model (here to the meta device: no GPU on this machine)."""
    from stormshard.inference import forecast
    from stormshard.inference.loader import build_forecaster, open_model_source

    devices = []

    def record(*args, device="cpu", **kwargs):  # noqa: ANN002, ANN003, ANN202
        devices.append(torch.device(device))
        raise InterruptedError("stop after the build's arguments")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(forecast, "build_forecaster", record)
    with pytest.raises(InterruptedError):
        run_forecast(setup["bundle"], setup["dataset"], DATES[0], 2, tmp_path / "cuda", verbose=False)
    assert devices == [torch.device("cuda", 0)]
    monkeypatch.undo()
    built = build_forecaster(open_model_source(setup["bundle"]), device="meta")
    assert {t.device.type for m in (built.model, built.normaliser, built.output_normaliser)
            for t in (*m.parameters(), *m.buffers())} == {"meta"}
