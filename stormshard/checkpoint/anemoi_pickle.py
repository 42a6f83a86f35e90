"""Open an anemoi checkpoint without anemoi installed and without running anything in it.

An anemoi inference checkpoint (``inference-*.ckpt``) is ``torch.save`` of the whole model
interface object, pickled classes included, plus ``<folder>/anemoi-metadata/anemoi.json``
(``ai-models.json`` in older files) and the supporting arrays as raw ``.numpy`` entries, added by
``anemoi.utils.checkpoints.save_metadata``. A Lightning ``last.ckpt`` is a pickled dict whose
``state_dict`` holds the weights.

:func:`open_anemoi_checkpoint` unpickles it with :class:`RestrictedUnpickler`, which resolves only
an allow-list of globals (torch tensor / storage rebuilders, dtypes, ``torch.Size``,
``collections.OrderedDict``, a few builtins, numpy array rebuilders, torch's sparse-tensor rebuilder, which
gives an inert :class:`SparseTensor` record: no sparse tensor is constructed) and turns every other class or
function into an inert :class:`Stub`: calling a stub (the pickle ``REDUCE`` / ``NEWOBJ`` opcodes)
only records the arguments, and its state (``BUILD``) is stored as a plain dict. Nothing named in
the file is imported or executed. A file whose pickle names a global that runs code or reaches the
system (:func:`runs_code`: ``os.system``, ``eval``, ``exec``, ``subprocess``, ``getattr`` of a private
attribute, ...) is refused outright (:class:`UnsafeAnemoiCheckpoint`, naming the global and the
file), although a stub would keep it inert here: anemoi-inference unpickles with
``torch.load(weights_only=False)``, and ``export-anemoi`` copies an imported file's pickle unchanged
into the file it writes. The model's tensors are then reachable as in ``nn.Module.state_dict``
(:func:`module_tensors`: ``_parameters``, ``_buffers``, ``_modules`` of every stub).
"""

from __future__ import annotations

import _compat_pickle
import io
import json
import os
import pickle
import zipfile
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stormshard.checkpoint.errors import ConversionError

__all__ = ["may_stub", "Stub", "RestrictedUnpickler", "AnemoiCheckpoint", "open_anemoi_checkpoint", "module_tensors",
           "stub_class_name", "NotAnemoiCheckpoint", "UnsafeAnemoiCheckpoint", "runs_code", "SparseTensor"]


class NotAnemoiCheckpoint(ConversionError):
    """The file is not an anemoi checkpoint (not a torch zip file, or no anemoi metadata / model)."""


class UnsafeAnemoiCheckpoint(ConversionError):
    """The file's pickle names a global that runs code (:func:`runs_code`): refused, nothing written."""


class _CodeGlobal(pickle.UnpicklingError):
    """Raised by the unpickler at the first global that runs code; ``name`` says which."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


#: modules (and their submodules) whose globals run code, spawn processes or touch files and sockets
_CODE_MODULES = frozenset({
    "os", "posix", "nt", "subprocess", "_posixsubprocess", "sys", "shutil", "importlib", "runpy", "pty", "socket",
    "ctypes", "_ctypes", "code", "codeop", "commands", "popen2", "webbrowser", "multiprocessing", "pickle", "_pickle",
    "cPickle", "marshal", "shelve", "dill", "cloudpickle", "joblib", "timeit", "pdb", "bdb", "trace", "profile",
    "cProfile", "pydoc", "platform", "signal", "asyncio", "io", "_io", "tempfile", "urllib", "http", "ftplib",
    "smtplib", "telnetlib", "requests", "setuptools", "distutils", "pip", "venv", "ensurepip", "zipimport", "pkgutil",
    "site", "sysconfig", "imp", "threading", "_thread", "gc",
})
#: single globals that run code (module.name; "builtins" stands for "__builtin__" too)
_CODE_NAMES = frozenset({
    *(f"builtins.{n}" for n in ("eval", "exec", "execfile", "compile", "__import__", "open", "input", "breakpoint",
                                 "globals", "locals", "vars", "setattr", "delattr", "exit", "quit", "help", "apply",
                                 "reload", "file", "memoryview")),
    "operator.methodcaller", "operator.attrgetter", "_operator.methodcaller", "_operator.attrgetter",
    "types.CodeType", "types.FunctionType", "types.LambdaType", "types.MethodType",
    "torch.load", "torch.jit.load", "torch.hub.load", "numpy.load", "numpy.fromfile",
    "hydra.utils.instantiate", "hydra.utils.call", "hydra.utils.get_method", "hydra.utils.get_class",
})
#: modules whose every global is refused, under a package whose others are fine
_CODE_SUBMODULES = ("torch.serialization", "torch.hub", "torch.package", "torch.utils.cpp_extension",
                    "numpy.lib.npyio", "hydra._internal.instantiate", "hydra._internal.utils")


#: the modules whose classes and functions a stub may stand for (an allow-list): what an anemoi checkpoint's
#: model, config and graph are built from. A global outside them and outside :data:`_STUB_GLOBALS` is refused
#: (a real unpickler would import it, and anemoi-inference loads with one). Of torch.nn, torch-geometric and
#: anemoi-training only the submodules of layers, graph data and tasks: not the classes whose constructors act
#: (torch-geometric's ``Sequential`` generates and runs code, its datasets download, ``SQLiteDatabase`` creates
#: a file, ``DistributedDataParallel`` communicates, anemoi-training's loggers and trainer start services)
_STUB_PACKAGES = ("anemoi.models", "anemoi.graphs", "anemoi.utils.config",
                  "anemoi.training.tasks", "anemoi.training.train.forecaster", "anemoi.training.losses",
                  "anemoi.training.schemas",
                  "anemoi.training.diagnostics.callbacks.plot_adapter",
                  "torch.nn.modules", "torch.nn.parameter", "torch.nn.attention", "torch._C._nn",
                  "torch_geometric.data.data", "torch_geometric.data.hetero_data", "torch_geometric.data.storage",
                  "torch_geometric.data.feature_store", "torch_geometric.data.graph_store",
                  "torch_geometric.data.view", "torch_geometric.inspector", "torch_geometric.typing",
                  "torch_geometric.nn.aggr", "torch_geometric.nn.conv",
                  "omegaconf", "hydra._internal.target_policy",
                  # the scipy sparse matrices an AIFS 1.x model kept (``_truncation_data``): rebuilt with NEWOBJ of
                  # the class and a dict state, never called with arguments (a function such as load_npz is refused)
                  "scipy.sparse")
#: plain data types and a few harmless functions, per module (Python 3 names)
_STUB_GLOBALS: dict[str, frozenset[str]] = {
    "builtins": frozenset({"dict", "list", "tuple", "set", "frozenset", "getattr", "type", "int", "float", "str",
                           "bytes", "bool", "slice", "range", "object", "complex", "bytearray", "long", "unicode"}),
    "collections": frozenset({"OrderedDict", "defaultdict", "deque", "Counter"}),
    "datetime": frozenset({"timedelta", "datetime", "date", "time", "timezone"}),
    "inspect": frozenset({"_empty"}),
    "pathlib": frozenset({"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"}),
    "typing": frozenset({"Any", "Union", "Optional", "OrderedDict", "List", "Dict", "Tuple", "Callable", "Literal",
                         "Set", "FrozenSet", "Type", "Sequence", "Mapping"}),
    # torch-geometric's Inspector records annotations such as tuple[Tensor, Tensor] (anemoi's GraphConv, GNN models)
    "types": frozenset({"GenericAlias"}),
    "operator": frozenset({"getitem"}),
    "_operator": frozenset({"getitem"}),
    "torch": frozenset({"Tensor", "Size", "device", "Generator"}),
}


def may_stub(module: str, name: str) -> bool:
    """Whether ``module.name`` (Python 3 module name) is on the allow-list a stub may stand for: a class or
    function of :data:`_STUB_PACKAGES`, or a plain type of :data:`_STUB_GLOBALS`; never a dotted name (a
    protocol-4 attribute path such as ``torch`` / ``os.system``) and never what :func:`runs_code` names."""
    if "." in name or runs_code(module, name):
        return False
    if name in _STUB_GLOBALS.get(module, ()):
        return True
    return _in_stub_packages(module)


def _in_stub_packages(name: str) -> bool:
    """Whether the dotted ``name`` lies in one of :data:`_STUB_PACKAGES`."""
    return any(name == p or name.startswith(f"{p}.") for p in _STUB_PACKAGES)


def _names_class(name: str) -> bool:
    """Whether the last part of the dotted ``name`` is spelled as a class (``GELU``, ``_DeferredTarget``): a
    global of :data:`_STUB_PACKAGES` spelled otherwise is a function or a module (``torch_geometric.io.fs.rm``,
    the ``os`` that ``torch.nn.parallel.distributed`` imports), which a real unpickler would call or reach into."""
    return name.rsplit(".", 1)[-1].lstrip("_")[:1].isupper()


def runs_code(module: str, name: str) -> bool:
    """Whether the global ``module.name`` of a pickle runs code (or reaches processes, files, sockets)
    when a real unpickler resolves it and the pickle calls it: the globals a file is refused for."""
    return (module.split(".")[0] in _CODE_MODULES or f"{module}.{name}" in _CODE_NAMES
            or any(module == m or module.startswith(f"{m}.") for m in _CODE_SUBMODULES))


class Stub:
    """An inert stand-in for a class (or function) the file names but that is not on the allow-list.

    ``_stub_name`` is the ``module.qualname`` the file named; calling an instance or the class
    records ``_stub_args``; the arguments of a ``NEWOBJ`` (``cls.__new__(cls, *args)``, a named tuple's
    fields) are kept as ``_stub_newargs``; ``__setstate__`` stores the state as attributes (dict state) or as
    ``_stub_state``. No code of the named class runs."""

    _stub_name = "?"

    def __new__(cls, *args: Any, **kwargs: Any) -> Stub:
        obj = super().__new__(cls)
        if args:
            obj.__dict__["_stub_newargs"] = args
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        name = type(self)._stub_name
        if (args or kwargs) and _in_stub_packages(name) and not _names_class(name):
            raise _CodeGlobal(f"{name} called with arguments (a function or module, not a class: a real unpickler "
                              "would run it)")
        self.__dict__["_stub_args"] = (args, kwargs)

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and (state[0] is None or isinstance(state[0], dict)):
            state = {**(state[0] or {}), **(state[1] or {})}  # (dict state, slot state)
        if isinstance(state, dict):
            self.__dict__.update({str(k): v for k, v in state.items()})
        else:
            self.__dict__["_stub_state"] = state

    def __call__(self, *args: Any, **kwargs: Any) -> Stub:
        if isinstance(self, _PublicGetattr):  # a method (OmegaConf.save, X.from_pretrained) or a module's function
            owner, attribute = (*self.__dict__["_stub_args"][0], "?", "?")[:2]
            raise _CodeGlobal(f"a call of getattr({_stub_target(owner) or '?'}, {attribute!r:.60}) (a real unpickler "
                              "would run it)")
        target = _stub_target(self)
        if not (_in_stub_packages(target) and _names_class(target)):
            raise _CodeGlobal(f"a call of {target:.120} (a real unpickler would run it)")
        out = Stub()
        out.__dict__.update(_stub_called=self._stub_name, _stub_args=(args, kwargs))
        return out

    def __repr__(self) -> str:
        return f"<stub {self._stub_name}>"

    # containers pickled as subclasses of dict/list use SETITEMS / APPENDS on the object
    def __setitem__(self, key: Any, value: Any) -> None:
        self.__dict__.setdefault("_stub_items", {})[key] = value

    def append(self, value: Any) -> None:
        self.__dict__.setdefault("_stub_list", []).append(value)

    def extend(self, values: Any) -> None:
        self.__dict__.setdefault("_stub_list", []).extend(values)


def stub_class_name(obj: Any) -> str | None:
    """``module.qualname`` of the class a stub stands for (None: not a stub)."""
    return type(obj)._stub_name if isinstance(obj, Stub) else None


_stub_classes: dict[str, type] = {}


class _PublicGetattr(Stub):
    """The stub of ``getattr``, which anemoi's files name (a method reference): the attribute must be
    public; a private one (``f.__globals__``, ``type.__subclasses__``) is the way from a harmless
    object to code, and is refused."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if len(args) > 1 and (not isinstance(args[1], str) or args[1].startswith("_")):
            raise _CodeGlobal(f"builtins.getattr of the private attribute {args[1]!r:.60}")
        target = _stub_target(args[0]) if args else ""
        if args and not (_in_stub_packages(target) and _names_class(target)):
            # a method of a model class (anemoi's files hold getattr(<model class>, 'forward')); a method of a
            # path, a date or a container (Path(...).touch) would act when a real unpickler calls it
            raise _CodeGlobal(f"builtins.getattr of {args[1] if len(args) > 1 else '?'!r:.60} on "
                              f"{target or type(args[0]).__name__!r:.80}")
        super().__init__(*args, **kwargs)


def _stub_target(obj: Any) -> str:
    """The ``module.qualname`` a stub class, a stub instance or a stub call's result stands for ("" otherwise)."""
    if isinstance(obj, type) and issubclass(obj, Stub):
        return obj._stub_name
    if isinstance(obj, Stub):
        return obj.__dict__.get("_stub_called") or type(obj)._stub_name
    return ""


def _stub_class(name: str) -> type:
    if name not in _stub_classes:
        base = _PublicGetattr if name in ("builtins.getattr", "__builtin__.getattr") else Stub
        _stub_classes[name] = type(name.rsplit(".", 1)[-1], (base,), {"_stub_name": name, "__module__": "stub"})
    return _stub_classes[name]


def _reconstructor(cls: Any, base: Any, state: Any) -> Any:
    """``copyreg._reconstructor`` for stubs and allowed classes only (never runs a constructor)."""
    if isinstance(cls, type) and issubclass(cls, Stub):
        return cls()
    raise pickle.UnpicklingError(f"copyreg._reconstructor of {cls!r} is not allowed")


def _new(cls: Any, *args: Any) -> Any:
    if isinstance(cls, type) and issubclass(cls, Stub):
        return cls(*args)
    raise pickle.UnpicklingError(f"__newobj__ of {cls!r} is not allowed")


_DTYPES = {name: getattr(torch, name) for name in (
    "float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
    "complex64", "complex128", "double", "float", "half", "long", "int", "short")}
_STORAGE_DTYPES = {"DoubleStorage": torch.float64, "FloatStorage": torch.float32, "HalfStorage": torch.float16,
                   "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
                   "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
                   "BoolStorage": torch.bool, "ComplexFloatStorage": torch.complex64,
                   "ComplexDoubleStorage": torch.complex128}


@dataclass(frozen=True)
class _StorageType:
    dtype: torch.dtype


def _rebuild_tensor_v2(storage: Any, offset: int, size: Any, stride: Any, requires_grad: bool = False,
                       backward_hooks: Any = None, metadata: Any = None) -> torch.Tensor:
    t = torch.empty((0,), dtype=storage.dtype)
    t.set_(storage, offset, tuple(size), tuple(stride))
    return t


def _rebuild_parameter(data: Any, requires_grad: bool = False, backward_hooks: Any = None, *state: Any) -> Any:
    if not isinstance(data, torch.Tensor):
        raise pickle.UnpicklingError("torch._utils._rebuild_parameter of something that is not a tensor")
    return torch.nn.Parameter(data, requires_grad=bool(requires_grad))


def _rebuild_from_type_v2(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    if func is not _rebuild_tensor_v2 and func is not _rebuild_parameter:
        raise pickle.UnpicklingError("torch._tensor._rebuild_from_type_v2 of a non-tensor rebuilder")
    return func(*args)


_SPARSE_LAYOUTS = {name: getattr(torch, name) for name in ("sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr",
                                                            "sparse_bsc")}


@dataclass(frozen=True)
class SparseTensor:
    """A sparse tensor of the pickle (``torch._utils._rebuild_sparse_tensor``'s arguments), recorded, not
    constructed (a sparse tensor built from unchecked parts may read out of bounds): ``layout`` a torch sparse
    layout; ``parts`` its component tensors (COO: ``indices`` ``(ndim, nnz)``, ``values``; CSR and the other
    compressed layouts: compressed indices, plain indices, ``values``); ``size``; ``coalesced`` (COO; None when
    the file does not say). Whoever reads one checks its parts (anemoi_truncation.sparse_entries)."""

    layout: Any
    parts: tuple[torch.Tensor, ...]
    size: tuple[int, ...]
    coalesced: bool | None = None

    def __reduce__(self) -> tuple:  # pickled again as it came (a file derived from a real one, in the tests)
        from torch._utils import _rebuild_sparse_tensor

        if self.layout == torch.sparse_coo:
            data = (*self.parts, torch.Size(self.size)) + (() if self.coalesced is None else (self.coalesced,))
        else:
            data = (*self.parts, torch.Size(self.size))
        return _rebuild_sparse_tensor, (self.layout, data)


def _get_layout(name: Any) -> Any:
    """``torch.serialization._get_layout`` (how a pickle names a tensor layout) of the sparse layouts only."""
    layout = _SPARSE_LAYOUTS.get(str(name).removeprefix("torch.")) if isinstance(name, str) else None
    if layout is None:
        raise pickle.UnpicklingError(f"torch.serialization._get_layout of {name!r:.40} (not a sparse layout)")
    return layout


def _rebuild_sparse_tensor(layout: Any, data: Any) -> SparseTensor:
    """``torch._utils._rebuild_sparse_tensor`` as an inert record (:class:`SparseTensor`): no tensor is built."""
    if layout not in _SPARSE_LAYOUTS.values() or not isinstance(data, tuple):
        raise pickle.UnpicklingError(f"torch._utils._rebuild_sparse_tensor of layout {layout!r:.40} with "
                                     f"{type(data).__name__} data")
    coo = layout == torch.sparse_coo
    count = 2 if coo else 3
    parts, size = data[:count], data[count] if len(data) > count else None
    extra = data[count + 1:]
    if (len(parts) != count or not all(isinstance(t, torch.Tensor) for t in parts)
            or not isinstance(size, (tuple, list)) or not all(isinstance(d, int) for d in size)
            or len(extra) > (1 if coo else 0) or (extra and not isinstance(extra[0], (bool, type(None))))):
        raise pickle.UnpicklingError(f"torch._utils._rebuild_sparse_tensor of {layout} with malformed data")
    return SparseTensor(layout, tuple(parts), tuple(int(d) for d in size), extra[0] if extra else None)


def _numpy_reconstruct(cls: Any, shape: Any, dtype: Any) -> np.ndarray:
    if cls is not np.ndarray:
        raise pickle.UnpicklingError(f"numpy _reconstruct of {cls!r} is not allowed")
    return np.ndarray.__new__(np.ndarray, shape, dtype)


def _numpy_scalar(dtype: Any, data: bytes | None = None) -> Any:
    return np.frombuffer(data or b"", dtype=dtype)[0] if data else dtype.type()


def _codecs_encode(text: Any, encoding: str = "utf-8") -> bytes:
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1", "utf-8", "utf8"):
        raise pickle.UnpicklingError("_codecs.encode of something other than a latin1/utf-8 string")
    return text.encode(encoding)  # how pickle protocol 2 writes bytes (numpy scalars)


def _numpy_dtype(spec: Any, align: bool = False, copy: bool = False) -> np.dtype:
    return np.dtype(spec)  # a dtype from a type code string ("f4", "i8"); no code runs


#: (module, name) -> the object the unpickler returns. Everything else becomes a Stub.
_ALLOWED: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
    ("torch._utils", "_rebuild_sparse_tensor"): _rebuild_sparse_tensor,
    ("torch.serialization", "_get_layout"): _get_layout,
    **{("torch", name): layout for name, layout in _SPARSE_LAYOUTS.items()},
    ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,
    ("torch", "Size"): torch.Size,
    ("torch", "device"): torch.device,
    ("collections", "OrderedDict"): OrderedDict,
    ("builtins", "set"): set, ("builtins", "frozenset"): frozenset, ("builtins", "slice"): slice,
    ("builtins", "complex"): complex, ("builtins", "bytearray"): bytearray, ("builtins", "object"): object,
    ("__builtin__", "set"): set,
    ("copyreg", "_reconstructor"): _reconstructor,
    ("_codecs", "encode"): _codecs_encode,
    ("copyreg", "__newobj__"): _new,
    ("numpy.core.multiarray", "_reconstruct"): _numpy_reconstruct,
    ("numpy._core.multiarray", "_reconstruct"): _numpy_reconstruct,
    ("numpy.core.multiarray", "scalar"): _numpy_scalar,
    ("numpy._core.multiarray", "scalar"): _numpy_scalar,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): _numpy_dtype,
    **{("torch", name): _StorageType(dtype) for name, dtype in _STORAGE_DTYPES.items()},
    **{("torch", name): dtype for name, dtype in _DTYPES.items()},
}


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickles a torch zip checkpoint's ``data.pkl`` resolving only :data:`_ALLOWED`; every other
    global becomes a :class:`Stub` class. ``storage(key, dtype, numel)`` reads a tensor storage."""

    def __init__(self, data: bytes, storage: Any) -> None:
        super().__init__(io.BytesIO(data))
        self._storage = storage
        self._cache: dict[str, Any] = {}
        self.stubbed: set[str] = set()

    @property
    def storage_keys(self) -> set[str]:
        """The storage keys read so far."""
        return set(self._cache)

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        py3 = _compat_pickle.IMPORT_MAPPING.get(module, module)  # the name Python 3 gives a protocol-2 module
        if runs_code(module, name) or runs_code(py3, name):
            raise _CodeGlobal(f"{py3}.{name}" + (f" (os.{name})" if py3 in ("posix", "nt") else ""))
        if module == "numpy" and name.endswith("DType") or module == "numpy.dtypes":
            return _numpy_dtype
        if not may_stub(py3, name):
            raise _CodeGlobal(f"{py3}.{name} (not a class or type an anemoi checkpoint holds: the allow-list is "
                              "anemoi's model, graph and task classes, torch.nn's layers, torch-geometric's graph "
                              "data and layers, the config's classes and plain types)")
        self.stubbed.add(f"{module}.{name}")
        return _stub_class(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and pid and pid[0] == "storage" and len(pid) >= 5):
            raise pickle.UnpicklingError(f"unknown persistent id {pid!r:.80}")
        _, storage_type, key, _location, numel = pid[:5]
        dtype = storage_type.dtype if isinstance(storage_type, _StorageType) else storage_type
        if not isinstance(dtype, torch.dtype):
            raise pickle.UnpicklingError(f"storage {key!r} has no known dtype ({storage_type!r:.80})")
        key = str(key)
        if key not in self._cache:
            self._cache[key] = self._storage(key, dtype, int(numel))
        return self._cache[key]


@dataclass
class AnemoiCheckpoint:
    """What :func:`open_anemoi_checkpoint` read. ``root`` is the unpickled object (stubs for
    anemoi's classes); ``metadata`` the anemoi metadata dict (``{}`` if the file has none);
    ``supporting_arrays`` the raw ``.numpy`` entries; ``kind`` ``"inference"`` (a pickled model) or
    ``"lightning"`` (a dict with a ``state_dict``)."""

    path: Path
    root: Any
    metadata: dict[str, Any]
    supporting_arrays: dict[str, np.ndarray]
    kind: str
    stubbed: set[str] = field(default_factory=set)
    storages_read: set[str] = field(default_factory=set)  # the data/<key> entries the pickle referenced
    # the bytes behind every storage (the tensors view them: writing a tensor changes them), by key
    buffers: dict[str, bytearray] = field(default_factory=dict)
    prefix: str = ""  # the zip's folder (``<prefix>/data.pkl``)

    def storage_key(self, tensor: torch.Tensor) -> str:
        """The ``data/<key>`` entry a tensor read from this file views."""
        ptr = tensor.untyped_storage().data_ptr()
        for key, buf in self.buffers.items():
            if buf and torch.frombuffer(buf, dtype=torch.uint8).data_ptr() == ptr:
                return key
        raise KeyError("the tensor is not one of this checkpoint's storages")


def _read_metadata(z: zipfile.ZipFile, names: list[str]) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    meta_name = next((n for n in names if n.endswith("/anemoi-metadata/anemoi.json")), None)
    meta_name = meta_name or next((n for n in names if n.endswith("/ai-models.json")), None)
    if meta_name is None:
        return {}, {}
    metadata = json.loads(z.read(meta_name))
    arrays: dict[str, np.ndarray] = {}

    def walk(tree: Any, name: str) -> None:  # {"data": {"latitudes": {"path", "shape", "dtype"}}} (or flat)
        if not isinstance(tree, dict):
            return
        if {"path", "shape", "dtype"} <= set(tree):
            entry = tree["path"] if tree["path"] in names else next(
                (n for n in names if n.endswith("/" + str(tree["path"]).rsplit("/", 1)[-1])), None)
            if entry is not None:
                raw = np.frombuffer(z.read(entry), dtype=np.dtype(str(tree["dtype"])))
                arrays[name] = raw.reshape([int(d) for d in tree["shape"]]).copy()
            return
        for key, sub in tree.items():
            walk(sub, f"{name}/{key}" if name else str(key))

    walk(metadata.get("supporting_arrays_paths") or {}, "")
    return metadata, arrays


def open_anemoi_checkpoint(path: str | os.PathLike) -> AnemoiCheckpoint:
    """Read an anemoi checkpoint (inference or Lightning) safely; raises :class:`NotAnemoiCheckpoint`
    naming the path and why when it is not one."""
    p = Path(path)
    if not p.is_file():
        raise NotAnemoiCheckpoint(f"{p}: no such file", fix="give the path of an anemoi .ckpt file")
    if not zipfile.is_zipfile(p):
        raise NotAnemoiCheckpoint(f"{p} is not an anemoi checkpoint: not a torch zip file",
                                  fix="give an anemoi-training inference-*.ckpt or last.ckpt")
    with zipfile.ZipFile(p) as z:
        names = z.namelist()
        pkl = [n for n in names if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pkl) != 1:
            raise NotAnemoiCheckpoint(f"{p} is not an anemoi checkpoint: no torch data.pkl entry",
                                      fix="give an anemoi-training inference-*.ckpt or last.ckpt")
        prefix = pkl[0].rsplit("/", 1)[0]
        metadata, arrays = _read_metadata(z, names)

        buffers: dict[str, bytearray] = {}

        def storage(key: str, dtype: torch.dtype, numel: int) -> Any:
            raw = buffers[key] = bytearray(z.read(f"{prefix}/data/{key}"))
            return torch.frombuffer(raw, dtype=dtype)[:numel].untyped_storage() if raw else \
                torch.empty(0, dtype=dtype).untyped_storage()

        unpickler = RestrictedUnpickler(z.read(pkl[0]), _TypedStorageReader(storage))
        try:
            root = unpickler.load()
        except _CodeGlobal as err:
            raise UnsafeAnemoiCheckpoint(
                f"{p} names {err.name} in its pickle: loading the file with torch.load(weights_only=False), as "
                "anemoi does, would run it (and export-anemoi would copy the pickle into the file it writes); "
                "stormshard refuses such files: nothing was written",
                fix="use a checkpoint from a source you trust, as anemoi-training's checkpoint callback wrote it") from None
        except Exception as err:  # noqa: BLE001 - any malformed pickle is "not an anemoi checkpoint"
            raise NotAnemoiCheckpoint(f"{p} could not be read as an anemoi checkpoint: {type(err).__name__}: {err}",
                                      fix="give an anemoi-training inference-*.ckpt or last.ckpt") from None
    if isinstance(root, dict) and "state_dict" in root:
        kind = "lightning"
        if not metadata:
            metadata = dict(root.get("hyper_parameters", {}) or {}).get("metadata", {}) or {}
    elif isinstance(root, Stub) and "_modules" in root.__dict__:
        kind = "inference"
    else:
        raise NotAnemoiCheckpoint(f"{p} is not an anemoi checkpoint: it holds a {type(root).__name__}, "
                                  "not an anemoi model or a Lightning checkpoint dict",
                                  fix="give an anemoi-training inference-*.ckpt or last.ckpt")
    if not metadata:
        raise NotAnemoiCheckpoint(f"{p} is not an anemoi checkpoint: no anemoi-metadata/anemoi.json "
                                  "(or ai-models.json) entry",
                                  fix="give a checkpoint written by anemoi-training's checkpoint callback")
    return AnemoiCheckpoint(p, root, metadata, arrays, kind, set(unpickler.stubbed), set(unpickler.storage_keys),
                           buffers, prefix)


class _TypedStorageReader:
    """Reads storages as tensors' typed storages (dtype attached), as ``_rebuild_tensor_v2`` wants."""

    def __init__(self, read: Any) -> None:
        self._read = read

    def __call__(self, key: str, dtype: torch.dtype, numel: int) -> Any:
        return torch.storage.TypedStorage(wrap_storage=self._read(key, dtype, numel), dtype=dtype, _internal=True)


def module_tensors(obj: Any, prefix: str = "", *, persistent_only: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of a (stubbed) module tree, named as ``nn.Module.state_dict`` names
    them (``persistent_only``: leave out non-persistent buffers, as ``state_dict`` does)."""
    out: dict[str, torch.Tensor] = {}
    state = obj.__dict__ if hasattr(obj, "__dict__") else {}
    skip = set(state.get("_non_persistent_buffers_set", ()) or ()) if persistent_only else set()
    for key in ("_parameters", "_buffers"):
        for name, t in (state.get(key) or {}).items():
            if isinstance(t, torch.Tensor) and not (key == "_buffers" and name in skip):
                out[prefix + name] = t
    for name, child in (state.get("_modules") or {}).items():
        if child is not None:
            out.update(module_tensors(child, f"{prefix}{name}.", persistent_only=persistent_only))
    return out
