"""``tests/anemoi_runner.py``: commands forked from the anemoi fork server behave as ``subprocess.run`` of the
anemoi venv's python would: the script really runs there (its output, its failure, its exit status), in its own
process with its own argv, cwd, environment and ``sys.path``, and nothing one call does leaks into the next."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.anemoi_runner import ANEMOI_PYTHON, run_in_anemoi_env, server_pid
from tests.test_anemoi_export import needs_anemoi

pytestmark = needs_anemoi

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}

SCRIPT = """\
import json, os, sys
import anemoi.models.interface
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "var": os.environ.get("RUNNER_VAR"),
                  "prefix": sys.prefix, "pid": os.getpid(), "name": __name__, "file": __file__}))
print("to stderr", file=sys.stderr)
os.write(2, b"fd 2\\n")
if sys.argv[1] == "fail":
    raise ValueError("deliberate failure " + sys.argv[2])
if sys.argv[1] == "exit":
    sys.exit(int(sys.argv[2]))
"""


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "scripts" / "probe.py"
    path.parent.mkdir()
    path.write_text(SCRIPT)
    return path


def test_the_script_runs_in_a_forked_anemoi_process(script, tmp_path):
    import json

    run = run_in_anemoi_env([str(script), "ok", "x"], cwd=tmp_path, env={**ENV, "RUNNER_VAR": "v1"}, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.args == [str(ANEMOI_PYTHON), str(script), "ok", "x"]
    seen = json.loads(run.stdout)
    assert seen["argv"] == [str(script), "ok", "x"] and seen["name"] == "__main__" and seen["file"] == str(script)
    assert seen["cwd"] == str(tmp_path) and seen["path0"] == str(script.parent) and seen["var"] == "v1"
    assert os.path.samefile(seen["prefix"], ANEMOI_PYTHON.parent.parent)  # the anemoi venv, not this one
    assert seen["prefix"] != sys.prefix
    assert seen["pid"] not in (os.getpid(), server_pid())
    assert run.stderr == "to stderr\nfd 2\n"
    again = json.loads(run_in_anemoi_env([str(script), "ok", "y"], cwd=tmp_path, env=ENV, timeout=120).stdout)
    assert again["pid"] != seen["pid"] and again["var"] is None and again["argv"][2] == "y"


def test_a_failing_script_fails(script, tmp_path):
    """The control: a script that raises gives status 1 and its traceback, ``sys.exit(N)`` status N."""
    run = run_in_anemoi_env([str(script), "fail", "42"], cwd=tmp_path, env=ENV, timeout=120)
    assert run.returncode == 1
    assert run.stderr.startswith("to stderr\nfd 2\nTraceback (most recent call last):\n")
    assert f'File "{script}", line 8, in <module>' in run.stderr
    assert run.stderr.endswith("ValueError: deliberate failure 42\n")
    assert run_in_anemoi_env([str(script), "exit", "3"], cwd=tmp_path, env=ENV, timeout=120).returncode == 3
    with pytest.raises(subprocess.CalledProcessError) as failed:
        run_in_anemoi_env([str(script), "fail", "1"], cwd=tmp_path, env=ENV, timeout=120, check=True, text=False)
    assert failed.value.returncode == 1 and b"deliberate failure 1" in failed.value.stderr


def test_code_and_state_do_not_leak_between_calls(tmp_path):
    code = "import sys, torch; print(hasattr(torch, 'leak'), sys.argv); torch.leak = 1; sys.exit(sys.argv[1])"
    first = run_in_anemoi_env(["-c", code, "stop"], cwd=tmp_path, env=ENV, timeout=120)
    assert (first.returncode, first.stdout, first.stderr) == (1, "False ['-c', 'stop']\n", "stop\n")
    second = run_in_anemoi_env(["-c", code, "again"], cwd=tmp_path, env=ENV, timeout=120)
    assert second.stdout.startswith("False ")


def test_a_timeout_kills_the_call_and_the_server_goes_on(tmp_path):
    with pytest.raises(subprocess.TimeoutExpired):
        run_in_anemoi_env(["-c", "import time; print('started', flush=True); time.sleep(600)"], cwd=tmp_path,
                          env=ENV, timeout=2)
    pid = server_pid()
    assert run_in_anemoi_env(["-c", "print('next')"], cwd=tmp_path, env=ENV, timeout=120).stdout == "next\n"
    assert server_pid() == pid


def test_other_interpreter_settings_run_as_a_plain_subprocess(tmp_path):
    run = run_in_anemoi_env(["-c", "import sys; print(sys.flags.dont_write_bytecode, sys.prefix)"], cwd=tmp_path,
                            env={**ENV, "PYTHONDONTWRITEBYTECODE": "1"}, timeout=120)
    flag, prefix = run.stdout.split()
    assert run.returncode == 0 and flag == "1" and os.path.samefile(prefix, ANEMOI_PYTHON.parent.parent)
