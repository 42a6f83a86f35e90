"""Training state on disk without pickled code: tensors plus a JSON skeleton.

A state file (``rank_NNNNN.pt`` of a training checkpoint, ``optimizer.pt`` / ``trainer.pt`` of a
consolidated one) is ``torch.save`` of a dict of plain types only, so it loads with
``torch.load(weights_only=True)``::

    {"stormshard": "state", "format": 2, "skeleton": "<JSON text>", "tensors": {path: Tensor}}

:func:`encode_state` walks a nested state (an engine's ``state_dict()`` with its optimizer,
scheduler, compressor, RNG and data position) and returns the skeleton (JSON) and the tensors keyed
by their path in the state (``state/engine/module/encoder.mlp.0.weight``). Tensors sharing storage
stay shared (one ``torch.save``). The skeleton holds every non-tensor leaf:

- ``None``, ``bool``, ``int``, ``str`` and finite ``float`` as themselves; a list as a JSON list;
- ``{"T": path}`` a tensor; ``{"float": "nan" | "inf" | "-inf"}``; ``{"tuple": [...]}``;
- ``{"dict": {key: value}}`` (string keys) or ``{"items": [[key, value], ...]}`` (other keys), with
  ``"ordered": true`` for an ``OrderedDict`` and ``"meta"`` for a module state dict's ``_metadata``;
- ``{"ndarray": path, "dtype": "<u4", "shape": [...]}`` a numpy array (its bytes as a uint8 tensor),
  ``{"npscalar": "<f8", "value": x}`` a numpy scalar;
- ``{"dtype": "float32"}``, ``{"device": "cpu"}``, ``{"size": [...]}`` for torch's dtype, device, Size;
- ``{"enum": name, "value": v}`` and ``{"object": name, "attrs": {...}}`` for the few classes of
  plain data DeepSpeed puts into its optimizer state (:data:`STATE_CLASSES`: the loss scalers, ZeRO's
  ``fragment_address`` and ``ZeroStageEnum``). Decoding builds only these, by name; it runs no code
  from the file.

A leaf of any other type is a developer error (:class:`TypeError` naming its path): add the class to
:data:`STATE_CLASSES` if it is plain data, or store it differently. :func:`decode_state` is exact:
the decoded state equals the encoded one (types, key order, tensors bit for bit).
"""

from __future__ import annotations

import enum
import functools
import importlib
import json
import math
import os
import re
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from stormshard.checkpoint.format import CheckpointError

__all__ = ["STATE_FORMAT", "STATE_CLASSES", "encode_state", "decode_state", "write_state_file", "read_state_file",
           "UntrustedPickle", "pickled_state_globals", "check_pickled_file", "read_pickled_file"]

STATE_FORMAT = 2
STATE_CLASSES = (  # plain-data classes DeepSpeed puts into its optimizer state (0.15-0.19)
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.utils.tensor_fragment.fragment_address",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
)
_MARK = "state"


def _child(path: str, key: Any) -> str:
    return f"{path}/{key}" if path else str(key)


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


class _Encoder:
    def __init__(self) -> None:
        self.tensors: dict[str, Tensor] = {}

    def _key(self, path: str) -> str:
        key, n = path or "root", 1
        while key in self.tensors:
            n += 1
            key = f"{path}#{n}"
        return key

    def key(self, k: Any, path: str) -> Any:
        if isinstance(k, (Tensor, np.ndarray, dict, list)):
            raise TypeError(f"checkpoint state at {path or '<root>'}: a dict key of type {type(k).__name__} "
                            "cannot be stored")
        return self.leaf(k, path)

    def leaf(self, x: Any, path: str) -> Any:  # noqa: C901, PLR0911, PLR0912 - one branch per stored type
        if isinstance(x, enum.Enum):  # before str / int: an IntEnum or StrEnum keeps its class
            return self._enum(x, path)
        if x is None or type(x) in (bool, str):
            return x
        if isinstance(x, int) and type(x) is int:
            return x
        if isinstance(x, float) and type(x) is float:
            return x if math.isfinite(x) else {"float": repr(x)}
        if isinstance(x, Tensor):
            key = self._key(path)
            self.tensors[key] = x.detach()
            return {"T": key}
        if isinstance(x, np.ndarray):
            if x.dtype.hasobject:
                raise TypeError(f"checkpoint state at {path}: a numpy array of objects cannot be stored")
            key = self._key(path)
            self.tensors[key] = torch.from_numpy(np.ascontiguousarray(x).reshape(-1).view(np.uint8).copy())
            return {"ndarray": key, "dtype": x.dtype.str, "shape": list(x.shape)}
        if isinstance(x, np.generic):
            return {"npscalar": x.dtype.str, "value": self.leaf(x.item(), path)}
        if isinstance(x, torch.dtype):
            return {"dtype": str(x).removeprefix("torch.")}
        if isinstance(x, torch.device):
            return {"device": str(x)}
        if isinstance(x, torch.Size):
            return {"size": list(x)}
        if isinstance(x, tuple) and type(x) is tuple:
            return {"tuple": [self.leaf(v, _child(path, i)) for i, v in enumerate(x)]}
        if isinstance(x, list) and type(x) is list:
            return [self.leaf(v, _child(path, i)) for i, v in enumerate(x)]
        if type(x) in (dict, OrderedDict):
            return self._dict(x, path)
        if _qualified(type(x)) in STATE_CLASSES and hasattr(x, "__dict__"):
            attrs = {k: self.leaf(v, _child(path, k)) for k, v in vars(x).items()}
            return {"object": _qualified(type(x)), "attrs": attrs}
        raise TypeError(
            f"checkpoint state at {path or '<root>'}: a {_qualified(type(x))} cannot be stored without pickle; store "
            "it as tensors and plain values, or add its class to stormshard.checkpoint.state_codec.STATE_CLASSES "
            "if it is plain data")

    def _enum(self, x: enum.Enum, path: str) -> Any:
        name = _qualified(type(x))
        if name not in STATE_CLASSES:
            raise TypeError(f"checkpoint state at {path}: the enum {name} is not in "
                            "stormshard.checkpoint.state_codec.STATE_CLASSES")
        return {"enum": name, "value": self.leaf(x.value, path)}

    def _dict(self, x: Mapping[Any, Any], path: str) -> dict[str, Any]:
        node: dict[str, Any]
        if all(isinstance(k, str) for k in x):
            node = {"dict": {k: self.leaf(v, _child(path, k)) for k, v in x.items()}}
        else:
            node = {"items": [[self.key(k, path), self.leaf(v, _child(path, k))] for k, v in x.items()]}
        if isinstance(x, OrderedDict):
            node["ordered"] = True
        meta = getattr(x, "_metadata", None)
        if meta is not None:
            node["meta"] = self.leaf(meta, _child(path, "_metadata"))
        return node


def encode_state(state: Any) -> tuple[str, dict[str, Tensor]]:
    """``(skeleton JSON text, {path: tensor})`` of ``state``; :class:`TypeError` names a leaf that
    cannot be stored."""
    enc = _Encoder()
    skeleton = enc.leaf(state, "")
    return json.dumps(skeleton, allow_nan=False, separators=(",", ":")), enc.tensors


def _class(name: str) -> Any:
    if name not in STATE_CLASSES:
        raise ValueError(f"names the class {name!r}, which stormshard does not load (known: {list(STATE_CLASSES)})")
    module, _, qual = name.rpartition(".")
    obj: Any = importlib.import_module(module)
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj


@functools.cache
def _torch_dtypes() -> dict[str, torch.dtype]:
    """torch's dtypes by the name :func:`encode_state` stores (``float32``): looked up, never ``getattr(torch, ...)``
    of a name from the file (which could reach any attribute, or import a lazy submodule)."""
    return {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


def _decode(node: Any, tensors: Mapping[str, Tensor]) -> Any:  # noqa: C901, PLR0911, PLR0912
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    if isinstance(node, list):
        return [_decode(v, tensors) for v in node]
    if not isinstance(node, dict):
        raise ValueError(f"holds a {type(node).__name__} node")
    if "T" in node:
        return tensors[node["T"]]
    if "dict" in node or "items" in node:
        pairs = node["dict"].items() if "dict" in node else [(_decode(k, tensors), v) for k, v in node["items"]]
        out: dict[Any, Any] = OrderedDict() if node.get("ordered") else {}
        for k, v in pairs:
            out[k] = _decode(v, tensors)
        if "meta" in node:
            out._metadata = _decode(node["meta"], tensors)  # type: ignore[attr-defined]
        return out
    if "tuple" in node:
        return tuple(_decode(v, tensors) for v in node["tuple"])
    if "float" in node:
        return float(node["float"])
    if "ndarray" in node:
        raw = tensors[node["ndarray"]].numpy().tobytes()
        return np.frombuffer(raw, dtype=np.dtype(node["dtype"])).reshape(node["shape"]).copy()
    if "npscalar" in node:
        return np.dtype(node["npscalar"]).type(_decode(node["value"], tensors))
    if "dtype" in node:
        dtype = _torch_dtypes().get(node["dtype"]) if isinstance(node["dtype"], str) else None
        if dtype is None:
            raise ValueError(f"names the dtype {node['dtype']!r:.60}")
        return dtype
    if "device" in node:
        return torch.device(node["device"])
    if "size" in node:
        return torch.Size(node["size"])
    if "enum" in node:
        cls = _class(node["enum"])
        if not (isinstance(cls, type) and issubclass(cls, enum.Enum)):  # else calling it would run its constructor
            raise ValueError(f"names {node['enum']} as an enum")
        return cls(_decode(node["value"], tensors))
    if "object" in node:
        cls = _class(node["object"])
        obj = cls.__new__(cls)
        obj.__dict__.update({k: _decode(v, tensors) for k, v in node["attrs"].items()})
        return obj
    raise ValueError(f"holds an unknown node {sorted(node)[:3]}")


def decode_state(skeleton: str, tensors: Mapping[str, Tensor]) -> Any:
    """The state :func:`encode_state` encoded; ``ValueError`` / ``KeyError`` on a malformed skeleton."""
    return _decode(json.loads(skeleton), tensors)


def write_state_file(state: Any, path: str | os.PathLike) -> None:
    """``torch.save`` ``state`` as tensors plus a JSON skeleton to ``path`` (the caller makes it atomic)."""
    skeleton, tensors = encode_state(state)
    torch.save({"stormshard": _MARK, "format": STATE_FORMAT, "skeleton": skeleton, "tensors": tensors}, path)


def read_state_file(path: str | os.PathLike, map_location: Any = "cpu") -> Any:
    """What :func:`write_state_file` wrote, loaded with ``torch.load(weights_only=True)``; a damaged or
    foreign file raises :class:`~stormshard.checkpoint.format.CheckpointError` naming it."""
    p = Path(path)
    try:
        raw = torch.load(p, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{p} is missing: the checkpoint is damaged") from None
    except Exception as exc:  # noqa: BLE001 - every reader error means a damaged (or foreign) file
        raise CheckpointError(f"{p} cannot be read as a torch file ({type(exc).__name__}): it is damaged (truncated "
                              "or overwritten) or was not written by stormshard") from None
    if not isinstance(raw, dict) or raw.get("stormshard") != _MARK or not isinstance(raw.get("skeleton"), str):
        raise CheckpointError(f"{p} is not a stormshard state file (no tensors + JSON skeleton in it)")
    if raw.get("format") != STATE_FORMAT:
        raise CheckpointError(f"{p} has state format {raw.get('format')!r}; this stormshard reads {STATE_FORMAT}")
    try:
        return decode_state(raw["skeleton"], raw["tensors"])
    except Exception as exc:  # noqa: BLE001 - decoding builds plain data only: any error (an unknown device, a number
        # out of a numpy type's range, nesting past the recursion limit) means a malformed skeleton
        raise CheckpointError(f"{p}: its state skeleton is malformed ({type(exc).__name__}: {_first_line(exc)}): "
                              "the file is damaged or was not written by stormshard") from None


class UntrustedPickle(CheckpointError):
    """A pickled state file (format 1) names a class or function outside :func:`pickled_state_globals`."""


@functools.cache
def pickled_state_globals() -> tuple[Any, ...]:
    """What a state file of format 1 holds beyond what ``torch.load(weights_only=True)`` allows by
    itself (tensors, ``OrderedDict``, ``torch.Size``, dtypes, devices): the types :func:`encode_state`
    stores, i.e. numpy arrays, scalars and dtypes (under numpy 2's names and numpy 1's) and the
    plain-data classes of :data:`STATE_CLASSES` (when DeepSpeed is installed). The allow-list of
    ``convert_checkpoint.py upgrade``; none of these runs code from the file."""
    try:
        from numpy._core import multiarray
    except ImportError:  # numpy 1
        from numpy.core import multiarray  # type: ignore[no-redef]
    import numpy.dtypes

    dtypes = [c for c in vars(numpy.dtypes).values()
              if isinstance(c, type) and issubclass(c, np.dtype) and c.__name__ not in ("ObjectDType", "VoidDType")]
    found: list[Any] = [np.ndarray, np.dtype, *dtypes]
    for name in ("_reconstruct", "scalar"):
        found += [getattr(multiarray, name)] + [(getattr(multiarray, name), f"{m}.multiarray.{name}")
                                                for m in ("numpy.core", "numpy._core")]
    for name in STATE_CLASSES:
        try:
            found.append(_class(name))
        except Exception:  # noqa: BLE001 - no (working) DeepSpeed here: a file naming its classes is refused
            continue
    return tuple(found)


def _refused(path: Path, detail: str) -> UntrustedPickle:
    return UntrustedPickle(
        f"{path} names {detail}, which stormshard does not unpickle (unpickling it could run code from the file; "
        "stormshard's format 1 holds tensors, numpy values and DeepSpeed's plain-data classes only)")


def check_pickled_file(path: str | os.PathLike) -> None:
    """:class:`UntrustedPickle` naming every global of the pickled state file ``path`` outside
    :func:`pickled_state_globals`; reads the pickle's opcodes only (nothing is unpickled). A file that
    is not a torch zip file passes here (:func:`read_pickled_file` checks it while loading)."""
    p = Path(path)
    with torch.serialization.safe_globals(list(pickled_state_globals())):
        try:
            names = torch.serialization.get_unsafe_globals_in_checkpoint(p)
        except Exception:  # noqa: BLE001 - not a zip file, or damaged: told by the reader
            return
    if names:
        raise _refused(p, "the global(s) " + ", ".join(sorted(names)))


def read_pickled_file(path: str | os.PathLike, map_location: Any = "cpu", *, trust: bool = False) -> Any:
    """A state file of checkpoint format 1 (pickled python objects), read with
    ``torch.load(weights_only=True)`` and the allow-list :func:`pickled_state_globals`: a file naming
    anything else is an :class:`UntrustedPickle` error. With ``trust``, a file the allow-list refuses
    is read unrestricted (``weights_only=False``: it runs code from the file). Only
    ``convert_checkpoint.py upgrade`` calls it."""
    p = Path(path)
    if not trust:
        check_pickled_file(p)
    try:
        with torch.serialization.safe_globals(list(pickled_state_globals())):
            return torch.load(p, map_location=map_location, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - refused by the allow-list, or damaged
        named = re.search(r"GLOBAL ([\w.]+)|but got <class '([\w.]+)'>", str(exc))
        if named is None:
            raise _damaged(p, exc) from None
        if not trust:
            raise _refused(p, f"the global {named.group(1) or named.group(2)}") from None
    try:
        return torch.load(p, map_location=map_location, weights_only=False)
    except Exception as exc:  # noqa: BLE001
        raise _damaged(p, exc) from None


def _damaged(path: Path, exc: BaseException) -> CheckpointError:
    return CheckpointError(f"{path} cannot be read as a torch file ({type(exc).__name__}): it is damaged (truncated "
                           "or overwritten)")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:160]
