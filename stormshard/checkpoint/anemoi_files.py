"""Checks of an anemoi checkpoint file before anything in it is read, each a :class:`ConversionError`
(exit 2 at the command line) naming the file and the entry at fault, raised before anything is written:

- a directory given as the checkpoint (the ``.ckpt`` files in it are listed);
- a metadata entry (``<folder>/anemoi-metadata/anemoi.json``, or an older ``ai-models.json``) that is
  not valid JSON, or not a JSON object;
- a supporting array the metadata lists (``supporting_arrays_paths``) whose dtype is not numeric
  (an object array would be a pickle, not data) or not a dtype at all, whose shape is not a list of
  sizes, or whose zip entry is missing or does not hold ``shape x itemsize`` bytes.

A file that is not a zip at all is left to :func:`stormshard.checkpoint.anemoi_pickle.open_anemoi_checkpoint`,
which says so.
"""

from __future__ import annotations

import json
import math
import os
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from stormshard.checkpoint.errors import ConversionError

__all__ = ["check_anemoi_file"]

_FIX = "give the inference-*.ckpt or last.ckpt anemoi-training wrote, unchanged (or re-save it with anemoi)"


def _metadata_entry(names: list[str]) -> str | None:
    """The zip entry of the anemoi metadata: ``*/anemoi-metadata/anemoi.json``, else ``*/ai-models.json``."""
    found = next((n for n in names if n.endswith("/anemoi-metadata/anemoi.json")), None)
    return found or next((n for n in names if n.endswith("/ai-models.json")), None)


def _array_specs(tree: Any, key: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(metadata key, {"path", "shape", "dtype"})`` of every supporting array listed under ``tree``."""
    if not isinstance(tree, dict):
        return
    if {"path", "shape", "dtype"} <= set(tree):
        yield key, tree
        return
    for name, sub in tree.items():
        yield from _array_specs(sub, f"{key}.{name}")


def _check_array(path: Path, z: zipfile.ZipFile, names: list[str], key: str, spec: dict[str, Any]) -> None:
    where = f"{path}: supporting array {key} (entry {spec['path']})"
    try:
        dtype = np.dtype(str(spec["dtype"]))
    except TypeError:
        raise ConversionError(f"{where}: dtype {spec['dtype']!r} is not a numpy dtype", fix=_FIX) from None
    if dtype.hasobject or dtype.kind not in "biufc":
        raise ConversionError(f"{where}: dtype {spec['dtype']!r} ({dtype}) is not numeric: supporting arrays are raw "
                              "numbers (an object array would be a pickle)", fix=_FIX)
    shape = spec["shape"]
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise ConversionError(f"{where}: shape {shape!r} is not a list of sizes", fix=_FIX)
    entry = spec["path"] if spec["path"] in names else next(
        (n for n in names if n.endswith("/" + str(spec["path"]).rsplit("/", 1)[-1])), None)
    if entry is None:
        raise ConversionError(f"{where}: the file has no such entry", fix=_FIX)
    size, expected = z.getinfo(entry).file_size, math.prod(shape) * dtype.itemsize
    if size != expected:
        raise ConversionError(f"{where}: {size} bytes, but shape {shape} of {dtype} needs {expected}", fix=_FIX)


def check_anemoi_file(source: str | os.PathLike) -> None:
    """Raise a :class:`ConversionError` naming the file and the entry when ``source`` is a directory or
    a zip whose anemoi metadata or supporting arrays are malformed (see the module docstring)."""
    path = Path(source)
    if path.is_dir():
        inside = sorted(str(p.relative_to(path)) for p in [*path.glob("*.ckpt"), *path.glob("*/*.ckpt")])
        listed = f" (it holds {', '.join(inside[:6])}{', ...' if len(inside) > 6 else ''})" if inside else \
            " (with no .ckpt file in it or its subfolders)"
        raise ConversionError(f"{path} is a directory, not an anemoi checkpoint file{listed}",
                              fix="give the .ckpt file itself, e.g. checkpoint/RUN_ID/inference-last.ckpt")
    if not path.is_file() or not zipfile.is_zipfile(path):
        return  # open_anemoi_checkpoint names what it is instead
    with zipfile.ZipFile(path) as z:
        names = z.namelist()
        entry = _metadata_entry(names)
        if entry is None:
            return
        try:
            meta = json.loads(z.read(entry))
        except (ValueError, UnicodeDecodeError) as err:
            raise ConversionError(f"{path}: its metadata entry {entry} is not valid JSON ({err})", fix=_FIX) from None
        if not isinstance(meta, dict):
            raise ConversionError(f"{path}: its metadata entry {entry} holds a JSON {type(meta).__name__}, not the "
                                  "object anemoi writes", fix=_FIX)
        arrays = meta.get("supporting_arrays_paths")
        if arrays is not None and not isinstance(arrays, dict):
            raise ConversionError(f"{path}: supporting_arrays_paths in {entry} is a JSON {type(arrays).__name__}, "
                                  "not an object", fix=_FIX)
        for key, spec in _array_specs(arrays, "supporting_arrays_paths"):
            _check_array(path, z, names, key, spec)
