"""An experiment config as the command line gives it: a JSON file, read strictly, and dotted overrides.

- :func:`read_json_object`: a JSON object from a file. A path that is missing or a directory, text
  that is not JSON (the line and column), a key given twice in one object (``json`` would keep the
  last value silently: a 6-step run became 100,000 steps) or a top level that is not an object is a
  :class:`ConfigError` naming the file, the key and the fix. The experiment config and a
  ``--deepspeed_config`` file are both read by it.
- :func:`apply_overrides`: ``dotted.key=value`` items (hydra / anemoi style, positional arguments
  of ``launch/train.py``) set into the raw config. A value is JSON when it parses (``50``, ``1e-4``,
  ``true``, ``null``, ``[1, 2]``, ``{"kind": "knn"}``) and a string otherwise (``runs/x``, ``bf16``);
  a key is checked against the config's schema first: an unknown key (in any section) is an error
  with a did-you-mean and the keys of that section, a key that addresses inside a value that is
  not an object (``training.max_steps.x``) is an error too, and so is a key given twice.
- :func:`validate_config`: the schema's validation of the raw config, with two rules before it: an
  empty string (``training.output_dir=`` from an unset shell variable, ``"init_weights": ""``) is an
  error naming the field, never the current directory or "no value"; and an error about a value an
  override set names that override (``override 'training.max_steps=abc': ...``), not the file.

Torch-free (the standard library only, and the schema passed in), like :mod:`stormshard.training.config`:
``launch/train.py`` validates a config before torch or DeepSpeed is imported.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
import types
import typing
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from stormshard.errors import format_validation_errors

__all__ = ["ConfigError", "read_json_object", "loads_json", "parse_override", "apply_overrides", "schema_keys",
           "empty_fields", "boolean_numbers", "validate_config"]


class ConfigError(ValueError):
    """An experiment config that cannot run; the message names the field, the value and the fix."""


class _Object(dict):
    """A JSON object as parsed, with the keys it held more than once: ``(key, first value, last value)``."""

    duplicates: list[tuple[str, Any, Any]]


def _object_pairs(pairs: list[tuple[str, Any]]) -> _Object:
    out = _Object()
    out.duplicates = []
    for key, value in pairs:
        if key in out:
            out.duplicates.append((key, out[key], value))
        out[key] = value
    return out


def _first_duplicate(value: Any, path: str = "") -> tuple[str, Any, Any] | None:
    """``(dotted key, first value, last value)`` of the first key given twice, walking the parsed value."""
    if isinstance(value, _Object):
        if value.duplicates:
            key, first, last = value.duplicates[0]
            return (f"{path}.{key}" if path else key), first, last
        for key, item in value.items():
            found = _first_duplicate(item, f"{path}.{key}" if path else key)
            if found:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = _first_duplicate(item, f"{path}[{i}]")
            if found:
                return found
    return None


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _lines_of(text: str, key: str) -> list[int]:
    """The lines where ``"key":`` appears in ``text`` (to point at both copies of a duplicate)."""
    pattern = re.compile(r'"' + re.escape(key) + r'"\s*:')
    return [text.count("\n", 0, m.start()) + 1 for m in pattern.finditer(text)]


def loads_json(text: str, source: str, prefix: str = "") -> Any:
    """``json.loads`` that refuses a key given twice in one object (:class:`ConfigError` naming
    ``source``, the dotted key (under ``prefix``), both values and their lines); :class:`json.JSONDecodeError`
    as usual."""
    value = json.loads(text, object_pairs_hook=_object_pairs)
    found = _first_duplicate(value, prefix)
    if found is not None:
        dotted, first, last = found
        lines = sorted(set(_lines_of(text, dotted.rsplit(".", 1)[-1])))
        where = f" (lines {', '.join(map(str, lines))})" if len(lines) > 1 else ""
        raise ConfigError(
            f"{source}: the key {dotted} is given twice{where}, first {json.dumps(_plain(first))}, then "
            f"{json.dumps(_plain(last))}: JSON would keep the last one silently; remove one of them"
        )
    return _plain(value)


def read_json_object(source: str | os.PathLike, what: str, fix: str, holds: str) -> dict[str, Any]:
    """The JSON object in the file ``source``; ``what`` names the file's role in messages ("config
    file"), ``fix`` says what to pass instead, ``holds`` what the object should hold."""
    path = Path(source)
    if path.is_dir():
        raise ConfigError(f"{what} {path} is a directory, not a JSON file: {fix}")
    if not path.is_file():
        reason = "does not exist" if not path.exists() else "is not a regular file"
        raise ConfigError(f"{what} {path} {reason}: {fix}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what} {path} is not UTF-8 text ({exc.reason} at byte {exc.start}): {fix}") from None
    except OSError as exc:
        raise ConfigError(f"{what} {path} cannot be read ({exc.strerror or exc}): check its permissions") from None
    try:
        raw = loads_json(text, str(path))
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a JSON object with {holds}, got a JSON {type(raw).__name__}")
    return raw


# ---------------------------------------------------------------------------------------------- overrides


def parse_override(item: str, source: str = "override") -> tuple[list[str], Any]:
    """``"training.lr=1e-4"`` -> ``(["training", "lr"], 0.0001)``: the value as JSON when it parses,
    else as a string (a value that starts like a JSON object or list must parse)."""
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(
            f"{source} {item!r} is not key=value: give dotted config keys after the options, e.g. "
            "training.max_steps=50 training.lr=1e-4"
        )
    parts = key.split(".")
    if any(not p for p in parts):
        raise ConfigError(f"{source} {item!r}: the key {key!r} has an empty part; write section.key=value")
    try:
        value = loads_json(text, f"{source} {item!r}", prefix=key)
    except json.JSONDecodeError as exc:
        if text.lstrip().startswith(("{", "[")):
            raise ConfigError(f"{source} {item!r}: the value is not valid JSON ({exc.msg} at column {exc.colno}); "
                              "quote it for the shell, e.g. 'graph.encoder={\"kind\": \"knn\"}'") from None
        value = text  # a plain string: runs/x, bf16
    return parts, value


_FREE = "free"  # a section whose keys the schema does not fix (a dict field: deepspeed, model.options)


def _unwrap(annotation: Any) -> list[Any]:
    """The alternatives of an annotation (``X | None``, ``Annotated[...]``, ``Optional``)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _unwrap(typing.get_args(annotation)[0])
    if origin is typing.Union or origin is types.UnionType:
        return [a for arg in typing.get_args(annotation) for a in _unwrap(arg)]
    return [annotation]


def schema_keys(annotation: Any) -> dict[str, Any] | str | None:
    """The keys an object value of ``annotation`` takes: ``{key: annotation}`` (the fields of a
    pydantic model or dataclass; of every alternative of a union), :data:`_FREE` for a dict, None
    when the value is not an object (a number, a string, a list)."""
    keys: dict[str, Any] = {}
    free = False
    for alt in _unwrap(annotation):
        origin = typing.get_origin(alt) or alt
        if isinstance(alt, type) and issubclass(alt, BaseModel):
            for name, info in alt.model_fields.items():
                keys.setdefault(name, info.annotation)
        elif dataclasses.is_dataclass(alt):
            keys.setdefault("type", str)  # a tagged dataclass section ({"type": "powersgd", ...})
            for f in dataclasses.fields(alt):
                keys.setdefault(f.name, f.type)
        elif origin in (dict, typing.Mapping, Any) or alt is Any:
            free = True
    if keys:
        return keys
    return _FREE if free else None


def _kind_of(annotation: Any) -> str:
    names = []
    for alt in _unwrap(annotation):
        origin = typing.get_origin(alt) or alt
        if alt is type(None):
            names.append("null")
        elif origin is typing.Literal:
            names.append(" | ".join(repr(a) for a in typing.get_args(alt)))
        else:
            names.append(getattr(origin, "__name__", str(origin)))
    return " or ".join(names)


def _check_key(parts: Sequence[str], schema: type[BaseModel], item: str, also: Iterable[str]) -> None:
    """Raise a :class:`ConfigError` unless the dotted key ``parts`` names a field of ``schema``."""
    dotted = ".".join(parts)
    if dotted in set(also):
        return
    keys: dict[str, Any] | str | None = schema_keys(schema)
    annotation: Any = schema
    for i, part in enumerate(parts):
        where = ".".join(parts[:i])
        if keys == _FREE:
            return  # e.g. deepspeed.*: its own check (DeepSpeed's keys, with a did-you-mean) runs at validation
        if keys is None:
            raise ConfigError(
                f"override {item!r}: {where} is not an object (its type is {_kind_of(annotation)}), so {dotted} "
                f"names nothing; set {where}=<value>"
            )
        if part not in keys:
            section = f"the section {where}" if where else "the config's top level"
            close = difflib.get_close_matches(part, list(keys), n=1, cutoff=0.6)
            hint = f"did you mean {'.'.join([*parts[:i], close[0]])}? " if close else ""
            raise ConfigError(
                f"override {item!r}: unknown key {dotted}: {hint}the keys of {section} are {', '.join(sorted(keys))}"
            )
        annotation = keys[part]
        keys = schema_keys(annotation)


def apply_overrides(raw: dict[str, Any], items: Sequence[str], schema: type[BaseModel],
                    also: Iterable[str] = ()) -> dict[str, Any]:
    """A copy of the raw config ``raw`` with every ``dotted.key=value`` of ``items`` set, in order.

    Keys are checked against ``schema`` (the experiment config's pydantic model; ``also``: dotted keys
    accepted besides its fields, e.g. deprecated spellings); the values are validated with the rest
    of the config afterwards. A parent that is missing or null becomes an object; one that holds a
    value that is not an object is an error (set the whole value instead).
    """
    out = json.loads(json.dumps(raw))  # a deep copy, JSON types only
    seen: dict[str, str] = {}
    for item in items:
        parts, value = parse_override(item)
        _check_key(parts, schema, item, also)
        dotted = ".".join(parts)
        if dotted in seen:
            raise ConfigError(f"overrides {seen[dotted]!r} and {item!r} both set {dotted}: give each key once (the "
                              "second would silently replace the first)")
        seen[dotted] = item
        node = out
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                where = ".".join(parts[: i + 1])
                raise ConfigError(
                    f"override {item!r}: {where} is {json.dumps(child)} in the config, not an object: set the whole "
                    f"value instead, e.g. {where}='{{...}}'"
                )
            node = child
        overlap = next((k for k in seen if k.startswith(dotted + ".") or dotted.startswith(k + ".")), None)
        if overlap is not None:  # optimizer.eps=... and optimizer='{...}': the later one decides silently
            raise ConfigError(f"overrides {seen[overlap]!r} and {item!r} both set {min(overlap, dotted, key=len)} "
                              "(one holds the other): give the whole object once, or only the keys inside it")
        node[parts[-1]] = value
    return out


# ---------------------------------------------------------------------------------------------- validation


def _known_fields(raw: Any, schema: Any, prefix: str) -> list[tuple[str, Any, Any]]:
    """``(dotted field, value, the field's schema)`` of each key of ``raw`` that ``schema`` has; free sections
    (``deepspeed``, ``model.options``) and unknown keys (validation names those) are not looked into."""
    keys = schema_keys(schema)
    if not isinstance(raw, dict) or not isinstance(keys, dict):
        return []
    return [(f"{prefix}.{key}" if prefix else key, value, keys[key]) for key, value in raw.items() if key in keys]


def empty_fields(raw: Any, schema: Any, prefix: str = "") -> list[str]:
    """The dotted fields of ``raw`` (checked against ``schema``'s fields) that hold an empty or blank
    string, list items included (``data.forcing[0]``); free sections and unknown keys are not looked into."""
    out = []
    for dotted, value, field in _known_fields(raw, schema, prefix):
        items = [(dotted, value)] if not isinstance(value, list) else \
            [(f"{dotted}[{i}]", v) for i, v in enumerate(value)]
        for where, item in items:
            if isinstance(item, str) and not item.strip():
                out.append(where)
            elif isinstance(item, dict):
                out += empty_fields(item, field, where)
    return out


def _number_not_bool(annotation: Any) -> bool:
    """Whether ``annotation`` takes a number (int or float) but not a boolean: pydantic would read ``true``
    there as 1 silently (``bool`` is an ``int`` to Python)."""
    alts = _unwrap(annotation)
    takes_bool = any(alt is bool or alt is Any or (typing.get_origin(alt) is typing.Literal and any(
        isinstance(a, bool) for a in typing.get_args(alt))) for alt in alts)
    return not takes_bool and any(alt is int or alt is float for alt in alts)


def boolean_numbers(raw: Any, schema: Any, prefix: str = "") -> list[tuple[str, bool]]:
    """``(dotted field, value)`` of each field of ``raw`` (checked against ``schema``'s fields) that holds
    ``true`` / ``false`` where the schema takes a number (``training.checkpoint_interval=true`` would be 1);
    free sections and unknown keys are not looked into, as in :func:`empty_fields`."""
    out = []
    for dotted, value, field in _known_fields(raw, schema, prefix):
        if isinstance(value, bool) and _number_not_bool(field):
            out.append((dotted, value))
        elif isinstance(value, dict):
            out += boolean_numbers(value, field, dotted)
    return out


def _override_of(items: Sequence[str]) -> dict[str, str]:
    """``{dotted key: item}`` of the overrides ``items``."""
    return {item.partition("=")[0].strip(): item for item in items}


def _source_for(field: str, message: str, overrides: dict[str, str]) -> str | None:
    """``override '<item>'`` for the override that set ``field`` (or the object holding it); for a
    section's own check (``field`` the section, or the top level) the override under it whose key its
    ``message`` names; None when no override is involved (the value came from the file)."""
    for key, item in overrides.items():
        if key == field or field.startswith(key + "."):
            return f"override {item!r}"
    top = field in ("", "(top level)")
    named = [item for key, item in overrides.items() if (top or key.startswith(field + ".")) and key in message]
    return f"override {named[0]!r}" if named else None


def validate_config(schema: type[BaseModel], raw: dict[str, Any], source: str,
                    overrides: Sequence[str] = ()) -> BaseModel:
    """``schema(**raw)``, or a :class:`ConfigError`: an empty string in any field of the schema first
    (naming the field and, when an override set it, the override), then pydantic's problems one per
    line, each prefixed with the override that set the value (``override 'training.max_steps=abc'``)
    or else ``source`` (the config file)."""
    by_key = _override_of(overrides)
    empty = empty_fields(raw, schema)
    if empty:
        field = empty[0]
        base = field.split("[", 1)[0]
        where = _source_for(base, "", by_key) or source
        more = f" (and {', '.join(empty[1:])})" if len(empty) > 1 else ""
        raise ConfigError(f"{where}: {field} is empty{more}: an empty value is never read as the current directory "
                          "or as 'not set' (an unset shell variable?); give a value, or leave the key out for its "
                          "default")
    flags = boolean_numbers(raw, schema)
    if flags:
        field, value = flags[0]
        where = _source_for(field, "", by_key) or source
        raise ConfigError(f"{where}: {field} = {json.dumps(value)} is a boolean where a number is expected (it would be "
                          f"read as {int(value)}): give a number, e.g. {field}={int(value) or 1}")
    try:
        return schema(**raw)
    except ValidationError as err:
        raise ConfigError(format_validation_errors(err, source, lambda field, message: _source_for(
            field, message, by_key))) from None
