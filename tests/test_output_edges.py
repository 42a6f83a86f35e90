"""Nothing written or lost before failing, across the entry points (the fifth audit): each case here used to
write, leave or lose something, or fail late with a message that named the wrong path.

- ``--overwrite`` of a conversion over a file left ``.<name>.old-<pid>`` beside it, and a rename that failed
  when the new output was swapped in lost the old one (moved aside, never put back); ``reshard --overwrite``
  into a checkpoints folder that failed after its step was in place lost the old step and ``latest``.
- ``reshard --out FILE`` read and converted the whole checkpoint, then failed naming a temporary path;
  ``export-anemoi --out DIR --overwrite`` did the whole export, then failed naming ``DIR.partial``.
- A full disk while a file was copied into the output (``shutil``'s ``sendfile``) was reported as a full disk
  writing the *source* file; a full disk while a graph cache was saved named no file ("writing the output").
- ``inspect`` of a bundle whose ``metadata.json`` is damaged printed a bare JSON error; a dataset chunk that
  cannot be decoded (truncated, overwritten) was ``error: RuntimeError: error during blosc decompression: -1``
  (with zarr's tracebacks at exit when run as a script), the store unnamed.
- A forecast wrote into the bundle or checkpoint it read (``--out`` equal to or inside ``--model``); a forecast
  with ``--overwrite`` that failed half-way deleted the previous forecast (and kept its stale scores).
- A run wrote into its dataset, its ``training.init_weights`` bundle or another run's checkpoint step
  (``training.output_dir`` equal to or inside them); a run stopped for lack of room for its first
  checkpoint left its ``graph.pt`` (and output folder) behind.
- ``python -m stormshard.data.synthetic`` into a read-only place or onto a full disk ended with a traceback
  (and, on a full disk, zarr's tracebacks and the folders it made), and a rename that failed when the new
  store was swapped in deleted the old one.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections import namedtuple
from pathlib import Path

import pytest

import stormshard.checkpoint.consolidate as consolidate
from stormshard.checkpoint.export import export_bundle
from stormshard.training.launch import run_training
from tests.bad_input_helpers import content_hashes, run_main, snapshot
from tests.test_cli_errors import _one_process  # noqa: F401 - autouse: a one-process environment
from tests.tiny_run import tiny_config

pytestmark = pytest.mark.filterwarnings("ignore")
FORECAST = ["--date", "2020-01-12T00", "--steps", "2"]


@pytest.fixture(scope="module")
def run(tmp_path_factory, dataset) -> Path:
    """A tiny run (2 steps, local engine) and its bundle, ``bundle`` beside it."""
    root = tmp_path_factory.mktemp("outputs")
    cfg = tiny_config(dataset, root / "run", **{"training.max_steps": 2, "training.checkpoint_interval": 1,
                                                "data.validation_samples": 1, "engine": "local", "deepspeed": {}})
    run_training(cfg)
    export_bundle(root / "run" / "checkpoints", root / "bundle")
    return root / "run"


def _refused(capsys, entry: str, argv: list[str], watch: Path, *fragments: str, status: int = 2) -> str:
    """``entry`` exits ``status`` with one ``error:`` line holding ``fragments``, no traceback, and nothing under
    ``watch`` written or changed; returns standard error."""
    before, hashes = snapshot(watch), content_hashes(watch)
    capsys.readouterr()
    code = run_main(entry, argv)
    err = capsys.readouterr().err
    assert code == status, f"exit status {code}\n{err}"
    assert "Traceback" not in err and len([line for line in err.splitlines() if "error: " in line]) == 1, err
    for fragment in fragments:
        assert fragment in err, f"{fragment!r} not in:\n{err}"
    assert snapshot(watch) == before and content_hashes(watch) == hashes, f"{argv} changed files under {watch}"
    return err


# ------------------------------------------------------------------------------ conversion


def test_an_overwritten_output_is_swapped_whole_and_nothing_stays_beside_it(tmp_path, monkeypatch):
    afile = tmp_path / "afile"
    afile.write_text("mine")
    with consolidate.atomic_directory(afile, overwrite=True) as tmp:
        (tmp / "new.txt").write_text("new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"] and (afile / "new.txt").is_file()

    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    real = os.replace

    def replace(src, dst) -> None:  # noqa: ANN001 - the new output cannot be renamed into place
        if Path(src).name.startswith(".out.tmp-"):
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(src))
        real(src, dst)

    monkeypatch.setattr(consolidate.os, "replace", replace)
    with pytest.raises(OSError), consolidate.atomic_directory(out, overwrite=True) as tmp:
        (tmp / "new.txt").write_text("new")
    monkeypatch.undo()
    assert sorted(p.name for p in out.iterdir()) == ["old.txt"] and (out / "old.txt").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "out"]  # no .tmp, no .old


def test_reshard_into_a_file_and_export_anemoi_into_a_folder_fail_before_any_work(run, tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("mine")
    checkpoints = str(run / "checkpoints")
    for extra in ([], ["--overwrite"]):
        err = _refused(capsys, "convert_checkpoint", ["reshard", checkpoints, "--gpus-per-model", "1", "--out",
                                                       str(afile), *extra], tmp_path,
                       f"--out {afile} is a file, not a checkpoints directory", "choose a directory")
        assert "checkpoint: read" not in err, err
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    err = _refused(capsys, "convert_checkpoint", ["export-anemoi", str(run.parent / "bundle"), "--out", str(folder),
                                                  "--overwrite"], tmp_path,
                   f"--out {folder} is a directory: export-anemoi writes one anemoi checkpoint file",
                   f"e.g. {folder / 'model.ckpt'}")
    assert "export-anemoi:" not in err, err


def test_a_failed_reshard_with_overwrite_leaves_the_checkpoints_it_would_replace(run, tmp_path, capsys, monkeypatch):
    import stormshard.checkpoint.reshard as reshard

    out = shutil.copytree(run / "checkpoints", tmp_path / "checkpoints")
    (out / "resume_config.json").write_text("{}")
    real = os.replace

    def replace(src, dst) -> None:  # noqa: ANN001 - the last file of the reshard cannot be written
        if Path(src).name == "resume_config.json.part":
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(src))
        real(src, dst)

    monkeypatch.setattr(reshard.os, "replace", replace)
    _refused(capsys, "convert_checkpoint", ["reshard", str(run / "checkpoints" / "step_00000002"), "--gpus-per-model",
                                            "1", "--out", str(out), "--overwrite"], tmp_path,
             "Input/output error", status=1)  # its step_00000002, latest and resume_config.json as they were


def test_a_full_disk_copying_into_the_output_names_the_output_not_the_source(run, tmp_path, capsys, monkeypatch):
    import stormshard.checkpoint.export as export

    def copyfile(src, dst) -> None:  # noqa: ANN001 - as shutil's sendfile copy reports it: both names
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(src), None, str(dst))

    monkeypatch.setattr(export.shutil, "copyfile", copyfile)
    out = tmp_path / "bundle"
    err = _refused(capsys, "convert_checkpoint", ["export", str(run / "checkpoints"), "--out", str(out)], tmp_path,
                   f"error: the disk is full (No space left on device) writing {out}: free space there", status=1)
    assert str(run) not in next(line for line in err.splitlines() if "error: " in line), err  # not the source's


def test_a_full_disk_saving_the_graph_names_the_graph_file(run, tmp_path, monkeypatch):
    from stormshard.graphs import builder

    graph = builder.load_graph(run / "graph.pt")

    def torch_save(*_args, **_kwargs) -> None:
        raise RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed")

    monkeypatch.setattr(builder.torch, "save", torch_save)
    with pytest.raises(OSError) as caught:
        builder.save_graph(graph, tmp_path / "graph.pt")
    assert caught.value.errno == errno.ENOSPC and caught.value.filename == str(tmp_path / "graph.pt")
    assert list(tmp_path.iterdir()) == []  # no temporary file left


def test_inspect_names_a_damaged_bundle_metadata(run, tmp_path, capsys):
    bundle = shutil.copytree(run.parent / "bundle", tmp_path / "bundle")
    (bundle / "metadata.json").write_text('{"format": "stormshard-bundle", "model": ')
    _refused(capsys, "convert_checkpoint", ["inspect", str(bundle)], tmp_path,
             f"{bundle / 'metadata.json'} cannot be read", "is damaged")


@pytest.mark.parametrize("what", ["training", "bundle", "consolidated"])
def test_inspect_verify_checks_every_file_against_its_checksum(run, tmp_path, capsys, what):
    """``inspect --verify``: a copy whose files match prints the verified count; one byte changed in the weights (the
    same size: only the sha256 tells) or a truncated file is one error naming it, and nothing is printed before."""
    from launch.convert_checkpoint import main as convert_main

    if what == "training":
        source = shutil.copytree(run / "checkpoints" / "step_00000002", tmp_path / "step_00000002")
        victim = next(source.glob("rank_*.safetensors"))
    elif what == "bundle":
        source = shutil.copytree(run.parent / "bundle", tmp_path / "bundle")
        victim = source / "model.safetensors"
    else:
        source = tmp_path / "consolidated"
        assert convert_main(["consolidate", str(run / "checkpoints"), "--out", str(source)]) == 0
        victim = source / "model.safetensors"
    capsys.readouterr()
    assert convert_main(["inspect", str(source), "--verify", "--brief"]) == 0
    assert "verified: " in capsys.readouterr().out
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    out = _refused(capsys, "convert_checkpoint", ["inspect", str(source), "--verify"], tmp_path,
                   f"{victim}: its contents differ from the sha256 recorded", "damaged")
    assert "verified" not in out
    victim.write_bytes(bytes(data[:100]))
    _refused(capsys, "convert_checkpoint", ["inspect", str(source), "--verify"], tmp_path,
             f"{victim}: 100 bytes", "truncated")


def test_inspect_verify_of_a_bundle_without_checksums_says_so(run, tmp_path, capsys):
    bundle = shutil.copytree(run.parent / "bundle", tmp_path / "bundle")
    meta = json.loads((bundle / "metadata.json").read_text())
    del meta["files"]
    (bundle / "metadata.json").write_text(json.dumps(meta))
    _refused(capsys, "convert_checkpoint", ["inspect", str(bundle), "--verify"], tmp_path,
             "no checksums were recorded", "write it again")


# ------------------------------------------------------------------------------ forecasts


def test_a_forecast_never_writes_into_its_model(run, dataset, capsys):
    bundle, step = run.parent / "bundle", run / "checkpoints" / "step_00000002"
    for model, out in ((bundle, bundle), (bundle, bundle / "fc"), (run / "checkpoints", step / "fc")):
        _refused(capsys, "forecast", ["--model", str(model), "--dataset", dataset, *FORECAST, "--out", str(out),
                                      "--overwrite"], run.parent, f"--out {out} is ", f"model {model}",
                 "never writes into the bundle or checkpoint it reads")


def test_a_failed_forecast_with_overwrite_keeps_the_previous_one(run, dataset, tmp_path, capsys, monkeypatch):
    from stormshard.inference.outputs import ForecastStore

    out = tmp_path / "fc"
    args = ["--model", str(run.parent / "bundle"), "--dataset", dataset, *FORECAST, "--out", str(out)]
    assert run_main("forecast", args) == 0
    (out / "notes.txt").write_text("mine")

    def interrupted(*_args, **_kwargs) -> None:
        raise RuntimeError("interrupted")

    monkeypatch.setattr(ForecastStore, "write", interrupted)
    _refused(capsys, "forecast", [*args, "--overwrite"], tmp_path, "RuntimeError: interrupted", status=1)
    monkeypatch.undo()
    assert run_main("forecast", [*args, "--overwrite"]) == 0  # and a forecast that completes replaces it
    assert sorted(p.name for p in out.iterdir()) == ["climatology.npz", "forecast.zarr", "notes.txt", "plots",
                                                     "scores.json"]


def test_a_damaged_dataset_is_named_and_leaves_no_forecast(run, dataset, tmp_path, capsys):
    data = shutil.copytree(dataset, tmp_path / "data.zarr")
    args = ["--model", str(run.parent / "bundle"), "--dataset", str(data), *FORECAST, "--no-scores", "--out",
            str(tmp_path / "fc")]
    chunk = data / "data" / "44.0.0.0"  # 2020-01-12T00, an input of the forecast
    chunk.write_bytes(chunk.read_bytes()[:10])
    _refused(capsys, "forecast", args, tmp_path, f"DamagedStoreError: {data}: the array 'data' at dates",
             "cannot be read (RuntimeError: error during blosc decompression", "the store is damaged", status=1)
    latitudes = data / "latitudes" / "0"
    latitudes.write_bytes(latitudes.read_bytes()[:10])
    _refused(capsys, "forecast", args, tmp_path, f"error: {data}: the array 'latitudes' cannot be read",
             "the store is damaged")


# ------------------------------------------------------------------------------ training


def _train_args(dataset: str, out: Path, *overrides: str) -> list[str]:
    config = out.parent / f"{out.name}-config.json"
    config.write_text(json.dumps(tiny_config(dataset, out, **{"training.max_steps": 1, "data.validation_samples": 1,
                                                              "engine": "local", "deepspeed": {}})))
    return ["--config", str(config), *overrides]


def test_a_run_never_writes_into_what_it_reads(run, dataset, tmp_path, capsys):
    data = shutil.copytree(dataset, tmp_path / "data.zarr")
    step = run / "checkpoints" / "step_00000001"
    bundle = run.parent / "bundle"
    for out, extra, fragment in (
            (data, [], f"is data.path={str(data)!r}"), (data / "run", [], f"is inside data.path={str(data)!r}"),
            (bundle / "run", [f"training.init_weights={bundle}"], f"is inside training.init_weights={str(bundle)!r}"),
            (step / "run", [], f"is inside the checkpoint {step}: its run deletes it")):
        args = _train_args(str(data), tmp_path / "cfg", f"training.output_dir={out}", *extra)
        _refused(capsys, "train", args, run.parent, fragment, "set another training.output_dir")
        assert sorted(p.name for p in data.iterdir()) == sorted(p.name for p in Path(dataset).iterdir())


def test_no_room_for_the_first_checkpoint_leaves_no_graph_behind(dataset, tmp_path, capsys, monkeypatch):
    import stormshard.training.diskspace as diskspace

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(diskspace.shutil, "disk_usage", lambda path: usage(10**12, 10**12 - 1000, 1000))
    out = tmp_path / "run"
    args = _train_args(dataset, out)
    before = sorted(p.name for p in tmp_path.iterdir())
    capsys.readouterr()
    assert run_main("train", args) == 2
    err = capsys.readouterr().err
    assert "has 1000 B free but the checkpoint of step 1 needs" in err and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no run folder, no graph.pt


def test_a_config_json_that_cannot_be_written_leaves_no_temporary_file(dataset, tmp_path, monkeypatch):
    from stormshard.training import launch
    from stormshard.training.config import load_experiment_config

    config = load_experiment_config(tiny_config(dataset, tmp_path / "run"))
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text("{}")

    def full(src, dst) -> None:  # noqa: ANN001
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(launch.os, "replace", full)
    with pytest.raises(OSError):
        launch.save_resolved_config(config)
    monkeypatch.undo()
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["config.json"]
    assert (tmp_path / "run" / "config.json").read_text() == "{}"


# ------------------------------------------------------------------------------ python -m stormshard.data.synthetic


def test_the_synthetic_generator_fails_cleanly_and_never_loses_the_store(tmp_path, capsys, monkeypatch):
    import stormshard.data.synthetic as synthetic
    import stormshard.errors as errors

    out = tmp_path / "s.zarr"
    assert synthetic.main(["--grid", "o4", "--steps", "6", "--out", str(out)]) == 0
    files = {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    capsys.readouterr()

    def read_only(*_args, **_kwargs) -> str:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    with monkeypatch.context() as m:  # a read-only file system: refused before anything is created
        m.setattr(errors.tempfile, "mkdtemp", read_only)
        assert synthetic.main(["--grid", "o4", "--steps", "6", "--out", str(tmp_path / "new" / "s.zarr")]) == 2
    err = capsys.readouterr().err
    assert "--out=" in err and "is not writable" in err and "Traceback" not in err, err

    real = os.replace

    def swap_fails(src, dst) -> None:  # noqa: ANN001 - the new store cannot be renamed into place
        if str(src).endswith("new.zarr"):
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(src))
        real(src, dst)

    with monkeypatch.context() as m:
        m.setattr(synthetic.os, "replace", swap_fails)
        assert synthetic.main(["--grid", "o4", "--steps", "8", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert f"error: Input/output error (EIO) writing {out}" in err and "the store there is kept as it was" in err, err
    assert {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()} == files
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.zarr"]
