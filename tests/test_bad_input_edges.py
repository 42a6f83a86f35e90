"""The edges of bad input (issue 32): nothing lost, every check before the first file, clear messages.

- ``--resume`` continues what ``latest`` names or stops: a newest step without ``metadata.json``, a
  newest step that is a file, ``latest`` naming a missing step, an empty or zeroed ``latest``, a step
  without rank files, a step newer than ``latest`` names, a corrupted checksum record; each stops with
  one ``error:`` naming the damaged step and the checkpoint to continue from, and writes nothing (not
  even ``config.json``). Moving the damaged step aside is the explicit decision to go back.
- An empty value (an override or a file field) names the field; nothing lands in the current directory.
- Every ``STORMSHARD_*`` variable: ``nan``, ``inf``, negative, non-numeric, unknown keys: one error.
- Overrides: an error names the override that set the value; a key given twice is an error; ``true`` / ``false``
  for a number is an error (not 1 / 0).
- ``training.init_weights``: damaged, another architecture (an error unless
  ``training.init_weights_partial``), ``training.freeze`` of every parameter: before any file.
- ``forecast --attention-kernel flex`` on a graph-transformer model is an error.
- A forecast replaces no file it writes (climatology, maps, score plots) without ``--overwrite``.
- A full disk during conversion, import and forecasts: ``error: the disk is full`` naming the output, and
  no partial output (no ``.partial`` file of ``export-anemoi`` either).

Each refused case: exit status 2 (1 for a full disk), one ``error:`` line with the field and the value, no
traceback, and every file under the test's root the same before and after (sizes, times and sha256).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from stormshard.data.synthetic import generate_synthetic_dataset
from tests.bad_input_helpers import content_hashes, run_main, snapshot
from tests.test_cli_errors import _one_process  # noqa: F401 - autouse: a one-process environment
from tests.tiny_run import tiny_config

FIXTURES = Path(__file__).parent / "fixtures" / "anemoi"
pytestmark = pytest.mark.filterwarnings("ignore")
RUN_ARGS = ["engine=local", "deepspeed={}", "training.max_steps=3", "training.checkpoint_interval=1",
            "training.keep_checkpoints=3", "data.validation_samples=1"]


@dataclass(frozen=True)
class World:
    root: Path
    dataset: Path
    config: Path  # the tiny config (output_dir: root/unused)
    run: Path  # trained 3 steps, a checkpoint per step
    bundle: Path  # exported from run
    gt_bundle: Path  # imported from the anemoi graph-transformer fixture (keeps its anemoi file)
    o16: Path  # a dataset on the fixture's grid

    def fresh(self, name: str) -> Path:
        return self.root / "fresh" / name


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    from stormshard.checkpoint.anemoi_import import import_anemoi

    root = tmp_path_factory.mktemp("edges")
    dataset = root / "o8.zarr"
    generate_synthetic_dataset(dataset, grid="o8", steps=64, seed=1)
    config = root / "config.json"
    config.write_text(json.dumps(tiny_config(str(dataset), root / "unused"), indent=1))
    run = root / "run"
    assert run_main("train", ["--config", str(config), f"training.output_dir={run}", *RUN_ARGS]) == 0
    bundle = root / "bundle"
    assert run_main("convert_checkpoint", ["export", str(run / "checkpoints"), "--out", str(bundle)]) == 0
    gt_bundle = import_anemoi(FIXTURES / "gt" / "inference.ckpt", root / "gt_bundle")
    o16 = root / "o16.zarr"
    generate_synthetic_dataset(o16, grid="o16", steps=24, seed=3)
    (root / "fresh").mkdir()
    return World(root, dataset, config, run, bundle, gt_bundle, o16)


def _refused(world: World, entry: str, argv: list[str], capsys, *fragments: str, status: int = 2,
             watch: Path | None = None) -> str:
    """Run ``entry``; it exits ``status`` with one ``error:`` line holding ``fragments``, no traceback,
    and nothing under ``watch`` (default: the whole root) written or changed. Returns standard error."""
    watch = watch or world.root
    before, hashes = snapshot(watch), content_hashes(watch)
    capsys.readouterr()
    code = run_main(entry, argv)
    out, err = capsys.readouterr()
    assert code == status, f"exit status {code}\n{err}"
    assert "Traceback" not in out + err, err
    assert len([line for line in err.splitlines() if "error: " in line]) == 1, err
    for fragment in fragments:
        assert fragment in err, f"{fragment!r} not in:\n{err}"
    assert snapshot(watch) == before and content_hashes(watch) == hashes, f"{argv} changed files under {watch}"
    return err


def _train(world: World, *args: str, out: Path | None = None) -> list[str]:
    return ["--config", str(world.config), f"training.output_dir={out or world.fresh('x')}", *args]


# ------------------------------------------------------------------------------ --resume: nothing lost


def _step(ckpt: Path, n: int) -> Path:
    return ckpt / f"step_{n:08d}"


def _no_metadata(c: Path) -> None:
    (_step(c, 3) / "metadata.json").unlink()


def _step_is_a_file(c: Path) -> None:
    shutil.rmtree(_step(c, 3))
    _step(c, 3).write_text("not a checkpoint")


def _latest_names_a_missing_step(c: Path) -> None:
    shutil.rmtree(_step(c, 3))


def _latest_empty(c: Path) -> None:
    (c / "latest").write_text("")


def _latest_zeroed(c: Path) -> None:
    (c / "latest").write_bytes(b"\0" * 14)


def _no_rank_files(c: Path) -> None:
    for f in _step(c, 3).glob("rank_*"):
        f.unlink()


def _newer_than_latest(c: Path) -> None:
    (c / "latest").write_text("step_00000002\n")


def _moved_aside_below_a_newer_step(c: Path) -> None:
    (c / "latest").write_text("step_00000002\n")  # an interrupted save of step 3 left latest behind
    _step(c, 2).rename(c / "step_00000002.damaged")


def _checksum_record_corrupted(c: Path) -> None:
    meta_file = _step(c, 3) / "metadata.json"
    meta = json.loads(meta_file.read_text())
    meta["files"]["rank_00000.pt"]["sha256"] = "0" * 64  # the file is intact, its record is not
    meta_file.write_text(json.dumps(meta, indent=1))


DAMAGE = {  # how -> (damage, fragments of the message; {c} is the checkpoints directory)
    "missing-metadata": (_no_metadata, ["checkpoint {c}/step_00000003 is damaged", "metadata.json: missing",
                                        "previous complete checkpoint is {c}/step_00000002 (step 2)"]),
    "newest-step-a-file": (_step_is_a_file, ["step_00000003: a file, not a checkpoint directory",
                                             "previous complete checkpoint is {c}/step_00000002"]),
    "latest-names-missing-step": (_latest_names_a_missing_step, [
        "{c}/latest", "names step_00000003, but {c}/step_00000003 does not exist",
        "echo step_00000002 > {c}/latest"]),
    "latest-empty": (_latest_empty, ["{c}/latest", "is damaged: it is empty", "echo step_00000003 > {c}/latest"]),
    "latest-zeroed": (_latest_zeroed, ["{c}/latest", "not a step_NNNNNNNN name", "echo step_00000003"]),
    "no-rank-files": (_no_rank_files, ["checkpoint {c}/step_00000003 is damaged", "rank_00000.pt: missing",
                                       "previous complete checkpoint is {c}/step_00000002"]),
    "newer-than-latest": (_newer_than_latest, ["names step_00000002 but step_00000003 is newer",
                                               "echo step_00000003 > {c}/latest"]),
    "moved-aside-below-a-newer-step": (_moved_aside_below_a_newer_step, [
        "names step_00000002, which was moved aside", "holds newer steps (step_00000003)",
        "echo step_00000003 > {c}/latest"]),
    "checksum-record-corrupted": (_checksum_record_corrupted, [
        "rank_00000.pt: its contents differ from the sha256 recorded", "step_00000002 (step 2)"]),
}


@pytest.mark.parametrize("how", list(DAMAGE))
def test_resume_continues_what_latest_names_or_stops(world, how, capsys):
    damage, fragments = DAMAGE[how]
    run = world.fresh(f"resume-{how}")
    shutil.copytree(world.run, run)
    damage(run / "checkpoints")
    c = run / "checkpoints"
    _refused(world, "train", ["--config", str(run / "config.json"), f"training.output_dir={run}", "--resume"], capsys,
             *[f.format(c=c) for f in fragments], watch=run)


def test_moving_the_damaged_step_aside_resumes_from_the_previous_one(world, capsys):
    run = world.fresh("moved-aside")
    shutil.copytree(world.run, run)
    c = run / "checkpoints"
    _step(c, 3).rename(c / "step_00000003.damaged")  # the user's decision, as the error advises
    capsys.readouterr()
    assert run_main("train", ["--config", str(run / "config.json"), f"training.output_dir={run}", "--resume"]) == 0
    err = capsys.readouterr().err
    assert "was moved aside (step_00000003.damaged): continuing from step_00000002" in err, err
    assert "resumed from step 2" in err and (c / "latest").read_text().strip() == "step_00000003"
    assert (c / "step_00000003.damaged").is_dir()  # kept as the user left it


# ------------------------------------------------------------------------------ empty values, overrides


def test_an_empty_value_names_the_field_and_never_means_here(world, tmp_path, capsys, monkeypatch):
    here = tmp_path / "cwd"
    here.mkdir()
    monkeypatch.chdir(here)
    for item, field in (("training.output_dir=", "training.output_dir"), ("training.init_weights=",
                                                                         "training.init_weights"),
                        ("data.path= ", "data.path"), ('data.forcing=[""]', "data.forcing[0]")):
        args = ["--config", str(world.config), item] if "output_dir" in item else _train(world, item)
        _refused(world, "train", args, capsys, f"override {item!r}: {field} is empty", "leave the key out")
        assert not any(here.iterdir())
    in_file = json.loads(world.config.read_text())
    in_file["data"]["graph_cache"] = ""
    (tmp_path / "empty.json").write_text(json.dumps(in_file))
    _refused(world, "train", ["--config", str(tmp_path / "empty.json")], capsys,
             f"{tmp_path / 'empty.json'}: data.graph_cache is empty")
    _refused(world, "forecast", ["--model", str(world.bundle), "--dataset", str(world.dataset), "--date",
                                 "2020-01-12T00", "--out", ""], capsys, "--out is empty")


def test_an_override_error_names_the_override_and_a_key_twice_is_an_error(world, capsys):
    err = _refused(world, "train", _train(world, "training.max_steps=abc"), capsys,
                   "override 'training.max_steps=abc': training.max_steps = \"abc\"")
    assert str(world.config) not in err  # the file holds another value: it is not the source
    _refused(world, "train", _train(world, "training.warmup_steps=50"), capsys,
             "override 'training.warmup_steps=50': training.warmup_steps=50 exceeds training.max_steps=3")
    _refused(world, "train", _train(world, "training.lr=1e-3", "training.lr=2e-3"), capsys,
             "overrides 'training.lr=1e-3' and 'training.lr=2e-3' both set training.lr")
    _refused(world, "train", _train(world, "optimizer.eps=1e-8", 'optimizer={"eps": 1e-6}'), capsys,
             "overrides 'optimizer.eps=1e-8' and 'optimizer={\"eps\": 1e-6}' both set optimizer (one holds the other)")


# ------------------------------------------------------------------------------ environment variables


ENV_CASES = [(name, value, fragment) for name in ("STORMSHARD_DIST_TIMEOUT", "STORMSHARD_RENDEZVOUS_TIMEOUT",
                                                  "STORMSHARD_HEARTBEAT_S", "STORMSHARD_DEAD_AFTER_S")
             for value, fragment in (("nan", "is not a finite number"), ("inf", "is not a finite number"),
                                     ("-1", "-1"), ("soon", "is not a number"),
                                     ("1e300", "above the largest value"))] + [
    ("STORMSHARD_MALLOC_TUNING", "yes", "is not one of ['0', '1']"),
    ("STORMSHARD_FLEX_KERNEL_OPTIONS", '{"BLOCK_Q": 64}', "unknown key(s) 'BLOCK_Q'"),
    ("STORMSHARD_FLEX_KERNEL_OPTIONS", "[1, 2]", "must be a JSON object"),
    ("STORMSHARD_FLEX_KERNEL_OPTIONS", "{BLOCK_M: 64", "is not a JSON object"),
    ("STORMSHARD_COMPILE_BACKEND", "inductr", "did you mean 'inductor'?"),
]


@pytest.mark.parametrize("name, value, fragment", ENV_CASES, ids=[f"{n[11:]}={v}" for n, v, _ in ENV_CASES])
def test_every_stormshard_variable_is_checked_before_any_work(world, name, value, fragment, capsys, monkeypatch):
    monkeypatch.setenv(name, value)
    extra = ["training.compile=true"] if name == "STORMSHARD_COMPILE_BACKEND" else []
    _refused(world, "train", _train(world, *extra), capsys, f"{name}={value!r}", fragment)


def test_a_forecast_reads_the_variables_before_any_work(world, capsys, monkeypatch):
    monkeypatch.setenv("STORMSHARD_FLEX_KERNEL_OPTIONS", '{"BLOCK_M": 64, "num_wraps": 4}')
    _refused(world, "forecast", ["--model", str(world.bundle), "--dataset", str(world.dataset), "--date",
                                 "2020-01-12T00", "--steps", "2", "--out", str(world.fresh("fc-env"))], capsys,
             "STORMSHARD_FLEX_KERNEL_OPTIONS=", "'num_wraps' (did you mean 'num_warps'?)")


# ------------------------------------------------------------------------------ init_weights, freeze


def test_init_weights_damaged_partial_or_frozen_stops_before_any_file(world, capsys):
    bundle = world.fresh("bundle-truncated")
    shutil.copytree(world.bundle, bundle)
    weights = bundle / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:2000])
    _refused(world, "train", _train(world, f"training.init_weights={bundle}"), capsys,
             f"training.init_weights={str(bundle)!r} cannot be read", "damaged")
    ckpt = world.fresh("ckpt-zeroed")
    shutil.copytree(world.run / "checkpoints", ckpt)
    rank = _step(ckpt, 3) / "rank_00000.pt"
    rank.write_bytes(b"\0" * rank.stat().st_size)
    _refused(world, "train", _train(world, f"training.init_weights={ckpt}"), capsys,
             f"training.init_weights={str(ckpt)!r} cannot be read", "rank_00000.pt")
    _refused(world, "train", _train(world, f"training.init_weights={world.bundle}", "model.processor.num_layers=3"),
             capsys, "matches 74 of the model's 86 parameters", "processor.processor.blocks.2.", "(not in the file)",
             "training.init_weights_partial=true")
    # a graph transformer of another grid: its node embeddings (O16 data, ico2 hidden) do not match this O8 run's
    _refused(world, "train", _train(world, f"training.init_weights={world.gt_bundle}"), capsys,
             "matches 40 of the model's 74 parameters", "another architecture")
    from safetensors.torch import load_file, save_file

    foreign = world.fresh("bundle-foreign")
    shutil.copytree(world.bundle, foreign)
    save_file({f"other.{k}": v for k, v in load_file(str(foreign / "model.safetensors")).items()},
              str(foreign / "model.safetensors"))
    _refused(world, "train", _train(world, f"training.init_weights={foreign}", "training.init_weights_partial=true"),
             capsys, "matches 0 of the model's 74 parameters", "it holds another model")
    from safetensors import safe_open

    with safe_open(str(world.bundle / "model.safetensors"), "pt") as f:
        tops = sorted({k.split(".")[0] for k in f.keys()})
    _refused(world, "train", _train(world, f"training.freeze={json.dumps(tops)}"), capsys,
             "training.freeze=", "freezes all 74 parameters of the model: nothing would train")


def test_partial_init_weights_train_when_allowed_with_a_warning(world, capsys):
    out = world.fresh("partial")
    assert run_main("train", _train(world, f"training.init_weights={world.bundle}", "model.processor.num_layers=3",
                                    "training.init_weights_partial=true", *RUN_ARGS[:2], "training.max_steps=1",
                                    "data.validation_samples=1", out=out)) == 0
    err = capsys.readouterr().err
    assert "warning: training.init_weights=" in err and "matches 74 of the model's 86 parameters" in err, err
    assert "12 start fresh: processor.processor.blocks.2." in err, err


# ------------------------------------------------------------------------------ forecasts


def test_forecast_flex_on_a_graph_transformer_is_an_error(world, capsys):
    _refused(world, "forecast", ["--model", str(world.gt_bundle), "--dataset", str(world.o16), "--date",
                                 "2020-01-05T00", "--steps", "1", "--attention-kernel", "flex", "--out",
                                 str(world.fresh("gt-forecast"))], capsys,
             "--attention-kernel 'flex'", "model.name='graphtransformer'", "has a graph processor")


# ------------------------------------------------------------------------------ a full disk: no partial output


def _disk_full(*_args, **_kwargs) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_in_convert_import_and_forecast_names_the_path_and_leaves_nothing(world, capsys, monkeypatch):
    import stormshard.checkpoint.anemoi_import as anemoi_import
    import stormshard.checkpoint.consolidate as consolidate
    from stormshard.inference.outputs import ForecastStore

    with monkeypatch.context() as m:
        m.setattr(consolidate, "save_safetensors", _disk_full)
        out = world.fresh("full") / "consolidated"
        _refused(world, "convert_checkpoint", ["consolidate", str(world.run / "checkpoints"), "--out", str(out)],
                 capsys, "error: the disk is full", str(out), status=1)
        m.setattr(anemoi_import, "save_safetensors", _disk_full)
        out = world.fresh("imported")
        _refused(world, "convert_checkpoint", ["import-anemoi", str(FIXTURES / "gt" / "inference.ckpt"), "--out",
                                               str(out)], capsys, "error: the disk is full", str(out), status=1)
    with monkeypatch.context() as m:
        m.setattr(ForecastStore, "write", _disk_full)
        out = world.fresh("forecast") / "fc"
        args = ["--model", str(world.bundle), "--dataset", str(world.dataset), "--date", "2020-01-12T00", "--steps",
                "2"]
        _refused(world, "forecast", [*args, "--out", str(out)], capsys, "error: the disk is full", str(out), status=1)
        kept = world.fresh("forecast-into") / "notes.txt"  # an existing --out keeps what was there
        kept.parent.mkdir()
        kept.write_text("mine")
        _refused(world, "forecast", [*args, "--out", str(kept.parent)], capsys, "the disk is full", status=1)
    kept.parent.joinpath("notes.txt").unlink()
    kept.parent.rmdir()


def test_a_failed_export_anemoi_leaves_no_partial_file(world, capsys, monkeypatch):
    import zipfile

    calls = []
    real = zipfile.ZipFile.writestr

    def fails_later(self, *args, **kwargs):  # noqa: ANN001, ANN202 - the zip's signature
        calls.append(1)
        if len(calls) > 3:  # some bytes of the .partial file are written: then the disk fills up
            _disk_full()
        return real(self, *args, **kwargs)

    monkeypatch.setattr(zipfile.ZipFile, "writestr", fails_later)
    out = world.fresh("exported") / "model.ckpt"
    _refused(world, "convert_checkpoint", ["export-anemoi", str(world.gt_bundle), "--out", str(out)], capsys,
             "error: the disk is full", str(out), status=1)
    assert len(calls) > 3 and not out.with_name("model.ckpt.partial").exists()


# ------------------------------------------------------------------------------ graph kernels


def _without_interpreter(entry: str, argv: list[str], world: World) -> tuple[int, str]:
    """``launch/<entry>.py argv`` in a fresh process without TRITON_INTERPRET (as a user's CPU has it)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "RANK", "WORLD_SIZE")}
    root = Path(__file__).resolve().parents[1]
    before, hashes = snapshot(world.root), content_hashes(world.root)
    proc = subprocess.run([sys.executable, str(root / "launch" / f"{entry}.py"), *argv], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    assert snapshot(world.root) == before and content_hashes(world.root) == hashes, f"{argv} changed files"
    assert "Traceback" not in proc.stderr and proc.stderr.count("error: ") == 1, proc.stderr
    return proc.returncode, proc.stderr


def test_a_graph_kernel_that_cannot_run_is_one_error_before_any_work(world):
    code, err = _without_interpreter("train", _train(world, "model.graph_kernel=triton"), world)
    assert code == 2 and "model.graph_kernel='triton' cannot run here (cpu)" in err and "TRITON_INTERPRET=1" in err, err
    code, err = _without_interpreter("forecast", ["--model", str(world.gt_bundle), "--dataset", str(world.o16),
                                                  "--date", "2020-01-05T00", "--steps", "1", "--graph-kernel",
                                                  "triton", "--out", str(world.fresh("gt-triton"))], world)
    assert code == 2 and "--graph-kernel='triton' cannot run here (cpu)" in err and "'csr'" in err, err


def test_torch_save_failing_on_a_full_disk_is_named_as_a_full_disk(world, capsys, monkeypatch):
    """``torch.save`` loses the errno (a RuntimeError from its zip writer): still "the disk is full", the output
    named, nothing left behind (here ``reshard``, whose rank files are torch.save'd state)."""
    import stormshard.checkpoint.state_codec as state_codec

    def failing_save(*_args, **_kwargs) -> None:
        raise RuntimeError("[enforce fail at inline_container.cc:778] . PytorchStreamWriter failed writing file "
                           "data/0: file write failed")

    monkeypatch.setattr(state_codec.torch, "save", failing_save)
    out = world.fresh("resharded") / "r"
    _refused(world, "convert_checkpoint", ["reshard", str(world.run / "checkpoints"), "--gpus-per-model", "1",
                                           "--out", str(out)], capsys, "error: the disk is full", str(out), status=1)


def test_a_failed_reshard_into_an_existing_out_leaves_what_was_there_and_nothing_new(world, capsys, monkeypatch):
    import stormshard.checkpoint.state_codec as state_codec

    def failing_save(*_args, **_kwargs) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    out = world.fresh("reshard-into")
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    monkeypatch.setattr(state_codec.torch, "save", failing_save)
    _refused(world, "convert_checkpoint", ["reshard", str(world.run / "checkpoints"), "--gpus-per-model", "1",
                                           "--out", str(out)], capsys, "error: the disk is full", status=1)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    (out / "notes.txt").unlink()
    out.rmdir()


def test_the_graph_kernel_may_change_on_resume(world, capsys):
    """How the same model computes (csr here, Triton on a GPU) is not what it computes: allowed on --resume."""
    run = world.fresh("resume-kernel")
    shutil.copytree(world.run, run)
    capsys.readouterr()
    assert run_main("train", ["--config", str(run / "config.json"), f"training.output_dir={run}", "--resume",
                              "model.graph_kernel=csr", "training.max_steps=4"]) == 0
    err = capsys.readouterr().err
    assert "resume: model.graph_kernel: stored 'auto', now 'csr' (allowed on --resume)" in err, err


# ------------------------------------------------------------------------------ outputs: before any work, never an input


def test_an_existing_out_is_refused_before_the_source_is_read(world, capsys):
    """consolidate, export and import-anemoi name an existing ``--out`` (without ``--overwrite``) before they
    read their source, not after consolidating it."""
    for argv in (["consolidate", str(world.run / "checkpoints"), "--out", str(world.bundle)],
                 ["export", str(world.run / "checkpoints"), "--out", str(world.bundle)],
                 ["import-anemoi", str(FIXTURES / "gt" / "inference.ckpt"), "--out", str(world.bundle)]):
        err = _refused(world, "convert_checkpoint", argv, capsys, f"--out {world.bundle} exists already",
                       "--overwrite")
        assert "checkpoint: read" not in err and "import-anemoi:" not in err, err


def test_reshard_never_repoints_the_latest_of_a_run_in_out(world, capsys):
    """An ``--out`` holding another run's checkpoints (``latest`` naming step 3): resharding step 2 there
    would repoint its ``latest`` to step 2 and replace its ``resume_config.json``; refused unless ``--overwrite``."""
    out = world.fresh("other-run") / "checkpoints"
    shutil.copytree(world.run / "checkpoints", out)
    shutil.rmtree(_step(out, 2))
    (out / "resume_config.json").write_text("{}")
    err = _refused(world, "convert_checkpoint", ["reshard", str(_step(world.run / "checkpoints", 2)),
                                                 "--gpus-per-model", "1", "--out", str(out)], capsys,
                   f"--out {out} already holds latest, resume_config.json, step_00000001", "--overwrite")
    assert "checkpoint: read" not in err, err
    assert (out / "latest").read_text().strip() == "step_00000003"


def test_a_graph_cache_that_is_not_a_graph_file_is_never_overwritten(world, capsys):
    """``data.graph_cache`` naming someone's file (the run would replace it with its graph), or a directory
    (the save would fail after the graph build, naming a temporary file), and an output directory whose
    ``checkpoints`` is a file (the first save would fail after training): each an error before any work."""
    notes = world.fresh("notes.txt")
    notes.write_text("mine")
    _refused(world, "train", _train(world, f"data.graph_cache={notes}"), capsys,
             f"data.graph_cache={str(notes)!r}", "is not a stormshard graph file", "choose another data.graph_cache")
    assert notes.read_text() == "mine"
    folder = world.fresh("graph-folder")
    folder.mkdir()
    _refused(world, "train", _train(world, f"data.graph_cache={folder}"), capsys,
             f"data.graph_cache={str(folder)!r} is a directory", "name a file")
    out = world.fresh("checkpoints-a-file")
    out.mkdir()
    (out / "checkpoints").write_text("mine")
    _refused(world, "train", _train(world, out=out), capsys, f"holds {out / 'checkpoints'}, a file",
             "set another training.output_dir")
    from stormshard.graphs.builder import is_graph_file

    assert is_graph_file(world.bundle / "graph.pt") and not is_graph_file(notes)  # a graph cache is rebuilt over


def test_a_forecast_never_writes_into_its_dataset(world, capsys):
    """A dataset at ``OUT/forecast.zarr`` (a forecast store is an anemoi dataset too): forecasting from it into
    ``OUT`` with ``--overwrite`` would re-create the store it reads (the dataset lost, the forecast made from
    fill values); an ``--out`` inside the dataset would write into its store. Both refused before any work."""
    folder = world.fresh("chained")
    store = folder / "forecast.zarr"
    shutil.copytree(world.dataset, store)
    args = ["--model", str(world.bundle), "--date", "2020-01-12T00", "--steps", "2", "--no-scores"]
    _refused(world, "forecast", [*args, "--dataset", str(store), "--out", str(folder), "--overwrite"], capsys,
             f"would re-create {store}", f"the dataset {store} the forecast reads")
    _refused(world, "forecast", [*args, "--dataset", str(world.dataset), "--out", str(world.dataset / "fc")], capsys,
             f"--out {world.dataset / 'fc'} is inside the dataset {world.dataset}", "choose an --out outside it")
    shutil.rmtree(folder)


def test_export_anemoi_never_replaces_the_anemoi_checkpoint_it_writes_into(world, capsys):
    """A bundle fine-tuned from an anemoi checkpoint (``training.init_weights``) is written into that file:
    ``--out`` naming it, even with ``--overwrite``, would replace the original; refused."""
    bundle = world.fresh("finetuned-from-anemoi")
    shutil.copytree(world.gt_bundle, bundle)
    origin = world.fresh("origin.ckpt")
    (bundle / "anemoi_source.ckpt").rename(origin)
    meta = json.loads((bundle / "metadata.json").read_text())
    meta["anemoi"]["template"] = None
    meta["experiment"] = {**(meta.get("experiment") or {}), "training": {"init_weights": str(origin)}}
    (bundle / "metadata.json").write_text(json.dumps(meta))
    _refused(world, "convert_checkpoint", ["export-anemoi", str(bundle), "--out", str(origin), "--overwrite"],
             capsys, f"--out {origin} is the anemoi checkpoint {bundle} descends from", "choose another --out")


def test_a_forecast_never_replaces_an_output_file_without_overwrite(world, capsys):
    """An ``--out`` holding a file the forecast writes beside its store (``climatology.npz``, a map, a score plot)
    but no ``forecast.zarr`` or ``scores.json``: without ``--overwrite`` that file used to be replaced
    silently; refused before any work, naming the file."""
    args = ["--model", str(world.bundle), "--dataset", str(world.dataset), "--date", "2020-01-12T00", "--steps", "2"]
    for name, extra in (("climatology.npz", []), ("maps/tracer_1_step002.png", ["--no-scores", "--plot", "tracer_1"]),
                        ("plots/scores_tracer_1.png", [])):
        folder = world.fresh(f"keeps-{name.replace('/', '-')}")
        mine = folder / name
        mine.parent.mkdir(parents=True)
        mine.write_text("mine")
        _refused(world, "forecast", [*args, *extra, "--out", str(folder)], capsys, f"{mine} exists",
                 "the forecast would replace it", "--overwrite")
        assert mine.read_text() == "mine"
        shutil.rmtree(folder)


def test_a_boolean_where_a_number_is_expected_is_an_error(world, tmp_path, capsys):
    """``true`` / ``false`` for a number (an override or a file field) was read as 1 / 0 silently:
    ``training.checkpoint_interval=true`` saved every step, ``training.lr=true`` trained at 1.0. Each an error
    naming the override (or the file), the field and the value; real booleans and ``"auto"`` stay accepted."""
    _refused(world, "train", _train(world, "training.checkpoint_interval=true"), capsys,
             "override 'training.checkpoint_interval=true': training.checkpoint_interval = true is a boolean where "
             "a number is expected")
    _refused(world, "train", _train(world, "training.lr=true"), capsys, "override 'training.lr=true'")
    _refused(world, "train", _train(world, "graph.processor.num_neighbours=false"), capsys,
             "graph.processor.num_neighbours = false", "read as 0")
    in_file = json.loads(world.config.read_text())
    in_file["data"]["validation_samples"] = True
    (tmp_path / "bool.json").write_text(json.dumps(in_file))
    _refused(world, "train", ["--config", str(tmp_path / "bool.json"), f"training.output_dir={world.fresh('b')}"],
             capsys, f"{tmp_path / 'bool.json'}: data.validation_samples = true is a boolean")
    from stormshard.training.config import load_experiment_config

    config = load_experiment_config(world.config, cli_overrides=["training.compile=false", "logging.progress=true",
                                                                 "training.init_weights_partial=true"])
    assert config.training.compile is False and config.training.init_weights_partial is True


# ------------------------------------------------------------------------- a hostile state skeleton


@pytest.mark.parametrize("skeleton", [
    {"device": "warp-drive"},  # torch.device raised a RuntimeError
    {"npscalar": "<i4", "value": 10**20},  # numpy raised an OverflowError
    "[" * 100_000 + "]" * 100_000,  # json raised a RecursionError
    {"enum": "deepspeed.runtime.fp16.loss_scaler.LossScaler", "value": 3},  # called the scaler's constructor
], ids=["device", "npscalar-overflow", "deep-nesting", "enum-of-a-class"])
def test_a_hostile_state_skeleton_is_an_error_naming_the_file(tmp_path, skeleton):
    """A state file (``rank_NNNNN.pt``, ``optimizer.pt``, ``trainer.pt``) whose JSON skeleton was crafted: one
    :class:`CheckpointError` naming the file, never a raw exception from inside the decoder, and no class of
    ``STATE_CLASSES`` constructed through a node that is not its kind."""
    import torch

    from stormshard.checkpoint.format import CheckpointError
    from stormshard.checkpoint.state_codec import read_state_file

    path = tmp_path / "rank_00000.pt"
    text = skeleton if isinstance(skeleton, str) else json.dumps(skeleton)
    torch.save({"stormshard": "state", "format": 2, "skeleton": text, "tensors": {}}, path)
    with pytest.raises(CheckpointError, match=r"rank_00000\.pt: its state skeleton is malformed"):
        read_state_file(path)


def test_a_state_skeletons_dtype_is_looked_up_not_got_from_torch():
    """``{"dtype": name}`` names one of torch's dtypes: a name from the file is never ``getattr(torch, name)``,
    which imported ``torch._dynamo`` for ``"_dynamo"`` (any lazy submodule, any attribute)."""
    code = ("import json, sys\nfrom stormshard.checkpoint.state_codec import decode_state\n"
            "import torch\nassert decode_state(json.dumps({'dtype': 'bfloat16'}), {}) is torch.bfloat16\n"
            "try:\n    decode_state(json.dumps({'dtype': '_dynamo'}), {})\nexcept ValueError:\n    pass\n"
            "print(sorted(m for m in sys.modules if m.startswith('torch._dynamo')))\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent.parent, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout


def _bundle_metadata_without_variables(meta: Path) -> None:
    meta.write_text(json.dumps({k: v for k, v in json.loads(meta.read_text()).items() if k != "variables"}))


def _bundle_metadata_with_a_string_of_roles(meta: Path) -> None:
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "variables": {"dataset": "t2m", "forcing": [],
                                                                              "diagnostic": []}}))


def _bundle_metadata_not_utf8(meta: Path) -> None:
    meta.write_bytes(b'{"format": "stormshard-bundle", "model": "\xff\xfe"}')


@pytest.mark.parametrize(("damage", "fragment"), [
    (_bundle_metadata_without_variables, "variables: missing, expected a JSON object"),
    (_bundle_metadata_with_a_string_of_roles, "variables.dataset: 't2m', expected a list of variable names"),
    (_bundle_metadata_not_utf8, "can't decode byte 0xff"),
], ids=["no-variables", "roles-not-a-list", "not-utf8"])
def test_a_damaged_bundle_metadata_is_an_error_naming_it(world, capsys, damage, fragment):
    """A bundle whose ``metadata.json`` lacks a section loading reads, holds one of another type or is not UTF-8:
    ``forecast.py --model`` and ``stormshard.load_model`` name the file and what is wrong (status 2), instead of
    ``error: KeyError: 'variables'`` (status 1) or a decoding error that names no file."""
    from stormshard.checkpoint.errors import ConversionError
    from stormshard.checkpoint.export import load_model

    bundle = world.fresh(f"bundle_{damage.__name__}")
    shutil.copytree(world.bundle, bundle)
    damage(bundle / "metadata.json")
    argv = ["--model", str(bundle), "--dataset", str(world.dataset), "--date", "2020-01-12T00", "--steps", "1",
            "--no-scores", "--out", str(world.fresh("fc_damaged"))]
    _refused(world, "forecast", argv, capsys, str(bundle / "metadata.json"), fragment)
    with pytest.raises(ConversionError, match="metadata.json") as err:
        load_model(bundle)
    assert fragment in str(err.value)
    shutil.rmtree(bundle)


@pytest.mark.parametrize("damaged", ["model.safetensors", "statistics.json", "graph.pt"])
def test_a_damaged_bundle_file_is_an_error_naming_it(world, capsys, damaged):
    """A bundle whose weights, statistics or graph file is truncated: ``forecast.py --model`` and
    ``stormshard.load_model`` name that file (status 2), not the bundle folder alone."""
    from stormshard.checkpoint.errors import ConversionError
    from stormshard.checkpoint.export import load_model

    bundle = world.fresh(f"bundle_damaged_{damaged.replace('.', '_')}")
    shutil.copytree(world.bundle, bundle)
    target = bundle / damaged
    target.write_bytes(target.read_bytes()[:40])
    argv = ["--model", str(bundle), "--dataset", str(world.dataset), "--date", "2020-01-12T00", "--steps", "1",
            "--no-scores", "--out", str(world.fresh("fc_damaged_file"))]
    _refused(world, "forecast", argv, capsys, str(target), "cannot be read", "--verify")
    with pytest.raises(ConversionError, match=damaged.replace(".", r"\.")):
        load_model(bundle)
    shutil.rmtree(bundle)
