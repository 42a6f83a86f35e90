"""Write an anemoi checkpoint whose pickle is a (changed) object tree read from a real one: for tests that
derive checkpoint layouts from the fixtures anemoi wrote (``tests/fixtures/anemoi``), without anemoi.

:func:`open_anemoi_checkpoint` reads a file's pickle as inert stubs; :func:`save_stub_tree` writes such a
tree back with ``torch.save`` (the tensors as the zip's storages, as torch writes them) through a pickler that
names every stub by the global the original file named (``Stub._stub_name``) and rebuilds it the way the
original did (``NEWOBJ`` and its state, or ``REDUCE`` of a stub called with arguments), then copies the
original's metadata entries (``anemoi-metadata/...``), optionally rewritten, under the new file's folder.
"""

from __future__ import annotations

import copyreg
import json
import pickle
import types
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from stormshard.checkpoint.anemoi_pickle import Stub, _stub_class

__all__ = ["save_stub_tree", "new_stub", "module_children"]


def rewrite_metadata(src: Path, dst: Path, edit_metadata: Callable[[dict], None]) -> Path:
    """A copy of the checkpoint ``src`` whose ``anemoi-metadata/anemoi.json`` is passed through ``edit_metadata``."""
    with zipfile.ZipFile(src) as z, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as out:
        for info in z.infolist():
            data = z.read(info)
            if info.filename.endswith("anemoi-metadata/anemoi.json"):
                meta = json.loads(data)
                edit_metadata(meta)
                data = json.dumps(meta).encode()
            out.writestr(info, data)
    return dst


def new_stub(name: str, **state: Any) -> Stub:
    """An instance of the stub of class ``name`` (``module.Class``) with ``state`` as its attributes."""
    obj = _stub_class(name).__new__(_stub_class(name))
    obj.__dict__.update(state)
    return obj


def module_children(module: Stub) -> dict[str, Any]:
    """A stubbed ``nn.Module``'s ``_modules`` dict (changed in place by the callers)."""
    return module.__dict__["_modules"]


class _StubPickler(pickle._Pickler):  # the Python pickler: its save_global and reducer_override can be replaced
    def save_global(self, obj: Any, name: str | None = None) -> None:
        if isinstance(obj, type) and issubclass(obj, Stub):
            module, _, qualname = obj._stub_name.rpartition(".")
            self.write(pickle.GLOBAL + module.encode() + b"\n" + qualname.encode() + b"\n")
            self.memoize(obj)
            return
        super().save_global(obj, name)

    def reducer_override(self, obj: Any) -> Any:
        if not isinstance(obj, Stub):
            return NotImplemented
        state = {k: v for k, v in obj.__dict__.items() if not k.startswith("_stub_")}
        if "_stub_called" in obj.__dict__:
            raise pickle.PicklingError(f"a call of a stub instance ({obj.__dict__['_stub_called']}) is not written back")
        args, kwargs = obj.__dict__.get("_stub_args", ((), {}))
        if kwargs:
            raise pickle.PicklingError(f"{obj!r} was built with keyword arguments")
        items = obj.__dict__.get("_stub_items")
        listed = obj.__dict__.get("_stub_list")
        if "_stub_state" in obj.__dict__:
            state = obj.__dict__["_stub_state"]
        rest = (state or None, iter(listed) if listed else None, iter(items.items()) if items else None)
        if args:  # REDUCE: the class called with arguments
            return (type(obj), tuple(args), *rest)
        return (copyreg.__newobj__, (type(obj), *obj.__dict__.get("_stub_newargs", ())), *rest)


def save_stub_tree(root: Any, path: Path, original: Path, edit_metadata: Callable[[dict], None] | None = None,
                   metadata_name: str | None = None) -> Path:
    """``root`` (a tree read by ``open_anemoi_checkpoint(original)``, changed) saved as ``torch.save`` does, plus
    ``original``'s metadata entries (``anemoi.json`` passed through ``edit_metadata`` and named
    ``metadata_name`` relative to the zip's folder when given, e.g. ``ai-models.json``)."""
    torch.save(root, path, pickle_module=types.SimpleNamespace(__name__="stub_pickle", Pickler=_StubPickler))
    with zipfile.ZipFile(path) as z:
        folder = z.namelist()[0].split("/")[0]
    with zipfile.ZipFile(original) as src, zipfile.ZipFile(path, "a") as dst:
        for info in src.infolist():
            if "/anemoi-metadata/" not in info.filename:
                continue
            data = src.read(info)
            rest = info.filename.split("/", 1)[1]
            if rest == "anemoi-metadata/anemoi.json":
                meta = json.loads(data)
                if edit_metadata:
                    edit_metadata(meta)
                data = json.dumps(meta).encode()
                rest = metadata_name or rest
            elif metadata_name and not metadata_name.startswith("anemoi-metadata/"):
                continue  # metadata 1.0: no supporting arrays
            dst.writestr(f"{folder}/{rest}", data)
    return path
