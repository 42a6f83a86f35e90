"""stormshard: parallel training of graph-transformer weather models (AIFS-class) in PyTorch.

Subpackages, bottom to top: :mod:`stormshard.parallel` (process groups, collectives, sequence /
tensor / graph parallelism), :mod:`stormshard.layers`, :mod:`stormshard.graphs`,
:mod:`stormshard.data`, :mod:`stormshard.models`, :mod:`stormshard.checkpoint` (the checkpoint
format and conversion), :mod:`stormshard.inference`, :mod:`stormshard.training`; under them all,
:mod:`stormshard.errors` (exit statuses and shared failure classes) and :mod:`stormshard.progress`
(progress lines). Importing the package is cheap: subpackages load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_SUBPACKAGES = ("parallel", "layers", "graphs", "data", "models", "training", "checkpoint", "inference")


def __getattr__(name: str) -> Any:
    if name in _SUBPACKAGES:
        return importlib.import_module(f"stormshard.{name}")
    if name == "load_model":
        return importlib.import_module("stormshard.checkpoint.export").load_model
    raise AttributeError(f"module 'stormshard' has no attribute {name!r}")
