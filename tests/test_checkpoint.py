"""Checkpoints: resume equals the uninterrupted run (local engine; DeepSpeed ZeRO 0 / ZeRO 2 /
PowerSGD on 2 ranks), a save killed midway leaves the previous one loadable, mismatches are named,
every file loads with ``torch.load(weights_only=True)`` (no pickled code), a checkpoint of the old
pickled format is refused until ``convert_checkpoint.py upgrade`` rewrites it, and a damaged file is
named with the previous complete checkpoint."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(os.path.dirname(os.path.dirname(__file__)), ".cache",
                                                           "torch_extensions"))

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from stormshard.checkpoint.format import CheckpointError, latest_checkpoint, list_checkpoints  # noqa: E402
from stormshard.checkpoint.state_codec import decode_state, encode_state, read_state_file  # noqa: E402
from stormshard.checkpoint.upgrade import upgrade_checkpoints  # noqa: E402
from stormshard.parallel.topology import ParallelLayout, build_process_groups  # noqa: E402
from stormshard.training.checkpoint import (  # noqa: E402
    capture_rng_state,
    load_checkpoint,
    restore_rng_state,
    save_checkpoint,
)
from stormshard.training.engine import EngineSettings, build_engine  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402
from tests.test_engine import MICRO, batch, make_model, shard_model, sharded_loss  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TOTAL, SPLIT = 6, 3


def _settings(engine: str, stage: int = 0, powersgd: bool = False) -> EngineSettings:
    return EngineSettings(
        engine=engine,
        micro_batch_size=MICRO,
        deepspeed={"zero_optimization": {"stage": stage}} if engine == "deepspeed" else {},
        gradient_accumulation_steps=2,
        gradient_clipping=0.5,
        optimizer={"weight_decay": 0.1},
        schedule={"lr": 0.01, "lr_min": 0.001, "warmup_steps": 2, "total_steps": TOTAL},
        compression={"rank": 1, "start_iter": 1, "min_numel": 0, "min_compression_rate": 0.0} if powersgd else None,
    )


def _train_steps(engine, groups, first: int, last: int) -> list[float]:
    """Optimizer steps first..last-1; batches depend on the step (the data position) only."""
    acc, dp = engine.accumulation, groups.layout.data_parallel_size
    losses = []
    for step in range(first, last):
        x, target = batch(step, MICRO * acc * dp)
        for micro in range(acc):
            start = (groups.data_parallel_rank * acc + micro) * MICRO
            loss = sharded_loss(engine, x[start : start + MICRO], target[start : start + MICRO], groups)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses


def _resume_equals_uninterrupted(rank: int, world: int, gpus_per_model: int, settings: EngineSettings,
                                 directory: str) -> list[float]:
    groups = build_process_groups(ParallelLayout(world_size=world, gpus_per_model=gpus_per_model))
    layout = {"world_size": world, "gpus_per_model": gpus_per_model}
    config = {"engine": settings.model_dump(mode="json")}

    def fresh(seed: int):
        torch.manual_seed(100 + rank)
        return build_engine(shard_model(make_model(seed, dropout=0.2), gpus_per_model, groups.model_rank),
                            groups, settings)

    engine = fresh(11)
    uninterrupted = _train_steps(engine, groups, 0, TOTAL)
    final = {k: v.clone() for k, v in engine.module.state_dict().items()}

    engine = fresh(11)
    first = _train_steps(engine, groups, 0, SPLIT)
    save_checkpoint(directory, SPLIT, {"engine": engine.state_dict(), "data": {"next_step": SPLIT}}, config, layout,
                    rank, world, model=engine.module)
    torch.rand(5), random.random(), np.random.rand()  # a restart does not continue the RNG streams
    engine = fresh(12)  # a different initial model: everything must come from the checkpoint
    loaded = load_checkpoint(directory, rank, config=config, layout=layout, world=world)
    engine.load_state_dict(loaded.state["engine"])
    assert engine.global_step == SPLIT and loaded.step == SPLIT
    second = _train_steps(engine, groups, loaded.state["data"]["next_step"], TOTAL)
    assert first + second == uninterrupted, (first + second, uninterrupted)
    for k, v in engine.module.state_dict().items():
        assert torch.equal(v, final[k]), k
    return uninterrupted


def test_resume_local_engine(tmp_path):
    settings = _settings("local")
    torch.manual_seed(0)
    losses = _resume_equals_uninterrupted(0, 1, 1, settings, str(tmp_path / "local"))
    assert len(losses) == TOTAL * 2 and len(set(losses)) == len(losses)
    meta = json.loads((latest_checkpoint(tmp_path / "local") / "metadata.json").read_text())
    assert meta["step"] == SPLIT and meta["world_size"] == 1
    names = [p["name"] for p in meta["ranks"][0]["parameters"]]
    assert names == ["gain", "lin1.weight", "lin1.bias", "norm.weight", "norm.bias", "lin2.weight", "lin2.bias"]


def _check_distributed_resume(rank: int, world: int, directory: str) -> None:
    cases = [
        ("zero0", 1, _settings("deepspeed", 0)),
        ("zero2", 1, _settings("deepspeed", 2)),
        ("zero0-powersgd", 1, _settings("deepspeed", 0, powersgd=True)),
        ("zero2-sharded", 2, _settings("deepspeed", 2)),
        ("ddp-sharded", 2, _settings("ddp")),
    ]
    for name, gpus_per_model, settings in cases:
        _resume_equals_uninterrupted(rank, world, gpus_per_model, settings, os.path.join(directory, name))
    meta = json.loads((Path(directory) / "zero2-sharded" / "step_00000003" / "metadata.json").read_text())
    gains = [next(p for p in r["parameters"] if p["name"] == "gain") for r in meta["ranks"]]
    assert [g["partition"] for g in gains] == [{"dim": 0, "parts": 2, "index": i, "full_size": 7} for i in (0, 1)]
    assert [g["shape"] for g in gains] == [[4], [3]] and gains[0]["full_shape"] == [7]


def test_resume_deepspeed_two_ranks(tmp_path):
    run_distributed(_check_distributed_resume, 2, str(tmp_path), timeout=300)
    files = sorted(tmp_path.rglob("step_*/*"))
    assert {f.suffix for f in files} == {".pt", ".safetensors", ".json"}
    assert_loads_without_pickle(files)


def assert_loads_without_pickle(files) -> None:
    """Every file of a checkpoint opens without unpickling code: ``.pt`` with ``torch.load(weights_only=True)``,
    safetensors and JSON with their readers."""
    from safetensors.torch import load_file

    for f in files:
        if f.suffix == ".pt":
            torch.load(f, weights_only=True)
        elif f.suffix == ".safetensors":
            load_file(f)
        elif f.suffix == ".json":
            json.loads(f.read_text())
        else:
            raise AssertionError(f"unexpected file {f} in a checkpoint")


def to_pickled_format(step_dir: Path) -> None:
    """Rewrite ``step_dir`` as a checkpoint of the earlier release (format 1): rank files of pickled
    python objects, no file records."""
    meta = json.loads((step_dir / "metadata.json").read_text())
    for f in sorted(step_dir.glob("rank_*.pt")):
        payload = read_state_file(f)
        torch.save({**payload, "format": 1}, f)
    for f in sorted(step_dir.glob("rank_*.json")):
        table = json.loads(f.read_text())
        table.pop("files", None)
        f.write_text(json.dumps(table))
    meta["format"] = 1
    meta.pop("files")
    (step_dir / "metadata.json").write_text(json.dumps(meta))


# --------------------------------------------------------------------------------------------
# atomicity: a process killed in the middle of a save
# --------------------------------------------------------------------------------------------

_CRASH = textwrap.dedent(
    """
    import os, sys
    import torch
    from stormshard.training import checkpoint as ck

    directory = sys.argv[1]
    ck.save_checkpoint(directory, 1, {"value": torch.arange(4)}, {"lr": 1}, {"world_size": 1}, 0, 1)

    def dying_writer(obj, path):
        with open(path.with_name(path.name + ".part"), "wb") as f:
            f.write(b"half a checkpoint")
        os._exit(17)

    ck._write_torch = dying_writer
    ck.save_checkpoint(directory, 2, {"value": torch.arange(8)}, {"lr": 1}, {"world_size": 1}, 0, 1)
    """
)


def test_killed_save_leaves_previous_checkpoint(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", _CRASH, str(tmp_path)], env=env, capture_output=True, timeout=120)
    assert proc.returncode == 17, proc.stderr.decode()
    assert (tmp_path / "step_00000002.tmp").is_dir()  # the save died there
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000001"]
    loaded = load_checkpoint(tmp_path, 0, config={"lr": 1}, layout={"world_size": 1}, world=1)
    assert loaded.step == 1 and torch.equal(loaded.state["value"], torch.arange(4))
    # the next save clears the stale temporary directory
    save_checkpoint(tmp_path, 2, {"value": torch.arange(8)}, {"lr": 1}, {"world_size": 1}, 0, 1)
    assert not (tmp_path / "step_00000002.tmp").exists()
    assert load_checkpoint(tmp_path, 0).step == 2
    # a dangling `latest` pointer falls back to the newest complete checkpoint
    (tmp_path / "latest").write_text("step_00000099\n")
    assert latest_checkpoint(tmp_path).name == "step_00000002"


def test_keep_last_and_mismatches(tmp_path):
    model = make_model(0)
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, {"s": step}, {"model": {"channels": 64}, "training": {"max_steps": 10}},
                        {"world_size": 1, "gpus_per_model": 1}, 0, 1, model=model, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000003", "step_00000004"]
    assert (tmp_path / "step_00000004" / "rank_00000.safetensors").is_file()
    from safetensors.torch import load_file

    weights = load_file(tmp_path / "step_00000004" / "rank_00000.safetensors")
    assert torch.equal(weights["gain"], model.gain.detach())

    with pytest.raises(CheckpointError) as err:
        load_checkpoint(tmp_path, 0, config={"model": {"channels": 128}, "training": {"max_steps": 20}},
                        layout={"world_size": 2, "gpus_per_model": 2}, world=2)
    msg = str(err.value)
    for part in ("world_size: stored 1, now 2", "layout.gpus_per_model: stored 1, now 2",
                 "config.model.channels: stored 64, now 128", "config.training.max_steps: stored 10, now 20"):
        assert part in msg, msg
    loaded = load_checkpoint(tmp_path, 0, config={"model": {"channels": 64}, "training": {"max_steps": 20}},
                             ignore=["training.max_steps"])
    assert loaded.state == {"s": 4}
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        load_checkpoint(tmp_path / "empty", 0)
    with pytest.raises(CheckpointError, match="rank 3 is outside"):
        load_checkpoint(tmp_path, 3)
    with pytest.raises(CheckpointError, match="keep_last"):
        save_checkpoint(tmp_path, 5, {}, {}, {}, 0, 1, keep_last=0)
    with pytest.raises(CheckpointError, match="step must be"):
        save_checkpoint(tmp_path, -1, {}, {}, {}, 0, 1)


def test_rng_capture_restore():
    state = capture_rng_state()
    a = (random.random(), np.random.rand(3), torch.rand(3), np.random.randn())
    restore_rng_state(state)
    b = (random.random(), np.random.rand(3), torch.rand(3), np.random.randn())
    assert a[0] == b[0] and np.array_equal(a[1], b[1]) and torch.equal(a[2], b[2]) and a[3] == b[3]


# --------------------------------------------------------------------------------------------
# no pickled code: tensors plus a JSON skeleton; the old pickled format behind `upgrade`
# --------------------------------------------------------------------------------------------


def test_state_codec_round_trip_is_exact():
    from collections import OrderedDict

    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    module = OrderedDict([("w", torch.randn(3, 2)), ("b", torch.zeros(2, dtype=torch.bfloat16))])
    module._metadata = OrderedDict([("", {"version": 1})])
    flat = torch.arange(10.0)
    np.random.seed(3)
    state = {
        "module": module, "ints": {0: {"step": torch.tensor(3.0)}, 7: None}, "betas": (0.9, 0.999),
        "odd": [float("nan"), float("inf"), -float("inf"), 1e-300, True, "x", None, 2**70],
        "numpy": np.random.get_state(legacy=True), "np_scalar": np.float32(0.1), "dtype": torch.bfloat16,
        "device": torch.device("cpu"), "size": torch.Size([2, 3]), "stage": ZeroStageEnum.gradients,
        "scaler": DynamicLossScaler(init_scale=8.0, scale_window=10, min_scale=1.0, delayed_shift=2,
                                    consecutive_hysteresis=False, dtype=torch.bfloat16),
        "mapping": OrderedDict([("w", fragment_address(numel=4, start=2))]),
        "views": [flat[:4], flat[4:]], "python": random.getstate(),
    }
    skeleton, tensors = encode_state(state)
    json.loads(skeleton)  # plain JSON (no NaN tokens)
    back = decode_state(skeleton, tensors)
    assert list(back) == list(state) and type(back["module"]) is OrderedDict
    assert back["module"]._metadata == module._metadata and list(back["module"]) == ["w", "b"]
    assert all(torch.equal(back["module"][k], module[k]) and back["module"][k].dtype == module[k].dtype for k in module)
    assert list(back["ints"]) == [0, 7] and back["betas"] == (0.9, 0.999)
    assert np.isnan(back["odd"][0]) and back["odd"][1:] == state["odd"][1:]
    assert back["numpy"][0] == "MT19937" and back["numpy"][1].dtype == np.uint32
    assert all(np.array_equal(a, b) for a, b in zip(back["numpy"], state["numpy"], strict=True))
    assert type(back["np_scalar"]) is np.float32 and back["np_scalar"] == state["np_scalar"]
    assert (back["dtype"], back["device"], back["size"], back["stage"]) == (torch.bfloat16, torch.device("cpu"),
                                                                            torch.Size([2, 3]), ZeroStageEnum.gradients)
    assert type(back["scaler"]) is DynamicLossScaler and vars(back["scaler"]) == vars(state["scaler"])
    assert back["mapping"]["w"] == fragment_address(numel=4, start=2)
    assert back["python"] == state["python"]
    random.setstate(back["python"])  # a valid python RNG state
    # anything else is a developer error naming where it sits
    with pytest.raises(TypeError, match=r"checkpoint state at engine/hook: a builtins.builtin_function_or_method cannot be stored"):
        encode_state({"engine": {"hook": len}})
    with pytest.raises(TypeError, match="opt/1: a collections.deque"):
        from collections import deque

        encode_state({"opt": [1, deque()]})


def test_pickled_format_is_refused_until_upgraded(tmp_path, capsys):
    """A checkpoint of the earlier release (pickled rank files) is an error naming the upgrade command;
    `convert_checkpoint.py upgrade` rewrites it in place, after which it loads the same state."""
    model = make_model(0)
    state = {"engine": {"module": model.state_dict(), "counter": 5}, "data": {"position": 4}}
    for step in (1, 2):
        save_checkpoint(tmp_path, step, state, {"lr": 1}, {"world_size": 1}, 0, 1, model=model)
    before = load_checkpoint(tmp_path, 0, restore_rng=False)
    for step_dir in list_checkpoints(tmp_path):
        to_pickled_format(step_dir)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(tmp_path, 0)
    msg = str(err.value)
    assert "earlier stormshard (checkpoint format 1" in msg and f"convert_checkpoint.py upgrade {tmp_path}" in msg, msg

    spec = __import__("importlib.util").util.spec_from_file_location("convert", ROOT / "launch" / "convert_checkpoint.py")
    cli = __import__("importlib.util").util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    assert cli.main(["upgrade", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count("upgraded from format 1 to 2") == 2, out
    after = load_checkpoint(tmp_path, 0, restore_rng=False)
    assert after.step == 2 and after.state["data"] == before.state["data"] and after.state["engine"]["counter"] == 5
    assert all(torch.equal(after.state["engine"]["module"][k], v) for k, v in before.state["engine"]["module"].items())
    assert_loads_without_pickle(sorted(tmp_path.rglob("step_*/*")))
    assert json.loads((tmp_path / "step_00000001" / "metadata.json").read_text())["upgraded_from"] == 1
    assert upgrade_checkpoints(tmp_path)[0][1] == "already in the current format"


def test_damaged_files_are_named_with_the_previous_checkpoint(tmp_path):
    model = make_model(0)
    for step in (1, 2):
        save_checkpoint(tmp_path, step, {"s": step}, {}, {"world_size": 1}, 0, 1, model=model)
    rank_file = tmp_path / "step_00000002" / "rank_00000.pt"
    size = rank_file.stat().st_size
    rank_file.write_bytes(b"\0" * size)  # zeroed, same size: only the sha256 finds it
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(tmp_path, 0)
    msg = str(err.value)
    assert f"{rank_file}: its contents differ from the sha256 recorded" in msg, msg
    assert "the previous complete checkpoint is" in msg and "step_00000001 (step 1)" in msg, msg
    assert "PytorchStreamReader" not in msg and "storages" not in msg


def test_upgrade_checks_the_space_before_rewriting_anything(tmp_path, monkeypatch):
    """The upgrade rewrites each checkpoint as a copy beside itself: without room for the largest one it is
    an error naming the sizes, before any checkpoint changes."""
    import shutil as shutil_module

    from stormshard.checkpoint import upgrade as upgrade_module
    from stormshard.checkpoint.errors import ConversionError

    model = make_model(0)
    for step in (1, 2):
        save_checkpoint(tmp_path, step, {"engine": {"module": model.state_dict()}}, {}, {"world_size": 1}, 0, 1,
                        model=model)
    for step_dir in list_checkpoints(tmp_path):
        to_pickled_format(step_dir)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    real = shutil_module.disk_usage
    monkeypatch.setattr(upgrade_module.shutil, "disk_usage",
                        lambda path: real(path)._replace(free=1 << 20))  # 1 MiB free
    with pytest.raises(ConversionError, match=r"MiB while .* has 1 MiB free; nothing was changed"):
        upgrade_checkpoints(tmp_path)
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    monkeypatch.setattr(upgrade_module.shutil, "disk_usage", real)
    assert [what for _, what in upgrade_checkpoints(tmp_path)] == ["upgraded from format 1 to 2"] * 2
