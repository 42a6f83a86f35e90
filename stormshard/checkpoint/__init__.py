"""Checkpoints below training: the on-disk format (:mod:`stormshard.checkpoint.format`; state as tensors
plus JSON, no pickles: :mod:`~stormshard.checkpoint.state_codec`; per-file checksums:
:mod:`~stormshard.checkpoint.integrity`; the pickled format 1: :mod:`~stormshard.checkpoint.upgrade`),
the stored config's sections (:mod:`stormshard.checkpoint.stored_config`), and conversion driven by
partition metadata: consolidate, reshard, export, inspect. Nothing here imports :mod:`stormshard.training`."""

from __future__ import annotations

from stormshard.checkpoint.consolidate import consolidate_checkpoint, load_consolidated, save_consolidated
from stormshard.checkpoint.errors import ConversionError
from stormshard.checkpoint.export import export_bundle, load_model
from stormshard.checkpoint.inspect import inspect_checkpoint
from stormshard.checkpoint.reshard import reshard_checkpoint

__all__ = [
    "consolidate_checkpoint", "save_consolidated", "load_consolidated", "reshard_checkpoint",
    "export_bundle", "load_model", "inspect_checkpoint", "ConversionError",
]
