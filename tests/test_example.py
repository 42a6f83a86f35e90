"""examples/custom_architecture.py runs as a script on 2 gloo ranks and its loss goes down."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_custom_architecture_example_trains():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "custom_architecture.py")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    losses = [float(v) for v in re.findall(r"loss (\d+\.\d+)", proc.stdout)]
    assert len(losses) == 4, proc.stdout  # steps 0, 8, 16, 24
    assert losses[-1] < 0.6 * losses[0], proc.stdout
