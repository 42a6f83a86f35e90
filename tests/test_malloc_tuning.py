"""The training process's glibc malloc settings (stormshard.training.malloc_tuning): applied once, on
Linux with glibc; skipped on request or when the user set glibc's own variables."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

CODE = "from stormshard.training.malloc_tuning import tune_malloc; print(tune_malloc(), tune_malloc())"


def _run(**env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "STORMSHARD_MALLOC_TUNING"}
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, check=True, env={**clean, **env})
    return out.stdout.strip()


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_tune_malloc_applies_once_unless_told_not_to():
    assert _run() == "True True"
    assert _run(STORMSHARD_MALLOC_TUNING="0") == "False False"
    assert _run(MALLOC_ARENA_MAX="4") == "False False"  # the user's own glibc settings win
