"""The one exception checkpoint conversion raises: it lists every difference it found."""

from __future__ import annotations

from collections.abc import Sequence

from stormshard.checkpoint.format import CheckpointError

__all__ = ["ConversionError", "check_metadata"]


class ConversionError(CheckpointError):
    """A checkpoint that cannot be converted: missing, extra or mis-shaped tensors, incomplete
    shards, missing or unreadable rank files, or a layout the target cannot take.

    ``problems`` holds one line per difference; the message lists them and says what to do.
    Nothing has been written when this is raised.
    """

    def __init__(self, what: str, problems: Sequence[str] = (), fix: str = "") -> None:
        self.problems = [str(p) for p in problems]
        lines = [what]
        shown = self.problems[:40]
        lines += [f"  - {p}" for p in shown]
        if len(self.problems) > len(shown):
            lines.append(f"  ... and {len(self.problems) - len(shown)} more")
        if fix:
            lines.append(fix)
        super().__init__("\n".join(lines))


# what metadata.json must hold, per checkpoint kind: key -> accepted types
_TRAINING_KEYS: dict[str, tuple[type, ...]] = {"format": (int,), "step": (int,), "world_size": (int,),
                                                "layout": (dict,), "config": (dict,), "ranks": (list,)}
_CONSOLIDATED_KEYS: dict[str, tuple[type, ...]] = {"format": (str,), "step": (int,), "config": (dict,),
                                                    "source_layout": (dict,), "parameters": (list,),
                                                    "optimizer": (bool,)}
_PARAMETER_KEYS = {"name", "shape", "full_shape", "partition"}


def check_metadata(meta: object, path: str, consolidated_format: str, training_format: int) -> dict:
    """``meta`` (a parsed ``metadata.json``) has the keys and types of a stormshard training or
    consolidated checkpoint; else a :class:`ConversionError` listing the foreign, missing and
    mistyped keys (a metadata.json written by another tool, or edited by hand). Keys beyond the
    required ones are listed when a required one is missing (they tell whose file it is), and
    tolerated otherwise (newer writers may add some); ``layout`` keys must be ParallelLayout's."""
    if not isinstance(meta, dict):
        raise ConversionError(f"{path} holds a JSON {type(meta).__name__}, not the object of a stormshard checkpoint",
                              fix="pass a step_NNNNNNNN directory written by launch/train.py, or a consolidated one")
    kind = "consolidated" if meta.get("format") == consolidated_format else "training"
    required = _CONSOLIDATED_KEYS if kind == "consolidated" else _TRAINING_KEYS
    problems = [f"{k}: missing" for k in required if k not in meta]
    if problems:
        problems += [f"{k}: foreign key (not written by stormshard)" for k in sorted(set(meta) - set(required))
                     if k not in ("time", "version", "optimizer_note")]
    problems += [f"{k}: {type(meta[k]).__name__} {str(meta[k])[:40]!r}, expected {'/'.join(t.__name__ for t in required[k])}"
                 for k in required if k in meta and (not isinstance(meta[k], required[k]) or isinstance(meta[k], bool)
                                                     and bool not in required[k])]
    if kind == "training" and meta.get("format") != training_format and "format" in meta:
        problems.append(f"format: {meta['format']!r}, expected {training_format} (training) or "
                        f"{consolidated_format!r} (consolidated)")
    if kind == "training" and isinstance(meta.get("layout"), dict):
        from dataclasses import fields

        from stormshard.parallel.topology import ParallelLayout

        known = {f.name for f in fields(ParallelLayout)}
        problems += [f"layout.{k}: foreign key (the layout keys are {sorted(known)})" for k in sorted(set(meta["layout"]) - known)]
        if "world_size" not in meta["layout"]:
            problems.append("layout.world_size: missing")
    if kind == "training" and isinstance(meta.get("ranks"), list):
        for r, table in enumerate(meta["ranks"]):
            rows = table.get("parameters") if isinstance(table, dict) else None
            if not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
                problems.append(f"ranks[{r}].parameters: not a list of parameter rows")
                continue
            missing = sorted({k for row in rows for k in _PARAMETER_KEYS - set(row)})
            if missing:
                foreign = sorted({k for row in rows for k in set(row) - _PARAMETER_KEYS - {"dtype"}})
                problems.append(f"ranks[{r}].parameters: rows lack {missing}" + (f" and hold foreign keys {foreign}"
                                                                                  if foreign else ""))
    if kind == "consolidated" and isinstance(meta.get("parameters"), list):
        for i, row in enumerate(meta["parameters"]):
            if not isinstance(row, dict) or not {"name", "shape"} <= set(row):
                problems.append(f"parameters[{i}]: not a row with name and shape")
                break
    if problems:
        raise ConversionError(f"{path} is not the metadata of a stormshard {kind} checkpoint:", problems,
                              fix="pass a checkpoint written by launch/train.py (or convert_checkpoint consolidate); "
                                  "restore its metadata.json if it was edited")
    return meta
