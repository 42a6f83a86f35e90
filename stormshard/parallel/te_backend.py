"""Optional Transformer Engine backend for the local matmul of the tensor-parallel linears.

The tensor-parallel layers do their own communication (``stormshard.parallel.comm``); only the
local ``y = x W^T (+ b)`` on each rank's slice may run through Transformer Engine, whose
``te.pytorch.Linear`` (``parallel_mode=None``: no communication of its own) brings its fused
kernels and FP8 under ``te.pytorch.fp8_autocast``. The TE module *shares* the layer's parameters,
so state dicts, partition metadata and optimisers see only the layer's own ``weight`` / ``bias``.

Transformer Engine is never a hard dependency: it is used only when it imports and the input is on
a CUDA device; everything else runs ``torch.nn.functional.linear``. Only that fallback is tested
in this repository (no GPU, no Transformer Engine in CI).
"""

from __future__ import annotations

import importlib
from functools import lru_cache
from types import ModuleType

import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["transformer_engine_available", "resolve_use_te", "LocalLinear"]


@lru_cache(maxsize=1)
def _te_pytorch() -> ModuleType | None:
    try:
        return importlib.import_module("transformer_engine.pytorch")
    except Exception:  # noqa: BLE001 - any import failure (missing, broken CUDA libs) means "not available"
        return None


def transformer_engine_available() -> bool:
    """True when ``transformer_engine.pytorch`` imports in this environment."""
    return _te_pytorch() is not None


def resolve_use_te(use_te: bool | None) -> bool:
    """Validate the ``use_te`` option: None = when available, True = required, False = never.

    Raises ImportError for ``use_te=True`` without Transformer Engine (before any work starts).
    """
    if use_te is not None and not isinstance(use_te, bool):
        raise TypeError(f"use_te must be None, True or False, got {use_te!r}")
    if use_te is True and not transformer_engine_available():
        raise ImportError(
            "use_te=True but transformer_engine.pytorch cannot be imported: install "
            "'stormshard[te]' on a CUDA machine, or pass use_te=None (use it when available) or False"
        )
    return use_te is not False and transformer_engine_available()


class LocalLinear:
    """The local ``x (..., in) -> (..., out)`` matmul of a parallel linear, with an optional TE kernel.

    Holds references to the owning layer's ``weight`` (out, in) and ``bias`` (out,) or None; it is
    *not* an ``nn.Module`` (so it adds no parameters or state-dict keys). The TE module is built
    lazily on the first CUDA input and reuses the same parameters.
    """

    def __init__(self, allow_te: bool) -> None:
        self.allow_te = allow_te
        self._te_linear: nn.Module | None = None

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        if self.allow_te and x.is_cuda:
            return self._te(weight, bias)(x)
        return F.linear(x, weight, bias)

    def _te(self, weight: Tensor, bias: Tensor | None) -> nn.Module:
        te = _te_pytorch()
        if te is None:  # pragma: no cover - guarded by resolve_use_te
            raise ImportError("transformer_engine.pytorch is not importable")
        lin = self._te_linear
        if lin is None:
            out_features, in_features = weight.shape
            lin = te.Linear(in_features, out_features, bias=bias is not None, params_dtype=weight.dtype,
                            device=weight.device, parallel_mode=None)
            self._te_linear = lin
        # share (not copy) the layer's parameters; re-bound every call so .to() / loading stay in sync
        lin.weight = weight
        if bias is not None:
            lin.bias = bias
        return lin
