"""Checkpoint conversion driven by partition metadata: consolidate, reshard, export, inspect."""

from __future__ import annotations

from stormshard.checkpoint.consolidate import (  # noqa: F401
    ConsolidatedCheckpoint,
    consolidate_checkpoint,
    load_any,
    load_consolidated,
    save_consolidated,
)
from stormshard.checkpoint.errors import ConversionError  # noqa: F401
from stormshard.checkpoint.export import InferenceModel, export_bundle, load_model  # noqa: F401
from stormshard.checkpoint.inspect import format_inspection, inspect_checkpoint  # noqa: F401
from stormshard.checkpoint.reshard import reshard_checkpoint  # noqa: F401

__all__ = [
    "ConsolidatedCheckpoint",
    "consolidate_checkpoint",
    "load_any",
    "load_consolidated",
    "save_consolidated",
    "ConversionError",
    "InferenceModel",
    "export_bundle",
    "load_model",
    "format_inspection",
    "inspect_checkpoint",
    "reshard_checkpoint",
]
