"""Opening a file never runs code it names, unless the user opts in (issue 32, security).

Every loader of a stored file is tried with a malicious one whose payload would create a marker file:

- a bundle or checkpoint whose stored config names its model builder as ``package.module:attribute``,
  shipping that module (its top level writes the marker) beside its weights, on a directory of
  ``sys.path`` as the README's layout puts bundles: ``forecast.py --model``, ``convert_checkpoint.py
  export`` / ``reshard``, ``train.py --config`` of a bundle's own config file, ``stormshard.load_model``;
- a checkpoint of the pickled format 1 whose pickle would run ``os.system``: ``convert_checkpoint.py
  upgrade``;
- an anemoi checkpoint whose pickle names ``os.system`` (and ``eval``, ``exec``, ``subprocess``, a
  private ``getattr``): ``import-anemoi``, and ``export-anemoi`` of a bundle that descends from one.

Each refusal runs the real entry point as a subprocess: exit status 2, exactly one ``error:`` line
naming the file, the module or global and the opt-in, no traceback, the marker absent and every file
under the test's root unchanged (hashed before and after). The opted-in paths still work, and an
error that recommends ``upgrade`` leads to a command that works as printed.
"""

from __future__ import annotations

import collections
import json
import logging.config
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.utils.collect_env as collect_env

from stormshard.checkpoint.anemoi_pickle import UnsafeAnemoiCheckpoint, open_anemoi_checkpoint
from stormshard.checkpoint.export import export_bundle, load_model
from stormshard.data.synthetic import generate_synthetic_dataset
from stormshard.models.trust import UntrustedModelCode, stored_beside
from tests.bad_input_helpers import cli, content_hashes
from tests.test_checkpoint import to_pickled_format
from tests.test_cli_errors import _one_process  # noqa: F401 - autouse: a one-process environment
from tests.tiny_run import tiny_config

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.filterwarnings("ignore")


@dataclass(frozen=True)
class World:
    """The files the tests open: a dataset, a trained run and its bundle, and the malicious copies under
    ``downloads`` (a folder on ``sys.path``); ``marker`` is the file every payload would create."""

    root: Path
    dataset: Path
    run: Path
    bundle: Path
    downloads: Path
    marker: Path


_EVIL_MODULE = """from pathlib import Path
Path({marker!r}).write_text("the module a stored file named ran")
from stormshard.models.registry import MODEL_REGISTRY
build = MODEL_REGISTRY["transformer"]  # a working builder, so that the opted-in path builds the model
"""


class _System:
    """Pickles as ``os.system(command)``: unpickling it without restriction runs the command."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple:
        return os.system, (self.command,)


def _evil_copy(world: World, src: Path, name: str) -> tuple[Path, str]:
    """``src`` (a bundle or a run) copied to ``downloads/name`` with ``evil_module.py`` beside it; the
    copy and the builder name ``name.evil_module:build`` that finds the module from ``downloads``."""
    dst = world.downloads / name
    shutil.copytree(src, dst)
    (dst / "evil_module.py").write_text(_EVIL_MODULE.format(marker=str(world.marker)))
    return dst, f"{name}.evil_module:build"


def _rename_model(metadata: Path, name: str, *sections: str) -> None:
    meta = json.loads(metadata.read_text())
    for section in sections:
        node = meta
        for key in section.split("."):
            node = node[key]
        node["name"] = name
    metadata.write_text(json.dumps(meta, indent=1))


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    root = tmp_path_factory.mktemp("untrusted")
    dataset = root / "o8.zarr"
    generate_synthetic_dataset(dataset, grid="o8", steps=64, seed=1)
    cfg = tiny_config(str(dataset), root / "run", engine="local", deepspeed={}, **{
        "training.max_steps": 2, "training.checkpoint_interval": 1, "data.validation_samples": 1})
    config = root / "config.json"
    config.write_text(json.dumps(cfg))
    assert cli("train").main(["--config", str(config)]) == 0
    w = World(root, dataset, root / "run", export_bundle(root / "run" / "checkpoints", root / "bundle"),
              root / "downloads", root / "PWNED")
    # a downloaded bundle: its metadata names the module it ships, and so does its own config file
    bundle, name = _evil_copy(w, w.bundle, "evil_bundle")
    _rename_model(bundle / "metadata.json", name, "model", "experiment.model")
    (bundle / "finetune_config.json").write_text(json.dumps({**cfg, "model": {**cfg["model"], "name": name},
                                                             "training": {**cfg["training"],
                                                                          "output_dir": str(root / "ft")}}))
    # a downloaded run: its checkpoints' stored config names the module it ships
    run, name = _evil_copy(w, w.run, "evil_run")
    for step in sorted((run / "checkpoints").glob("step_*")):
        _rename_model(step / "metadata.json", name, "config.model")
    # a run of the earlier release (pickled format 1), and one whose newer step's pickle runs a command
    for old in ("old", "old_evil"):
        shutil.copytree(w.run / "checkpoints", root / old / "checkpoints")
        for step in sorted((root / old / "checkpoints").glob("step_*")):
            to_pickled_format(step)
    rank = sorted((root / "old_evil" / "checkpoints").glob("step_*"))[-1] / "rank_00000.pt"
    payload = torch.load(rank, weights_only=False)  # written just above
    payload["state"]["hook"] = _System(f"touch {w.marker}")
    torch.save(payload, rank)
    # an anemoi checkpoint whose pickle runs a command, and a bundle that descends from it
    _anemoi_zip({"state_dict": {"w": torch.ones(2)}, "payload": _System(f"touch {w.marker}")}, root / "evil.ckpt")
    descendant = root / "downloads" / "anemoi_bundle"
    shutil.copytree(w.bundle, descendant)
    shutil.copyfile(root / "evil.ckpt", descendant / "anemoi_source.ckpt")
    meta = json.loads((descendant / "metadata.json").read_text())
    (descendant / "metadata.json").write_text(json.dumps({**meta, "anemoi": {"template": "anemoi_source.ckpt"}}))
    return w


def _anemoi_zip(obj: object, path: Path) -> Path:
    """``obj`` saved as a torch zip with an anemoi metadata entry (what import-anemoi looks for)."""
    import zipfile

    torch.save(obj, path)
    with zipfile.ZipFile(path, "a") as z:
        z.writestr(f"{z.namelist()[0].split('/')[0]}/anemoi-metadata/anemoi.json", '{"version": "2.0"}')
    return path


def _run(world: World, entry: str, *argv: str) -> subprocess.CompletedProcess:
    """``launch/<entry>.py argv`` in a fresh interpreter, with ``downloads`` on ``sys.path`` (the README keeps
    bundles under the repository root, which the launchers put there)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(world.downloads), env.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, str(ROOT / "launch" / f"{entry}.py"), *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def _refused(world: World, entry: str, argv: list[str], *fragments: str) -> str:
    """Run ``entry`` and check the refusal: status 2, one ``error:`` line holding ``fragments``, no
    traceback, no marker, nothing changed under the root. Returns standard error."""
    before = content_hashes(world.root)
    done = _run(world, entry, *argv)
    err = done.stderr
    assert done.returncode == 2, f"exit status {done.returncode}\n{err}"
    assert "Traceback" not in err + done.stdout, err
    assert len([line for line in err.splitlines() if line.startswith("error:")]) == 1, err
    for fragment in fragments:
        assert fragment in err, f"{fragment!r} not in:\n{err}"
    assert not world.marker.exists(), f"the payload ran:\n{err}"
    assert content_hashes(world.root) == before, "files under the root changed"
    return err


# ---------------------------------------------------------------------------------- model builders


def _builder_cases() -> list:
    opt_in = "--trust-model-code (Python: trust_model_code=True)"
    date = ["--dataset", "{dataset}", "--date", "2020-01-12T00", "--steps", "1", "--out", "{root}/fc"]
    return [
        pytest.param("forecast", ["--model", "{downloads}/evil_bundle", *date],
                     ["evil_bundle/metadata.json", "module 'evil_bundle.evil_module'", opt_in], id="forecast-bundle"),
        pytest.param("forecast", ["--model", "{downloads}/evil_run/checkpoints", *date],
                     ["step_00000002/metadata.json", "module 'evil_run.evil_module'", opt_in], id="forecast-checkpoint"),
        pytest.param("convert_checkpoint", ["export", "{downloads}/evil_run/checkpoints", "--out", "{root}/b"],
                     ["module 'evil_run.evil_module'", opt_in], id="export"),
        pytest.param("convert_checkpoint", ["reshard", "{downloads}/evil_run/checkpoints", "--gpus-per-model", "1",
                                            "--out", "{root}/k1"],
                     ["module 'evil_run.evil_module'", opt_in], id="reshard"),
        pytest.param("train", ["--config", "{downloads}/evil_bundle/finetune_config.json"],
                     ["--config", "evil_bundle/finetune_config.json (beside", "module 'evil_bundle.evil_module'",
                      opt_in], id="train-bundle-config"),
    ]


@pytest.mark.parametrize(("entry", "argv", "fragments"), _builder_cases())
def test_a_builder_module_named_by_a_stored_file_never_runs(world, entry, argv, fragments):
    paths = {"dataset": str(world.dataset), "root": str(world.root), "downloads": str(world.downloads)}
    _refused(world, entry, [a.format(**paths) for a in argv], *fragments)


def test_the_opt_in_imports_the_builder_and_forecasts(world):
    """``--trust-model-code``: the module runs (the marker appears) and the forecast is written."""
    out = world.root / "trusted_fc"
    try:
        done = _run(world, "forecast", "--model", str(world.downloads / "evil_bundle"), "--dataset",
                    str(world.dataset), "--date", "2020-01-12T00", "--steps", "1", "--out", str(out), "--no-scores",
                    "--trust-model-code")
        assert done.returncode == 0, done.stderr
        assert world.marker.exists() and (out / "forecast.zarr").is_dir()
    finally:
        world.marker.unlink(missing_ok=True)
        shutil.rmtree(out, ignore_errors=True)


def test_train_trusts_the_users_own_config_and_a_bundles_config_on_request(world, tmp_path):
    """A builder module named by the user's own --config is imported as before; a bundle's config file
    needs --trust-model-code. (A missing dataset stops both right after the builder is resolved.)"""
    cfg = json.loads((world.downloads / "evil_bundle" / "finetune_config.json").read_text())
    cfg["data"]["path"] = str(tmp_path / "missing.zarr")
    mine = tmp_path / "mine.json"
    mine.write_text(json.dumps(cfg))
    assert stored_beside(mine) is None
    assert stored_beside(world.downloads / "evil_bundle" / "finetune_config.json") is not None
    try:
        for argv in (["--config", str(mine)], ["--config", str(world.downloads / "evil_bundle" /
                                                                  "finetune_config.json"),
                                               f"data.path={tmp_path / 'missing.zarr'}", "--trust-model-code"]):
            done = _run(world, "train", *argv)
            assert done.returncode == 2 and "missing.zarr" in done.stderr, done.stderr
            assert world.marker.exists(), done.stderr
            world.marker.unlink()
    finally:
        world.marker.unlink(missing_ok=True)


@pytest.mark.parametrize("kind", ["foreign-metadata", "no-metadata", "run-config"])
def test_a_config_that_came_with_code_or_a_run_is_a_stored_file(world, tmp_path, kind):
    """The folder decides, not a marker its sender controls: a ``metadata.json`` of any content, a run's
    ``config.json`` (``metrics.jsonl`` beside it) or a builder module shipped in the config's own folder."""
    folder = world.downloads / f"evilcfg_{kind.replace('-', '_')}"
    name = f"{folder.name}.evil_module:build"
    folder.mkdir()
    (folder / "evil_module.py").write_text(_EVIL_MODULE.format(marker=str(world.marker)))
    cfg = json.loads((world.downloads / "evil_bundle" / "finetune_config.json").read_text())
    cfg["model"]["name"] = name
    cfg["training"]["output_dir"] = str(tmp_path / "out")
    config = folder / ("config.json" if kind == "run-config" else "finetune_config.json")
    config.write_text(json.dumps(cfg))
    if kind == "foreign-metadata":
        (folder / "metadata.json").write_text('{"format": "bundle-v2"}')
    if kind == "run-config":
        (folder / "metrics.jsonl").write_text("")
    try:
        _refused(world, "train", ["--config", str(config)], f"{config.name} (beside", f"module '{folder.name}",
                 "--trust-model-code")
    finally:
        shutil.rmtree(folder)
        world.marker.unlink(missing_ok=True)


def test_run_training_of_a_bundles_config_refuses_its_builder_module_unless_trusted(world):
    """``run_training(path)`` treats a config file beside a stormshard ``metadata.json`` as a stored file,
    as ``launch/train.py`` does: nothing imported without ``trust_model_code=True``."""
    from stormshard.training.launch import run_training

    stored = world.downloads / "evil_bundle" / "finetune_config.json"
    with pytest.raises(UntrustedModelCode, match=r"finetune_config.json \(beside .*trust_model_code=True"):
        run_training(stored)
    assert not world.marker.exists()


def test_load_model_refuses_a_builder_module_unless_trusted(world, monkeypatch):
    """``stormshard.load_model``: a bad-input error naming the module and the opt-in, nothing imported;
    with ``trust_model_code=True`` the model loads and predicts as the bundle it was copied from."""
    import stormshard

    monkeypatch.syspath_prepend(str(world.downloads))
    evil = world.downloads / "evil_bundle"
    try:
        with pytest.raises(UntrustedModelCode, match=r"model.name='evil_bundle.evil_module:build'.*"
                                                     r"trust_model_code=True") as err:
            stormshard.load_model(evil)
        assert isinstance(err.value, ValueError)  # bad input: exit status 2 from the entry points
        assert "evil_bundle.evil_module" not in sys.modules and not world.marker.exists()
        trusted = stormshard.load_model(evil, trust_model_code=True)
        assert world.marker.exists()
        reference = load_model(world.bundle)
        x = torch.randn(1, 2, reference.graph["data"].num_nodes, len(reference.variables.input_names))
        assert torch.equal(trusted.predict(x), reference.predict(x))
    finally:
        world.marker.unlink(missing_ok=True)
        for name in [m for m in sys.modules if m.startswith("evil_bundle")]:
            del sys.modules[name]


def test_validating_a_stored_config_imports_nothing(world):
    """The model config checks the builder name's form only, without the registry (no import cycle):
    validating a stored config (its model section, the whole experiment as ``--resume`` compares it)
    imports nothing it names."""
    meta = json.loads((world.downloads / "evil_bundle" / "metadata.json").read_text())
    code = ("import json, sys\n"
            "from stormshard.models.config import ModelConfig\n"
            "from stormshard.training.config import stored_config_dump\n"
            f"meta = json.loads({json.dumps(json.dumps(meta))})\n"
            "ModelConfig(**meta['model']); stored_config_dump(meta['experiment'])\n"
            "print(sorted(m for m in sys.modules if m.startswith(('evil', 'stormshard.models.registry'))))\n"
            "from stormshard.checkpoint.stored_config import stored_model_config\n"
            "stored_model_config(meta['model'])\n"
            "print(sorted(m for m in sys.modules if m.startswith('evil')))\n")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(world.downloads), str(ROOT)]))
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-2:] == ["[]", "[]"] and not world.marker.exists()  # no registry call


# --------------------------------------------------------------------------- pickled format 1


def test_upgrade_refuses_a_format1_pickle_that_names_code(world):
    """The newer step's pickle names os.system: nothing runs, and no step is rewritten (the older, clean
    one neither: every file is checked before the first is rewritten)."""
    ckpts = world.root / "old_evil" / "checkpoints"
    _refused(world, "convert_checkpoint", ["upgrade", str(ckpts)], "rank_00000.pt names the global(s) posix.system",
             f"python launch/convert_checkpoint.py upgrade {ckpts} --trust-model-code")


def test_an_error_recommending_upgrade_leads_to_a_working_command(world, tmp_path, capsys):
    """A format-1 checkpoint: forecast and consolidate name the upgrade command; run as printed (the
    allow-list reads stormshard's own pickles), after which both work."""
    old = tmp_path / "old" / "checkpoints"
    shutil.copytree(world.root / "old" / "checkpoints", old)
    argv = ["--model", str(old), "--dataset", str(world.dataset), "--date", "2020-01-12T00", "--steps", "1",
            "--no-scores", "--out", str(tmp_path / "fc")]
    assert cli("forecast").main(argv) == 2
    assert cli("convert_checkpoint").main(["consolidate", str(old), "--out", str(tmp_path / "full")]) == 2
    commands = re.findall(r"python (launch/convert_checkpoint\.py upgrade \S+)", capsys.readouterr().err)
    assert len(commands) == 2, commands
    for command in commands:
        done = _run(world, "convert_checkpoint", *shlex.split(command)[1:])
        assert done.returncode == 0 and "error:" not in done.stderr, done.stderr
    assert cli("forecast").main(argv) == 0
    assert cli("convert_checkpoint").main(["consolidate", str(old), "--out", str(tmp_path / "full")]) == 0
    assert not world.marker.exists()


def test_upgrade_with_the_opt_in_unpickles_unrestricted(world, tmp_path):
    """``upgrade --trust-model-code``: what the allow-list refuses is unpickled (here the payload runs, as
    the user asked) and the checkpoint is rewritten in the current format."""
    ckpts = tmp_path / "checkpoints"
    shutil.copytree(world.root / "old_evil" / "checkpoints", ckpts)
    try:
        assert cli("convert_checkpoint").main(["upgrade", str(ckpts), "--trust-model-code"]) == 0
        assert world.marker.exists()
        for f in ckpts.glob("step_*/*.pt"):
            torch.load(f, weights_only=True)
    finally:
        world.marker.unlink(missing_ok=True)


# ----------------------------------------------------------------------------------- anemoi files


def test_import_anemoi_refuses_a_pickle_naming_os_system(world):
    _refused(world, "convert_checkpoint", ["import-anemoi", str(world.root / "evil.ckpt"), "--out",
                                           str(world.root / "imported")],
             "evil.ckpt names posix.system (os.system) in its pickle", "nothing was written")


def test_export_anemoi_refuses_a_template_naming_os_system(world):
    """A bundle that descends from such a file: export-anemoi would copy its pickle; refused, no output."""
    _refused(world, "convert_checkpoint", ["export-anemoi", str(world.downloads / "anemoi_bundle"), "--out",
                                           str(world.root / "out.ckpt")],
             "anemoi_source.ckpt names posix.system (os.system) in its pickle")
    assert not list(world.root.glob("out.ckpt*"))


class _Reduce:
    def __init__(self, func: object, *args: object) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple:
        return self.func, self.args


@pytest.mark.parametrize(("payload", "named"), [
    (_Reduce(eval, "__import__('os').system('touch PWNED')"), "builtins.eval"),
    (_Reduce(exec, "import os; os.system('touch PWNED')"), "builtins.exec"),
    (_Reduce(subprocess.check_call, ["touch", "PWNED"]), "subprocess.check_call"),
    (_Reduce(__import__, "os"), "builtins.__import__"),
    (_Reduce(getattr, collections.OrderedDict, "__subclasses__"),
     "builtins.getattr of the private attribute '__subclasses__'"),
    # globals outside the allow-list, which a deny-list would have let through as stubs
    (_Reduce(os.path.join, "a", "b"), "posixpath.join" if os.name == "posix" else "ntpath.join"),
    (_Reduce(collect_env.run, "touch PWNED"), "torch.utils.collect_env.run"),  # a shell command
    (_Reduce(logging.config.dictConfig, {}), "logging.config.dictConfig"),
    (_Reduce(getattr, _Reduce(pathlib.Path, "PWNED"), "touch"), "builtins.getattr of 'touch'"),
], ids=["eval", "exec", "subprocess", "import", "getattr-private", "not-allowed", "collect-env", "dict-config",
        "getattr-on-a-path"])
def test_every_code_global_is_refused_by_name(tmp_path, monkeypatch, payload, named):
    monkeypatch.chdir(tmp_path)
    path = _anemoi_zip({"state_dict": {"w": torch.ones(2)}, "payload": payload}, tmp_path / "bad.ckpt")
    with pytest.raises(UnsafeAnemoiCheckpoint, match=re.escape(f"bad.ckpt names {named}")):
        open_anemoi_checkpoint(path)
    assert not (tmp_path / "PWNED").exists()


def _text(value: str) -> bytes:
    """A protocol-2 ``BINUNICODE`` opcode pushing ``value``."""
    raw = value.encode()
    return b"X" + len(raw).to_bytes(4, "little") + raw


def _raw_anemoi_zip(payload: bytes, path: Path) -> Path:
    """A torch-zip-shaped anemoi file whose ``data.pkl`` is ``{"state_dict": {}, "payload": <payload opcodes>}``."""
    import zipfile

    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", b"\x80\x02}(" + _text("state_dict") + b"}" + _text("payload") + payload + b"u.")
        z.writestr("archive/version", "3\n")
        z.writestr("archive/anemoi-metadata/anemoi.json", '{"version": "2.0"}')
    return path


def _call(func: bytes, *args: str) -> bytes:
    """The opcodes of ``func(*args)`` (``func``: the opcodes pushing the callable)."""
    return func + b"(" + b"".join(_text(a) for a in args) + b"tR"


def _getattr(obj: bytes, name: str) -> bytes:
    """The opcodes of ``getattr(obj, name)``."""
    return b"c__builtin__\ngetattr\n" + obj + _text(name) + b"\x86R"


_OUTSIDE = "(not a class or type an anemoi checkpoint holds"


@pytest.mark.parametrize(("payload", "named"), [
    # modules, functions and classes of torch, torch-geometric and anemoi-training outside the submodules anemoi's
    # models, graphs and tasks come from: refused by name (torch.nn.parallel.distributed imports os; torch-geometric's
    # profile utilities import subprocess; its fs.rm deletes; its Sequential generates and runs code; its
    # SQLiteDatabase creates a file; DistributedDataParallel communicates; anemoi-training's MLflow logger connects)
    (_call(_getattr(b"ctorch.nn.parallel.distributed\nos\n", "system"), "touch PWNED"),
     f"torch.nn.parallel.distributed.os {_OUTSIDE}"),
    (_call(_getattr(b"ctorch_geometric.profile.utils\nsp\n", "getoutput"), "touch PWNED"),
     f"torch_geometric.profile.utils.sp {_OUTSIDE}"),
    (_call(b"ctorch_geometric.io.fs\nrm\n", "PWNED"), f"torch_geometric.io.fs.rm {_OUTSIDE}"),
    (_call(b"ctorch_geometric.nn.sequential\nSequential\n", "x", "PWNED"),
     f"torch_geometric.nn.sequential.Sequential {_OUTSIDE}"),
    (_call(b"ctorch_geometric.data.database\nSQLiteDatabase\n", "PWNED", "t"),
     f"torch_geometric.data.database.SQLiteDatabase {_OUTSIDE}"),
    (_call(b"ctorch.nn.parallel.distributed\nDistributedDataParallel\n", "m"),
     f"torch.nn.parallel.distributed.DistributedDataParallel {_OUTSIDE}"),
    (_call(b"canemoi.training.diagnostics.mlflow.logger\nAnemoiMLflowLogger\n", "PWNED"),
     f"anemoi.training.diagnostics.mlflow.logger.AnemoiMLflowLogger {_OUTSIDE}"),
    # inside the allowed submodules, anything that is not a class: a module one of them imports (reached into), a
    # function (called), a method of an allowed class (called: OmegaConf.save(config, path) writes a file)
    (_call(_getattr(b"ctorch.nn.modules.module\nos\n", "system"), "touch PWNED"),
     "builtins.getattr of 'system' on 'torch.nn.modules.module.os'"),
    (_call(b"ctorch.nn.modules.module\nregister_module_forward_hook\n", "PWNED"),
     "torch.nn.modules.module.register_module_forward_hook called with arguments"),
    (_call(_getattr(b"comegaconf.omegaconf\nOmegaConf\n", "save"), "config", "PWNED"),
     "a call of getattr(omegaconf.omegaconf.OmegaConf, 'save')"),
], ids=["module-of-torch", "subprocess-of-pyg", "pyg-function", "pyg-sequential", "pyg-database", "ddp",
        "anemoi-logger", "module-of-an-allowed-module", "allowed-module-function", "allowed-class-method"])
def test_a_package_global_that_is_no_class_is_refused(tmp_path, monkeypatch, payload, named):
    """The stub allow-list names the submodules anemoi's files are built from (its models, graphs and tasks, torch.nn's
    layers, torch-geometric's graph data and layers, omegaconf): anything else is refused by name, and inside them
    reaching into an imported module, calling a function or calling a method, which would run under the real
    unpickler anemoi-inference uses on the file export-anemoi writes, is refused too; the anemoi fixtures do none
    of these."""
    monkeypatch.chdir(tmp_path)
    path = _raw_anemoi_zip(payload, tmp_path / "bad.ckpt")
    with pytest.raises(UnsafeAnemoiCheckpoint, match=re.escape(f"bad.ckpt names {named}")):
        open_anemoi_checkpoint(path)
    assert not (tmp_path / "PWNED").exists()
