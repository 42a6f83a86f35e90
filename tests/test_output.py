"""Output a person can follow: plain progress lines and events when the output is a log file (no
``\\r`` frames), a line per phase of graph building, conversion and forecasting (quiet unless asked),
and under torchrun stormshard's message as the root cause of torchrun's failure summary."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stormshard.data.synthetic import generate_synthetic_dataset
from stormshard.progress import PeriodicLine, active, note, phase, reporting
from tests.tiny_run import tiny_config

ROOT = Path(__file__).resolve().parent.parent


def _cli(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_output_cli", ROOT / "launch" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def _one_process(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS",
                "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "TORCHELASTIC_ERROR_FILE"):
        monkeypatch.delenv(key, raising=False)


# --------------------------------------------------------------------------------------------
# stormshard.progress
# --------------------------------------------------------------------------------------------


def test_periodic_line():
    clock = iter([0.0, 1.0, 5.0, 31.0, 40.0, 100.0]).__next__
    out = io.StringIO()
    line = PeriodicLine(10, initial=0, every_s=30, stream=out, clock=clock)  # made at t=0
    first = line.update(1, loss=0.5, samples=4)  # t=1: the first update always prints
    assert first == "step 1/10 (10%) | loss 0.5 | 4 samples/s | elapsed 1.0 s | ETA 9.0 s"
    assert line.update(2, loss=0.4, samples=4) is None  # t=5: within 30 s of the last line
    text = line.update(3, loss=0.3, samples=4)  # t=31: due; samples/s over the 8 samples since t=1
    assert text.startswith("step 3/10 (30%) | loss 0.3 | 0.2667 samples/s | elapsed 31 s | ETA ")
    assert line.update(4, loss=0.2, samples=4) is None  # t=40
    assert "ETA" not in line.update(10, loss=0.1, samples=4)  # t=100: the last step always prints
    assert out.getvalue().count("\n") == 3 and "\r" not in out.getvalue()
    with pytest.raises(ValueError, match="every_s"):
        PeriodicLine(10, every_s=0)


def test_phase_lines_only_when_reporting(capsys):
    with phase("quiet"):
        note("not printed")
    assert not active() and capsys.readouterr().err == ""
    with reporting():
        assert active()
        with reporting(False):  # an inner "no" keeps the outer reporting
            with phase("work", lambda: "3 items"):
                pass
        note("throttled away", throttle=True)  # within THROTTLE_S of the last line
        with pytest.raises(RuntimeError), phase("failed"):
            raise RuntimeError("boom")
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("work: 3 items (") and lines[0].endswith(" s)")


def test_graph_build_progress(tmp_path, capsys):
    from stormshard.graphs.builder import GraphConfig, KNNEdges, load_or_build_graph

    cfg = GraphConfig(data_grid="o8", hidden="o4", processor=KNNEdges(num_neighbours=6))
    load_or_build_graph(cfg, tmp_path / "quiet.pt")
    assert capsys.readouterr().err == ""  # quiet by default (tests, library use)
    load_or_build_graph(cfg, tmp_path / "g.pt", progress=True)
    load_or_build_graph(cfg, tmp_path / "g.pt", progress=True)
    err = capsys.readouterr().err
    for phase_name in ("hidden nodes (o4): 208", "encoder edges", "decoder edges", "processor edges",
                       "node areas and edge attributes", "built in", f"saved {tmp_path / 'g.pt'}",
                       f"loaded {tmp_path / 'g.pt'} (built from this config)"):
        assert f"graph: {phase_name}" in err, phase_name


# --------------------------------------------------------------------------------------------
# a tiny run into a log file, then conversion and a forecast from its checkpoint
# --------------------------------------------------------------------------------------------


def test_log_file_output_events_conversion_and_forecast(tmp_path, capsys):
    """stderr is not a terminal under pytest's capture, as in a log file: plain lines, no tqdm frames."""
    dataset = tmp_path / "synthetic.zarr"
    generate_synthetic_dataset(dataset, grid="o8", steps=64, seed=1)
    run = tmp_path / "run"
    changes = {"logging.progress": True, "logging.log_every_s": 1e-6, "training.validation_interval": 1,
               "training.checkpoint_interval": 2, "data.validation_samples": 2}
    config = tmp_path / "config.json"
    config.write_text(json.dumps(tiny_config(str(dataset), run, **changes)))
    train = _cli("train")
    assert train.main(["--config", str(config)]) == 0
    err = capsys.readouterr().err
    assert "\r" not in err
    for line in ("graph: built in", f"graph: saved {run / 'graph.pt'}", "step 1/3 (33%) | loss ",
                 "step 3/3 (100%) | loss ", "validation RMSE against persistence at step 1 (2 windows):",
                 "validation RMSE against persistence at step 2 (2 windows):",
                 f"checkpoint saved: {run / 'checkpoints' / 'step_00000002'}",
                 f"checkpoint saved: {run / 'checkpoints' / 'step_00000003'}"):
        assert line in err, line
    assert len([x for x in err.splitlines() if x.startswith("step ")]) == 3
    assert err.index("step 1/3") < err.index("at step 1 (") < err.index("step 2/3") < err.index("step_00000002")

    # resumed: the event names the step and the checkpoint
    config.write_text(json.dumps(tiny_config(str(dataset), run, **changes, **{"training.max_steps": 4})))
    assert train.main(["--config", str(config), "--resume"]) == 0
    err = capsys.readouterr().err
    assert f"resumed from step 3 ({run / 'checkpoints' / 'step_00000003'})" in err
    assert f"graph: loaded {run / 'graph.pt'}" in err and "graph: building" not in err  # cached, not rebuilt
    assert "step 4/4 (100%)" in err and "\r" not in err

    # conversion: a line per phase on stderr, the result alone on stdout
    convert = _cli("convert_checkpoint")
    assert convert.main(["consolidate", str(run / "checkpoints"), "--out", str(tmp_path / "full")]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("consolidated step 4") and "checkpoint: read 1 rank file(s) of" in err
    assert convert.main(["inspect", str(run / "checkpoints"), "--json"]) == 0
    json.loads(capsys.readouterr().out)  # --json output stays parseable

    # a forecast: a line per phase and at the last step of each date (rank 0, stderr)
    forecast = _cli("forecast")
    assert forecast.main(["--model", str(run / "checkpoints"), "--dataset", str(dataset), "--date", "2020-01-12T00",
                          "--steps", "2", "--out", str(tmp_path / "fc"), "--no-scores"]) == 0
    err = capsys.readouterr().err
    for line in ("forecast: opened the model", "forecast: built the model (1 rank(s) per model, 1 replica(s), fp32)",
                 "forecast 2020-01-12T00:00:00: step 2/2 (", "forecast: rollout of 1 date(s) x 1 member(s) x 2 step(s)"):
        assert line in err, line


# --------------------------------------------------------------------------------------------
# torchrun: stormshard's message is the root cause of torchrun's summary
# --------------------------------------------------------------------------------------------


def test_elastic_error_file(tmp_path, monkeypatch, capsys):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from stormshard.cli import report_failure, write_elastic_error_file

    assert not write_elastic_error_file("error: x")  # outside torchrun: nothing written
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    status = report_failure(ValueError("training.lr = -1: must be positive\n  - a second line"))
    assert status == 2 and capsys.readouterr().err.startswith("error: training.lr")
    data = json.loads(path.read_text())
    assert data["message"]["extraInfo"]["py_callstack"] == "error: training.lr = -1: must be positive\n  - a second line"
    # what torchrun prints from it (torch's own reader and formatter)
    summary = ChildFailedError("launch/train.py", {0: ProcessFailure(0, 123, 2, str(path))}).format_msg()
    assert "traceback : error: training.lr = -1: must be positive\n    - a second line" in summary
    # a non-zero rank of bad input prints nothing but writes the same message; --debug adds the traceback
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    report_failure(ValueError("bad value"))
    assert json.loads(path.read_text())["message"]["extraInfo"]["py_callstack"] == "error: bad value"
    assert capsys.readouterr().err == ""
    try:
        raise ValueError("bad value")
    except ValueError as exc:
        report_failure(exc, debug=True)
    assert "Traceback" in json.loads(path.read_text())["message"]["extraInfo"]["py_callstack"]
    assert json.loads(path.read_text())["message"]["message"] == "error: bad value"


def test_torchrun_prints_stormshard_message_as_root_cause(tmp_path):
    config = tmp_path / "bad.json"
    config.write_text(json.dumps({"training": {"lr": -1}}))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("TORCHELASTIC_ERROR_FILE", None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
                           str(ROOT / "launch" / "train.py"), "--config", str(config)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    message = f"error: {config}: training.lr = -1: Input should be greater than 0"
    assert proc.returncode == 1, proc.stderr  # torchrun's own status for any failed child
    lines = [x.strip() for x in proc.stderr.splitlines() if x.strip()]
    assert lines[0] == message  # the child's own line
    assert "exitcode  : 2" in proc.stderr  # the child's status, in torchrun's summary
    assert lines[-2] == f"traceback : {message}" and set(lines[-1]) == {"="}  # the root cause, last
