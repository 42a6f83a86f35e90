"""Checkpoint conversion: consolidate equals the gpus_per_model=1 run, reshard 2 -> 4 keeps the
model's outputs and resumes training, export -> load_model gives the training model's forecast,
inspect, and damaged or mismatched checkpoints fail with a list of differences and write nothing."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from stormshard.checkpoint.consolidate import consolidate_checkpoint, load_consolidated, save_consolidated
from stormshard.checkpoint.errors import ConversionError
from stormshard.checkpoint.export import export_bundle, load_model
from stormshard.checkpoint.inspect import inspect_checkpoint
from stormshard.checkpoint.reshard import reshard_checkpoint
from stormshard.checkpoint.sources import model_sources
from stormshard.checkpoint.state_codec import read_state_file, write_state_file
from stormshard.checkpoint.stored_config import stored_shard_strategy
from stormshard.data.synthetic import generate_synthetic_dataset
from stormshard.models.registry import build_model
from tests.distributed import run_distributed
from tests.test_checkpoint import assert_loads_without_pickle, to_pickled_format
from tests.tiny_run import tiny_config, train_losses

ROOT = Path(__file__).resolve().parent.parent
KINDS = {  # the transformer with tensor parallelism (deepspeed ZeRO 0) and a graph processor (local engine)
    "tensor": {"parallel.shard_strategy": "tensor"},
    "graph": {"model.name": "graphtransformer", "graph.hidden": "ico1", "graph.processor": {"kind": "multimesh"},
              "engine": "local", "deepspeed": {}},
}


def _config(dataset: str, out: Path, **changes) -> dict:
    return tiny_config(dataset, out, **{"data.validation_samples": 2, **changes})


_train = train_losses


def _forward(rank, world, step_dir, x):
    """This rank's output slice of the model stored in ``step_dir`` (its own rank file) on the
    normalised input ``x (batch, time, grid, variables)``; the model group is the whole world."""
    meta = json.loads((Path(step_dir) / "metadata.json").read_text())
    src = model_sources(meta["config"], step_dir)
    group = dist.group.WORLD if world > 1 else None
    torch.manual_seed(123)  # the weights come from the file, not from this
    model = build_model(src.config.model, src.graph, src.variables, group, shard_strategy=src.config.shard_strategy)
    payload = read_state_file(Path(step_dir) / f"rank_{rank:05d}.pt")
    model.load_state_dict(payload["state"]["engine"]["module"])
    with torch.no_grad():
        out = model.eval()(x[:, :, model.plan.data_slice])
    return model.plan.data_slice.start, out


def _stitch(parts) -> torch.Tensor:
    return torch.cat([out for _, out in sorted(parts, key=lambda p: p[0])], dim=1)


def _input(step_dir: Path) -> torch.Tensor:
    meta = json.loads((step_dir / "metadata.json").read_text())
    src = model_sources(meta["config"], step_dir)
    g = torch.Generator().manual_seed(7)
    return torch.randn(2, 2, src.graph["data"].num_nodes, len(src.variables.input_names), generator=g)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Checkpoints after 3 steps of the same config at gpus_per_model 1 and 2, per kind."""
    root = tmp_path_factory.mktemp("conversion")
    dataset = root / "synthetic.zarr"
    generate_synthetic_dataset(dataset, grid="o8", steps=64, seed=1)
    out = {"root": root, "dataset": str(dataset)}
    for kind, extra in KINDS.items():
        one = _config(str(dataset), root / f"{kind}1", **extra)
        two = _config(str(dataset), root / f"{kind}2", **{**extra, "parallel.gpus_per_model": 2})
        _train(0, 1, one)
        run_distributed(_train, 2, two)
        out[kind] = (root / f"{kind}1" / "checkpoints" / "step_00000003", root / f"{kind}2" / "checkpoints" /
                     "step_00000003", two)
    # ZeRO 2 over 2 replicas of a 2-rank tensor-parallel model: the same effective batch of 2
    zero = _config(str(dataset), root / "zero", **{**KINDS["tensor"], "parallel.gpus_per_model": 2,
                                                   "training.micro_batch_size": 1,
                                                   "deepspeed.zero_optimization": {"stage": 2}})
    run_distributed(_train, 4, zero)
    out["zero"] = (root / "zero" / "checkpoints" / "step_00000003", zero)
    return out


def _close(a: torch.Tensor, b: torch.Tensor, what: str, floor: float = 0.0) -> None:
    """``a == b`` relative to ``b``'s own scale (AdamW's exp_avg_sq is ~1e-8: a fixed atol would pass
    scrambled second moments). ``floor`` is an absolute tolerance for tensors whose exact value is
    zero (e.g. key biases, to which the softmax is invariant: their moments are rounding noise)."""
    assert a.shape == b.shape, what
    scale = float(b.abs().max())
    torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3 * scale + floor + 1e-30, msg=what)


def _close_moments(state: dict, reference: dict, names) -> None:  # noqa: ANN001
    """AdamW moments tensor by tensor; the noise floor is 1e-6 of the largest moment of that kind."""
    for key in ("exp_avg", "exp_avg_sq"):
        floor = 1e-6 * max(float(reference[n][key].abs().max()) for n in names)
        for name in names:
            _close(state[name][key], reference[name][key], f"{name} {key}", floor)


def test_moment_check_rejects_scrambled_second_moments(runs):
    """The tolerance must fail a permuted exp_avg_sq (a fixed atol of 2e-4 passed it)."""
    single = consolidate_checkpoint(runs["tensor"][0])
    names = list(single.model)
    scrambled = {n: dict(single.optimizer["state"][n]) for n in names}
    # the most varied second moment (largest spread relative to its scale)
    big = max(names, key=lambda n: float(single.optimizer["state"][n]["exp_avg_sq"].std()
                                         / single.optimizer["state"][n]["exp_avg_sq"].abs().max().clamp_min(1e-30)))
    sq = scrambled[big]["exp_avg_sq"]
    scrambled[big]["exp_avg_sq"] = sq.flatten()[torch.randperm(sq.numel(), generator=torch.Generator().manual_seed(0))
                                               ].view_as(sq)
    assert not torch.equal(scrambled[big]["exp_avg_sq"], sq)
    with pytest.raises(AssertionError):
        _close_moments(scrambled, single.optimizer["state"], names)


# ------------------------------------------------------------------------------ consolidate


@pytest.mark.parametrize("kind", list(KINDS))
def test_consolidate_equals_gpus_per_model_1(runs, kind, tmp_path):
    single_dir, sharded_dir, _ = runs[kind]
    meta = json.loads((sharded_dir / "metadata.json").read_text())
    sliced = [r for r in meta["ranks"][1]["parameters"] if r["partition"]]
    if kind == "tensor":  # the conversion has real work to do: slices along both dims
        assert {r["partition"]["dim"] for r in sliced} == {0, 1} and all(r["partition"]["index"] == 1 for r in sliced)
    single, sharded = consolidate_checkpoint(single_dir), consolidate_checkpoint(sharded_dir)
    assert list(sharded.model) == list(single.model)
    for name, ref in single.model.items():
        _close(sharded.model[name], ref, name)
    _close_moments(sharded.optimizer["state"], single.optimizer["state"], list(single.model))
    for name in single.model:
        assert float(sharded.optimizer["state"][name]["step"]) == 3
    assert sharded.engine["scheduler"] == single.engine["scheduler"]
    assert len(sharded.replicas) == 1 and sharded.replicas[0]["data"]["position"] == 6
    # save -> load round trip, bit for bit
    save_consolidated(sharded, tmp_path / "full")
    back = load_consolidated(tmp_path / "full")
    assert all(torch.equal(back.model[n], t) for n, t in sharded.model.items())
    assert all(torch.equal(back.optimizer["state"][n]["exp_avg"], sharded.optimizer["state"][n]["exp_avg"])
               for n in sharded.model)


def test_consolidate_zero2_partitions_equals_gpus_per_model_1(runs):
    """Tensor-parallel slices whose AdamW moments sit in ZeRO 2 flat partitions over 2 replicas."""
    zero_dir, _ = runs["zero"]
    single, zero = consolidate_checkpoint(runs["tensor"][0]), consolidate_checkpoint(zero_dir)
    assert zero.engine["zero_stage"] == 2 and len(zero.replicas) == 2
    assert zero.replicas[1]["data"]["rank"] == 1
    for name, ref in single.model.items():
        _close(zero.model[name], ref, name)
    _close_moments(zero.optimizer["state"], single.optimizer["state"], list(single.model))


def test_reshard_zero2_to_one_rank_per_model_resumes_like_the_original(runs, tmp_path):
    zero_dir, zero_cfg = runs["zero"]
    x = _input(zero_dir)
    original = _stitch(run_distributed(_forward, 2, str(zero_dir), x))  # model group 0: ranks 0 and 1
    out = tmp_path / "k1" / "checkpoints"
    step_dir = reshard_checkpoint(zero_dir, out, 1)
    assert json.loads((step_dir / "metadata.json").read_text())["world_size"] == 2
    torch.testing.assert_close(_stitch([_forward(0, 1, str(step_dir), x)]), original, rtol=1e-5, atol=1e-5)
    resume = json.loads((out / "resume_config.json").read_text())
    resume["training"]["max_steps"] = 4
    resumed = run_distributed(_train, 2, resume, True)[0]
    cont = copy.deepcopy(zero_cfg)
    cont["training"]["max_steps"] = 4
    cont["training"]["output_dir"] = str(tmp_path / "orig")
    shutil.copytree(zero_dir, tmp_path / "orig" / "checkpoints" / zero_dir.name)
    assert resumed == pytest.approx(run_distributed(_train, 4, cont, True)[0], rel=1e-5)


# ------------------------------------------------------------------------------ reshard


@pytest.mark.parametrize("kind", list(KINDS))
def test_reshard_2_to_4_keeps_outputs_and_resumes(runs, kind, tmp_path):
    _, sharded_dir, two = runs[kind]
    x = _input(sharded_dir)
    original = _stitch(run_distributed(_forward, 2, str(sharded_dir), x))
    out = tmp_path / "k4" / "checkpoints"
    step_dir = reshard_checkpoint(sharded_dir, out, 4)
    meta = json.loads((step_dir / "metadata.json").read_text())
    assert meta["world_size"] == 4 and meta["layout"]["gpus_per_model"] == 4
    if kind == "tensor":
        parts = [r["partition"] for r in meta["ranks"][3]["parameters"] if r["partition"]]
        assert parts and all(p["parts"] == 4 and p["index"] == 3 for p in parts)
    resharded = _stitch(run_distributed(_forward, 4, str(step_dir), x))
    torch.testing.assert_close(resharded, original, rtol=1e-5, atol=1e-5)
    # and to a single process
    single = reshard_checkpoint(sharded_dir, tmp_path / "k1" / "checkpoints", 1)
    torch.testing.assert_close(_stitch([_forward(0, 1, str(single), x)]), original, rtol=1e-5, atol=1e-5)
    # launch/train.py --resume continues from the resharded checkpoint
    resume = json.loads((out / "resume_config.json").read_text())
    assert resume["training"]["output_dir"] == str(out.parent)
    resume["training"]["max_steps"] = 4
    losses = run_distributed(_train, 4, resume, True)
    assert len(losses[0]) == 1 and math.isfinite(losses[0][0]) and all(o == losses[0] for o in losses)
    assert (out / "step_00000004" / "rank_00003.pt").is_file()
    # the continued run at gpus_per_model 4 takes the same step as the original layout would
    cont = copy.deepcopy(two)
    cont["training"]["max_steps"] = 4
    shutil.copytree(sharded_dir, tmp_path / "two" / "checkpoints" / sharded_dir.name)
    cont["training"]["output_dir"] = str(tmp_path / "two")
    reference = run_distributed(_train, 2, cont, True)[0]
    assert losses[0] == pytest.approx(reference, rel=1e-4)


def test_reshard_changes_strategy(runs, tmp_path):
    _, sharded_dir, _ = runs["tensor"]
    x = _input(sharded_dir)
    original = _stitch(run_distributed(_forward, 2, str(sharded_dir), x))
    step_dir = reshard_checkpoint(sharded_dir, tmp_path / "seq", 2, "shard_sequence")
    meta = json.loads((step_dir / "metadata.json").read_text())
    assert meta["config"]["parallel"]["shard_strategy"] == "shard_sequence"
    assert "shard_strategy" not in meta["config"]["model"]["processor"]
    assert not any(r["partition"] for r in meta["ranks"][0]["parameters"])
    torch.testing.assert_close(_stitch(run_distributed(_forward, 2, str(step_dir), x)), original,
                               rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------ export


def test_export_load_gives_the_training_models_forecast(runs, tmp_path):
    _, sharded_dir, _ = runs["tensor"]
    x = _input(sharded_dir)
    training = _stitch(run_distributed(_forward, 2, str(sharded_dir), x))
    bundle = export_bundle(sharded_dir.parent, tmp_path / "bundle")
    assert {p.name for p in bundle.iterdir()} == {"metadata.json", "model.safetensors", "statistics.json", "graph.pt"}
    loaded = load_model(bundle)
    assert not loaded.model.training and next(loaded.model.parameters()).device.type == "cpu"
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(x), training, rtol=1e-5, atol=1e-5)
    assert loaded.variables.output_names == ("tracer_1", "tracer_2", "tracer_3", "tracer_product")
    # one call, one process, no DeepSpeed imported
    code = ("import sys, torch; from stormshard.checkpoint.export import load_model; "
            f"m = load_model({str(bundle)!r}); "
            f"x = torch.load({str(tmp_path / 'x.pt')!r}); y = m.model(x); "
            "assert 'deepspeed' not in sys.modules, 'deepspeed was imported'; "
            f"torch.save(y.detach(), {str(tmp_path / 'y.pt')!r})")
    torch.save(x, tmp_path / "x.pt")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)
    torch.testing.assert_close(torch.load(tmp_path / "y.pt"), training, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------ inspect / CLI


def _cli():
    spec = importlib.util.spec_from_file_location("convert_checkpoint", ROOT / "launch" / "convert_checkpoint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_inspect_and_cli(runs, tmp_path, capsys):
    _, sharded_dir, _ = runs["tensor"]
    info = inspect_checkpoint(sharded_dir.parent)
    assert info["kind"] == "training" and info["step"] == 3 and info["world_size"] == 2
    assert info["layout"]["gpus_per_model"] == 2 and info["engine"] == "deepspeed" and info["zero_stage"] == 0
    single = consolidate_checkpoint(runs["tensor"][0])
    assert info["num_parameters"] == sum(t.numel() for t in single.model.values())
    assert info["model_bytes"] == 4 * info["num_parameters"] and info["partitioned"] == 12
    cli = _cli()
    assert cli.main(["inspect", str(sharded_dir), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 3
    assert cli.main(["inspect", str(sharded_dir)]) == 0
    text = capsys.readouterr().out
    assert "gpus_per_model 2" in text and "KiB" in text and "dim 1 / 2 parts" in text
    assert cli.main(["consolidate", str(sharded_dir), "--out", str(tmp_path / "c")]) == 0
    assert inspect_checkpoint(tmp_path / "c")["kind"] == "consolidated"
    assert cli.main(["reshard", str(tmp_path / "c"), "--gpus-per-model", "4", "--out", str(tmp_path / "r")]) == 0
    assert inspect_checkpoint(tmp_path / "r")["world_size"] == 4
    assert cli.main(["export", str(tmp_path / "r"), "--out", str(tmp_path / "b")]) == 0
    assert inspect_checkpoint(tmp_path / "b")["kind"] == "inference bundle"
    assert cli.main(["reshard", str(sharded_dir), "--gpus-per-model", "3", "--out", str(tmp_path / "r3")]) == 2
    assert "error:" in capsys.readouterr().err
    assert not (tmp_path / "r3").exists()


# ------------------------------------------------------------------------------ no pickled code; never into the source


def _same_tree(a, b, where: str = "") -> None:  # noqa: ANN001
    """``a == b`` for nested checkpoint state: types, keys, tensors bit for bit, objects by their fields."""
    assert type(a) is type(b), (where, type(a), type(b))
    if isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            _same_tree(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same_tree(x, y, f"{where}/{i}")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif hasattr(a, "__dict__") and not isinstance(a, int):
        assert vars(a) == vars(b), where
    else:
        assert a == b, (where, a, b)


def test_files_load_without_pickle_and_the_pickled_format_upgrades(runs, tmp_path, capsys):
    zero_dir, _ = runs["zero"]  # ZeRO 2: DeepSpeed's loss scaler, fragment addresses and stage enum inside
    for step_dir in (runs["tensor"][1], runs["graph"][1], zero_dir):
        assert_loads_without_pickle(sorted(step_dir.iterdir()))
    reference = consolidate_checkpoint(zero_dir)
    full = save_consolidated(reference, tmp_path / "full")
    assert_loads_without_pickle(sorted(full.iterdir()))
    assert_loads_without_pickle(sorted(export_bundle(full, tmp_path / "bundle").iterdir()))

    old = _copy(zero_dir, tmp_path / "old" / "checkpoints" / zero_dir.name)
    to_pickled_format(old)
    cli = _cli()
    assert cli.main(["consolidate", str(old.parent), "--out", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and f"python launch/convert_checkpoint.py upgrade {old}" in err, err
    assert not (tmp_path / "c").exists()
    assert cli.main(["upgrade", str(old.parent)]) == 0
    assert "upgraded from format 1 to 2" in capsys.readouterr().out
    assert_loads_without_pickle(sorted(old.iterdir()))
    _same_tree(dataclasses.asdict(consolidate_checkpoint(old)), dataclasses.asdict(reference))

    # a consolidated checkpoint of the earlier release (pickled optimizer.pt / trainer.pt) too
    old_full = _copy(full, tmp_path / "old_full")
    meta = json.loads((old_full / "metadata.json").read_text())
    for name in ("optimizer.pt", "trainer.pt"):
        torch.save(read_state_file(old_full / name), old_full / name)
    meta.update(version=1)
    meta.pop("files")
    (old_full / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(ConversionError, match=f"upgrade {old_full}"):
        load_consolidated(old_full)
    assert cli.main(["upgrade", str(old_full)]) == 0
    _same_tree(dataclasses.asdict(load_consolidated(old_full)), dataclasses.asdict(load_consolidated(full)))


def test_conversion_never_writes_into_its_source(runs, tmp_path, capsys):
    checkpoints = _copy(runs["tensor"][1].parent, tmp_path / "run" / "checkpoints")
    step = checkpoints / runs["tensor"][1].name
    before = {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()}
    cli = _cli()
    cases = [  # (arguments, what the error says)
        (["consolidate", str(checkpoints), "--out", str(checkpoints), "--overwrite"], "is the source"),
        (["consolidate", str(step), "--out", str(step / "full"), "--overwrite"], "is inside the source"),
        (["consolidate", str(checkpoints), "--out", str(step / "full")], "is inside the source"),
        (["reshard", str(checkpoints), "--gpus-per-model", "1", "--out", str(checkpoints), "--overwrite"],
         "is the source"),
        (["reshard", str(step), "--gpus-per-model", "1", "--out", str(checkpoints), "--overwrite"],
         "--overwrite would replace it"),
        (["export", str(checkpoints), "--out", str(checkpoints / "bundle")], "is inside the source"),
        (["export", str(step), "--out", str(tmp_path / "run"), "--overwrite"], "--overwrite would replace it"),
    ]
    for args, what in cases:
        assert cli.main(args) == 2, args
        err = capsys.readouterr().err
        assert err.count("error:") == 1 and what in err and "Traceback" not in err, (args, err)
        assert "conversion never writes into its source" in err or "holds the source" in err, err
    after = {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()}
    assert after == before  # the source untouched, nothing written next to it


# ------------------------------------------------------------------------------ damaged / mismatched


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_rank(path: Path, rank: int, fn) -> None:
    """Edit the engine state of a rank; its weights file (optional) would then disagree with it, so
    it goes, and the file records of metadata.json follow the edit: the check under test is the one
    on the engine state, not the checksum."""
    (path / f"rank_{rank:05d}.safetensors").unlink(missing_ok=True)
    f = path / f"rank_{rank:05d}.pt"
    payload = read_state_file(f)
    fn(payload)
    write_state_file(payload, f)
    _rerecord(path)


def _rerecord(path: Path) -> None:
    """metadata.json's file records as the files are now (an edit made on purpose, not damage)."""
    from stormshard.checkpoint.integrity import record_files

    meta = json.loads((path / "metadata.json").read_text())
    meta["files"] = record_files(sorted(f for f in path.iterdir() if f.name != "metadata.json"))
    (path / "metadata.json").write_text(json.dumps(meta))


def _edit_meta(path: Path, fn) -> None:
    meta = json.loads((path / "metadata.json").read_text())
    fn(meta)
    (path / "metadata.json").write_text(json.dumps(meta))


def _fails(path: Path, *expected: str, tmp: Path, convert: str = "reshard") -> None:
    out = tmp / f"out_{path.name}"
    with pytest.raises(ConversionError) as info:
        if convert == "reshard":
            reshard_checkpoint(path, out / "checkpoints", 4)
        else:
            export_bundle(path, out)
    for text in expected:
        assert text in str(info.value), f"{text!r} not in:\n{info.value}"
    assert not out.exists(), "a failed conversion wrote files"


def test_damaged_and_mismatched_checkpoints_fail_and_write_nothing(runs, tmp_path):
    _, good, _ = runs["tensor"]
    qkv = "processor.processor.blocks.0.attention.lin_qkv.weight"

    p = _copy(good, tmp_path / "missing_rank")
    (p / "rank_00001.pt").unlink()
    _fails(p, "rank_00001.pt: missing", tmp=tmp_path)

    p = _copy(good, tmp_path / "corrupted")
    data = (p / "rank_00000.pt").read_bytes()
    (p / "rank_00000.pt").write_bytes(data[: len(data) // 2])
    _fails(p, f"rank_00000.pt: {len(data) // 2} bytes, {len(data)} when it was saved (truncated",
           "rank_00000.pt: unreadable: cannot be read as a torch file", tmp=tmp_path)
    _rerecord(p)  # a checkpoint without the records of this file: the reader still names it
    _fails(p, "rank_00000.pt: unreadable: cannot be read as a torch file", "damaged (truncated", tmp=tmp_path)

    p = _copy(good, tmp_path / "corrupted_weights")
    data = bytearray((p / "rank_00001.safetensors").read_bytes())
    data[-8:] = b"\xff" * 8  # flip the last weights' bytes
    (p / "rank_00001.safetensors").write_bytes(bytes(data))
    _fails(p, "rank_00001.safetensors: its contents differ from the sha256 recorded", tmp=tmp_path)
    _rerecord(p)  # without the checksum, the comparison with the engine state finds it
    _fails(p, "rank_00001.safetensors: ", "differ from the engine state", tmp=tmp_path)
    (p / "rank_00001.safetensors").write_bytes(bytes(data[:100]))
    _rerecord(p)
    _fails(p, "rank_00001.safetensors: unreadable", tmp=tmp_path)

    p = _copy(good, tmp_path / "extra_rank")
    shutil.copy(p / "rank_00001.pt", p / "rank_00002.pt")
    _fails(p, "rank_00002.pt: extra rank file", tmp=tmp_path)

    p = _copy(good, tmp_path / "truncated_metadata")
    text = (p / "metadata.json").read_text()
    (p / "metadata.json").write_text(text[: len(text) // 2])
    _fails(p, f"{p / 'metadata.json'} cannot be read", "the checkpoint is damaged", tmp=tmp_path)

    p = _copy(good, tmp_path / "missing_tensor")
    _edit_rank(p, 1, lambda pl: pl["state"]["engine"]["module"].pop(qkv))
    _edit_rank(p, 0, lambda pl: pl["state"]["engine"]["module"].__setitem__("spare.weight", torch.zeros(2)))
    _fails(p, f"rank 1: {qkv}: in metadata.json but missing", "rank 0: spare.weight: in the weights but not",
           tmp=tmp_path)

    p = _copy(good, tmp_path / "wrong_shape")
    _edit_rank(p, 1, lambda pl: pl["state"]["engine"]["module"].__setitem__(qkv, torch.zeros(23, 16)))
    _fails(p, f"rank 1: {qkv}: shape [23, 16], metadata.json says [24, 16]", tmp=tmp_path)

    def half_shards(meta):
        for row in meta["ranks"][1]["parameters"]:
            if row["name"] == qkv:
                row["partition"]["index"] = 0
    p = _copy(good, tmp_path / "incomplete")
    _edit_meta(p, half_shards)
    _fails(p, f"{qkv}: incomplete shards", tmp=tmp_path)

    p = _copy(good, tmp_path / "replica_disagrees")
    _edit_rank(p, 1, lambda pl: pl["state"]["engine"]["module"]["embed_data.bias"].add_(1.0))
    _fails(p, "embed_data.bias: replicated, but model rank 1 differs", tmp=tmp_path)

    def wider(meta):  # the checkpoint no longer matches the model its config builds
        meta["config"]["model"]["num_channels"] = 32
    p = _copy(good, tmp_path / "other_model")
    _edit_meta(p, wider)
    _fails(p, "does not match the model", "embed_data.weight: shape [16, 16] in the checkpoint, [32, 16] in the model",
           tmp=tmp_path, convert="export")

    def unknown_optimizer(pl):  # an optimizer format the converter does not know
        pl["state"]["engine"]["optimizer"] = {"fp32_groups_flat": [torch.zeros(3)]}
    p = _copy(good, tmp_path / "unknown_optimizer")
    for r in (0, 1):
        _edit_rank(p, r, unknown_optimizer)
    _fails(p, "ZeRO stage 0", "only the weights were consolidated", tmp=tmp_path)
    export_bundle(p, tmp_path / "unknown_optimizer_bundle")  # the weights are still exportable
    assert "only the weights" in consolidate_checkpoint(p).optimizer_note

    zero_dir, _ = runs["zero"]  # a ZeRO partition of a replica is gone
    p = _copy(zero_dir, tmp_path / "zero_partition")
    _edit_rank(p, 2, lambda pl: pl["state"]["engine"]["optimizer"]["partition_count"].__setitem__(0, 1))
    _fails(p, "data-parallel rank 1 has partition_count [1]", tmp=tmp_path)


# ------------------------------------------------------------------------------ old spellings of the strategy


@pytest.mark.parametrize("stored, expected", [
    ({"parallel": {"shard_strategy": "shard_heads"}, "model": {"processor": {"shard_strategy": "tensor"}}}, "shard_heads"),
    ({"parallel": {"shard_strategy": None}, "model": {"processor": {"shard_strategy": "shard_heads"}}}, "shard_heads"),
    ({"parallel": {"tensor_model_parallel_size": 2}, "model": {"processor": {}}}, "tensor"),
    ({"parallel": {"tensor_model_parallel_size": 1}}, "shard_sequence"),
    ({}, "shard_sequence"),
])
def test_stored_shard_strategy_reads_the_old_spellings(stored, expected):
    assert stored_shard_strategy(stored) == expected


def test_old_checkpoints_with_the_strategy_under_model_still_convert(runs, tmp_path):
    """A checkpoint whose stored config spells the strategy the old way (``model.processor.shard_strategy``,
    or ``parallel.tensor_model_parallel_size`` alone) loads, inspects, reshards and exports with it."""
    _, sharded_dir, _ = runs["tensor"]
    x = _input(sharded_dir)
    original = _stitch(run_distributed(_forward, 2, str(sharded_dir), x))

    def model_key(config):
        config["parallel"]["shard_strategy"] = None
        config["model"]["processor"]["shard_strategy"] = "tensor"

    def tp_size(config):
        config["parallel"]["shard_strategy"] = None
        config["parallel"]["tensor_model_parallel_size"] = 2

    for name, to_old in (("model_key", model_key), ("tp_size", tp_size)):
        old = _copy(sharded_dir, tmp_path / name)
        _edit_meta(old, lambda meta, to_old=to_old: to_old(meta["config"]))
        assert model_sources(json.loads((old / "metadata.json").read_text())["config"], old).config.shard_strategy \
            == "tensor"
        assert inspect_checkpoint(old)["model"]["shard_strategy"] == "tensor"
        step_dir = reshard_checkpoint(old, tmp_path / f"{name}_k1" / "checkpoints", 1)
        config = json.loads((step_dir / "metadata.json").read_text())["config"]
        assert config["parallel"]["shard_strategy"] == "tensor" and config["parallel"]["gpus_per_model"] == 1
        assert "shard_strategy" not in config["model"]["processor"]
        assert "tensor_model_parallel_size" not in config["parallel"]
        torch.testing.assert_close(_stitch([_forward(0, 1, str(step_dir), x)]), original, rtol=1e-5, atol=1e-5)
    # the model key read from the old checkpoint itself, on its own 2 ranks, and from its bundle
    old = tmp_path / "model_key"
    torch.testing.assert_close(_stitch(run_distributed(_forward, 2, str(old), x)), original, rtol=1e-5, atol=1e-5)
    loaded = load_model(export_bundle(old, tmp_path / "old_bundle"))
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(x), original, rtol=1e-5, atol=1e-5)
