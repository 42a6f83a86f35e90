"""Helpers the bad-input tests share (``tests/test_bad_input_catalogue.py``, ``tests/test_bad_input_edges.py``):
the launchers run in-process through their ``main(argv)``, and a snapshot of every file under a folder
to prove that a refused input wrote or changed nothing."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from tests.test_cli_errors import _cli


def cli(name: str):  # noqa: ANN201 - the launcher module launch/<name>.py
    """``launch/<name>.py`` loaded as a module (its ``main(argv)`` runs the entry point in-process)."""
    return _cli(name)


def run_main(entry: str, argv: list[str]) -> int:
    """The exit status of ``launch/<entry>.py`` with ``argv`` (argparse's ``SystemExit`` included)."""
    try:
        return cli(entry).main(argv)
    except SystemExit as exc:  # argparse: usage and "error: ..." on stderr, status 2
        return int(exc.code)


def snapshot(root: Path) -> dict[str, tuple]:
    """Every directory and file under ``root`` with its size and modification time."""
    out = {}
    for dirpath, _dirnames, filenames in os.walk(root):
        out[dirpath] = ("dir",)
        for name in filenames:
            st = os.stat(os.path.join(dirpath, name))
            out[os.path.join(dirpath, name)] = (st.st_size, st.st_mtime_ns)
    return out


def content_hashes(root: Path) -> dict[str, str]:
    """The sha256 of every file under ``root`` (and every directory, as an empty string), by path."""
    out = {}
    for dirpath, _dirnames, filenames in os.walk(root):
        out[dirpath] = ""
        for name in filenames:
            path = os.path.join(dirpath, name)
            out[path] = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    return out
